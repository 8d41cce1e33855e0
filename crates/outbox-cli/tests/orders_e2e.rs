//! The seeds' Order system end to end, on the machine's PostgreSQL and a real broker, with the
//! `outbox` relay as a separate process (`CARGO_BIN_EXE_outbox`, configured with a
//! `[destinations.*]` table as in the destinations spec).
//!
//! Each test: 1,000 orders over HTTP (about 10 % cancelled, some cancelled twice) plus invalid
//! and over-the-credit-limit requests; the order service, delivery and billing run in this
//! process from `outbox-orders` (each on its own `outbox_t_…` schema), the relay outside it.
//! Once everything settled, every event is published **again** straight to the broker (NATS:
//! a fresh `Nats-Msg-Id`, so JetStream's duplicate window does not drop it, but the same
//! `outbox-event-id`), and the test waits for both consumers to have seen those duplicates.
//! Then: every order exactly one reservation and one charge, every cancellation exactly one
//! release and one refund, nothing for rejected requests, every outbox row delivered, nothing
//! parked (`outbox_orders::check`).
//!
//! Variants: NATS; NATS with the relay SIGKILLed midway and restarted; Kafka (the broker from
//! `scripts/kafka.sh`, partitions assigned directly because joining a group takes ~20 s on
//! tansu).
//!
//! The tests take a shared lock and run one at a time: each drives a few thousand HTTP
//! requests and transactions, and the machine is small.

mod common;

use common::{BIN, pg_url};
use outbox_testkit::unique;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use outbox_orders::Db;
use outbox_orders::check::CheckReport;
use outbox_orders::consumers::{Consumer, Service};
use outbox_orders::load::{LoadConfig, LoadCounters, LoadReport};
use outbox_orders::order::OrderStore;
use outbox_orders::transport::{Transport, TransportArgs};
use outbox_types::Store;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::task::JoinHandle;

const ORDERS: u64 = 1_000;

/// One test at a time (see the module docs).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The test broker's address, for a test that found [`kafka_available`].
fn kafka_brokers() -> String {
    outbox_testkit::kafka_brokers().expect("no Kafka test broker: check kafka_available() first")
}

