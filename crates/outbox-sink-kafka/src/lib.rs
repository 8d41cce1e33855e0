//! # outbox-sink-kafka
//!
//! Publishes outbox events to **Apache Kafka** (or any broker speaking its protocol) with
//! librdkafka, through [`rdkafka`] built with its bundled librdkafka. An event counts as
//! delivered only once its **delivery report** came back without error: with `acks=all` that
//! means every in-sync replica of the partition has the record.
//!
//! ## How an event becomes a record
//!
//! Everything comes from [`outbox_types::routing`], shared by every sink:
//!
//! - **Topic**: the event's own `destination` if the writer set one, else the
//!   [`topic`](KafkaSinkConfig::topic) template (default `events.${event_type}`).
//! - **Key**: the aggregate id. The partitioner hashes it (Java-compatible murmur2 by default),
//!   so one aggregate always lands in one partition and its records keep their order there.
//! - **Headers**: the routing headers (`outbox-event-id`, `outbox-event-type`,
//!   `outbox-aggregate-type`, `outbox-aggregate-id`, `outbox-occurred-at`,
//!   `outbox-idempotency-key`, then the event's own headers such as `traceparent`), plus
//!   `content-type` (`application/json`, or `application/cloudevents+json` — the CloudEvents
//!   Kafka binding's structured mode); in CloudEvents binary mode the attributes as `ce_`
//!   headers (the key is the `partitionkey`, as the binding has it).
//! - **Body**: the stored JSON bytes, or a CloudEvents 1.0 structured envelope (binary mode:
//!   the stored bytes).
//! - **`format = "debezium"`**: what Debezium's Outbox Event Router emits through Kafka
//!   Connect's JSON converter — key = the aggregate id as a JSON string, value = the payload as
//!   stored (a `null` payload is the value `null`), headers `id` and the event's own as JSON
//!   strings, no `content-type`. An event of the WAL mode's `debezium` source is the record the
//!   router makes of its row, byte for byte: its topic (`outbox.event.<aggregatetype>` by
//!   default), typed key, headers in the router's order (`null` values included), a tombstone
//!   where `route.tombstone.on.empty.payload` asks for one, the partition of a `partition`
//!   placement and the timestamp of `table.field.event.timestamp`. See `docs/from-debezium.md`.
//! - **Timestamp**: when the relay published the record (`CreateTime`, the producer's clock), or
//!   with [`record_timestamp`](KafkaSinkConfig::record_timestamp) `= "occurred_at"` the event's
//!   `occurred_at` in milliseconds; with `format = "debezium"`, a `debezium` source event's
//!   `table.field.event.timestamp` column when it has one.
//!
//! ## Duplicates
//!
//! The producer is idempotent (`enable.idempotence=true`, `acks=all`, which this sink does not
//! let configuration turn off): librdkafka's own retries after a lost produce response never
//! write a record twice. What it cannot cover is the relay publishing an event again (an ack to
//! the database lost, a relay crash): consumers deduplicate on the `outbox-event-id` header.
//!
//! ## Throughput
//!
//! A relay batch holds at most one event per aggregate, so the whole batch is handed to
//! librdkafka at once and all the delivery futures are awaited together: librdkafka packs the
//! records into a few produce requests (`linger`, `batch_size`, `batch_num_messages`,
//! `compression`), and a batch costs about one produce round trip, not one per record.
//!
//! ## Failures
//!
//! | what happened | outcome |
//! |---|---|
//! | delivery report without error | `Delivered` |
//! | broker unreachable (transport failure, all brokers down, name not resolved), no report within `delivery_timeout`, producer queue full, no leader or leader moving, not enough replicas, request timed out, broker storage error, throttling, TLS or authentication failing, cluster authorization refused, a fatal or fenced producer (replaced), the producer shut down | `Unavailable` (no attempt, however long it lasts), with the last broker error librdkafka reported |
//! | any other produce error | `Retry` (costs an attempt) |
//! | record larger than `max_message_bytes` or the broker's limit | `Reject`, naming the topic and the limit to raise |
//! | topic does not exist and the broker does not create topics | `Reject`, naming the topic |
//! | no WRITE permission on the topic, topic name invalid, record refused by the broker's validation | `Reject` |
//!
//! With topic auto-creation off (`allow_auto_create_topics = false`, or the broker's own
//! setting), librdkafka waits `topic.metadata.propagation.max.ms` (30 s by default, settable in
//! `properties`) before it believes a topic is missing; until then records for it time out and
//! are retried (the reason says the topic may be missing), after that they are rejected at once
//! until librdkafka's next metadata refresh sees the topic.
//!
//! [`KafkaSink::connect`] never fails because Kafka is down: librdkafka connects lazily and keeps
//! reconnecting in the background. While no broker answers, `publish` answers `Unavailable` after
//! `delivery_timeout` and the relay keeps the events. If librdkafka reports a fatal error (the
//! idempotent producer's state is lost, e.g. the producer was fenced), the sink builds a fresh
//! producer for the next call.
//!
//! ## Configuration
//!
//! ```toml
//! [destinations.kafka]
//! type = "kafka"
//! brokers = ["kafka-1:9092", "kafka-2:9092"]
//! topic = "${aggregate_type}.events"
//! format = "raw"                 # or "cloudevents" (with cloudevents_source = "/orders"), "debezium"
//! tls = true
//! user = "relay"
//! password_env = "KAFKA_PASSWORD"
//! sasl_mechanism = "SCRAM-SHA-512"
//! compression = "lz4"
//! linger = "5ms"
//! delivery_timeout = "5s"
//! properties = { "queue.buffering.max.kbytes" = 65536 }
//! ```

