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

mod destination;
mod load;
mod naive;
mod scenarios;
mod timing;
mod writer_cost;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use destination::{Destination, Endpoints, SinkKind};
use outbox_engine::{Relay, RelayConfig};
use outbox_postgresql::{PgOutbox, PgStore};
use outbox_types::{DeadLetterPolicy, NewEvent, Sink, Store};
use serde::{Deserialize, Serialize};
use timing::{Percentiles, PublishStats, StoreStats, TimedSink, TimedStore};

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

/// `--sink`: one destination, or all of them in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SinkArg {
    Channel,
    Nats,
    Kafka,
    Rabbitmq,
    Redis,
    Webhook,
    /// Every sink in turn, then a table.
    All,
}

impl SinkArg {
    fn kinds(self) -> Vec<SinkKind> {
        match self {
            SinkArg::Channel => vec![SinkKind::Channel],
            SinkArg::Nats => vec![SinkKind::Nats],
            SinkArg::Kafka => vec![SinkKind::Kafka],
            SinkArg::Rabbitmq => vec![SinkKind::Rabbitmq],
            SinkArg::Redis => vec![SinkKind::Redis],
            SinkArg::Webhook => vec![SinkKind::Webhook],
            SinkArg::All => SinkKind::ALL.to_vec(),
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

fn schema_name(tag: &str) -> String {
    format!("outbox_bench_{tag}_{}", std::process::id())
}

async fn fresh(url: &str, schema: &str) -> anyhow::Result<PgStore> {
    let store = PgStore::connect(url, PgOutbox::with_names(schema, "events")?).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(store.pool())
    .await?;
    store.outbox().migrate(store.pool()).await?;
    Ok(store)
}

async fn drop_schema(store: &PgStore) -> anyhow::Result<()> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        store.outbox().schema()
    )))
    .execute(store.pool())
    .await?;
    Ok(())
}

fn payload(bytes: usize, aggregate: u64, n: u64) -> serde_json::Value {
    let head = format!("{{\"aggregate\":{aggregate},\"n\":{n},\"pad\":\"\"}}");
    let pad = bytes.saturating_sub(head.len());
    serde_json::json!({ "aggregate": aggregate, "n": n, "pad": "x".repeat(pad) })
}

async fn fill(
    store: &PgStore,
    events: u64,
    aggregates: u64,
    payload_bytes: usize,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut batch = Vec::with_capacity(5000);
    for i in 0..events {
        let aggregate = i % aggregates;
        batch.push(NewEvent::new(
            "order",
            aggregate.to_string(),
            "OrderUpdated",
            &payload(payload_bytes, aggregate, i / aggregates),
        )?);
        if batch.len() == 5000 || i + 1 == events {
            let mut tx = store.pool().begin().await?;
            store.outbox().enqueue_batch(&mut *tx, &batch).await?;
            tx.commit().await?;
            batch.clear();
        }
    }
    Ok(started.elapsed().as_secs_f64())
}

