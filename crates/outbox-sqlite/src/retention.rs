//! Purge: deleting delivered and dead events past their retention, a bounded batch at a
//! time.

use crate::SqliteStore;
use crate::error::map_sqlx;
use crate::time::now_micros;
use outbox_types::StoreError;
use outbox_types::sql_store::micros;
use sqlx::AssertSqlSafe;
use std::time::Duration;

pub(crate) async fn purge_delivered(
    store: &SqliteStore,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    purge(store, &store.sql().purge, older_than, limit).await
}

pub(crate) async fn purge_dead(
    store: &SqliteStore,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    purge(store, &store.sql().purge_dead, older_than, limit).await
}

/// Run one of the purge statements: `older_than` and `limit` are its parameters.
async fn purge(
    store: &SqliteStore,
    statement: &str,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    let _turn = store.writes.lock().await;
    let cutoff = now_micros().saturating_sub(micros(older_than));
    let done = sqlx::query(AssertSqlSafe(statement))
        .bind(cutoff)
        .bind(i64::from(limit))
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
