//! Kafka: a private tansu broker (the Kafka-protocol broker `scripts/kafka.sh` runs) on a port
//! of its own, advertising the address of the [`TcpProxy`] in front of it — so every client,
//! the relays' producers included, talks to it through the proxy and a cut or a slow link
//! reaches them all (a Kafka client connects to the advertised address, not the bootstrap one).
//!
//! tansu keeps its log in memory here, so the broker itself is never restarted (it would lose
//! what it stored, which is not a fault of the outbox); link faults stand in for it.
//!
//! The consumer is the product's own: `outbox_inbox::kafka::handle_message`, committing each
//! offset after the inbox transaction, in a consumer group (joining takes ~20 s with tansu; the
//! topic is read from the beginning, so nothing is missed meanwhile). Per-aggregate order holds
//! per partition, and the sink keys by aggregate id, so one aggregate is read in order.
//!
//! Poison: the sink's `max_message_bytes` is 200 000 and a poison payload is bigger; the sink
//! must reject it and the relay bury it.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_inbox::{AdapterOptions, Delivery, InboxHandler, ParkedMessage, Processed};
use outbox_testkit::TcpProxy;
use outbox_types::EventId;
use outbox_types::routing::header;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Headers;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use tokio::process::{Child, Command};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use super::{BrokerReadBack, Destination, DestinationHandler, Endpoint};
use crate::Error;

/// Partitions of the topic.
pub const PARTITIONS: i32 = 3;
/// The sink's record size limit; poison payloads exceed it.
pub const MAX_MESSAGE: usize = 200_000;

/// A private tansu broker.
pub struct KafkaDestination {
    endpoint: Endpoint,
    /// The proxy's address: where the relays and the harness's own clients reach the broker.
    addr: SocketAddr,
    /// Where the broker log and the read-back listing go.
    log_dir: PathBuf,
    topic: String,
    broker: Mutex<Option<Child>>,
}

/// Runs the handler on the harness's main runtime: the consumer's database pool belongs to it,
/// and connections opened from the consumer thread's runtime would die with that runtime.
struct OnMainRuntime {
    inner: Arc<DestinationHandler>,
    runtime: tokio::runtime::Handle,
}

#[async_trait]
impl InboxHandler for OnMainRuntime {
    async fn handle(&self, delivery: &Delivery) -> Result<Processed<()>, outbox_inbox::Error> {
        let delivery = delivery.clone();
        self.on_main(|inner| async move { inner.handle(&delivery).await })
            .await
    }

    async fn park(&self, message: &ParkedMessage) -> Result<(), outbox_inbox::Error> {
        let message = message.clone();
        self.on_main(|inner| async move { inner.park(&message).await })
            .await
    }
}

impl OnMainRuntime {
    /// Run `call` on the handler as a task of the main runtime; a task that panicked or was
    /// cancelled is a handler error.
    async fn on_main<T, F>(
        &self,
        call: impl FnOnce(Arc<DestinationHandler>) -> F,
    ) -> Result<T, outbox_inbox::Error>
    where
        F: std::future::Future<Output = Result<T, outbox_inbox::Error>> + Send + 'static,
        T: Send + 'static,
    {
        self.runtime
            .spawn(call(self.inner.clone()))
            .await
            .map_err(|e| outbox_inbox::Error::Handler(Box::new(e)))?
    }
}

