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
    if seqs.is_empty() {
        return Ok(0);
    }
    settle(store, &store.sql().ack, json_text(seqs)?, lease).await
}

pub(crate) async fn retry(
    store: &MySqlStore,
    lease: &Lease,
    events: &[RetryEvent],
) -> Result<u64, StoreError> {
    if events.is_empty() {
        return Ok(0);
    }
    let batch = retry_batch(events, "delay_us", micros)?;
    settle(store, &store.sql().retry, batch, lease).await
}

pub(crate) async fn bury(
    store: &MySqlStore,
    lease: &Lease,
    events: &[BuryEvent],
) -> Result<u64, StoreError> {
    if events.is_empty() {
        return Ok(0);
    }
    settle(store, &store.sql().bury, bury_batch(events)?, lease).await
}

pub(crate) async fn release(
    store: &MySqlStore,
    lease: &Lease,
    seqs: &[i64],
) -> Result<u64, StoreError> {
    if seqs.is_empty() {
        return Ok(0);
    }
    settle(store, &store.sql().release, json_text(seqs)?, lease).await
}

/// Runs one settle `statement` over `batch` (its JSON array) under the lease's token; the rows
/// it changed.
async fn settle(
    store: &MySqlStore,
    statement: &str,
    batch: String,
    lease: &Lease,
) -> Result<u64, StoreError> {
    let done = sqlx::query(AssertSqlSafe(statement))
        .bind(batch)
        .bind(lease.token.to_string())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
