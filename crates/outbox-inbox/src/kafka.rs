//! Kafka adapter (`rdkafka`): commit the offset after the consumer's commit.
//!
//! [`run`] reads a [`StreamConsumer`] (configure it with `enable.auto.commit=false`);
//! [`handle_message`] settles one message. The event id comes from the `outbox-event-id`
//! header. The [`InboxHandler`] claims it and runs the effect in one committed transaction;
//! only then is the message's offset committed (`commit_message` in asynchronous mode: the
//! commit is requested after the database commit and librdkafka sends it in the background; a
//! synchronous commit would block a runtime worker thread inside async code for the broker's
//! round trip — or for good, when a broker never answers). A duplicate is committed without
//! running the effect. After a crash, or a commit the broker never got, uncommitted offsets are
//! read again and the inbox drops what was already applied.
//!
//! **Attempts.** Kafka has no per-message redelivery (a partition is a log; not committing only
//! matters after a restart or rebalance), so the adapter retries a failed message in place,
//! [`AdapterOptions::retry_delay`] apart, counting attempts itself; at
//! [`AdapterOptions::max_attempts`] it writes the message to `<table>_parked` and commits its
//! offset. Retrying in place holds back the rest of that partition meanwhile, which is what
//! keeps per-aggregate order (the outbox's Kafka sink keys messages by aggregate id).

use std::collections::BTreeMap;

use outbox_types::routing::header;
use rdkafka::Message;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers};

use crate::consumer::{RawMessage, parse_event_id, settle};
use crate::{AdapterOptions, Error, HandlerOutcome, InboxHandler};

/// Settle one message: handle it through `handler`, retrying in place up to
/// [`AdapterOptions::max_attempts`], then commit its offset (applied, duplicate, parked). `Err`
/// when the offset commit failed (the message is then read again after a restart and dropped
/// by the inbox) or parking failed (the offset is not committed).
///
/// ```no_run
/// use rdkafka::consumer::StreamConsumer;
/// # async fn demo(consumer: StreamConsumer, handler: impl outbox_inbox::InboxHandler) -> Result<(), Box<dyn std::error::Error>> {
/// let options = outbox_inbox::AdapterOptions::default();
/// loop {
///     let message = consumer.recv().await?;
///     outbox_inbox::kafka::handle_message(&consumer, &handler, &message, &options).await?;
/// }
/// # }
/// ```
pub async fn handle_message<H: InboxHandler + ?Sized>(
    consumer: &StreamConsumer,
    handler: &H,
    message: &BorrowedMessage<'_>,
    options: &AdapterOptions,
) -> Result<HandlerOutcome, Error> {
    let mut headers = BTreeMap::new();
    if let Some(hs) = message.headers() {
        for h in hs.iter() {
            if let Some(value) = h.value {
                headers.insert(
                    h.key.to_owned(),
                    String::from_utf8_lossy(value).into_owned(),
                );
            }
        }
    }
    let payload = message.payload().map(<[u8]>::to_vec).unwrap_or_default();
    let source = message.topic().to_owned();
    let mut attempt = 1;
    loop {
        let raw = RawMessage {
            event_id: parse_event_id(
                headers.get(header::EVENT_ID).map(String::as_str),
                "`outbox-event-id` header",
            ),
            payload: payload.clone(),
            headers: headers.clone(),
            source: source.clone(),
            attempt,
        };
        match settle(handler, raw, options).await {
            HandlerOutcome::Retry(error) if attempt < options.max_attempts.max(1) => {
                tracing::debug!(error = %error, attempt, "Retrying Kafka message in place.");
                attempt += 1;
                tokio::time::sleep(options.retry_delay).await;
            }
            HandlerOutcome::Retry(error) => return Err(error),
            outcome => {
                consumer
                    .commit_message(message, CommitMode::Async)
                    .map_err(|e| Error::Broker(format!("Kafka offset commit failed: {e}")))?;
                return Ok(outcome);
            }
        }
    }
}

/// Read `consumer` forever, settling every message with [`handle_message`]. A message that
/// could not be settled (the database is down, so it could neither be applied nor parked) is
/// retried after the retry delay until it is, so the partition never skips it. `Err` only when
/// the consumer fails with a non-transient error.
///
/// ```no_run
/// use rdkafka::ClientConfig;
/// use rdkafka::consumer::{Consumer, StreamConsumer};
/// # async fn demo(handler: impl outbox_inbox::InboxHandler) -> Result<(), Box<dyn std::error::Error>> {
/// let consumer: StreamConsumer = ClientConfig::new()
///     .set("bootstrap.servers", "127.0.0.1:9092")
///     .set("group.id", "billing")
///     .set("enable.auto.commit", "false")
///     .create()?;
/// consumer.subscribe(&["orders"])?;
/// outbox_inbox::kafka::run(&consumer, &handler, &outbox_inbox::AdapterOptions::default()).await?;
/// # Ok(()) }
/// ```
pub async fn run<H: InboxHandler + ?Sized>(
    consumer: &StreamConsumer,
    handler: &H,
    options: &AdapterOptions,
) -> Result<(), Error> {
    loop {
        let message = match consumer.recv().await {
            Ok(message) => message,
            Err(error) => {
                tracing::warn!(error = %error, "Kafka consumer error.");
                tokio::time::sleep(options.retry_delay).await;
                continue;
            }
        };
        while let Err(error) = handle_message(consumer, handler, &message, options).await {
            if !error.is_transient() {
                return Err(error);
            }
            tracing::warn!(error = %error, topic = message.topic(), partition = message.partition(), offset = message.offset(), "Kafka message not settled; retrying.");
            tokio::time::sleep(options.retry_delay).await;
        }
    }
}
