//! What every sink crate's integration tests share, so a new sink's tests start from the same
//! pieces: a fresh outbox in its own PostgreSQL schema, transactional enqueue (committed or
//! rolled back), names no other test uses, waiting for the store, an event as a relay hands it
//! to a sink, and the per-aggregate order check.
//!
//! A sink's `tests/common/mod.rs` re-exports this crate and adds what is broker-specific (a
//! consumer, a topic or queue of the test's own); a sink with nothing broker-specific uses the
//! crate directly (`use outbox_sink_tests as common;`).

pub use outbox_testkit::unique;
use std::time::Duration;

use outbox_postgresql::{PgOutbox, PgStore};
use outbox_types::{EventId, EventRecord, NewEvent, OutboxStats, Store};
use sqlx::postgres::PgPoolOptions;

/// `OUTBOX_TEST_DATABASE_URL`, or the machine's local PostgreSQL `test` database.
pub fn database_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A fresh migrated outbox in its own schema (`outbox_t_…`, which `scripts/test.sh` drops before
/// each run).
pub async fn fresh_store() -> PgStore {
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&database_url())
        .await
        .expect("PostgreSQL must be running on 127.0.0.1:5432");
    let outbox = PgOutbox::with_names(&unique("outbox_t_sink"), "events").unwrap();
    outbox.migrate(&pool).await.unwrap();
    PgStore::new(pool, outbox)
}

/// Enqueue `events` in one transaction that commits.
pub async fn enqueue_committed(store: &PgStore, events: &[NewEvent]) -> Vec<EventId> {
    let mut tx = store.pool().begin().await.unwrap();
    let done = store
        .outbox()
        .enqueue_batch(&mut *tx, events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    done.into_iter().map(|e| e.id).collect()
}

/// Enqueue `events` in one transaction that rolls back: none of them may ever be published.
pub async fn enqueue_rolled_back(store: &PgStore, events: &[NewEvent]) {
    let mut tx = store.pool().begin().await.unwrap();
    store
        .outbox()
        .enqueue_batch(&mut *tx, events)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
}

/// Poll `stats` until `done` holds, or fail after `limit`.
pub async fn wait_for_stats(
    store: &PgStore,
    limit: Duration,
    what: &str,
    done: impl Fn(&OutboxStats) -> bool,
) -> OutboxStats {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let stats = store.stats().await.unwrap();
        if done(&stats) {
            return stats;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Poll the record of `id` until `done` holds, or fail after `limit`.
pub async fn wait_for_record(
    store: &PgStore,
    id: EventId,
    limit: Duration,
    what: &str,
    done: impl Fn(&EventRecord) -> bool,
) -> EventRecord {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let record = store.get(id).await.unwrap().expect("event exists");
        if done(&record) {
            return record;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An event as a relay would hand it to a sink, for tests that call `publish` directly.
pub fn event(aggregate_id: &str, n: u64) -> outbox_types::Event {
    outbox_types::Event {
        seq: n as i64,
        id: EventId::new(),
        aggregate_type: "agg".into(),
        aggregate_id: aggregate_id.into(),
        event_type: "Numbered".into(),
        payload: serde_json::json!({ "aggregate": aggregate_id, "n": n }).to_string(),
        destination: None,
        headers: Default::default(),
        idempotency_key: None,
        occurred_at: chrono::Utc::now(),
        enqueued_at: chrono::Utc::now(),
        attempts: 0,
    }
}

/// Which aggregates' payload sequence numbers are not increasing in `delivered` (aggregate, n).
pub fn order_violations(delivered: &[(String, u64)]) -> Vec<String> {
    let mut last: std::collections::HashMap<&str, u64> = Default::default();
    let mut bad = Vec::new();
    for (aggregate, n) in delivered {
        if let Some(prev) = last.get(aggregate.as_str())
            && n <= prev
        {
            bad.push(format!("{aggregate}: {n} after {prev}"));
        }
        last.insert(aggregate, *n);
    }
    bad
}
