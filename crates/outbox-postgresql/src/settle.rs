//! Settling a claimed batch under its lease: ack (delivered, or deleted with
//! `delete_on_ack`), retry (back to pending after a delay), bury (dead) and release (back to
//! pending untouched). Each statement checks the lease token, so a relay whose lease expired
//! settles nothing.

use crate::PgStore;
use crate::error::map_sqlx;
use outbox_types::sql_store::{count, millis};
use outbox_types::{Lease, StoreError};
use sqlx::AssertSqlSafe;

outbox_types::impl_settle_by_statement! {
    store: PgStore,
    ack: |store, lease, seqs| {
        if store.delete_on_ack {
            let n: i64 = sqlx::query_scalar(AssertSqlSafe(store.sql().ack_delete.as_str()))
                .bind(seqs)
                .bind(lease.token)
                .fetch_one(&store.pool)
                .await
                .map_err(map_sqlx)?;
            return Ok(count(n));
        }
        settle(store, &store.sql().ack, seqs, lease).await
    },
    retry: |store, lease, events| {
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        let delays: Vec<i64> = events.iter().map(|e| millis(e.delay)).collect();
        let errors = truncated_errors(events.iter().map(|e| e.error.as_str()));
        let costs: Vec<i32> = events.iter().map(|e| i32::from(e.counts_attempt)).collect();
        let done = sqlx::query(AssertSqlSafe(store.sql().retry.as_str()))
            .bind(&seqs)
            .bind(&delays)
            .bind(&errors)
            .bind(lease.token)
            .bind(&costs)
            .execute(&store.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    },
    bury: |store, lease, events| {
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        let errors = truncated_errors(events.iter().map(|e| e.error.as_str()));
        let done = sqlx::query(AssertSqlSafe(store.sql().bury.as_str()))
            .bind(&seqs)
            .bind(&errors)
            .bind(lease.token)
            .execute(&store.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    },
    release: |store, lease, seqs| settle(store, &store.sql().release, seqs, lease).await,
}

/// Each error as stored: cut to the bound.
fn truncated_errors<'e>(errors: impl Iterator<Item = &'e str>) -> Vec<String> {
    errors.map(outbox_types::truncate_error).collect()
}

/// Runs one settle `statement` over `seqs` under the lease's token; the rows it changed.
async fn settle(
    store: &PgStore,
    statement: &str,
    seqs: &[i64],
    lease: &Lease,
) -> Result<u64, StoreError> {
    let done = sqlx::query(AssertSqlSafe(statement))
        .bind(seqs)
        .bind(lease.token)
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
