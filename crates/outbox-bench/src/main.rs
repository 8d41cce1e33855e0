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
//! cargo run --release -p outbox-bench -- claim-latency --delivered 10000,1000000
//! ```

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use outbox_core::{DeadLetterPolicy, NewEvent, Store};
use outbox_postgres::{PgOutbox, PgStore};
use outbox_relay::{Relay, RelayConfig};
use serde::{Deserialize, Serialize};

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
    /// Drain a backlog from PostgreSQL to the in-process sink: events/s, relay CPU, peak RSS.
    Drain(DrainArgs),
    /// Claim+ack latency of one batch with a small backlog, at several sizes of delivered
    /// history: shows whether claim cost grows with delivered rows.
    ClaimLatency(ClaimArgs),
    /// Internal: run a relay until the outbox is drained and print its own figures.
    #[command(hide = true)]
    RelayChild(ChildArgs),
}

#[derive(clap::Args, Clone)]
struct DrainArgs {
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
    /// Batches published concurrently.
    #[arg(long, default_value_t = 1)]
    batches_in_flight: usize,
    /// Runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
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
}

/// What the relay child reports about itself.
#[derive(Serialize, Deserialize, Debug)]
struct ChildReport {
    delivered: u64,
    seconds: f64,
    cpu_seconds: f64,
    peak_rss_kb: u64,
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
            Command::RelayChild(args) => relay_child(&cli.database_url, args).await,
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

async fn drain(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: DrainArgs,
) -> anyhow::Result<()> {
    let schema = schema_name("drain");
    let mut rates = Vec::new();
    let mut cpu_per_10k = Vec::new();
    let mut rss = Vec::new();
    let mut fill_rates = Vec::new();
    let mut settings = String::new();
    for run in 0..args.runs.max(1) {
        let store = fresh(url, &schema).await?;
        settings = server_settings(&store).await?;
        let fill_secs = fill(&store, args.events, args.aggregates, args.payload_bytes).await?;
        fill_rates.push(args.events as f64 / fill_secs);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "VACUUM ANALYZE {}",
            store.outbox().qualified_table()
        )))
        .execute(store.pool())
        .await?;
        let exe = std::env::current_exe()?;
        let output = tokio::process::Command::new(exe)
            .args(["--database-url", url, "relay-child", "--schema", &schema])
            .args([
                "--expect",
                &args.events.to_string(),
                "--batch-size",
                &args.batch_size.to_string(),
            ])
            .args(["--batches-in-flight", &args.batches_in_flight.to_string()])
            .stderr(Stdio::inherit())
            .output()
            .await?;
        if !output.status.success() {
            bail!("relay child failed: {:?}", output.status);
        }
        let report: ChildReport =
            serde_json::from_slice(&output.stdout).context("relay child output")?;
        let stats = store.stats().await?;
        if stats.delivered != args.events {
            bail!("drain incomplete: {stats:?}");
        }
        let rate = report.delivered as f64 / report.seconds;
        println!(
            "run {}: {:>9.0} events/s  cpu {:.3} s/10k events  peak RSS {:.1} MB",
            run + 1,
            rate,
            report.cpu_seconds / report.delivered as f64 * 10_000.0,
            report.peak_rss_kb as f64 / 1024.0
        );
        rates.push(rate);
        cpu_per_10k.push(report.cpu_seconds / report.delivered as f64 * 10_000.0);
        rss.push(report.peak_rss_kb as f64 / 1024.0);
        drop_schema(&store).await?;
    }
    let summary = serde_json::json!({
        "scenario": "drain", "sink": "in-process channel",
        "events": args.events, "aggregates": args.aggregates, "payload_bytes": args.payload_bytes,
        "batch_size": args.batch_size, "batches_in_flight": args.batches_in_flight, "runs": args.runs,
        "database": settings,
        "events_per_second_median": median(rates.clone()),
        "relay_cpu_seconds_per_10k_median": median(cpu_per_10k.clone()),
        "relay_peak_rss_mb_median": median(rss.clone()),
        "enqueue_events_per_second_median": median(fill_rates.clone()),
    });
    println!();
    println!(
        "drain  PostgreSQL -> in-process sink  ({} events of {} B over {} aggregates, batch {}, {} batches in flight; {settings})",
        args.events, args.payload_bytes, args.aggregates, args.batch_size, args.batches_in_flight
    );
    println!(
        "  median of {} runs: {:.0} events/s, relay CPU {:.3} s per 10k events ({:.1} µs/event), peak relay RSS {:.1} MB",
        args.runs,
        median(rates),
        median(cpu_per_10k.clone()),
        median(cpu_per_10k) * 100.0,
        median(rss)
    );
    println!(
        "  (backlog written with enqueue_batch of 5000 per transaction at {:.0} events/s)",
        median(fill_rates)
    );
    record(json_out, summary)
}

