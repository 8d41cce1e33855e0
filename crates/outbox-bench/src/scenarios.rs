//! The writer-side scenarios: what enqueueing costs a business transaction (`write-overhead`),
//! and how the relay behaves while writers run at a fixed rate or flat out (`steady`).

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox_postgresql::PgStore;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};
use uuid::Uuid;

use crate::load::{self, Variant, WriterPlan};
use crate::{RelayArg, RelayKind, in_fresh_schema, median, record, schema_name, server_settings};

#[derive(clap::Args, Clone)]
pub struct WriteArgs {
    /// Concurrent writers, one connection each.
    #[arg(long, default_value_t = 16)]
    writers: usize,
    /// Seconds each variant runs per run.
    #[arg(long, default_value_t = 15)]
    seconds: u64,
    /// Event payload size in bytes.
    #[arg(long, default_value_t = 400)]
    payload_bytes: usize,
    /// Runs (medians of the rates are reported); variants are interleaved within a run, and
    /// the two compared for the library's overhead swap places every run, so keep it even.
    #[arg(long, default_value_t = 6)]
    runs: usize,
}

/// The transactions `write-overhead` compares, in the order of its figures.
const WRITE_VARIANTS: [Variant; 3] = [Variant::OrderOnly, Variant::Outbox, Variant::RawInsert];

/// Scenario 1: commits/s of the business transaction alone, with `PgOutbox::enqueue`, and with
/// a hand-written `INSERT` of the same event row.
pub async fn write_overhead(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: WriteArgs,
) -> anyhow::Result<()> {
    in_fresh_schema(url, &schema_name("write"), async |store| {
        load::create_orders(store).await?;
        let settings = server_settings(store).await?;
        println!(
            "write-overhead: {} writers, one connection each, {} s per variant, {} run(s); a transaction inserts one order row and, per variant, one {} B event; {settings}",
            args.writers,
            args.seconds,
            args.runs.max(1),
            args.payload_bytes
        );
        let rates = write_rates(store, &args).await?;
        report_write_overhead(json_out, &args, &settings, &rates)
    })
    .await
}

/// Commits/s of each of [`WRITE_VARIANTS`] in every run (indexed like it), after a warm-up.
async fn write_rates(store: &PgStore, args: &WriteArgs) -> anyhow::Result<Vec<Vec<f64>>> {
    let plan = |variant, seconds| WriterPlan {
        variant,
        writers: args.writers,
        rate: 0.0,
        duration: Duration::from_secs(seconds),
        payload_bytes: args.payload_bytes,
        record_commits: false,
    };
    // Warm-up: connections, prepared statements, the tables' first pages.
    for variant in WRITE_VARIANTS {
        load::run_writers(store, &plan(variant, 2)).await?;
    }
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); WRITE_VARIANTS.len()];
    for run in 0..args.runs.max(1) {
        // The two variants compared for the library's overhead run back to back, each going
        // first in every other run, so drift over time does not favour one of them.
        let order = if run % 2 == 0 { [1, 2, 0] } else { [2, 1, 0] };
        for i in order {
            load::reset(store).await?;
            let variant = WRITE_VARIANTS[i];
            let result = load::run_writers(store, &plan(variant, args.seconds))
                .await?
                .all_committed(variant.name())?;
            let rate = result.commits as f64 / result.seconds;
            println!(
                "  run {}: {:<20} {:>7.0} commits/s",
                run + 1,
                variant.name(),
                rate
            );
            rates[i].push(rate);
        }
    }
    Ok(rates)
}

