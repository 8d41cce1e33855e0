//! How the suite gets at a store ([`Harness`]), and the claim requests and payload reading
//! every part of the suite shares.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_engine::RelayConfig;
use outbox_testkit::numbered;
use outbox_types::{
    BuryEvent, Claim, ClaimRequest, DeadLetterPolicy, Event, EventId, EventState, NewEvent,
    RetryEvent, Store,
};

/// How the suite gets at a store.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The store under test.
    type Store: Store;
    /// A new, migrated, empty outbox, isolated from every other test.
    async fn fresh(&self) -> Arc<Self::Store>;
    /// Enqueue `events` in one committed transaction through the store's enqueue API; returns
    /// `(id, created)` per event.
    async fn enqueue(&self, store: &Self::Store, events: &[NewEvent]) -> Vec<(EventId, bool)>;
    /// Move every time recorded for these events (`occurred_at`, `enqueued_at`, `claimed_at`,
    /// `delivered_at`, `dead_at`) `by` into the past, as if it all had happened that much
    /// earlier. Lease expiries and due times stay as they are. Lets the suite test retention and
    /// time ranges without waiting.
    async fn backdate(&self, store: &Self::Store, ids: &[EventId], by: Duration);

    /// The source a relay under test claims from, for the relay settings `relay`: the store
    /// itself (table claims) unless the harness tests another source over it — the WAL harness
    /// starts a stream source, so the relay behaviour tests run over both sources.
    async fn source(
        &self,
        store: &Arc<Self::Store>,
        relay: &RelayConfig,
    ) -> Arc<dyn outbox_types::Source> {
        let _ = relay;
        store.clone()
    }

    /// Whether several relays over the same outbox all deliver (table claims), or one does while
    /// the others stand by (one replication slot, one streamer).
    fn relays_share_work(&self) -> bool {
        true
    }

    /// Whether the store's claims skip a deferred destination (`Hold::deferred`, the relay's
    /// fair turns) or claim it as usual (SQLite).
    fn defers(&self) -> bool {
        true
    }
}

/// A claim of up to `limit` events by `test-relay` on a lease of a minute, under the block
/// policy: the request the suite and the stores' own tests make when nothing else about it
/// matters to the test.
pub fn claim_up_to(limit: u32) -> ClaimRequest {
    ClaimRequest::new(
        "test-relay",
        limit,
        Duration::from_secs(60),
        DeadLetterPolicy::Block,
    )
}

pub(crate) fn payload_n(e: &outbox_types::Event) -> u64 {
    let value: serde_json::Value = serde_json::from_str(&e.payload).unwrap_or_default();
    value["n"].as_u64().unwrap_or(u64::MAX)
}

/// A failed delivery of `seq` that counts an attempt and makes it wait `delay`.
pub(crate) fn counted_retry(seq: i64, delay: Duration, error: impl Into<String>) -> RetryEvent {
    RetryEvent {
        counts_attempt: true,
        seq,
        delay,
        error: error.into(),
    }
}

/// A retry of `seq` because its destination was unavailable: no attempt counted.
pub(crate) fn unavailable_retry(seq: i64, delay: Duration, error: impl Into<String>) -> RetryEvent {
    RetryEvent {
        counts_attempt: false,
        ..counted_retry(seq, delay, error)
    }
}

/// `seq` given up on with `error`.
pub(crate) fn buried(seq: i64, error: impl Into<String>) -> BuryEvent {
    BuryEvent {
        seq,
        error: error.into(),
    }
}