async fn server_settings(store: &PgStore) -> anyhow::Result<String> {
    let mut parts = Vec::new();
    for name in [
        "server_version",
        "synchronous_commit",
        "shared_buffers",
        "fsync",
        // Off on the shared development server: dead row versions then go only through
        // on-access pruning and killed index entries, which slows claims on long runs.
        "autovacuum",
        "max_wal_size",
    ] {
        let v: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {name}")))
            .fetch_one(store.pool())
            .await?;
        parts.push(format!("{name}={v}"));
    }
    Ok(parts.join(" "))
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

/// Figures of one drain run.
#[derive(Serialize, Debug, Clone)]
struct RunFigures {
    events_per_second: f64,
    seconds: f64,
    relay_cpu_us_per_event: f64,
    relay_peak_rss_mb: f64,
    connect_ms: f64,
    publish_calls: u64,
    events_per_call: f64,
    /// Latency of one `publish` call (one wave: at most one event per aggregate).
    publish_call_ms: Percentiles,
    /// Latency of the call that carried each event.
    publish_event_ms: Percentiles,
    first_call_ms: f64,
    /// Sums of claim / publish / ack durations over the drain's wall time.
    claim_share: f64,
    publish_share: f64,
    ack_share: f64,
    claims: u64,
    empty_claims: u64,
    retried: u64,
    dead: u64,
    released: u64,
    /// What the destination held afterwards (distinct event ids for the webhook).
    destination_received: Option<u64>,
    destination_duplicates: Option<u64>,
    enqueue_events_per_second: f64,
}

/// One sink's result over all runs.
struct SinkSummary {
    kind: SinkKind,
    relay: RelayKind,
    detail: String,
    sink_config: serde_json::Value,
    settings: String,
    runs: Vec<RunFigures>,
}

impl SinkSummary {
    fn median_of(&self, f: impl Fn(&RunFigures) -> f64) -> f64 {
        median(self.runs.iter().map(f).collect())
    }
}

async fn drain(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: DrainArgs,
) -> anyhow::Result<()> {
    let endpoints = args.endpoints()?;
    let kinds = args.sink.kinds();
    let relays = args.relay.kinds();
    let mut results: Vec<(SinkKind, Result<SinkSummary, String>)> = Vec::new();
    for &kind in &kinds {
        let mut rates = Vec::new();
        for &relay in &relays {
            match drain_sink(url, &args, &endpoints, kind, relay).await {
                Ok(summary) => {
                    print_summary(&args, &summary);
                    record(json_out, summary_json(&args, &summary))?;
                    rates.push(summary.median_of(|r| r.events_per_second));
                    if relay == RelayKind::Ours {
                        results.push((kind, Ok(summary)));
                    }
                }
                Err(error) if kinds.len() > 1 || relays.len() > 1 => {
                    eprintln!(
                        "drain --sink {kind} --relay {} failed: {error:#}",
                        relay.name()
                    );
                    if relay == RelayKind::Ours {
                        results.push((kind, Err(format!("{error:#}"))));
                    }
                }
                Err(error) => return Err(error.context(format!("drain --sink {kind}"))),
            }
        }
        if let [ours, naive] = rates[..]
            && naive > 0.0
        {
            println!(
                "drain --sink {kind}: ours {ours:.0} events/s vs the naive baseline {naive:.0} events/s: {:.1}x",
                ours / naive
            );
            record(
                json_out,
                serde_json::json!({"scenario": "drain-vs-baseline", "sink": kind.name(), "events": args.events,
                    "ours_events_per_second": ours, "naive_events_per_second": naive, "ratio": ours / naive}),
            )?;
        }
    }
    if kinds.len() > 1 && relays.contains(&RelayKind::Ours) {
        print_table(&args, &results);
        if results.iter().any(|(_, r)| r.is_err()) {
            bail!("some sinks failed; see above");
        }
    }
    Ok(())
}

async fn drain_sink(
    url: &str,
    args: &DrainArgs,
    endpoints: &Endpoints,
    kind: SinkKind,
    relay: RelayKind,
) -> anyhow::Result<SinkSummary> {
    let schema = schema_name(&format!("drain_{kind}"));
    let mut summary = SinkSummary {
        kind,
        relay,
        detail: String::new(),
        sink_config: serde_json::Value::Null,
        settings: String::new(),
        runs: Vec::new(),
    };
    println!(
        "drain --sink {kind} --relay {}: {} events of {} B over {} aggregates, batch {}, {} batch(es) in flight, {} run(s)",
        relay.name(),
        args.events,
        args.payload_bytes,
        args.aggregates,
        args.batch_size,
        args.batches_in_flight,
        args.runs.max(1)
    );
    for run in 0..args.runs.max(1) {
        let store = fresh(url, &schema).await?;
        let result = drain_run(url, &store, args, endpoints, kind, run, &mut summary).await;
        let dropped = drop_schema(&store).await;
        let figures = result.with_context(|| format!("run {}", run + 1))?;
        dropped?;
        print_run(run, &figures);
        summary.runs.push(figures);
    }
    Ok(summary)
}

async fn drain_run(
    url: &str,
    store: &PgStore,
    args: &DrainArgs,
    endpoints: &Endpoints,
    kind: SinkKind,
    run: usize,
    summary: &mut SinkSummary,
) -> anyhow::Result<RunFigures> {
    summary.settings = server_settings(store).await?;
    let fill_secs = fill(store, args.events, args.aggregates, args.payload_bytes).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "VACUUM ANALYZE {}",
        store.outbox().qualified_table()
    )))
    .execute(store.pool())
    .await?;

    let name = format!("outbox_bench_{kind}_{}_{}", std::process::id(), run + 1);
    let mut destination = Destination::prepare(kind, endpoints, &name)
        .await
        .with_context(|| format!("preparing the {kind} destination"))?;
    summary.detail = destination.detail.clone();
    summary.sink_config = destination.sink_config.clone();
    let outcome = run_child(
        url,
        store.outbox().schema(),
        args,
        kind,
        summary.relay,
        &destination,
    )
    .await;
    let received = match &outcome {
        Ok(_) => destination.received(args.events).await,
        Err(_) => Ok(None),
    };
    let duplicates = destination.duplicates();
    let cleaned = destination.cleanup().await;
    let report = outcome?;
    let received = received.with_context(|| format!("counting what {kind} received"))?;
    cleaned.with_context(|| format!("cleaning up the {kind} destination"))?;

    if report.delivered < args.events {
        bail!(
            "the relay delivered {} of {} events (retried {}, dead {}, released {}); first failure: {}",
            report.delivered,
            args.events,
            report.relay.retried,
            report.relay.dead,
            report.relay.released,
            report.publish.first_failure.as_deref().unwrap_or("none")
        );
    }
    let stats = store.stats().await?;
    // The naive relay deletes what it sent; ours marks it delivered, or deletes it too.
    let complete = match summary.relay {
        RelayKind::Ours if args.delete_on_ack => {
            stats.pending == 0 && stats.in_flight == 0 && stats.delivered == 0
        }
        RelayKind::Ours => stats.delivered == args.events,
        RelayKind::Naive => stats.pending == 0 && stats.in_flight == 0,
    };
    if !complete {
        bail!("drain incomplete: {stats:?}");
    }
    if let Some(n) = received
        && n < args.events
    {
        bail!(
            "silent loss: the relay and PostgreSQL count {} delivered, but the {kind} destination holds only {n}",
            args.events
        );
    }

    let delivered = report.delivered as f64;
    let share = |secs: f64| {
        if report.seconds > 0.0 {
            secs / report.seconds
        } else {
            0.0
        }
    };
    Ok(RunFigures {
        events_per_second: delivered / report.seconds,
        seconds: report.seconds,
        relay_cpu_us_per_event: report.cpu_seconds / delivered * 1e6,
        relay_peak_rss_mb: report.peak_rss_kb as f64 / 1024.0,
        connect_ms: report.connect_seconds * 1e3,
        publish_calls: report.publish.calls,
        events_per_call: if report.publish.calls > 0 {
            report.publish.events as f64 / report.publish.calls as f64
        } else {
            0.0
        },
        publish_call_ms: report.publish.per_call,
        publish_event_ms: report.publish.per_event,
        first_call_ms: report.publish.first_call_ms,
        claim_share: share(report.store.claim_seconds),
        publish_share: share(report.publish.seconds_total),
        ack_share: share(report.store.ack_seconds),
        claims: report.store.claims,
        empty_claims: report.store.empty_claims,
        retried: report.relay.retried,
        dead: report.relay.dead,
        released: report.relay.released,
        destination_received: received,
        destination_duplicates: duplicates,
        enqueue_events_per_second: args.events as f64 / fill_secs,
    })
}

