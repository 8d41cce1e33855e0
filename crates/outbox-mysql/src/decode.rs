//! Rows into the core's types: a claimed row into an [`Event`], an operator's read into an
//! [`EventRecord`]. A row that cannot be decoded is [`StoreError::Corrupt`] with its seq, so the
//! relay can bury it instead of failing the claim.

use crate::error::map_sqlx;
use outbox_types::sql_store::{decode_headers, event_record};
use outbox_types::{Event, EventId, EventRecord, Reading, StoreError};
use sqlx::Row;
use sqlx::mysql::MySqlRow;
use uuid::Uuid;

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
    let (id, headers) = match reading {
        Reading::Delivery => (decode_id(row, "id", seq)?, decode_headers(seq, &headers)?),
        Reading::Display => (
            decode_id(row, "id", seq).unwrap_or_else(|_| EventId::from_uuid(Uuid::nil())),
            outbox_types::headers_for_display(&headers),
        ),
    };
    Ok(Event {
        seq,
        id,
        aggregate_type: row.try_get("aggregate_type").map_err(map_sqlx)?,
        aggregate_id: row.try_get("aggregate_id").map_err(map_sqlx)?,
        event_type: row.try_get("event_type").map_err(map_sqlx)?,
        payload: outbox_types::check_payload(
            seq,
            row.try_get("payload").map_err(map_sqlx)?,
            reading,
        )?,
        destination: row.try_get("destination").map_err(map_sqlx)?,
        headers,
        idempotency_key: row.try_get("idempotency_key").map_err(map_sqlx)?,
        occurred_at: row.try_get("occurred_at").map_err(map_sqlx)?,
        enqueued_at: row.try_get("enqueued_at").map_err(map_sqlx)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

pub(crate) fn decode_record(row: &MySqlRow) -> Result<EventRecord, StoreError> {
    event_record(&Columns(row), decode_event_as(row, Reading::Display)?)
}

/// A row read column by column for the builders of [`outbox_types::sql_store`].
pub(crate) struct Columns<'r>(pub(crate) &'r MySqlRow);

outbox_types::impl_stored_row!(Columns, map_sqlx);
