//! `outbox`: the relay daemon and its admin commands.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 bad usage or configuration (the message names the
//! key, value or URL at fault).

#[cfg(not(feature = "postgres"))]
compile_error!(
    "outbox-cli needs its `postgres` feature (the configuration's [wal] section, the inbox names and the relay's supervision are written against PostgreSQL): build with `--features postgres,...`"
);

mod admin;
mod config;
mod demo;
mod import_debezium;
mod inbox;
mod logging;
mod observe;
mod ops;
mod progress;
mod relay;
mod schema;
mod sinks;
mod store;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_types::humantime_duration;
use serde_json::json;

use crate::config::{Config, ConfigError};
use crate::store::AnyStore;

/// `outbox --version`: the version and what this build has (its cargo features), e.g.
/// `0.1.0 (postgres, webhook, stdout, file)`, so an operator can tell which databases and sinks
/// a binary supports without a config to try.
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let built: Vec<&str> = config::built_features().collect();
    format!("{} ({})", env!("CARGO_PKG_VERSION"), built.join(", "))
});

#[derive(Parser)]
#[command(
    name = "outbox",
    version = VERSION.as_str(),
    about = "Transactional outbox relay and tools"
)]
struct Cli {
    /// Log format: `human` (also `text`) for people, `json` for log shippers. Colour only on a
    /// terminal, and never with `NO_COLOR` set.
    #[arg(
        long,
        global = true,
        value_enum,
        env = "OUTBOX_LOG_FORMAT",
        default_value_t = LogFormat::Human
    )]
    log_format: LogFormat,
    /// Threads that run the relay's tasks. Default `1`: everything on the main thread, which
    /// costs the least CPU per event (measured with scripts/bench-relay-runtime.sh on 2 cores:
    /// 95-104 µs per event against 122-138 µs on one worker per core for a WAL relay at 2,000
    /// events/s, 44 against 75 µs polling; drains as fast). N > 1: a pool of N workers, for
    /// sinks that do CPU work of their own on a host with cores to spare.
    #[arg(
        long,
        global = true,
        env = "OUTBOX_WORKER_THREADS",
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    worker_threads: Option<u16>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    #[value(alias = "text")]
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the outbox schema (idempotent).
    Migrate(MigrateArgs),
    /// Deliver events from the outbox to the configured sink until SIGINT/SIGTERM.
    Relay(RelayArgs),
    /// Counts per state and per destination, lag, paused destinations, and which relays hold
    /// claims since when.
    Status(StatusArgs),
    /// Stop delivering to a destination: running relays leave its events pending (within one
    /// poll interval) until `outbox resume`.
    Pause(PauseArgs),
    /// Deliver to a paused destination again.
    Resume(PauseArgs),
    /// WAL mode (logical replication): slot status, preparation, recovery.
    #[command(subcommand)]
    Wal(WalCommand),
    /// Send delivered events again: those written in [--from, --to) go back to pending with their
    /// ids unchanged, so consumers deduplicate them.
    Replay(ReplayArgs),
    /// The outbox's DDL: `outbox schema print` writes what `outbox migrate` applies, with its
    /// bookkeeping rows, for review or for your own migration tool (docs/table-contract.md).
    #[command(subcommand)]
    Schema(SchemaCommand),
    /// Validate a configuration and print the effective settings (secrets masked).
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Inspect, requeue or purge dead events.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Purge: delete delivered events older than the retention period, now (the relay also does
    /// it on its schedule). `cleanup` is the old spelling.
    #[command(alias = "cleanup")]
    Purge(PurgeArgs),
    /// The consumer-side inbox, for consumers in any language: create its tables and claim
    /// routine, show its state, purge old rows, list parked messages (docs/inbox.md).
    #[command(subcommand)]
    Inbox(InboxCommand),
    /// Run the Order system in one process on SQLite (order service over HTTP, load generator,
    /// relay, in-process bus, delivery and billing consumers) and check every effect happened
    /// exactly once.
    Demo(demo::DemoArgs),
}

