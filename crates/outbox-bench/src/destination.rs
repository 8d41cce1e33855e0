//! The real destinations of `drain --sink`: the parent prepares one per run (stream, topic,
//! exchange + queue, stream key, HTTP receiver), the relay child builds its sink from the same
//! configuration structs the `outbox` binary reads, and afterwards the parent counts what the
//! destination received and deletes what it created.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use outbox_types::Sink;
use serde::{Deserialize, Serialize};

/// The destinations `drain` can publish to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    /// In-process channel (no broker: the relay's own cost).
    Channel,
    /// NATS JetStream.
    Nats,
    /// Kafka protocol (tansu on this machine).
    Kafka,
    /// RabbitMQ with publisher confirms.
    Rabbitmq,
    /// Redis Streams.
    Redis,
    /// HTTP webhook to a local receiver.
    Webhook,
}

impl SinkKind {
    pub fn name(self) -> &'static str {
        match self {
            SinkKind::Channel => "channel",
            SinkKind::Nats => "nats",
            SinkKind::Kafka => "kafka",
            SinkKind::Rabbitmq => "rabbitmq",
            SinkKind::Redis => "redis",
            SinkKind::Webhook => "webhook",
        }
    }

    /// The throughput target of issue 3 ("Performance"), events/s.
    pub fn target(self) -> Option<f64> {
        match self {
            SinkKind::Channel => None,
            SinkKind::Nats | SinkKind::Redis => Some(15_000.0),
            SinkKind::Kafka | SinkKind::Rabbitmq => Some(10_000.0),
            SinkKind::Webhook => Some(5_000.0),
        }
    }
}

impl std::fmt::Display for SinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the brokers are and how to configure their sinks.
#[derive(Clone, Debug)]
pub struct Endpoints {
    pub nats_url: String,
    pub kafka_brokers: String,
    pub kafka_partitions: i32,
    pub amqp_url: String,
    pub redis_url: String,
    pub webhook_concurrency: usize,
    /// `--sink-set key=value`: merged into the sink's configuration last.
    pub overrides: Vec<(String, serde_json::Value)>,
}

/// Parse `key=value`; the value as JSON when it is JSON (`5`, `true`, `"x"`), else as a string.
pub fn parse_override(text: &str) -> anyhow::Result<(String, serde_json::Value)> {
    let (key, value) = text
        .split_once('=')
        .with_context(|| format!("`--sink-set {text}`: expected KEY=VALUE"))?;
    let value =
        serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::String(value.to_owned()));
    Ok((key.trim().to_owned(), value))
}

/// One prepared destination.
pub struct Destination {
    /// What it is, with the broker version where it was cheap to learn.
    pub detail: String,
    /// The sink configuration the relay child gets (JSON of the sink crate's config struct).
    pub sink_config: serde_json::Value,
    state: State,
}

enum State {
    Channel,
    Nats {
        jetstream: async_nats::jetstream::Context,
        stream: String,
    },
    Kafka {
        admin: Arc<rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>>,
        brokers: String,
        topic: String,
        partitions: i32,
    },
    Rabbitmq {
        _connection: lapin::Connection,
        channel: lapin::Channel,
        exchange: String,
        queue: String,
    },
    Redis {
        connection: redis::aio::MultiplexedConnection,
        key: String,
    },
    Webhook(WebhookReceiver),
}

