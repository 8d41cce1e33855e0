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
use outbox_types::{Event, EventId, Headers, NewEvent};
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
    // The outbox table refuses these names, and a message that fails is handed to it.
    event.check_headers()?;
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
    .map_err(|e| WalError::Encode(outbox_types::EncodeError::Serialize(e)))
}

pub(crate) fn decode_envelope(content: &[u8]) -> Result<Envelope, String> {
    let envelope: Envelope = serde_json::from_slice(content).map_err(|e| {
        format!(
            "not an outbox envelope ({}); write messages with outbox_wal::enqueue_message",
            envelope_problem(content).unwrap_or_else(|| e.to_string())
        )
    })?;
    if envelope.v != 1 {
        return Err(format!(
            "envelope version {} is newer than this build knows (1); upgrade the relay",
            envelope.v
        ));
    }
    // The table's payload column is `json`; a message must not carry less (and its dead letter
    // could not be written otherwise).
    crate::pgoutput::check_json(&envelope.payload)
        .map_err(|_| "the envelope's `payload` is not JSON text; write messages with outbox_wal::enqueue_message".to_owned())?;
    Ok(envelope)
}

/// Which field of a refused envelope is wrong (serde's own error does not say), for the dead
/// letter's reason. Runs only for refused envelopes.
fn envelope_problem(content: &[u8]) -> Option<String> {
    use serde_json::Value;
    let map: serde_json::Map<String, Value> = match serde_json::from_slice::<Value>(content) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Some("the content is JSON but not an object".to_owned()),
        Err(e) => return Some(format!("the content is not JSON: {e}")),
    };
    fn check<T: serde::de::DeserializeOwned>(
        map: &serde_json::Map<String, Value>,
        field: &str,
        required: bool,
    ) -> Option<String> {
        match map.get(field) {
            None if required => Some(format!("field `{field}` is missing")),
            None => None,
            Some(value) => serde_json::from_value::<T>(value.clone())
                .err()
                .map(|e| format!("field `{field}`: {e}")),
        }
    }
    check::<u8>(&map, "v", true)
        .or_else(|| check::<Uuid>(&map, "id", true))
        .or_else(|| check::<String>(&map, "aggregate_type", true))
        .or_else(|| check::<String>(&map, "aggregate_id", true))
        .or_else(|| check::<String>(&map, "event_type", true))
        .or_else(|| check::<String>(&map, "payload", true))
        .or_else(|| check::<Option<String>>(&map, "destination", false))
        .or_else(|| {
            check::<Headers>(&map, "headers", false)
                .map(|e| format!("{e} (header values must be strings)"))
        })
        .or_else(|| check::<Option<String>>(&map, "idempotency_key", false))
        .or_else(|| check::<DateTime<Utc>>(&map, "occurred_at", true))
}

/// A logical message with the outbox prefix that is not a valid envelope, as the dead event it
/// becomes, with its `last_error`.
///
/// Its id is derived from the slot and the message's LSN, so a message seen again after a
/// restart maps to the same dead row (written once). Whatever can be read of the envelope
/// (aggregate and event type) is kept so `outbox dead list` shows where it belongs; the content
/// itself becomes the payload (as is when it is JSON, else as a JSON string).
pub(crate) fn malformed_message(
    slot: &str,
    lsn: Lsn,
    content: &[u8],
    reason: &str,
    committed_at: DateTime<Utc>,
) -> (Event, String) {
    let parsed: Option<serde_json::Map<String, serde_json::Value>> =
        serde_json::from_slice(content).ok();
    let field = |name: &str| {
        parsed
            .as_ref()
            .and_then(|m| m.get(name))
            .and_then(|v| v.as_str())
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    };
    let text = String::from_utf8_lossy(content);
    let payload = if serde_json::from_str::<serde::de::IgnoredAny>(&text).is_ok() {
        text.into_owned()
    } else {
        serde_json::Value::String(text.into_owned()).to_string()
    };
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&crate::slot::fnv1a(slot).to_be_bytes());
    bytes[8..].copy_from_slice(&lsn.0.to_be_bytes());
    let id = uuid::Builder::from_custom_bytes(bytes).into_uuid();
    let writer_id = field("id")
        .map(|id| format!(" (the writer's id was {id})"))
        .unwrap_or_default();
    let error = format!(
        "the logical message at {lsn} cannot be read as an event: {reason}{writer_id}. Its content is kept as this row's payload; fix the writer, then `outbox dead purge` this row (or correct it and `outbox dead requeue`)"
    );
    let event = Event {
        seq: i64::try_from(lsn.0).unwrap_or(i64::MAX),
        id: EventId::from_uuid(id),
        aggregate_type: field("aggregate_type").unwrap_or_else(|| "outbox.malformed".to_owned()),
        aggregate_id: field("aggregate_id").unwrap_or_else(|| lsn.to_string()),
        event_type: field("event_type").unwrap_or_else(|| "outbox.malformed_message".to_owned()),
        payload,
        destination: None,
        headers: Headers::new(),
        idempotency_key: None,
        occurred_at: committed_at,
        enqueued_at: committed_at,
        attempts: 0,
    };
    (event, error)
}

