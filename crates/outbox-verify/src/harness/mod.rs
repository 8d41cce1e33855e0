//! One run of the harness: set up, write under faults, heal, drain, check, report.
//!
//! The phases, and why each exists:
//!
//! 1. **Setup** — a throwaway PostgreSQL cluster (or a given database), the outbox migrated,
//!    business tables, the consumer's inbox and effects tables in the machine's shared
//!    PostgreSQL (never faulted, so consumer failures cannot reorder what is observed), the
//!    destinations with a proxy in front of each broker, a proxy for the relays' and one for the
//!    writers' database links, and the relay processes.
//! 2. **Write under faults** — writers run for the profile's duration while the seeded schedule
//!    injects faults and a supervisor restarts relays that died on their own (recorded).
//! 3. **Heal** — every fault undone: links restored, brokers and database up, relays resumed
//!    and running.
//! 4. **Drain** — wait until the outbox has nothing pending or in flight and the consumers have
//!    received every delivered event, or the drain timeout.
//! 5. **Check** — relays stopped with SIGTERM (they must exit 0), the final state read, the
//!    checker run, the report written.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_postgresql::PgOutbox;
use outbox_testkit::TcpProxy;
use outbox_types::EventId;
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::{Mutex, watch};

use crate::Error;
use crate::checker;
use crate::cluster::PgCluster;
use crate::dest::file::FileDestination;
use crate::dest::webhook::WebhookDestination;
use crate::dest::{ConsumerSide, Destination, UNROUTED};
use crate::faults::{self, Capabilities, Fault, Intensity, Scheduled};
use crate::history::{History, LateWrites, LeaseFault, OutboxRow};
use crate::relays::{self, Relays};
use crate::report::{self, FaultRecord, RunReport, Sample};
use crate::writers::{self, WriterLog, WriterOptions};

/// The pre-set shapes of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// About two minutes, a few faults of each kind. Runs in CI.
    Short,
    /// Thirty minutes, thousands of faults. For manual runs.
    Long,
    /// No faults; writers at full speed; backlog and relay memory sampled over time.
    Load,
}

impl Profile {
    /// The profile's name.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Short => "short",
            Profile::Long => "long",
            Profile::Load => "load",
        }
    }
}

/// Everything a run needs.
#[derive(Clone, Debug, Serialize)]
pub struct Options {
    /// The profile the defaults came from.
    pub profile: Profile,
    /// Seed of the fault schedule and the writers' choices.
    pub seed: u64,
    /// The `outbox` binary.
    pub outbox_bin: PathBuf,
    /// Directory for the run's files (cluster, logs, sink file, report).
    pub work_dir: PathBuf,
    /// Use this database instead of a throwaway cluster (no database restarts then).
    pub database_url: Option<String>,
    /// The consumer's database (inbox and effects).
    pub consumer_url: String,
    /// Relay processes.
    pub relays: usize,
    /// Concurrent writers.
    pub writers: u32,
    /// Aggregates per destination the writers spread their events over. Few aggregates make
    /// long per-aggregate sequences (the order check has much to check) and keep every
    /// aggregate's head in flight at once.
    pub aggregates: u32,
    /// Transactions per second per writer (`None`: as fast as possible).
    pub rate: Option<f64>,
    /// How long writers run.
    pub duration: Duration,
    /// Destinations: `file`, `nats`, `webhook`.
    pub destinations: Vec<String>,
    /// Faults of each kind (0: none).
    pub faults_per_kind: u32,
    /// One outage of one destination this long (zero: none); see [`Fault::Outage`].
    pub outage: Duration,
    /// Only these fault kinds (empty: every applicable kind).
    pub only_faults: Vec<String>,
    /// Fraction of transactions rolled back on purpose.
    pub rollback: f64,
    /// Fraction of transactions whose writer kills its own connection.
    pub crash: f64,
    /// Probability that the consumer fails right after committing an effect (redelivery).
    pub consumer_crash: f64,
    /// Longest wait for the outbox to drain after healing.
    pub drain_timeout: Duration,
    /// Sampling interval of the timeline.
    pub sample_every: Duration,
    /// Relay mode: `poll` (claims and leases) or `wal` (logical replication; needs the
    /// harness's own cluster, which runs with `wal_level = logical`).
    pub mode: String,
    /// Relay lease.
    pub lease: Duration,
    /// Relay batch size.
    pub batch_size: u32,
    /// Filler bytes per payload.
    pub pad: usize,
    /// Where the JSON report goes.
    pub report_path: PathBuf,
    /// Environment variables set to each relay's id (e.g.
    /// `OUTBOX_DESTINATIONS__KAFKA__CLIENT_ID`).
    pub per_relay_env: Vec<String>,
}

