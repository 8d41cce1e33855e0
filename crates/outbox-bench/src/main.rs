//! `outbox-bench`: reproducible figures for the README and the issue notes.
//!
//! Every scenario prints its workload (event size, aggregates, batch size, database settings)
//! next to its figures, a median over `--runs` runs, and appends a JSON record to
//! `--json-out` when given. The relay always runs in a separate process (this binary re-executed
//! with the hidden `relay-child` command) so its CPU time and peak RSS are its own, not the
//! load generator's.
//!
//! ```text
//! cargo run --release -p outbox-bench -- drain --events 100000
//! cargo run --release -p outbox-bench -- drain --sink nats --events 100000
//! cargo run --release -p outbox-bench -- drain --sink all --json-out drain.jsonl
//! cargo run --release -p outbox-bench -- claim-latency --delivered 10000,1000000
//! cargo run --release -p outbox-bench -- --database-url "$(scripts/pg-logical.sh url)" writer-cost --relay both
//! cargo run --release -p outbox-bench -- steady --rates 500,2000
//! ```
//!
//! `drain --sink nats|kafka|rabbitmq|redis|webhook` drains the same backlog through the real
//! relay into the real broker: the parent prepares the destination (stream, topic, exchange +
//! durable queue, stream key, or a local HTTP receiver), the relay child builds the sink from
//! the configuration struct `outbox relay` reads and times every `publish` call, and the parent
//! then checks the destination holds at least as many messages as events were drained and
//! deletes what it created.

mod claim;
mod database;
mod destination;
mod drain;
mod load;
mod naive;
mod proc_stats;
mod relay_child;
mod scenarios;
mod timing;
mod writer_cost;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use destination::{Destination, Endpoints, SinkKind};
use outbox_engine::{Relay, RelayConfig};
use outbox_postgresql::{PgOutbox, PgStore};
use outbox_types::{DeadLetterPolicy, Sink, Store};
use serde::{Deserialize, Serialize};
use timing::{Percentiles, PublishStats, StoreStats, TimedSink, TimedSource};

use claim::*;
use database::*;
use drain::*;
use proc_stats::*;
use relay_child::*;

#[derive(Parser)]
#[command(name = "outbox-bench", about = "Outbox benchmarks")]
struct Cli {
    /// PostgreSQL to benchmark against.
    #[arg(
        long,
        env = "OUTBOX_BENCH_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test",
        global = true
    )]
    database_url: String,
    /// Append results as JSON lines to this file.
    #[arg(long, global = true)]
    json_out: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Drain a backlog from PostgreSQL through the relay into a sink (the in-process channel, or
    /// a real broker with `--sink`): events/s, relay CPU, peak RSS, publish latency.
    Drain(DrainArgs),
    /// Claim+ack latency of one batch with a small backlog, at several sizes of delivered
    /// history: shows whether claim cost grows with delivered rows.
    ClaimLatency(ClaimArgs),
    /// Commits/s of a business transaction alone, with `enqueue`, and with a hand-written
    /// INSERT of the same event: the outbox's cost and the library's overhead over raw SQL.
    WriteOverhead(scenarios::WriteArgs),
    /// pgbench-style: business transactions/s with an event written by hand into a table with
    /// only a primary key, by `enqueue` (with and without each index), and as a logical message;
    /// optionally with our WAL relay delivering beside the writers.
    WriterCost(writer_cost::WriterCostArgs),
    /// Writers at fixed rates (and flat out) with the relay running: commit → ack latency,
    /// backlog, relay CPU and RSS; `--relay both` adds the naive baseline.
    Steady(scenarios::SteadyArgs),
    /// Internal: run a relay until the outbox is drained and print its own figures.
    #[command(hide = true)]
    RelayChild(ChildArgs),
    /// Internal: run the WAL relay beside `writer-cost`'s writers until stdin closes.
    #[command(hide = true)]
    WalRelayChild(writer_cost::WalChildArgs),
}

/// `--sink`: one destination, or all of them in turn (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SinkArg(Option<SinkKind>);

impl SinkArg {
    fn kinds(self) -> Vec<SinkKind> {
        self.0
            .map_or_else(|| SinkKind::value_variants().to_vec(), |kind| vec![kind])
    }
}

