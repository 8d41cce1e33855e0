//! End to end against real services: events enqueued in a real PostgreSQL outbox are moved by
//! `outbox_engine::Relay` through `KafkaSink` to a Kafka-protocol broker (tansu, started by
//! `scripts/kafka.sh`), and read back with a real Kafka consumer.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_engine::{Relay, RelayConfig};
use outbox_sink_kafka::{KafkaSink, KafkaSinkConfig};
use outbox_testkit::numbered;
use outbox_types::{NewEvent, Sink, Store};
use rdkafka::Message;

fn relay_config(batch_size: u32) -> RelayConfig {
    common::drain_relay_config("kafka-test", batch_size)
}

fn sink_config(brokers: &str, topic_template: &str) -> KafkaSinkConfig {
    serde_json::from_value(serde_json::json!({
        "brokers": brokers,
        "topic": topic_template,
        "compression": "lz4",
        "delivery_timeout": "5s",
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_events_reach_kafka_in_aggregate_order_and_rolled_back_ones_never_do() {
    if !common::kafka_available() {
        return;
    }
    let prefix = common::unique("outbox_it");
    // The template renders `<prefix>.Numbered`; one event names its own topic instead.
    let topic = format!("{prefix}.Numbered");
    let own_topic = format!("{prefix}.audit");
    common::create_topic(&common::brokers(), &topic, 3).await;
    common::create_topic(&common::brokers(), &own_topic, 1).await;

    let store = Arc::new(common::fresh_store().await);
    let aggregates = 12u64;
    let per_aggregate = 15u64;
    let (committed, audit) =
        common::enqueue_numbered_and_audit(&store, aggregates, per_aggregate, own_topic.clone())
            .await;

    let sink = Arc::new(
        KafkaSink::connect(sink_config(
            &common::brokers(),
            &format!("{prefix}.${{event_type}}"),
        ))
        .unwrap(),
    );
    sink.check()
        .await
        .expect("the test broker answers metadata requests");
    let report = Relay::new(store.clone(), sink, relay_config(50))
        .run(std::future::pending())
        .await;
    common::assert_all_delivered(&store, &report, &committed).await;
    for event in &committed {
        let record = store.get(event.id()).await.unwrap().unwrap();
        assert!(record.delivered_at.is_some());
    }

    let expected = (aggregates * per_aggregate) as usize;
    let messages = common::consume(
        &common::brokers(),
        &topic,
        3,
        expected,
        Duration::from_secs(30),
        Duration::from_secs(1),
    )
    .await;
    assert_eq!(
        messages.len(),
        expected,
        "exactly the committed events, once each"
    );

    let mut arrivals = common::Arrivals::new(&committed);
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    // Records of one partition come back in offset order; an aggregate lives in one partition.
    let mut by_partition: BTreeMap<i32, Vec<&rdkafka::message::OwnedMessage>> = BTreeMap::new();
    for m in &messages {
        by_partition.entry(m.partition()).or_default().push(m);
    }
    assert!(
        by_partition.len() > 1,
        "12 aggregates hashed over 3 partitions should use more than one"
    );
    for (partition, records) in by_partition {
        for m in records {
            let id = common::header(m, "outbox-event-id").expect("event id header");
            let event = arrivals.arrived(&id);
            let key = std::str::from_utf8(m.key().unwrap()).unwrap();
            assert_eq!(key, event.aggregate_id(), "key = aggregate id");
            assert_eq!(
                m.payload().unwrap(),
                event.payload().as_bytes(),
                "raw JSON body"
            );
            assert_eq!(
                common::header(m, "outbox-event-type").as_deref(),
                Some("Numbered")
            );
            assert_eq!(
                common::header(m, "outbox-aggregate-type").as_deref(),
                Some("agg")
            );
            assert_eq!(
                common::header(m, "content-type").as_deref(),
                Some("application/json")
            );
            common::assert_trace_and_key_headers(event, |name| common::header(m, name));
            let previous = partition_of.insert(key.to_owned(), partition);
            assert!(
                previous.is_none_or(|p| p == partition),
                "aggregate {key} is spread over partitions {previous:?} and {partition}"
            );
            arrivals.in_order(key, m.payload().unwrap());
        }
    }
    arrivals.assert_complete(aggregates);

    let audits = common::consume(
        &common::brokers(),
        &own_topic,
        1,
        1,
        Duration::from_secs(20),
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(
        audits.len(),
        1,
        "the event's own destination wins over the template"
    );
    assert_eq!(
        common::header(&audits[0], "outbox-event-id"),
        Some(audit.id().to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_that_is_down_keeps_events_pending_until_it_comes_up() {
    if !common::kafka_available() {
        return;
    }
    // A broker of this test's own, on a port where nothing listens yet.
    let port = common::free_port();
    let brokers = format!("127.0.0.1:{port}");
    let topic = common::unique("outbox_down");

    let store = Arc::new(common::fresh_store().await);
    let events: Vec<NewEvent> = (0..30)
        .map(|i| numbered(&format!("d{}", i % 5), i / 5))
        .collect();
    common::enqueue_committed(&store, &events).await;

    let mut config = sink_config(&brokers, &topic);
    config.delivery_timeout = Duration::from_secs(1);
    config.properties.insert(
        "reconnect.backoff.max.ms".into(),
        outbox_sink_kafka::PropertyValue::Integer(500),
    );
    // Creating the sink must not need the broker.
    let sink = Arc::new(KafkaSink::connect(config).unwrap());
    assert!(sink.check().await.is_err(), "nothing listens yet");

    // Three attempts would be spent within two seconds: the outage below lasts longer and must
    // cost none.
    let (counters, stop, run) = common::spawn_relay(
        &store,
        sink.clone(),
        common::dead_after_three_quick_attempts(relay_config(10)),
    );

    // While the broker is down: nothing delivered, failures recorded on the rows, at most one
    // attempt counted.
    common::outage_recorded_at_no_cost(&store, events[0].id(), &[&brokers, &topic]).await;
    assert_eq!(counters.report().delivered, 0);
    assert_eq!(store.stats().await.unwrap().delivered, 0);
    assert_eq!(store.stats().await.unwrap().dead, 0);

    // The broker comes up: the same relay and sink deliver everything.
    let _broker = common::OwnBroker::start(port);
    common::create_topic(&brokers, &topic, 1).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let stats = store.stats().await.unwrap();
        if stats.delivered == events.len() as u64 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not delivered after recovery: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    let report = run.await.unwrap();
    assert!(report.unavailable > 0, "{report:?}");
    assert_eq!(report.dead, 0, "{report:?}");

    let messages = common::consume(
        &brokers,
        &topic,
        1,
        events.len(),
        Duration::from_secs(30),
        Duration::from_secs(1),
    )
    .await;
    let got: HashSet<String> = messages
        .iter()
        .filter_map(|m| common::header(m, "outbox-event-id"))
        .collect();
    let want: HashSet<String> = events.iter().map(|e| e.id().to_string()).collect();
    assert_eq!(got, want);
}