impl Options {
    /// The defaults of `profile`.
    pub fn for_profile(
        profile: Profile,
        seed: u64,
        outbox_bin: PathBuf,
        work_dir: PathBuf,
    ) -> Self {
        let report_path = work_dir.join("report.json");
        let per_relay_env = std::env::var("OUTBOX_VERIFY_PER_RELAY_ENV")
            .map(|v| {
                v.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let base = Options {
            profile,
            seed,
            outbox_bin,
            work_dir,
            database_url: None,
            consumer_url: "postgres://postgres@127.0.0.1:5432/test".into(),
            relays: 2,
            writers: 16,
            aggregates: 48,
            rate: Some(12.0),
            duration: Duration::from_secs(75),
            destinations: default_destinations(),
            faults_per_kind: 2,
            outage: Duration::from_secs(30),
            only_faults: Vec::new(),
            rollback: 0.1,
            crash: 0.03,
            consumer_crash: 0.01,
            drain_timeout: Duration::from_secs(90),
            sample_every: Duration::from_secs(1),
            mode: "poll".into(),
            lease: Duration::from_secs(4),
            batch_size: 200,
            pad: 64,
            report_path,
            per_relay_env,
        };
        match profile {
            Profile::Short => base,
            Profile::Long => Options {
                relays: 3,
                duration: Duration::from_secs(30 * 60),
                faults_per_kind: 150,
                outage: Duration::from_secs(5 * 60),
                drain_timeout: Duration::from_secs(300),
                sample_every: Duration::from_secs(5),
                ..base
            },
            Profile::Load => Options {
                rate: None,
                duration: Duration::from_secs(10 * 60),
                faults_per_kind: 0,
                outage: Duration::ZERO,
                rollback: 0.05,
                crash: 0.0,
                consumer_crash: 0.0,
                // The consumers apply one inbox transaction per message (~1.1–1.6k/s on this
                // machine): after 10 minutes at full speed they are ~800k messages behind.
                drain_timeout: Duration::from_secs(30 * 60),
                sample_every: Duration::from_secs(5),
                batch_size: 500,
                // An order-like spread: many aggregates, a few events each per minute. With 48
                // per destination, flat-out writers keep every aggregate's head in flight and a
                // relay sends a batch in sequential waves per aggregate; `--aggregates 48`
                // measures that case (crates/outbox-verify/README.md).
                aggregates: 1024,
                // The harness's Kafka consumer settles one message at a time (~300/s), far below
                // what flat-out writers produce; it would measure the consumer, not the relay.
                destinations: vec!["file".into(), "nats".into(), "webhook".into()],
                ..base
            },
        }
    }
}

/// Every destination compiled in: file and webhook always, NATS JetStream and Kafka with their
/// features (both on by default).
fn default_destinations() -> Vec<String> {
    let mut d = vec!["file".to_owned()];
    if cfg!(feature = "nats") {
        d.push("nats".into());
    }
    d.push("webhook".into());
    if cfg!(feature = "kafka") {
        d.push("kafka".into());
    }
    d
}

/// Names of the run's tables (unique per run, so runs against a shared database do not meet).
struct Names {
    outbox_schema: String,
    business_schema: String,
    consumer_schema: String,
}

impl Names {
    fn new(owned: bool) -> Self {
        let tag = format!(
            "{}_{}",
            std::process::id(),
            rand::random::<u32>() % 1_000_000
        );
        Names {
            outbox_schema: if owned {
                "outbox".into()
            } else {
                format!("outbox_t_v{tag}")
            },
            business_schema: if owned {
                "outbox_t_verify".into()
            } else {
                format!("outbox_t_vb{tag}")
            },
            consumer_schema: format!("outbox_t_vc{tag}"),
        }
    }
}

/// Everything faults act on.
struct Ctx {
    relays: Arc<Relays>,
    relay_db: TcpProxy,
    writer_db: TcpProxy,
    cluster: Option<Arc<PgCluster>>,
    admin: PgPool,
    table: String,
    dests: Vec<Arc<dyn Destination>>,
    writer_options: Arc<WriterOptions>,
    log: Arc<WriterLog>,
    lease: Duration,
    lease_faults: Mutex<Vec<LeaseFault>>,
    /// Serializes faults per target (a link, the database, a broker) so one fault's end does
    /// not undo another's middle.
    locks: BTreeMap<String, Mutex<()>>,
    poison_numbers: AtomicU64,
    started: Instant,
    /// Set when the writers stopped: faults not yet begun are skipped.
    writing_done: std::sync::atomic::AtomicBool,
}

fn target_of(fault: &Fault) -> String {
    match fault {
        Fault::KillRelay { relay, .. } => format!("relay{relay}"),
        // One pause at a time: a pause proves fencing only if another relay is running to
        // re-claim the paused one's events.
        Fault::PauseRelay { .. } => "pause".into(),
        Fault::CutRelayDatabase { .. } => "relay_db".into(),
        Fault::CutWriterDatabase { .. } => "writer_db".into(),
        Fault::RestartDatabase { .. } => "database".into(),
        Fault::CutBroker { dest, .. }
        | Fault::Outage { dest, .. }
        | Fault::BrokerLatency { dest, .. }
        | Fault::BrokerDrops { dest, .. } => format!("link:{dest}"),
        Fault::RestartBroker { dest, .. } => format!("broker:{dest}"),
        Fault::TerminateRelayConnections
        | Fault::TerminateWriterConnections
        | Fault::Poison { .. } => "none".into(),
    }
}

async fn admin_pool(url: &str) -> Result<PgPool, Error> {
    let options: PgConnectOptions = url.parse()?;
    Ok(PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options.application_name("outbox_verify_admin"))
        .await?)
}

/// `postgres://…/db` with `application_name` set, through `proxy`.
fn via(url: &str, proxy: &TcpProxy, app: &str) -> Result<String, Error> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(Error::Invalid(format!("not a URL: {url}")));
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let userinfo = authority
        .rsplit_once('@')
        .map(|(u, _)| format!("{u}@"))
        .unwrap_or_default();
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    let query = if query.is_empty() {
        format!("application_name={app}")
    } else {
        format!("{query}&application_name={app}")
    };
    Ok(format!(
        "{scheme}://{userinfo}{}/{path}?{query}",
        proxy.addr()
    ))
}

