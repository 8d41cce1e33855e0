//! `outbox-verify`: run the correctness harness and exit non-zero on any violation.
//!
//! Exit codes: 0 every check passed; 1 a violation was found (see the summary and the JSON
//! report); 2 the harness itself could not run (bad options, a service missing).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use outbox_verify::harness::{self, Options, Profile};

#[derive(Clone, Copy, ValueEnum)]
enum ProfileArg {
    Short,
    Long,
    Load,
}

#[derive(Parser)]
#[command(
    name = "outbox-verify",
    about = "Kill, cut and overload writers, relays and brokers; prove nothing is lost, nothing rolled back is sent, order holds and effects happen once."
)]
struct Cli {
    /// `short` (~2 min, CI), `long` (30 min, thousands of faults), `load` (no faults, max rate).
    #[arg(long, value_enum, default_value_t = ProfileArg::Short)]
    profile: ProfileArg,
    /// Seed of the fault schedule and the writers' choices (printed; pass it to replay).
    #[arg(long)]
    seed: Option<u64>,
    /// The `outbox` binary (default: next to this one, or $OUTBOX_BIN).
    #[arg(long)]
    outbox_bin: Option<PathBuf>,
    /// Directory for the run's files (default: a new directory under the system temp dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Where the JSON report goes (default: <work dir>/report.json).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Use this database for the outbox instead of a throwaway cluster (no restarts then).
    #[arg(long)]
    database_url: Option<String>,
    /// The consumer's database (inbox and effects tables go in a schema of their own).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    consumer_url: String,
    /// Comma-separated destinations: file, nats, webhook, kafka (default: all four; the load
    /// profile leaves Kafka out).
    #[arg(long, value_delimiter = ',')]
    destinations: Option<Vec<String>>,
    /// Relay mode: `poll` or `wal` (logical replication).
    #[arg(long)]
    mode: Option<String>,
    /// Relay processes (1–3).
    #[arg(long)]
    relays: Option<usize>,
    /// Concurrent writers.
    #[arg(long)]
    writers: Option<u32>,
    /// Aggregates per destination the writers spread their events over.
    #[arg(long)]
    aggregates: Option<u32>,
    /// Transactions per second per writer; 0 = as fast as possible.
    #[arg(long)]
    rate: Option<f64>,
    /// How long writers run, e.g. `90s`, `30m`.
    #[arg(long)]
    duration: Option<String>,
    /// Faults of each kind.
    #[arg(long)]
    faults_per_kind: Option<u32>,
    /// One outage of one destination this long, e.g. `30s` (short profile), `5m` (long); `0s`
    /// for none.
    #[arg(long)]
    outage: Option<String>,
    /// Only these fault kinds, comma-separated (e.g. `kill_relay,poison`; names as in the
    /// report).
    #[arg(long, value_delimiter = ',')]
    only_faults: Option<Vec<String>>,
    /// Longest wait for the outbox to drain after the faults, e.g. `2m`.
    #[arg(long)]
    drain_timeout: Option<String>,
}

fn duration(text: &str) -> anyhow::Result<Duration> {
    outbox_types::humantime_duration::parse_duration(text)
        .map_err(|e| anyhow::anyhow!("invalid duration `{text}`: {e}"))
}

fn options(cli: Cli) -> anyhow::Result<Options> {
    let profile = match cli.profile {
        ProfileArg::Short => Profile::Short,
        ProfileArg::Long => Profile::Long,
        ProfileArg::Load => Profile::Load,
    };
    let seed = cli.seed.unwrap_or_else(rand::random);
    let bin = outbox_verify::relays::locate_outbox_bin(cli.outbox_bin.as_deref())?;
    let work = match cli.work_dir {
        Some(dir) => dir,
        None => std::env::temp_dir().join(format!(
            "outbox-verify-{}-{}",
            profile.name(),
            chrono::Utc::now().format("%Y%m%dT%H%M%S")
        )),
    };
    let mut o = Options::for_profile(profile, seed, bin, work);
    if let Some(r) = cli.report {
        o.report_path = r;
    }
    o.database_url = cli.database_url;
    o.consumer_url = cli.consumer_url;
    if let Some(d) = cli.destinations {
        o.destinations = d;
    }
    if let Some(m) = cli.mode {
        o.mode = m;
    }
    if let Some(n) = cli.relays {
        anyhow::ensure!((1..=3).contains(&n), "--relays must be 1, 2 or 3");
        o.relays = n;
    }
    if let Some(n) = cli.writers {
        anyhow::ensure!(n >= 1, "--writers must be at least 1");
        o.writers = n;
    }
    if let Some(n) = cli.aggregates {
        anyhow::ensure!(n >= 1, "--aggregates must be at least 1");
        o.aggregates = n;
    }
    if let Some(r) = cli.rate {
        anyhow::ensure!(r >= 0.0, "--rate must not be negative");
        o.rate = (r > 0.0).then_some(r);
    }
    if let Some(d) = cli.duration {
        o.duration = duration(&d)?;
    }
    if let Some(n) = cli.faults_per_kind {
        o.faults_per_kind = n;
    }
    if let Some(d) = cli.outage {
        o.outage = duration(&d)?;
    }
    if let Some(k) = cli.only_faults {
        o.only_faults = k;
    }
    if let Some(d) = cli.drain_timeout {
        o.drain_timeout = duration(&d)?;
    }
    Ok(o)
}

async fn interrupted() {
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
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OUTBOX_VERIFY_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(
                    "warn,sqlx=error,outbox_inbox=error,rdkafka=off,async_nats=error",
                )
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let options = match options(cli) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let report_path = options.report_path.clone();
    // SIGINT/SIGTERM end the run early; dropping the runtime then drops every task, which
    // kills the relay and broker processes (kill_on_drop) and stops the throwaway cluster.
    let outcome = runtime.block_on(async {
        tokio::select! {
            r = harness::run(options) => Some(r),
            _ = interrupted() => None,
        }
    });
    let Some(outcome) = outcome else {
        eprintln!("interrupted: processes stopped, no report");
        drop(runtime);
        return ExitCode::from(130);
    };
    match outcome {
        Ok(report) => {
            println!("{}", report.summary());
            println!("report: {}", report_path.display());
            if report.violations().is_empty() {
                // The database and broker stores are only worth keeping to investigate.
                for dir in ["pg", "nats"] {
                    let _ = std::fs::remove_dir_all(PathBuf::from(&report.work_dir).join(dir));
                }
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("error: the harness could not run: {e}");
            ExitCode::from(2)
        }
    }
}