impl Destination {
    /// Create the destination named `name` (prefixed `outbox_bench_`) for `kind`.
    pub async fn prepare(
        kind: SinkKind,
        endpoints: &Endpoints,
        name: &str,
    ) -> anyhow::Result<Self> {
        let (detail, mut sink_config, state) = match kind {
            SinkKind::Channel => (
                "in-process tokio channel, drained by a task of the relay process".to_owned(),
                serde_json::json!({}),
                State::Channel,
            ),
            SinkKind::Nats => prepare_nats(endpoints, name).await?,
            SinkKind::Kafka => prepare_kafka(endpoints, name).await?,
            SinkKind::Rabbitmq => prepare_rabbitmq(endpoints, name).await?,
            SinkKind::Redis => prepare_redis(endpoints, name).await?,
            SinkKind::Webhook => {
                let receiver = WebhookReceiver::start()?;
                let config = serde_json::json!({
                    "url": format!("http://{}/hooks/${{event_type}}", receiver.addr),
                    // Signed as in production: the HMAC is part of the cost per event.
                    "secret": "whsec_outbox_bench",
                    "concurrency": endpoints.webhook_concurrency,
                });
                (
                    format!(
                        "axum 0.8 receiver on http://{} answering 200, in the bench's parent process (its own thread and runtime; it shares the machine's cores with the relay); signed requests (HMAC-SHA256), concurrency {}",
                        receiver.addr, endpoints.webhook_concurrency
                    ),
                    config,
                    State::Webhook(receiver),
                )
            }
        };
        if kind != SinkKind::Channel
            && let Some(object) = sink_config.as_object_mut()
        {
            for (key, value) in &endpoints.overrides {
                object.insert(key.clone(), value.clone());
            }
        }
        Ok(Destination {
            detail,
            sink_config,
            state,
        })
    }

    /// How many messages the destination holds now (distinct event ids for Kafka and the
    /// webhook); `None` for the channel, whose receiver lives in the relay child. `expect` lets
    /// a count that has to consume stop once it has seen that many.
    pub async fn received(&mut self, expect: u64) -> anyhow::Result<Option<u64>> {
        Ok(Some(match &mut self.state {
            State::Channel => return Ok(None),
            State::Nats { jetstream, stream } => {
                let mut handle = jetstream
                    .get_stream(stream.as_str())
                    .await
                    .with_context(|| format!("NATS stream {stream}"))?;
                handle.info().await?.state.messages
            }
            State::Kafka {
                brokers,
                topic,
                partitions,
                ..
            } => {
                // Consumed, not read off the watermarks: tansu reports the high watermark as
                // the base offset of the last record batch + 1, which undercounts.
                let (brokers, topic, partitions) = (brokers.clone(), topic.clone(), *partitions);
                tokio::task::spawn_blocking(move || {
                    count_kafka_records(&brokers, &topic, partitions, expect)
                })
                .await??
            }
            State::Rabbitmq { channel, queue, .. } => {
                let ready = outbox_testkit::rabbitmq::ready_messages(channel, queue)
                    .await
                    .with_context(|| format!("RabbitMQ queue {queue}"))?;
                u64::from(ready)
            }
            State::Redis { connection, key } => {
                redis::cmd("XLEN")
                    .arg(key.as_str())
                    .query_async(connection)
                    .await?
            }
            State::Webhook(receiver) => receiver.distinct(),
        }))
    }

    /// Requests the webhook receiver answered beyond one per distinct event id (redeliveries).
    pub fn duplicates(&self) -> Option<u64> {
        match &self.state {
            State::Webhook(receiver) => {
                Some(receiver.requests().saturating_sub(receiver.distinct()))
            }
            _ => None,
        }
    }

    /// Delete what `prepare` created.
    pub async fn cleanup(self) -> anyhow::Result<()> {
        match self.state {
            State::Channel => {}
            State::Nats { jetstream, stream } => {
                jetstream
                    .delete_stream(stream.as_str())
                    .await
                    .with_context(|| format!("deleting NATS stream {stream}"))?;
            }
            State::Kafka { admin, topic, .. } => {
                let options = rdkafka::admin::AdminOptions::new()
                    .operation_timeout(Some(Duration::from_secs(10)));
                for result in admin.delete_topics(&[topic.as_str()], &options).await? {
                    result.map_err(|(t, e)| anyhow!("deleting Kafka topic {t}: {e}"))?;
                }
            }
            State::Rabbitmq {
                _connection: connection,
                channel,
                exchange,
                queue,
            } => {
                channel
                    .queue_delete(queue.as_str().into(), Default::default())
                    .await
                    .with_context(|| format!("deleting RabbitMQ queue {queue}"))?;
                channel
                    .exchange_delete(exchange.as_str().into(), Default::default())
                    .await
                    .with_context(|| format!("deleting RabbitMQ exchange {exchange}"))?;
                let _ = connection.close(200, "OK".into()).await;
            }
            State::Redis {
                mut connection,
                key,
            } => {
                let _: () = redis::cmd("DEL")
                    .arg(key.as_str())
                    .query_async(&mut connection)
                    .await?;
            }
            State::Webhook(receiver) => receiver.stop()?,
        }
        Ok(())
    }
}