async fn relay_child(url: &str, args: ChildArgs) -> anyhow::Result<()> {
    let store =
        Arc::new(PgStore::connect(url, PgOutbox::with_names(&args.schema, "events")?).await?);
    let (sink, mut rx) = outbox_sink_channel::ChannelSink::new(args.batch_size as usize * 4);
    let consumer = tokio::spawn(async move {
        let mut n = 0u64;
        while rx.recv().await.is_some() {
            n += 1;
        }
        n
    });
    let config = RelayConfig {
        relay_id: "bench".into(),
        batch_size: args.batch_size,
        max_batches_in_flight: args.batches_in_flight,
        poll_interval: Duration::from_millis(5),
        dead_letter: DeadLetterPolicy::Block,
        stop_when_idle: true,
        ..RelayConfig::default()
    };
    let cpu_before = cpu_seconds()?;
    let started = Instant::now();
    let relay = Relay::new(store.clone(), Arc::new(sink), config);
    let report = relay.run(std::future::pending()).await;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds()? - cpu_before;
    consumer.abort();
    if report.delivered < args.expect {
        bail!(
            "relay child delivered {} of {}",
            report.delivered,
            args.expect
        );
    }
    let out = ChildReport {
        delivered: report.delivered,
        seconds,
        cpu_seconds: cpu,
        peak_rss_kb: peak_rss_kb()?,
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// User + system CPU time of this process, from /proc (clock ticks of 1/100 s).
fn cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the full line: 12 and 13 after the comm.
    let utime: f64 = fields.get(11).context("utime")?.parse()?;
    let stime: f64 = fields.get(12).context("stime")?.parse()?;
    Ok((utime + stime) / 100.0)
}

fn peak_rss_kb() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .context("VmHWM")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("VmHWM value")?
        .parse()?)
}

async fn claim_latency(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: ClaimArgs,
) -> anyhow::Result<()> {
    let schema = schema_name("claim");
    let mut rows = Vec::new();
    for &delivered in &args.delivered {
        let store = fresh(url, &schema).await?;
        let t = store.outbox().qualified_table().to_owned();
        // History: delivered rows, written directly (this measures the claim, not the writer).
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
        let request = outbox_core::ClaimRequest {
            owner: "bench".into(),
            limit: args.batch_size,
            lease: Duration::from_secs(30),
            dead_letter: DeadLetterPolicy::Block,
            hold: None,
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
        let rate = drained as f64 / started.elapsed().as_secs_f64();
        let mut sorted = claim_ms.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let p99 = sorted
            .get(((sorted.len() as f64) * 0.99) as usize)
            .copied()
            .unwrap_or(0.0);
        println!(
            "delivered history {:>9}: claim of {} median {:.2} ms, p99 {:.2} ms; claim+ack cycle median {:.2} ms; serial drain {:.0} events/s",
            delivered,
            args.batch_size,
            median(claim_ms.clone()),
            p99,
            median(cycle_ms.clone()),
            rate
        );
        rows.push(serde_json::json!({
            "delivered_rows": delivered, "claim_ms_median": median(claim_ms), "claim_ms_p99": p99,
            "cycle_ms_median": median(cycle_ms), "serial_drain_events_per_second": rate,
        }));
        drop_schema(&store).await?;
    }
    if rows.len() >= 2 {
        let first = rows[0]["claim_ms_median"].as_f64().unwrap_or(0.0);
        let last = rows[rows.len() - 1]["claim_ms_median"]
            .as_f64()
            .unwrap_or(0.0);
        if first > 0.0 {
            println!(
                "slowdown of the median claim from the smallest to the largest history: {:.2}x",
                last / first
            );
        }
    }
    record(
        json_out,
        serde_json::json!({"scenario": "claim-latency", "pending": args.pending, "batch_size": args.batch_size, "rows": rows}),
    )
}
