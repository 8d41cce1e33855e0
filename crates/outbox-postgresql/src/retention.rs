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
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(store.sql().purge.as_str()))
        .bind(millis(older_than))
        .bind(i64::from(limit))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(count(n))
}

pub(crate) async fn purge_dead(
    store: &PgStore,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(store.sql().purge_dead.as_str()))
        .bind(millis(older_than))
        .bind(i64::from(limit))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(count(n))
}
