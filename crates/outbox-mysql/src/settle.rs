//! Settling a claimed batch under its lease: ack, retry (back to pending after a delay), bury
//! (dead) and release (back to pending untouched), each batch one statement over a JSON array.
//! Each statement checks the lease token, so a relay whose lease expired settles nothing.

use crate::MySqlStore;
use crate::error::map_sqlx;
use crate::sql::{json_text, micros};
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
    let done = sqlx::query(AssertSqlSafe(store.sql().ack.as_str()))
        .bind(json_text(seqs)?)
        .bind(lease.token.to_string())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}

pub(crate) async fn retry(
    store: &MySqlStore,
    lease: &Lease,
    events: &[RetryEvent],
) -> Result<u64, StoreError> {
    if events.is_empty() {
        return Ok(0);
    }
    let batch: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            serde_json::json!({
                "seq": e.seq,
                "delay_us": micros(e.delay),
                "error": outbox_types::truncate_error(&e.error),
                "cost": i32::from(e.counts_attempt),
            })
        })
        .collect();
    let done = sqlx::query(AssertSqlSafe(store.sql().retry.as_str()))
        .bind(json_text(&batch)?)
        .bind(lease.token.to_string())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}

pub(crate) async fn bury(
    store: &MySqlStore,
    lease: &Lease,
    events: &[BuryEvent],
) -> Result<u64, StoreError> {
    if events.is_empty() {
        return Ok(0);
    }
    let batch: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            serde_json::json!({
                "seq": e.seq,
                "error": outbox_types::truncate_error(&e.error),
            })
        })
        .collect();
    let done = sqlx::query(AssertSqlSafe(store.sql().bury.as_str()))
        .bind(json_text(&batch)?)
        .bind(lease.token.to_string())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}

pub(crate) async fn release(
    store: &MySqlStore,
    lease: &Lease,
    seqs: &[i64],
) -> Result<u64, StoreError> {
    if seqs.is_empty() {
        return Ok(0);
    }
    let done = sqlx::query(AssertSqlSafe(store.sql().release.as_str()))
        .bind(json_text(seqs)?)
        .bind(lease.token.to_string())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
