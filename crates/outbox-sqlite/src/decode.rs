//! Rows into the core's types: a claimed row into an [`Event`], an operator's read into an
//! [`EventRecord`]. A row that cannot be decoded is [`StoreError::Corrupt`] with its seq, so the
//! relay can bury it instead of failing the claim.

use crate::error::map_sqlx;
use crate::time::to_time;
use chrono::{DateTime, Utc};
use outbox_types::sql_reading::{headers_as, id_as};
use outbox_types::sql_store::{StoredRow, count, event_record, parse_event_id};
use outbox_types::{Event, EventId, EventRecord, Reading, StoreError};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

pub(crate) fn get_time(
    row: &SqliteRow,
    seq: i64,
    column: &str,
) -> Result<DateTime<Utc>, StoreError> {
    let us: i64 = row.try_get(column).map_err(map_sqlx)?;
    to_time(seq, column, us)
}

pub(crate) fn get_opt_time(
    row: &SqliteRow,
    seq: i64,
    column: &str,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    let us: Option<i64> = row.try_get(column).map_err(map_sqlx)?;
    us.map(|us| to_time(seq, column, us)).transpose()
}

pub(crate) fn decode_id(row: &SqliteRow, column: &str, seq: i64) -> Result<EventId, StoreError> {
    let text: String = row.try_get(column).map_err(map_sqlx)?;
    parse_event_id(seq, column, &text)
}

pub(crate) fn decode_event(row: &SqliteRow) -> Result<Event, StoreError> {
    decode_event_as(row, Reading::Delivery)
}

/// A text column; for display, bytes that are not UTF-8 are replaced rather than refused.
pub(crate) fn text_as(
    row: &SqliteRow,
    column: &str,
    reading: Reading,
) -> Result<String, StoreError> {
    match row.try_get::<String, _>(column) {
        Ok(text) => Ok(text),
        Err(_) if reading == Reading::Display => {
            let bytes: Vec<u8> = row.try_get_unchecked(column).map_err(map_sqlx)?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
        Err(e) => Err(StoreError::Corrupt {
            seq: row.try_get("seq").unwrap_or(0),
            reason: format!("column `{column}` cannot be read as text ({e})"),
        }),
    }
}

pub(crate) fn opt_text_as(
    row: &SqliteRow,
    column: &str,
    reading: Reading,
) -> Result<Option<String>, StoreError> {
    let present: Option<Vec<u8>> = row.try_get_unchecked(column).map_err(map_sqlx)?;
    match present {
        None => Ok(None),
        Some(_) => text_as(row, column, reading).map(Some),
    }
}

pub(crate) fn decode_event_as(row: &SqliteRow, reading: Reading) -> Result<Event, StoreError> {
    let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
    let headers = text_as(row, "headers", reading)?;
    let attempts: i64 = row.try_get("attempts").map_err(map_sqlx)?;
    let id = id_as(decode_id(row, "id", seq), reading)?;
    let headers = headers_as(seq, &headers, reading)?;
    Ok(Event {
        seq,
        id,
        aggregate_type: text_as(row, "aggregate_type", reading)?,
        aggregate_id: text_as(row, "aggregate_id", reading)?,
        event_type: text_as(row, "event_type", reading)?,
        payload: outbox_types::check_payload(seq, text_as(row, "payload", reading)?, reading)?,
        destination: opt_text_as(row, "destination", reading)?,
        headers,
        idempotency_key: opt_text_as(row, "idempotency_key", reading)?,
        occurred_at: get_time(row, seq, "occurred_at")?,
        enqueued_at: get_time(row, seq, "enqueued_at")?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

pub(crate) fn decode_record(row: &SqliteRow) -> Result<EventRecord, StoreError> {
    event_record(&Columns(row), decode_event_as(row, Reading::Display)?)
}

/// A row read column by column for the builders of [`outbox_types::sql_store`]: times are
/// microseconds since the epoch.
pub(crate) struct Columns<'r>(pub(crate) &'r SqliteRow);

impl StoredRow for Columns<'_> {
    fn count(&self, name: &str) -> Result<u64, StoreError> {
        let n: i64 = self.0.try_get(name).map_err(map_sqlx)?;
        Ok(count(n))
    }

    fn text(&self, name: &str) -> Result<String, StoreError> {
        self.0.try_get(name).map_err(map_sqlx)
    }

    fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError> {
        self.0.try_get(name).map_err(map_sqlx)
    }

    fn time(&self, seq: i64, name: &str) -> Result<DateTime<Utc>, StoreError> {
        get_time(self.0, seq, name)
    }

    fn opt_time(&self, seq: i64, name: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        get_opt_time(self.0, seq, name)
    }
}
