//! Purge: deleting delivered and dead events past their retention, a bounded batch at a time.
//! (The partitioned layout drops whole partitions instead, see [`crate::partition`].)

use crate::PgStore;
use crate::error::map_sqlx;
use outbox_types::sql_store::{count, millis};
use sqlx::AssertSqlSafe;

outbox_types::impl_purge_by_statement!(PgStore, |store, statement, older_than, limit| {
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(statement))
        .bind(millis(older_than))
        .bind(i64::from(limit))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(count(n))
});
