//! Rows into the core's types: a claimed row into an [`Event`], an operator's read into an
//! [`EventRecord`]. A row that cannot be decoded is [`StoreError::Corrupt`] with its seq, so the
//! relay can bury it instead of failing the claim.

use crate::error::map_sqlx;
use outbox_types::sql_reading::{headers_as, id_as};
use outbox_types::sql_store::{event, event_record};
use outbox_types::{Event, EventId, EventRecord, Reading, StoreError};
use sqlx::Row;
use sqlx::mysql::MySqlRow;

/// The UUID in text column `column`.
pub(crate) fn decode_id(
    row: &sqlx::mysql::MySqlRow,
    column: &str,
    seq: i64,
) -> Result<EventId, StoreError> {
    let text: String = row.try_get(column).map_err(map_sqlx)?;
    outbox_types::sql_store::parse_event_id(seq, column, &text)
}

pub(crate) fn decode_event(row: &MySqlRow) -> Result<Event, StoreError> {
    decode_event_as(row, Reading::Delivery)
}

pub(crate) fn decode_event_as(row: &MySqlRow, reading: Reading) -> Result<Event, StoreError> {
    let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
    let headers: String = row.try_get("headers").map_err(map_sqlx)?;
    let attempts: i32 = row.try_get("attempts").map_err(map_sqlx)?;
    let id = id_as(decode_id(row, "id", seq), reading)?;
    let headers = headers_as(seq, &headers, reading)?;
    let payload = row.try_get("payload").map_err(map_sqlx)?;
    let payload = outbox_types::check_payload(seq, payload, reading)?;
    let attempts = u32::try_from(attempts).unwrap_or(0);
    event(&Columns(row), seq, id, payload, headers, attempts)
}

pub(crate) fn decode_record(row: &MySqlRow) -> Result<EventRecord, StoreError> {
    event_record(&Columns(row), decode_event_as(row, Reading::Display)?)
}

/// A row read column by column for the builders of [`outbox_types::sql_store`].
pub(crate) struct Columns<'r>(pub(crate) &'r MySqlRow);

outbox_types::impl_stored_row!(Columns, map_sqlx);