fn upstream_of(url: &str) -> Result<std::net::SocketAddr, Error> {
    let options: PgConnectOptions = url.parse()?;
    let host = options.get_host();
    let host = if host.starts_with('/') || host == "localhost" {
        "127.0.0.1"
    } else {
        host
    };
    use std::net::ToSocketAddrs;
    (host, options.get_port())
        .to_socket_addrs()
        .map_err(Error::io("resolving the database address"))?
        .next()
        .ok_or_else(|| Error::Invalid(format!("cannot resolve {host}")))
}

/// The relay's configuration file, as a JSON value rendered to TOML. With `destinations`,
/// the `[destinations]` and `[[routes]]` form (one route per destination by aggregate type);
/// else the legacy single `[sink]`.
fn relay_config(
    options: &Options,
    db_url: &str,
    schema: &str,
    dests: &[Arc<dyn Destination>],
    destinations_style: bool,
) -> serde_json::Value {
    let lease_ms = options.lease.as_millis() as u64;
    let mut config = serde_json::json!({
        "database": {"url": db_url, "schema": schema},
        "relay": {
            "batch_size": options.batch_size,
            "poll_interval": "50ms",
            "lease": format!("{lease_ms}ms"),
            "publish_timeout": format!("{}ms", (lease_ms * 5 / 8).max(500)),
            "max_store_backoff": "1s",
            // The default number of attempts: an outage (the `outage` fault, broker cuts and
            // restarts) must not spend them; only the poison events may end dead.
            "retry": {"base": "100ms", "cap": "2s", "max_attempts": 10},
        },
        "retention": {"enabled": false},
    });
    if options.mode == "wal" {
        config["mode"] = serde_json::json!("wal");
        config["wal"] = serde_json::json!({
            "slot": "outbox_t_verify",
            "publication": "outbox_t_verify",
            "status_interval": "500ms",
            "standby_poll_interval": "500ms",
            "takeover_timeout": "20s",
            "max_reconnect_backoff": "1s",
        });
    }
    if destinations_style {
        let mut tables = serde_json::Map::new();
        let mut routes = Vec::new();
        for d in dests {
            tables.insert(d.name().to_owned(), d.sink_table());
            routes.push(serde_json::json!({"when": {"aggregate_type": d.name()}, "to": d.name()}));
        }
        config["destinations"] = serde_json::Value::Object(tables);
        config["routes"] = serde_json::Value::Array(routes);
    } else if let Some(d) = dests.first() {
        config["sink"] = d.sink_table();
    }
    config
}

fn write_config(path: &Path, config: &serde_json::Value) -> Result<(), Error> {
    let text = toml::to_string_pretty(config)
        .map_err(|e| Error::Invalid(format!("rendering the relay config: {e}")))?;
    std::fs::write(path, text).map_err(Error::io(format!("writing {}", path.display())))
}

/// Whether `outbox config check` accepts the file.
async fn config_accepted(bin: &Path, path: &Path) -> Result<(bool, String), Error> {
    let out = tokio::process::Command::new(bin)
        .args(["config", "check", "--config"])
        .arg(path)
        .output()
        .await
        .map_err(Error::io(format!("running {}", bin.display())))?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    ))
}

