//! RabbitMQ adapter (AMQP 0-9-1 via `lapin`): `basic.ack` after the consumer's commit,
//! `basic.nack` with requeue on failure, park after the last attempt.
//!
//! [`run`] consumes a queue (manual acks, prefetch [`AdapterOptions::batch`]);
//! [`handle_delivery`] settles one delivery. The event id comes from the `outbox-event-id`
//! header (as the outbox RabbitMQ sink writes it). The [`InboxHandler`] claims it and runs the
//! effect in one committed transaction; only then is the delivery acked. A duplicate is acked
//! without running the effect.
//!
//! **Attempts.** AMQP 0-9-1 itself only has the `redelivered` flag, so the adapter decides:
//! - on a **quorum queue** RabbitMQ adds `x-delivery-count` (deliveries returned so far) to a
//!   redelivered message: the attempt is that count plus one — durable, and shared by every
//!   consumer of the queue. Recommended.
//! - on a **classic queue** there is no counter. The adapter counts per event id in memory
//!   ([`Attempts`]): the first delivery (`redelivered = false`) is attempt 1, each redelivery
//!   adds one. The count is lost on restart and is per process, so a poison message may be
//!   tried up to `max_attempts` times per consumer process before it is parked — still bounded,
//!   never an endless loop.
//!
//! A failed delivery is nack'ed with requeue after [`AdapterOptions::retry_delay`] (the nack is
//! sent from a spawned task, so the consumer keeps working meanwhile). At the last attempt the
//! message is written to `<table>_parked` and acked. With a quorum queue, keep its
//! `x-delivery-limit` above `max_attempts` (RabbitMQ 4 defaults it to 20), or the broker drops
//! or dead-letters the message before the inbox parks it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use futures::StreamExt;
use lapin::Channel;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use outbox_types::EventId;
use outbox_types::routing::header;

use crate::consumer::{RawMessage, parse_event_id, settle};
use crate::{AdapterOptions, Error, HandlerOutcome, InboxHandler};

/// The most event ids [`Attempts`] remembers; beyond that it starts over (an attempt count is
/// then underestimated, which only delays parking).
const MAX_TRACKED: usize = 100_000;

/// In-process attempt counts for queues without `x-delivery-count` (classic queues).
#[derive(Debug, Default)]
pub struct Attempts {
    counts: Mutex<HashMap<EventId, u32>>,
}

impl Attempts {
    /// An empty counter.
    ///
    /// ```
    /// let attempts = outbox_inbox::rabbitmq::Attempts::new();
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    fn next(&self, event_id: EventId, redelivered: bool) -> u32 {
        let Ok(mut counts) = self.counts.lock() else {
            return 1;
        };
        if counts.len() >= MAX_TRACKED {
            counts.clear();
        }
        let count = counts.entry(event_id).or_insert(0);
        *count = if redelivered {
            // A redelivery never seen before (e.g. after a restart) is at least the second.
            (*count).max(1).saturating_add(1)
        } else {
            1
        };
        *count
    }

    fn forget(&self, event_id: EventId) {
        if let Ok(mut counts) = self.counts.lock() {
            counts.remove(&event_id);
        }
    }
}

fn value_to_string(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::Boolean(b) => Some(b.to_string()),
        other => value_to_u64(other).map(|n| n.to_string()),
    }
}

