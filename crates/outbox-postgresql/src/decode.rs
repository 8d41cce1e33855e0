//! Rows into the core's types: a claimed row into an [`Event`], an operator's read into an
//! [`EventRecord`]. A row that cannot be decoded is [`StoreError::Corrupt`] with its seq, so the
//! relay can bury it instead of failing the claim.

use crate::error::map_sqlx;
use outbox_types::sql_reading::headers_as;
use outbox_types::sql_store::{event, event_record};
use outbox_types::{Event, EventId, EventRecord, Reading, StoreError};
use sqlx::Row;
use sqlx::postgres::PgRow;
use uuid::Uuid;

pub(crate) fn decode_event(row: &PgRow) -> Result<Event, StoreError> {
    decode_event_as(row, Reading::Delivery)
}

pub(crate) fn decode_event_as(row: &PgRow, reading: Reading) -> Result<Event, StoreError> {
    let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
    let headers: String = row.try_get("headers").map_err(map_sqlx)?;
    let headers = headers_as(seq, &headers, reading)?;
    let attempts: i32 = row.try_get("attempts").map_err(map_sqlx)?;
    // The stock table's columns are typed (`uuid`, `json`); a hand-altered one may hold text
    // there, which a foreign writer can fill with anything: read it, and say what is wrong.
    let id = match row.try_get::<Uuid, _>("id") {
        Ok(id) => id,
        Err(_) => {
            let text: String = row.try_get("id").map_err(map_sqlx)?;
            Uuid::parse_str(&text).map_err(|e| StoreError::Corrupt {
                seq,
                reason: format!("column `id` is not a UUID ({e})"),
            })?
        }
    };
    let payload: String = row.try_get("payload").map_err(map_sqlx)?;
    let payload = match row.try_get::<bool, _>("payload_typed") {
        Ok(false) => outbox_types::check_payload(seq, payload, reading)?,
        _ => payload,
    };
    let attempts = u32::try_from(attempts).unwrap_or(0);
    event(
        &Columns(row),
        seq,
        EventId::from_uuid(id),
        payload,
        headers,
        attempts,
    )
}

pub(crate) fn decode_record(row: &PgRow) -> Result<EventRecord, StoreError> {
    event_record(&Columns(row), decode_event_as(row, Reading::Display)?)
}

/// A row read column by column for the builders of [`outbox_types::sql_store`].
pub(crate) struct Columns<'r>(pub(crate) &'r PgRow);

outbox_types::impl_stored_row!(Columns, map_sqlx);