async fn run_child(
    url: &str,
    schema: &str,
    args: &DrainArgs,
    kind: SinkKind,
    relay: RelayKind,
    destination: &Destination,
) -> anyhow::Result<ChildReport> {
    let exe = std::env::current_exe()?;
    let output = tokio::process::Command::new(exe)
        .args(["--database-url", url, "relay-child", "--schema", schema])
        .args([
            "--expect",
            &args.events.to_string(),
            "--batch-size",
            &args.batch_size.to_string(),
        ])
        .args(["--batches-in-flight", &args.batches_in_flight.to_string()])
        .args(["--sink", kind.name(), "--relay", relay.name()])
        .args(["--poll-interval-ms", &args.poll_interval_ms.to_string()])
        .args([
            "--sink-config",
            &serde_json::to_string(&destination.sink_config)?,
        ])
        .args(args.delete_on_ack.then_some("--delete-on-ack"))
        .stderr(Stdio::inherit())
        .output()
        .await?;
    if !output.status.success() {
        bail!("relay child failed: {:?}", output.status);
    }
    parse_child_report(&output.stdout)
}

/// The relay child's report: the last line of its standard output (the first is `READY`).
fn parse_child_report(stdout: &[u8]) -> anyhow::Result<ChildReport> {
    let text = String::from_utf8_lossy(stdout);
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .context("the relay child printed no report")?;
    serde_json::from_str(last).context("relay child output")
}