fn value_to_u64(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

fn header_map(headers: Option<&FieldTable>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(table) = headers {
        for (name, value) in table.inner() {
            if let Some(value) = value_to_string(value) {
                out.insert(name.as_str().to_owned(), value);
            }
        }
    }
    out
}

/// Settle one delivery from `queue`: handle it through `handler`, then ack (applied, duplicate,
/// parked) or nack with requeue after the retry delay (failed, attempts left). `Err` only when
/// the ack itself failed; the broker then redelivers and the inbox drops the duplicate.
///
/// ```no_run
/// use futures::StreamExt;
/// # async fn demo(channel: lapin::Channel, handler: impl outbox_inbox::InboxHandler) -> Result<(), Box<dyn std::error::Error>> {
/// let options = outbox_inbox::AdapterOptions::default();
/// let attempts = outbox_inbox::rabbitmq::Attempts::new();
/// let mut consumer = channel
///     .basic_consume("billing".into(), "".into(), Default::default(), Default::default())
///     .await?;
/// while let Some(delivery) = consumer.next().await {
///     let delivery = delivery?;
///     outbox_inbox::rabbitmq::handle_delivery(&handler, &delivery, "billing", &attempts, &options).await?;
/// }
/// # Ok(()) }
/// ```
pub async fn handle_delivery<H: InboxHandler + ?Sized>(
    handler: &H,
    delivery: &Delivery,
    queue: &str,
    attempts: &Attempts,
    options: &AdapterOptions,
) -> Result<HandlerOutcome, Error> {
    let table = delivery.properties.headers().as_ref();
    let headers = header_map(table);
    let event_id = parse_event_id(
        headers.get(header::EVENT_ID).map(String::as_str),
        "`outbox-event-id` header",
    );
    let broker_count = table
        .and_then(|t| t.inner().get("x-delivery-count"))
        .and_then(value_to_u64);
    let attempt = match (&event_id, broker_count) {
        (_, Some(returned)) => u32::try_from(returned.saturating_add(1)).unwrap_or(u32::MAX),
        (Ok(id), None) => attempts.next(*id, delivery.redelivered),
        (Err(_), None) => 1,
    };
    let raw = RawMessage {
        event_id: event_id.clone(),
        payload: delivery.data.clone(),
        headers,
        source: queue.to_owned(),
        attempt,
    };
    let outcome = settle(handler, raw, options).await;
    if outcome.is_acked() {
        if let Ok(id) = event_id {
            attempts.forget(id);
        }
        delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(|e| Error::Broker(format!("basic.ack failed: {e}")))?;
    } else {
        let acker = delivery.acker.clone();
        let delay = options.retry_delay;
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let nack = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            if let Err(error) = acker.nack(nack).await {
                tracing::warn!(error = %error, "basic.nack failed; the broker redelivers when the channel closes.");
            }
        });
    }
    Ok(outcome)
}

/// Consume `queue` on `channel` (manual acks, prefetch [`AdapterOptions::batch`]) until the
/// consumer is cancelled or the channel closes, settling every delivery with
/// [`handle_delivery`]. Errors of single deliveries are logged and consumption goes on.
///
/// ```no_run
/// # async fn demo(channel: lapin::Channel, handler: impl outbox_inbox::InboxHandler) -> Result<(), outbox_inbox::Error> {
/// outbox_inbox::rabbitmq::run(&channel, "billing", &handler, &outbox_inbox::AdapterOptions::default()).await?;
/// # Ok(()) }
/// ```
pub async fn run<H: InboxHandler + ?Sized>(
    channel: &Channel,
    queue: &str,
    handler: &H,
    options: &AdapterOptions,
) -> Result<(), Error> {
    let prefetch = u16::try_from(options.batch).unwrap_or(u16::MAX);
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| Error::Broker(format!("basic.qos failed: {e}")))?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| Error::Broker(format!("basic.consume on `{queue}` failed: {e}")))?;
    let attempts = Attempts::new();
    while let Some(delivery) = consumer.next().await {
        match delivery {
            Ok(delivery) => {
                if let Err(error) =
                    handle_delivery(handler, &delivery, queue, &attempts, options).await
                {
                    tracing::warn!(error = %error, queue, "RabbitMQ delivery not settled; it will be redelivered.");
                }
            }
            Err(error) => {
                return Err(Error::Broker(format!(
                    "consumer on `{queue}` failed: {error}"
                )));
            }
        }
    }
    Ok(())
}
