//! `writer-cost`: what writing an event costs the service's own transactions, pgbench-style.
//!
//! The database is the one resource a user cannot scale by adding relays, so the figure that
//! matters is how many business transactions per second the primary still commits with the
//! outbox in them. Every writer holds one connection and runs, as fast as the server lets it,
//! transactions of one small business `UPDATE` (a random row of a 10,000-row `accounts` table)
//! and, per variant, one event:
//!
//! | variant | the event |
//! |---|---|
//! | `business-only` | none: the ceiling |
//! | `pk-only` | a hand-written `INSERT` into Debezium's documented outbox table (`id uuid PRIMARY KEY`, `aggregatetype`, `aggregateid`, `type`, `payload jsonb`): the floor any table outbox pays |
//! | `enqueue` | `PgOutbox::enqueue` into our table with every index of the polling layout |
//! | `enqueue-no-open`, `enqueue-no-heads`, `enqueue-no-id` | the same with one index dropped: what that index costs |
//! | `enqueue-no-header-check` | the same without the `_header_rules` trigger: what checking headers at insert costs |
//! | `enqueue-pk-only` | the same with `_open`, `_heads` and the unique `id` index dropped |
//! | `stream-table` | `outbox_wal::enqueue_streamed`: the insert-only stream table of WAL mode |
//! | `message` | `outbox_wal::enqueue_message`: a logical message, no row |
//!
//! `--headers N` gives every event N string headers (a `traceparent` first, then `h1`, `h2`, …),
//! so the header check has members to walk; the default 0 leaves `{}`.
//!
//! Variants run interleaved in every run (the order rotates), each on freshly truncated tables
//! after a `CHECKPOINT`; ratios to `pk-only` are taken within a run and their median reported,
//! because drift between runs on a shared 2-core machine is as large as the differences sought.
//! PostgreSQL's CPU is read from `/proc` for the postmaster and its children (exited backends'
//! time is in the postmaster's `cutime`/`cstime`), so it needs the server on this machine.
//!
//! `--relay wal` runs our relay in WAL mode in a child process beside the writers (the table
//! variants through the table source, `message` through the message source; a fresh slot per
//! run), so the ratios include the relay's write-back; `--relay both` measures each variant
//! without and with it. WAL mode needs a server with `wal_level = logical`:
//! `--database-url "$(scripts/pg-logical.sh url)"`.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox_postgresql::{PgOutbox, PgStore};
use outbox_types::{NewEvent, Sink};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use uuid::Uuid;

use crate::{median, record, server_settings};

/// What a writer's transaction holds besides the business `UPDATE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WriterVariant {
    BusinessOnly,
    PkOnly,
    Enqueue,
    EnqueueNoOpen,
    EnqueueNoHeads,
    EnqueueNoId,
    EnqueueNoHeaderCheck,
    EnqueuePkOnly,
    StreamTable,
    Message,
}

impl WriterVariant {
    fn name(self) -> &'static str {
        match self {
            WriterVariant::BusinessOnly => "business-only",
            WriterVariant::PkOnly => "pk-only",
            WriterVariant::Enqueue => "enqueue",
            WriterVariant::EnqueueNoOpen => "enqueue-no-open",
            WriterVariant::EnqueueNoHeads => "enqueue-no-heads",
            WriterVariant::EnqueueNoId => "enqueue-no-id",
            WriterVariant::EnqueueNoHeaderCheck => "enqueue-no-header-check",
            WriterVariant::EnqueuePkOnly => "enqueue-pk-only",
            WriterVariant::StreamTable => "stream-table",
            WriterVariant::Message => "message",
        }
    }

    /// The outbox table this variant enqueues into (and the WAL relay reads), if any.
    fn table(self) -> Option<&'static str> {
        match self {
            WriterVariant::BusinessOnly | WriterVariant::PkOnly => None,
            WriterVariant::Enqueue | WriterVariant::Message | WriterVariant::StreamTable => {
                Some("events")
            }
            WriterVariant::EnqueueNoOpen => Some("events_no_open"),
            WriterVariant::EnqueueNoHeads => Some("events_no_heads"),
            WriterVariant::EnqueueNoId => Some("events_no_id"),
            WriterVariant::EnqueueNoHeaderCheck => Some("events_no_hdr_check"),
            WriterVariant::EnqueuePkOnly => Some("events_pk_only"),
        }
    }

    /// Statements that drop the indexes this variant goes without (`{s}` schema, `{t}` table).
    fn drops(self) -> &'static [&'static str] {
        const OPEN: &str = r#"DROP INDEX "{s}".{t}_open"#;
        const HEADS: &str = r#"DROP INDEX "{s}".{t}_heads"#;
        const ID: &str = r#"ALTER TABLE "{s}".{t} DROP CONSTRAINT {t}_id_key"#;
        // IF EXISTS: a build from before the check measures the same table as `enqueue`.
        const HEADER_CHECK: &str = r#"DROP TRIGGER IF EXISTS {t}_header_rules ON "{s}".{t}"#;
        match self {
            WriterVariant::EnqueueNoOpen => &[OPEN],
            WriterVariant::EnqueueNoHeads => &[HEADS],
            WriterVariant::EnqueueNoId => &[ID],
            WriterVariant::EnqueueNoHeaderCheck => &[HEADER_CHECK],
            WriterVariant::EnqueuePkOnly => &[OPEN, HEADS, ID],
            _ => &[],
        }
    }
}