fn print_run(run: usize, f: &RunFigures) {
    println!(
        "  run {}: {:>8.0} events/s in {:.2} s, relay CPU {:.1} µs/event, peak RSS {:.1} MB; {} publish calls of {:.0} events, call p50 {:.1} / p99 {:.1} / max {:.1} ms, first {:.1} ms",
        run + 1,
        f.events_per_second,
        f.seconds,
        f.relay_cpu_us_per_event,
        f.relay_peak_rss_mb,
        f.publish_calls,
        f.events_per_call,
        f.publish_call_ms.p50_ms,
        f.publish_call_ms.p99_ms,
        f.publish_call_ms.max_ms,
        f.first_call_ms,
    );
    println!(
        "         time in claim {:.0}% ({} claims, {} empty), publish {:.0}%, ack {:.0}%; connect {:.0} ms (not timed); destination holds {}",
        f.claim_share * 100.0,
        f.claims,
        f.empty_claims,
        f.publish_share * 100.0,
        f.ack_share * 100.0,
        f.connect_ms,
        f.destination_received
            .map(|n| n.to_string())
            .unwrap_or_else(|| "(counted by the relay)".into()),
    );
}

fn print_summary(args: &DrainArgs, s: &SinkSummary) {
    let kind = s.kind;
    println!();
    println!(
        "drain  PostgreSQL -> {kind}, {} relay{}  ({} events of {} B over {} aggregates, batch {}, {} batch(es) in flight; relay on the bare sink, no router; {})",
        s.relay.name(),
        if args.delete_on_ack && s.relay == RelayKind::Ours {
            ", acks delete the rows"
        } else {
            ""
        },
        args.events,
        args.payload_bytes,
        args.aggregates,
        args.batch_size,
        args.batches_in_flight,
        s.settings
    );
    println!("  destination: {}", s.detail);
    if kind != SinkKind::Channel {
        println!("  sink config: {}", s.sink_config);
    }
    let target = kind
        .target()
        .map(|t| format!(" (issue 3 target ≥ {t:.0})"))
        .unwrap_or_default();
    println!(
        "  median of {} run(s): {:.0} events/s{target}, relay CPU {:.1} µs/event, peak relay RSS {:.1} MB",
        s.runs.len(),
        s.median_of(|r| r.events_per_second),
        s.median_of(|r| r.relay_cpu_us_per_event),
        s.median_of(|r| r.relay_peak_rss_mb),
    );
    println!(
        "  publish latency per call (one call = one wave of at most one event per aggregate; {:.0} events per call here): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        s.median_of(|r| r.events_per_call),
        s.median_of(|r| r.publish_call_ms.p50_ms),
        s.median_of(|r| r.publish_call_ms.p99_ms),
        s.median_of(|r| r.publish_call_ms.max_ms),
    );
    println!(
        "  publish latency per event (estimated: the latency of the call that carried it): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        s.median_of(|r| r.publish_event_ms.p50_ms),
        s.median_of(|r| r.publish_event_ms.p99_ms),
        s.median_of(|r| r.publish_event_ms.max_ms),
    );
    println!(
        "  relay wall time in claim {:.0}%, publish {:.0}%, ack {:.0}% (sums of call durations over the drain's wall time; batches in flight overlap)",
        s.median_of(|r| r.claim_share) * 100.0,
        s.median_of(|r| r.publish_share) * 100.0,
        s.median_of(|r| r.ack_share) * 100.0,
    );
    let retried: u64 = s.runs.iter().map(|r| r.retried).sum();
    let dup: u64 = s.runs.iter().filter_map(|r| r.destination_duplicates).sum();
    println!(
        "  checked: PostgreSQL {} all {}{}; relay retried {retried}{}",
        if args.delete_on_ack || s.relay == RelayKind::Naive {
            "no longer holds"
        } else {
            "marks delivered"
        },
        args.events,
        if kind == SinkKind::Channel {
            String::new()
        } else {
            format!(", the destination held ≥ {} in every run", args.events)
        },
        if dup > 0 {
            format!(", {dup} duplicate requests")
        } else {
            String::new()
        },
    );
    println!(
        "  (backlog written with enqueue_batch of 5000 per transaction at {:.0} events/s)",
        s.median_of(|r| r.enqueue_events_per_second)
    );
    println!();
}

