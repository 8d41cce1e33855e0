//! What the broker adapters share: the message they hand over ([`Delivery`]), the handler they
//! call ([`InboxHandler`]), the poison policy ([`AdapterOptions`]) and what happened to a
//! message ([`HandlerOutcome`]).
//!
//! Why a trait between adapters and databases: an adapter only needs "apply this message in a
//! committed transaction, or tell me it was a duplicate" and "park this message"; it must not
//! care which database the inbox lives in. Each database module ships a ready implementation
//! (`PgHandler`, `MySqlHandler`, `SqliteHandler`) that runs a closure as the effect inside the
//! inbox transaction; implement the trait yourself for anything else.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use outbox_types::EventId;
use uuid::Uuid;

use crate::{Error, Processed};

/// One broker message, as an adapter hands it to an [`InboxHandler`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivery {
    /// The event id from the `outbox-event-id` header (Redis: the `id` field).
    pub event_id: EventId,
    /// The message body, as published (the event's JSON payload or a CloudEvents envelope).
    pub payload: Vec<u8>,
    /// The message headers (Redis: the entry's fields other than `payload`).
    pub headers: BTreeMap<String, String>,
    /// Where it came from: the subject, queue or stream.
    pub source: String,
    /// Which delivery of this message this is, starting at 1.
    pub attempt: u32,
}

impl Delivery {
    /// A delivery, for handlers tested without a broker.
    ///
    /// ```
    /// let d = outbox_inbox::Delivery::new(outbox_inbox::EventId::new(), b"{}".to_vec(), "orders");
    /// assert_eq!(d.attempt, 1);
    /// ```
    pub fn new(event_id: EventId, payload: Vec<u8>, source: impl Into<String>) -> Self {
        Delivery {
            event_id,
            payload,
            headers: BTreeMap::new(),
            source: source.into(),
            attempt: 1,
        }
    }

    /// The payload parsed as JSON.
    ///
    /// ```
    /// let d = outbox_inbox::Delivery::new(outbox_inbox::EventId::new(), br#"{"a":1}"#.to_vec(), "s");
    /// let v: serde_json::Value = d.json().unwrap();
    /// assert_eq!(v["a"], 1);
    /// ```
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| Error::BadMessage(format!("payload is not the expected JSON: {e}")))
    }
}

/// A message given up on: written to `<table>_parked` and then acked.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedMessage {
    /// The event id, when the message had a readable one.
    pub event_id: Option<EventId>,
    /// The subject, queue or stream it came from.
    pub source: String,
    /// The message body.
    pub payload: Vec<u8>,
    /// The message headers.
    pub headers: BTreeMap<String, String>,
    /// How many times it was delivered.
    pub attempts: u32,
    /// The last error.
    pub error: String,
}

impl ParkedMessage {
    /// A parked-message record.
    ///
    /// ```
    /// let p = outbox_inbox::ParkedMessage::new(None, "orders", b"x".to_vec(), 1, "no outbox-event-id header");
    /// assert_eq!(p.attempts, 1);
    /// ```
    pub fn new(
        event_id: Option<EventId>,
        source: impl Into<String>,
        payload: Vec<u8>,
        attempts: u32,
        error: impl Into<String>,
    ) -> Self {
        ParkedMessage {
            event_id,
            source: source.into(),
            payload,
            headers: BTreeMap::new(),
            attempts,
            error: error.into(),
        }
    }
}

/// The contract between a broker adapter and the consumer's database.
#[async_trait]
pub trait InboxHandler: Send + Sync {
    /// Apply `delivery`: claim `(event_id, handler)` and run the effect in one transaction and
    /// **commit** before returning `Ok`. A duplicate returns `Ok(Processed::Duplicate)` without
    /// running the effect. On `Err` nothing may have been committed.
    async fn handle(&self, delivery: &Delivery) -> Result<Processed<()>, Error>;

    /// Durably record a poison message (commit before returning `Ok`); the adapter acks it
    /// afterwards.
    async fn park(&self, message: &ParkedMessage) -> Result<(), Error>;
}

#[async_trait]
impl<H: InboxHandler + ?Sized> InboxHandler for std::sync::Arc<H> {
    async fn handle(&self, delivery: &Delivery) -> Result<Processed<()>, Error> {
        (**self).handle(delivery).await
    }

    async fn park(&self, message: &ParkedMessage) -> Result<(), Error> {
        (**self).park(message).await
    }
}

/// How an adapter treats failures.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdapterOptions {
    /// Deliveries of one message before it is parked (default 5, at least 1).
    pub max_attempts: u32,
    /// How long a failed message waits before it is delivered again (default 1 s): the NATS
    /// nak delay, the Redis min-idle time before it is claimed again, the RabbitMQ pause
    /// before the nack.
    pub retry_delay: Duration,
    /// Messages fetched per round trip (default 16).
    pub batch: usize,
}

