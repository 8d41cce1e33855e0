//! Writing events into the stream table (`<table>_stream`, [`Source::StreamTable`]).
//!
//! The outbox table keeps each event's delivery state in its row, which costs every event three
//! extra index entries at insert (`_open`, `_heads`, the unique `id`) and a row update when it is
//! delivered: what lets the polling relay claim from it. WAL mode reads events from the log and
//! needs none of that for the events it delivers as they stream by, so the stream table has the
//! event columns and a primary key only, and nothing is written back: the slot's confirmed
//! position records what was delivered, as for logical messages. An event that fails, waits
//! behind a failed one or is dead is handed to the outbox table as a row of its own (where
//! retries, `outbox dead …` and `outbox status` find it), exactly like a message. Measured with
//! `outbox-bench writer-cost` and `wal_bench` (see the crate docs).
//!
//! [`Source::StreamTable`]: crate::Source::StreamTable

use outbox_postgresql::PgOutbox;
use outbox_types::{EventId, NewEvent};
use sqlx::PgExecutor;

use crate::error::{WalError, map_sqlx};

/// Write `event` into `outbox`'s stream table (`"<schema>"."<table>_stream"`, created by
/// [`prepare`](crate::prepare) or the relay's start when `sources` has `stream_table`), inside
/// the caller's transaction: it commits or rolls back with the business change. Returns the
/// event's id.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = outbox_postgresql::PgOutbox::new();
/// let mut tx = pool.begin().await?;
/// // … the business change …
/// let event = outbox_types::NewEvent::new("order", "42", "OrderCreated", &serde_json::json!({"amount": 1999}))?;
/// outbox_wal::enqueue_streamed(&mut *tx, &outbox, &event).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
///
/// From any language it is one `INSERT` (`id`, `headers`, `occurred_at` and `enqueued_at` have
/// defaults):
///
/// ```sql
/// INSERT INTO outbox_events_stream (aggregate_type, aggregate_id, event_type, payload)
/// VALUES ('order', '42', 'OrderCreated', '{"amount": 1999}');
/// ```
///
/// The stream table has no idempotency key (a unique index on it would cost every insert what
/// the stream table saves); use `PgOutbox::enqueue` for events that need one.
pub async fn enqueue_streamed<'e, E: PgExecutor<'e>>(
    executor: E,
    outbox: &PgOutbox,
    event: &NewEvent,
) -> Result<EventId, WalError> {
    // The stream table refuses these names itself (and so does the outbox table, which takes
    // the events that fail); refused here first, naming the header.
    event.check_headers()?;
    if event.idempotency_key().is_some() {
        return Err(WalError::Config(
            "the stream table has no idempotency key: enqueue events that carry one with PgOutbox::enqueue (the outbox table)".into(),
        ));
    }
    let sql = format!(
        "INSERT INTO \"{}\".\"{}_stream\"
             (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, occurred_at)
         VALUES ($1, $2, $3, $4, $5::json, $6, $7::jsonb, $8)",
        outbox.schema(),
        outbox.table()
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(event.id().as_uuid())
        .bind(event.aggregate_type())
        .bind(event.aggregate_id())
        .bind(event.event_type())
        .bind(event.payload())
        .bind(event.destination())
        .bind(event.headers_json())
        .bind(event.occurred_at())
        .execute(executor)
        .await
        .map_err(map_sqlx)?;
    Ok(event.id())
}

/// Delete rows of the stream table enqueued more than `older_than` ago, `batch` rows per
/// statement (short transactions, no long locks), through its BRIN index on `enqueued_at`.
/// Returns how many. Purging never loses an event: the relay reads events from the WAL, never
/// from these rows. `outbox relay` runs it with `retention.delivered` when WAL mode captures the
/// stream table.
pub async fn purge_stream_table(
    config: &crate::WalConfig,
    pool: &sqlx::PgPool,
    older_than: std::time::Duration,
    batch: u32,
) -> Result<u64, WalError> {
    let t = crate::slot::stream_table(config);
    let sql = format!(
        "DELETE FROM {t} WHERE ctid IN (
             SELECT ctid FROM {t}
             WHERE enqueued_at < now() - $1 * interval '1 millisecond'
             LIMIT $2)"
    );
    let batch = i64::from(batch.max(1));
    let millis = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    let mut total = 0;
    loop {
        let deleted = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
            .bind(millis)
            .bind(batch)
            .execute(pool)
            .await
            .map_err(map_sqlx)?
            .rows_affected();
        total += deleted;
        if deleted < batch as u64 {
            return Ok(total);
        }
    }
}