type Prepared = (String, serde_json::Value, State);

async fn prepare_nats(endpoints: &Endpoints, name: &str) -> anyhow::Result<Prepared> {
    use async_nats::jetstream;
    let client = async_nats::connect(endpoints.nats_url.as_str())
        .await
        .with_context(|| format!("connecting to NATS at {}", endpoints.nats_url))?;
    let info = client.server_info();
    let jetstream = jetstream::new(client);
    let stream = name.to_owned();
    jetstream
        .create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{stream}.>")],
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .with_context(|| format!("creating JetStream stream {stream}"))?;
    let detail = format!(
        "NATS {} JetStream at {}: stream {stream} (file storage, subjects {stream}.>, default 2 min duplicate window)",
        info.version, endpoints.nats_url
    );
    let config = serde_json::json!({
        "servers": [endpoints.nats_url],
        "subject": format!("{stream}.${{event_type}}"),
    });
    Ok((detail, config, State::Nats { jetstream, stream }))
}

async fn prepare_kafka(endpoints: &Endpoints, name: &str) -> anyhow::Result<Prepared> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &endpoints.kafka_brokers)
        .set("socket.connection.setup.timeout.ms", "5000")
        .create()
        .context("Kafka admin client")?;
    let admin = Arc::new(admin);
    let topic = name.to_owned();
    let partitions = endpoints.kafka_partitions.max(1);
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let created = admin
        .create_topics(
            &[NewTopic::new(
                &topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &options,
        )
        .await
        .with_context(|| {
            format!(
                "creating Kafka topic {topic} at {} (start the broker with scripts/kafka.sh)",
                endpoints.kafka_brokers
            )
        })?;
    for result in created {
        result.map_err(|(t, e)| anyhow!("creating Kafka topic {t}: {e}"))?;
    }
    // Wait until the topic's partitions show in metadata, so the relay does not measure that.
    let probe = admin.clone();
    let probe_topic = topic.clone();
    let brokers = tokio::task::spawn_blocking(move || -> anyhow::Result<usize> {
        for _ in 0..50 {
            let metadata = probe
                .inner()
                .fetch_metadata(Some(&probe_topic), Duration::from_secs(5))?;
            let ready = metadata
                .topics()
                .iter()
                .any(|t| t.error().is_none() && t.partitions().len() == partitions as usize);
            if ready {
                return Ok(metadata.brokers().len());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("topic {probe_topic} did not show {partitions} partitions in metadata")
    })
    .await??;
    let detail = format!(
        "Kafka-protocol broker at {} ({brokers} broker(s); the protocol does not expose a server version — on this machine tansu with in-memory storage, see scripts/kafka.sh): topic {topic}, {partitions} partitions, replication 1, created with the admin API",
        endpoints.kafka_brokers
    );
    let config = serde_json::json!({
        "brokers": endpoints.kafka_brokers,
        "topic": topic,
    });
    Ok((
        detail,
        config,
        State::Kafka {
            admin,
            brokers: endpoints.kafka_brokers.clone(),
            topic,
            partitions,
        },
    ))
}

/// Distinct `outbox-event-id`s in `topic`, read from the beginning of every partition (no
/// consumer group: `assign`), until `expect` were seen or nothing came for 5 s.
fn count_kafka_records(
    brokers: &str,
    topic: &str,
    partitions: i32,
    expect: u64,
) -> anyhow::Result<u64> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", topic)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .context("Kafka consumer")?;
    let mut assignment = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        assignment.add_partition_offset(topic, p, rdkafka::Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let mut ids = HashSet::new();
    let mut last_news = std::time::Instant::now();
    while (ids.len() as u64) < expect && last_news.elapsed() < Duration::from_secs(5) {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                last_news = std::time::Instant::now();
                let id = message.headers().and_then(|headers| {
                    headers
                        .iter()
                        .find(|h| h.key == "outbox-event-id")
                        .and_then(|h| h.value)
                        .map(<[u8]>::to_vec)
                });
                if let Some(id) = id {
                    ids.insert(id);
                }
            }
            Some(Err(error)) => bail!("consuming {topic}: {error}"),
            None => {}
        }
    }
    Ok(ids.len() as u64)
}

async fn prepare_rabbitmq(endpoints: &Endpoints, name: &str) -> anyhow::Result<Prepared> {
    let version = rabbitmq_version(&endpoints.amqp_url)
        .await
        .unwrap_or_else(|e| format!("(version unknown: {e})"));
    let connection =
        lapin::Connection::connect(&endpoints.amqp_url, lapin::ConnectionProperties::default())
            .await
            .with_context(|| {
                format!("connecting to RabbitMQ at {}", redact(&endpoints.amqp_url))
            })?;
    let channel = connection.create_channel().await?;
    let exchange = name.to_owned();
    let queue = name.to_owned();
    outbox_testkit::rabbitmq::declare_topic_exchange(&channel, &exchange).await?;
    outbox_testkit::rabbitmq::declare_bound_queue(&channel, &queue, &exchange, "#").await?;
    let detail = format!(
        "RabbitMQ {version} at {}: durable topic exchange {exchange} -> durable classic queue {queue} (binding #); publisher confirms, mandatory, persistent messages",
        redact(&endpoints.amqp_url)
    );
    let config = serde_json::json!({
        "url": endpoints.amqp_url,
        "exchange": exchange,
        "mandatory": true,
        "persistent": true,
    });
    Ok((
        detail,
        config,
        State::Rabbitmq {
            _connection: connection,
            channel,
            exchange,
            queue,
        },
    ))
}

/// The broker's `version` server property, read from the AMQP `connection.start` frame (lapin
/// does not keep the server properties). Opens and drops one TCP connection.
async fn rabbitmq_version(url: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url
        .split_once("://")
        .map(|(_, r)| r)
        .context("no scheme in the AMQP URL")?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    let address = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    };
    let read = async {
        let mut socket = tokio::net::TcpStream::connect(&address).await?;
        socket.write_all(b"AMQP\x00\x00\x09\x01").await?;
        let mut frame = vec![0u8; 8192];
        let mut len = 0;
        while len < frame.len() {
            let n = socket.read(&mut frame[len..]).await?;
            if n == 0 {
                break;
            }
            len += n;
            if find_long_string(&frame[..len], b"version").is_some() {
                break;
            }
        }
        frame.truncate(len);
        Ok::<_, anyhow::Error>(frame)
    };
    let frame = tokio::time::timeout(Duration::from_secs(5), read).await??;
    let version = find_long_string(&frame, b"version").context("no version property")?;
    let product = find_long_string(&frame, b"product").unwrap_or_else(|| "RabbitMQ".into());
    Ok(if product == "RabbitMQ" {
        version
    } else {
        format!("{version} ({product})")
    })
}

