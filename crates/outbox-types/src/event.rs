//! Events: what writers enqueue, what relays claim, and the states in between.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::EncodeError;

/// Header names and values carried with an event to its destination.
///
/// A sorted map, so the stored form and what a sink emits are stable.
pub type Headers = BTreeMap<String, String>;

/// Stored headers as an operator should see them in `outbox dead list|show`, even when the text
/// is not a JSON object of strings (a foreign writer's row, dead-lettered for exactly that):
/// other values are shown as their JSON text, and text that is no JSON object at all under
/// `outbox-unreadable-headers`. Never used for delivery, which refuses such rows.
///
/// ```
/// let h = outbox_types::headers_for_display(r#"{"retry": 3, "tenant": "acme"}"#);
/// assert_eq!(h["retry"], "3");
/// assert_eq!(h["tenant"], "acme");
/// let h = outbox_types::headers_for_display("[1,2");
/// assert_eq!(h["outbox-unreadable-headers"], "[1,2");
/// ```
pub fn headers_for_display(text: &str) -> Headers {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => Headers::from([("outbox-unreadable-headers".to_owned(), text.to_owned())]),
    }
}

/// The header-name prefix reserved for the relay's own message headers (`outbox-event-id`,
/// `outbox-event-type`, … in [`routing::header`](crate::routing::header)).
///
/// Sinks put those headers on every message, and an event's own header of the same name is never
/// sent (it could otherwise forge the id consumers deduplicate on). So a writer's header with
/// this prefix is a mistake that would vanish silently at delivery; every store refuses it when
/// the event is written instead: the Rust enqueue with [`EncodeError::ReservedHeader`], the
/// database with a trigger on the outbox table (see `docs/table-contract.md`). The one exception
/// is [`routing::header::PARTITION`](crate::routing::header::PARTITION): the WAL relay stores it
/// itself (the Kafka partition a Debezium table chose) when it hands an event to the table.
pub const RESERVED_HEADER_PREFIX: &str = "outbox-";

/// Whether a header named `name`, from an event's row, would pass for one of the relay's own
/// message headers: it starts with [`RESERVED_HEADER_PREFIX`] in **any** case (`Outbox-Event-Id`,
/// `OUTBOX-TENANT`, `outbox-partition` too). Every sink leaves such a header off the message
/// ([`Routing::headers`](crate::routing::Routing::headers)): on a broker whose header names are
/// case-sensitive (Kafka, RabbitMQ) a forged `Outbox-Event-Id` would otherwise travel beside the
/// real `outbox-event-id`, and a consumer that reads names without case could take it.
///
/// ```
/// use outbox_types::is_relay_header;
/// assert!(is_relay_header("outbox-event-id"));
/// assert!(is_relay_header("Outbox-Event-Id"));
/// assert!(is_relay_header("OUTBOX-TENANT"));
/// assert!(!is_relay_header("outboxed"));
/// assert!(!is_relay_header("tenant"));
/// ```
pub fn is_relay_header(name: &str) -> bool {
    name.get(..RESERVED_HEADER_PREFIX.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(RESERVED_HEADER_PREFIX))
}

/// Whether a header named `name` may not be stored with an event: it starts with
/// [`RESERVED_HEADER_PREFIX`] (lower case, as written) and is not `outbox-partition`.
///
/// ```
/// use outbox_types::is_reserved_header;
/// assert!(is_reserved_header("outbox-event-id"));
/// assert!(is_reserved_header("outbox-"));
/// assert!(!is_reserved_header("outbox-partition"));
/// assert!(!is_reserved_header("Outbox-Tenant"));
/// assert!(!is_reserved_header("tenant"));
/// ```
pub fn is_reserved_header(name: &str) -> bool {
    name.starts_with(RESERVED_HEADER_PREFIX) && name != crate::routing::header::PARTITION
}

/// The longest `last_error` a store keeps, in bytes. Longer errors are cut at a character boundary
/// (a sink that echoes a 10 MB response body must not bloat the outbox table).
pub const MAX_LAST_ERROR_LEN: usize = 2048;

/// Whether `value` is a W3C `traceparent` this library can forward: version `00`,
/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lowercase, ids not all zero.
/// (Future versions may append fields; they are accepted when the first four parse.)
pub fn is_valid_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    if parts.len() < 4 {
        return false;
    }
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let (version, trace, parent, flags) = (parts[0], parts[1], parts[2], parts[3]);
    hex(version, 2)
        && version != "ff"
        && (version != "00" || parts.len() == 4)
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && parent.bytes().any(|b| b != b'0')
        && hex(flags, 2)
}

