//! Settling a claimed batch under its lease: ack, retry (back to pending after a delay), bury
//! (dead) and release (back to pending untouched), each batch one statement over a JSON array.
//! Each statement checks the lease token, so a relay whose lease expired settles nothing.

use crate::MySqlStore;
use crate::error::map_sqlx;
use crate::sql::{json_text, micros};
use outbox_types::sql_store::{bury_batch, retry_batch};
use outbox_types::{Lease, StoreError};
use sqlx::AssertSqlSafe;

outbox_types::impl_settle_by_statement! {
    store: MySqlStore,
    ack: |store, lease, seqs| settle(store, &store.sql().ack, lease, seqs, json_text).await,
    retry: |store, lease, events| {
        settle(store, &store.sql().retry, lease, events, |events| {
            retry_batch(events, "delay_us", micros)
        })
        .await
    },
    bury: |store, lease, events| settle(store, &store.sql().bury, lease, events, bury_batch).await,
    release: |store, lease, seqs| {
        settle(store, &store.sql().release, lease, seqs, json_text).await
    },
}

/// Runs one settle `statement` under the lease's token over `items` (some: the callers run
/// nothing for none), as the JSON array `batch` makes of them; the rows it changed.
async fn settle<T>(
    store: &MySqlStore,
    statement: &str,
    lease: &Lease,
    items: &[T],
    batch: impl FnOnce(&[T]) -> Result<String, StoreError>,
) -> Result<u64, StoreError> {
    let done = sqlx::query(AssertSqlSafe(statement))
        .bind(batch(items)?)
        .bind(lease.token.to_string())
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}