/// Run the harness.
pub async fn run(options: Options) -> Result<RunReport, Error> {
    let work = options.work_dir.clone();
    std::fs::create_dir_all(&work).map_err(Error::io(format!("creating {}", work.display())))?;
    // The cluster runs as `postgres`, which must be able to reach its directory.
    crate::cluster::set_mode(&work, 0o755)?;
    let logs = work.join("relay-logs");
    std::fs::create_dir_all(&logs).map_err(Error::io("creating the log directory"))?;

    // --- the outbox's database -------------------------------------------------------------
    if options.mode != "poll" && options.mode != "wal" {
        return Err(Error::Invalid(format!(
            "unknown mode `{}` (poll or wal)",
            options.mode
        )));
    }
    let (cluster, url) = match &options.database_url {
        Some(url) => (None, url.clone()),
        None => {
            let port = crate::cluster::free_port()?;
            let cluster = PgCluster::create(&work.join("pg"), port).await?;
            let admin = admin_pool(&cluster.url("postgres")).await?;
            sqlx::query("CREATE DATABASE outbox_verify")
                .execute(&admin)
                .await?;
            admin.close().await;
            let url = cluster.url("outbox_verify");
            (Some(Arc::new(cluster)), url)
        }
    };
    let names = Names::new(cluster.is_some());
    let admin = admin_pool(&url).await?;
    let outbox = PgOutbox::with_names(&names.outbox_schema, "events")?;
    outbox.migrate(&admin).await?;
    let upstream = upstream_of(&url)?;
    let relay_db = TcpProxy::start(upstream)
        .await
        .map_err(Error::io("starting the relay database proxy"))?;
    let writer_db = TcpProxy::start(upstream)
        .await
        .map_err(Error::io("starting the writer database proxy"))?;

    // --- destinations ------------------------------------------------------------------------
    let mut dests: Vec<Arc<dyn Destination>> = Vec::new();
    for name in &options.destinations {
        let d: Arc<dyn Destination> = match name.as_str() {
            "file" => Arc::new(FileDestination::new("file", work.join("sink.jsonl"))?),
            "webhook" => Arc::new(WebhookDestination::start("webhook").await?),
            #[cfg(feature = "nats")]
            "nats" => Arc::new(
                crate::dest::nats::NatsDestination::start("nats", work.join("nats")).await?,
            ),
            #[cfg(feature = "kafka")]
            "kafka" => {
                Arc::new(crate::dest::kafka::KafkaDestination::start("kafka", work.clone()).await?)
            }
            other => {
                return Err(Error::Invalid(format!(
                    "unknown destination `{other}` (known: file, nats, kafka, webhook)"
                )));
            }
        };
        dests.push(d);
    }
    if dests.is_empty() {
        return Err(Error::Invalid("no destination".into()));
    }

    // --- relay configuration -----------------------------------------------------------------
    let relay_url = via(&url, &relay_db, "outbox_verify_relay")?;
    let config_path = work.join("relay.toml");
    write_config(
        &config_path,
        &relay_config(&options, &relay_url, &names.outbox_schema, &dests, true),
    )?;
    let (destinations_style, why) = match config_accepted(&options.outbox_bin, &config_path).await?
    {
        (true, _) => (true, String::new()),
        (false, why) => {
            write_config(
                &config_path,
                &relay_config(&options, &relay_url, &names.outbox_schema, &dests, false),
            )?;
            (false, why)
        }
    };
    if !destinations_style {
        if dests.len() > 1 || dests[0].name() != "file" {
            return Err(Error::Invalid(format!(
                "this outbox binary does not accept a [destinations] config ({why}); only `--destinations file` works with it"
            )));
        }
        let (ok, why) = config_accepted(&options.outbox_bin, &config_path).await?;
        if !ok {
            return Err(Error::Invalid(format!(
                "the outbox binary refuses the generated config {}: {why}",
                config_path.display()
            )));
        }
    }

    // --- writers and consumers --------------------------------------------------------------
    let writer_options = Arc::new(WriterOptions {
        url: via(&url, &writer_db, "outbox_verify_writer")?,
        rate: options.rate,
        rollback: options.rollback,
        crash: options.crash,
        max_events: 3,
        aggregates: options.aggregates,
        destinations: dests.iter().map(|d| d.name().to_owned()).collect(),
        pad: options.pad,
        outbox: outbox.clone(),
        schema: names.business_schema.clone(),
    });
    {
        let mut conn = writers::connect(&url).await?;
        writers::setup(&mut conn, &writer_options).await?;
    }
    let consumer_pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&options.consumer_url)
        .await?;
    let side = Arc::new(
        ConsumerSide::setup(
            consumer_pool.clone(),
            &names.consumer_schema,
            options.consumer_crash,
        )
        .await?,
    );
    let (stop_consumers, consumers_stopped) = watch::channel(false);
    let mut consumer_tasks = Vec::new();
    for d in &dests {
        consumer_tasks.push(
            d.start_consumer(side.handler(d.name()), consumers_stopped.clone())
                .await?,
        );
    }

    // --- relays --------------------------------------------------------------------------------
    let mut relays = Relays::new(
        options.outbox_bin.clone(),
        config_path.clone(),
        logs.clone(),
        options.relays,
    );
    relays.per_relay_env = options.per_relay_env.clone();
    let relays = Arc::new(relays);
    relays.start_all().await?;

    let log = Arc::new(WriterLog::new(&work.join("history.jsonl"))?);
    let mut caps = Capabilities {
        relays: options.relays,
        owns_database: cluster.is_some(),
        proxied: dests
            .iter()
            .filter(|d| d.proxy().is_some())
            .map(|d| d.name().to_owned())
            .collect(),
        restartable: dests
            .iter()
            .filter(|d| d.can_restart())
            .map(|d| d.name().to_owned())
            .collect(),
        poisonable: dests
            .iter()
            .filter(|d| d.poison(serde_json::json!({})).is_some())
            .map(|d| d.name().to_owned())
            .collect(),
        lease: options.lease,
    };
    if destinations_style {
        caps.poisonable.push(UNROUTED.to_owned());
    }
    let mut schedule = faults::schedule(
        options.seed,
        &caps,
        Intensity {
            duration: options.duration,
            per_kind: options.faults_per_kind,
            outage: options.outage,
        },
    );
    if !options.only_faults.is_empty() {
        schedule.retain(|s| options.only_faults.iter().any(|k| k == s.fault.kind()));
    }
    std::fs::write(
        work.join("schedule.json"),
        serde_json::to_vec_pretty(&schedule).unwrap_or_default(),
    )
    .map_err(Error::io("writing the schedule"))?;
    let mut locks = BTreeMap::new();
    for s in &schedule {
        locks
            .entry(target_of(&s.fault))
            .or_insert_with(|| Mutex::new(()));
    }
    let started = Instant::now();
    let started_unix_ms = crate::history::unix_ms();
    let ctx = Arc::new(Ctx {
        relays: relays.clone(),
        relay_db,
        writer_db,
        cluster: cluster.clone(),
        admin: admin.clone(),
        table: outbox.qualified_table().to_owned(),
        dests: dests.clone(),
        writer_options: writer_options.clone(),
        log: log.clone(),
        lease: options.lease,
        lease_faults: Mutex::new(Vec::new()),
        locks,
        poison_numbers: AtomicU64::new(0),
        started,
        writing_done: std::sync::atomic::AtomicBool::new(false),
    });

    // --- write under faults -----------------------------------------------------------------
    let (stop_writers, writers_stopped) = watch::channel(false);
    let mut writer_tasks = Vec::new();
    for w in 0..options.writers {
        writer_tasks.push(tokio::spawn(writers::run(
            w,
            writer_options.clone(),
            options.seed,
            log.clone(),
            writers_stopped.clone(),
        )));
    }
    let (stop_background, background_stopped) = watch::channel(false);
    let supervisor = {
        let relays = relays.clone();
        let mut stopped = background_stopped.clone();
        tokio::spawn(async move {
            while !*stopped.borrow() {
                relays.supervise().await;
                tokio::select! {
                    _ = stopped.changed() => {}
                    _ = tokio::time::sleep(Duration::from_millis(300)) => {}
                }
            }
        })
    };
    let sampler = {
        let ctx = ctx.clone();
        let side = side.clone();
        let every = options.sample_every;
        let mut stopped = background_stopped.clone();
        tokio::spawn(async move {
            let mut timeline = Vec::new();
            while !*stopped.borrow() {
                timeline.push(sample(&ctx, &side).await);
                tokio::select! {
                    _ = stopped.changed() => {}
                    _ = tokio::time::sleep(every) => {}
                }
            }
            timeline.push(sample(&ctx, &side).await);
            timeline
        })
    };
    let fault_tasks: Vec<_> = schedule
        .iter()
        .cloned()
        .map(|s| {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let at = Duration::from_millis(s.at_ms);
                tokio::time::sleep_until((ctx.started + at).into()).await;
                inject(&ctx, s).await
            })
        })
        .collect();
    print_progress(&format!(
        "seed {}: {} writers, {} relays, destinations {}, {} faults over {} s (work dir {})",
        options.seed,
        options.writers,
        options.relays,
        options.destinations.join(","),
        schedule.len(),
        options.duration.as_secs(),
        work.display()
    ));
    tokio::time::sleep(options.duration).await;
    let _ = stop_writers.send(true);
    for t in writer_tasks {
        let _ = t.await;
    }
    log.flush();
    let write_s = started.elapsed().as_secs_f64();
    print_progress(&format!(
        "writers stopped after {write_s:.0} s with {} transactions; waiting for faults to end",
        log.len()
    ));
    // Faults still queued behind others (on the same target) are skipped now that the writers
    // stopped; the ones under way get a minute to end, then are cut short (healing below undoes
    // whatever they left).
    ctx.writing_done.store(true, Ordering::SeqCst);
    let mut fault_records = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for mut t in fault_tasks {
        match tokio::time::timeout_at(deadline, &mut t).await {
            Ok(Ok(Some(record))) => fault_records.push(record),
            Ok(_) => {}
            Err(_) => t.abort(),
        }
    }

    // --- heal and drain ----------------------------------------------------------------------
    ctx.relay_db.heal();
    ctx.writer_db.heal();
    if let Some(c) = &cluster
        && !c.is_up().await
    {
        c.start().await?;
    }
    for d in &dests {
        if let Some(p) = d.proxy() {
            p.heal();
        }
        d.start_broker().await?;
    }
    relays.heal().await?;
    print_progress("healed; draining");
    let drain_started = Instant::now();
    let drained = drain(&ctx, &side, options.drain_timeout).await;
    let drain_s = drain_started.elapsed().as_secs_f64();
    print_progress(&format!(
        "drain {} after {drain_s:.1} s; stopping relays",
        if drained { "complete" } else { "TIMED OUT" }
    ));

    // --- stop, collect, check ----------------------------------------------------------------
    let _ = stop_background.send(true);
    let _ = supervisor.await;
    let relay_stops = relays.stop_all(Duration::from_secs(20)).await;
    let timeline = sampler.await.unwrap_or_default();
    // Let consumers finish what is in flight to them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop_consumers.send(true);
    for t in consumer_tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }

    let mut history = collect(&ctx, &side, &names).await?;
    for d in &dests {
        if let Some(read_back) = d.held_by_broker().await {
            history
                .broker_held
                .insert(d.name().to_owned(), read_back.held);
            history
                .broker_dropped
                .insert(d.name().to_owned(), read_back.dropped_after_ack);
        }
    }
    std::fs::write(
        work.join("history.json"),
        serde_json::to_vec(&history).unwrap_or_default(),
    )
    .map_err(Error::io("writing the history"))?;
    let verdict = checker::check(&history);
    let mut faults_by_kind = BTreeMap::new();
    for f in &fault_records {
        if !f.failed {
            *faults_by_kind
                .entry(f.scheduled.fault.kind().to_owned())
                .or_default() += 1;
        }
    }
    let outage = fault_records.iter().find_map(|f| match &f.scheduled.fault {
        Fault::Outage { dest, .. } if !f.failed => Some((
            dest.as_str(),
            started_unix_ms + (f.started_s * 1000.0) as u64,
            started_unix_ms + (f.ended_s * 1000.0) as u64,
        )),
        _ => None,
    });
    let latency = report::latencies(&history, outage);
    let report = RunReport {
        seed: options.seed,
        profile: options.profile.name().to_owned(),
        options: serde_json::to_value(&options).unwrap_or_default(),
        destinations: options.destinations.clone(),
        destinations_config: destinations_style,
        write_s,
        drain_s,
        drained,
        faults_by_kind,
        faults: fault_records,
        lease_faults: history.lease_faults.clone(),
        relay_exits: relays.exits.lock().await.clone(),
        relay_stops,
        relay_logs: report::summarize_logs(&relays.log_files()),
        parked: side.parked(),
        timeline,
        verdict,
        latency,
        work_dir: work.display().to_string(),
    };
    std::fs::write(
        &options.report_path,
        serde_json::to_vec_pretty(&report).unwrap_or_default(),
    )
    .map_err(Error::io(format!(
        "writing {}",
        options.report_path.display()
    )))?;

    // --- tear down ------------------------------------------------------------------------------
    for d in &dests {
        d.shutdown().await;
    }
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        names.consumer_schema
    )))
    .execute(&consumer_pool)
    .await;
    if cluster.is_none() {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE; DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            names.outbox_schema, names.business_schema
        )))
        .execute(&admin)
        .await;
    }
    admin.close().await;
    drop(ctx);
    drop(cluster);
    Ok(report)
}