/// Start the Kafka-protocol test broker (`scripts/kafka.sh`); `false` (after a loud message)
/// when that fails outside CI.
fn kafka_available() -> bool {
    outbox_testkit::kafka_brokers().is_some()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Broker {
    Nats,
    Kafka,
}

/// The broker resources of one test: a stream and its subjects, or a topic.
struct Route {
    broker: Broker,
    /// NATS stream name.
    stream: String,
    /// NATS subject prefix (`<prefix>.orders.${event_type}`).
    subject_prefix: String,
    /// Kafka topic.
    topic: String,
}

impl Route {
    fn new(broker: Broker) -> Route {
        let tag = unique("t");
        Route {
            broker,
            stream: format!("OUTBOX_T_{}", tag.to_uppercase()),
            subject_prefix: tag.clone(),
            topic: format!("outbox_t_orders_{tag}"),
        }
    }

    /// The `[destinations.orders]` table, as the relay's config file has it.
    fn destination_toml(&self) -> String {
        match self.broker {
            Broker::Nats => format!(
                "type = \"nats\"\nservers = [\"{}\"]\nsubject = \"{}.orders.${{event_type}}\"\nack_timeout = \"3s\"\n",
                nats_url(),
                self.subject_prefix
            ),
            Broker::Kafka => format!(
                "type = \"kafka\"\nbrokers = \"{}\"\ntopic = \"{}\"\ndelivery_timeout = \"3s\"\n",
                kafka_brokers(),
                self.topic
            ),
        }
    }

    fn transport(&self, group: &str) -> TransportArgs {
        TransportArgs {
            transport: match self.broker {
                Broker::Nats => Transport::Nats,
                Broker::Kafka => Transport::Kafka,
            },
            nats_url: nats_url(),
            stream: self.stream.clone(),
            subjects: format!("{}.orders.>", self.subject_prefix),
            durable: Some(group.to_owned()),
            kafka_brokers: kafka_brokers(),
            topic: self.topic.clone(),
            kafka_assign: true,
            max_attempts: 20,
            retry_delay_ms: 200,
        }
    }

    async fn create(&self) {
        match self.broker {
            Broker::Nats => {
                let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
                js.create_stream(stream::Config {
                    name: self.stream.clone(),
                    subjects: vec![format!("{}.orders.>", self.subject_prefix)],
                    ..Default::default()
                })
                .await
                .expect("NATS JetStream must be running on 127.0.0.1:4222");
            }
            Broker::Kafka => {
                common::kafka_topics(&kafka_brokers(), &[(&self.topic, 3)]).await;
            }
        }
    }

    async fn delete(&self) {
        match self.broker {
            Broker::Nats => {
                if let Ok(client) = async_nats::connect(nats_url()).await {
                    let _ = jetstream::new(client).delete_stream(&self.stream).await;
                }
            }
            Broker::Kafka => {
                if let Ok(admin) = ClientConfig::new()
                    .set("bootstrap.servers", kafka_brokers())
                    .create::<AdminClient<DefaultClientContext>>()
                {
                    let _ = admin
                        .delete_topics(&[&self.topic], &AdminOptions::new())
                        .await;
                }
            }
        }
    }

    /// Publish every event of the outbox once more, straight to the broker, with the same
    /// `outbox-event-id` (and, on NATS, a fresh `Nats-Msg-Id`).
    async fn replay(&self, events: &[OutboxRow]) {
        match self.broker {
            Broker::Nats => {
                let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
                let mut acks = Vec::new();
                for e in events {
                    let mut headers = HeaderMap::new();
                    headers.insert("Nats-Msg-Id", uuid::Uuid::now_v7().to_string().as_str());
                    headers.insert("outbox-event-id", e.id.as_str());
                    headers.insert("outbox-event-type", e.event_type.as_str());
                    headers.insert("outbox-aggregate-type", "order");
                    headers.insert("outbox-aggregate-id", e.aggregate_id.as_str());
                    let subject = format!("{}.orders.{}", self.subject_prefix, e.event_type);
                    acks.push(
                        js.publish_with_headers(subject, headers, e.payload.clone().into())
                            .await
                            .unwrap(),
                    );
                }
                for ack in acks {
                    let ack = ack.await.unwrap();
                    assert!(!ack.duplicate, "JetStream dropped a replayed message");
                }
            }
            Broker::Kafka => {
                let producer: FutureProducer = ClientConfig::new()
                    .set("bootstrap.servers", kafka_brokers())
                    .create()
                    .unwrap();
                for e in events {
                    let headers = OwnedHeaders::new()
                        .insert(Header {
                            key: "outbox-event-id",
                            value: Some(e.id.as_str()),
                        })
                        .insert(Header {
                            key: "outbox-event-type",
                            value: Some(e.event_type.as_str()),
                        });
                    producer
                        .send(
                            FutureRecord::to(&self.topic)
                                .key(&e.aggregate_id)
                                .payload(&e.payload)
                                .headers(headers),
                            Duration::from_secs(10),
                        )
                        .await
                        .unwrap_or_else(|(e, _)| panic!("replay to Kafka: {e}"));
                }
            }
        }
    }
}

struct OutboxRow {
    id: String,
    event_type: String,
    aggregate_id: String,
    payload: String,
}

struct System {
    route: Route,
    schemas: Vec<String>,
    orders: OrderStore,
    store: Arc<dyn Store>,
    base: String,
    delivery: Arc<Consumer>,
    billing: Arc<Consumer>,
    stop_services: tokio::sync::watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    dir: tempfile::TempDir,
    /// The `outbox relay` process; behind a lock so `wait_for` (which borrows `self`) can
    /// notice when it died.
    relay: std::sync::Mutex<Option<tokio::process::Child>>,
    relay_starts: u32,
}

impl System {
    async fn start(broker: Broker) -> System {
        let route = Route::new(broker);
        route.create().await;
        let tag = unique("outbox_t_e2e");
        let schemas: Vec<String> = ["orders", "delivery", "billing"]
            .iter()
            .map(|s| format!("{tag}_{s}"))
            .collect();

        let db = Db::connect(&pg_url(), Some(&schemas[0]), 8)
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432");
        let outbox = outbox_postgresql::PgOutbox::with_names(&schemas[0], "events").unwrap();
        let orders = OrderStore::new(db, Some(outbox));
        orders.migrate().await.unwrap();
        let store = orders.relay_store();

        let (stop_services, stopped) = tokio::sync::watch::channel(false);
        let until_stopped = move || {
            let mut stopped = stopped.clone();
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            }
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let mut tasks = vec![tokio::spawn({
            let server = outbox_orders::http::serve(listener, orders.clone(), until_stopped());
            async move {
                server.await.unwrap();
            }
        })];

        let mut consumers = Vec::new();
        for (service, schema) in [
            (Service::Delivery, &schemas[1]),
            (Service::Billing, &schemas[2]),
        ] {
            let db = Db::connect(&pg_url(), Some(schema), 4).await.unwrap();
            let consumer = Arc::new(Consumer::open(service, db).await.unwrap());
            let transport = route.transport(&unique(service.name()));
            let running = consumer.clone();
            let shutdown = until_stopped();
            tasks.push(tokio::spawn(async move {
                outbox_orders::transport::consume(running, &transport, shutdown)
                    .await
                    .unwrap();
            }));
            consumers.push(consumer);
        }
        let billing = consumers.pop().unwrap();
        let delivery = consumers.pop().unwrap();

        let mut system = System {
            route,
            schemas,
            orders,
            store,
            base,
            delivery,
            billing,
            stop_services,
            tasks,
            dir: tempfile::tempdir().unwrap(),
            relay: std::sync::Mutex::new(None),
            relay_starts: 0,
        };
        system.write_config();
        system.start_relay().await;
        system
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("outbox.toml")
    }

    fn relay_log(&self, n: u32) -> PathBuf {
        self.dir.path().join(format!("relay-{n}.log"))
    }

    /// The relay's configuration file, per the destinations spec. A short lease, so a killed
    /// relay's claims come back quickly.
    fn write_config(&self) {
        let config = format!(
            "{}table = \"events\"\n\n\
             [relay]\nbatch_size = 200\npoll_interval = \"20ms\"\nlease = \"5s\"\npublish_timeout = \"4s\"\n\n\
             [retention]\nenabled = false\n\n\
             [destinations.orders]\n{}",
            common::pg_database(&self.schemas[0]),
            self.route.destination_toml()
        );
        common::write_config(self.dir.path(), &config);
    }

    async fn start_relay(&mut self) {
        self.relay_starts += 1;
        let log = std::fs::File::create(self.relay_log(self.relay_starts)).unwrap();
        let relay = tokio::process::Command::new(BIN)
            .args(["relay", "--config"])
            .arg(self.config_path())
            .env("OUTBOX_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("the outbox binary starts");
        *self.relay.get_mut().unwrap() = Some(relay);
    }

    /// SIGKILL the relay process and wait until it is gone.
    async fn kill_relay(&mut self) {
        match self.relay.get_mut().unwrap().take() {
            Some(mut child) => {
                child.kill().await.unwrap();
                let status = child.wait().await.unwrap();
                assert!(!status.success(), "killed relay exited {status}");
            }
            None => panic!("no relay is running"),
        }
    }

    /// Stop the relay gracefully (SIGTERM); it must exit 0.
    async fn stop_relay(&mut self) {
        let Some(mut child) = self.relay.get_mut().unwrap().take() else {
            return;
        };
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .expect("the relay stops within 30 s of SIGTERM")
            .unwrap();
        assert!(
            status.success(),
            "relay exited {status}; log:\n{}",
            self.logs()
        );
    }

    /// Fail at once (with its log) when the relay process exited on its own.
    fn assert_relay_alive(&self) {
        let mut relay = self.relay.lock().unwrap();
        if let Some(child) = relay.as_mut()
            && let Ok(Some(status)) = child.try_wait()
        {
            drop(relay);
            panic!("the relay process exited with {status}\n{}", self.logs());
        }
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for n in 1..=self.relay_starts {
            let text = std::fs::read_to_string(self.relay_log(n)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            out.push_str(&format!("--- relay run {n} (last lines) ---\n"));
            for line in tail.into_iter().rev() {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    fn load(&self, counters: Arc<LoadCounters>) -> JoinHandle<LoadReport> {
        let base = self.base.clone();
        tokio::spawn(async move {
            let config = LoadConfig {
                orders: ORDERS,
                clients: 8,
                rate: Some(300.0),
                cancel_ratio: 0.10,
                invalid_ratio: 0.05,
                over_limit_ratio: 0.02,
                seed: 6,
                ..LoadConfig::default()
            };
            outbox_orders::load::run(&base, config, counters)
                .await
                .unwrap()
        })
    }

    async fn outbox_rows(&self) -> Vec<OutboxRow> {
        let rows: Vec<(String, String, String, String)> = self
            .orders
            .outbox_rows("CAST(id AS TEXT), event_type, aggregate_id, CAST(payload AS TEXT)")
            .await
            .unwrap();
        rows.into_iter()
            .map(|(id, event_type, aggregate_id, payload)| OutboxRow {
                id,
                event_type,
                aggregate_id,
                payload,
            })
            .collect()
    }

    /// Poll until `done` holds; fail after `limit` with the relay's log.
    async fn wait_for(&self, limit: Duration, what: &str, mut done: impl AsyncFnMut() -> bool) {
        let deadline = Instant::now() + limit;
        while !done().await {
            self.assert_relay_alive();
            assert!(
                Instant::now() < deadline,
                "timed out after {limit:?} waiting for {what}; outbox {:?}; delivery {:?}; billing {:?}\n{}",
                self.store.stats().await.ok(),
                counts(&self.delivery),
                counts(&self.billing),
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until the outbox is drained and both consumers applied every effect the clients
    /// were promised.
    async fn wait_settled(&self, load: &LoadReport) {
        let (created, cancelled) = (load.created.len() as u64, load.cancelled.len() as u64);
        let store = self.store.clone();
        let (d, b) = (self.delivery.counters(), self.billing.counters());
        self.wait_for(Duration::from_secs(180), "every effect", async || {
            let stats = store.stats().await.unwrap();
            stats.pending == 0
                && stats.in_flight == 0
                && [&d, &b].iter().all(|c| {
                    c.opened.load(Ordering::Relaxed) >= created
                        && c.closed.load(Ordering::Relaxed) >= cancelled
                })
        })
        .await;
    }

    /// Replay every event and wait until both consumers dropped that many more duplicates.
    async fn inject_duplicates(&self) -> usize {
        let rows = self.outbox_rows().await;
        let (d, b) = (self.delivery.counters(), self.billing.counters());
        let before = (
            d.duplicates.load(Ordering::Relaxed),
            b.duplicates.load(Ordering::Relaxed),
        );
        self.route.replay(&rows).await;
        let n = rows.len() as u64;
        self.wait_for(
            Duration::from_secs(120),
            "the replayed duplicates",
            async || {
                d.duplicates.load(Ordering::Relaxed) >= before.0 + n
                    && b.duplicates.load(Ordering::Relaxed) >= before.1 + n
            },
        )
        .await;
        rows.len()
    }

    async fn verify(&self, load: &LoadReport) -> CheckReport {
        outbox_orders::check::verify(&self.orders, &self.delivery, &self.billing, Some(load))
            .await
            .unwrap()
    }

    async fn shutdown(mut self) {
        self.stop_relay().await;
        let _ = self.stop_services.send(true);
        for t in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
        self.route.delete().await;
        if let Db::Postgres(pool) = self.orders.db() {
            for schema in &self.schemas {
                let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
                )))
                .execute(&pool)
                .await;
            }
        }
    }
}

fn counts(c: &Consumer) -> (u64, u64, u64, u64) {
    let c = c.counters();
    (
        c.opened.load(Ordering::Relaxed),
        c.closed.load(Ordering::Relaxed),
        c.duplicates.load(Ordering::Relaxed),
        c.parked.load(Ordering::Relaxed),
    )
}

/// The whole flow; `kill_midway` SIGKILLs the relay process once a third of the events are
/// delivered and starts a new one after the clients made 200 more orders.
async fn exactly_once(broker: Broker, kill_midway: bool) {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let mut system = System::start(broker).await;
    let counters = Arc::new(LoadCounters::default());
    let load = system.load(counters.clone());

    if kill_midway {
        let store = system.store.clone();
        system
            .wait_for(
                Duration::from_secs(60),
                "a third of the events delivered",
                async || store.stats().await.unwrap().delivered >= ORDERS / 3,
            )
            .await;
        system.kill_relay().await;
        let killed_at = counters.created.load(Ordering::Relaxed);
        let c = counters.clone();
        system
            .wait_for(
                Duration::from_secs(60),
                "200 more orders with the relay down",
                async || c.created.load(Ordering::Relaxed) >= (killed_at + 200).min(ORDERS),
            )
            .await;
        system.start_relay().await;
    }

    let load = load.await.unwrap();
    assert_eq!(load.created.len() as u64, ORDERS, "{:?}", load.unexpected);
    assert!(
        load.cancelled.len() > 50,
        "{} cancelled",
        load.cancelled.len()
    );
    assert!(load.rejected > 10 && load.declined > 0, "{load:?}");
    system.wait_settled(&load).await;
    let replayed = system.inject_duplicates().await;

    let report = system.verify(&load).await;
    let stats = system.store.stats().await.unwrap();
    let events = system.outbox_rows().await.len() as u64;
    eprintln!(
        "{broker:?}{}: {report}; {events} events, {replayed} replayed; outbox {stats:?}; {:.1} s",
        if kill_midway { " / relay killed" } else { "" },
        started.elapsed().as_secs_f64()
    );
    assert!(report.ok(), "{report}\n{}", system.logs());
    assert_eq!(report.orders as u64, ORDERS);
    assert_eq!(report.cancelled, load.cancelled.len());
    assert_eq!(events, ORDERS + load.cancelled.len() as u64);
    assert_eq!(stats.delivered, events, "{stats:?}");
    assert_eq!((stats.pending, stats.in_flight, stats.dead), (0, 0, 0));
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_orders_exactly_once() {
    exactly_once(Broker::Nats, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_orders_exactly_once_with_relay_killed_midway() {
    exactly_once(Broker::Nats, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_orders_exactly_once() {
    if !kafka_available() {
        return;
    }
    exactly_once(Broker::Kafka, false).await;
}

/// The relay configuration `scripts/orders.sh` uses is one the binary accepts.
#[test]
fn example_relay_config_is_valid() {
    let config = common::repo().join("crates/outbox-orders/outbox.toml");
    let out = std::process::Command::new(BIN)
        .args(["config", "check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("[destinations.orders]"), "{text}");
    assert!(
        text.contains("subject = \"orders.${event_type}\""),
        "{text}"
    );
}