fn summary_json(args: &DrainArgs, s: &SinkSummary) -> serde_json::Value {
    serde_json::json!({
        "scenario": "drain", "sink": s.kind.name(), "relay": s.relay.name(), "destination": s.detail,
        "sink_config": s.sink_config,
        "events": args.events, "aggregates": args.aggregates, "payload_bytes": args.payload_bytes,
        "batch_size": args.batch_size, "batches_in_flight": args.batches_in_flight,
        "delete_on_ack": args.delete_on_ack, "runs": args.runs, "database": s.settings,
        "target_events_per_second": s.kind.target(),
        "events_per_second_median": s.median_of(|r| r.events_per_second),
        "relay_cpu_seconds_per_10k_median": s.median_of(|r| r.relay_cpu_us_per_event) / 100.0,
        "relay_cpu_us_per_event_median": s.median_of(|r| r.relay_cpu_us_per_event),
        "relay_peak_rss_mb_median": s.median_of(|r| r.relay_peak_rss_mb),
        "publish_call_ms_p50_median": s.median_of(|r| r.publish_call_ms.p50_ms),
        "publish_call_ms_p99_median": s.median_of(|r| r.publish_call_ms.p99_ms),
        "publish_call_ms_max_median": s.median_of(|r| r.publish_call_ms.max_ms),
        "publish_event_ms_p50_median": s.median_of(|r| r.publish_event_ms.p50_ms),
        "publish_event_ms_p99_median": s.median_of(|r| r.publish_event_ms.p99_ms),
        "events_per_publish_call_median": s.median_of(|r| r.events_per_call),
        "enqueue_events_per_second_median": s.median_of(|r| r.enqueue_events_per_second),
        "per_run": s.runs,
    })
}

fn print_table(args: &DrainArgs, results: &[(SinkKind, Result<SinkSummary, String>)]) {
    println!(
        "drain, every sink: {} events of {} B over {} aggregates, batch {}, {} batch(es) in flight, median of {} run(s)",
        args.events,
        args.payload_bytes,
        args.aggregates,
        args.batch_size,
        args.batches_in_flight,
        args.runs.max(1)
    );
    println!(
        "{:<9} {:>9} {:>8} {:>9} {:>7} {:>11} {:>11} {:>11}  {:<17}",
        "sink",
        "events/s",
        "target",
        "µs/event",
        "RSS MB",
        "call p50 ms",
        "call p99 ms",
        "event p99",
        "claim/pub/ack %"
    );
    for (kind, result) in results {
        let target = kind
            .target()
            .map(|t| format!("{t:.0}"))
            .unwrap_or_else(|| "-".into());
        match result {
            Ok(s) => {
                let rate = s.median_of(|r| r.events_per_second);
                let mark = match kind.target() {
                    Some(t) if rate < t => "↓",
                    Some(_) => "✓",
                    None => " ",
                };
                println!(
                    "{:<9} {:>8.0}{mark} {:>8} {:>9.1} {:>7.1} {:>11.2} {:>11.2} {:>11.2}  {:.0}/{:.0}/{:.0}",
                    kind.name(),
                    rate,
                    target,
                    s.median_of(|r| r.relay_cpu_us_per_event),
                    s.median_of(|r| r.relay_peak_rss_mb),
                    s.median_of(|r| r.publish_call_ms.p50_ms),
                    s.median_of(|r| r.publish_call_ms.p99_ms),
                    s.median_of(|r| r.publish_event_ms.p99_ms),
                    s.median_of(|r| r.claim_share) * 100.0,
                    s.median_of(|r| r.publish_share) * 100.0,
                    s.median_of(|r| r.ack_share) * 100.0,
                );
            }
            Err(error) => {
                let short: String = error.chars().take(90).collect();
                println!("{:<9} FAILED: {short}", kind.name());
            }
        }
    }
    println!(
        "(✓/↓: at or below issue 3's target; figures from a busy machine mean nothing. Latency: one publish call = one wave of at most one event per aggregate.)"
    );
}