/// In an AMQP field table: the long-string value of the short-string key `key`.
fn find_long_string(bytes: &[u8], key: &[u8]) -> Option<String> {
    let mut needle = vec![u8::try_from(key.len()).ok()?];
    needle.extend_from_slice(key);
    needle.push(b'S');
    let at = bytes.windows(needle.len()).position(|w| w == needle)? + needle.len();
    let len = u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize;
    let value = bytes.get(at + 4..at + 4 + len)?;
    Some(String::from_utf8_lossy(value).into_owned())
}

fn redact(url: &str) -> String {
    outbox_types::redact::redact_url(url)
}

async fn prepare_redis(endpoints: &Endpoints, name: &str) -> anyhow::Result<Prepared> {
    let client = redis::Client::open(endpoints.redis_url.as_str())?;
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("connecting to Redis at {}", redact(&endpoints.redis_url)))?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut connection)
        .await?;
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("(unknown)")
        .trim()
        .to_owned();
    let key = name.to_owned();
    let _: () = redis::cmd("DEL")
        .arg(key.as_str())
        .query_async(&mut connection)
        .await?;
    let detail = format!(
        "Redis {version} at {}: stream key {key}, XADD without MAXLEN",
        redact(&endpoints.redis_url)
    );
    let config = serde_json::json!({
        "url": endpoints.redis_url,
        "stream": key,
    });
    Ok((detail, config, State::Redis { connection, key }))
}