/// Prints the medians of [`write_rates`]'s `rates` and the library's overhead, and records them.
fn report_write_overhead(
    json_out: Option<&std::path::Path>,
    args: &WriteArgs,
    settings: &str,
    rates: &[Vec<f64>],
) -> anyhow::Result<()> {
    let [alone, outbox, raw] = [0, 1, 2].map(|i| median(rates[i].clone()));
    println!();
    println!("write-overhead, median of {} run(s):", args.runs.max(1));
    println!("  {:<20} {:>9}  vs order only", "transaction", "commits/s");
    for (i, variant) in WRITE_VARIANTS.iter().enumerate() {
        let r = median(rates[i].clone());
        println!(
            "  {:<20} {:>9.0}  {:>6.1}%",
            variant.name(),
            r,
            r / alone * 100.0
        );
    }
    // Run-to-run drift on a shared 2-core machine is larger than the difference sought, so the
    // overhead is taken within each run, where the two variants ran back to back on the same
    // tables. Which of the two went first moved the result by several percent on this machine
    // (one set of runs favoured the second, another the first), so the runs where the library
    // went first and those where the raw INSERT did are averaged separately and the two
    // averages averaged: a position effect cancels.
    let per_run: Vec<f64> = rates[2]
        .iter()
        .zip(&rates[1])
        .map(|(raw, outbox)| (raw - outbox) / raw * 100.0)
        .collect();
    let mean = |xs: Vec<f64>| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    let library_first = mean(per_run.iter().step_by(2).copied().collect());
    let raw_first = mean(per_run.iter().skip(1).step_by(2).copied().collect());
    let overhead = if per_run.len() >= 2 {
        (library_first + raw_first) / 2.0
    } else {
        library_first
    };
    println!(
        "  library overhead over the hand-written INSERT: {overhead:.1}% (target ≤ 3%): {library_first:.1}% in the runs where enqueue went first, {raw_first:.1}% where the raw INSERT did (per run: {}); outbox cost over the order alone: {:.1}%",
        per_run
            .iter()
            .map(|p| format!("{p:.1}"))
            .collect::<Vec<_>>()
            .join(", "),
        (alone - outbox) / alone * 100.0
    );
    record(
        json_out,
        serde_json::json!({
            "scenario": "write-overhead", "writers": args.writers, "seconds": args.seconds,
            "payload_bytes": args.payload_bytes, "runs": args.runs, "database": settings,
            "order_only_commits_per_second": alone, "outbox_commits_per_second": outbox,
            "raw_insert_commits_per_second": raw, "library_overhead_percent": overhead,
            "library_overhead_percent_per_run": per_run,
            "per_run": {"order_only": rates[0], "outbox": rates[1], "raw_insert": rates[2]},
        }),
    )
}

/// A steady-state rate: a number of transactions per second, or as fast as the database goes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rate {
    Fixed(f64),
    Max,
}

impl Rate {
    /// Transactions per second to hold; `None` for as fast as the database goes.
    fn target(self) -> Option<f64> {
        match self {
            Rate::Fixed(r) => Some(r),
            Rate::Max => None,
        }
    }
}

fn parse_rate(s: &str) -> Result<Rate, String> {
    if s.eq_ignore_ascii_case("max") {
        return Ok(Rate::Max);
    }
    s.parse::<f64>()
        .ok()
        .filter(|r| *r > 0.0)
        .map(Rate::Fixed)
        .ok_or_else(|| format!("`{s}` is neither a positive rate nor `max`"))
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rate::Fixed(r) => write!(f, "{r:.0}/s"),
            Rate::Max => f.write_str("max"),
        }
    }
}