mod config;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::join_all;
use outbox_types::routing::{Binding, PayloadFormat, Routing, header};
use outbox_types::{Event, Outcome, Sink, SinkError, truncate_error};
use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use tracing::{debug, error, info, warn};

use config::config_error;
pub use config::{
    BodyFormat, Compression, KafkaSinkConfig, Partitioner, PropertyValue, RecordTimestamp,
    SaslMechanism, Secret,
};

/// How long a broker error reported by librdkafka stays relevant for a `Retry` reason.
const NEWS_TTL: Duration = Duration::from_secs(60);

/// The last thing librdkafka said about its connections, for `Retry` reasons.
#[derive(Default)]
struct BrokerNews {
    last_error: Mutex<Option<(Instant, String)>>,
}

impl BrokerNews {
    fn record(&self, text: String) {
        let mut slot = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        *slot = Some((Instant::now(), text));
    }

    fn recent(&self) -> Option<String> {
        let slot = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref()
            .filter(|(at, _)| at.elapsed() < NEWS_TTL)
            .map(|(_, text)| text.clone())
    }
}

/// Routes librdkafka's logs and errors to `tracing` and remembers the last broker error.
struct SinkContext {
    news: Arc<BrokerNews>,
}

impl ClientContext for SinkContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => error!(target: "librdkafka", facility = fac, "{message}"),
            RDKafkaLogLevel::Warning => warn!(target: "librdkafka", facility = fac, "{message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                info!(target: "librdkafka", facility = fac, "{message}")
            }
            RDKafkaLogLevel::Debug => debug!(target: "librdkafka", facility = fac, "{message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        warn!(target: "librdkafka", %error, reason, "Kafka client error.");
        self.news.record(format!("{error}: {reason}"));
    }
}

type Client = FutureProducer<SinkContext>;

/// Publishes events to Kafka. See the [crate docs](crate).
pub struct KafkaSink {
    routing: Routing,
    client_config: rdkafka::ClientConfig,
    producer: Mutex<Client>,
    news: Arc<BrokerNews>,
    brokers: String,
    delivery_timeout: Duration,
    record_timestamp: RecordTimestamp,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("brokers", &self.brokers)
            .field("topic", &self.routing.destination.as_str())
            .finish_non_exhaustive()
    }
}

/// What became of one event before its delivery report.
enum Slot {
    Done(Outcome),
    Waiting {
        topic: String,
        size: usize,
        delivery: DeliveryFuture,
    },
}