fn print_progress(message: &str) {
    eprintln!("outbox-verify: {message}");
}

async fn sample(ctx: &Ctx, side: &ConsumerSide) -> Sample {
    let row: Option<(i64, Option<f64>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT count(*), extract(epoch FROM now() - min(enqueued_at))::float8 FROM {} WHERE status IN ('pending', 'in_flight')",
        ctx.table
    )))
    .fetch_one(&ctx.admin)
    .await
    .ok();
    let mut rss = Vec::new();
    for slot in &ctx.relays.slots {
        rss.push(match slot.try_lock() {
            Ok(slot) => Relays::rss_kib(&slot),
            Err(_) => None,
        });
    }
    Sample {
        t_s: ctx.started.elapsed().as_secs_f64(),
        backlog: row.map(|r| r.0),
        oldest_s: row.and_then(|r| r.1),
        txns: ctx.log.len() as u64,
        received: side.received() as u64,
        relay_rss_kib: rss,
    }
}

/// Wait until nothing is pending or in flight and every delivered event was received. Past
/// `timeout`, keep waiting while the consumers still make progress (a slow consumer is not a
/// lost event), up to three times `timeout`.
async fn drain(ctx: &Ctx, side: &ConsumerSide, timeout: Duration) -> bool {
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut progress = (0usize, Instant::now());
    loop {
        let counts: Result<(i64, i64), _> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE status IN ('pending', 'in_flight')), count(*) FILTER (WHERE status = 'delivered') FROM {}",
            ctx.table
        )))
        .fetch_one(&ctx.admin)
        .await;
        let received = side.received();
        if received > progress.0 {
            progress = (received, Instant::now());
        }
        if let Ok((open, delivered)) = counts {
            let distinct: HashSet<EventId> = side
                .observed()
                .into_iter()
                .filter_map(|o| o.event_id)
                .collect();
            if open == 0 && distinct.len() as i64 >= delivered {
                return true;
            }
            if last_report.elapsed() > Duration::from_secs(10) {
                print_progress(&format!(
                    "draining: {open} pending or in flight, {delivered} delivered, {} received",
                    distinct.len()
                ));
                last_report = Instant::now();
            }
        }
        let elapsed = started.elapsed();
        let stalled = progress.1.elapsed() > Duration::from_secs(10);
        if elapsed > timeout * 3 || (elapsed > timeout && stalled) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Read the final state.
