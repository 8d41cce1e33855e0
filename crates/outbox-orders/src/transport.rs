//! Broker transports of the delivery and billing services: NATS JetStream (feature `nats`) and
//! Kafka (feature `kafka`). Each sets up what the broker needs (a durable pull consumer; a
//! consumer group or a direct partition assignment) and hands every message to
//! `outbox_inbox`'s adapter with a [`Consumer`] as the handler, which acks (commits the offset)
//! only after the consumer's own transaction committed.
//!
//! Both run until `shutdown` completes. The handler logic is the same on every transport; this
//! module is only plumbing.

#![cfg_attr(not(any(feature = "nats", feature = "kafka")), allow(unused_imports))]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use outbox_inbox::{AdapterOptions, BoxFuture};

use crate::Error;
use crate::consumers::Consumer;

/// Where a consumer reads from.
#[derive(Clone, Debug, clap::Args)]
pub struct TransportArgs {
    /// `nats` (JetStream pull consumer) or `kafka`.
    #[arg(long, value_enum, default_value_t = Transport::Nats)]
    pub transport: Transport,
    /// NATS server URL.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// JetStream stream holding the order events (created if missing, capturing
    /// `--subjects`).
    #[arg(long, default_value = "ORDERS")]
    pub stream: String,
    /// Subjects of the stream when it is created, and the consumer's filter.
    #[arg(long, default_value = "orders.>")]
    pub subjects: String,
    /// Durable consumer / consumer group name [default: the service name].
    #[arg(long)]
    pub durable: Option<String>,
    /// Kafka bootstrap brokers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:19092")]
    pub kafka_brokers: String,
    /// Kafka topic of the order events.
    #[arg(long, default_value = "orders")]
    pub topic: String,
    /// Read every partition of the topic by direct assignment (starting at the group's
    /// committed offsets) instead of joining the consumer group: no rebalance wait, but run
    /// only one instance per service.
    #[arg(long)]
    pub kafka_assign: bool,
    /// Deliveries of a failing message before it is parked.
    #[arg(long, default_value_t = 10)]
    pub max_attempts: u32,
    /// Pause before a failed message is tried again, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub retry_delay_ms: u64,
}

impl Default for TransportArgs {
    fn default() -> Self {
        TransportArgs {
            transport: Transport::Nats,
            nats_url: "nats://127.0.0.1:4222".into(),
            stream: "ORDERS".into(),
            subjects: "orders.>".into(),
            durable: None,
            kafka_brokers: "127.0.0.1:19092".into(),
            topic: "orders".into(),
            kafka_assign: false,
            max_attempts: 10,
            retry_delay_ms: 500,
        }
    }
}

/// The broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// NATS JetStream.
    Nats,
    /// Kafka (any Kafka-protocol broker).
    Kafka,
}

impl TransportArgs {
    fn options(&self) -> AdapterOptions {
        AdapterOptions::default()
            .with_max_attempts(self.max_attempts)
            .with_retry_delay(Duration::from_millis(self.retry_delay_ms))
    }

    /// The durable consumer (NATS) or consumer group (Kafka) `consumer` reads as: `--durable`,
    /// else the service's name.
    fn durable_for(&self, consumer: &Consumer) -> String {
        self.durable
            .clone()
            .unwrap_or_else(|| consumer.service().name().to_owned())
    }
}

/// `outbox_inbox`'s adapter for one broker, set up, running until it fails.
type Adapter = BoxFuture<'static, Result<(), outbox_inbox::Error>>;

/// Consume with `consumer` from the broker `args` name until `shutdown` completes: set up what
/// the broker needs (reading as `--durable`, else the service's name), then run
/// `outbox_inbox`'s adapter for it with the attempts and retry delay of `args` until it fails
/// or `shutdown` completes.
pub async fn consume(
    consumer: Arc<Consumer>,
    args: &TransportArgs,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    let durable = args.durable_for(&consumer);
    let options = args.options();
    let adapter: Result<Adapter, Error> = match args.transport {
        #[cfg(feature = "nats")]
        Transport::Nats => {
            let pull =
                nats::pull_consumer(&args.nats_url, &args.stream, &args.subjects, &durable).await?;
            tracing::info!(service = consumer.service().name(), stream = %args.stream, durable = %durable, "Consuming from NATS JetStream.");
            Ok(Box::pin(async move {
                outbox_inbox::nats::run(&pull, &consumer, &options).await
            }))
        }
        #[cfg(feature = "kafka")]
        Transport::Kafka => {
            let kafka = kafka::set_up(args, &durable).await?;
            tracing::info!(service = consumer.service().name(), topic = %args.topic, group = %durable, assign = args.kafka_assign, "Consuming from Kafka.");
            Ok(Box::pin(async move {
                outbox_inbox::kafka::run(&kafka, &consumer, &options).await
            }))
        }
        #[allow(unreachable_patterns)]
        other => {
            let _ = (durable, options);
            Err(Error::Invalid(format!(
                "this build has no {other:?} transport (enable the crate feature)"
            )))
        }
    };
    let adapter = adapter?;
    tokio::select! {
        done = adapter => Ok(done?),
        () = shutdown => Ok(()),
    }
}

