//! The Redis Streams adapter against the machine's Redis (`OUTBOX_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`); every test uses its own stream. The scenarios every broker passes
//! are in `common`; here: its channel and what only Redis tests (`poll`'s answer).

#![cfg(all(feature = "redis", feature = "sqlite"))]

mod common;

use std::time::Duration;

use outbox_inbox::{AdapterOptions, EventId, InboxHandler};
use redis::aio::MultiplexedConnection;

use common::{Channel, Runner, eventually, fixture};
use outbox_testkit::unique;

async fn connection() -> MultiplexedConnection {
    let url =
        std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis must be running on 127.0.0.1:6379")
}

async fn add(conn: &mut MultiplexedConnection, stream: &str, id: Option<EventId>, payload: &str) {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    if let Some(id) = id {
        cmd.arg("id").arg(id.to_string());
    }
    cmd.arg("type")
        .arg("OrderCreated")
        .arg("payload")
        .arg(payload);
    let _: String = cmd.query_async(conn).await.unwrap();
}

/// Entries of `group` still pending (delivered, not acked).
async fn pending(conn: &mut MultiplexedConnection, stream: &str, group: &str) -> i64 {
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(conn)
        .await
        .unwrap();
    match reply {
        redis::Value::Array(items) => match items.first() {
            Some(redis::Value::Int(n)) => *n,
            _ => -1,
        },
        _ => -1,
    }
}

/// Entries of `group` not yet delivered.
async fn lag(conn: &mut MultiplexedConnection, stream: &str, group: &str) -> i64 {
    let len: i64 = redis::cmd("XLEN")
        .arg(stream)
        .query_async(conn)
        .await
        .unwrap();
    let groups: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await
        .unwrap();
    for g in groups {
        let mut name = None;
        let mut entries_read = None;
        for pair in g.chunks(2) {
            if let [redis::Value::BulkString(k), v] = pair {
                match (k.as_slice(), v) {
                    (b"name", redis::Value::BulkString(n)) => name = Some(n.clone()),
                    (b"entries-read", redis::Value::Int(n)) => entries_read = Some(*n),
                    _ => {}
                }
            }
        }
        if name.as_deref() == Some(group.as_bytes()) {
            return len - entries_read.unwrap_or(0);
        }
    }
    -1
}

async fn drained(stream: &str, group: &str) -> bool {
    let mut conn = connection().await;
    lag(&mut conn, stream, group).await == 0 && pending(&mut conn, stream, group).await == 0
}

/// A new stream with the consumer group `billing`.
async fn new_stream(conn: &mut MultiplexedConnection) -> String {
    let stream = unique("inbox_s");
    outbox_inbox::redis::ensure_group(conn, &stream, "billing")
        .await
        .unwrap();
    stream
}

async fn delete(conn: &mut MultiplexedConnection, stream: &str) {
    let _: i64 = redis::cmd("DEL")
        .arg(stream)
        .query_async(conn)
        .await
        .unwrap();
}

/// A stream of its own with the consumer group `billing`, read by consumer `c1`.
struct Stream {
    conn: MultiplexedConnection,
    stream: String,
}

impl Channel for Stream {
    async fn open() -> Stream {
        let mut conn = connection().await;
        let stream = new_stream(&mut conn).await;
        Stream { conn, stream }
    }

    async fn publish(&mut self, id: Option<EventId>, body: &'static str) {
        add(&mut self.conn, &self.stream, id, body).await;
    }

    fn spawn_run(&self, handler: impl InboxHandler + 'static, options: AdapterOptions) -> Runner {
        let stream = self.stream.clone();
        tokio::spawn(async move {
            let mut conn = connection().await;
            outbox_inbox::redis::run(&mut conn, &stream, "billing", "c1", &handler, &options).await
        })
    }

    /// Every entry delivered and acked.
    async fn wait_settled(&self, timeout: Duration) -> bool {
        eventually(timeout, || drained(&self.stream, "billing")).await
    }

    async fn delete(mut self) {
        delete(&mut self.conn, &self.stream).await;
    }
}

common::channel_tests!(Stream; failed_first_delivery_is_reclaimed_and_applied_once);

#[tokio::test]
async fn entry_without_id_is_parked_at_once() {
    let f = fixture().await;
    let mut conn = connection().await;
    let stream = new_stream(&mut conn).await;
    add(&mut conn, &stream, None, "junk").await;
    let handler = f.handler();
    let outcomes = outbox_inbox::redis::poll(
        &mut conn,
        &stream,
        "billing",
        "c1",
        &handler,
        &AdapterOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(outcomes.len(), 1);
    assert!(matches!(outcomes[0], outbox_inbox::HandlerOutcome::Parked));
    assert_eq!(pending(&mut conn, &stream, "billing").await, 0);
    delete(&mut conn, &stream).await;
}