async fn collect(ctx: &Ctx, side: &ConsumerSide, names: &Names) -> Result<History, Error> {
    let rows: Vec<(uuid::Uuid, String, i32, Option<String>)> = sqlx::query_as(AssertSqlSafe(
        format!("SELECT id, status, attempts, last_error FROM {}", ctx.table),
    ))
    .fetch_all(&ctx.admin)
    .await?;
    let outbox = rows
        .into_iter()
        .map(|(id, status, attempts, last_error)| {
            (
                EventId::from_uuid(id),
                OutboxRow {
                    status,
                    attempts,
                    last_error,
                },
            )
        })
        .collect();
    let business: Vec<(uuid::Uuid,)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT txn FROM {}.business",
        names.business_schema
    )))
    .fetch_all(&ctx.admin)
    .await?;
    Ok(History {
        txns: ctx.log.txns(),
        observed: side.observed(),
        outbox,
        effects: side.effects().await?,
        business_rows: business.into_iter().map(|(t,)| t).collect(),
        lease_faults: ctx
            .lease_faults
            .lock()
            .await
            .iter()
            .cloned()
            .map(settle_late_writes)
            .collect(),
        broker_held: HashMap::new(),
        broker_dropped: HashMap::new(),
    })
}

/// Settle a lease fault that had not shown a fenced write by the time the fault ended, from the
/// resumed process's whole log (every relay process has stopped by now): a fenced marker later
/// on means fenced; a log that ends without "Relay stopped." means the process was killed before
/// it wrote that batch back; a normal stop without any fenced write is a violation.
fn settle_late_writes(mut fault: LeaseFault) -> LeaseFault {
    if fault.late_writes != LateWrites::Pending || fault.reclaimed == 0 {
        return fault;
    }
    let Some((log, offset)) = &fault.log else {
        return fault;
    };
    let text = relays::log_after(Path::new(log), *offset);
    let stopped = text.find(relays::STOPPED_MARKER);
    // The first thing the resumed relay said about its claim was that it failed.
    let claim_failed_first = text
        .find(relays::CLAIM_FAILED_MARKER)
        .is_some_and(|at| stopped.is_none_or(|stop| at < stop));
    fault.late_writes = if relays::FENCED_MARKERS.iter().any(|m| text.contains(m)) {
        LateWrites::Fenced
    } else if fault.leases == 1 && claim_failed_first {
        LateWrites::ClaimLost
    } else if stopped.is_some() {
        LateWrites::Unfenced
    } else {
        LateWrites::NeverWritten
    };
    fault
}

