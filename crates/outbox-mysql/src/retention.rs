//! Purge: deleting delivered and dead events past their retention, a bounded batch at a
//! time.

use crate::MySqlStore;
use crate::error::map_sqlx;
use crate::sql::micros;
use outbox_types::StoreError;
use sqlx::AssertSqlSafe;
use std::time::Duration;

pub(crate) async fn purge_delivered(
    store: &MySqlStore,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    purge(store, &store.sql().purge, older_than, limit).await
}

pub(crate) async fn purge_dead(
    store: &MySqlStore,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    purge(store, &store.sql().purge_dead, older_than, limit).await
}

/// Run one of the purge statements: `older_than` and `limit` are its parameters.
async fn purge(
    store: &MySqlStore,
    statement: &str,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    if limit == 0 {
        return Ok(0);
    }
    let done = sqlx::query(AssertSqlSafe(statement))
        .bind(micros(older_than))
        .bind(i64::from(limit))
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