/// Whether our relay runs beside the writers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ConcurrentRelay {
    /// Writers alone.
    None,
    /// Our relay in WAL mode delivering concurrently (to the in-process channel sink).
    Wal,
    /// Each variant without the relay, then with it.
    Both,
}

#[derive(clap::Args, Clone)]
pub struct WriterCostArgs {
    /// Concurrent writers, one connection each.
    #[arg(long, default_value_t = 16)]
    writers: usize,
    /// Seconds each variant runs per run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Runs; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Event payload size in bytes.
    #[arg(long, default_value_t = 400)]
    payload_bytes: usize,
    /// Aggregates the events are spread over.
    #[arg(long, default_value_t = 1000)]
    aggregates: u64,
    /// String headers per event (a `traceparent`, then `h1`, `h2`, …); 0: none.
    #[arg(long, default_value_t = 0)]
    headers: usize,
    /// Variants to measure, comma separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "business-only,pk-only,enqueue,enqueue-no-open,enqueue-no-heads,enqueue-no-id,enqueue-pk-only,stream-table,message"
    )]
    variants: Vec<WriterVariant>,
    /// Our relay beside the writers.
    #[arg(long, value_enum, default_value = "none")]
    relay: ConcurrentRelay,
}

/// What one variant did in one run.
#[derive(Clone, Debug, Serialize)]
struct CostRun {
    commits_per_second: f64,
    /// PostgreSQL CPU (all its processes) per committed transaction, µs.
    postgres_cpu_us_per_commit: f64,
    /// With the relay: events it delivered during the run, and its CPU per delivered event.
    relay_delivered: Option<u64>,
    relay_cpu_us_per_event: Option<f64>,
}

const ACCOUNTS: i32 = 10_000;
const BUSINESS_UPDATE: &str =
    "UPDATE \"{s}\".accounts SET balance = balance + 1, updated_at = now() WHERE id = $1";