async fn relay_child(url: &str, args: ChildArgs) -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OUTBOX_BENCH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let pg = Arc::new(
        PgStore::connect(url, PgOutbox::with_names(&args.schema, "events")?)
            .await?
            .with_delete_on_ack(args.delete_on_ack),
    );
    let store = Arc::new(TimedStore::new(pg.clone()));
    let mut consumer = None;
    let inner: Arc<dyn Sink> = match args.sink {
        SinkKind::Channel => {
            let (sink, mut rx) =
                outbox_sink_channel::ChannelSink::new(args.batch_size as usize * 4);
            consumer = Some(tokio::spawn(async move {
                let mut n = 0u64;
                while rx.recv().await.is_some() {
                    n += 1;
                }
                n
            }));
            Arc::new(sink)
        }
        kind => destination::build_sink(kind, &args.sink_config).await?,
    };
    // Connection set-up happens before the clock starts: it is not what a drain measures.
    let connect_started = Instant::now();
    let mut last_error = None;
    while connect_started.elapsed() < Duration::from_secs(15) {
        match inner.check().await {
            Ok(()) => {
                last_error = None;
                break;
            }
            Err(e) => {
                last_error = Some(e.to_string());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    if let Some(error) = last_error {
        bail!("the {} sink is not ready: {error}", args.sink);
    }
    let connect_seconds = connect_started.elapsed().as_secs_f64();
    let stamp = args
        .record_acks
        .as_ref()
        .map(|_| Arc::new(load::AckStampSink::new(inner.clone())));
    let stamped: Arc<dyn Sink> = match &stamp {
        Some(s) => s.clone(),
        None => inner,
    };
    let sink = Arc::new(TimedSink::new(stamped));
    // Steady state: the parent closes our standard input when its writers are done and the
    // outbox is drained. Otherwise the relay stops on its own when nothing is left.
    let until_eof = args.until_stdin_eof;
    let shutdown = async move {
        if until_eof {
            use tokio::io::AsyncReadExt;
            let mut sink = Vec::new();
            let _ = tokio::io::stdin().read_to_end(&mut sink).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    // The parent starts its writers once this line arrives.
    println!("READY");

    let config = RelayConfig {
        relay_id: "bench".into(),
        batch_size: args.batch_size,
        max_batches_in_flight: args.batches_in_flight,
        poll_interval: args
            .poll_interval_ms
            .map(Duration::from_millis)
            .unwrap_or(RelayConfig::default().poll_interval),
        min_poll_interval: args
            .min_poll_interval_ms
            .map(Duration::from_millis)
            .unwrap_or(RelayConfig::default().min_poll_interval),
        dead_letter: DeadLetterPolicy::Block,
        stop_when_idle: !until_eof,
        ..RelayConfig::default()
    };
    let cpu_before = cpu_snapshot();
    let cpu_ticks_before = cpu_ticks_seconds()?;
    let started = Instant::now();
    let report = match args.relay {
        RelayKind::Ours => {
            let relay = Relay::new(store.clone(), sink.clone(), config);
            relay.run(shutdown).await
        }
        RelayKind::Naive => {
            let naive = naive::run(
                &pg,
                sink.clone(),
                (!until_eof).then_some(args.expect),
                Duration::from_millis(args.idle_sleep_ms),
                shutdown,
            )
            .await?;
            outbox_engine::RelayReport {
                delivered: naive.delivered,
                retried: naive.failed,
                batches: naive.passes,
                ..Default::default()
            }
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds_since(&cpu_before, cpu_ticks_before)?;
    if let Some(consumer) = consumer {
        consumer.abort();
    }
    if let (Some(stamp), Some(path)) = (&stamp, &args.record_acks) {
        stamp.write_to(path)?;
    }
    if !until_eof && report.delivered < args.expect {
        eprintln!(
            "relay child: delivered {} of {} ({report:?})",
            report.delivered, args.expect
        );
    }
    let out = ChildReport {
        delivered: report.delivered,
        seconds,
        cpu_seconds: cpu,
        peak_rss_kb: peak_rss_kb()?,
        connect_seconds,
        relay: RelayCounts {
            batches: report.batches,
            claimed: report.claimed,
            retried: report.retried,
            dead: report.dead,
            released: report.released,
            fenced: report.fenced,
            store_errors: report.store_errors,
        },
        publish: sink.stats(),
        store: store.stats(),
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// CPU time of this process's threads so far: nanoseconds on the CPU per thread id, from
/// `/proc/self/task/*/schedstat`; empty where the kernel does not provide it.
fn cpu_snapshot() -> std::collections::HashMap<String, u64> {
    let mut threads = std::collections::HashMap::new();
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
                continue;
            };
            if let Some(Ok(nanos)) = text.split_whitespace().next().map(str::parse::<u64>) {
                threads.insert(task.file_name().to_string_lossy().into_owned(), nanos);
            }
        }
    }
    threads
}

/// CPU seconds this process used since `before` (a [`cpu_snapshot`]) and `before_ticks` (a
/// [`cpu_ticks_seconds`]): per-thread nanoseconds where available (threads that exited in
/// between are lost, so call it while the relay and its sink are alive), else user + system
/// time in clock ticks of 1/100 s, too coarse for short runs.
fn cpu_seconds_since(
    before: &std::collections::HashMap<String, u64>,
    before_ticks: f64,
) -> anyhow::Result<f64> {
    let now = cpu_snapshot();
    if before.is_empty() || now.is_empty() {
        return Ok(cpu_ticks_seconds()? - before_ticks);
    }
    let nanos: u64 = now
        .iter()
        .map(|(tid, n)| n.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    Ok(nanos as f64 / 1e9)
}

/// User + system CPU time of this process, from /proc (clock ticks of 1/100 s).
fn cpu_ticks_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the full line: 12 and 13 after the comm.
    let utime: f64 = fields.get(11).context("utime")?.parse()?;
    let stime: f64 = fields.get(12).context("stime")?.parse()?;
    Ok((utime + stime) / 100.0)
}

fn peak_rss_kb() -> anyhow::Result<u64> {
    status_kb("self", "VmHWM").context("VmHWM in /proc/self/status")
}

/// A `kB` field (`VmRSS`, `VmHWM`, …) of `/proc/<pid>/status`.
fn status_kb(pid: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Claim + ack one batch at a time until nothing is pending: (claim ms per batch, claim+ack ms
/// per batch, events/s).
async fn claim_drain(
    store: &PgStore,
    batch_size: u32,
) -> anyhow::Result<(Vec<f64>, Vec<f64>, f64)> {
    let request = outbox_types::ClaimRequest {
        owner: "bench".into(),
        limit: batch_size,
        lease: Duration::from_secs(30),
        dead_letter: DeadLetterPolicy::Block,
        hold: None,
        max_batch_bytes: u64::MAX,
        max_payload_bytes: u64::MAX,
        up_to_seq: None,
    };
    let mut claim_ms = Vec::new();
    let mut cycle_ms = Vec::new();
    let started = Instant::now();
    let mut drained = 0u64;
    loop {
        let t0 = Instant::now();
        let claim = store.claim(&request).await?;
        let t1 = Instant::now();
        if claim.events.is_empty() {
            break;
        }
        let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
        store.ack(&claim.lease, &seqs).await?;
        claim_ms.push((t1 - t0).as_secs_f64() * 1000.0);
        cycle_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
        drained += seqs.len() as u64;
    }
    Ok((
        claim_ms,
        cycle_ms,
        drained as f64 / started.elapsed().as_secs_f64(),
    ))
}

fn p99(xs: &[f64]) -> f64 {
    let mut sorted = xs.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    sorted
        .get(((sorted.len() as f64) * 0.99) as usize)
        .copied()
        .unwrap_or(0.0)
}

async fn claim_latency(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: ClaimArgs,
) -> anyhow::Result<()> {
    let schema = schema_name("claim");
    let mut rows = Vec::new();
    println!(
        "claim-latency: {} pending events of 400 B over 1000 aggregates claimed and acked {} at a time, one after the other, on top of a delivered history of {:?} rows",
        args.pending, args.batch_size, args.delivered
    );
    for &delivered in &args.delivered {
        let store = fresh(url, &schema).await?;
        let t = store.outbox().qualified_table().to_owned();
        // History: delivered rows, written directly (this measures the claim, not the writer).
        let history_started = Instant::now();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, status, delivered_at)
             SELECT gen_random_uuid(), 'order', (g % 1000)::text, 'OrderUpdated',
                    json_build_object('n', g, 'pad', repeat('x', 380)), 'delivered', now()
             FROM generate_series(1, $1) AS g"
        )))
        .bind(delivered as i64)
        .execute(store.pool())
        .await?;
        fill(&store, args.pending, 1000, 400).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {t}")))
            .execute(store.pool())
            .await?;
        let size: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT pg_size_pretty(pg_total_relation_size('{t}'))"
        )))
        .fetch_one(store.pool())
        .await?;
        let (claim_ms, cycle_ms, rate) = claim_drain(&store, args.batch_size).await?;
        println!(
            "delivered history {:>9} ({size}, written in {:.0} s): claim of {} median {:.2} ms, p99 {:.2} ms; claim+ack cycle median {:.2} ms; serial drain {:.0} events/s",
            delivered,
            history_started.elapsed().as_secs_f64(),
            args.batch_size,
            median(claim_ms.clone()),
            p99(&claim_ms),
            median(cycle_ms.clone()),
            rate
        );
        let mut row = serde_json::json!({
            "delivered_rows": delivered, "table_size": size,
            "claim_ms_median": median(claim_ms.clone()), "claim_ms_p99": p99(&claim_ms),
            "cycle_ms_median": median(cycle_ms), "serial_drain_events_per_second": rate,
        });

        if args.held_snapshot_rounds > 0 {
            // A transaction that took its snapshot and stays open: nothing newer than it can be
            // vacuumed, so every claim and ack below leaves dead versions in the indexes.
            let mut holder = store.pool().acquire().await?;
            sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut *holder)
                .await?;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {t} WHERE false"
            )))
            .execute(&mut *holder)
            .await?;
            let mut last = (Vec::new(), Vec::new(), 0.0);
            for _ in 0..args.held_snapshot_rounds {
                fill(&store, args.pending, 1000, 400).await?;
                last = claim_drain(&store, args.batch_size).await?;
            }
            // Each event leaves two versions behind that the snapshot pins: the claim's and the
            // ack's (the statistics collector reports them too late to read here).
            let dead = u64::from(args.held_snapshot_rounds) * args.pending * 2;
            sqlx::query("ROLLBACK").execute(&mut *holder).await?;
            let (held_claim, held_cycle, held_rate) = last;
            let slowdown = median(held_claim.clone()) / median(claim_ms).max(1e-9);
            println!(
                "  with a transaction held open over {} rounds of {} events ({dead} dead row versions it pins): last round's claim median {:.2} ms ({slowdown:.2}x), p99 {:.2} ms; cycle {:.2} ms; serial drain {:.0} events/s",
                args.held_snapshot_rounds,
                args.pending,
                median(held_claim.clone()),
                p99(&held_claim),
                median(held_cycle.clone()),
                held_rate
            );
            row["held_snapshot"] = serde_json::json!({
                "rounds": args.held_snapshot_rounds, "dead_tuples": dead,
                "claim_ms_median": median(held_claim.clone()), "claim_ms_p99": p99(&held_claim),
                "cycle_ms_median": median(held_cycle), "serial_drain_events_per_second": held_rate,
                "slowdown": slowdown,
            });
        }
        rows.push(row);
        drop_schema(&store).await?;
    }
    if rows.len() >= 2 {
        let first = rows[0]["claim_ms_median"].as_f64().unwrap_or(0.0);
        let last = rows[rows.len() - 1]["claim_ms_median"]
            .as_f64()
            .unwrap_or(0.0);
        let first_rate = rows[0]["serial_drain_events_per_second"]
            .as_f64()
            .unwrap_or(0.0);
        let last_rate = rows[rows.len() - 1]["serial_drain_events_per_second"]
            .as_f64()
            .unwrap_or(0.0);
        if first > 0.0 && last_rate > 0.0 {
            println!(
                "slowdown from the smallest to the largest history: median claim {:.2}x, drain rate {:.2}x (target ≤ 1.25x)",
                last / first,
                first_rate / last_rate
            );
        }
    }
    record(
        json_out,
        serde_json::json!({"scenario": "claim-latency", "pending": args.pending, "batch_size": args.batch_size, "rows": rows}),
    )
}
