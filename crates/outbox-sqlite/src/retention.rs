//! Purge: deleting delivered and dead events past their retention, a bounded batch at a
//! time.

use crate::SqliteStore;
use crate::error::map_sqlx;
use crate::time::now_micros;
use outbox_types::sql_store::micros;
use sqlx::AssertSqlSafe;

outbox_types::impl_purge_by_statement!(SqliteStore, |store, statement, older_than, limit| {
    let _turn = store.writes.lock().await;
    let cutoff = now_micros().saturating_sub(micros(older_than));
    let done = sqlx::query(AssertSqlSafe(statement))
        .bind(cutoff)
        .bind(i64::from(limit))
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
});
