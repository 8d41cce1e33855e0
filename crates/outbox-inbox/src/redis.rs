//! Redis Streams adapter (consumer groups): `XACK` after the consumer's commit.
//!
//! [`poll`] runs one round, [`run`] loops it. Each round first takes back entries that failed
//! earlier, or that a crashed consumer of the group left pending, with `XAUTOCLAIM` (entries
//! idle for at least [`AdapterOptions::retry_delay`]), then reads new ones with
//! `XREADGROUP … >`. For each entry: the event id comes from the `id` field (as the outbox Redis
//! sink writes it), the body from `payload`, every other field becomes a header. The
//! [`InboxHandler`] claims the id and runs the effect in one committed transaction; only then
//! is the entry `XACK`ed. A duplicate is acked without running the effect. A failed entry is
//! simply left pending: it comes back through `XAUTOCLAIM` after the retry delay.
//!
//! **Attempts** are Redis' own delivery counter (`XPENDING`'s times-delivered, which
//! `XREADGROUP` sets to 1 and every `XAUTOCLAIM` increments), so they survive restarts and are
//! shared by every consumer in the group. At [`AdapterOptions::max_attempts`] the entry is
//! written to `<table>_parked` and acked.
//!
//! `XREADGROUP` blocks its connection for up to the retry delay (at most 1 s): give the adapter
//! a connection of its own rather than the application's shared multiplexed one.

use std::collections::BTreeMap;

use redis::Value;
use redis::aio::MultiplexedConnection;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamPendingCountReply, StreamReadReply};

use crate::consumer::{RawMessage, parse_event_id, settle};
use crate::{AdapterOptions, Error, HandlerOutcome, InboxHandler};

fn broker(what: &str, e: redis::RedisError) -> Error {
    Error::Broker(format!("Redis {what} failed: {e}"))
}

/// Create the consumer group `group` on `stream` (and the stream) if it does not exist yet,
/// starting at the beginning of the stream.
///
/// ```no_run
/// # async fn demo(mut conn: redis::aio::MultiplexedConnection) -> Result<(), outbox_inbox::Error> {
/// outbox_inbox::redis::ensure_group(&mut conn, "events.OrderCreated", "billing").await?;
/// # Ok(()) }
/// ```
pub async fn ensure_group(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
) -> Result<(), Error> {
    let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match created {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        Err(e) => Err(broker("XGROUP CREATE", e)),
    }
}

fn field_string(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

async fn times_delivered(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    id: &str,
) -> Result<u32, Error> {
    let reply: StreamPendingCountReply = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg(id)
        .arg(id)
        .arg(1)
        .query_async(conn)
        .await
        .map_err(|e| broker("XPENDING", e))?;
    Ok(reply
        .ids
        .first()
        .map(|p| u32::try_from(p.times_delivered.max(1)).unwrap_or(u32::MAX))
        .unwrap_or(1))
}

async fn settle_entry<H: InboxHandler + ?Sized>(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    handler: &H,
    entry: &StreamId,
    options: &AdapterOptions,
) -> Result<HandlerOutcome, Error> {
    let attempt = times_delivered(conn, stream, group, &entry.id).await?;
    let mut headers = BTreeMap::new();
    let mut payload = Vec::new();
    for (name, value) in &entry.map {
        if name == "payload" {
            if let Value::BulkString(bytes) = value {
                payload = bytes.clone();
            }
        } else if let Some(value) = field_string(value) {
            headers.insert(name.clone(), value);
        }
    }
    let raw = RawMessage {
        event_id: parse_event_id(headers.get("id").map(String::as_str), "`id` field"),
        payload,
        headers,
        source: stream.to_owned(),
        attempt,
    };
    let outcome = settle(handler, raw, options).await;
    if outcome.is_acked() {
        let _: i64 = redis::cmd("XACK")
            .arg(stream)
            .arg(group)
            .arg(&entry.id)
            .query_async(conn)
            .await
            .map_err(|e| broker("XACK", e))?;
    }
    Ok(outcome)
}

/// One round on `stream` for `consumer` of `group`: reclaim entries idle for the retry delay
/// (`XAUTOCLAIM`), read new ones (`XREADGROUP`, blocking up to the retry delay, at most 1 s),
/// settle each. Returns what happened to each entry, in order.
///
/// ```no_run
/// # async fn demo(mut conn: redis::aio::MultiplexedConnection, handler: impl outbox_inbox::InboxHandler) -> Result<(), outbox_inbox::Error> {
/// let options = outbox_inbox::AdapterOptions::default();
/// outbox_inbox::redis::ensure_group(&mut conn, "orders", "billing").await?;
/// let outcomes = outbox_inbox::redis::poll(&mut conn, "orders", "billing", "billing-1", &handler, &options).await?;
/// # Ok(()) }
/// ```
pub async fn poll<H: InboxHandler + ?Sized>(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    consumer: &str,
    handler: &H,
    options: &AdapterOptions,
) -> Result<Vec<HandlerOutcome>, Error> {
    let idle_ms = u64::try_from(options.retry_delay.as_millis()).unwrap_or(u64::MAX);
    let batch = options.batch.max(1);
    let claimed: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
        .arg(stream)
        .arg(group)
        .arg(consumer)
        .arg(idle_ms)
        .arg("0-0")
        .arg("COUNT")
        .arg(batch)
        .query_async(conn)
        .await
        .map_err(|e| broker("XAUTOCLAIM", e))?;
    let mut entries = claimed.claimed;
    if entries.len() < batch {
        let read: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg(consumer)
            .arg("COUNT")
            .arg(batch - entries.len())
            .arg("BLOCK")
            .arg(idle_ms.clamp(1, 1000))
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(conn)
            .await
            .map_err(|e| broker("XREADGROUP", e))?;
        if let Some(read) = read {
            entries.extend(read.keys.into_iter().flat_map(|k| k.ids));
        }
    }
    let mut outcomes = Vec::with_capacity(entries.len());
    for entry in &entries {
        outcomes.push(settle_entry(conn, stream, group, handler, entry, options).await?);
    }
    Ok(outcomes)
}

/// [`poll`] forever. Broker errors are logged and retried after the retry delay; returns only
/// on an error that is not transient.
///
/// ```no_run
/// # async fn demo(mut conn: redis::aio::MultiplexedConnection, handler: impl outbox_inbox::InboxHandler) -> Result<(), outbox_inbox::Error> {
/// let options = outbox_inbox::AdapterOptions::default();
/// outbox_inbox::redis::ensure_group(&mut conn, "orders", "billing").await?;
/// outbox_inbox::redis::run(&mut conn, "orders", "billing", "billing-1", &handler, &options).await?;
/// # Ok(()) }
/// ```
pub async fn run<H: InboxHandler + ?Sized>(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    consumer: &str,
    handler: &H,
    options: &AdapterOptions,
) -> Result<(), Error> {
    loop {
        if let Err(error) = poll(conn, stream, group, consumer, handler, options).await {
            if !error.is_transient() {
                return Err(error);
            }
            tracing::warn!(error = %error, stream, group, "Redis stream round failed; retrying.");
            tokio::time::sleep(options.retry_delay).await;
        }
    }
}