/// Cut `error` to at most [`MAX_LAST_ERROR_LEN`] bytes without splitting a UTF-8 character.
///
/// ```
/// let long = "é".repeat(5000);
/// let cut = outbox_types::truncate_error(&long);
/// assert!(cut.len() <= outbox_types::MAX_LAST_ERROR_LEN);
/// assert!(cut.ends_with('…'));
/// ```
pub fn truncate_error(error: &str) -> String {
    if error.len() <= MAX_LAST_ERROR_LEN {
        return error.to_owned();
    }
    let marker = '…';
    let mut end = MAX_LAST_ERROR_LEN - marker.len_utf8();
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    let mut cut = String::with_capacity(end + marker.len_utf8());
    cut.push_str(&error[..end]);
    cut.push(marker);
    cut
}

/// The identity of an event: a UUID v7, so ids sort by creation time and index well.
///
/// Consumers deduplicate on it (the inbox key), so it is kept unchanged across retries and
/// replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EventId(Uuid);

impl EventId {
    /// A fresh time-ordered id.
    pub fn new() -> Self {
        EventId(Uuid::now_v7())
    }

    /// Wrap an existing UUID (an id chosen by the caller, or read back from a store).
    pub const fn from_uuid(uuid: Uuid) -> Self {
        EventId(uuid)
    }

    /// The UUID inside.
    pub const fn as_uuid(&self) -> &Uuid {
        &self.0
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for EventId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(EventId)
    }
}

impl From<Uuid> for EventId {
    fn from(value: Uuid) -> Self {
        EventId(value)
    }
}

/// The unit of ordering: events of one aggregate are delivered in the order they were enqueued;
/// events of different aggregates are independent.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AggregateKey {
    /// e.g. `order`.
    pub aggregate_type: String,
    /// e.g. the order's id.
    pub aggregate_id: String,
}

impl AggregateKey {
    /// The key a claimed row's two columns make, or `None` when either is missing: a store's
    /// claim leaves out (NULL) the key of a row over `max_metadata_bytes`, which is dead-lettered
    /// unread.
    pub fn from_columns(
        aggregate_type: Option<String>,
        aggregate_id: Option<String>,
    ) -> Option<Self> {
        aggregate_type
            .zip(aggregate_id)
            .map(|(aggregate_type, aggregate_id)| AggregateKey {
                aggregate_type,
                aggregate_id,
            })
    }
}

/// An event as a writer enqueues it, inside the same transaction as its business change.
///
/// The payload is serialized when the event is built, so a value that cannot become JSON is
/// rejected before anything is written.
#[derive(Clone, Debug, PartialEq)]
pub struct NewEvent {
    id: EventId,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: String,
    destination: Option<String>,
    headers: Headers,
    idempotency_key: Option<String>,
    occurred_at: DateTime<Utc>,
}

impl NewEvent {
    /// Build an event whose payload is `payload` serialized as JSON.
    ///
    /// Fails when the payload cannot be serialized or when a type/id field is empty.
    pub fn new<P: Serialize + ?Sized>(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: &P,
    ) -> Result<Self, EncodeError> {
        let payload = serde_json::to_string(payload)?;
        Self::build(
            aggregate_type.into(),
            aggregate_id.into(),
            event_type.into(),
            payload,
        )
    }

    /// Build an event from JSON text kept byte for byte (no re-encoding), after checking that it
    /// is one JSON document.
    ///
    /// ```
    /// let e = outbox_types::NewEvent::from_json("order", "7", "OrderCreated", r#"{ "a" : 1 }"#).unwrap();
    /// assert_eq!(e.payload(), r#"{ "a" : 1 }"#);
    /// assert!(outbox_types::NewEvent::from_json("order", "7", "OrderCreated", "{oops").is_err());
    /// ```
    pub fn from_json(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        json: impl Into<String>,
    ) -> Result<Self, EncodeError> {
        let payload = json.into();
        serde_json::from_str::<serde::de::IgnoredAny>(&payload)
            .map_err(EncodeError::InvalidJson)?;
        Self::build(
            aggregate_type.into(),
            aggregate_id.into(),
            event_type.into(),
            payload,
        )
    }

    fn build(
        aggregate_type: String,
        aggregate_id: String,
        event_type: String,
        payload: String,
    ) -> Result<Self, EncodeError> {
        if aggregate_type.is_empty() {
            return Err(EncodeError::Empty("aggregate_type"));
        }
        if aggregate_id.is_empty() {
            return Err(EncodeError::Empty("aggregate_id"));
        }
        if event_type.is_empty() {
            return Err(EncodeError::Empty("event_type"));
        }
        Ok(NewEvent {
            id: EventId::new(),
            aggregate_type,
            aggregate_id,
            event_type,
            payload,
            destination: None,
            headers: Headers::new(),
            idempotency_key: None,
            occurred_at: Utc::now(),
        })
    }