/// Claim as `owner`, up to `limit` events on leases of `lease`, and ack each claim until nothing
/// is pending or in flight: an empty claim waits `pause` and looks at the counts, since others
/// may still hold events whose successors become due after their ack. `on_claim` sees each
/// claim's events before they are acked; every ack must settle them all (a live lease is never
/// fenced). One worker of a concurrent claiming test.
pub async fn claim_and_ack_until_drained<S: Store + ?Sized>(
    store: &S,
    owner: &str,
    limit: u32,
    lease: Duration,
    pause: Duration,
    mut on_claim: impl FnMut(&[Event]),
) {
    loop {
        let claim = store
            .claim(&ClaimRequest::new(
                owner,
                limit,
                lease,
                DeadLetterPolicy::Block,
            ))
            .await
            .unwrap();
        if claim.events.is_empty() {
            tokio::time::sleep(pause).await;
            let stats = store.stats().await.unwrap();
            if stats.pending == 0 && stats.in_flight == 0 {
                return;
            }
            continue;
        }
        on_claim(&claim.events);
        let seqs = seqs_of(&claim.events);
        let acked = store.ack(&claim.lease, &seqs).await.unwrap();
        assert_eq!(acked as usize, seqs.len(), "a live lease is never fenced");
    }
}

/// [`claim_up_to`] by relay `owner`, for the scenarios where several relays claim.
pub fn claim_as(owner: &str, limit: u32) -> ClaimRequest {
    ClaimRequest {
        owner: owner.to_owned(),
        ..claim_up_to(limit)
    }
}

/// Whether a claim now finds nothing to hand out (and claims nothing, then).
pub async fn claims_nothing<S: Store + ?Sized>(store: &S) -> bool {
    store
        .claim(&claim_up_to(10))
        .await
        .unwrap()
        .events
        .is_empty()
}

/// The seqs of `events`, in their order: what a settle call takes.
pub fn seqs_of(events: &[Event]) -> Vec<i64> {
    events.iter().map(|e| e.seq).collect()
}

/// The seqs of `events` but `left_out`, in their order: the rest of a claim, settled one way
/// while the event left out is settled another.
pub fn seqs_except(events: &[Event], left_out: i64) -> Vec<i64> {
    events
        .iter()
        .map(|e| e.seq)
        .filter(|seq| *seq != left_out)
        .collect()
}

/// The state of event `id`, which must exist.
pub async fn state_of<S: Store + ?Sized>(store: &S, id: EventId) -> EventState {
    store
        .get(id)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("event {id} is not in the outbox"))
        .state
}

/// The ids of what [`Harness::enqueue`] returned, dropping the `created` flags.
pub(crate) fn ids_of(enqueued: Vec<(EventId, bool)>) -> Vec<EventId> {
    enqueued.into_iter().map(|(id, _)| id).collect()
}

/// [`numbered`] events, one per `(aggregate_id, n)`, in that order.
pub(crate) fn numbered_all(events: &[(&str, u64)]) -> Vec<NewEvent> {
    events.iter().map(|(a, n)| numbered(a, *n)).collect()
}

/// A fresh store holding aggregate `a`'s events 1 and 2 and aggregate `b`'s event 1, with a/1
/// claimed alone: the start of the scenarios about what waits behind a/1.
pub(crate) async fn a1_claimed<H: Harness>(h: &H) -> (Arc<H::Store>, Claim) {
    let store = h.fresh().await;
    h.enqueue(&store, &numbered_all(&[("a", 1), ("a", 2), ("b", 1)]))
        .await;
    let claim = store.claim(&claim_up_to(1)).await.unwrap();
    (store, claim)
}

/// `(aggregate_id, n)` of each of `events`, in their order.
pub(crate) fn labels(events: &[Event]) -> Vec<(&str, u64)> {
    events
        .iter()
        .map(|e| (e.aggregate_id.as_str(), payload_n(e)))
        .collect()
}

/// The aggregate id of each of `events`, in their order.
pub(crate) fn aggregate_ids(events: &[Event]) -> Vec<&str> {
    events.iter().map(|e| e.aggregate_id.as_str()).collect()
}

/// A fresh store holding `events`, enqueued in one transaction, and what the enqueue returned.
pub(crate) async fn fresh_holding<H: Harness>(
    h: &H,
    events: &[NewEvent],
) -> (Arc<H::Store>, Vec<(EventId, bool)>) {
    let store = h.fresh().await;
    let enqueued = h.enqueue(&store, events).await;
    (store, enqueued)
}