/// A command's database: a config file, or flags laid over its keys (the key beside each flag).
/// The outbox's ([`DbArgs`]) and the inbox's ([`InboxDbArgs`]) are the same four flags with
/// their own help and keys, loaded the same way: a macro because clap takes the help from each
/// field's doc comment.
macro_rules! database_flags {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident loaded by ($load:expr) {
            $(#[$config_doc:meta])*
            config,
            $(#[$url_doc:meta])*
            database_url => $url_key:literal,
            $(#[$schema_doc:meta])*
            schema => $schema_key:literal,
            $(#[$table_doc:meta])*
            table => $table_key:literal,
        }
    ) => {
        $(#[$meta])*
        #[derive(Args, Clone)]
        $vis struct $name {
            $(#[$config_doc])*
            #[arg(long, short)]
            config: Option<PathBuf>,
            $(#[$url_doc])*
            #[arg(long)]
            database_url: Option<String>,
            $(#[$schema_doc])*
            #[arg(long)]
            schema: Option<String>,
            $(#[$table_doc])*
            #[arg(long)]
            table: Option<String>,
        }

        impl $name {
            /// The configuration: the file, the environment, then the flags given and `extra`
            /// over them, checked for what the command needs.
            fn load(
                &self,
                extra: Vec<(&'static str, Option<serde_json::Value>)>,
            ) -> Result<Config, ConfigError> {
                warn_password_flag(&self.database_url);
                let mut pairs = vec![
                    ($url_key, self.database_url.clone().map(|v| json!(v))),
                    ($schema_key, self.schema.clone().map(|v| json!(v))),
                    ($table_key, self.table.clone().map(|v| json!(v))),
                ];
                pairs.extend(extra);
                ($load)(self.config.as_deref(), config::flags(pairs))
            }
        }
    };
}

database_flags! {
    pub(crate) struct DbArgs loaded by (config::load) {
        /// Config file (TOML). Keys can also come from OUTBOX_SECTION__KEY environment variables.
        config,
        /// Database URL: postgres://… or sqlite://path. Keep passwords out of it: a command line
        /// is readable by every user of the machine (`ps`); put the URL in OUTBOX_DATABASE__URL or
        /// the config file instead.
        database_url => "database.url",
        /// PostgreSQL schema of the outbox.
        schema => "database.schema",
        /// Outbox table name.
        table => "database.table",
    }
}

#[derive(Args)]
struct MigrateArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Print JSON: the outbox, the versions applied, whether it was current already.
    #[arg(long)]
    json: bool,
}

database_flags! {
    /// Where the inbox is: `[inbox]` of the config file, `[database]` for the rest.
    struct InboxDbArgs loaded by (|file, flags| config::load_for(file, flags, config::Need::Inbox)) {
        /// Config file (TOML), the relay's or one of the consumer's own; `[inbox]` and, when it
        /// names no `database_url`, `[database]` are read. Keys can also come from
        /// OUTBOX_INBOX__KEY environment variables.
        config,
        /// The consumer's database URL (overrides `inbox.database_url`). Keep passwords out of
        /// it: a command line is readable by every user of the machine; use
        /// OUTBOX_INBOX__DATABASE_URL or the config file instead.
        database_url => "inbox.database_url",
        /// PostgreSQL schema of the inbox (default `public`).
        schema => "inbox.schema",
        /// Inbox table name (default `outbox_inbox`).
        table => "inbox.table",
    }
}

#[derive(Subcommand)]
enum InboxCommand {
    /// Create or upgrade the inbox tables and the claim routine (idempotent); prints the claim
    /// to call.
    Migrate {
        #[command(flatten)]
        db: InboxDbArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Rows per handler, oldest and newest, rows past retention, parked messages.
    Status {
        #[command(flatten)]
        db: InboxDbArgs,
        /// The retention window to count against (default `inbox.retention`, 7d).
        #[arg(long)]
        older_than: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete inbox rows processed longer ago than the retention window, in batches; prints
    /// the count. With --every, runs again at that interval until SIGINT/SIGTERM.
    Purge {
        #[command(flatten)]
        db: InboxDbArgs,
        /// The retention window, e.g. `7d` (default `inbox.retention`). A duplicate arriving
        /// after its row was purged is applied again: keep it well above the longest
        /// redelivery delay.
        #[arg(long)]
        older_than: Option<String>,
        /// Rows deleted per statement (default `inbox.batch_size`).
        #[arg(long)]
        batch_size: Option<u32>,
        /// Run as a retention loop: purge now, then every interval (e.g. `1h`).
        #[arg(long)]
        every: Option<String>,
        /// Print JSON (one object per run).
        #[arg(long)]
        json: bool,
    },
    /// List parked (poison) messages, oldest first; `parked show ID` for one.
    #[command(args_conflicts_with_subcommands = true)]
    Parked {
        #[command(flatten)]
        db: InboxDbArgs,
        /// Only this handler's.
        #[arg(long)]
        handler: Option<String>,
        /// Continue after this id (printed at the end of a full page).
        #[arg(long)]
        after: Option<i64>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(subcommand)]
        show: Option<ParkedCommand>,
    },
}

#[derive(Subcommand)]
enum ParkedCommand {
    /// Everything about one parked message: headers, payload, last error.
    Show {
        #[command(flatten)]
        db: InboxDbArgs,
        /// The parked message's id (first column of `outbox inbox parked`).
        id: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct RelayArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Events claimed per batch.
    #[arg(long)]
    batch_size: Option<u32>,
    /// Longest pause between claims of an idle outbox, e.g. `100ms` (while events trickle in,
    /// claims follow every `relay.min_poll_interval`).
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
    /// With `--drain`: how long to keep waiting, once nothing else is due, for events that
    /// failed during the drain and come due again, e.g. `30s` (default `60s`, the default retry cap).
    #[arg(long, requires = "drain")]
    drain_wait: Option<String>,
    /// `poll` the outbox table, or stream PostgreSQL's `wal` (see `[wal]` in the config).
    #[arg(long)]
    mode: Option<String>,
    /// Serve /metrics, /healthz and /readyz here, e.g. `127.0.0.1:9464`.
    #[arg(long)]
    metrics_listen: Option<String>,
}

#[derive(Subcommand)]
enum SchemaCommand {
    /// Print the SQL script `outbox migrate` would apply to a database without the outbox,
    /// bookkeeping rows included: applied by another tool, `outbox migrate` then finds the
    /// schema current and the relay accepts it. Connects to nothing.
    Print(schema::PrintArgs),
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
    /// Turn a Debezium configuration (Debezium Server `application.properties`, or a Kafka
    /// Connect connector JSON) for the PostgreSQL connector with the Outbox Event Router into
    /// an `outbox.toml` on standard output; what is not carried over is listed on standard
    /// error and at the top of the file. See docs/from-debezium.md.
    ImportDebezium {
        /// The Debezium configuration file.
        file: PathBuf,
        /// Kafka bootstrap servers (`host:9092,host2:9092`); a Kafka Connect configuration
        /// does not hold them.
        #[arg(long)]
        kafka_brokers: Option<String>,
        /// Take over the connector's replication slot and publication (stop the connector
        /// first: a slot has one reader) instead of creating the relay's own.
        #[arg(long)]
        reuse_slot: bool,
        /// The outbox table (`schema.table`), when `table.include.list` names several.
        #[arg(long)]
        table: Option<String>,
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
    /// Requeue: make dead events pending again (attempts reset), due now. `retry` is the old
    /// spelling.
    #[command(alias = "retry")]
    Requeue(DeadSelection),
    /// Purge: delete dead events for good. `discard` is the old spelling.
    #[command(alias = "discard")]
    Purge(DeadSelection),
}

/// The dead events `dead requeue` and `dead purge` act on: the given ids, or `--all`.
#[derive(Args)]
struct DeadSelection {
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
}

impl DeadSelection {
    /// Requeue (`requeue`) or purge the selected dead events.
    async fn act(self, requeue: bool) -> anyhow::Result<()> {
        let filter = dead_filter(&self.ids, self.all)?;
        let (_, store) = open(&self.db).await?;
        admin::act(store.dyn_store().as_ref(), filter, requeue, self.json).await
    }
}

#[derive(Args)]
struct PurgeArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Override `retention.delivered`, e.g. `7d`.
    #[arg(long)]
    older_than: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum WalCommand {
    /// Slot lag, retained WAL, confirmed position, decode rate, whether a relay streams.
    Status {
        #[command(flatten)]
        db: DbArgs,
        /// Sample the decode rate over this long (e.g. `2s`); off by default.
        #[arg(long)]
        sample: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Create the publication and the slot now (step 1 of switching from polling to WAL mode:
    /// every commit from then on is captured).
    Prepare {
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// After a lost or invalidated slot: create a fresh slot, deliver every outbox row still
    /// undelivered by polling the table once, then `outbox relay` resumes streaming.
    Recover {
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Drop the slot (leaving WAL mode; stop the WAL relay first, or the server refuses).
    DropSlot {
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct PauseArgs {
    #[command(flatten)]
    db: DbArgs,
    /// The destination (a `[destinations.NAME]` of the config).
    destination: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ReplayArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Events written at or after: RFC 3339, a date (2026-11-23), `now`, or a duration ago (2h).
    #[arg(long)]
    from: String,
    /// Events written before (same forms).
    #[arg(long, default_value = "now")]
    to: String,
    /// Only events routed to this destination.
    #[arg(long)]
    destination: Option<String>,
    /// Only events of this exact type.
    #[arg(long)]
    event_type: Option<String>,
    /// Rows updated per statement.
    #[arg(long, default_value_t = 5000)]
    batch_size: u32,
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
    /// A running relay's metrics address (e.g. `http://relay-0:9464`), asked for which
    /// destinations are up or down and since when. Default: `metrics.listen` of the config;
    /// `none` skips the question.
    #[arg(long, value_name = "URL")]
    relay: Option<String>,
}

/// A password in a `--database-url` flag is visible to every user of the machine.
fn warn_password_flag(url: &Option<String>) {
    if let Some(url) = url
        && outbox_types::redact::redact_url(url) != *url
    {
        tracing::warn!(
            url = %outbox_types::redact::redact_url(url),
            "--database-url carries a password, which every user of this machine can read from the process list; set OUTBOX_DATABASE__URL (OUTBOX_INBOX__DATABASE_URL) or the config file instead."
        );
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some((old, new)) = deprecated_spelling(&args) {
        eprintln!(
            "warning: `outbox {old}` is deprecated: use `outbox {new}` (the same command; the old spelling goes in a later release)"
        );
    }
    let cli = Cli::parse_from(&args);
    init_logging(cli.log_format);
    let mut builder = match cli.worker_threads {
        None | Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(threads) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(usize::from(threads));
            builder
        }
    };
    let runtime = match builder.enable_all().build() {
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
        // PostgreSQL's notices ("schema … already exists, skipping" from idempotent migrations)
        // are not news.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx::postgres::notice=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        // Colour only on a terminal (a file or a log collector gets plain text), and every
        // control character a row could smuggle into a field escaped (see `logging`).
        LogFormat::Human => builder
            .with_ansi(
                std::io::IsTerminal::is_terminal(&std::io::stderr())
                    // https://no-color.org: set and not empty means no colour.
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            )
            .fmt_fields(logging::SafeFields)
            .init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate(args) => migrate(args).await,
        Command::Relay(args) => relay::run(args).await,
        Command::Status(args) => status(args).await,
        Command::Pause(args) => pause(args, true).await,
        Command::Resume(args) => pause(args, false).await,
        Command::Replay(args) => replay(args).await,
        Command::Wal(command) => wal(command).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Config(ConfigCommand::Check { db, json }) => config_check(db, json).await,
        Command::Config(ConfigCommand::ImportDebezium {
            file,
            kafka_brokers,
            reuse_slot,
            table,
        }) => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let options = import_debezium::ImportOptions {
                kafka_brokers,
                reuse_slot,
                table,
            };
            // The input's values may hold secrets and terminal escapes: what is printed of
            // them is masked and escaped (the notes are already).
            let imported = import_debezium::import(&text, &options).map_err(|e| {
                anyhow::anyhow!(import_debezium::printable(
                    "",
                    &format!("importing {}: {e:#}", file.display())
                ))
            })?;
            for note in &imported.notes {
                eprintln!("not carried over: {note}");
            }
            print!("{}", imported.toml);
            Ok(())
        }
        Command::Schema(SchemaCommand::Print(args)) => {
            print!("{}", schema::script(&args)?);
            Ok(())
        }
        Command::Dead(command) => dead(command).await,
        Command::Purge(args) => purge(args).await,
        Command::Inbox(command) => inbox_command(command).await,
    }
}

async fn inbox_command(command: InboxCommand) -> anyhow::Result<()> {
    match command {
        InboxCommand::Migrate { db, json } => {
            let config = db.load(vec![])?;
            let inbox = inbox::AnyInbox::open(&config, true).await?;
            inbox::migrate(&inbox, json).await
        }
        InboxCommand::Status {
            db,
            older_than,
            json,
        } => {
            let config = db.load(vec![(
                "inbox.retention",
                duration_flag("inbox.older_than", &older_than)?,
            )])?;
            let inbox = inbox::AnyInbox::open(&config, false).await?;
            inbox::status(&inbox, config.inbox.retention, json).await
        }
        InboxCommand::Purge {
            db,
            older_than,
            batch_size,
            every,
            json,
        } => {
            let every = every
                .as_deref()
                .map(|text| {
                    humantime_duration::parse_duration(text)
                        .map_err(|e| ConfigError(format!("invalid --every: {e}")))
                })
                .transpose()?;
            let config = db.load(vec![
                (
                    "inbox.retention",
                    duration_flag("inbox.older_than", &older_than)?,
                ),
                ("inbox.batch_size", batch_size.map(|v| json!(v))),
            ])?;
            let inbox = inbox::AnyInbox::open(&config, false).await?;
            let (older_than, batch) = (config.inbox.retention, config.inbox.batch_size);
            match every {
                None => inbox::purge_once(&inbox, older_than, batch, json)
                    .await
                    .map(|_| ()),
                Some(every) => {
                    inbox::purge_loop(
                        &inbox,
                        older_than,
                        batch,
                        every,
                        json,
                        relay::shutdown_signal(),
                    )
                    .await
                }
            }
        }
        InboxCommand::Parked {
            db,
            handler,
            after,
            limit,
            json,
            show,
        } => match show {
            Some(ParkedCommand::Show { db, id, json }) => {
                let config = db.load(vec![])?;
                let inbox = inbox::AnyInbox::open(&config, false).await?;
                inbox::show_parked(&inbox, id, json).await
            }
            None => {
                let config = db.load(vec![])?;
                let inbox = inbox::AnyInbox::open(&config, false).await?;
                let mut query = outbox_inbox::ParkedQuery::new().limit(limit);
                if let Some(h) = handler {
                    query = query.handler(h);
                }
                if let Some(a) = after {
                    query = query.after(a);
                }
                inbox::list_parked(&inbox, &query, json).await
            }
        },
    }
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let config = args.db.load(vec![])?;
    let store = AnyStore::open(&config).await?;
    let applied = store.migrate().await.context("migration failed")?;
    if args.json {
        println!(
            "{}",
            json!({ "outbox": store.describe(), "applied": applied, "already_current": applied.is_empty() })
        );
    } else if applied.is_empty() {
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

/// WAL errors that need a person (configuration, server setup, a lost slot) exit 2 with the
/// message that says what to change; the rest exit 1.
fn wal_error(error: outbox_wal::WalError) -> anyhow::Error {
    use outbox_wal::WalError;
    match error {
        WalError::Config(_)
        | WalError::ServerSetup(_)
        | WalError::SlotLost { .. }
        | WalError::SlotInvalidated { .. } => ConfigError(error.to_string()).into(),
        other => anyhow::Error::new(other),
    }
}

async fn wal(command: WalCommand) -> anyhow::Result<()> {
    match command {
        WalCommand::Status { db, sample, json } => {
            let config = db.load(vec![])?;
            let wal = config.wal_config()?;
            let status = match &sample {
                Some(text) => {
                    let over = humantime_duration::parse_duration(text)
                        .map_err(|e| ConfigError(format!("invalid --sample: {e}")))?;
                    outbox_wal::wal_status_sampled(&wal, over).await
                }
                None => outbox_wal::wal_status(&wal).await,
            }
            .map_err(wal_error)?;
            ops::print_wal_status(&status, json)
        }
        WalCommand::Prepare { db, json } => {
            let config = db.load(vec![])?;
            let wal = config.wal_config()?;
            let lsn = outbox_wal::prepare(&wal).await.map_err(wal_error)?;
            let access = outbox_wal::message_source_access(&wal)
                .await
                .map_err(wal_error)?;
            let connection = outbox_wal::check_replication_connection(&wal)
                .await
                .map_err(wal_error)?;
            if json {
                println!(
                    "{}",
                    json!({
                        "slot": wal.slot,
                        "confirmed_flush_lsn": lsn.to_string(),
                        "message_source": access,
                        "replication_connection": connection,
                    })
                );
            } else {
                println!(
                    "slot {} and publication {} are ready; every commit from {lsn} on is captured",
                    wal.slot, wal.publication
                );
                ops::print_replication_connection(&connection);
                ops::print_message_source_fix(&access);
            }
            Ok(())
        }
        WalCommand::Recover { db, json } => {
            let config = db.load(vec![])?;
            let wal = config.wal_config()?;
            let (sink, _) = sinks::build(&config).await?;
            let report = outbox_wal::recover(&wal, sink).await.map_err(wal_error)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!(
                    "recovered slot {}: {}{} undelivered row(s) delivered ({} dead); start `outbox relay` to resume streaming",
                    wal.slot,
                    if report.dropped_invalidated_slot {
                        "dropped the invalidated slot, "
                    } else {
                        ""
                    },
                    report.redelivered,
                    report.dead
                );
            }
            Ok(())
        }
        WalCommand::DropSlot { db, json } => {
            let config = db.load(vec![])?;
            let wal = config.wal_config()?;
            let dropped = outbox_wal::drop_slot(&wal).await.map_err(wal_error)?;
            if json {
                println!("{}", json!({ "slot": wal.slot, "dropped": dropped }));
            } else if dropped {
                println!("dropped slot {}", wal.slot);
            } else {
                println!("slot {} did not exist", wal.slot);
            }
            Ok(())
        }
    }
}

async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let config = args.db.load(vec![])?;
    let routes = config.route_table()?;
    let store = AnyStore::open(&config).await?;
    let wal = match config.mode {
        config::Mode::Wal => Some(
            outbox_wal::wal_status(&config.wal_config()?)
                .await
                .map_err(wal_error)?,
        ),
        config::Mode::Poll => None,
    };
    let relay = match ops::relay_address(args.relay.as_deref(), config.metrics.listen)? {
        Some(url) => Some(ops::ask_relay(url).await),
        None => None,
    };
    ops::status(
        store.dyn_store().as_ref(),
        &store.describe(),
        &routes,
        wal.as_ref(),
        relay.as_ref(),
        args.json,
    )
    .await
}

async fn pause(args: PauseArgs, pause: bool) -> anyhow::Result<()> {
    let config = args.db.load(vec![])?;
    let routes = config.route_table()?;
    ops::check_destination(&args.destination, &routes, !config.destinations.is_empty())?;
    let store = AnyStore::open(&config).await?;
    ops::pause(
        store.dyn_store().as_ref(),
        &args.destination,
        pause,
        args.json,
    )
    .await
}

async fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    let filter = outbox_types::ReplayFilter {
        from: ops::parse_time("from", &args.from)?,
        to: ops::parse_time("to", &args.to)?,
        destination: args.destination.clone(),
        event_type: args.event_type.clone(),
    };
    let config = args.db.load(vec![])?;
    let routes = config.route_table()?;
    if let Some(d) = &args.destination {
        ops::check_destination(d, &routes, true)?;
    }
    let store = AnyStore::open(&config).await?;
    ops::replay(
        store.dyn_store().as_ref(),
        filter,
        &routes,
        args.batch_size,
        args.json,
    )
    .await
}

async fn open(db: &DbArgs) -> anyhow::Result<(Config, AnyStore)> {
    let config = db.load(vec![])?;
    let store = AnyStore::open(&config).await?;
    Ok((config, store))
}

fn dead_filter(ids: &[String], all: bool) -> Result<outbox_types::DeadFilter, ConfigError> {
    if all {
        return Ok(outbox_types::DeadFilter::All);
    }
    if ids.is_empty() {
        return Err(ConfigError("give event ids, or --all".into()));
    }
    Ok(outbox_types::DeadFilter::Ids(admin::parse_ids(ids)?))
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
        DeadCommand::Requeue(selection) => selection.act(true).await,
        DeadCommand::Purge(selection) => selection.act(false).await,
    }
}

/// The old spelling of a command the glossary renamed, if `args` uses one, with the new one:
/// `dead retry` → `dead requeue`, `dead discard` → `dead purge`, `cleanup` → `purge`.
fn deprecated_spelling(args: &[String]) -> Option<(&'static str, &'static str)> {
    // The words before the first option that takes no value: the command path. Global options
    // come first (`--log-format json`), so they are skipped with their value.
    let mut words = Vec::new();
    let mut rest = args.iter().skip(1);
    while let Some(arg) = rest.next() {
        if arg == "--log-format" {
            rest.next();
        } else if arg.starts_with('-') {
            if words.is_empty() {
                continue;
            }
            break;
        } else {
            words.push(arg.as_str());
            if words.len() == 2 {
                break;
            }
        }
    }
    match words.as_slice() {
        ["dead", "retry", ..] => Some(("dead retry", "dead requeue")),
        ["dead", "discard", ..] => Some(("dead discard", "dead purge")),
        ["cleanup", ..] => Some(("cleanup", "purge")),
        _ => None,
    }
}

async fn purge(args: PurgeArgs) -> anyhow::Result<()> {
    let extra = vec![(
        "retention.delivered",
        duration_flag("retention.older_than", &args.older_than)?,
    )];
    let config = args.db.load(extra)?;
    let store = AnyStore::open(&config).await?;
    if let Some(pg) = store.partitioned() {
        let report = pg
            .outbox()
            .maintain_partitions(pg.pool(), chrono::Utc::now())
            .await
            .context("partition rotation failed")?;
        if args.json {
            println!(
                "{}",
                json!({
                    "created": report.created,
                    "dropped": report.dropped,
                    "kept": report.kept.iter().map(|k| json!({"partition": k.name, "reason": format!("{:?}", k.reason)})).collect::<Vec<_>>(),
                    "keys_removed": report.keys_removed,
                })
            );
        } else {
            println!(
                "partitions created: {}; dropped: {}; kept past retention: {}",
                if report.created.is_empty() {
                    "-".into()
                } else {
                    report.created.join(", ")
                },
                if report.dropped.is_empty() {
                    "-".into()
                } else {
                    report.dropped.join(", ")
                },
                if report.kept.is_empty() {
                    "-".into()
                } else {
                    report
                        .kept
                        .iter()
                        .map(|k| format!("{} ({:?})", k.name, k.reason))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            );
        }
        return Ok(());
    }
    admin::purge_expired(
        store.dyn_store().as_ref(),
        config.retention.delivered,
        config.retention.dead,
        config.retention.batch_size,
        args.json,
    )
    .await
}

async fn config_check(db: DbArgs, as_json: bool) -> anyhow::Result<()> {
    let mut config = db.load(vec![])?;
    // Check every destination's sink as `outbox relay` builds it, without contacting any
    // broker, so the check refuses what the relay would refuse.
    sinks::check(&config).await?;
    config.database.url = outbox_postgresql::redact_url(&config.database.url);
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
