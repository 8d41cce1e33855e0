//! The Kafka adapter against the machine's Kafka-protocol broker (`OUTBOX_TEST_KAFKA_BROKERS`,
//! default `127.0.0.1:19092`, started by `scripts/kafka.sh`); every test uses its own topic and
//! consumer group. The scenarios every broker passes are in `common`; here: its channel.

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

use common::{Channel, Runner, eventually};
use outbox_testkit::unique;

fn brokers() -> String {
    outbox_testkit::kafka_brokers().expect("no Kafka test broker: run scripts/kafka.sh")
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

async fn produce(topic: &str, id: Option<EventId>, body: &str) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let value = id.map(|id| id.to_string());
    let mut record = FutureRecord::to(topic).key("order-1").payload(body);
    if let Some(value) = &value {
        record = record.headers(OwnedHeaders::new().insert(Header {
            key: "outbox-event-id",
            value: Some(value.as_str()),
        }));
    }
    producer
        .send(record, Duration::from_secs(10))
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

/// A topic of its own, read by a consumer in a consumer group of its own.
struct Topic {
    topic: String,
    consumer: Arc<StreamConsumer>,
    /// How many messages were produced: the offset the adapter commits once it settled them.
    produced: i64,
}

impl Channel for Topic {
    async fn open() -> Topic {
        let topic = topic().await;
        let consumer = consumer(&topic);
        Topic {
            topic,
            consumer,
            produced: 0,
        }
    }

    async fn publish(&mut self, id: Option<EventId>, body: &'static str) {
        produce(&self.topic, id, body).await;
        self.produced += 1;
    }

    fn spawn_run(&self, handler: impl InboxHandler + 'static, options: AdapterOptions) -> Runner {
        let consumer = self.consumer.clone();
        tokio::spawn(async move { outbox_inbox::kafka::run(&consumer, &handler, &options).await })
    }

    /// The committed offset of partition 0 reaches the number of messages produced.
    async fn wait_settled(&self, timeout: Duration) -> bool {
        let (c, t, offset) = (self.consumer.clone(), self.topic.clone(), self.produced);
        eventually(timeout, move || {
            let (c, t) = (c.clone(), t.clone());
            async move { committed(&c, &t).await == Some(offset) }
        })
        .await
    }

    /// Topics are left to the broker (the tests' one keeps them in memory).
    async fn delete(self) {}
}

// On a multi-threaded runtime, as the Kafka tests have always run.
common::channel_tests!(@on #[tokio::test(flavor = "multi_thread", worker_threads = 2)] Topic;
    same_event_twice_applies_once_and_commits = same_event_twice_applies_once_and_acks,
    always_failing_handler_is_parked_after_max_attempts_and_committed =
        always_failing_handler_is_parked_after_max_attempts_and_acked,
    failed_first_delivery_is_retried_in_place_and_applied_once =
        failed_first_delivery_is_delivered_again_and_applied_once,
    message_without_event_id_is_parked_at_once = message_without_event_id_is_parked_at_once,
    malformed_payload_is_parked_without_retries = malformed_payload_is_parked_without_retries,
);
