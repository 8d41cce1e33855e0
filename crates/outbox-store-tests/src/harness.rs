//! How the suite gets at a store ([`Harness`]), and the claim requests and payload reading
//! every part of the suite shares.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_engine::RelayConfig;
use outbox_types::{ClaimRequest, DeadLetterPolicy, EventId, NewEvent, Store};

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

pub(crate) fn req(limit: u32) -> ClaimRequest {
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
