//! NATS JetStream adapter: ack after the consumer's commit.
//!
//! [`run`] pulls messages from a JetStream pull consumer; [`handle_message`] settles one. For
//! each message: the event id comes from the `outbox-event-id` header; the [`InboxHandler`]
//! claims it and runs the effect in one committed transaction; only then is the message acked
//! (`double_ack`, which waits for the server's confirmation). A duplicate is acked without
//! running the effect.
//!
//! **Attempts** are JetStream's own delivery counter (`info().delivered`), so they survive
//! consumer restarts and are shared by every instance of a durable consumer. A failure below
//! [`AdapterOptions::max_attempts`] is nak'ed with [`AdapterOptions::retry_delay`]; at the last
//! attempt the message is parked (`<table>_parked`) and acked. Configure the JetStream consumer
//! with `ack_policy = explicit` and `max_deliver` greater than `max_attempts` (or unlimited,
//! the default): if the server's limit is lower, it stops redelivering before the inbox parks.
//! An `ack_wait` longer than the slowest effect avoids needless redeliveries (they are harmless:
//! the inbox drops them).

use std::collections::BTreeMap;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Message};
use futures::StreamExt;
use outbox_types::routing::header;

use crate::consumer::{RawMessage, parse_event_id, settle};
use crate::{AdapterOptions, Error, HandlerOutcome, InboxHandler};

/// Settle one JetStream message: handle it through `handler`, then ack (applied, duplicate,
/// parked) or nak with the retry delay (failed, attempts left). `Err` only when the ack or nak
/// itself failed; the message then comes back after `ack_wait` and the inbox sorts it out.
///
/// ```no_run
/// use futures::StreamExt;
/// # async fn demo(consumer: async_nats::jetstream::consumer::PullConsumer, handler: impl outbox_inbox::InboxHandler) -> Result<(), Box<dyn std::error::Error>> {
/// let options = outbox_inbox::AdapterOptions::default();
/// let mut messages = consumer.messages().await?;
/// while let Some(message) = messages.next().await {
///     let outcome = outbox_inbox::nats::handle_message(&handler, &message?, &options).await?;
///     println!("{outcome:?}");
/// }
/// # Ok(()) }
/// ```
pub async fn handle_message<H: InboxHandler + ?Sized>(
    handler: &H,
    message: &Message,
    options: &AdapterOptions,
) -> Result<HandlerOutcome, Error> {
    let mut headers = BTreeMap::new();
    let mut event_id = None;
    if let Some(map) = &message.headers {
        for (name, values) in map.iter() {
            if let Some(value) = values.first() {
                headers.insert(name.to_string(), value.as_str().to_owned());
            }
        }
        event_id = map.get(header::EVENT_ID).map(|v| v.as_str().to_owned());
    }
    let attempt = message
        .info()
        .map(|i| u32::try_from(i.delivered.max(1)).unwrap_or(u32::MAX))
        .unwrap_or(1);
    let raw = RawMessage {
        event_id: parse_event_id(event_id.as_deref(), "`outbox-event-id` header"),
        payload: message.payload.to_vec(),
        headers,
        source: message.subject.to_string(),
        attempt,
    };
    let outcome = settle(handler, raw, options).await;
    if outcome.is_acked() {
        message
            .double_ack()
            .await
            .map_err(|e| Error::Broker(format!("JetStream ack failed: {e}")))?;
    } else {
        message
            .ack_with(AckKind::Nak(Some(options.retry_delay)))
            .await
            .map_err(|e| Error::Broker(format!("JetStream nak failed: {e}")))?;
    }
    Ok(outcome)
}

/// Consume `consumer` until its message stream ends, settling every message with
/// [`handle_message`]. Errors of single messages (a failed ack, a missed heartbeat) are logged
/// and consumption goes on; `Err` only when the stream cannot be opened.
///
/// ```no_run
/// # async fn demo(consumer: async_nats::jetstream::consumer::PullConsumer, handler: impl outbox_inbox::InboxHandler) -> Result<(), outbox_inbox::Error> {
/// outbox_inbox::nats::run(&consumer, &handler, &outbox_inbox::AdapterOptions::default()).await?;
/// # Ok(()) }
/// ```
pub async fn run<H: InboxHandler + ?Sized>(
    consumer: &PullConsumer,
    handler: &H,
    options: &AdapterOptions,
) -> Result<(), Error> {
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| Error::Broker(format!("JetStream consumer stream: {e}")))?;
    while let Some(message) = messages.next().await {
        match message {
            Ok(message) => {
                if let Err(error) = handle_message(handler, &message, options).await {
                    tracing::warn!(error = %error, "JetStream message not settled; it will be redelivered.");
                }
            }
            Err(error) => {
                tracing::warn!(error = %error, "JetStream consumer stream error.");
            }
        }
    }
    Ok(())
}
