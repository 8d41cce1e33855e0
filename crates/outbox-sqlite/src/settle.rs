//! Settling a claimed batch under its lease: ack, retry (back to pending after a delay), bury
//! (dead) and release (back to pending untouched). Each statement checks the lease token, so a
//! relay whose lease expired settles nothing.

use crate::SqliteStore;
use crate::error::map_sqlx;
use crate::time::{Stamp, after, now_micros};
use outbox_types::sql_store::{bury_batch, json_text, retry_batch};
use outbox_types::{BuryEvent, Lease, RetryEvent, StoreError};
use sqlx::AssertSqlSafe;

pub(crate) async fn ack(
    store: &SqliteStore,
    lease: &Lease,
    seqs: &[i64],
) -> Result<u64, StoreError> {
    if seqs.is_empty() {
        return Ok(0);
    }
    let seqs = json_text(seqs)?;
    settle(store, &store.sql().ack, lease, Stamp::Now, |_| Ok(seqs)).await
}

pub(crate) async fn retry(
    store: &SqliteStore,
    lease: &Lease,
    events: &[RetryEvent],
) -> Result<u64, StoreError> {
    if events.is_empty() {
        return Ok(0);
    }
    settle(store, &store.sql().retry, lease, Stamp::None, |now| {
        retry_batch(events, "due", |delay| after(now, delay))
    })
    .await
}

pub(crate) async fn bury(
    store: &SqliteStore,
    lease: &Lease,
    events: &[BuryEvent],
) -> Result<u64, StoreError> {
    if events.is_empty() {
        return Ok(0);
    }
    let batch = bury_batch(events)?;
    settle(store, &store.sql().bury, lease, Stamp::Now, |_| Ok(batch)).await
}

pub(crate) async fn release(
    store: &SqliteStore,
    lease: &Lease,
    seqs: &[i64],
) -> Result<u64, StoreError> {
    if seqs.is_empty() {
        return Ok(0);
    }
    let seqs = json_text(seqs)?;
    settle(store, &store.sql().release, lease, Stamp::None, |_| {
        Ok(seqs)
    })
    .await
}

/// Runs one settle `statement` under the write turn: its parameters are the batch's JSON array
/// (`batch` builds it from the current time, read under the turn, as retry's due times need),
/// the lease's token and, with [`Stamp::Now`], that time. The rows it changed.
async fn settle(
    store: &SqliteStore,
    statement: &str,
    lease: &Lease,
    stamp: Stamp,
    batch: impl FnOnce(i64) -> Result<String, StoreError>,
) -> Result<u64, StoreError> {
    let _turn = store.writes.lock().await;
    let now = now_micros();
    let mut query = sqlx::query(AssertSqlSafe(statement))
        .bind(batch(now)?)
        .bind(lease.token.to_string());
    if stamp == Stamp::Now {
        query = query.bind(now);
    }
    let done = query.execute(&store.pool).await.map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