/// Inject one fault and undo it; `None` when it was skipped because the writers had stopped
/// before its turn came.
async fn inject(ctx: &Ctx, scheduled: Scheduled) -> Option<FaultRecord> {
    let target = target_of(&scheduled.fault);
    let _guard = match ctx.locks.get(&target) {
        Some(lock) if target != "none" => Some(lock.lock().await),
        _ => None,
    };
    if ctx.writing_done.load(Ordering::SeqCst) {
        return None;
    }
    let started_s = ctx.started.elapsed().as_secs_f64();
    let result = act(ctx, &scheduled.fault).await;
    let (note, failed) = match result {
        Ok(note) => (note, false),
        Err(error) => (error.to_string(), true),
    };
    Some(FaultRecord {
        scheduled,
        started_s,
        ended_s: ctx.started.elapsed().as_secs_f64(),
        note,
        failed,
    })
}

fn dest<'a>(ctx: &'a Ctx, name: &str) -> Result<&'a Arc<dyn Destination>, Error> {
    ctx.dests
        .iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| Error::Invalid(format!("no destination {name}")))
}

async fn terminate(ctx: &Ctx, app: &str) -> Result<String, Error> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(app)
    .fetch_one(&ctx.admin)
    .await?;
    Ok(format!("terminated {n} connections"))
}

