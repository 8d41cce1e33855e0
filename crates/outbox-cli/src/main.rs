//! `outbox`: the relay daemon and its admin commands.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 bad usage or configuration (the message names the
//! key, value or URL at fault).

mod config;
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
    ];
    let config = args.db.load(extra)?;
    let store = AnyStore::open(&config.database).await?;
    let dyn_store = store.dyn_store();
    dyn_store
        .check()
        .await
        .map_err(|e| ConfigError(format!("{} is not ready: {e}", store.describe())))?;
    let sink = build_sink(&config.sink).await?;
    tracing::info!(outbox = %store.describe(), sink = sink.name(), "Relaying.");
    let relay = Relay::new(dyn_store, sink, config.relay.clone());
    let report = relay.run(shutdown_signal()).await;
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