impl KafkaSink {
    /// Check `config` and create the producer. Does not wait for (or need) a broker:
    /// librdkafka connects in the background, and publishing answers `Retry` until it can.
    ///
    /// Fails only on configuration that cannot work, with a message naming the setting. The
    /// constructor every sink has: settings in, sink out, no broker needed.
    pub fn connect(config: KafkaSinkConfig) -> Result<Self, SinkError> {
        Self::build(&config)
    }

    /// The earlier name of [`KafkaSink::connect`], taking the settings by reference.
    #[deprecated(note = "use `KafkaSink::connect(config)`, the constructor every sink has")]
    pub fn new(config: &KafkaSinkConfig) -> Result<Self, SinkError> {
        Self::build(config)
    }

    fn build(config: &KafkaSinkConfig) -> Result<Self, SinkError> {
        let routing = config.routing()?;
        if let Some(warning) = config.cleartext_warning() {
            tracing::warn!("{warning}");
        }
        let client_config = config.client_config()?;
        let news = Arc::new(BrokerNews::default());
        let producer = create_producer(&client_config, &news)?;
        Ok(KafkaSink {
            routing,
            client_config,
            producer: Mutex::new(producer),
            news,
            brokers: config.bootstrap_servers()?,
            delivery_timeout: config.delivery_timeout,
            record_timestamp: config.record_timestamp,
        })
    }

    /// Check `config` as [`KafkaSink::connect`] does, without creating a producer (a producer
    /// starts connecting to the brokers at once): the settings, the routing, and every client
    /// property as librdkafka's own configuration parser takes it. What only a client can
    /// check (an inline PEM that does not parse, say) is left to the relay's start. This is
    /// what `outbox config check` runs.
    pub fn check_config(config: &KafkaSinkConfig) -> Result<(), SinkError> {
        config.routing()?;
        config.bootstrap_servers()?;
        config
            .client_config()?
            .create_native_config()
            .map(|_| ())
            .map_err(|e| {
                config_error(format!(
                    "librdkafka refused the configuration: {e} (check `properties` and the settings it names)"
                ))
            })
    }

    /// The routing in use.
    pub fn routing(&self) -> &Routing {
        &self.routing
    }