/// Add `event` to the WAL through `executor` — normally `&mut *tx` of the caller's own
/// transaction, so the event commits or rolls back with the business change — as a
/// transactional logical message with `prefix` (use [`DEFAULT_PREFIX`] unless the relay's
/// `message_prefix` says otherwise). Never commits by itself.
///
/// Unlike [`PgOutbox::enqueue`](outbox_postgresql::PgOutbox::enqueue) there is no table and so no
/// unique index: an idempotency key is carried to the destination but not deduplicated here.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin().await?;
/// // … the business change …
/// let event = outbox_types::NewEvent::new("order", "42", "OrderCreated", &serde_json::json!({"amount": 1999}))?;
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
    fn malformed_messages_become_dead_events_with_a_stable_id() {
        let now = Utc::now();
        let content = br#"{"v":1,"aggregate_type":"order","aggregate_id":"7","event_type":"T","headers":{"retry":3}}"#;
        let reason = decode_envelope(content).unwrap_err();
        assert!(reason.contains("field `id` is missing"), "{reason}");
        let with_id = br#"{"v":1,"id":"00000000-0000-0000-0000-000000000000","aggregate_type":"order","aggregate_id":"7","event_type":"T","payload":"{}","headers":{"retry":3},"occurred_at":"2024-01-01T00:00:00Z"}"#;
        let headers = decode_envelope(with_id).unwrap_err();
        assert!(headers.contains("field `headers`"), "{headers}");
        let (event, error) = malformed_message("slot_a", Lsn(0x1234), content, &reason, now);
        assert_eq!(event.aggregate_type, "order");
        assert_eq!(event.aggregate_id, "7");
        assert_eq!(event.payload.as_bytes(), content, "JSON content kept as is");
        assert!(
            error.contains("0/1234") && error.contains("outbox dead"),
            "{error}"
        );
        let (again, _) = malformed_message("slot_a", Lsn(0x1234), content, &reason, now);
        assert_eq!(
            event.id, again.id,
            "the same message maps to the same dead row"
        );
        let (other, _) = malformed_message("slot_b", Lsn(0x1234), content, &reason, now);
        assert_ne!(event.id, other.id);
        let (raw, _) = malformed_message("slot_a", Lsn(1), b"\xffnot json", "x", now);
        assert!(
            serde_json::from_str::<String>(&raw.payload).is_ok(),
            "{}",
            raw.payload
        );
        assert_eq!(raw.aggregate_type, "outbox.malformed");
    }

    #[test]
    fn foreign_content_is_refused() {
        assert!(decode_envelope(b"hello").is_err());
        assert!(
            decode_envelope(br#"{"v":1,"id":"00000000-0000-0000-0000-000000000000","aggregate_type":"a","aggregate_id":"1","event_type":"T","payload":"{not json","occurred_at":"2024-01-01T00:00:00Z"}"#)
                .unwrap_err()
                .contains("payload")
        );
        assert!(
            decode_envelope(br#"{"v":2,"id":"00000000-0000-0000-0000-000000000000","aggregate_type":"a","aggregate_id":"1","event_type":"T","payload":"{}","occurred_at":"2024-01-01T00:00:00Z"}"#)
                .unwrap_err()
                .contains("version 2")
        );
    }
}