async fn act(ctx: &Ctx, fault: &Fault) -> Result<String, Error> {
    match fault {
        Fault::KillRelay { relay, down_ms } => {
            let mut slot = ctx.relays.slots[*relay].lock().await;
            let id = slot.relay_id.clone();
            slot.held_down = true;
            Relays::kill(&mut slot).await?;
            tokio::time::sleep(Duration::from_millis(*down_ms)).await;
            ctx.relays.spawn(&mut slot)?;
            slot.held_down = false;
            Ok(format!("killed {id}, started {}", slot.relay_id))
        }
        Fault::PauseRelay { relay } => pause_relay(ctx, *relay).await,
        Fault::TerminateRelayConnections => terminate(ctx, "outbox_verify_relay").await,
        Fault::TerminateWriterConnections => terminate(ctx, "outbox_verify_writer").await,
        Fault::CutRelayDatabase { ms } => {
            ctx.relay_db.cut();
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            ctx.relay_db.restore();
            Ok(String::new())
        }
        Fault::CutWriterDatabase { ms } => {
            ctx.writer_db.cut();
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            ctx.writer_db.restore();
            Ok(String::new())
        }
        Fault::RestartDatabase { immediate, down_ms } => {
            let Some(cluster) = &ctx.cluster else {
                return Err(Error::Invalid(
                    "the harness does not own the database".into(),
                ));
            };
            cluster
                .restart(*immediate, Duration::from_millis(*down_ms))
                .await?;
            Ok(String::new())
        }
        Fault::CutBroker { dest: name, ms } | Fault::Outage { dest: name, ms } => {
            let proxy = dest(ctx, name)?
                .proxy()
                .ok_or_else(|| Error::Invalid(format!("{name} has no proxy")))?;
            proxy.cut();
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            proxy.restore();
            Ok(String::new())
        }
        Fault::BrokerLatency {
            dest: name,
            latency_ms,
            ms,
        } => {
            let proxy = dest(ctx, name)?
                .proxy()
                .ok_or_else(|| Error::Invalid(format!("{name} has no proxy")))?;
            proxy.set_latency(Duration::from_millis(*latency_ms));
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            proxy.set_latency(Duration::ZERO);
            Ok(String::new())
        }
        Fault::BrokerDrops {
            dest: name,
            rate,
            ms,
        } => {
            let proxy = dest(ctx, name)?
                .proxy()
                .ok_or_else(|| Error::Invalid(format!("{name} has no proxy")))?;
            proxy.set_drop_rate(*rate);
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            proxy.set_drop_rate(0.0);
            Ok(String::new())
        }
        Fault::RestartBroker {
            dest: name,
            down_ms,
        } => {
            let d = dest(ctx, name)?;
            d.stop_broker().await?;
            tokio::time::sleep(Duration::from_millis(*down_ms)).await;
            d.start_broker().await?;
            Ok(String::new())
        }
        Fault::Poison { dest: name } => {
            let d = if name == UNROUTED {
                None
            } else {
                Some(dest(ctx, name)?.clone())
            };
            let shape = |p: serde_json::Value| match &d {
                Some(d) => d.poison(p),
                None => Some(p),
            };
            let n = ctx.poison_numbers.fetch_add(1, Ordering::SeqCst);
            let mut last = None;
            // The writers' link may be cut right now: try for a while.
            for _ in 0..50 {
                match writers::write_poison(&ctx.writer_options, name, n, shape, &ctx.log).await {
                    Ok(()) => return Ok(format!("poison-{n}")),
                    Err(e) => last = Some(e),
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(last.unwrap_or_else(|| Error::Timeout("writing a poison event".into())))
        }
    }
}

/// The lease-clock fault: freeze a relay while it holds claimed events, keep it frozen past its
/// lease until the other relays have re-claimed them, resume it, and look in its log for its
/// late writes being fenced.
async fn pause_relay(ctx: &Ctx, relay: usize) -> Result<String, Error> {
    let mut slot = ctx.relays.slots[relay].lock().await;
    if slot.child.is_none() {
        return Ok("relay not running".into());
    }
    let id = slot.relay_id.clone();
    let held_query = format!(
        "SELECT seq, lease_token FROM {} WHERE lease_owner = $1 AND status = 'in_flight'",
        ctx.table
    );
    // Freeze it at a moment when it holds a claim: stop it, look, and if it holds nothing let
    // it run a little and try again (claims can be milliseconds long), for up to 10 s.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut held: Vec<(i64, uuid::Uuid)>;
    loop {
        Relays::signal(&slot, "STOP").await?;
        slot.paused = true;
        tokio::time::sleep(Duration::from_millis(20)).await;
        held = sqlx::query_as(AssertSqlSafe(held_query.as_str()))
            .bind(&id)
            .fetch_all(&ctx.admin)
            .await
            .unwrap_or_default();
        if !held.is_empty() || Instant::now() > deadline {
            break;
        }
        Relays::signal(&slot, "CONT").await?;
        slot.paused = false;
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..40))).await;
    }
    // Statements it sent before it froze still complete in the server (an ack in flight):
    // what it holds is what is left after them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held: Vec<(i64, uuid::Uuid)> = if held.is_empty() {
        held
    } else {
        sqlx::query_as(AssertSqlSafe(held_query.as_str()))
            .bind(&id)
            .fetch_all(&ctx.admin)
            .await
            .unwrap_or_default()
    };
    let seqs: Vec<i64> = held.iter().map(|h| h.0).collect();
    let tokens: Vec<uuid::Uuid> = held.iter().map(|h| h.1).collect();
    tokio::time::sleep(ctx.lease + Duration::from_millis(500)).await;
    let reclaim_deadline = Instant::now() + ctx.lease * 3;
    let mut reclaimed = 0i64;
    while !held.is_empty() {
        reclaimed = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} t JOIN unnest($1::bigint[], $2::uuid[]) AS h(seq, token) ON t.seq = h.seq
             WHERE t.lease_token IS DISTINCT FROM h.token OR t.status <> 'in_flight'",
            ctx.table
        )))
        .bind(&seqs)
        .bind(&tokens)
        .fetch_one(&ctx.admin)
        .await
        .unwrap_or(reclaimed);
        if reclaimed as usize >= held.len() || Instant::now() > reclaim_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let offset = relays::file_len(&slot.log);
    Relays::signal(&slot, "CONT").await?;
    slot.paused = false;
    let mut fenced = false;
    if reclaimed > 0 {
        // A relay frozen after its claim committed but before it read the result believes,
        // once resumed, that its lease starts then: it publishes the whole stale batch (up to a
        // lease long) before its write-back is fenced. Wait for that too (the slot stays locked,
        // so no kill fault cuts it short).
        let deadline = Instant::now() + (ctx.lease * 8).max(Duration::from_secs(15));
        while Instant::now() < deadline {
            if relays::log_contains_after(&slot.log, offset, &relays::FENCED_MARKERS) {
                fenced = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let record = LeaseFault {
        relay: id.clone(),
        held: held.len() as u64,
        reclaimed: u64::try_from(reclaimed).unwrap_or(0),
        late_writes: if fenced {
            LateWrites::Fenced
        } else {
            LateWrites::Pending
        },
        log: Some((slot.log.display().to_string(), offset)),
        leases: held
            .iter()
            .map(|h| h.1)
            .collect::<std::collections::HashSet<_>>()
            .len() as u64,
    };
    let note = format!(
        "{id} paused holding {} events, {} re-claimed, fenced after resume: {fenced}{}",
        record.held,
        record.reclaimed,
        if fenced || reclaimed == 0 {
            ""
        } else {
            " (not yet: settled from its whole log after the run)"
        }
    );
    ctx.lease_faults.lock().await.push(record);
    Ok(note)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paused relay's fault settled from what its log says after it was resumed.
    fn settled(after_resume: &str, leases: u64) -> LateWrites {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("relay.log");
        let before = "INFO Claimed 40 events\n";
        std::fs::write(&log, format!("{before}{after_resume}")).expect("log written");
        settle_late_writes(LeaseFault {
            relay: "relay-1".into(),
            held: 40,
            reclaimed: 40,
            late_writes: LateWrites::Pending,
            log: Some((log.display().to_string(), before.len() as u64)),
            leases,
        })
        .late_writes
    }

    #[test]
    fn a_late_write_is_settled_from_the_resumed_relays_log() {
        let claim_failed =
            "WARN Claim failed; the database may be down. Events stay in the outbox.\n";
        let fenced = "WARN Lease expired before the write; another relay owns these events.\n";
        let stopped = "INFO Relay stopped.\n";
        assert_eq!(
            settled(&format!("{fenced}{stopped}"), 1),
            LateWrites::Fenced
        );
        assert_eq!(
            settled(&format!("{claim_failed}{fenced}{stopped}"), 1),
            LateWrites::Fenced
        );
        // The claim it was frozen in never got its answer: it never had the events.
        assert_eq!(
            settled(&format!("{claim_failed}{stopped}"), 1),
            LateWrites::ClaimLost
        );
        // Two claims held: the failed one may be the other; a missing fence stays a violation.
        assert_eq!(
            settled(&format!("{claim_failed}{stopped}"), 2),
            LateWrites::Unfenced
        );
        // It stopped normally before any claim failed, and never fenced: a violation.
        assert_eq!(
            settled(&format!("{stopped}{claim_failed}"), 1),
            LateWrites::Unfenced
        );
        assert_eq!(settled("", 1), LateWrites::NeverWritten);
    }
}