pub async fn writer_cost(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: WriterCostArgs,
) -> anyhow::Result<()> {
    if args.variants.is_empty() {
        bail!("--variants is empty: name at least one (e.g. --variants pk-only,enqueue)");
    }
    let schema = crate::schema_name("cost");
    crate::in_fresh_schema(url, &schema, async |store| {
        let pool = store.pool().clone();
        let postgres = postgres_cpu(&pool).await?;
        let wal_level: String = sqlx::query_scalar("SHOW wal_level")
            .fetch_one(&pool)
            .await?;
        let relay_modes: Vec<bool> = match args.relay {
            ConcurrentRelay::None => vec![false],
            ConcurrentRelay::Wal => vec![true],
            ConcurrentRelay::Both => vec![false, true],
        };
        if relay_modes.contains(&true) && wal_level != "logical" {
            bail!(
                "--relay wal needs a server with wal_level = logical (this one has `{wal_level}`): \
                 start the throwaway cluster with `scripts/pg-logical.sh start` and pass \
                 --database-url \"$(scripts/pg-logical.sh url)\""
            );
        }
        setup(store, &args).await?;
        let settings = server_settings(store).await?;
        println!(
            "writer-cost: {} writers, one connection each, {} s per variant, {} run(s); a transaction updates one of {ACCOUNTS} account rows and, per variant, writes one {} B event with {} header(s) over {} aggregates; wal_level={wal_level} {settings}",
            args.writers,
            args.seconds,
            args.runs.max(1),
            args.payload_bytes,
            args.headers,
            args.aggregates
        );
        // Warm-up: connections, the tables' first pages, the enqueue function's plan.
        for &variant in &args.variants {
            truncate(store, &args).await?;
            run_writers(store, &args, variant, Duration::from_secs(2)).await?;
        }
        let mut results: Vec<serde_json::Value> = Vec::new();
        for &with_relay in &relay_modes {
            let label = if with_relay {
                "with our WAL relay delivering"
            } else {
                "writers alone"
            };
            println!("\n{label}:");
            let n = args.variants.len();
            let mut runs: Vec<Vec<Option<CostRun>>> = vec![Vec::new(); n];
            for run in 0..args.runs.max(1) {
                for k in 0..n {
                    // The order rotates each run, so no variant always goes first.
                    let i = (k + run) % n;
                    let variant = args.variants[i];
                    truncate(store, &args).await?;
                    sqlx::query("CHECKPOINT").execute(&pool).await?;
                    if with_relay && variant.table().is_none() {
                        runs[i].push(None);
                        continue;
                    }
                    let relay = if with_relay {
                        Some(WalChild::start(url, &schema, variant, run).await?)
                    } else {
                        None
                    };
                    let cpu0 = postgres.seconds()?;
                    let (commits, seconds) =
                        run_writers(store, &args, variant, Duration::from_secs(args.seconds)).await?;
                    let cpu = postgres.seconds()? - cpu0;
                    let relay = match relay {
                        Some(child) => Some(child.stop().await?),
                        None => None,
                    };
                    let r = CostRun {
                        commits_per_second: commits as f64 / seconds,
                        postgres_cpu_us_per_commit: cpu / commits.max(1) as f64 * 1e6,
                        relay_delivered: relay.as_ref().map(|r| r.delivered),
                        relay_cpu_us_per_event: relay
                            .as_ref()
                            .map(|r| r.cpu_seconds / r.delivered.max(1) as f64 * 1e6),
                    };
                    println!(
                        "  run {}: {:<17} {:>7.0} commits/s  PostgreSQL {:>5.0} µs CPU/commit{}",
                        run + 1,
                        variant.name(),
                        r.commits_per_second,
                        r.postgres_cpu_us_per_commit,
                        match (r.relay_delivered, r.relay_cpu_us_per_event) {
                            (Some(d), Some(c)) => format!("  relay delivered {d}, {c:.1} µs CPU/event"),
                            _ => String::new(),
                        }
                    );
                    runs[i].push(Some(r));
                }
            }
            print_summary(&args, label, &runs);
            results.push(summary_json(&args, with_relay, &runs));
        }
        record(
            json_out,
            serde_json::json!({
                "scenario": "writer-cost", "writers": args.writers, "seconds": args.seconds,
                "runs": args.runs, "payload_bytes": args.payload_bytes, "aggregates": args.aggregates,
                "headers": args.headers,
                "database": settings, "wal_level": wal_level, "results": results,
            }),
        )
    })
    .await
}

/// Ratio of `variant` to `pk-only` within each run where both ran.
fn ratios(args: &WriterCostArgs, runs: &[Vec<Option<CostRun>>], i: usize) -> Vec<f64> {
    let Some(base) = args
        .variants
        .iter()
        .position(|v| *v == WriterVariant::PkOnly)
    else {
        return Vec::new();
    };
    runs[i]
        .iter()
        .zip(&runs[base])
        .filter_map(|(r, b)| Some(r.as_ref()?.commits_per_second / b.as_ref()?.commits_per_second))
        .collect()
}

fn medians(runs: &[Option<CostRun>], f: impl Fn(&CostRun) -> Option<f64>) -> Option<f64> {
    let xs: Vec<f64> = runs.iter().flatten().filter_map(f).collect();
    (!xs.is_empty()).then(|| median(xs))
}

