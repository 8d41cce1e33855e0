//! Rows into the core's types: a claimed row into an [`Event`], an operator's read into an
//! [`EventRecord`]. A row that cannot be decoded is [`StoreError::Corrupt`] with its seq, so the
//! relay can bury it instead of failing the claim.

use crate::error::map_sqlx;
use outbox_types::sql_store::{count, decode_headers, parse_state};
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
    let event = decode_event_as(row, Reading::Display)?;
    let status: String = row.try_get("status").map_err(map_sqlx)?;
    let state = parse_state(event.seq, &status)?;
    Ok(EventRecord {
        event,
        state,
        next_attempt_at: row.try_get("next_attempt_at").map_err(map_sqlx)?,
        last_error: row.try_get("last_error").map_err(map_sqlx)?,
        lease_owner: row.try_get("lease_owner").map_err(map_sqlx)?,
        lease_expires_at: row.try_get("lease_expires_at").map_err(map_sqlx)?,
        delivered_at: row.try_get("delivered_at").map_err(map_sqlx)?,
        dead_at: row.try_get("dead_at").map_err(map_sqlx)?,
    })
}

/// Column `name` of `row`, a count.
pub(crate) fn count_of(row: &MySqlRow, name: &str) -> Result<u64, StoreError> {
    let n: i64 = row.try_get(name).map_err(map_sqlx)?;
    Ok(count(n))
}
