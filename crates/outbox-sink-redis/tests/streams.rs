//! Against the real Redis on 127.0.0.1:6379 and the real PostgreSQL outbox: exactly the committed
//! events are appended, with their fields, routing and per-aggregate order; a key of the wrong
//! type is a clear rejection that spares the rest of the pipeline; `MAXLEN ~` trims; a Redis
//! that is down at start-up (or goes away later) keeps the events pending until it is back.

use outbox_sink_tests as common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use outbox_engine::RelayConfig;
use outbox_sink_redis::RedisSink;
use outbox_types::{Outcome, Sink};
use redis::aio::MultiplexedConnection;
use redis::streams::StreamRangeReply;

const REDIS: &str = "redis://127.0.0.1:6379";

fn relay_config(stop_when_idle: bool) -> RelayConfig {
    common::relay_config("redis-test", stop_when_idle)
}

async fn redis() -> MultiplexedConnection {
    redis::Client::open(REDIS)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis must be running on 127.0.0.1:6379")
}

/// Every entry of `key` as (entry id, field → value).
async fn xrange(con: &mut MultiplexedConnection, key: &str) -> Vec<HashMap<String, String>> {
    let reply: StreamRangeReply = redis::cmd("XRANGE")
        .arg(key)
        .arg("-")
        .arg("+")
        .query_async(con)
        .await
        .unwrap();
    reply
        .ids
        .into_iter()
        .map(|entry| {
            entry
                .map
                .into_iter()
                .map(|(k, v)| (k, redis::from_redis_value::<String>(v).unwrap()))
                .collect()
        })
        .collect()
}

