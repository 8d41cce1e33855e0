//! `outbox`: the relay daemon and its admin commands.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 bad usage or configuration (the message names the
//! key, value or URL at fault).

mod admin;
mod config;
mod demo;
mod observe;
mod store;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_core::{Sink, humantime_duration};
use outbox_relay::Relay;
use serde_json::json;

use crate::config::{Config, ConfigError, SinkConfig};
use crate::store::AnyStore;

#[derive(Parser)]
#[command(
    name = "outbox",
    version,
    about = "Transactional outbox relay and tools"
)]
struct Cli {
    /// Log format: `human` on a terminal, `json` for log shippers.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the outbox schema (idempotent).
    Migrate(DbArgs),
    /// Deliver events from the outbox to the configured sink until SIGINT/SIGTERM.
    Relay(RelayArgs),
    /// Counts per state and the age of the oldest undelivered event.
    Status(StatusArgs),
    /// Validate a configuration and print the effective settings (secrets masked).
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Inspect, requeue or discard dead events.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Delete delivered events older than the retention period, now (the relay also does it on
    /// its schedule).
    Cleanup(CleanupArgs),
    /// Run the Order system in one process on SQLite (order service over HTTP, load generator,
    /// relay, in-process bus, delivery and billing consumers) and check every effect happened
    /// exactly once.
    Demo(demo::DemoArgs),
}

#[derive(Args, Clone)]
struct DbArgs {
    /// Config file (TOML). Keys can also come from OUTBOX_SECTION__KEY environment variables.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Database URL: postgres://… or sqlite://path.
    #[arg(long)]
    database_url: Option<String>,
    /// PostgreSQL schema of the outbox.
    #[arg(long)]
    schema: Option<String>,
    /// Outbox table name.
    #[arg(long)]
    table: Option<String>,
}

#[derive(Args)]
struct RelayArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Events claimed per batch.
    #[arg(long)]
    batch_size: Option<u32>,
    /// Pause after a short batch, e.g. `100ms`.
    #[arg(long)]
    poll_interval: Option<String>,
    /// Claim lease, e.g. `30s`.
    #[arg(long)]
    lease: Option<String>,
    /// Sink: `stdout` or `file:PATH`.
    #[arg(long)]
    sink: Option<String>,
    /// Exit once nothing is due instead of waiting for more events.
    #[arg(long)]
    drain: bool,
    /// Serve /metrics, /healthz and /readyz here, e.g. `127.0.0.1:9464`.
    #[arg(long)]
    metrics_listen: Option<String>,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Load the file, environment and flags exactly as `outbox relay` would; exit 2 with the
    /// problem named if anything is wrong, else print the effective configuration.
    Check {
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON instead of TOML.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum DeadCommand {
    /// List dead events, oldest first.
    List {
        #[command(flatten)]
        db: DbArgs,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Continue after this seq (printed at the end of a full page).
        #[arg(long)]
        after: Option<i64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Everything about one event (in any state).
    Show {
        #[command(flatten)]
        db: DbArgs,
        /// The event id.
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make dead events pending again (attempts reset), due now.
    Retry {
        #[command(flatten)]
        db: DbArgs,
        /// Event ids.
        ids: Vec<String>,
        /// Every dead event.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete dead events for good.
    Discard {
        #[command(flatten)]
        db: DbArgs,
        /// Event ids.
        ids: Vec<String>,
        /// Every dead event.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct CleanupArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Override `retention.delivered`, e.g. `7d`.
    #[arg(long)]
    older_than: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct StatusArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

impl DbArgs {
    fn layer(&self) -> Vec<(&'static str, Option<serde_json::Value>)> {
        vec![
            ("database.url", self.database_url.clone().map(|v| json!(v))),
            ("database.schema", self.schema.clone().map(|v| json!(v))),
            ("database.table", self.table.clone().map(|v| json!(v))),
        ]
    }

    fn load(
        &self,
        extra: Vec<(&'static str, Option<serde_json::Value>)>,
    ) -> Result<Config, ConfigError> {
        let mut pairs = self.layer();
        pairs.extend(extra);
        config::load(self.config.as_deref(), config::flags(pairs))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            if let Some(config) = error.downcast_ref::<ConfigError>() {
                eprintln!("error: {config}");
                ExitCode::from(2)
            } else {
                eprintln!("error: {error:#}");
                ExitCode::from(1)
            }
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OUTBOX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate(args) => migrate(args).await,
        Command::Relay(args) => relay(args).await,
        Command::Status(args) => status(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Config(ConfigCommand::Check { db, json }) => config_check(db, json),
        Command::Dead(command) => dead(command).await,
        Command::Cleanup(args) => cleanup(args).await,
    }
}

async fn migrate(args: DbArgs) -> anyhow::Result<()> {
    let config = args.load(vec![])?;
    let store = AnyStore::open(&config.database).await?;
    let applied = store.migrate().await.context("migration failed")?;
    if applied.is_empty() {
        println!("{}: schema is current", store.describe());
    } else {
        println!("{}: applied migrations {applied:?}", store.describe());
    }
    Ok(())
}

fn duration_flag(
    key: &'static str,
    value: &Option<String>,
) -> Result<Option<serde_json::Value>, ConfigError> {
    match value {
        None => Ok(None),
        Some(text) => humantime_duration::parse_duration(text)
            .map(|_| Some(json!(text)))
            .map_err(|e| {
                ConfigError(format!(
                    "invalid --{}: {e}",
                    key.rsplit('.').next().unwrap_or(key).replace('_', "-")
                ))
            }),
    }
}

fn sink_flag(value: &Option<String>) -> Result<Option<serde_json::Value>, ConfigError> {
    match value.as_deref() {
        None => Ok(None),
        Some("stdout") => Ok(Some(json!({"type": "stdout"}))),
        Some(other) => match other.strip_prefix("file:") {
            Some(path) if !path.is_empty() => Ok(Some(json!({"type": "file", "path": path}))),
            _ => Err(ConfigError(format!(
                "unknown --sink `{other}`: use `stdout` or `file:PATH` (brokers are configured in the [sink] section of the config file)"
            ))),
        },
    }
}

async fn build_sink(config: &SinkConfig) -> anyhow::Result<Arc<dyn Sink>> {
    Ok(match config {
        SinkConfig::Stdout => Arc::new(outbox_sink_stdout::StdoutSink::stdout()),
        SinkConfig::File { path, sync } => Arc::new(
            outbox_sink_stdout::StdoutSink::file(path, *sync)
                .await
                .map_err(|e| ConfigError(format!("invalid `sink`: {e}")))?,
        ),
    })
}

async fn relay(args: RelayArgs) -> anyhow::Result<()> {
    let extra = vec![
        ("relay.batch_size", args.batch_size.map(|v| json!(v))),
        (
            "relay.poll_interval",
            duration_flag("relay.poll_interval", &args.poll_interval)?,
        ),
        ("relay.lease", duration_flag("relay.lease", &args.lease)?),
        ("sink", sink_flag(&args.sink)?),
        ("relay.stop_when_idle", args.drain.then_some(json!(true))),
        (
            "metrics.listen",
            args.metrics_listen.clone().map(|v| json!(v)),
        ),
    ];
    let config = args.db.load(extra)?;
    let store = AnyStore::open(&config.database).await?;
    let dyn_store = store.dyn_store();
    dyn_store
        .check()
        .await
        .map_err(|e| ConfigError(format!("{} is not ready: {e}", store.describe())))?;
    let sink = build_sink(&config.sink).await?;
    if let Some(listen) = config.metrics.listen {
        observe::serve(
            listen,
            config.metrics.refresh,
            dyn_store.clone(),
            sink.clone(),
        )
        .await?;
    }
    tracing::info!(outbox = %store.describe(), sink = sink.name(), "Relaying.");
    let retention = config
        .retention
        .enabled
        .then(|| tokio::spawn(retention_loop(dyn_store.clone(), config.retention.clone())));
    let relay = Relay::new(dyn_store, sink, config.relay.clone());
    let report = relay.run(shutdown_signal()).await;
    if let Some(task) = retention {
        task.abort();
    }
    tracing::info!(
        delivered = report.delivered,
        retried = report.retried,
        dead = report.dead,
        released = report.released,
        fenced = report.fenced,
        "Relay exited."
    );
    Ok(())
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        tracing::info!("Shutdown requested: finishing in-flight batches.");
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let config = args.db.load(vec![])?;
    let store = AnyStore::open(&config.database).await?;
    let stats = store
        .dyn_store()
        .stats()
        .await
        .context("reading the outbox failed")?;
    let age = stats.oldest_pending_age();
    if args.json {
        let mut value = serde_json::to_value(&stats)?;
        value["oldest_pending_age_seconds"] = json!(age.map(|a| a.as_secs_f64()));
        value["outbox"] = json!(store.describe());
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!("outbox      {}", store.describe());
        println!(
            "pending     {} ({} waiting for a retry)",
            stats.pending, stats.retrying
        );
        println!("in_flight   {}", stats.in_flight);
        println!("delivered   {}", stats.delivered);
        println!("dead        {}", stats.dead);
        println!(
            "oldest pending age  {}",
            age.map(
                |a| humantime_duration::format_duration(
                    Duration::from_millis(a.as_millis() as u64)
                )
            )
            .unwrap_or_else(|| "-".into())
        );
    }
    Ok(())
}

async fn open(db: &DbArgs) -> anyhow::Result<(Config, AnyStore)> {
    let config = db.load(vec![])?;
    let store = AnyStore::open(&config.database).await?;
    Ok((config, store))
}

fn dead_filter(ids: &[String], all: bool) -> Result<outbox_core::DeadFilter, ConfigError> {
    if all {
        return Ok(outbox_core::DeadFilter::All);
    }
    if ids.is_empty() {
        return Err(ConfigError("give event ids, or --all".into()));
    }
    Ok(outbox_core::DeadFilter::Ids(admin::parse_ids(ids)?))
}

async fn dead(command: DeadCommand) -> anyhow::Result<()> {
    match command {
        DeadCommand::List {
            db,
            limit,
            after,
            json,
        } => {
            let (_, store) = open(&db).await?;
            admin::list(store.dyn_store().as_ref(), limit, after, json).await
        }
        DeadCommand::Show { db, id, json } => {
            let id = admin::parse_ids(std::slice::from_ref(&id))?[0];
            let (_, store) = open(&db).await?;
            admin::show(store.dyn_store().as_ref(), id, json).await
        }
        DeadCommand::Retry { db, ids, all, json } => {
            let filter = dead_filter(&ids, all)?;
            let (_, store) = open(&db).await?;
            admin::act(store.dyn_store().as_ref(), filter, true, json).await
        }
        DeadCommand::Discard { db, ids, all, json } => {
            let filter = dead_filter(&ids, all)?;
            let (_, store) = open(&db).await?;
            admin::act(store.dyn_store().as_ref(), filter, false, json).await
        }
    }
}

async fn cleanup(args: CleanupArgs) -> anyhow::Result<()> {
    let extra = vec![(
        "retention.delivered",
        duration_flag("retention.older_than", &args.older_than)?,
    )];
    let config = args.db.load(extra)?;
    let store = AnyStore::open(&config.database).await?;
    admin::cleanup(
        store.dyn_store().as_ref(),
        config.retention.delivered,
        config.retention.batch_size,
        args.json,
    )
    .await
}

/// The relay's retention schedule: purge delivered events every `interval` until shutdown.
async fn retention_loop(store: Arc<dyn outbox_core::Store>, retention: config::RetentionConfig) {
    let mut ticker = tokio::time::interval(retention.interval.max(Duration::from_secs(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match admin::purge(
            store.as_ref(),
            retention.delivered,
            retention.batch_size,
            |_| {},
        )
        .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, "Retention deleted delivered events."),
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), "Retention run failed; will try again at the next interval.")
            }
        }
    }
}

fn config_check(db: DbArgs, as_json: bool) -> anyhow::Result<()> {
    let mut config = db.load(vec![])?;
    config.database.url = outbox_postgres::redact_url(&config.database.url);
    if as_json {
        println!("{}", serde_json::to_string_pretty(&config)?);
    } else {
        println!("# effective configuration (secrets masked)");
        print!(
            "{}",
            toml::to_string_pretty(&config).context("rendering the configuration")?
        );
    }
    Ok(())
}
