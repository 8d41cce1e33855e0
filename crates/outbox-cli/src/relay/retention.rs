//! The relay's retention schedule: a task the relay spawns beside the engine and aborts when
//! the engine has stopped.
//!
//! Why its own module: retention is not delivery. Every `interval` it purges delivered events
//! (or rotates partitions, in the partitioned layout), old rows of WAL mode's stream table and,
//! when configured, old dead events; a failed run is logged and tried again at the next
//! interval, so a database outage never ends the relay.

use std::sync::Arc;
use std::time::Duration;

use crate::admin::{self, Purgeable};
use crate::config;

/// What the retention task works on.
pub(super) struct Retention {
    pub(super) store: Arc<dyn outbox_types::Store>,
    pub(super) partitioned: Option<outbox_postgresql::PgStore>,
    pub(super) stream_table: Option<(outbox_wal::WalConfig, sqlx::PgPool)>,
    pub(super) config: config::RetentionConfig,
}

/// Purge every `interval` until the task is aborted.
pub(super) async fn retention_loop(retention: Retention) {
    let mut ticker = tokio::time::interval(retention.config.interval.max(Duration::from_secs(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match &retention.partitioned {
            Some(pg) => rotate_partitions(pg).await,
            None => purge(&retention, Purgeable::Delivered, retention.config.delivered).await,
        }
        if let Some((wal, pool)) = &retention.stream_table {
            purge_stream_table(&retention.config, wal, pool).await;
        }
        if let Some(age) = retention.config.dead {
            purge(&retention, Purgeable::Dead, age).await;
        }
    }
}

async fn rotate_partitions(pg: &outbox_postgresql::PgStore) {
    match pg
        .outbox()
        .maintain_partitions(pg.pool(), chrono::Utc::now())
        .await
    {
        Ok(report) => {
            if !report.created.is_empty() || !report.dropped.is_empty() {
                tracing::info!(
                    created = ?report.created,
                    dropped = ?report.dropped,
                    kept = report.kept.len(),
                    "Partition rotation."
                );
            }
        }
        Err(error) => {
            tracing::warn!(%error, "Partition rotation failed; will try again at the next interval.")
        }
    }
}

async fn purge_stream_table(
    config: &config::RetentionConfig,
    wal: &outbox_wal::WalConfig,
    pool: &sqlx::PgPool,
) {
    match outbox_wal::purge_stream_table(wal, pool, config.delivered, config.batch_size).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            deleted = n,
            "Retention deleted old rows of the stream table."
        ),
        Err(error) => {
            tracing::warn!(%error, "Stream table retention failed; will try again at the next interval.")
        }
    }
}

/// One retention run over `which` events older than `age`: what it deleted is logged, and a
/// failure is a warning (the next interval tries again), never the relay's end.
async fn purge(retention: &Retention, which: Purgeable, age: Duration) {
    let purged = admin::purge_in_batches(
        retention.store.as_ref(),
        which,
        age,
        retention.config.batch_size,
        |_| {},
    )
    .await;
    match (purged, which) {
        (Ok(0), _) => {}
        (Ok(n), Purgeable::Delivered) => {
            tracing::info!(deleted = n, "Retention deleted delivered events.")
        }
        (Ok(n), Purgeable::Dead) => {
            tracing::info!(deleted = n, "Retention deleted old dead events.")
        }
        (Err(error), Purgeable::Delivered) => {
            tracing::warn!(error = %format!("{error:#}"), "Retention run failed; will try again at the next interval.")
        }
        (Err(error), Purgeable::Dead) => {
            tracing::warn!(error = %format!("{error:#}"), "Dead-event retention failed; will try again at the next interval.")
        }
    }
}