fn print_summary(args: &WriterCostArgs, label: &str, runs: &[Vec<Option<CostRun>>]) {
    println!(
        "\nwriter-cost, {label}, median of {} run(s):",
        args.runs.max(1)
    );
    println!(
        "  {:<17} {:>9} {:>10} {:>15} {:>16}",
        "variant", "commits/s", "vs pk-only", "PG µs CPU/tx", "relay µs CPU/ev"
    );
    for (i, variant) in args.variants.iter().enumerate() {
        let rate = medians(&runs[i], |r| Some(r.commits_per_second));
        let Some(rate) = rate else {
            println!(
                "  {:<17} {:>9}",
                variant.name(),
                "— (no relay of ours reads it)"
            );
            continue;
        };
        let ratio = ratios(args, runs, i);
        let cpu = medians(&runs[i], |r| Some(r.postgres_cpu_us_per_commit)).unwrap_or(0.0);
        let relay = medians(&runs[i], |r| r.relay_cpu_us_per_event);
        println!(
            "  {:<17} {:>9.0} {:>10} {:>15.0} {:>16}",
            variant.name(),
            rate,
            if ratio.is_empty() {
                "—".to_owned()
            } else {
                format!("{:.3}", median(ratio))
            },
            cpu,
            relay.map_or("—".to_owned(), |c| format!("{c:.1}"))
        );
    }
}

fn summary_json(
    args: &WriterCostArgs,
    with_relay: bool,
    runs: &[Vec<Option<CostRun>>],
) -> serde_json::Value {
    let variants: Vec<serde_json::Value> = args
        .variants
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let ratio = ratios(args, runs, i);
            let ratio = (!ratio.is_empty()).then(|| median(ratio));
            serde_json::json!({
                "variant": v,
                "commits_per_second": medians(&runs[i], |r| Some(r.commits_per_second)),
                "ratio_to_pk_only": ratio,
                "postgres_cpu_us_per_commit": medians(&runs[i], |r| Some(r.postgres_cpu_us_per_commit)),
                "relay_cpu_us_per_event": medians(&runs[i], |r| r.relay_cpu_us_per_event),
                "per_run": runs[i],
            })
        })
        .collect();
    serde_json::json!({ "relay": if with_relay { "wal" } else { "none" }, "variants": variants })
}

/// The business table, Debezium's outbox table, and one outbox table per index variant.
async fn setup(store: &PgStore, args: &WriterCostArgs) -> anyhow::Result<()> {
    let s = store.outbox().schema().to_owned();
    let pool = store.pool();
    for sql in [
        format!(
            "CREATE TABLE \"{s}\".accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL,
                 updated_at TIMESTAMPTZ NOT NULL DEFAULT now()) WITH (fillfactor = 80)"
        ),
        format!(
            "INSERT INTO \"{s}\".accounts (id, balance) SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g"
        ),
        // Debezium's documented outbox table.
        format!(
            "CREATE TABLE \"{s}\".debezium_outbox (id UUID PRIMARY KEY,
                 aggregatetype VARCHAR(255) NOT NULL, aggregateid VARCHAR(255) NOT NULL,
                 type VARCHAR(255) NOT NULL, payload JSONB)"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await?;
    }
    if args.variants.contains(&WriterVariant::StreamTable) {
        let config = outbox_wal::WalConfig {
            schema: s.clone(),
            table: "events".into(),
            ..outbox_wal::WalConfig::new("")
        };
        sqlx::raw_sql(sqlx::AssertSqlSafe(outbox_wal::stream_table_ddl(&config)))
            .execute(pool)
            .await?;
    }
    for variant in &args.variants {
        let Some(table) = variant.table() else {
            continue;
        };
        if table == "events" {
            continue; // `fresh` migrated it
        }
        let outbox = PgOutbox::with_names(&s, table)?;
        outbox.migrate(pool).await?;
        for drop in variant.drops() {
            let sql = drop.replace("{s}", &s).replace("{t}", table);
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await?;
        }
    }
    Ok(())
}

async fn truncate(store: &PgStore, args: &WriterCostArgs) -> anyhow::Result<()> {
    let s = store.outbox().schema();
    let mut tables = vec![format!("\"{s}\".debezium_outbox")];
    if args.variants.contains(&WriterVariant::StreamTable) {
        tables.push(format!("\"{s}\".events_stream"));
    }
    for variant in &args.variants {
        if let Some(t) = variant.table() {
            tables.push(format!("\"{s}\".\"{t}\""));
        }
    }
    tables.sort();
    tables.dedup();
    crate::execute(store, format!("TRUNCATE {}", tables.join(", "))).await?;
    Ok(())
}

