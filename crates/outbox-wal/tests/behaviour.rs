//! The relay behaviour suite of `outbox-store-tests` — order per aggregate, retries, dead
//! letters under `block` and `skip`, several relays, shutdown, lanes and cooldown, a panicking
//! sink, `outbox pause`, requeue while running — run over WAL mode's stream source: the same
//! tests the polling relay passes over every store, on the logical-replication test cluster.
//!
//! The harness creates the slot before a test writes anything and starts its sources without
//! the catch-up, so the events a test writes come through the stream (and go to the table only
//! when the engine hands them there: a failure, a pause, a dead event under `block`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_engine::RelayConfig;
use outbox_postgresql::PgStore;
use outbox_store_tests::Harness;
use outbox_types::{EventId, NewEvent};
use outbox_wal::{Source, WalConfig, WalSource};

struct WalHarness;

/// The WAL settings of the outbox behind `store` (one slot per outbox, named after its schema).
fn wal_config(store: &PgStore) -> WalConfig {
    let name = store.outbox().schema().to_owned();
    WalConfig {
        schema: name.clone(),
        table: store.outbox().table().to_owned(),
        slot: name.clone(),
        publication: name.clone(),
        message_prefix: name,
        sources: vec![Source::Table],
        catch_up: false,
        status_interval: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(500),
        standby_poll_interval: Duration::from_millis(100),
        takeover_timeout: Duration::from_secs(15),
        max_reconnect_backoff: Duration::from_millis(500),
        ..WalConfig::new(common::cluster_url())
    }
}

#[async_trait]
impl Harness for WalHarness {
    type Store = PgStore;

    async fn fresh(&self) -> Arc<PgStore> {
        let fx = common::Fixture::new(&[Source::Table]).await;
        Arc::new(PgStore::new(fx.pool.clone(), fx.outbox.clone()))
    }

    async fn enqueue(&self, store: &PgStore, events: &[NewEvent]) -> Vec<(EventId, bool)> {
        outbox_sink_tests::enqueue_batch_committed(store, events)
            .await
            .into_iter()
            .map(|e| (e.id, e.created))
            .collect()
    }

    async fn backdate(&self, store: &PgStore, ids: &[EventId], by: Duration) {
        let ids: Vec<uuid::Uuid> = ids.iter().map(|id| *id.as_uuid()).collect();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET occurred_at = occurred_at - $2 * interval '1 millisecond',
                 enqueued_at = enqueued_at - $2 * interval '1 millisecond'
             WHERE id = ANY($1)",
            store.outbox().qualified_table()
        )))
        .bind(&ids)
        .bind(by.as_millis() as i64)
        .execute(store.pool())
        .await
        .unwrap();
    }

    async fn source(
        &self,
        store: &Arc<PgStore>,
        relay: &RelayConfig,
    ) -> Arc<dyn outbox_types::Source> {
        let store = PgStore::new(store.pool().clone(), store.outbox().clone());
        let config = wal_config(&store);
        Arc::new(
            WalSource::start(config, store, relay)
                .await
                .expect("the WAL source starts"),
        )
    }

    fn relays_share_work(&self) -> bool {
        false
    }
}

outbox_store_tests::relay_behaviour!(WalHarness);
