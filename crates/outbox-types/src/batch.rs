//! [`in_batches`]: delete a batch at a time until one comes back short.
//!
//! Why here: purging is one bounded `DELETE` repeated, so no statement holds locks on a large
//! table for long. The loop around it — at least one row per batch, report each batch, stop at
//! the first short one, add up — is the same for the stores' purges behind `outbox purge` and
//! for the inboxes' purges; it lives here once, without I/O, generic over the caller's error.

use std::future::Future;

/// Run `delete_batch(batch)` (one statement deleting at most `batch` rows; `0` counts as `1`)
/// until it deletes fewer than `batch`, calling `progress` with each batch's count; the total
/// deleted. The first error stops the loop and is returned.
///
/// ```
/// # use std::future::Future;
/// # fn block_on<F: Future>(f: F) -> F::Output {
/// #     let mut f = std::pin::pin!(f);
/// #     let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
/// #     loop { if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; } }
/// # }
/// use outbox_types::batch::in_batches;
///
/// let mut left = 25u64;
/// let mut seen = Vec::new();
/// let total = block_on(in_batches(10, |n| seen.push(n), |batch| {
///     let n = left.min(u64::from(batch));
///     left -= n;
///     async move { Ok::<_, std::convert::Infallible>(n) }
/// }));
/// assert_eq!(total, Ok(25));
/// assert_eq!(seen, [10, 10, 5]);
/// ```
pub async fn in_batches<E, F, Fut>(
    batch: u32,
    mut progress: impl FnMut(u64),
    mut delete_batch: F,
) -> Result<u64, E>
where
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Result<u64, E>>,
{
    let batch = batch.max(1);
    let mut total = 0u64;
    loop {
        let n = delete_batch(batch).await?;
        total += n;
        progress(n);
        if n < u64::from(batch) {
            return Ok(total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    fn block_on<F: Future>(f: F) -> F::Output {
        let mut f = pin!(f);
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
        }
    }

    #[test]
    fn a_zero_batch_counts_as_one_and_an_error_stops() {
        let mut calls = Vec::new();
        let total = block_on(in_batches(
            0,
            |_| {},
            |batch| {
                calls.push(batch);
                let n = if calls.len() < 3 { 1 } else { 0 };
                async move { Ok::<_, ()>(n) }
            },
        ));
        assert_eq!(total, Ok(2));
        assert_eq!(calls, [1, 1, 1]);

        let mut progress = 0;
        let failed = block_on(in_batches(
            5,
            |_| progress += 1,
            |_| async { Err::<u64, _>("boom") },
        ));
        assert_eq!(failed, Err("boom"));
        assert_eq!(progress, 0);
    }
}
