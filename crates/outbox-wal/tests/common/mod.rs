//! Shared by the WAL-mode integration tests: the throwaway logical-replication cluster
//! (`scripts/pg-logical.sh`), a fresh outbox + slot per test, sinks with switches.

#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_engine::RelayConfig;
use outbox_postgresql::PgOutbox;
use outbox_testkit::RecordingSink;
use outbox_types::{Event, EventId, NewEvent, Outcome, RetryPolicy, Sink};
use outbox_wal::{Source, WalConfig, WalError, WalRelay, WalReport};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

static COUNTER: AtomicU64 = AtomicU64::new(0);

static CLUSTER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The URL of a PostgreSQL with `wal_level = logical` (`outbox_testkit::logical_cluster_url`),
/// found or started once per test binary.
pub fn cluster_url() -> String {
    CLUSTER
        .get_or_init(outbox_testkit::logical_cluster_url)
        .clone()
}

pub async fn pool(max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .connect(&cluster_url())
        .await
        .expect("the logical-replication test cluster must be up (scripts/pg-logical.sh start)")
}

/// Drop slots of earlier test runs that nobody streams from (they would retain WAL and use up
/// max_replication_slots): only those whose process (`owt_<pid>_<n>`) is gone. A slot another
/// test binary running now has just created is inactive too until it streams; dropping it
/// would fail that test.
pub async fn drop_stale_slots(pool: &PgPool) {
    let inactive: Vec<String> = sqlx::query_scalar(
        "SELECT slot_name::text FROM pg_replication_slots WHERE slot_name LIKE 'owt\\_%' AND NOT active
           AND slot_name NOT LIKE $1",
    )
    .bind(format!("owt\\_{}\\_%", std::process::id()))
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    // Only names that carry a pid: another test binary's slot named otherwise (`owt_cli_…`)
    // is not this clean-up's to judge (scripts/test.sh drops inactive ones before a run).
    let stale = inactive.into_iter().filter(|slot| {
        slot.split('_')
            .nth(1)
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| !std::path::Path::new("/proc").join(pid.to_string()).exists())
    });
    for slot in stale {
        let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&slot)
            .execute(pool)
            .await;
    }
}

/// One test's outbox: its own schema, slot and publication.
pub struct Fixture {
    pub pool: PgPool,
    pub outbox: PgOutbox,
    pub config: WalConfig,
}

impl Fixture {
    /// A fresh outbox whose slot exists already (writers may start at once).
    pub async fn new(sources: &[Source]) -> Fixture {
        let fx = Self::bare(sources).await;
        outbox_wal::prepare(&fx.config).await.unwrap();
        fx
    }