    fn producer(&self) -> Client {
        self.producer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// After a fatal error the idempotent producer cannot go on: swap in a fresh one (once, even
    /// when several publishes notice at the same time).
    ///
    /// `fenced` forces the swap: a broker may answer `ProducerFenced` / `InvalidProducerEpoch`
    /// per record without librdkafka raising its fatal flag, and every later record of that
    /// producer then fails the same way (seen with the Kafka-protocol broker used in tests).
    fn replace_if_fatal(&self, used: &Client, fenced: bool) {
        let (code, reason) = match used.client().fatal_error() {
            Some((code, reason)) => (Some(code), reason),
            None if fenced => (None, "the broker fenced this producer".to_owned()),
            None => return,
        };
        let mut slot = self.producer.lock().unwrap_or_else(|p| p.into_inner());
        if !std::ptr::eq(slot.client(), used.client()) {
            return; // someone else already replaced it
        }
        match create_producer(&self.client_config, &self.news) {
            Ok(fresh) => {
                warn!(
                    ?code,
                    reason, "Kafka producer hit a fatal error; replaced it."
                );
                *slot = fresh;
            }
            Err(error) => {
                error!(%error, "Kafka producer hit a fatal error and could not be replaced.")
            }
        }
    }

    fn headers(&self, event: &Event) -> OwnedHeaders {
        let mut headers = self.routing.headers(event);
        headers.extend(self.routing.cloudevents_headers(event, Binding::Kafka));
        let mut owned = OwnedHeaders::new_with_capacity(headers.len() + 1);
        // Debezium's records carry no content type; its consumers see exactly its headers.
        let ours = self.routing.format != PayloadFormat::Debezium;
        if ours {
            owned = owned.insert(Header {
                key: "content-type",
                value: Some(self.routing.content_type()),
            });
        }
        for (name, value) in &headers {
            // One content type per record: the body's, not a second one from the writer.
            if ours && name.eq_ignore_ascii_case("content-type") {
                continue;
            }
            owned = owned.insert(Header {
                key: name.as_str(),
                value: Some(value.as_str()),
            });
        }
        owned
    }

    /// Hand one event to librdkafka; waits (briefly, up to `until`) while its queue is full.
    async fn enqueue(&self, producer: &Client, event: &Event, until: Instant) -> Slot {
        let topic = self.routing.destination(event);
        if let Err(why) = check_topic(&topic) {
            return Slot::Done(Outcome::reject(format!(
                "topic `{topic}` (from {}): {why}",
                self.topic_origin(event)
            )));
        }
        let body = self.routing.body(event);
        let key = self.routing.key(event);
        let mut record = FutureRecord::to(&topic)
            .key(key.as_ref())
            .headers(self.headers(event));
        if !self.routing.is_tombstone(event) {
            record = record.payload(&body);
        }
        if self.routing.format == PayloadFormat::Debezium
            && let Some(partition) = event.headers.get(header::PARTITION)
        {
            match partition.parse::<i32>() {
                Ok(p) if p >= 0 => record = record.partition(p),
                _ => {
                    return Slot::Done(Outcome::reject(format!(
                        "partition `{partition}` for topic `{topic}` is not a partition number: fix the Debezium `partition` placement's column"
                    )));
                }
            }
        }
        if let Some(ms) = self.routing.record_timestamp(event) {
            // The Debezium shape's own: the router's `table.field.event.timestamp` column.
            record = record.timestamp(ms);
        } else if self.record_timestamp == RecordTimestamp::OccurredAt {
            record = record.timestamp(event.occurred_at.timestamp_millis());
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    return Slot::Waiting {
                        size: body.len(),
                        topic: topic.clone(),
                        delivery,
                    };
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < until =>
                {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((error, _)) => {
                    return Slot::Done(self.classify(&error, &topic, body.len()));
                }
            }
        }
    }

    fn topic_origin(&self, event: &Event) -> String {
        match &event.destination {
            Some(d) if !d.is_empty() => "the event's own destination".to_owned(),
            _ => format!("template `{}`", self.routing.destination.as_str()),
        }
    }

    /// The failure classification of this sink: turn a produce error into an outcome (unavailable:
    /// no attempt; retry or reject: costs one) whose reason names the topic and the fix.
    fn classify(&self, error: &KafkaError, topic: &str, size: usize) -> Outcome {
        let news = || {
            self.news
                .recent()
                .map(|n| format!("; last broker error: {n}"))
                .unwrap_or_default()
        };
        let code = match error {
            KafkaError::MessageProduction(code) => Some(*code),
            other => other.rdkafka_error_code(),
        };
        let reason = |text: String| truncate_error(&text);
        use RDKafkaErrorCode as C;
        match code {
            Some(C::MessageSizeTooLarge | C::MessageBatchTooLarge | C::InvalidMessageSize) => {
                Outcome::reject(reason(format!(
                    "record of {size} bytes for topic `{topic}` is too large ({error}): raise `max_message_bytes` of the sink and `max.message.bytes` of the topic (or `message.max.bytes` of the broker), or make the event smaller"
                )))
            }
            Some(C::UnknownPartition) => Outcome::reject(reason(format!(
                "topic `{topic}` has no such partition ({error}): the event names its partition (a Debezium `partition` placement); fix the column's value or add partitions to the topic"
            ))),
            Some(C::UnknownTopic | C::UnknownTopicOrPartition | C::UnknownTopicId) => {
                Outcome::reject(reason(format!(
                    "topic `{topic}` does not exist and the broker does not create topics automatically ({error}): create the topic, or fix the `topic` template / the event's destination"
                )))
            }
            Some(C::TopicAuthorizationFailed) => Outcome::reject(reason(format!(
                "not authorized to write to topic `{topic}` ({error}): grant the relay's principal WRITE (and DESCRIBE) on the topic, or fix the `topic` template"
            ))),
            Some(C::InvalidTopic) => Outcome::reject(reason(format!(
                "the broker refuses topic name `{topic}` ({error}): fix the `topic` template or the event's destination"
            ))),
            Some(
                C::InvalidRecord
                | C::InvalidMessage
                | C::UnsupportedForMessageFormat
                | C::PolicyViolation,
            ) => Outcome::reject(reason(format!(
                "the broker refused the record for topic `{topic}` ({error}): check the topic's configuration (e.g. compaction, timestamp limits, policies)"
            ))),
            Some(C::MessageTimedOut) => Outcome::unavailable(reason(format!(
                "no delivery report for topic `{topic}` within {} ms (`delivery_timeout`) from brokers {}: they may be unreachable, or the topic may not exist yet{}",
                self.delivery_timeout.as_millis(),
                self.brokers,
                news()
            ))),
            Some(C::QueueFull) => Outcome::unavailable(reason(format!(
                "librdkafka's producer queue stayed full for topic `{topic}`: the brokers {} are slower than the outbox or unreachable (raise `properties.\"queue.buffering.max.messages\"` if they are healthy){}",
                self.brokers,
                news()
            ))),
            Some(C::Fatal | C::Fenced | C::ProducerFenced | C::InvalidProducerEpoch) => {
                Outcome::unavailable(reason(format!(
                    "the Kafka producer hit a fatal error for topic `{topic}` ({error}); it is replaced for the next attempt"
                )))
            }
            Some(C::ClusterAuthorizationFailed) => Outcome::unavailable(reason(format!(
                "the brokers {} refuse the idempotent producer ({error}): grant the relay's principal IDEMPOTENT_WRITE on the cluster",
                self.brokers
            ))),
            Some(C::Authentication | C::SaslAuthenticationFailed | C::SSL) => {
                Outcome::unavailable(reason(format!(
                    "cannot authenticate to the brokers {} ({error}): check `user`, the password, `sasl_mechanism`, `tls` and `tls_ca_file`{}",
                    self.brokers,
                    news()
                )))
            }
            Some(
                C::BrokerTransportFailure
                | C::Resolve
                | C::AllBrokersDown
                | C::OperationTimedOut
                | C::TimedOutQueue
                | C::LeaderNotAvailable
                | C::NotLeaderForPartition
                | C::PreferredLeaderNotAvailable
                | C::FencedLeaderEpoch
                | C::UnknownLeaderEpoch
                | C::RequestTimedOut
                | C::BrokerNotAvailable
                | C::NetworkException
                | C::NotEnoughReplicas
                | C::NotEnoughReplicasAfterAppend
                | C::KafkaStorageError
                | C::ThrottlingQuotaExceeded,
            ) => Outcome::unavailable(reason(format!(
                "the brokers {} cannot take records for topic `{topic}` now ({error}){}",
                self.brokers,
                news()
            ))),
            _ => Outcome::retry(reason(format!(
                "producing to topic `{topic}` failed: {error}{}",
                news()
            ))),
        }
    }
}

fn create_producer(
    client_config: &rdkafka::ClientConfig,
    news: &Arc<BrokerNews>,
) -> Result<Client, SinkError> {
    client_config
        .create_with_context(SinkContext { news: news.clone() })
        .map_err(|e| {
            config_error(format!(
                "librdkafka refused the configuration: {e} (check `properties` and the settings it names)"
            ))
        })
}

/// Whether `topic` is a legal Kafka topic name: 1–249 characters of `[a-zA-Z0-9._-]`, not
/// `.` or `..`.
fn check_topic(topic: &str) -> Result<(), String> {
    if topic.is_empty() {
        return Err("the topic name is empty".to_owned());
    }
    if topic.len() > 249 {
        return Err(format!(
            "a topic name has at most 249 characters, this one has {}",
            topic.len()
        ));
    }
    if topic == "." || topic == ".." {
        return Err("`.` and `..` are not topic names".to_owned());
    }
    if let Some(bad) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "a topic name may hold only ASCII letters, digits, `.`, `_` and `-`, not `{bad}`"
        ));
    }
    Ok(())
}

