//! End to end against real services: events enqueued in a real PostgreSQL outbox are moved by
//! `outbox_engine::Relay` through `RabbitMqSink` to the machine's RabbitMQ, and read back from
//! queues the test binds.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_engine::{Relay, RelayConfig};
use outbox_sink_rabbitmq::RabbitMqSink;
use outbox_testkit::{TcpProxy, numbered};
use outbox_types::{NewEvent, RetryPolicy, Sink, Store};

fn relay_config(batch_size: u32) -> RelayConfig {
    common::drain_relay_config("rabbitmq-test", batch_size)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_events_reach_rabbitmq_in_aggregate_order_and_rolled_back_ones_never_do() {
    let rabbit = common::Rabbit::connect().await;
    let exchange = rabbit.exchange("outbox_ex");
    let store = Arc::new(common::fresh_store().await);

    let sink = Arc::new(
        RabbitMqSink::connect(common::config(serde_json::json!({
            "url": "amqp://127.0.0.1:5672/%2f",
            "user": "guest",
            "password": "guest",
            "exchange": exchange,
            "routing_key": "${aggregate_type}.${event_type}",
            "declare": true,
        })))
        .unwrap(),
    );
    sink.check().await.unwrap();
    // The consumers' side: the exchange (the sink's `declare` finds it as it would declare it)
    // and their queues.
    rabbit.declare_exchange(&exchange).await;
    let numbered_queue = rabbit.queue_bound(&exchange, "agg.#").await;
    let audit_queue = rabbit.queue_bound(&exchange, "audit.*").await;

    let aggregates = 10u64;
    let per_aggregate = 20u64;
    let (committed, audit) =
        common::enqueue_numbered_and_audit(&store, aggregates, per_aggregate, "audit.special")
            .await;

    let report = Relay::new(store.clone(), sink, relay_config(40))
        .run(std::future::pending())
        .await;
    common::assert_all_delivered(&store, &report, &committed).await;

    let expected = (aggregates * per_aggregate) as usize;
    let messages = rabbit.drain_expecting(&numbered_queue, expected).await;
    assert_eq!(
        messages.len(),
        expected,
        "exactly the committed events, once each"
    );
    let mut arrivals = common::Arrivals::new(&committed);
    for m in &messages {
        let id = m
            .properties
            .message_id()
            .as_ref()
            .expect("message_id = event id")
            .to_string();
        let event = arrivals.arrived(&id);
        assert_eq!(common::header(m, "outbox-event-id"), Some(id.clone()));
        assert_eq!(*m.properties.delivery_mode(), Some(2), "persistent");
        assert_eq!(
            m.properties.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(m.routing_key.as_str(), "agg.Numbered");
        assert_eq!(m.exchange.as_str(), exchange);
        assert_eq!(m.data, event.payload().as_bytes(), "raw JSON body");
        assert_eq!(
            common::header(m, "outbox-aggregate-id").as_deref(),
            Some(event.aggregate_id())
        );
        common::assert_trace_and_key_headers(event, |name| common::header(m, name));
        arrivals.in_order(event.aggregate_id(), &m.data);
    }
    arrivals.assert_complete(aggregates);

    let audits = rabbit.drain_expecting(&audit_queue, 1).await;
    assert_eq!(
        audits.len(),
        1,
        "the event's own destination is its routing key"
    );
    assert_eq!(audits[0].routing_key.as_str(), "audit.special");
    assert_eq!(
        common::header(&audits[0], "outbox-event-id"),
        Some(audit.id().to_string())
    );

    rabbit.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_connection_keeps_events_pending_until_rabbitmq_is_reachable_again() {
    let rabbit = common::Rabbit::connect().await;
    let exchange = rabbit.exchange("outbox_ex_cut");
    let proxy = TcpProxy::start("127.0.0.1:5672".parse().unwrap())
        .await
        .unwrap();
    let url = format!("amqp://127.0.0.1:{}/%2f", proxy.addr().port());
    let sink = Arc::new(
        RabbitMqSink::connect(common::config(serde_json::json!({
            "url": url,
            "exchange": exchange,
            "declare": true,
            "routing_key": "cut.${event_type}",
            "connect_timeout": "1s",
            "confirm_timeout": "2s",
        })))
        .unwrap(),
    );
    sink.check().await.unwrap();
    rabbit.declare_exchange(&exchange).await;
    let queue = rabbit.queue_bound(&exchange, "#").await;

    let store = Arc::new(common::fresh_store().await);
    let before: Vec<NewEvent> = (0..20)
        .map(|i| numbered(&format!("c{}", i % 4), i / 4))
        .collect();
    common::enqueue_committed(&store, &before).await;

    // Three attempts, spent within two seconds if the outage below cost attempts.
    let (counters, stop, run) = common::spawn_relay(
        &store,
        sink.clone(),
        common::dead_after_three_quick_attempts(relay_config(10)),
    );
    let wait_delivered = |n: u64| {
        common::wait_for_stats(&store, Duration::from_secs(60), "delivered", move |s| {
            s.delivered == n
        })
    };
    wait_delivered(20).await;

    // RabbitMQ goes away for the relay (the connection is cut, new ones are refused).
    proxy.cut();
    let after: Vec<NewEvent> = (20..40)
        .map(|i| numbered(&format!("c{}", i % 4), i / 4))
        .collect();
    common::enqueue_committed(&store, &after).await;
    let broker = format!("127.0.0.1:{}", proxy.addr().port());
    common::outage_recorded_at_no_cost(&store, after[0].id(), &[&broker]).await;
    let during = store.stats().await.unwrap();
    assert_eq!(during.delivered, 20, "{during:?}");
    assert_eq!(during.dead, 0, "{during:?}");

    proxy.restore();
    wait_delivered(40).await;
    let _ = stop.send(());
    let report = run.await.unwrap();
    assert!(report.unavailable > 0, "{report:?}");
    assert_eq!(report.dead, 0, "{report:?}");
    assert_eq!(counters.report().delivered, 40);

    let messages = rabbit.drain_expecting(&queue, 40).await;
    let got: HashSet<String> = messages
        .iter()
        .filter_map(|m| m.properties.message_id().as_ref().map(|s| s.to_string()))
        .collect();
    let want: HashSet<String> = before
        .iter()
        .chain(&after)
        .map(|e| e.id().to_string())
        .collect();
    assert_eq!(
        got, want,
        "every event arrived (a duplicate is allowed, a loss is not)"
    );
    rabbit.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unroutable_message_is_not_delivered_until_a_queue_is_bound() {
    let rabbit = common::Rabbit::connect().await;
    let exchange = rabbit.exchange("outbox_ex_noroute");
    let sink = Arc::new(
        RabbitMqSink::connect(common::config(serde_json::json!({
            "exchange": exchange,
            "declare": true,
            "routing_key": "lonely.${event_type}",
        })))
        .unwrap(),
    );
    let store = Arc::new(common::fresh_store().await);
    let events: Vec<NewEvent> = (0..6)
        .map(|i| numbered(&format!("u{}", i % 3), i / 3))
        .collect();
    common::enqueue_committed(&store, &events).await;

    let retry = RetryPolicy {
        base: Duration::from_millis(300),
        cap: Duration::from_millis(300),
        max_attempts: 100,
    };
    // No queue is bound: every message comes back under `mandatory`. One round: the drain
    // does not wait for the retries.
    let report = Relay::new(
        store.clone(),
        sink.clone(),
        RelayConfig {
            retry,
            drain_wait: Duration::ZERO,
            ..relay_config(10)
        },
    )
    .run(std::future::pending())
    .await;
    assert_eq!(report.delivered, 0, "{report:?}");
    assert!(report.retried >= 3, "{report:?}");
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.delivered, stats.pending), (0, 6), "{stats:?}");
    let record = store.get(events[0].id()).await.unwrap().unwrap();
    let error = record.last_error.unwrap_or_default();
    assert!(
        error.contains("unroutable")
            && error.contains(&exchange)
            && error.contains("lonely.Numbered"),
        "{error}"
    );

    // A consumer binds its queue: the same events go through.
    let queue = rabbit.queue_bound(&exchange, "lonely.#").await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let report = Relay::new(store.clone(), sink.clone(), relay_config(10))
        .run(std::future::pending())
        .await;
    assert_eq!(report.delivered, 6, "{report:?}");
    assert_eq!(rabbit.drain_expecting(&queue, 6).await.len(), 6);

    // With `unroutable = "reject"` the event is buried at once instead.
    let rejecting = RabbitMqSink::connect(common::config(serde_json::json!({
        "exchange": exchange,
        "routing_key": "nobody.listens",
        "unroutable": "reject",
    })))
    .unwrap();
    let e = outbox_types::NewEvent::from_json("order", "1", "OrderCreated", "{}")
        .unwrap()
        .claimed(1);
    let outcomes = rejecting.publish(&[e]).await;
    assert!(
        matches!(&outcomes[..], [outbox_types::Outcome::Reject { reason }] if reason.contains("NO_ROUTE")),
        "{outcomes:?}"
    );
    rabbit.clean_up().await;
}

/// End to end through the relay: an event whose headers cannot fit one frame of the connection
/// (here `frame_max=8192`, negotiated from the URL) is dead with a reason naming both sizes,
/// without a single outage; the other aggregates are delivered on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_too_large_for_a_frame_is_dead_and_causes_no_outage() {
    let rabbit = common::Rabbit::connect().await;
    let exchange = rabbit.exchange("outbox_ex_frame_relay");
    rabbit.declare_exchange(&exchange).await;
    let queue = rabbit.queue_bound(&exchange, "#").await;
    let sink = Arc::new(
        RabbitMqSink::connect(common::config(serde_json::json!({
            "url": "amqp://guest:guest@127.0.0.1:5672/%2f?frame_max=8192",
            "exchange": exchange,
        })))
        .unwrap(),
    );
    let store = Arc::new(common::fresh_store().await);
    let mut events: Vec<NewEvent> = (0..10)
        .map(|i| numbered(&format!("g{}", i % 5), i / 5))
        .collect();
    let big = numbered("big", 0).with_header("x-big", "h".repeat(10_000));
    events.insert(3, big.clone());
    common::enqueue_committed(&store, &events).await;
    let report = Relay::new(
        store.clone(),
        sink,
        RelayConfig {
            // The store's bound on headers and the other small columns stays out of the way:
            // this is about the broker's frame.
            max_metadata_bytes: 1 << 20,
            ..relay_config(20)
        },
    )
    .run(std::future::pending())
    .await;
    assert_eq!((report.delivered, report.dead), (10, 1), "{report:?}");
    assert_eq!(report.unavailable, 0, "no outage: {report:?}");
    let record = store.get(big.id()).await.unwrap().unwrap();
    let error = record.last_error.unwrap_or_default();
    assert!(
        error.contains("frame_max") && error.contains("8192 bytes"),
        "{error}"
    );
    assert_eq!(rabbit.drain_expecting(&queue, 10).await.len(), 10);
    rabbit.clean_up().await;
}