async fn consume(
    consumer: StreamConsumer,
    handler: OnMainRuntime,
    mut stop: watch::Receiver<bool>,
) {
    let options = AdapterOptions::default()
        .with_max_attempts(1000)
        .with_retry_delay(Duration::from_millis(100));
    loop {
        let message = tokio::select! {
            _ = stop.changed() => return,
            m = consumer.recv() => m,
        };
        match message {
            Ok(message) => {
                // Retried here until settled: the partition must not skip a message.
                while let Err(error) =
                    outbox_inbox::kafka::handle_message(&consumer, &handler, &message, &options)
                        .await
                {
                    tracing::debug!(%error, "Kafka message not settled; retrying.");
                    if *stop.borrow() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            Err(error) => {
                tracing::debug!(%error, "Kafka consumer error.");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Every event id in `topic`, read from offset 0 to each partition's high watermark by a
/// consumer outside any group (it assigns the partitions itself and commits nothing). Each
/// record's partition, offset and event id also go to `listing` (tab-separated), to compare
/// with the offsets the relays' Kafka sink logged for the records it saw acknowledged.
fn read_back(
    brokers: &str,
    topic: &str,
    listing: &std::path::Path,
) -> Result<HashSet<EventId>, String> {
    use std::io::Write;
    let file = std::fs::File::create(listing)
        .map_err(|e| format!("creating {}: {e}", listing.display()))?;
    let mut listing_out = std::io::BufWriter::new(file);
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("{topic}_read_back"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .create()
        .map_err(|e| format!("Kafka read-back consumer: {e}"))?;
    let timeout = Duration::from_secs(10);
    let mut assignment = TopicPartitionList::new();
    let mut remaining = HashSet::new();
    for partition in 0..PARTITIONS {
        let (low, high) = consumer
            .fetch_watermarks(topic, partition, timeout)
            .map_err(|e| format!("watermarks of {topic}/{partition}: {e}"))?;
        if high > low {
            assignment
                .add_partition_offset(topic, partition, Offset::Beginning)
                .map_err(|e| format!("assigning {topic}/{partition}: {e}"))?;
            remaining.insert(partition);
        }
    }
    consumer
        .assign(&assignment)
        .map_err(|e| format!("assigning {topic}: {e}"))?;
    let mut held = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !remaining.is_empty() {
        if Instant::now() > deadline {
            return Err(format!(
                "partitions {remaining:?} of {topic} not read to the end within 120 s"
            ));
        }
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(message)) => {
                let id = message.headers().and_then(|hs| {
                    hs.iter()
                        .find(|h| h.key == header::EVENT_ID)
                        .and_then(|h| h.value)
                        .and_then(|v| std::str::from_utf8(v).ok())
                        .and_then(|v| v.parse::<EventId>().ok())
                });
                let _ = writeln!(
                    listing_out,
                    "{}\t{}\t{}",
                    message.partition(),
                    message.offset(),
                    id.map(|id| id.to_string()).unwrap_or_else(|| "-".into())
                );
                if let Some(id) = id {
                    held.insert(id);
                }
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                remaining.remove(&partition);
            }
            Some(Err(error)) => tracing::debug!(%error, "Kafka read-back."),
            None => {}
        }
    }
    listing_out
        .flush()
        .map_err(|e| format!("writing {}: {e}", listing.display()))?;
    Ok(held)
}

/// The events the relays' logs show acknowledged by the broker at a real offset ("Kafka record
/// acknowledged." with `offset` ≥ 0, logged by the sink at debug level on each delivery
/// report without error).
fn acknowledged(relay_logs: &std::path::Path) -> HashSet<EventId> {
    let mut acked = HashSet::new();
    let Ok(dir) = std::fs::read_dir(relay_logs) else {
        return acked;
    };
    for entry in dir.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        for line in text.lines().filter(|l| l.contains(ACK_LOGGED)) {
            let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let offset = record["offset"].as_i64().unwrap_or(-1);
            if let (true, Some(id)) = (
                offset >= 0,
                record["event_id"].as_str().and_then(|v| v.parse().ok()),
            ) {
                acked.insert(id);
            }
        }
    }
    acked
}

/// The message of the Kafka sink's debug line for each record the broker acknowledged.
const ACK_LOGGED: &str = "Kafka record acknowledged.";

impl KafkaDestination {
    /// Start tansu on a free port behind a proxy and create the topic.
    pub async fn start(name: &str, log_dir: PathBuf) -> Result<Self, Error> {
        // `OUTBOX_VERIFY_TANSU` (or `OUTBOX_TEST_TANSU`), else the venv `scripts/kafka.sh`
        // makes, in this checkout or one beside it.
        let bin = outbox_testkit::tansu_binary().map_err(Error::Process)?;
        let port = crate::cluster::free_port()?;
        let upstream: SocketAddr = ([127, 0, 0, 1], port).into();
        let proxy = TcpProxy::start(upstream)
            .await
            .map_err(Error::io("starting the Kafka proxy"))?;
        let log = std::fs::File::create(log_dir.join("tansu.log"))
            .map_err(Error::io("creating the tansu log"))?;
        let child = Command::new(&bin)
            .arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://{}", proxy.addr()))
            .args(["--storage-engine", "memory://tansu/"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(Error::io(format!("starting {}", bin.display())))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(upstream).await.is_err() {
            if Instant::now() > deadline {
                return Err(Error::Timeout("tansu did not listen within 30 s".into()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let topic = format!("outbox_t_verify_{}", std::process::id());
        let me = KafkaDestination {
            addr: proxy.addr(),
            endpoint: Endpoint::proxied(name, proxy, |addr| {
                serde_json::json!({
                    "type": "kafka",
                    "brokers": addr.to_string(),
                    "topic": topic,
                    "max_message_bytes": MAX_MESSAGE,
                    "delivery_timeout": "2s",
                    "request_timeout": "1500ms",
                    "connect_timeout": "1s",
                    "linger": "1ms",
                })
            }),
            log_dir: log_dir.clone(),
            topic,
            broker: Mutex::new(Some(child)),
        };
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", me.addr.to_string())
            .create()
            .map_err(|e| Error::Broker(format!("Kafka admin client: {e}")))?;
        let results = admin
            .create_topics(
                &[NewTopic::new(
                    &me.topic,
                    PARTITIONS,
                    TopicReplication::Fixed(1),
                )],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(|e| Error::Broker(format!("creating topic {}: {e}", me.topic)))?;
        for r in results {
            r.map_err(|(t, e)| Error::Broker(format!("creating topic {t}: {e}")))?;
        }
        Ok(me)
    }
}

#[async_trait]
impl Destination for KafkaDestination {
    fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    fn poison(&self, payload: serde_json::Value) -> Option<serde_json::Value> {
        super::oversized(payload, MAX_MESSAGE)
    }

    async fn start_consumer(
        &self,
        handler: Arc<DestinationHandler>,
        stop: watch::Receiver<bool>,
    ) -> Result<JoinHandle<()>, Error> {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.addr.to_string())
            .set("group.id", format!("{}_consumer", self.topic))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .map_err(|e| Error::Broker(format!("Kafka consumer: {e}")))?;
        consumer
            .subscribe(&[&self.topic])
            .map_err(|e| Error::Broker(format!("subscribing to {}: {e}", self.topic)))?;
        // The adapter commits each offset synchronously (a blocking librdkafka call inside an
        // async fn); on the harness's runtime a commit the broker never answers would stall a
        // worker thread and everything scheduled on it. Its own thread and runtime contain that.
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let handler = OnMainRuntime {
            inner: handler,
            runtime: tokio::runtime::Handle::current(),
        };
        std::thread::Builder::new()
            .name("kafka-consumer".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(error) => {
                        tracing::warn!(%error, "No runtime for the Kafka consumer.");
                        return;
                    }
                };
                runtime.block_on(consume(consumer, handler, stop));
                let _ = done_tx.send(());
            })
            .map_err(Error::io("starting the Kafka consumer thread"))?;
        Ok(tokio::spawn(async move {
            let _ = done_rx.await;
        }))
    }

    async fn held_by_broker(&self) -> Option<BrokerReadBack> {
        let brokers = self.addr.to_string();
        let topic = self.topic.clone();
        let listing = self.log_dir.join("kafka-read-back.tsv");
        let relay_logs = self.log_dir.join("relay-logs");
        match tokio::task::spawn_blocking(move || read_back(&brokers, &topic, &listing)).await {
            Ok(Ok(held)) => {
                let dropped_after_ack = acknowledged(&relay_logs)
                    .into_iter()
                    .filter(|id| !held.contains(id))
                    .collect();
                Some(BrokerReadBack {
                    held,
                    dropped_after_ack,
                })
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "Could not read the Kafka topic back.");
                None
            }
            Err(error) => {
                tracing::warn!(%error, "Reading the Kafka topic back panicked.");
                None
            }
        }
    }

    async fn shutdown(&self) {
        if let Some(mut child) = self.broker.lock().await.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_at_a_real_offset_are_read_from_every_relay_log() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (a, b, c) = (EventId::new(), EventId::new(), EventId::new());
        let line = |id: EventId, offset: i64| {
            format!(
                r#"{{"timestamp":"2026-11-26T01:49:22.988857Z","level":"DEBUG","message":"Kafka record acknowledged.","event_id":"{id}","topic":"t","partition":0,"offset":{offset},"target":"outbox_sink_kafka"}}"#
            )
        };
        std::fs::write(
            dir.path().join("verify-r0-1.log"),
            format!("{}\n{{\"message\":\"Relay stopped.\"}}\n", line(a, 5)),
        )
        .expect("log");
        // An ack without an offset (a duplicate answered from the producer's state) is not
        // evidence of where the broker stored it.
        std::fs::write(
            dir.path().join("verify-r1-1.log"),
            format!("{}\n{}\nnot json\n", line(b, 0), line(c, -1)),
        )
        .expect("log");
        assert_eq!(acknowledged(dir.path()), HashSet::from([a, b]));
        assert!(acknowledged(&dir.path().join("missing")).is_empty());
    }
}
