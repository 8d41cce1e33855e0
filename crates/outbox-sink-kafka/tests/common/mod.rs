//! Shared by the Kafka sink's integration tests: the Kafka-protocol test broker (tansu, started
//! by `scripts/kafka.sh`), a fresh PostgreSQL outbox per test, and a real Kafka consumer that
//! reads partitions by `assign()` (no consumer group: joining one takes ~20 s on tansu).

#![allow(dead_code)]

pub use outbox_sink_tests::*;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

/// Start the test broker with `scripts/kafka.sh` (once per test process). Returns `false` —
/// after a loud message — when it cannot be started outside CI; under CI (`CI` set) a broker
/// that cannot be started fails the test instead of skipping it (`outbox_testkit::kafka_brokers`).
pub fn kafka_available() -> bool {
    outbox_testkit::kafka_brokers().is_some()
}

/// Where the shared test broker listens (`OUTBOX_TEST_KAFKA_BROKERS`, else the one
/// `scripts/kafka.sh` starts); for a test that found [`kafka_available`].
pub fn brokers() -> String {
    outbox_testkit::kafka_brokers().expect("no Kafka test broker: check kafka_available() first")
}

/// The tansu binary `scripts/kafka.sh` installed, to start a broker of a test's own.
pub fn tansu_binary() -> PathBuf {
    outbox_testkit::tansu_binary().unwrap_or_else(|why| panic!("{why}"))
}

/// A free loopback port (nothing listens on it once this returns).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A tansu broker of the test's own on `port`, killed when dropped.
pub struct OwnBroker(std::process::Child);

impl OwnBroker {
    pub fn start(port: u16) -> Self {
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(tansu_binary())
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start tansu");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "tansu did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        OwnBroker(child)
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Create `topic` with `partitions` partitions.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap();
    for r in results {
        match r {
            Ok(_) => {}
            // The names are unique per test, so an existing topic is this test's own: a
            // producer that was retrying against a broker just started can have had it
            // auto-created by its metadata request first.
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, e)) => panic!("create topic {t}: {e}"),
        }
    }
}

/// The one record of the one-partition `topic` of [`brokers`] (waiting up to 20 s for it and
/// 300 ms more for any other): the test fails unless there is exactly one.
pub async fn consume_only_record(topic: &str) -> OwnedMessage {
    let mut messages = consume(
        &brokers(),
        topic,
        1,
        1,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    assert_eq!(messages.len(), 1);
    messages.remove(0)
}

/// Read every record of `topic` (every partition it has, at least `0..partitions`, from the
/// beginning) until `expected`
/// arrived and then `settle` passed without more, or `timeout` ran out.
pub async fn consume(
    brokers: &str,
    topic: &str,
    partitions: i32,
    expected: usize,
    timeout: Duration,
    settle: Duration,
) -> Vec<OwnedMessage> {
    let brokers = brokers.to_owned();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", unique("outbox-test-reader"))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        // Every partition the topic has: a producer retrying against a broker that just came
        // up can have had the topic auto-created (with the broker's default partition count)
        // before `create_topic` asked for `partitions`; reading only those missed records.
        let partitions = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .ok()
            .and_then(|m| {
                m.topics()
                    .iter()
                    .find(|t| t.name() == topic)
                    .map(|t| t.partitions().len() as i32)
            })
            .unwrap_or(0)
            .max(partitions);
        let mut assignment = TopicPartitionList::new();
        for p in 0..partitions {
            assignment
                .add_partition_offset(&topic, p, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&assignment).unwrap();
        let mut out = Vec::new();
        let deadline = Instant::now() + timeout;
        let mut quiet_since: Option<Instant> = None;
        while Instant::now() < deadline {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    out.push(m.detach());
                    quiet_since = None;
                }
                Some(Err(e)) => eprintln!("consumer: {e}"),
                None => {
                    if out.len() >= expected {
                        let since = *quiet_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= settle {
                            break;
                        }
                    }
                }
            }
        }
        out
    })
    .await
    .unwrap()
}

/// The header `name` of `message` as text.
pub fn header(message: &OwnedMessage, name: &str) -> Option<String> {
    use rdkafka::message::Headers;
    let headers = message.headers()?;
    headers
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
}