    /// Use a caller-chosen id instead of a fresh UUID v7.
    pub fn with_id(mut self, id: EventId) -> Self {
        self.id = id;
        self
    }

    /// Route the event to this destination (topic, subject, stream…) instead of letting the
    /// relay's routing decide.
    pub fn with_destination(mut self, destination: impl Into<String>) -> Self {
        self.destination = Some(destination.into());
        self
    }

    /// Add one header. A name under [`RESERVED_HEADER_PREFIX`] (`outbox-…`, other than
    /// `outbox-partition`) is refused when the event is enqueued (see
    /// [`NewEvent::check_headers`]).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Attach a W3C trace context (`traceparent`, and `tracestate` when given): stored with the
    /// event and forwarded as headers by every sink, so the consumer's span joins the writer's
    /// trace. A malformed `traceparent` is an error before anything is written.
    ///
    /// ```
    /// use outbox_types::NewEvent;
    /// let e = NewEvent::new("order", "1", "OrderCreated", &1)
    ///     .unwrap()
    ///     .with_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)
    ///     .unwrap();
    /// assert_eq!(e.headers()["traceparent"], "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    /// assert!(NewEvent::new("order", "1", "OrderCreated", &1).unwrap().with_traceparent("00-xyz", None).is_err());
    /// ```
    pub fn with_traceparent(
        mut self,
        traceparent: &str,
        tracestate: Option<&str>,
    ) -> Result<Self, EncodeError> {
        let traceparent = traceparent.trim();
        if !is_valid_traceparent(traceparent) {
            return Err(EncodeError::InvalidTraceparent(traceparent.to_owned()));
        }
        self.headers
            .insert("traceparent".to_owned(), traceparent.to_owned());
        if let Some(state) = tracestate.map(str::trim).filter(|s| !s.is_empty()) {
            self.headers
                .insert("tracestate".to_owned(), state.to_owned());
        }
        Ok(self)
    }

    /// Replace all headers (the same rule for names as [`NewEvent::with_header`]).
    pub fn with_headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// A deduplication key: enqueueing a second event with the same key is a no-op that returns
    /// the first event's id (as long as the first is still in the table).
    pub fn with_idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// When the business fact happened (defaults to the time the event was built).
    pub fn with_occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.occurred_at = at;
        self
    }

    /// The event's id.
    pub fn id(&self) -> EventId {
        self.id
    }
    /// e.g. `order`.
    pub fn aggregate_type(&self) -> &str {
        &self.aggregate_type
    }
    /// e.g. the order's id.
    pub fn aggregate_id(&self) -> &str {
        &self.aggregate_id
    }
    /// e.g. `OrderCreated`.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }
    /// The JSON text that will be stored and published.
    pub fn payload(&self) -> &str {
        &self.payload
    }
    /// The explicit destination, if any.
    pub fn destination(&self) -> Option<&str> {
        self.destination.as_deref()
    }
    /// Headers to carry.
    pub fn headers(&self) -> &Headers {
        &self.headers
    }
    /// The deduplication key, if any.
    pub fn idempotency_key(&self) -> Option<&str> {
        self.idempotency_key.as_deref()
    }
    /// When the business fact happened.
    pub fn occurred_at(&self) -> DateTime<Utc> {
        self.occurred_at
    }
    /// Check the header names against the rule every outbox table enforces at insert: none
    /// under [`RESERVED_HEADER_PREFIX`] except `outbox-partition` (the values are strings by
    /// construction). Every store's enqueue calls it before anything is sent, so a bad name is
    /// an [`EncodeError::ReservedHeader`] naming the header rather than a database error.
    ///
    /// ```
    /// use outbox_types::NewEvent;
    /// let e = NewEvent::new("order", "1", "OrderCreated", &1).unwrap();
    /// assert!(e.clone().with_header("tenant", "acme").check_headers().is_ok());
    /// let err = e.with_header("outbox-tenant", "acme").check_headers().unwrap_err();
    /// assert!(err.to_string().contains("`outbox-tenant`"));
    /// ```
    pub fn check_headers(&self) -> Result<(), EncodeError> {
        match self.headers.keys().find(|name| is_reserved_header(name)) {
            Some(name) => Err(EncodeError::ReservedHeader(name.clone())),
            None => Ok(()),
        }
    }

    /// The [`Event`] a relay hands to a sink once a store holds this event at position `seq`:
    /// no attempt yet, enqueued now. For a sink's tests and examples, and for anything else
    /// that needs the event a sink sees without a database behind it.
    ///
    /// ```
    /// let event = outbox_types::NewEvent::from_json("order", "42", "OrderCreated", "{}")
    ///     .unwrap()
    ///     .claimed(7);
    /// assert_eq!((event.seq, event.attempts, event.aggregate_id.as_str()), (7, 0, "42"));
    /// ```
    pub fn claimed(self, seq: i64) -> Event {
        Event {
            seq,
            id: self.id,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            event_type: self.event_type,
            payload: self.payload,
            destination: self.destination,
            headers: self.headers,
            idempotency_key: self.idempotency_key,
            occurred_at: self.occurred_at,
            enqueued_at: Utc::now(),
            attempts: 0,
        }
    }

    /// The headers as a JSON object, the form stores keep them in.
    pub fn headers_json(&self) -> String {
        // A map of strings always serializes.
        serde_json::to_string(&self.headers).unwrap_or_else(|_| "{}".to_owned())
    }
}

