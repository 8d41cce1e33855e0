//! Purge: deleting delivered and dead events past their retention, a bounded batch at a
//! time.

use crate::MySqlStore;
use crate::error::map_sqlx;
use crate::sql::micros;
use sqlx::AssertSqlSafe;

outbox_types::impl_purge_by_statement!(MySqlStore, |store, statement, older_than, limit| {
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
});
