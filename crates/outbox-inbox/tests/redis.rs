//! The Redis Streams adapter against the machine's Redis (`OUTBOX_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`); every test uses its own stream.

#![cfg(all(feature = "redis", feature = "sqlite"))]

mod common;

use std::time::Duration;

use outbox_inbox::{AdapterOptions, EventId};
use redis::aio::MultiplexedConnection;

use common::{eventually, fixture, unique};

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

#[tokio::test]
async fn same_event_twice_applies_once_and_acks() {
    let f = fixture().await;
    let mut conn = connection().await;
    let stream = unique("inbox_s");
    outbox_inbox::redis::ensure_group(&mut conn, &stream, "billing")
        .await
        .unwrap();
    let id = EventId::new();
    add(&mut conn, &stream, Some(id), r#"{"n":1}"#).await;
    add(&mut conn, &stream, Some(id), r#"{"n":1}"#).await;

    let handler = f.handler();
    let runner = {
        let stream = stream.clone();
        tokio::spawn(async move {
            let mut conn = connection().await;
            outbox_inbox::redis::run(
                &mut conn,
                &stream,
                "billing",
                "c1",
                &handler,
                &AdapterOptions::default(),
            )
            .await
        })
    };
    assert!(eventually(Duration::from_secs(15), || drained(&stream, "billing")).await);
    runner.abort();
    assert_eq!(f.effects().await, 1);
    assert!(f.parked().await.is_empty());
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn always_failing_handler_is_parked_after_max_attempts_and_acked() {
    let f = fixture().await;
    let mut conn = connection().await;
    let stream = unique("inbox_s");
    outbox_inbox::redis::ensure_group(&mut conn, &stream, "billing")
        .await
        .unwrap();
    let id = EventId::new();
    add(&mut conn, &stream, Some(id), r#"{"n":2}"#).await;

    let handler = f.failing_handler();
    let options = AdapterOptions::default()
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(100));
    let runner = {
        let stream = stream.clone();
        tokio::spawn(async move {
            let mut conn = connection().await;
            outbox_inbox::redis::run(&mut conn, &stream, "billing", "c1", &handler, &options).await
        })
    };
    assert!(
        eventually(Duration::from_secs(20), || async {
            !f.parked().await.is_empty()
        })
        .await
    );
    assert!(eventually(Duration::from_secs(10), || drained(&stream, "billing")).await);
    runner.abort();
    let parked = f.parked().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].event_id, Some(id));
    assert_eq!(parked[0].attempts, 3);
    assert_eq!(parked[0].payload, br#"{"n":2}"#);
    assert!(parked[0].error.contains("downstream rejected"));
    assert_eq!(f.effects().await, 0);
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn entry_without_id_is_parked_at_once() {
    let f = fixture().await;
    let mut conn = connection().await;
    let stream = unique("inbox_s");
    outbox_inbox::redis::ensure_group(&mut conn, &stream, "billing")
        .await
        .unwrap();
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
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn failed_first_delivery_is_reclaimed_and_applied_once() {
    let f = fixture().await;
    let mut conn = connection().await;
    let stream = unique("inbox_s");
    outbox_inbox::redis::ensure_group(&mut conn, &stream, "billing")
        .await
        .unwrap();
    add(&mut conn, &stream, Some(EventId::new()), r#"{"n":3}"#).await;
    let handler = f.flaky_handler();
    let options = AdapterOptions::default().with_retry_delay(Duration::from_millis(100));
    let runner = {
        let stream = stream.clone();
        tokio::spawn(async move {
            let mut conn = connection().await;
            outbox_inbox::redis::run(&mut conn, &stream, "billing", "c1", &handler, &options).await
        })
    };
    assert!(eventually(Duration::from_secs(15), || async { f.effects().await == 1 }).await);
    assert!(eventually(Duration::from_secs(10), || drained(&stream, "billing")).await);
    runner.abort();
    assert_eq!(f.effects().await, 1);
    assert!(f.parked().await.is_empty());
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();
}
