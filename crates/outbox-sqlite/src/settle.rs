//! Settling a claimed batch under its lease: ack, retry (back to pending after a delay), bury
//! (dead) and release (back to pending untouched). Each statement checks the lease token, so a
//! relay whose lease expired settles nothing.

use crate::SqliteStore;
use crate::error::map_sqlx;
use crate::time::{after, now_micros};
use outbox_types::sql_store::json_text;
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
    let _turn = store.writes.lock().await;
    let done = sqlx::query(AssertSqlSafe(store.sql().ack.as_str()))
        .bind(seqs)
        .bind(lease.token.to_string())
        .bind(now_micros())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}

pub(crate) async fn retry(
    store: &SqliteStore,
    lease: &Lease,
    events: &[RetryEvent],
) -> Result<u64, StoreError> {
    if events.is_empty() {
        return Ok(0);
    }
    let _turn = store.writes.lock().await;
    let now = now_micros();
    let batch: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            serde_json::json!({
                "seq": e.seq,
                "due": after(now, e.delay),
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
    store: &SqliteStore,
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
    let batch = json_text(&batch)?;
    let _turn = store.writes.lock().await;
    let done = sqlx::query(AssertSqlSafe(store.sql().bury.as_str()))
        .bind(batch)
        .bind(lease.token.to_string())
        .bind(now_micros())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
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
    let _turn = store.writes.lock().await;
    let done = sqlx::query(AssertSqlSafe(store.sql().release.as_str()))
        .bind(seqs)
        .bind(lease.token.to_string())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