/// The values of `--sink` are those of [`SinkKind`] and `all`, so that a new destination is
/// listed in one place only.
impl ValueEnum for SinkArg {
    fn value_variants<'a>() -> &'a [Self] {
        static VARIANTS: std::sync::OnceLock<Vec<SinkArg>> = std::sync::OnceLock::new();
        VARIANTS.get_or_init(|| {
            SinkKind::value_variants()
                .iter()
                .copied()
                .map(Some)
                .chain([None])
                .map(SinkArg)
                .collect()
        })
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        match self.0 {
            Some(kind) => kind.to_possible_value(),
            None => Some(
                clap::builder::PossibleValue::new("all").help("Every sink in turn, then a table"),
            ),
        }
    }
}

#[derive(clap::Args, Clone)]
struct DrainArgs {
    /// Where the relay publishes: the in-process channel (the relay's own cost), a real broker,
    /// or `all` of them in turn.
    #[arg(long, value_enum, default_value = "channel")]
    sink: SinkArg,
    /// The relay: ours, the seeds' naive poller, or both (then the ratio is printed).
    #[arg(long, value_enum, default_value = "ours")]
    relay: RelayArg,
    /// Our relay's pause after a short claim, in milliseconds.
    #[arg(long, default_value_t = 5)]
    poll_interval_ms: u64,
    /// Backlog size.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Distinct aggregates the events are spread over.
    #[arg(long, default_value_t = 1000)]
    aggregates: u64,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 400)]
    payload_bytes: usize,
    /// Relay batch size.
    #[arg(long, default_value_t = 1000)]
    batch_size: u32,
    /// Batches published concurrently (the relay's `max_batches_in_flight`).
    #[arg(long, alias = "max-batches-in-flight", default_value_t = 1)]
    batches_in_flight: usize,
    /// Our relay's ack deletes the row instead of marking it delivered (the relay's
    /// `retention.delivered = "0s"`).
    #[arg(long)]
    delete_on_ack: bool,
    /// Runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Requests in flight of the webhook sink (`concurrency`).
    #[arg(long, default_value_t = 64)]
    webhook_concurrency: usize,
    /// Partitions of the Kafka topic the bench creates.
    #[arg(long, default_value_t = 3)]
    kafka_partitions: i32,
    /// NATS server with JetStream.
    #[arg(
        long,
        env = "OUTBOX_BENCH_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// Kafka bootstrap brokers (`scripts/kafka.sh` starts tansu on 127.0.0.1:19092).
    #[arg(
        long,
        env = "OUTBOX_BENCH_KAFKA_BROKERS",
        default_value = "127.0.0.1:19092"
    )]
    kafka_brokers: String,
    /// RabbitMQ.
    #[arg(
        long,
        env = "OUTBOX_BENCH_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Redis.
    #[arg(
        long,
        env = "OUTBOX_BENCH_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// Set a field of the sink's configuration (as in the `outbox` config file), e.g.
    /// `--sink-set linger=1ms` (Kafka) or `--sink-set persistent=false` (RabbitMQ). Repeatable;
    /// the value is read as JSON when it is JSON, else as a string.
    #[arg(long = "sink-set", value_name = "KEY=VALUE")]
    sink_set: Vec<String>,
}

impl DrainArgs {
    fn endpoints(&self) -> anyhow::Result<Endpoints> {
        Ok(Endpoints {
            nats_url: self.nats_url.clone(),
            kafka_brokers: self.kafka_brokers.clone(),
            kafka_partitions: self.kafka_partitions,
            amqp_url: self.amqp_url.clone(),
            redis_url: self.redis_url.clone(),
            webhook_concurrency: self.webhook_concurrency.max(1),
            overrides: self
                .sink_set
                .iter()
                .map(|s| destination::parse_override(s))
                .collect::<anyhow::Result<_>>()?,
        })
    }
}

#[derive(clap::Args, Clone)]
struct ClaimArgs {
    /// Delivered-history sizes to compare, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "10000,1000000")]
    delivered: Vec<u64>,
    /// Pending backlog during the measurement.
    #[arg(long, default_value_t = 20_000)]
    pending: u64,
    /// Batch size per claim.
    #[arg(long, default_value_t = 500)]
    batch_size: u32,
    /// Also measure with a long-running transaction held open (a snapshot that keeps every
    /// row version the claims and acks leave behind from being vacuumed), over this many
    /// rounds of filling and draining the pending backlog; 0 = skip.
    #[arg(long, default_value_t = 5)]
    held_snapshot_rounds: u32,
}

