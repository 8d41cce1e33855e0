//! Where the engine gets its events: the one small contract behind both relay modes.
//!
//! The relay engine (`outbox-engine`) claims a batch, publishes it and writes back what became
//! of each event. It does not care whether the batch came from the outbox table or from the
//! database's write-ahead log:
//!
//! - **Table claims** (polling mode): every [`Store`] is a source. A claim marks rows
//!   `in_flight` under a lease with a fencing token; ack, retry, bury and release only touch rows
//!   still carrying that token.
//! - **The replication stream** (WAL mode, `outbox-wal`): a claim hands out events decoded from
//!   the stream (no row is written to claim them); ack marks table rows delivered and lets the
//!   stream confirm its position past them; retry, release and bury hand the events to the
//!   table, where table claims take them up again in order. Everything the engine does —
//!   batching, per-aggregate order, lanes and cooldown, retries and backoff, dead letters,
//!   pauses, metrics, shutdown — is then the same in both modes.
//!
//! # Contract
//! Everything in [`Store`]'s claim contract holds for a source: a claim never hands out an
//! event while an earlier event of its aggregate is still out (claimed and not settled),
//! waiting for a retry, or dead under [`DeadLetterPolicy::Block`](crate::DeadLetterPolicy);
//! events of one aggregate in one claim come in order; every write after a claim names the
//! claim's [`Lease`] and returns how many events it settled.

use async_trait::async_trait;

use crate::error::StoreError;
use crate::store::{BuryEvent, Claim, ClaimRequest, Lease, PausedDestination, RetryEvent, Store};

/// Where the relay engine gets events from, and where it records what became of them. See the
/// module docs; every [`Store`] is one.
#[async_trait]
pub trait Source: Send + Sync + 'static {
    /// Claim up to `request.limit` events (see [`Store::claim`]).
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError>;

    /// The events were delivered.
    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError>;

    /// The events failed and are to be tried again after their delay.
    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError>;

    /// The events are dead.
    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError>;

    /// The events were not published (held behind a failure of their aggregate, or the relay
    /// is stopping): give them back with no attempt counted.
    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError>;

    /// The destinations an operator paused (see [`Store::paused`]).
    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError>;

    /// Resolves when a claim may find work before the relay's next poll: a stream source
    /// with events decoded and waiting. Table claims have no such signal (the default never
    /// resolves), so the relay polls them every poll interval.
    async fn work_ready(&self) {
        std::future::pending::<()>().await
    }

    /// The relay stopped: settle what is left and let go of what the source holds (a stream
    /// source writes back and confirms its position, and stops streaming). Table claims hold
    /// nothing: the default does nothing.
    async fn close(&self) {}

    /// Whether a claim that found nothing means there is nothing left to do, for a relay that
    /// stops once idle (`--drain`). Table claims: always. A stream source draining says so once
    /// its stream reached the position it was asked to catch up to.
    fn exhausted(&self) -> bool {
        true
    }

    /// A short name for messages (`postgres`, `wal`, …).
    fn kind(&self) -> &'static str;
}

#[async_trait]
impl<T: Store + ?Sized> Source for T {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        Store::claim(self, request).await
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        Store::ack(self, lease, seqs).await
    }

    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError> {
        Store::retry(self, lease, events).await
    }

    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError> {
        Store::bury(self, lease, events).await
    }

    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        Store::release(self, lease, seqs).await
    }

    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError> {
        Store::paused(self).await
    }

    fn kind(&self) -> &'static str {
        Store::kind(self)
    }
}