/// NATS JetStream.
#[cfg(feature = "nats")]
pub mod nats {
    use super::*;
    use async_nats::jetstream::{self, consumer::AckPolicy, consumer::pull, stream};

    /// Make sure the stream exists (created with `subjects` when missing) and return the
    /// durable pull consumer `durable` on it (created when missing: explicit acks, every
    /// subject of `filter`, delivered from the start, no server-side delivery limit — the
    /// inbox adapter parks after its own attempt count).
    pub async fn pull_consumer(
        url: &str,
        stream_name: &str,
        subjects: &str,
        durable: &str,
    ) -> Result<jetstream::consumer::PullConsumer, Error> {
        let client = async_nats::connect(url)
            .await
            .map_err(|e| Error::Broker(format!("cannot connect to NATS at {url}: {e}")))?;
        let js = jetstream::new(client);
        let stream = js
            .get_or_create_stream(stream::Config {
                name: stream_name.to_owned(),
                subjects: vec![subjects.to_owned()],
                ..Default::default()
            })
            .await
            .map_err(|e| Error::Broker(format!("JetStream stream `{stream_name}`: {e}")))?;
        stream
            .get_or_create_consumer(
                durable,
                pull::Config {
                    durable_name: Some(durable.to_owned()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: Duration::from_secs(30),
                    filter_subject: subjects.to_owned(),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| Error::Broker(format!("JetStream consumer `{durable}`: {e}")))
    }
}

/// Kafka.
#[cfg(feature = "kafka")]
pub mod kafka {
    use super::*;
    use rdkafka::consumer::{Consumer as _, StreamConsumer};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    /// A consumer of `topic` in group `group` with offsets committed only by the inbox
    /// adapter. With `assign`, every partition of the topic is assigned directly, starting at
    /// the group's committed offset (or the beginning); otherwise the consumer joins the group.
    /// Blocking (metadata round trip): call it from `spawn_blocking`.
    pub fn stream_consumer(
        brokers: &str,
        topic: &str,
        group: &str,
        assign: bool,
    ) -> Result<StreamConsumer, Error> {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .map_err(|e| Error::Broker(format!("Kafka consumer for {brokers}: {e}")))?;
        if assign {
            let partitions = {
                let metadata = consumer
                    .fetch_metadata(Some(topic), Duration::from_secs(10))
                    .map_err(|e| Error::Broker(format!("Kafka metadata of `{topic}`: {e}")))?;
                metadata
                    .topics()
                    .iter()
                    .find(|t| t.name() == topic)
                    .map(|t| t.partitions().len())
                    .unwrap_or(0)
            };
            if partitions == 0 {
                return Err(Error::Broker(format!(
                    "Kafka topic `{topic}` has no partitions (does it exist?)"
                )));
            }
            let mut list = TopicPartitionList::new();
            for p in 0..partitions {
                list.add_partition_offset(topic, p as i32, Offset::Stored)
                    .map_err(|e| Error::Broker(format!("Kafka assignment: {e}")))?;
            }
            consumer
                .assign(&list)
                .map_err(|e| Error::Broker(format!("Kafka assignment of `{topic}`: {e}")))?;
        } else {
            consumer
                .subscribe(&[topic])
                .map_err(|e| Error::Broker(format!("Kafka subscription to `{topic}`: {e}")))?;
        }
        Ok(consumer)
    }

    /// [`stream_consumer`] of the brokers and topic `args` name, in `group`, off the async
    /// workers (metadata and assignment calls block).
    pub(super) async fn set_up(args: &TransportArgs, group: &str) -> Result<StreamConsumer, Error> {
        let (brokers, topic, group) = (
            args.kafka_brokers.clone(),
            args.topic.clone(),
            group.to_owned(),
        );
        let assign = args.kafka_assign;
        tokio::task::spawn_blocking(move || stream_consumer(&brokers, &topic, &group, assign))
            .await
            .map_err(|e| Error::Io(format!("Kafka set-up task: {e}")))?
    }
}