#[derive(clap::Args, Clone)]
pub struct SteadyArgs {
    /// Total event rates to hold (one event per transaction), comma separated; `max` = writers
    /// as fast as the database goes, measured also without the relay for the ratio.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate, default_value = "1000,5000,max")]
    rates: Vec<Rate>,
    /// The relay: ours, the seeds' naive poller, or both.
    #[arg(long, value_enum, default_value = "ours")]
    relay: RelayArg,
    /// Concurrent writers.
    #[arg(long, default_value_t = 16)]
    writers: usize,
    /// Seconds the writers run per run.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Events committed in the first seconds are left out of the latency figures.
    #[arg(long, default_value_t = 3)]
    warmup_seconds: u64,
    /// Runs per rate (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[arg(long, default_value_t = 400)]
    payload_bytes: usize,
    /// Relay batch size.
    #[arg(long, default_value_t = 500)]
    batch_size: u32,
    /// Our relay's longest pause between claims (`relay.poll_interval`), in milliseconds; the
    /// relay's default (100 ms) when absent.
    #[arg(long)]
    poll_interval_ms: Option<u64>,
    /// Our relay's pause after a short claim that found events (`relay.min_poll_interval`), in
    /// milliseconds; the relay's default (10 ms) when absent.
    #[arg(long)]
    min_poll_interval_ms: Option<u64>,
    /// Our relay's ack deletes the row instead of marking it delivered (the relay's
    /// `retention.delivered = "0s"`).
    #[arg(long)]
    delete_on_ack: bool,
    /// Longest wait for the relay to deliver what was written, after the writers stop.
    #[arg(long, default_value_t = 180)]
    drain_timeout_seconds: u64,
}

/// The relay's poll settings as the run used them.
fn poll_label(args: &SteadyArgs) -> String {
    let ms = |v: Option<u64>, default: &str| {
        v.map_or(format!("{default} (default)"), |v| format!("{v} ms"))
    };
    format!(
        "{} idle / {} busy",
        ms(args.poll_interval_ms, "100 ms"),
        ms(args.min_poll_interval_ms, "10 ms")
    )
}

/// Figures of one steady-state run.
#[derive(serde::Serialize, Clone, Debug, Default)]
struct SteadyRun {
    target_rate: Option<f64>,
    commits_per_second: f64,
    /// Writers' commit rate with no relay running (rate `max` only).
    commits_per_second_without_relay: Option<f64>,
    events: u64,
    late_transactions: u64,
    latency_ms_p50: f64,
    latency_ms_p95: f64,
    latency_ms_p99: f64,
    latency_ms_max: f64,
    measured_events: u64,
    undelivered: u64,
    backlog_max: u64,
    /// Largest backlog in the first and in the second half of the writing.
    backlog_max_first_half: u64,
    backlog_max_second_half: u64,
    backlog_at_stop: u64,
    drain_after_stop_seconds: f64,
    relay_cpu_us_per_event: f64,
    /// PostgreSQL's CPU (all its processes) while the writers ran, per committed event: the
    /// writers' and the relay's work together.
    postgres_cpu_us_per_event: f64,
    relay_peak_rss_mb: f64,
    relay_rss_mb_first: f64,
    relay_rss_mb_last: f64,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn rss_mb(pid: u32) -> Option<f64> {
    crate::status_kb(&pid.to_string(), "VmRSS").map(|kb| kb as f64 / 1024.0)
}

async fn backlog(store: &PgStore) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE status IN ('pending', 'in_flight')",
        store.outbox().qualified_table()
    )))
    .fetch_one(store.pool())
    .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Scenario 3: writers at fixed rates with the relay running; commit → sink ack latency,