#[async_trait]
impl Sink for KafkaSink {
    fn name(&self) -> &str {
        "kafka"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let producer = self.producer();
        let started = Instant::now();
        let until = started + self.delivery_timeout;
        let mut slots = Vec::with_capacity(events.len());
        for event in events {
            slots.push(self.enqueue(&producer, event, until).await);
        }
        // Every record is queued; librdkafka batches them. Wait for all reports together. The
        // extra second covers the report of a record that times out right at the deadline.
        let wait_until = tokio::time::Instant::from_std(until + Duration::from_secs(1));
        let fenced = std::sync::atomic::AtomicBool::new(false);
        let fenced = &fenced;
        let outcomes = join_all(slots.into_iter().zip(events).map(|(slot, event)| async move {
            match slot {
                Slot::Done(outcome) => outcome,
                Slot::Waiting {
                    topic,
                    size,
                    delivery,
                } => match tokio::time::timeout_at(wait_until, delivery).await {
                    Ok(Ok(Ok(delivery))) => {
                        // Where the broker says it put the record: lets a record missing from
                        // the topic later be told apart as overwritten, truncated or never
                        // written (the correctness harness reads these back).
                        debug!(
                            event_id = %event.id,
                            topic = %topic,
                            partition = delivery.partition,
                            offset = delivery.offset,
                            "Kafka record acknowledged."
                        );
                        Outcome::Delivered
                    }
                    Ok(Ok(Err((error, _)))) => {
                        if is_fenced(&error) {
                            fenced.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        self.classify(&error, &topic, size)
                    }
                    Ok(Err(_canceled)) => Outcome::unavailable(format!(
                        "the Kafka producer was shut down before topic `{topic}` confirmed the record"
                    )),
                    Err(_) => Outcome::unavailable(format!(
                        "no delivery report for topic `{topic}` within {} ms from brokers {}{}",
                        self.delivery_timeout.as_millis(),
                        self.brokers,
                        self.news
                            .recent()
                            .map(|n| format!("; last broker error: {n}"))
                            .unwrap_or_default()
                    )),
                },
            }
        }))
        .await;
        self.replace_if_fatal(&producer, fenced.load(std::sync::atomic::Ordering::Relaxed));
        debug!(
            events = events.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "Kafka batch settled."
        );
        outcomes
    }

    /// Asks the brokers for cluster metadata; `Unavailable` when none answers within
    /// `delivery_timeout`.
    async fn check(&self) -> Result<(), SinkError> {
        let producer = self.producer();
        let timeout = self.delivery_timeout;
        let brokers = self.brokers.clone();
        let answer = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, timeout)
                .map(|m| m.brokers().len())
        })
        .await;
        match answer {
            Ok(Ok(n)) if n > 0 => Ok(()),
            Ok(Ok(_)) => Err(SinkError::Unavailable(format!(
                "Kafka at {brokers} answered with no brokers"
            ))),
            Ok(Err(error)) => Err(SinkError::Unavailable(format!(
                "Kafka at {brokers} did not answer a metadata request within {} ms: {error}",
                timeout.as_millis()
            ))),
            Err(join) => Err(SinkError::Unavailable(format!(
                "the Kafka metadata request failed: {join}"
            ))),
        }
    }
}

