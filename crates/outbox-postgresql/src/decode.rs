//! Rows into the core's types: a claimed row into an [`Event`], an operator's read into an
//! [`EventRecord`]. A row that cannot be decoded is [`StoreError::Corrupt`] with its seq, so the
//! relay can bury it instead of failing the claim.

use crate::error::map_sqlx;
use outbox_types::sql_store::{count, decode_headers, parse_state};
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
    let headers = match reading {
        Reading::Delivery => decode_headers(seq, &headers)?,
        Reading::Display => outbox_types::headers_for_display(&headers),
    };
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
    Ok(Event {
        seq,
        id: EventId::from_uuid(id),
        aggregate_type: row.try_get("aggregate_type").map_err(map_sqlx)?,
        aggregate_id: row.try_get("aggregate_id").map_err(map_sqlx)?,
        event_type: row.try_get("event_type").map_err(map_sqlx)?,
        payload,
        destination: row.try_get("destination").map_err(map_sqlx)?,
        headers,
        idempotency_key: row.try_get("idempotency_key").map_err(map_sqlx)?,
        occurred_at: row.try_get("occurred_at").map_err(map_sqlx)?,
        enqueued_at: row.try_get("enqueued_at").map_err(map_sqlx)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

pub(crate) fn decode_record(row: &PgRow) -> Result<EventRecord, StoreError> {
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
pub(crate) fn count_of(row: &PgRow, name: &str) -> Result<u64, StoreError> {
    let n: i64 = row.try_get(name).map_err(map_sqlx)?;
    Ok(count(n))
}