fn event(aggregate: u64, n: u64, payload_bytes: usize, headers: usize) -> anyhow::Result<NewEvent> {
    let mut event = NewEvent::new(
        "account",
        aggregate.to_string(),
        "BalanceChanged",
        &crate::payload(payload_bytes, aggregate, n),
    )?;
    for h in 0..headers {
        event = match h {
            0 => event.with_header(
                "traceparent",
                format!("00-{:032x}-{:016x}-01", u128::from(n) + 1, aggregate + 1),
            ),
            _ => event.with_header(format!("h{h}"), format!("value-{n}-{h}")),
        };
    }
    Ok(event)
}

/// Writers flat out for `duration`: (commits, seconds).
async fn run_writers(
    store: &PgStore,
    args: &WriterCostArgs,
    variant: WriterVariant,
    duration: Duration,
) -> anyhow::Result<(u64, f64)> {
    let s = store.outbox().schema().to_owned();
    let update = BUSINESS_UPDATE.replace("{s}", &s);
    let pk_only = format!(
        "INSERT INTO \"{s}\".debezium_outbox (id, aggregatetype, aggregateid, type, payload)
         VALUES ($1, $2, $3, $4, $5::jsonb)"
    );
    let outbox = PgOutbox::with_names(&s, variant.table().unwrap_or("events"))?;
    let prefix = format!("{s}_events");
    let (pool, connections) = crate::load::writer_connections(store, args.writers.max(1)).await?;
    let commits = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for (w, mut conn) in connections.into_iter().enumerate() {
        let (update, pk_only, outbox, prefix) = (
            update.clone(),
            pk_only.clone(),
            outbox.clone(),
            prefix.clone(),
        );
        let (commits, failed) = (commits.clone(), failed.clone());
        let (aggregates, payload_bytes, headers) =
            (args.aggregates.max(1), args.payload_bytes, args.headers);
        tasks.push(tokio::spawn(async move {
            let mut n: u64 = w as u64;
            while Instant::now() < deadline && !failed.load(Ordering::Relaxed) {
                n += 1;
                // A cheap spread over accounts and aggregates, the same for every variant.
                let mix = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (w as u64) << 32;
                let account = (mix % ACCOUNTS as u64) as i32 + 1;
                let aggregate = (mix >> 16) % aggregates;
                let result: anyhow::Result<()> = async {
                    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                    sqlx::query(sqlx::AssertSqlSafe(update.as_str()))
                        .bind(account)
                        .execute(&mut *tx)
                        .await?;
                    match variant {
                        WriterVariant::BusinessOnly => {}
                        WriterVariant::PkOnly => {
                            let e = event(aggregate, n, payload_bytes, headers)?;
                            sqlx::query(sqlx::AssertSqlSafe(pk_only.as_str()))
                                .bind(Uuid::now_v7())
                                .bind(e.aggregate_type())
                                .bind(e.aggregate_id())
                                .bind(e.event_type())
                                .bind(e.payload())
                                .execute(&mut *tx)
                                .await?;
                        }
                        WriterVariant::Message => {
                            let e = event(aggregate, n, payload_bytes, headers)?;
                            outbox_wal::enqueue_message(&mut *tx, &prefix, &e).await?;
                        }
                        WriterVariant::StreamTable => {
                            let e = event(aggregate, n, payload_bytes, headers)?;
                            outbox_wal::enqueue_streamed(&mut *tx, &outbox, &e).await?;
                        }
                        _ => {
                            let e = event(aggregate, n, payload_bytes, headers)?;
                            outbox.enqueue(&mut *tx, &e).await?;
                        }
                    }
                    tx.commit().await?;
                    Ok(())
                }
                .await;
                match result {
                    Ok(()) => {
                        commits.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(error) => {
                        failed.store(true, Ordering::Relaxed);
                        return Err(error.context(format!("writer {w}, {}", variant.name())));
                    }
                }
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let seconds = started.elapsed().as_secs_f64();
    pool.close().await;
    Ok((commits.load(Ordering::Relaxed), seconds))
}

/// The server `pool` connects to, for its CPU time (it must run on this machine).
pub async fn postgres_cpu(pool: &sqlx::PgPool) -> anyhow::Result<outbox_testkit::PostgresCpu> {
    let dir: String = sqlx::query_scalar("SHOW data_directory")
        .fetch_one(pool)
        .await
        .context("SHOW data_directory (the bench reads PostgreSQL's CPU from /proc: connect as a superuser to a server on this machine)")?;
    Ok(outbox_testkit::PostgresCpu::from_data_directory(&dir)?)
}

/// Our relay in WAL mode in a child process (`wal-relay-child`), delivering to the in-process
/// channel sink until its standard input closes.
struct WalChild {
    child: tokio::process::Child,
    config: outbox_wal::WalConfig,
}

/// What the child printed when it stopped.
#[derive(Serialize, Deserialize, Debug)]
pub struct WalChildReport {
    delivered: u64,
    cpu_seconds: f64,
}

impl WalChild {
    async fn start(
        url: &str,
        schema: &str,
        variant: WriterVariant,
        run: usize,
    ) -> anyhow::Result<Self> {
        let table = variant
            .table()
            .context("a variant without an outbox table")?;
        let name = format!("{schema}_{}_{run}", table);
        let config = outbox_wal::WalConfig {
            schema: schema.to_owned(),
            table: table.to_owned(),
            slot: name.clone(),
            publication: name,
            message_prefix: format!("{schema}_events"),
            sources: vec![match variant {
                WriterVariant::Message => outbox_wal::Source::Messages,
                WriterVariant::StreamTable => outbox_wal::Source::StreamTable,
                _ => outbox_wal::Source::Table,
            }],
            catch_up: false,
            ..outbox_wal::WalConfig::new(url)
        };
        outbox_wal::prepare(&config).await?;
        let child = tokio::process::Command::new(std::env::current_exe()?)
            .arg("wal-relay-child")
            .arg("--config")
            .arg(serde_json::to_string(&config)?)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        // Let it connect and start streaming before the writers start.
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(WalChild { child, config })
    }

    async fn stop(mut self) -> anyhow::Result<WalChildReport> {
        if let Some(mut stdin) = self.child.stdin.take() {
            stdin.shutdown().await.ok();
        }
        let out = self.child.wait_with_output().await?;
        if !out.status.success() {
            bail!("the WAL relay child failed: {}", out.status);
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .last()
            .context("the WAL relay child printed nothing")?;
        let report: WalChildReport = serde_json::from_str(line)?;
        // Its walsender may take a moment to exit after it did.
        let _ = outbox_wal::drop_slot_waiting(&self.config, Duration::from_secs(5)).await;
        let pool = sqlx::PgPool::connect(&self.config.database_url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP PUBLICATION IF EXISTS \"{}\"",
            self.config.publication
        )))
        .execute(&pool)
        .await?;
        pool.close().await;
        Ok(report)
    }
}

#[derive(clap::Args)]
pub struct WalChildArgs {
    /// The `WalConfig`, JSON.
    #[arg(long)]
    config: String,
}

/// The child: run the WAL relay into the channel sink until standard input closes.
pub async fn wal_relay_child(args: WalChildArgs) -> anyhow::Result<()> {
    let config: outbox_wal::WalConfig = serde_json::from_str(&args.config)?;
    let (sink, mut rx) = outbox_sink_channel::ChannelSink::new(10_000);
    let consumer = tokio::spawn(async move {
        let mut n = 0u64;
        while rx.recv().await.is_some() {
            n += 1;
        }
        n
    });
    let sink: Arc<dyn Sink> = Arc::new(sink);
    let cpu0 = crate::cpu_ticks_seconds()?;
    let relay = outbox_wal::WalRelay::new(config, sink).with_relay(outbox_engine::RelayConfig {
        relay_id: "writer-cost".into(),
        ..outbox_engine::RelayConfig::default()
    });
    let report = relay
        .run(async {
            let mut stdin = tokio::io::stdin();
            let mut buf = [0u8; 64];
            while tokio::io::AsyncReadExt::read(&mut stdin, &mut buf)
                .await
                .is_ok_and(|n| n > 0)
            {}
        })
        .await?;
    let cpu = crate::cpu_ticks_seconds()? - cpu0;
    consumer.abort();
    println!(
        "{}",
        serde_json::to_string(&WalChildReport {
            delivered: report.delivered,
            cpu_seconds: cpu,
        })?
    );
    Ok(())
}