/// backlog, relay CPU and memory; at `max`, the writers' rate with and without the relay.
pub async fn steady(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: SteadyArgs,
) -> anyhow::Result<()> {
    let schema = schema_name("steady");
    let settings =
        in_fresh_schema(url, &schema, async |probe| server_settings(probe).await).await?;
    println!(
        "steady: {} writers, one {} B event per transaction (order row + enqueue), {} s per run after which the relay drains what is left, {} run(s) per rate; relay batch {}, poll interval {} (ours{}) / idle sleep 5 s (naive); sink: in-process channel; latency = sink ack − COMMIT returned, events of the first {} s left out; {settings}",
        args.writers,
        args.payload_bytes,
        args.seconds,
        args.runs.max(1),
        args.batch_size,
        poll_label(&args),
        if args.delete_on_ack {
            ", acks delete the rows"
        } else {
            ""
        },
        args.warmup_seconds
    );
    let mut table = Vec::new();
    for relay in args.relay.kinds() {
        for &rate in &args.rates {
            let mut runs = Vec::new();
            for run in 0..args.runs.max(1) {
                let figures = in_fresh_schema(url, &schema, async |store| {
                    load::create_orders(store).await?;
                    steady_run(url, store, &args, relay, rate).await
                })
                .await
                .with_context(|| {
                    format!("steady {rate}, {} relay, run {}", relay.name(), run + 1)
                })?;
                print_steady_run(relay, rate, run, &figures);
                runs.push(figures);
            }
            let summary = median_run(&runs, rate);
            record(
                json_out,
                serde_json::json!({
                    "scenario": "steady", "relay": relay.name(), "rate": rate.to_string(),
                    "writers": args.writers, "seconds": args.seconds, "payload_bytes": args.payload_bytes,
                    "batch_size": args.batch_size, "poll_interval_ms": args.poll_interval_ms,
                    "min_poll_interval_ms": args.min_poll_interval_ms,
                    "runs": args.runs, "database": settings, "median": summary, "per_run": runs,
                }),
            )?;
            table.push((relay, rate, summary));
        }
    }
    print_steady_table(&args, &table);
    Ok(())
}

/// `SteadyRun { <fields given>, <each figure>: its median over $runs, <each count>: its
/// median rounded down }`: the struct literal still has to name every field.
macro_rules! steady_medians {
    (
        $runs:expr,
        { $($field:ident: $value:expr),* $(,)? },
        figures: [$($figure:ident),* $(,)?],
        counts: [$($count:ident),* $(,)?] $(,)?
    ) => {
        SteadyRun {
            $($field: $value,)*
            $($figure: median($runs.iter().map(|r| r.$figure).collect()),)*
            $($count: median($runs.iter().map(|r| r.$count as f64).collect()) as u64,)*
        }
    };
}

/// The median of each figure over `runs` at `rate` (the largest `undelivered`).
fn median_run(runs: &[SteadyRun], rate: Rate) -> SteadyRun {
    steady_medians!(
        runs,
        {
            target_rate: rate.target(),
            commits_per_second_without_relay: (rate == Rate::Max).then(|| {
                median(
                    runs.iter()
                        .map(|r| r.commits_per_second_without_relay.unwrap_or(0.0))
                        .collect(),
                )
            }),
            undelivered: runs.iter().map(|r| r.undelivered).max().unwrap_or(0),
        },
        figures: [
            commits_per_second,
            latency_ms_p50,
            latency_ms_p95,
            latency_ms_p99,
            latency_ms_max,
            drain_after_stop_seconds,
            relay_cpu_us_per_event,
            postgres_cpu_us_per_event,
            relay_peak_rss_mb,
            relay_rss_mb_first,
            relay_rss_mb_last,
        ],
        counts: [
            events,
            late_transactions,
            measured_events,
            backlog_max,
            backlog_max_first_half,
            backlog_max_second_half,
            backlog_at_stop,
        ],
    )
}