/// An event claimed by a relay, as handed to a [`Sink`](crate::Sink).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The store's position of the event: enqueue order, and the key stores use to ack.
    pub seq: i64,
    /// The event's id, stable across retries: consumers deduplicate on it.
    pub id: EventId,
    /// e.g. `order`.
    pub aggregate_type: String,
    /// e.g. the order's id; the message key at the destination.
    pub aggregate_id: String,
    /// e.g. `OrderCreated`.
    pub event_type: String,
    /// JSON text exactly as enqueued.
    pub payload: String,
    /// The destination the writer chose, if any.
    pub destination: Option<String>,
    /// Headers the writer attached.
    pub headers: Headers,
    /// The writer's deduplication key, if any.
    pub idempotency_key: Option<String>,
    /// When the business fact happened.
    pub occurred_at: DateTime<Utc>,
    /// When the row was written (the start of the writer's transaction).
    pub enqueued_at: DateTime<Utc>,
    /// Failed attempts before this one.
    pub attempts: u32,
}

impl Event {
    /// The aggregate this event belongs to (its ordering unit).
    pub fn aggregate(&self) -> AggregateKey {
        AggregateKey {
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
        }
    }
}

/// The lifecycle of an event. Every store uses these four words, stored as the lowercase
/// `snake_case` string.
///
/// | state | entered by | left by | kept |
/// |---|---|---|---|
/// | `pending` | enqueue, retry, release, requeue | claim (once due and unblocked) | until delivered or dead |
/// | `in_flight` | claim (with a lease owner, token and expiry) | ack, retry, bury, release; or another claim once the lease expired | for the lease |
/// | `delivered` | ack | purge (retention) | retention period |
/// | `dead` | bury (permanent rejection or attempts exhausted) | requeue, discard | until an operator acts |
///
/// The seeds' `new / sent / error` map to `pending / delivered / dead`; their `error` rows that
/// were still being retried are `pending` rows with `attempts > 0` here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventState {
    /// Waiting for delivery; due once its next attempt time has come.
    Pending,
    /// Claimed by a relay that holds a lease on it.
    InFlight,
    /// Acknowledged by its destination.
    Delivered,
    /// Given up on: rejected by the destination or out of attempts.
    Dead,
}

impl EventState {
    /// The stored spelling.
    pub const fn as_str(&self) -> &'static str {
        match self {
            EventState::Pending => "pending",
            EventState::InFlight => "in_flight",
            EventState::Delivered => "delivered",
            EventState::Dead => "dead",
        }
    }

    /// All states, in lifecycle order.
    pub const ALL: [EventState; 4] = [
        EventState::Pending,
        EventState::InFlight,
        EventState::Delivered,
        EventState::Dead,
    ];
}

impl fmt::Display for EventState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is not one of the four state names.
#[derive(Debug, thiserror::Error)]
#[error("unknown event state `{0}` (expected pending, in_flight, delivered or dead)")]
pub struct ParseStateError(pub String);

impl FromStr for EventState {
    type Err = ParseStateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pending" => Ok(EventState::Pending),
            "in_flight" => Ok(EventState::InFlight),
            "delivered" => Ok(EventState::Delivered),
            "dead" => Ok(EventState::Dead),
            other => Err(ParseStateError(other.to_owned())),
        }
    }
}