    /// A fresh outbox, no slot yet.
    pub async fn bare(sources: &[Source]) -> Fixture {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_test_writer()
            .try_init();
        let pool = pool(10).await;
        drop_stale_slots(&pool).await;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("owt_{}_{n}", std::process::id());
        let outbox = PgOutbox::with_names(&name, "events").unwrap();
        outbox.migrate(&pool).await.unwrap();
        let config = WalConfig {
            schema: name.clone(),
            table: "events".into(),
            slot: name.clone(),
            publication: name.clone(),
            sources: sources.to_vec(),
            // Logical messages are database-wide: every outbox sharing a database needs its own
            // prefix (here: one per test).
            message_prefix: name.clone(),
            status_interval: Duration::from_millis(100),
            heartbeat_interval: Duration::from_millis(500),
            standby_poll_interval: Duration::from_millis(200),
            takeover_timeout: Duration::from_secs(15),
            max_reconnect_backoff: Duration::from_millis(500),
            debezium: outbox_wal::DebeziumTable {
                table: format!("{name}.outbox"),
                ..Default::default()
            },
            ..WalConfig::new(cluster_url())
        };
        if sources.contains(&Source::Debezium) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(outbox_wal::debezium_table_ddl(
                &config.debezium,
            )))
            .execute(&pool)
            .await
            .unwrap();
        }
        Fixture {
            pool,
            outbox,
            config,
        }
    }

    /// Run `sql` (one statement or several) as it is, no parameters.
    pub async fn exec(&self, sql: String) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .unwrap();
    }

    /// A [`RecordingSink`], and a relay with [`test_relay`]'s settings delivering to it, ready.
    pub async fn start_recording(&self) -> (Arc<RecordingSink>, Running) {
        let sink = Arc::new(RecordingSink::new());
        let relay = start(self.config.clone(), sink.clone()).ready().await;
        (sink, relay)
    }

    /// Commit `events` into the table in one transaction.
    pub async fn enqueue_table(&self, events: &[NewEvent]) {
        let mut tx = self.pool.begin().await.unwrap();
        self.outbox.enqueue_batch(&mut *tx, events).await.unwrap();
        tx.commit().await.unwrap();
    }

    /// Commit `events` as logical messages in one transaction.
    pub async fn enqueue_messages(&self, events: &[NewEvent]) {
        let mut tx = self.pool.begin().await.unwrap();
        outbox_wal::enqueue_messages(&mut *tx, &self.config.message_prefix, events)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    /// Commit `events` into the stream table in one transaction.
    pub async fn enqueue_streamed(&self, events: &[NewEvent]) {
        let mut tx = self.pool.begin().await.unwrap();
        for e in events {
            outbox_wal::enqueue_streamed(&mut *tx, &self.outbox, e)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }

    /// Commit `events` into the Debezium outbox table in one transaction, as a service writing
    /// Debezium's documented table does: plain INSERTs, each followed by a DELETE of the row
    /// (the pattern that keeps the table empty; the relay ignores deletes).
    pub async fn enqueue_debezium(&self, events: &[NewEvent]) {
        let table = self.debezium_table();
        let mut tx = self.pool.begin().await.unwrap();
        for e in events {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload) VALUES ($1, $2, $3, $4, $5::jsonb)"
            )))
            .bind(e.id().as_uuid())
            .bind(e.aggregate_type())
            .bind(e.aggregate_id())
            .bind(e.event_type())
            .bind(e.payload())
            .execute(&mut *tx)
            .await
            .unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM {table} WHERE id = $1"
            )))
            .bind(e.id().as_uuid())
            .execute(&mut *tx)
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }

    /// The Debezium outbox table, quoted.
    pub fn debezium_table(&self) -> String {
        let (schema, name) = self.config.debezium.schema_and_name();
        format!("\"{schema}\".\"{name}\"")
    }

    pub async fn status_counts(&self) -> (i64, i64, i64) {
        let row: (i64, i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE status IN ('pending','in_flight')),
                    count(*) FILTER (WHERE status = 'delivered'),
                    count(*) FILTER (WHERE status = 'dead') FROM {}",
            self.outbox.qualified_table()
        )))
        .fetch_one(&self.pool)
        .await
        .unwrap();
        row
    }

    /// Wait up to `limit` until [`Fixture::status_counts`] is `expected`; past it, fail with
    /// the counts last seen.
    pub async fn wait_status_counts(&self, expected: (i64, i64, i64), limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.status_counts().await != expected {
            assert!(
                Instant::now() < deadline,
                "{:?}",
                self.status_counts().await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Drop the slot and the schema.
    pub async fn cleanup(self) {
        let _ = outbox_wal::drop_slot_waiting(&self.config, Duration::from_secs(5)).await;
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP PUBLICATION IF EXISTS \"{}\"",
            self.config.publication
        )))
        .execute(&self.pool)
        .await;
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.config.schema
        )))
        .execute(&self.pool)
        .await;
    }
}

/// A relay running in a task, stoppable.
pub struct Running {
    pub stop: Option<oneshot::Sender<()>>,
    pub handle: JoinHandle<Result<WalReport, WalError>>,
    pub counters: Arc<outbox_wal::WalCounters>,
}

/// The engine's settings for a test relay: fast retries, five attempts, the slot's name as
/// its id (so `application_name` tells the tests' sessions apart).
pub fn test_relay(config: &WalConfig) -> RelayConfig {
    RelayConfig {
        relay_id: config.slot.clone(),
        poll_interval: Duration::from_millis(50),
        publish_timeout: Duration::from_secs(5),
        retry: RetryPolicy {
            base: Duration::from_millis(10),
            cap: Duration::from_millis(100),
            max_attempts: 5,
        },
        ..RelayConfig::default()
    }
}

/// A relay with [`test_relay`]'s settings.
pub fn start(config: WalConfig, sink: Arc<dyn Sink>) -> Running {
    let relay = test_relay(&config);
    start_relay(config, relay, sink)
}