/// Whether a delivery error means this producer instance can no longer produce (its producer
/// id or epoch was superseded): the fix is a fresh producer, not a retry with the same one.
fn is_fenced(error: &KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    let code = match error {
        KafkaError::MessageProduction(code) => Some(*code),
        other => other.rdkafka_error_code(),
    };
    matches!(
        code,
        Some(C::Fatal | C::Fenced | C::ProducerFenced | C::InvalidProducerEpoch)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fenced_producers_are_recognised_for_replacement() {
        use rdkafka::types::RDKafkaErrorCode as C;
        for code in [
            C::ProducerFenced,
            C::InvalidProducerEpoch,
            C::Fenced,
            C::Fatal,
        ] {
            assert!(is_fenced(&KafkaError::MessageProduction(code)), "{code:?}");
        }
        for code in [
            C::MessageSizeTooLarge,
            C::MessageTimedOut,
            C::UnknownTopicOrPartition,
        ] {
            assert!(!is_fenced(&KafkaError::MessageProduction(code)), "{code:?}");
        }
    }

    fn sink() -> KafkaSink {
        // A port nothing listens on: creating the sink must still work.
        let config: KafkaSinkConfig =
            serde_json::from_str(r#"{"brokers": ["127.0.0.1:1"], "delivery_timeout": "1s"}"#)
                .unwrap();
        KafkaSink::connect(config).unwrap()
    }

    #[test]
    fn topic_names_are_checked() {
        assert!(check_topic("events.OrderCreated").is_ok());
        assert!(check_topic("a_b-c.9").is_ok());
        assert!(check_topic("").is_err());
        assert!(check_topic("..").is_err());
        assert!(check_topic("has space").unwrap_err().contains("` `"));
        assert!(check_topic(&"x".repeat(250)).is_err());
    }

    #[tokio::test]
    async fn failures_are_classified_with_the_topic_and_the_fix() {
        let sink = sink();
        let too_large = sink.classify(
            &KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge),
            "t1",
            2_000_000,
        );
        let Outcome::Reject { reason } = too_large else {
            panic!("{too_large:?}")
        };
        assert!(reason.contains("`t1`") && reason.contains("max_message_bytes"));
        let unknown = sink.classify(
            &KafkaError::MessageProduction(RDKafkaErrorCode::UnknownTopicOrPartition),
            "t2",
            10,
        );
        assert!(
            matches!(&unknown, Outcome::Reject { reason } if reason.contains("create the topic")),
            "{unknown:?}"
        );
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::QueueFull,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::NotEnoughReplicas,
            RDKafkaErrorCode::LeaderNotAvailable,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::SSL,
        ] {
            let outcome = sink.classify(&KafkaError::MessageProduction(code), "t3", 10);
            assert!(
                matches!(&outcome, Outcome::Unavailable { reason, .. } if reason.contains("t3") || reason.contains("127.0.0.1:1")),
                "{code:?}: the destination is unavailable, not the event at fault: {outcome:?}"
            );
        }
        let other = sink.classify(
            &KafkaError::MessageProduction(RDKafkaErrorCode::InvalidTimestamp),
            "t4",
            10,
        );
        assert!(
            matches!(&other, Outcome::Retry { reason, .. } if reason.contains("t4")),
            "an unexplained per-record error costs an attempt: {other:?}"
        );
    }

    #[test]
    fn librdkafka_refusing_a_property_is_a_configuration_error() {
        let config: KafkaSinkConfig =
            serde_json::from_str(r#"{"properties": {"no.such.property": "1"}}"#).unwrap();
        let err = KafkaSink::connect(config).unwrap_err().to_string();
        assert!(err.contains("no.such.property"), "{err}");
    }

    #[tokio::test]
    async fn an_unreachable_broker_means_unavailable_not_a_failed_start() {
        let sink = sink();
        let event = event();
        let outcomes = sink.publish(&[event]).await;
        assert!(
            matches!(&outcomes[..], [Outcome::Unavailable { reason, .. }] if reason.contains("events.OrderCreated") && reason.contains("127.0.0.1:1")),
            "{outcomes:?}"
        );
        assert!(sink.check().await.is_err());
    }

    /// An `OrderCreated` event of aggregate `order` `1`.
    fn event() -> Event {
        outbox_types::NewEvent::from_json("order", "1", "OrderCreated", "{}")
            .unwrap()
            .claimed(1)
    }

    #[test]
    fn a_record_carries_one_content_type() {
        use rdkafka::message::Headers as _;
        let sink = sink();
        let mut headers = outbox_types::Headers::new();
        headers.insert("Content-Type".into(), "text/plain".into());
        headers.insert("trace-id".into(), "t".into());
        let event = Event { headers, ..event() };
        let owned = sink.headers(&event);
        let types: Vec<_> = owned
            .iter()
            .filter(|h| h.key.eq_ignore_ascii_case("content-type"))
            .map(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
            .collect();
        assert_eq!(types, vec![Some("application/json".to_owned())]);
        assert!(owned.iter().any(|h| h.key == "trace-id"));
    }
}