impl Default for AdapterOptions {
    fn default() -> Self {
        AdapterOptions {
            max_attempts: 5,
            retry_delay: Duration::from_secs(1),
            batch: 16,
        }
    }
}

impl AdapterOptions {
    /// Park after `n` deliveries (`n` is raised to 1).
    ///
    /// ```
    /// let o = outbox_inbox::AdapterOptions::default().with_max_attempts(3);
    /// assert_eq!(o.max_attempts, 3);
    /// ```
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// Wait `delay` before a failed message comes back.
    ///
    /// ```
    /// let o = outbox_inbox::AdapterOptions::default().with_retry_delay(std::time::Duration::from_millis(100));
    /// assert_eq!(o.retry_delay.as_millis(), 100);
    /// ```
    pub fn with_retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Fetch up to `n` messages per round trip (`n` is raised to 1).
    ///
    /// ```
    /// let o = outbox_inbox::AdapterOptions::default().with_batch(1);
    /// assert_eq!(o.batch, 1);
    /// ```
    pub fn with_batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }
}

/// What an adapter did with one message. Named `HandlerOutcome`, not `Outcome`, because
/// `outbox_types::Outcome` is what a sink reports to the relay.
#[derive(Debug)]
#[non_exhaustive]
pub enum HandlerOutcome {
    /// The effect ran and committed; the message was acked.
    Applied,
    /// Already processed; acked without running the effect.
    Duplicate,
    /// Given up on: written to the parked table, then acked.
    Parked,
    /// Failed; not acked, the broker delivers it again.
    Retry(Error),
}

/// The old name of [`HandlerOutcome`].
#[deprecated(note = "renamed to HandlerOutcome")]
pub type Outcome = HandlerOutcome;

impl HandlerOutcome {
    /// Whether the adapter acked the message.
    ///
    /// ```
    /// assert!(outbox_inbox::HandlerOutcome::Duplicate.is_acked());
    /// ```
    pub fn is_acked(&self) -> bool {
        !matches!(self, HandlerOutcome::Retry(_))
    }
}

/// A message as read off the broker, before it is known to be well formed.
#[allow(dead_code)]
pub(crate) struct RawMessage {
    pub event_id: Result<EventId, String>,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
    pub source: String,
    pub attempt: u32,
}

/// Parse an `outbox-event-id` value.
#[allow(dead_code)]
pub(crate) fn parse_event_id(value: Option<&str>, what: &str) -> Result<EventId, String> {
    match value {
        None => Err(format!(
            "the message has no {what}; it cannot be deduplicated"
        )),
        Some(v) => Uuid::parse_str(v.trim())
            .map(EventId::from_uuid)
            .map_err(|e| format!("{what} `{v}` is not a UUID: {e}")),
    }
}

/// Decide what happens to one message; the adapter acks unless the outcome is `Retry`.
#[allow(dead_code)]
pub(crate) async fn settle<H: InboxHandler + ?Sized>(
    handler: &H,
    raw: RawMessage,
    options: &AdapterOptions,
) -> HandlerOutcome {
    let (event_id, failure) = match raw.event_id {
        Ok(event_id) => {
            let delivery = Delivery {
                event_id,
                payload: raw.payload,
                headers: raw.headers,
                source: raw.source,
                attempt: raw.attempt,
            };
            match handler.handle(&delivery).await {
                Ok(Processed::Applied(())) => return HandlerOutcome::Applied,
                Ok(Processed::Duplicate) => return HandlerOutcome::Duplicate,
                Err(error)
                    if error.is_transient() && delivery.attempt < options.max_attempts.max(1) =>
                {
                    tracing::warn!(event_id = %event_id, attempt = delivery.attempt, source = %delivery.source, error = %error, "Inbox handler failed; the message will be delivered again.");
                    return HandlerOutcome::Retry(error);
                }
                Err(error) => {
                    let parked = ParkedMessage {
                        event_id: Some(event_id),
                        source: delivery.source,
                        payload: delivery.payload,
                        headers: delivery.headers,
                        attempts: delivery.attempt,
                        error: error.to_string(),
                    };
                    (Some(event_id), parked)
                }
            }
        }
        Err(reason) => (
            None,
            ParkedMessage {
                event_id: None,
                source: raw.source,
                payload: raw.payload,
                headers: raw.headers,
                attempts: raw.attempt,
                error: reason,
            },
        ),
    };
    match handler.park(&failure).await {
        Ok(()) => {
            tracing::error!(event_id = ?event_id.map(|e| e.to_string()), attempts = failure.attempts, source = %failure.source, error = %failure.error, "Inbox parked a poison message.");
            HandlerOutcome::Parked
        }
        Err(error) => {
            tracing::warn!(error = %error, "Parking a poison message failed; it will be delivered again.");
            HandlerOutcome::Retry(error)
        }
    }
}
