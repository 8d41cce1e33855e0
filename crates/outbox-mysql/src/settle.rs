//! Settling a claimed batch under its lease: ack, retry (back to pending after a delay), bury
//! (dead) and release (back to pending untouched), each batch one statement over a JSON array.
//! Each statement checks the lease token, so a relay whose lease expired settles nothing.

use crate::MySqlStore;
use crate::error::map_sqlx;
use crate::sql::{json_text, micros};
use outbox_types::sql_store::{bury_batch, retry_batch};
use outbox_types::{BuryEvent, Lease, RetryEvent, StoreError};
use sqlx::AssertSqlSafe;

pub(crate) async fn ack(
    store: &MySqlStore,
    lease: &Lease,
    seqs: &[i64],
) -> Result<u64, StoreError> {
    settle(store, &store.sql().ack, lease, seqs, json_text).await
}

pub(crate) async fn retry(
    store: &MySqlStore,
    lease: &Lease,
    events: &[RetryEvent],
) -> Result<u64, StoreError> {
    settle(store, &store.sql().retry, lease, events, |events| {
        retry_batch(events, "delay_us", micros)
    })
    .await
}

pub(crate) async fn bury(
    store: &MySqlStore,
    lease: &Lease,
    events: &[BuryEvent],
) -> Result<u64, StoreError> {
    settle(store, &store.sql().bury, lease, events, bury_batch).await
}

pub(crate) async fn release(
    store: &MySqlStore,
    lease: &Lease,
    seqs: &[i64],
) -> Result<u64, StoreError> {
    settle(store, &store.sql().release, lease, seqs, json_text).await
}

/// Runs one settle `statement` under the lease's token over `items`, as the JSON array `batch`
/// makes of them; the rows it changed. No items, no statement.
async fn settle<T>(
    store: &MySqlStore,
    statement: &str,
    lease: &Lease,
    items: &[T],
    batch: impl FnOnce(&[T]) -> Result<String, StoreError>,
) -> Result<u64, StoreError> {
    if items.is_empty() {
        return Ok(0);
    }
    let done = sqlx::query(AssertSqlSafe(statement))
        .bind(batch(items)?)
        .bind(lease.token.to_string())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