/// A relay with the engine settings `relay`.
pub fn start_relay(config: WalConfig, relay: RelayConfig, sink: Arc<dyn Sink>) -> Running {
    let relay = WalRelay::new(config, sink).with_relay(relay);
    let counters = relay.counters();
    let (tx, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    Running {
        stop: Some(tx),
        handle,
        counters,
    }
}

impl Running {
    /// Wait until the relay streams or stands by (its session set up), so what a test writes
    /// next comes through the stream rather than as rows waiting when the session started.
    pub async fn ready(self) -> Self {
        let counters = self.counters.clone();
        wait_for(
            "the relay to stream or stand by",
            Duration::from_secs(30),
            || counters.streaming() || counters.standing_by() || self.handle.is_finished(),
        )
        .await;
        self
    }
}

impl Running {
    pub async fn stop(mut self) -> WalReport {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("relay stops within 30 s")
            .expect("relay task")
            .expect("relay run")
    }
}

/// Run `statements` on `pool` one after the other, each alone (no parameters).
pub async fn exec_each(pool: &PgPool, statements: impl IntoIterator<Item = String>) {
    for sql in statements {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Wait until `check` holds, or panic after `limit`.
pub async fn wait_for(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait up to `limit` until `sink` has delivered as many distinct events as `expected` (`what`
/// names them), then check that it delivered exactly those, each aggregate's in order.
pub async fn wait_delivered_exactly(
    sink: &RecordingSink,
    expected: &HashSet<EventId>,
    what: &str,
    limit: Duration,
) {
    wait_for(what, limit, || {
        sink.distinct_delivered().len() >= expected.len()
    })
    .await;
    assert_eq!(&sink.distinct_delivered(), expected);
    assert!(outbox_testkit::check_first_delivery_order(&sink.delivered()).is_empty());
}

/// A sink in front of a [`RecordingSink`] that can be switched off (every publish fails with a
/// retryable error while off).
pub struct SwitchSink {
    pub inner: RecordingSink,
    pub down: AtomicBool,
    pub calls_while_down: AtomicU64,
    pub max_batch_seen: AtomicU64,
}

impl SwitchSink {
    pub fn new(inner: RecordingSink) -> Self {
        SwitchSink {
            inner,
            down: AtomicBool::new(false),
            calls_while_down: AtomicU64::new(0),
            max_batch_seen: AtomicU64::new(0),
        }
    }

    /// Wait up to `limit` until more than `calls` publishes were refused while off (`what`
    /// names what that shows).
    pub async fn wait_calls_while_down(&self, what: &str, limit: Duration, calls: u64) {
        wait_for(what, limit, || {
            self.calls_while_down.load(Ordering::Relaxed) > calls
        })
        .await;
    }
}

#[async_trait]
impl Sink for SwitchSink {
    fn name(&self) -> &str {
        "switch"
    }
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        self.max_batch_seen
            .fetch_max(events.len() as u64, Ordering::Relaxed);
        // One event per aggregate per call: the Sink contract.
        let mut seen = HashSet::new();
        for e in events {
            assert!(
                seen.insert((e.aggregate_type.clone(), e.aggregate_id.clone())),
                "two events of one aggregate in one sink call"
            );
        }
        if self.down.load(Ordering::SeqCst) {
            self.calls_while_down.fetch_add(1, Ordering::Relaxed);
            return events
                .iter()
                .map(|_| Outcome::retry("destination down (test)"))
                .collect();
        }
        self.inner.publish(events).await
    }
}

/// Ids of `events`.
pub fn ids(events: &[NewEvent]) -> HashSet<EventId> {
    events.iter().map(|e| e.id()).collect()
}

/// Event `n` of aggregate `agg` with a payload of about `size` bytes.
pub fn sized(agg: &str, n: u64, size: usize) -> NewEvent {
    NewEvent::new(
        "agg",
        agg,
        "Numbered",
        &serde_json::json!({ "aggregate": agg, "n": n, "pad": "x".repeat(size.saturating_sub(40)) }),
    )
    .unwrap()
}

/// Duplicate count: deliveries minus distinct events.
pub fn duplicates(delivered: &[Event]) -> usize {
    let distinct: HashSet<EventId> = delivered.iter().map(|e| e.id).collect();
    delivered.len() - distinct.len()
}

pub type Shared<T> = Arc<Mutex<T>>;

/// A file of the throwaway cluster's TLS setup: `rootcert` (the CA that signed the server's
/// certificate) or `wrong-rootcert` (an unrelated CA). `None` with `OUTBOX_WAL_TEST_URL`, whose
/// server this suite did not set up.
pub fn cluster_cert(which: &str) -> Option<String> {
    if std::env::var("OUTBOX_WAL_TEST_URL").is_ok() {
        return None;
    }
    cluster_url();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/pg-logical.sh");
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg(which)
        .output()
        .expect("run scripts/pg-logical.sh");
    assert!(
        out.status.success(),
        "scripts/pg-logical.sh {which} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The cluster's URL with another host, database or query.
pub fn cluster_url_with(host: Option<&str>, database: Option<&str>, query: Option<&str>) -> String {
    let mut url = url::Url::parse(&cluster_url()).expect("a URL");
    if let Some(host) = host {
        url.set_host(Some(host)).expect("a host");
    }
    if let Some(database) = database {
        url.set_path(&format!("/{database}"));
    }
    if let Some(query) = query {
        url.set_query(Some(query));
    }
    url.to_string()
}

/// Rows of `SELECT status, last_error FROM <outbox> ORDER BY seq`.
pub async fn statuses(fx: &Fixture) -> Vec<(i64, String, Option<String>)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT seq, status, last_error FROM {} ORDER BY seq",
        fx.outbox.qualified_table()
    )))
    .fetch_all(&fx.pool)
    .await
    .unwrap()
}
