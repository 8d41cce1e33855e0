//! Purge: deleting delivered and dead events past their retention, a bounded batch at a time.
//! (The partitioned layout drops whole partitions instead, see [`crate::partition`].)

use crate::PgStore;
use crate::error::map_sqlx;
use outbox_types::StoreError;
use outbox_types::sql_store::{count, millis};
use sqlx::AssertSqlSafe;
use std::time::Duration;

pub(crate) async fn purge_delivered(
    store: &PgStore,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    purge(store, &store.sql().purge, older_than, limit).await
}

pub(crate) async fn purge_dead(
    store: &PgStore,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    purge(store, &store.sql().purge_dead, older_than, limit).await
}

/// Run one of the purge statements: `older_than` and `limit` are its parameters.
async fn purge(
    store: &PgStore,
    statement: &str,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(statement))
        .bind(millis(older_than))
        .bind(i64::from(limit))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(count(n))
}