/// The medians of every relay and rate as one table, and ours against the naive relay.
fn print_steady_table(args: &SteadyArgs, table: &[(RelayKind, Rate, SteadyRun)]) {
    println!();
    println!(
        "steady state, median of {} run(s) ({} writers, in-process sink):",
        args.runs.max(1),
        args.writers
    );
    println!(
        "{:<6} {:>7} {:>9} {:>8} {:>8} {:>8} {:>9} {:>11} {:>9} {:>8} {:>7} {:>8}",
        "relay",
        "rate",
        "commits/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "max ms",
        "backlog max",
        "bounded",
        "µs/event",
        "RSS MB",
        "PG µs/ev"
    );
    for (relay, rate, s) in table {
        println!(
            "{:<6} {:>7} {:>9.0} {:>8.2} {:>8.2} {:>8.2} {:>9.1} {:>11} {:>9} {:>8.1} {:>7.1} {:>8.1}",
            relay.name(),
            rate.to_string(),
            s.commits_per_second,
            s.latency_ms_p50,
            s.latency_ms_p95,
            s.latency_ms_p99,
            s.latency_ms_max,
            s.backlog_max,
            if bounded(s) { "yes" } else { "NO" },
            s.relay_cpu_us_per_event,
            s.relay_peak_rss_mb,
            s.postgres_cpu_us_per_event,
        );
        if let Some(alone) = s.commits_per_second_without_relay
            && alone > 0.0
        {
            println!(
                "       writers flat out: {:.0} commits/s without the relay, {:.0} with it: {:.1}% (target ≥ 85%)",
                alone,
                s.commits_per_second,
                s.commits_per_second / alone * 100.0
            );
        }
    }
    for rate in &args.rates {
        let find = |k| {
            table
                .iter()
                .find(|(r, q, _)| *r == k && q == rate)
                .map(|(_, _, s)| s)
        };
        if let (Some(ours), Some(naive)) = (find(RelayKind::Ours), find(RelayKind::Naive))
            && ours.latency_ms_p99 > 0.0
        {
            println!(
                "at {rate}: naive p99 {:.1} ms vs ours {:.2} ms ({:.0}x); naive backlog max {} vs ours {}",
                naive.latency_ms_p99,
                ours.latency_ms_p99,
                naive.latency_ms_p99 / ours.latency_ms_p99,
                naive.backlog_max,
                ours.backlog_max
            );
        }
    }
    println!(
        "(bounded: the largest backlog of the second half of the writing is at most 1.5x that of the first half plus one second of writes, and everything was delivered.)"
    );
}

/// Backlog bounded: it did not keep growing over the run, and everything got delivered.
fn bounded(s: &SteadyRun) -> bool {
    let one_second = s.commits_per_second;
    s.undelivered == 0
        && (s.backlog_max_second_half as f64) <= 1.5 * s.backlog_max_first_half as f64 + one_second
}

fn print_steady_run(relay: RelayKind, rate: Rate, run: usize, r: &SteadyRun) {
    println!(
        "  {} {rate} run {}: {:.0} commits/s{}, latency p50 {:.2} / p95 {:.2} / p99 {:.2} / max {:.1} ms over {} events, {} undelivered; backlog max {} (halves {} → {}), {} at stop, drained {:.1} s later; relay {:.1} µs CPU/event, PostgreSQL {:.1} µs CPU/event, RSS {:.1} → {:.1} MB (peak {:.1})",
        relay.name(),
        run + 1,
        r.commits_per_second,
        r.commits_per_second_without_relay
            .map(|a| format!(" ({a:.0} without the relay)"))
            .unwrap_or_default(),
        r.latency_ms_p50,
        r.latency_ms_p95,
        r.latency_ms_p99,
        r.latency_ms_max,
        r.measured_events,
        r.undelivered,
        r.backlog_max,
        r.backlog_max_first_half,
        r.backlog_max_second_half,
        r.backlog_at_stop,
        r.drain_after_stop_seconds,
        r.relay_cpu_us_per_event,
        r.postgres_cpu_us_per_event,
        r.relay_rss_mb_first,
        r.relay_rss_mb_last,
        r.relay_peak_rss_mb,
    );
}