async fn del(con: &mut MultiplexedConnection, keys: &[&str]) {
    let _: () = redis::cmd("DEL").arg(keys).query_async(con).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_appends_exactly_the_committed_events_with_fields_and_order() {
    let store = Arc::new(common::fresh_store().await);
    let id = common::unique("t");
    let main_key = format!("outbox:{id}:Numbered");
    let audit_key = format!("outbox:{id}:audit");

    let (committed, committed_ids) =
        common::enqueue_with_ghosts(&store, common::special_event(audit_key.clone())).await;

    let sink = RedisSink::connect(common::config(serde_json::json!({
        "url": REDIS,
        "stream": format!("outbox:{id}:${{event_type}}"),
        "maxlen": 100000,
        "client_name": "outbox-sink-redis-test",
    })))
    .unwrap();
    sink.check().await.unwrap();
    let report = common::run_to_idle(&store, sink, relay_config(true)).await;
    common::assert_all_delivered(&store, &report, &committed).await;

    let mut con = redis().await;
    let main = xrange(&mut con, &main_key).await;
    let audit = xrange(&mut con, &audit_key).await;
    assert_eq!(main.len(), committed.len() - 1);
    assert_eq!(audit.len(), 1, "own destination wins");

    let got: HashSet<String> = main.iter().chain(&audit).map(|f| f["id"].clone()).collect();
    let want: HashSet<String> = committed_ids.iter().map(|i| i.to_string()).collect();
    assert_eq!(got, want, "exactly the committed events");

    let mut order = Vec::new();
    for fields in main.iter().chain(&audit) {
        assert_eq!(fields["type"], "Numbered");
        assert_eq!(fields["aggregate_type"], "agg");
        assert!(chrono::DateTime::parse_from_rfc3339(&fields["occurred_at"]).is_ok());
        let payload: serde_json::Value = serde_json::from_str(&fields["payload"]).unwrap();
        let aggregate = payload["aggregate"].as_str().unwrap().to_owned();
        assert_eq!(fields["key"], aggregate, "key = aggregate id");
        assert_ne!(aggregate, "ghost");
        let headers: HashMap<String, String> = serde_json::from_str(&fields["headers"]).unwrap();
        assert_eq!(headers["outbox-event-id"], fields["id"]);
        assert!(!headers.contains_key("Outbox-Event-Id"), "no forged twin");
        assert_eq!(headers["outbox-aggregate-id"], aggregate);
        if aggregate == "special" {
            assert_eq!(fields["idempotency_key"], "special-0");
            assert_eq!(headers["traceparent"], common::SPECIAL_TRACEPARENT);
        } else {
            assert!(!fields.contains_key("idempotency_key"));
        }
        order.push((aggregate, payload["n"].as_u64().unwrap()));
    }
    let violations = common::order_violations(&order);
    assert!(violations.is_empty(), "{violations:?}");
    del(&mut con, &[&main_key, &audit_key]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_another_type_is_rejected_without_failing_the_rest() {
    let id = common::unique("w");
    let mut con = redis().await;
    let string_key = format!("outbox:{id}:occupied");
    let _: () = redis::cmd("SET")
        .arg(&string_key)
        .arg("not a stream")
        .query_async(&mut con)
        .await
        .unwrap();
    let sink = RedisSink::connect(common::config(serde_json::json!({
        "url": REDIS,
        "stream": format!("outbox:{id}:${{aggregate_id}}"),
        "max_message_bytes": 4096,
    })))
    .unwrap();
    let mut huge = common::event("big", 1);
    huge.payload = format!("\"{}\"", "x".repeat(8192));
    let outcomes = sink
        .publish(&[
            common::event("a", 1),
            common::event("occupied", 1),
            huge,
            common::event("b", 1),
        ])
        .await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    common::assert_rejected(
        &outcomes[1],
        &["WRONGTYPE", &string_key],
        "a key of another type",
    );
    common::assert_rejected(&outcomes[2], &["too large"], "an entry too large");
    assert_eq!(outcomes[3], Outcome::Delivered);
    let a = format!("outbox:{id}:a");
    let b = format!("outbox:{id}:b");
    assert_eq!(xrange(&mut con, &a).await.len(), 1);
    assert_eq!(xrange(&mut con, &b).await.len(), 1);
    del(&mut con, &[&a, &b, &string_key]).await;
}

/// A row's headers in the reserved prefix, in any case, never reach the entry's `headers`
/// field (a JSON object, whose keys are case-sensitive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_relay_headers_in_any_case_do_not_travel() {
    let key = format!("outbox:{}:forged", common::unique("f"));
    let sink = RedisSink::connect(common::config(serde_json::json!({
        "url": REDIS,
        "stream": key,
    })))
    .unwrap();
    let e = common::with_forged_relay_headers(common::event("x", 1));
    assert_eq!(
        sink.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Delivered]
    );
    let mut con = redis().await;
    let entries = xrange(&mut con, &key).await;
    let headers: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&entries[0]["headers"]).unwrap();
    let headers: Vec<(String, String)> = headers
        .into_iter()
        .map(|(k, v)| (k, v.as_str().unwrap_or_default().to_owned()))
        .collect();
    common::assert_no_forged_relay_headers(&e, &headers);
    del(&mut con, &[&key]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxlen_trims_the_stream() {
    let id = common::unique("m");
    let key = format!("outbox:{id}:trimmed");
    let sink = RedisSink::connect(common::config(serde_json::json!({
        "url": REDIS,
        "stream": key,
        "maxlen": 10,
    })))
    .unwrap();
    for batch in 0..10u64 {
        let events: Vec<_> = (0..100)
            .map(|a| common::event(&format!("a{a}"), batch))
            .collect();
        assert!(
            sink.publish(&events)
                .await
                .iter()
                .all(|o| *o == Outcome::Delivered)
        );
    }
    let mut con = redis().await;
    let len: u64 = redis::cmd("XLEN")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    // `~` trims whole radix-tree nodes (100 entries by default), so about 10 to 110 remain.
    assert!(len <= 200, "XLEN {len} after 1000 XADDs with MAXLEN ~ 10");
    del(&mut con, &[&key]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_keeps_events_pending_until_it_is_back() {
    let store = Arc::new(common::fresh_store().await);
    let id = common::unique("o");
    let key = format!("outbox:{id}:Numbered");

    let proxy = common::cut_proxy("127.0.0.1:6379".parse().unwrap()).await;
    let sink = RedisSink::connect(common::config(serde_json::json!({
        "url": format!("redis://{}", proxy.addr()),
        "stream": format!("outbox:{id}:${{event_type}}"),
        "connect_timeout": "500ms",
        "response_timeout": "1s",
    })))
    .expect("a Redis that is down is not a configuration error");

    // Down at start-up, then lost while the relay runs: the sink reconnects on demand.
    let (_, ids) = common::outage_then_cut_while_running(
        &store,
        sink,
        &proxy,
        "redis-test",
        "Redis unreachable",
    )
    .await;

    let mut con = redis().await;
    let entries = xrange(&mut con, &key).await;
    let got: HashSet<String> = entries.iter().map(|f| f["id"].clone()).collect();
    let want: HashSet<String> = ids.iter().map(|i| i.to_string()).collect();
    assert_eq!(got, want);
    // First appearances keep per-aggregate order (a lost reply may add a later duplicate).
    let mut seen = HashSet::new();
    let order: Vec<(String, u64)> = entries
        .iter()
        .filter(|f| seen.insert(f["id"].clone()))
        .map(|f| common::aggregate_and_n(f["payload"].as_bytes()))
        .collect();
    assert!(common::order_violations(&order).is_empty());
    del(&mut con, &[&key]).await;
}