/// Everything a store keeps about one event, for admin commands and tests.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    /// The event as a sink would see it.
    #[serde(flatten)]
    pub event: Event,
    /// Where it is in its lifecycle.
    pub state: EventState,
    /// When the next attempt is due (meaningful while pending).
    pub next_attempt_at: DateTime<Utc>,
    /// The last delivery error, cut to [`MAX_LAST_ERROR_LEN`].
    pub last_error: Option<String>,
    /// The relay holding the lease while in flight.
    pub lease_owner: Option<String>,
    /// When that lease expires.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// When the destination acknowledged it.
    pub delivered_at: Option<DateTime<Utc>>,
    /// When it was buried.
    pub dead_at: Option<DateTime<Utc>>,
}

/// Per-aggregate order among first deliveries: for every aggregate, the first delivery of each
/// event must come in increasing `seq`. Later deliveries of an event (duplicates, which
/// at-least-once allows) are ignored. Returns one description per violation; empty means the
/// order held. Used by the demo, the tests and the correctness harness.
///
/// ```
/// # use outbox_types::{Event, EventId};
/// # fn ev(agg: &str, seq: i64) -> Event { Event { seq, id: EventId::new(), aggregate_type: "a".into(),
/// #   aggregate_id: agg.into(), event_type: "T".into(), payload: "{}".into(), destination: None,
/// #   headers: Default::default(), idempotency_key: None, occurred_at: chrono::Utc::now(),
/// #   enqueued_at: chrono::Utc::now(), attempts: 0 } }
/// let (a1, a2, b1) = (ev("a", 1), ev("a", 2), ev("b", 3));
/// assert!(outbox_types::check_first_delivery_order(&[a1.clone(), b1.clone(), a2.clone(), a1.clone()]).is_empty());
/// assert_eq!(outbox_types::check_first_delivery_order(&[a2, b1, a1]).len(), 1);
/// ```
pub fn check_first_delivery_order(delivered: &[Event]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mut last: std::collections::HashMap<(&str, &str), i64> = std::collections::HashMap::new();
    let mut violations = Vec::new();
    for e in delivered {
        if !seen.insert(e.id) {
            continue;
        }
        let key = (e.aggregate_type.as_str(), e.aggregate_id.as_str());
        if let Some(prev) = last.insert(key, e.seq)
            && e.seq < prev
        {
            violations.push(format!(
                "aggregate {}/{}: seq {} first delivered after seq {}",
                key.0, key.1, e.seq, prev
            ));
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_checked_against_the_w3c_format() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(is_valid_traceparent(ok));
        assert!(is_valid_traceparent(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
        ] {
            assert!(!is_valid_traceparent(bad), "{bad}");
        }
        let e = NewEvent::new("a", "1", "T", &1)
            .unwrap()
            .with_traceparent(ok, Some("congo=t61rcWkgMzE"))
            .unwrap();
        assert_eq!(e.headers()["tracestate"], "congo=t61rcWkgMzE");
        let err = NewEvent::new("a", "1", "T", &1)
            .unwrap()
            .with_traceparent("nope", None)
            .unwrap_err();
        assert!(err.to_string().contains("not a W3C traceparent"), "{err}");
    }

    #[test]
    fn unserializable_payload_is_rejected_before_any_write() {
        let mut bad = std::collections::HashMap::new();
        bad.insert(vec![1u8], 1);
        let err = NewEvent::new("order", "1", "OrderCreated", &bad).unwrap_err();
        assert!(matches!(err, EncodeError::Serialize(_)), "{err}");
    }

    #[test]
    fn empty_fields_are_rejected() {
        assert!(matches!(
            NewEvent::new("", "1", "T", &1).unwrap_err(),
            EncodeError::Empty("aggregate_type")
        ));
        assert!(matches!(
            NewEvent::new("a", "", "T", &1).unwrap_err(),
            EncodeError::Empty("aggregate_id")
        ));
        assert!(matches!(
            NewEvent::new("a", "1", "", &1).unwrap_err(),
            EncodeError::Empty("event_type")
        ));
    }

    #[test]
    fn states_round_trip_through_their_names() {
        for state in EventState::ALL {
            assert_eq!(state.as_str().parse::<EventState>().unwrap(), state);
        }
        assert!("sent".parse::<EventState>().is_err());
    }

    #[test]
    fn short_errors_are_kept_whole() {
        assert_eq!(truncate_error("boom"), "boom");
        let exact = "x".repeat(MAX_LAST_ERROR_LEN);
        assert_eq!(truncate_error(&exact), exact);
    }

    #[test]
    fn ids_are_time_ordered() {
        let a = EventId::new();
        let b = EventId::new();
        assert!(a < b);
        assert_eq!(a.to_string().parse::<EventId>().unwrap(), a);
    }
}