/// One steady run on `store`, whose outbox and orders are empty.
async fn steady_run(
    url: &str,
    store: &PgStore,
    args: &SteadyArgs,
    relay: RelayKind,
    rate: Rate,
) -> anyhow::Result<SteadyRun> {
    let plan = WriterPlan {
        variant: Variant::Outbox,
        writers: args.writers,
        // 0: as fast as they go.
        rate: rate.target().unwrap_or(0.0),
        duration: Duration::from_secs(args.seconds),
        payload_bytes: args.payload_bytes,
        record_commits: true,
    };
    let mut figures = SteadyRun::default();
    if rate == Rate::Max {
        // The same writers with no relay: the rate the relay's presence is compared with.
        let alone = load::run_writers(
            store,
            &WriterPlan {
                record_commits: false,
                ..plan.clone()
            },
        )
        .await?;
        figures.commits_per_second_without_relay = Some(alone.commits as f64 / alone.seconds);
        load::reset(store).await?;
    }

    let acks_file = std::env::temp_dir().join(format!("{}.acks", store.outbox().schema()));
    let RelayChild {
        mut child,
        pid,
        stdin,
        mut stdout,
    } = start_relay_child(url, store, args, relay, &acks_file).await?;

    // Backlog and relay RSS once a second while the writers run.
    let (sampling, sampler) = sample_backlog_and_rss(store, pid);
    let postgres = crate::writer_cost::postgres_cpu(store.pool()).await?;
    let postgres_before = postgres.seconds()?;
    let writing_started = crate::load::now_micros();
    let writers = load::run_writers(store, &plan).await?;
    let postgres_seconds = postgres.seconds()? - postgres_before;
    sampling.store(false, Ordering::Relaxed);
    let samples = sampler.await?;
    let writers = writers.all_committed("writers")?;
    figures.backlog_at_stop = backlog(store).await?;
    let stopped = Instant::now();
    let timeout = Duration::from_secs(args.drain_timeout_seconds);
    while backlog(store).await? > 0 && stopped.elapsed() < timeout {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    figures.drain_after_stop_seconds = stopped.elapsed().as_secs_f64();
    drop(stdin);
    let mut out = Vec::new();
    stdout.read_to_end(&mut out).await?;
    let status = child.wait().await?;
    if !status.success() {
        bail!("relay child failed: {status:?}");
    }
    let report = crate::parse_child_report(&out)?;
    let acks = load::read_acks(&acks_file)?;
    let _ = std::fs::remove_file(&acks_file);

    let warm_until = writing_started + i64::try_from(args.warmup_seconds).unwrap_or(0) * 1_000_000;
    let (latencies, undelivered) = commit_to_ack_ms(&writers.committed_at, &acks, warm_until);
    figures.undelivered = undelivered;
    figures.target_rate = rate.target();
    figures.commits_per_second = writers.commits as f64 / writers.seconds;
    figures.postgres_cpu_us_per_event = postgres_seconds / writers.commits.max(1) as f64 * 1e6;
    figures.events = writers.commits;
    figures.late_transactions = writers.late;
    figures.measured_events = latencies.len() as u64;
    figures.latency_ms_p50 = percentile(&latencies, 0.50);
    figures.latency_ms_p95 = percentile(&latencies, 0.95);
    figures.latency_ms_p99 = percentile(&latencies, 0.99);
    figures.latency_ms_max = latencies.last().copied().unwrap_or(0.0);
    backlog_figures(&mut figures, &samples, args.seconds as f64 / 2.0);
    figures.relay_peak_rss_mb = report.peak_rss_kb as f64 / 1024.0;
    figures.relay_cpu_us_per_event = if report.delivered > 0 {
        report.cpu_seconds / report.delivered as f64 * 1e6
    } else {
        0.0
    };
    Ok(figures)
}

/// The relay child of a steady run, ready: it said READY on stdout.
struct RelayChild {
    child: tokio::process::Child,
    pid: u32,
    /// Closing it stops the child.
    stdin: tokio::process::ChildStdin,
    /// Its report comes here once it stopped.
    stdout: tokio::io::BufReader<tokio::process::ChildStdout>,
}

/// Starts `relay-child` on this run's schema; it records each ack in `acks_file`.
async fn start_relay_child(
    url: &str,
    store: &PgStore,
    args: &SteadyArgs,
    relay: RelayKind,
    acks_file: &std::path::Path,
) -> anyhow::Result<RelayChild> {
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args(["--database-url", url, "relay-child"])
        .args(["--schema", store.outbox().schema(), "--expect", "0"])
        .args(["--batch-size", &args.batch_size.to_string()])
        .args(["--batches-in-flight", "1", "--sink", "channel"])
        .args(["--relay", relay.name()])
        .args(
            args.poll_interval_ms
                .iter()
                .flat_map(|ms| ["--poll-interval-ms".to_owned(), ms.to_string()]),
        )
        .args(
            args.min_poll_interval_ms
                .iter()
                .flat_map(|ms| ["--min-poll-interval-ms".to_owned(), ms.to_string()]),
        )
        .args((args.delete_on_ack && relay == RelayKind::Ours).then_some("--delete-on-ack"))
        .arg("--until-stdin-eof")
        .arg("--record-acks")
        .arg(acks_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().context("relay child pid")?;
    let stdin = child.stdin.take().context("relay child stdin")?;
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().context("relay child stdout")?);
    let mut first = String::new();
    tokio::time::timeout(Duration::from_secs(30), stdout.read_line(&mut first))
        .await
        .context("the relay child did not get ready within 30 s")??;
    if first.trim() != "READY" {
        bail!("the relay child said `{}` instead of READY", first.trim());
    }
    Ok(RelayChild {
        child,
        pid,
        stdin,
        stdout,
    })
}

/// Seconds since the sampling started, backlog, relay RSS in MB.
type Sample = (f64, u64, f64);

/// A [`Sample`] once a second until the returned flag is cleared.
fn sample_backlog_and_rss(
    store: &PgStore,
    pid: u32,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<Vec<Sample>>) {
    let sampling = Arc::new(AtomicBool::new(true));
    let store = store.clone();
    let flag = sampling.clone();
    let sampler = tokio::spawn(async move {
        let mut samples: Vec<Sample> = Vec::new();
        let started = Instant::now();
        while flag.load(Ordering::Relaxed) {
            let b = backlog(&store).await.unwrap_or(0);
            let rss = rss_mb(pid).unwrap_or(0.0);
            samples.push((started.elapsed().as_secs_f64(), b, rss));
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        samples
    });
    (sampling, sampler)
}

/// Commit → ack latencies in ms, sorted, of the events committed from `warm_until` (µs since
/// the epoch) on; and how many committed events were never acked.
fn commit_to_ack_ms(
    committed_at: &HashMap<Uuid, i64>,
    acks: &HashMap<Uuid, i64>,
    warm_until: i64,
) -> (Vec<f64>, u64) {
    let mut undelivered = 0;
    let mut latencies = Vec::with_capacity(committed_at.len());
    for (id, committed) in committed_at {
        match acks.get(id) {
            Some(acked) if *committed >= warm_until => {
                latencies.push((acked - committed) as f64 / 1000.0);
            }
            Some(_) => {}
            None => undelivered += 1,
        }
    }
    latencies.sort_by(|a, b| a.total_cmp(b));
    (latencies, undelivered)
}

/// The backlog's maximum over the whole writing, each half of it, and the relay's RSS at the
/// first and last sample.
fn backlog_figures(figures: &mut SteadyRun, samples: &[Sample], half: f64) {
    figures.backlog_max = samples.iter().map(|s| s.1).max().unwrap_or(0);
    figures.backlog_max_first_half = samples
        .iter()
        .filter(|s| s.0 < half)
        .map(|s| s.1)
        .max()
        .unwrap_or(0);
    figures.backlog_max_second_half = samples
        .iter()
        .filter(|s| s.0 >= half)
        .map(|s| s.1)
        .max()
        .unwrap_or(0);
    figures.relay_rss_mb_first = samples.first().map(|s| s.2).unwrap_or(0.0);
    figures.relay_rss_mb_last = samples.last().map(|s| s.2).unwrap_or(0.0);
}