#[derive(clap::Args, Clone)]
struct ChildArgs {
    #[arg(long)]
    schema: String,
    #[arg(long)]
    expect: u64,
    #[arg(long)]
    batch_size: u32,
    #[arg(long)]
    batches_in_flight: usize,
    #[arg(long, value_enum, default_value = "channel")]
    sink: SinkKind,
    /// The sink's configuration, JSON of its crate's config struct.
    #[arg(long, default_value = "{}")]
    sink_config: String,
    /// Which relay runs: ours, or the seeds' naive poller (the baseline).
    #[arg(long, value_enum, default_value = "ours")]
    relay: RelayKind,
    /// Our relay's longest pause between claims (`relay.poll_interval`); its default when absent.
    #[arg(long)]
    poll_interval_ms: Option<u64>,
    /// Our relay's pause after a short claim that found events (`relay.min_poll_interval`); its
    /// default when absent.
    #[arg(long)]
    min_poll_interval_ms: Option<u64>,
    /// The naive relay's sleep when nothing is pending (the seeds' five seconds).
    #[arg(long, default_value_t = 5000)]
    idle_sleep_ms: u64,
    /// Run until standard input closes instead of until the outbox is drained (steady state).
    #[arg(long)]
    until_stdin_eof: bool,
    /// Write `event-id micros` for every acknowledged event to this file at the end.
    #[arg(long)]
    record_acks: Option<std::path::PathBuf>,
    /// Acks delete the rows (`PgStore::with_delete_on_ack`).
    #[arg(long)]
    delete_on_ack: bool,
}

/// The relay under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RelayKind {
    /// This project's relay (`outbox_engine::Relay`).
    Ours,
    /// The seeds' naive poller: select all pending, send one at a time, delete, sleep 5 s.
    Naive,
}

impl RelayKind {
    fn name(self) -> &'static str {
        match self {
            RelayKind::Ours => "ours",
            RelayKind::Naive => "naive",
        }
    }
}

/// `--relay`: one relay, or ours and then the baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum RelayArg {
    Ours,
    Naive,
    /// Ours, then the naive baseline, and the ratio.
    Both,
}

impl RelayArg {
    fn kinds(self) -> Vec<RelayKind> {
        match self {
            RelayArg::Ours => vec![RelayKind::Ours],
            RelayArg::Naive => vec![RelayKind::Naive],
            RelayArg::Both => vec![RelayKind::Ours, RelayKind::Naive],
        }
    }
}

/// What the relay child reports about itself.
#[derive(Serialize, Deserialize, Debug)]
struct ChildReport {
    delivered: u64,
    /// Wall time of the drain (connecting to the broker excluded).
    seconds: f64,
    cpu_seconds: f64,
    peak_rss_kb: u64,
    /// Time until the sink's readiness check passed (connection set-up), before the clock.
    connect_seconds: f64,
    relay: RelayCounts,
    publish: PublishStats,
    store: StoreStats,
}

/// The relay's own report (`outbox_engine::RelayReport` is not deserializable).
#[derive(Serialize, Deserialize, Debug, Default)]
struct RelayCounts {
    batches: u64,
    claimed: u64,
    retried: u64,
    dead: u64,
    released: u64,
    fenced: u64,
    store_errors: u64,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        match cli.command {
            Command::Drain(args) => drain(&cli.database_url, cli.json_out.as_deref(), args).await,
            Command::ClaimLatency(args) => {
                claim_latency(&cli.database_url, cli.json_out.as_deref(), args).await
            }
            Command::WriteOverhead(args) => {
                scenarios::write_overhead(&cli.database_url, cli.json_out.as_deref(), args).await
            }
            Command::Steady(args) => {
                scenarios::steady(&cli.database_url, cli.json_out.as_deref(), args).await
            }
            Command::WriterCost(args) => {
                writer_cost::writer_cost(&cli.database_url, cli.json_out.as_deref(), args).await
            }
            Command::RelayChild(args) => relay_child(&cli.database_url, args).await,
            Command::WalRelayChild(args) => writer_cost::wal_relay_child(args).await,
        }
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    if xs.is_empty() { 0.0 } else { xs[xs.len() / 2] }
}

fn record(json_out: Option<&std::path::Path>, value: serde_json::Value) -> anyhow::Result<()> {
    if let Some(path) = json_out {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        writeln!(f, "{value}")?;
    }
    Ok(())
}
