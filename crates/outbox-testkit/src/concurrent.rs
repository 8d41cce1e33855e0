//! Racing copies of one task, as tests of "safe to race" (several migrations at once, several
//! writers) start them: each on its own runtime task, so they really overlap, and every
//! output collected, so the test can check what each racer did.

use std::future::Future;

/// Start `n` copies of the task `make` builds (given each copy's index, 0 to `n - 1`), all at
/// once on the runtime, and wait for them; their outputs in start order. A panicking copy
/// panics the caller.
pub async fn race<T, Fut>(n: usize, mut make: impl FnMut(usize) -> Fut) -> Vec<T>
where
    T: Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let tasks: Vec<_> = (0..n).map(|i| tokio::spawn(make(i))).collect();
    let mut outputs = Vec::with_capacity(n);
    for task in tasks {
        outputs.push(
            task.await
                .unwrap_or_else(|e| panic!("a racing task failed: {e}")),
        );
    }
    outputs
}