/// An HTTP receiver answering 200 to every POST, counting requests and distinct `X-Event-Id`s.
/// Runs on its own thread with a single-threaded runtime.
struct WebhookReceiver {
    addr: SocketAddr,
    requests: Arc<AtomicU64>,
    ids: Arc<Mutex<HashSet<String>>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl WebhookReceiver {
    fn start() -> anyhow::Result<Self> {
        use axum::routing::post;
        let requests = Arc::new(AtomicU64::new(0));
        let ids = Arc::new(Mutex::new(HashSet::<String>::new()));
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let counter = requests.clone();
        let seen = ids.clone();
        let thread = std::thread::Builder::new()
            .name("webhook-receiver".into())
            .spawn(move || -> anyhow::Result<()> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async move {
                    let app = axum::Router::new().route(
                        "/{*path}",
                        post(
                            move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                                let counter = counter.clone();
                                let seen = seen.clone();
                                async move {
                                    counter.fetch_add(1, Ordering::Relaxed);
                                    if let Some(id) =
                                        headers.get("x-event-id").and_then(|v| v.to_str().ok())
                                    {
                                        seen.lock()
                                            .unwrap_or_else(|p| p.into_inner())
                                            .insert(id.to_owned());
                                    }
                                    drop(body);
                                    axum::http::StatusCode::OK
                                }
                            },
                        ),
                    );
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    axum::serve(listener, app)
                        .with_graceful_shutdown(async move {
                            let _ = stop_rx.await;
                        })
                        .await?;
                    Ok(())
                })
            })?;
        Ok(WebhookReceiver {
            addr,
            requests,
            ids,
            shutdown: Some(stop_tx),
            thread: Some(thread),
        })
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    fn distinct(&self) -> u64 {
        self.ids.lock().unwrap_or_else(|p| p.into_inner()).len() as u64
    }

    fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.shutdown.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            thread
                .join()
                .map_err(|_| anyhow!("the webhook receiver thread panicked"))??;
        }
        Ok(())
    }
}

/// Build the sink of `kind` from its configuration JSON, the way `outbox relay` builds it
/// from its config file (`crates/outbox-cli/src/sinks.rs`).
pub async fn build_sink(kind: SinkKind, config: &str) -> anyhow::Result<Arc<dyn Sink>> {
    // The sinks whose `connect` is not async share one shape but no trait to be generic over.
    macro_rules! connect {
        ($sink:ty) => {
            Arc::new(<$sink>::connect(serde_json::from_str(config)?).map_err(|e| anyhow!("{e}"))?)
        };
    }
    Ok(match kind {
        SinkKind::Channel => bail!("the channel sink is built by the relay child itself"),
        SinkKind::Nats => Arc::new(
            outbox_sink_nats::NatsSink::connect(serde_json::from_str(config)?)
                .await
                .map_err(|e| anyhow!("{e}"))?,
        ),
        SinkKind::Kafka => connect!(outbox_sink_kafka::KafkaSink),
        SinkKind::Rabbitmq => connect!(outbox_sink_rabbitmq::RabbitMqSink),
        SinkKind::Redis => connect!(outbox_sink_redis::RedisSink),
        SinkKind::Webhook => connect!(outbox_sink_webhook::WebhookSink),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_parse_json_or_text() {
        assert_eq!(
            parse_override("linger=1ms").unwrap(),
            ("linger".to_owned(), serde_json::json!("1ms"))
        );
        assert_eq!(
            parse_override("persistent=false").unwrap(),
            ("persistent".to_owned(), serde_json::json!(false))
        );
        assert!(parse_override("nothing").is_err());
    }

    #[test]
    fn amqp_field_table_lookup() {
        let mut frame = b"\x01\x00\x00junk".to_vec();
        frame.extend_from_slice(b"\x07productS\x00\x00\x00\x08RabbitMQ");
        frame.extend_from_slice(b"\x07versionS\x00\x00\x00\x063.10.8");
        assert_eq!(
            find_long_string(&frame, b"version").as_deref(),
            Some("3.10.8")
        );
        assert_eq!(
            find_long_string(&frame, b"product").as_deref(),
            Some("RabbitMQ")
        );
        assert_eq!(find_long_string(&frame, b"platform"), None);
    }
}
