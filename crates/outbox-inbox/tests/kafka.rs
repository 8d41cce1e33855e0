//! The Kafka adapter against the machine's Kafka-protocol broker (`OUTBOX_TEST_KAFKA_BROKERS`,
//! default `127.0.0.1:19092`, started by `scripts/kafka.sh`); every test uses its own topic and
//! consumer group.

#![cfg(all(feature = "kafka", feature = "sqlite"))]

mod common;

use std::sync::Arc;
use std::time::Duration;

use outbox_inbox::{AdapterOptions, EventId, InboxHandler};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::task::JoinHandle;

use common::{Fixture, eventually, fixture, unique};

fn brokers() -> String {
    std::env::var("OUTBOX_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:19092".into())
}

async fn topic() -> String {
    let topic = unique("inbox_k");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let results = admin
        .create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap();
    for r in results {
        r.unwrap();
    }
    topic
}

async fn produce(topic: &str, id: EventId, body: &str) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let value = id.to_string();
    producer
        .send(
            FutureRecord::to(topic)
                .key("order-1")
                .payload(body)
                .headers(OwnedHeaders::new().insert(Header {
                    key: "outbox-event-id",
                    value: Some(value.as_str()),
                })),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
}

fn consumer(topic: &str) -> Arc<StreamConsumer> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("billing"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    Arc::new(consumer)
}

async fn committed(consumer: &Arc<StreamConsumer>, topic: &str) -> Option<i64> {
    let consumer = consumer.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&topic, 0);
        let got = consumer
            .committed_offsets(tpl, Duration::from_secs(5))
            .ok()?;
        match got.find_partition(&topic, 0)?.offset() {
            Offset::Offset(n) => Some(n),
            _ => None,
        }
    })
    .await
    .unwrap()
}

/// Run the adapter over `consumer` in the background, until aborted.
fn spawn_run(
    consumer: &Arc<StreamConsumer>,
    handler: impl InboxHandler + 'static,
    options: AdapterOptions,
) -> JoinHandle<Result<(), outbox_inbox::Error>> {
    let consumer = consumer.clone();
    tokio::spawn(async move { outbox_inbox::kafka::run(&consumer, &handler, &options).await })
}

/// Wait up to 30 s for the committed offset of `topic`'s partition 0 to reach `offset`.
async fn wait_committed(consumer: &Arc<StreamConsumer>, topic: &str, offset: i64) -> bool {
    let (c, t) = (consumer.clone(), topic.to_owned());
    eventually(Duration::from_secs(30), move || {
        let (c, t) = (c.clone(), t.clone());
        async move { committed(&c, &t).await == Some(offset) }
    })
    .await
}

/// A fixture, a new topic holding `copies` messages of one new event with `body`, that event
/// and a consumer of the topic: where each test starts.
async fn produced(body: &str, copies: usize) -> (Fixture, String, EventId, Arc<StreamConsumer>) {
    let f = fixture().await;
    let topic = topic().await;
    let id = EventId::new();
    for _ in 0..copies {
        produce(&topic, id, body).await;
    }
    let consumer = consumer(&topic);
    (f, topic, id, consumer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_event_twice_applies_once_and_commits() {
    let (f, topic, _, consumer) = produced(r#"{"n":1}"#, 2).await;
    let handler = f.handler();
    let runner = spawn_run(&consumer, handler, AdapterOptions::default());
    assert!(wait_committed(&consumer, &topic, 2).await);
    runner.abort();
    assert_eq!(f.effects().await, 1);
    assert!(f.parked().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_failing_handler_is_parked_after_max_attempts_and_committed() {
    let (f, topic, id, consumer) = produced(r#"{"n":2}"#, 1).await;
    let handler = f.failing_handler();
    let options = AdapterOptions::default()
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(100));
    let runner = spawn_run(&consumer, handler, options);
    assert!(wait_committed(&consumer, &topic, 1).await);
    runner.abort();
    f.assert_parked_after_failures(id, 3, br#"{"n":2}"#).await;
}
