//! Settling a claimed batch under its lease: ack, retry (back to pending after a delay), bury
//! (dead) and release (back to pending untouched). Each statement checks the lease token, so a
//! relay whose lease expired settles nothing.

use crate::SqliteStore;
use crate::error::map_sqlx;
use crate::time::{Stamp, after, now_micros};
use outbox_types::sql_store::{bury_batch, json_text, retry_batch};
use outbox_types::{BuryEvent, Lease, RetryEvent, StoreError};
use sqlx::AssertSqlSafe;

outbox_types::impl_settle_by_statement! {
    store: SqliteStore,
    ack: |store, lease, seqs| {
        settle(store, &store.sql().ack, lease, Stamp::Now, seqs, seq_list).await
    },
    retry: |store, lease, events| {
        settle(store, &store.sql().retry, lease, Stamp::None, events, retry_list).await
    },
    bury: |store, lease, events| {
        settle(store, &store.sql().bury, lease, Stamp::Now, events, bury_list).await
    },
    release: |store, lease, seqs| {
        settle(store, &store.sql().release, lease, Stamp::None, seqs, seq_list).await
    },
}

fn seq_list(seqs: &[i64], _now: i64) -> Result<String, StoreError> {
    json_text(seqs)
}

/// Retries with their due times (`now` plus each delay).
fn retry_list(events: &[RetryEvent], now: i64) -> Result<String, StoreError> {
    retry_batch(events, "due", |delay| after(now, delay))
}

fn bury_list(events: &[BuryEvent], _now: i64) -> Result<String, StoreError> {
    bury_batch(events)
}

/// Runs one settle `statement` over `items` (some: the callers run nothing for none) under the
/// write turn. Its parameters are the JSON array `batch` makes of the items and the current time
/// (read under the turn, as retry's due times need), the lease's token and, with
/// [`Stamp::Now`], that time. The rows it changed.
async fn settle<T>(
    store: &SqliteStore,
    statement: &str,
    lease: &Lease,
    stamp: Stamp,
    items: &[T],
    batch: impl FnOnce(&[T], i64) -> Result<String, StoreError>,
) -> Result<u64, StoreError> {
    let _turn = store.writes.lock().await;
    let now = now_micros();
    let mut query = sqlx::query(AssertSqlSafe(statement))
        .bind(batch(items, now)?)
        .bind(lease.token.to_string());
    if stamp == Stamp::Now {
        query = query.bind(now);
    }
    let done = query.execute(&store.pool).await.map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
