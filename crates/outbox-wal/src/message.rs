//! Table-less events: [`enqueue_message`] writes an event as a transactional logical decoding
//! message (`pg_logical_emit_message(true, prefix, content)`) in the caller's transaction.
//!
//! Why: an outbox table in WAL mode is written once and then only waits to be cleaned up; every
//! row costs an insert, an index entry, a later update or delete, and vacuum. A logical message
//! lives only in the WAL: it commits or rolls back with the transaction, reaches the relay through
//! the same slot in commit order, and leaves nothing behind to vacuum. The price: it exists
//! nowhere else, so if the slot is lost before the event was delivered the event is gone (table
//! rows survive and are re-scanned by [`recover`](crate::recover)).
//!
//! The content is the [`NewEvent`] as one JSON object (the envelope, version 1). The payload is
//! carried as a JSON *string* so the bytes the writer produced are the bytes a sink publishes.

use chrono::{DateTime, Utc};
use outbox_core::{EventId, Headers, NewEvent};
use serde::{Deserialize, Serialize};
use sqlx::PgExecutor;
use uuid::Uuid;

use crate::error::{WalError, map_sqlx};
use crate::lsn::Lsn;

/// The prefix WAL mode reads events from unless configured otherwise.
pub const DEFAULT_PREFIX: &str = "outbox";

/// The suffix of the heartbeat prefix (`<prefix>.heartbeat`); heartbeats carry no event.
pub(crate) const HEARTBEAT_SUFFIX: &str = ".heartbeat";

/// What [`enqueue_message`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnqueuedMessage {
    /// The event's id.
    pub id: EventId,
    /// Where the message sits in the WAL (also the event's `seq` when it is delivered).
    pub lsn: Lsn,
}

/// Version 1 of the message envelope, as written.
#[derive(Serialize)]
struct EnvelopeOut<'a> {
    v: u8,
    id: &'a Uuid,
    aggregate_type: &'a str,
    aggregate_id: &'a str,
    event_type: &'a str,
    payload: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    destination: Option<&'a str>,
    #[serde(skip_serializing_if = "Headers::is_empty")]
    headers: &'a Headers,
    #[serde(skip_serializing_if = "Option::is_none")]
    idempotency_key: Option<&'a str>,
    occurred_at: DateTime<Utc>,
}

/// The envelope as read back.
#[derive(Debug, Deserialize)]
pub(crate) struct Envelope {
    pub v: u8,
    pub id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: String,
    #[serde(default)]
    pub destination: Option<String>,
    #[serde(default)]
    pub headers: Headers,
    #[serde(default)]
    pub idempotency_key: Option<String>,
    pub occurred_at: DateTime<Utc>,
}

/// The message content for `event`.
pub fn encode_envelope(event: &NewEvent) -> Result<String, WalError> {
    serde_json::to_string(&EnvelopeOut {
        v: 1,
        id: event.id().as_uuid(),
        aggregate_type: event.aggregate_type(),
        aggregate_id: event.aggregate_id(),
        event_type: event.event_type(),
        payload: event.payload(),
        destination: event.destination(),
        headers: event.headers(),
        idempotency_key: event.idempotency_key(),
        occurred_at: event.occurred_at(),
    })
    .map_err(|e| WalError::Encode(outbox_core::EncodeError::Serialize(e)))
}

pub(crate) fn decode_envelope(content: &[u8]) -> Result<Envelope, String> {
    let envelope: Envelope =
        serde_json::from_slice(content).map_err(|e| format!("not an outbox envelope: {e}"))?;
    if envelope.v != 1 {
        return Err(format!(
            "envelope version {} is newer than this build knows (1)",
            envelope.v
        ));
    }
    Ok(envelope)
}

/// Add `event` to the WAL through `executor` — normally `&mut *tx` of the caller's own
/// transaction, so the event commits or rolls back with the business change — as a
/// transactional logical message with `prefix` (use [`DEFAULT_PREFIX`] unless the relay's
/// `message_prefix` says otherwise). Never commits by itself.
///
/// Unlike [`PgOutbox::enqueue`](outbox_postgres::PgOutbox::enqueue) there is no table and so no
/// unique index: an idempotency key is carried to the destination but not deduplicated here.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin().await?;
/// // … the business change …
/// let event = outbox_core::NewEvent::new("order", "42", "OrderCreated", &serde_json::json!({"amount": 1999}))?;
/// outbox_wal::enqueue_message(&mut *tx, outbox_wal::DEFAULT_PREFIX, &event).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn enqueue_message<'e, E: PgExecutor<'e>>(
    executor: E,
    prefix: &str,
    event: &NewEvent,
) -> Result<EnqueuedMessage, WalError> {
    let content = encode_envelope(event)?;
    let lsn: String = sqlx::query_scalar(
        "SELECT pg_logical_emit_message(true, $1, convert_to($2, 'UTF8'))::text",
    )
    .bind(prefix)
    .bind(content)
    .fetch_one(executor)
    .await
    .map_err(map_sqlx)?;
    let lsn = Lsn::parse(&lsn).map_err(WalError::Decode)?;
    Ok(EnqueuedMessage {
        id: event.id(),
        lsn,
    })
}

/// Add several events in one statement, in order, as [`enqueue_message`] does for one. Returns
/// where each landed in the WAL.
pub async fn enqueue_messages<'e, E: PgExecutor<'e>>(
    executor: E,
    prefix: &str,
    events: &[NewEvent],
) -> Result<Vec<EnqueuedMessage>, WalError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let contents = events
        .iter()
        .map(encode_envelope)
        .collect::<Result<Vec<_>, _>>()?;
    let lsns: Vec<String> = sqlx::query_scalar(
        "SELECT pg_logical_emit_message(true, $1, convert_to(c, 'UTF8'))::text
         FROM unnest($2::text[]) WITH ORDINALITY AS u(c, ord) ORDER BY ord",
    )
    .bind(prefix)
    .bind(&contents)
    .fetch_all(executor)
    .await
    .map_err(map_sqlx)?;
    events
        .iter()
        .zip(lsns)
        .map(|(e, lsn)| {
            Ok(EnqueuedMessage {
                id: e.id(),
                lsn: Lsn::parse(&lsn).map_err(WalError::Decode)?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_and_keeps_payload_bytes() {
        let event = NewEvent::from_json("order", "7", "OrderCreated", r#"{ "a" :  1 }"#)
            .unwrap()
            .with_header("traceparent", "00-abc-def-01")
            .with_destination("orders")
            .with_idempotency_key("k1");
        let text = encode_envelope(&event).unwrap();
        let back = decode_envelope(text.as_bytes()).unwrap();
        assert_eq!(back.payload, r#"{ "a" :  1 }"#);
        assert_eq!(back.id, *event.id().as_uuid());
        assert_eq!(back.destination.as_deref(), Some("orders"));
        assert_eq!(back.idempotency_key.as_deref(), Some("k1"));
        assert_eq!(back.headers.get("traceparent").unwrap(), "00-abc-def-01");
        assert_eq!(back.occurred_at, event.occurred_at());
    }

    #[test]
    fn foreign_content_is_refused() {
        assert!(decode_envelope(b"hello").is_err());
        assert!(
            decode_envelope(br#"{"v":2,"id":"00000000-0000-0000-0000-000000000000","aggregate_type":"a","aggregate_id":"1","event_type":"T","payload":"{}","occurred_at":"2024-01-01T00:00:00Z"}"#)
                .unwrap_err()
                .contains("version 2")
        );
    }
}
