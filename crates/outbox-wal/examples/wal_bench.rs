//! WAL-mode benchmark: drain rate of a backlog and commit → sink-ack latency under a steady
//! write rate, with the relay in a child process so its CPU time and peak RSS are its own.
//!
//! ```text
//! scripts/pg-logical.sh start
//! cargo run --release -p outbox-wal --example wal_bench -- drain --events 100000 --source table
//! cargo run --release -p outbox-wal --example wal_bench -- drain --events 100000 --source messages
//! cargo run --release -p outbox-wal --example wal_bench -- drain --events 100000 --source stream_table
//! cargo run --release -p outbox-wal --example wal_bench -- drain --events 100000 --source debezium
//! cargo run --release -p outbox-wal --example wal_bench -- latency --rate 1000 --seconds 10
//! cargo run --release -p outbox-wal --example wal_bench -- latency --rate 5000 --seconds 10
//! ```
//!
//! Add `--sink nats` to either scenario to deliver to the NATS JetStream on 127.0.0.1:4222
//! instead (a stream of the run's own, created by the sink, deleted afterwards; an event counts
//! as received when its PubAck came back).
//!
//! Workload: 400-byte JSON payloads, 1000 aggregates, the in-process channel sink (the child
//! drains its receiver) unless `--sink nats`. Drain: the backlog is committed in transactions of 1000 events before
//! the relay starts (catch-up scan off, so every event comes through the WAL). Latency: single-
//! event transactions from 8 paced writer connections; latency = wall-clock time the child's
//! sink receiver got the event − wall-clock time the writer's COMMIT returned.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use outbox_postgresql::PgOutbox;
use outbox_types::{Event, EventId, NewEvent, Outcome, Sink};
use outbox_wal::{Source, WalConfig, WalRelay};
use sqlx::postgres::PgPoolOptions;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

/// `--source` of `drain` and `latency`: `table` (the default), `messages`, `stream_table` or
/// `debezium`.
fn source_arg(args: &[String]) -> Source {
    match arg(args, "--source", "table").as_str() {
        "messages" => Source::Messages,
        "stream_table" => Source::StreamTable,
        "debezium" => Source::Debezium,
        _ => Source::Table,
    }
}

fn url() -> Res<String> {
    if let Ok(url) = std::env::var("OUTBOX_WAL_BENCH_URL") {
        return Ok(url);
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/pg-logical.sh");
    let status = std::process::Command::new("bash")
        .arg(script)
        .arg("start")
        .status()?;
    if !status.success() {
        return Err("scripts/pg-logical.sh start failed".into());
    }
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg("url")
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn event(agg: u64, n: u64, payload_bytes: usize) -> Res<NewEvent> {
    let head = format!(r#"{{"aggregate":"a{agg}","n":{n},"pad":""#);
    let pad = payload_bytes.saturating_sub(head.len() + 2);
    let json = format!("{head}{}\"}}", "x".repeat(pad));
    Ok(NewEvent::from_json(
        "agg",
        format!("a{agg}"),
        "BenchEvent",
        json,
    )?)
}

fn config(url: &str, name: &str, source: Source) -> WalConfig {
    WalConfig {
        schema: name.to_owned(),
        slot: name.to_owned(),
        publication: name.to_owned(),
        message_prefix: name.to_owned(),
        sources: vec![source],
        debezium: outbox_wal::DebeziumTable {
            table: format!("{name}.outbox"),
            ..Default::default()
        },
        catch_up: false,
        status_interval: Duration::from_millis(200),
        ..WalConfig::new(url)
    }
}

fn proc_figures() -> (f64, u64) {
    // utime + stime (clock ticks, 100 Hz on Linux) and VmHWM (peak RSS, kB).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let cpu = (ticks(11) + ticks(12)) / 100.0;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (cpu, hwm)
}

/// A real sink whose confirmed events are also handed to the bench's receiver, so "received"
/// means "the broker acknowledged it".
struct Acked<S> {
    inner: S,
    tx: tokio::sync::mpsc::Sender<Event>,
}

#[async_trait]
impl<S: Sink> Sink for Acked<S> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let outcomes = self.inner.publish(events).await;
        for (e, o) in events.iter().zip(&outcomes) {
            if *o == Outcome::Delivered {
                let _ = self.tx.send(e.clone()).await;
            }
        }
        outcomes
    }
}

/// The NATS sink settings of a run: its own subject and stream.
fn nats_config(name: &str) -> Res<outbox_sink_nats::NatsSinkConfig> {
    Ok(serde_json::from_value(serde_json::json!({
        "servers": ["nats://127.0.0.1:4222"],
        "subject": format!("{name}.events"),
        "create_stream": true,
        "stream_name": name.to_uppercase(),
        "stream_subjects": [format!("{name}.>")],
    }))?)
}

/// Messages in the run's NATS stream, then delete it.
async fn nats_count_and_delete(name: &str) -> Res<u64> {
    let js = async_nats::jetstream::new(async_nats::connect("nats://127.0.0.1:4222").await?);
    let mut stream = js.get_stream(name.to_uppercase()).await?;
    let count = stream.info().await?.state.messages;
    js.delete_stream(name.to_uppercase()).await?;
    Ok(count)
}

/// After a run on the `nats` sink: its stream holds all `n` events (the relay counted them as
/// delivered, the broker must have them), and is deleted. Other sinks: nothing to check.
async fn check_nats_stream(sink: &str, name: &str, n: u64) -> Res<()> {
    if sink == "nats" {
        let stored = nats_count_and_delete(name).await?;
        if stored < n {
            return Err(format!("NATS stream holds {stored} of {n} events").into());
        }
    }
    Ok(())
}

/// The relay process: deliver until `events` distinct events arrived, then stop gracefully.
async fn child(args: &[String]) -> Res<()> {
    let cfg: WalConfig = serde_json::from_str(&arg(args, "--config", "{}"))?;
    let n: usize = arg(args, "--events", "0").parse()?;
    let out = arg(args, "--out", "/dev/null");
    // The receiver reads the sink's own channel: no task in between, whose wakeups would count
    // as the relay's CPU.
    let capacity = n.max(1);
    let (sink, mut rx): (Arc<dyn Sink>, _) = match arg(args, "--sink", "channel").as_str() {
        "nats" => {
            let (tx, rx) = tokio::sync::mpsc::channel(capacity);
            let inner = outbox_sink_nats::NatsSink::connect(nats_config(&cfg.slot)?).await?;
            (Arc::new(Acked { inner, tx }), rx)
        }
        _ => {
            let (sink, rx) = outbox_sink_channel::ChannelSink::new(capacity);
            (Arc::new(sink), rx)
        }
    };
    // WAL_BENCH_METRICS=1: the Prometheus recorder `outbox relay` installs with `metrics.listen`
    // (no listener; its upkeep every 5 s as the relay runs it), so the metrics' cost is counted;
    // `no-upkeep`: the same recorder never drained, as nobody scraping it and no upkeep leave it.
    let metrics = std::env::var("WAL_BENCH_METRICS").unwrap_or_default();
    if metrics == "1" || metrics == "no-upkeep" {
        let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets(&[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ])?
            .install_recorder()?;
        if metrics == "1" {
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                    handle.run_upkeep();
                }
            });
        }
    }
    // The engine's settings, the same in both modes: batches of 1000, and WAL_BENCH_IN_FLIGHT
    // batches in flight (default 4).
    let relay = WalRelay::new(cfg, sink).with_relay(outbox_engine::RelayConfig {
        relay_id: "wal-bench".into(),
        batch_size: 1000,
        max_batches_in_flight: std::env::var("WAL_BENCH_IN_FLIGHT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4),
        poll_interval: std::env::var("WAL_BENCH_POLL_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(std::time::Duration::from_millis)
            .unwrap_or(std::time::Duration::from_millis(100)),
        ..outbox_engine::RelayConfig::default()
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let (cpu0, _) = proc_figures();
    let receiver = tokio::spawn(async move {
        let mut seen: HashMap<EventId, u128> = HashMap::with_capacity(n);
        let mut first = None;
        let mut last = started;
        let mut stop = Some(stop_tx);
        while let Some(e) = rx.recv().await {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            seen.entry(e.id).or_insert(now);
            first.get_or_insert_with(Instant::now);
            last = Instant::now();
            if seen.len() >= n
                && let Some(tx) = stop.take()
            {
                let _ = tx.send(());
            }
        }
        (seen, first.unwrap_or(started), last)
    });
    let report = relay
        .run(async move {
            let _ = stop_rx.await;
        })
        .await?;
    eprintln!("relay: {report:?}");
    let (seen, first, last) = receiver.await?;
    let (cpu1, hwm_kb) = proc_figures();
    let mut file = std::io::BufWriter::new(std::fs::File::create(&out)?);
    for (id, nanos) in &seen {
        writeln!(file, "{id} {nanos}")?;
    }
    file.flush()?;
    println!(
        "{}",
        serde_json::json!({
            "events": seen.len(),
            "since_start_s": last.duration_since(started).as_secs_f64(),
            "first_to_last_s": last.duration_since(first).as_secs_f64(),
            "cpu_s": cpu1 - cpu0,
            "peak_rss_kb": hwm_kb,
        })
    );
    Ok(())
}

fn spawn_child(
    cfg: &WalConfig,
    events: usize,
    out: &std::path::Path,
    sink: &str,
) -> Res<std::process::Child> {
    Ok(std::process::Command::new(std::env::current_exe()?)
        .args([
            "relay-child",
            "--sink",
            sink,
            "--config",
            &serde_json::to_string(cfg)?,
            "--events",
            &events.to_string(),
            "--out",
            &out.display().to_string(),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()?)
}

fn child_figures(child: std::process::Child) -> Res<serde_json::Value> {
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(format!("relay child failed: {}", out.status).into());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().ok_or("relay child printed nothing")?;
    Ok(serde_json::from_str(line)?)
}

/// The server's CPU meter (it runs on this machine: the logical cluster of the scripts).
async fn postgres_cpu(pool: &sqlx::PgPool) -> Res<outbox_testkit::PostgresCpu> {
    let dir: String = sqlx::query_scalar("SHOW data_directory")
        .fetch_one(pool)
        .await?;
    Ok(outbox_testkit::PostgresCpu::from_data_directory(&dir)?)
}

async fn setup(url: &str, source: Source) -> Res<(sqlx::PgPool, PgOutbox, WalConfig)> {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(url)
        .await?;
    let name = format!("owb_{}", std::process::id());
    let outbox = PgOutbox::with_names(&name, "events")?;
    outbox.migrate(&pool).await?;
    let cfg = config(url, &name, source);
    if source == Source::Debezium {
        sqlx::raw_sql(sqlx::AssertSqlSafe(outbox_wal::debezium_table_ddl(
            &cfg.debezium,
        )))
        .execute(&pool)
        .await?;
    }
    outbox_wal::prepare(&cfg).await?;
    Ok((pool, outbox, cfg))
}

/// What a service writing Debezium's documented table does: one plain INSERT.
async fn insert_debezium(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    cfg: &WalConfig,
    e: &NewEvent,
) -> Res<()> {
    let (schema, table) = cfg.debezium.schema_and_name();
    let sql = format!(
        "INSERT INTO \"{schema}\".\"{table}\" (id, aggregatetype, aggregateid, type, payload) VALUES ($1, $2, $3, $4, $5::jsonb)"
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(e.id().as_uuid())
        .bind(e.aggregate_type())
        .bind(e.aggregate_id())
        .bind(e.event_type())
        .bind(e.payload())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn teardown(pool: &sqlx::PgPool, cfg: &WalConfig) {
    // The child's walsender may take a moment to exit after the child did.
    let _ = outbox_wal::drop_slot_waiting(cfg, Duration::from_secs(5)).await;
    for sql in [
        format!("DROP PUBLICATION IF EXISTS \"{}\"", cfg.publication),
        format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", cfg.schema),
    ] {
        let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await;
    }
}

async fn drain(args: &[String]) -> Res<()> {
    let url = url()?;
    let n: u64 = arg(args, "--events", "100000").parse()?;
    let aggregates: u64 = arg(args, "--aggregates", "1000").parse()?;
    let size: usize = arg(args, "--payload-bytes", "400").parse()?;
    let source = source_arg(args);
    let (pool, outbox, mut cfg) = setup(&url, source).await?;
    if args
        .iter()
        .any(|a| a == "--no-mark" || a == "--delete-on-ack")
    {
        cfg.delete_on_ack = true;
    }
    let loading = Instant::now();
    for chunk in 0..n.div_ceil(1000) {
        let events: Vec<NewEvent> = (chunk * 1000..((chunk + 1) * 1000).min(n))
            .map(|i| event(i % aggregates, i / aggregates, size))
            .collect::<Res<_>>()?;
        let mut tx = pool.begin().await?;
        match source {
            Source::Table => {
                outbox.enqueue_batch(&mut *tx, &events).await?;
            }
            Source::Messages => {
                outbox_wal::enqueue_messages(&mut *tx, &cfg.message_prefix, &events).await?;
            }
            Source::StreamTable => {
                for e in &events {
                    outbox_wal::enqueue_streamed(&mut *tx, &outbox, e).await?;
                }
            }
            Source::Debezium => {
                for e in &events {
                    insert_debezium(&mut tx, &cfg, e).await?;
                }
            }
        }
        tx.commit().await?;
    }
    eprintln!("backlog of {n} committed in {:?}", loading.elapsed());
    let dir = tempfile_dir()?;
    let sink = arg(args, "--sink", "channel");
    let server = postgres_cpu(&pool).await?;
    let server_before = server.seconds()?;
    let child = spawn_child(&cfg, n as usize, &dir.join("recv.txt"), &sink)?;
    let figures = child_figures(child)?;
    // From the relay's start to its exit: decoding in the walsender, the write-back, the
    // catch-up look at the table, heartbeats.
    let server_seconds = server.seconds()? - server_before;
    let events = figures["events"].as_f64().unwrap_or(0.0);
    let total = figures["since_start_s"].as_f64().unwrap_or(0.0);
    let cpu = figures["cpu_s"].as_f64().unwrap_or(0.0);
    check_nats_stream(&sink, &cfg.slot, n).await?;
    println!(
        "drain sink={sink} source={source:?} delete_on_ack={} events={n} aggregates={aggregates} payload={size}B: {:.0} events/s (relay start → last ack {:.2} s; first → last {:.2} s), CPU {:.1} µs/event, PostgreSQL CPU {:.1} µs/event, peak RSS {:.1} MB",
        cfg.delete_on_ack,
        events / total.max(1e-9),
        total,
        figures["first_to_last_s"].as_f64().unwrap_or(0.0),
        cpu / events.max(1.0) * 1e6,
        server_seconds / events.max(1.0) * 1e6,
        figures["peak_rss_kb"].as_f64().unwrap_or(0.0) / 1024.0
    );
    teardown(&pool, &cfg).await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

fn tempfile_dir() -> Res<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("wal_bench_{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

async fn latency(args: &[String]) -> Res<()> {
    let url = url()?;
    let rate: u64 = arg(args, "--rate", "1000").parse()?;
    let seconds: u64 = arg(args, "--seconds", "10").parse()?;
    let writers: u64 = arg(args, "--writers", "8").parse()?;
    let size: usize = arg(args, "--payload-bytes", "400").parse()?;
    let source = source_arg(args);
    let (pool, outbox, cfg) = setup(&url, source).await?;
    let per_writer = rate * seconds / writers;
    let n = per_writer * writers;
    let dir = tempfile_dir()?;
    let recv_file = dir.join("recv.txt");
    let sink = arg(args, "--sink", "channel");
    let child = spawn_child(&cfg, n as usize, &recv_file, &sink)?;
    // Let the child connect and start streaming.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let interval = Duration::from_secs_f64(writers as f64 / rate as f64);
    let server = postgres_cpu(&pool).await?;
    let server_before = server.seconds()?;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let pool = pool.clone();
        let outbox = outbox.clone();
        let prefix = cfg.message_prefix.clone();
        let cfg = cfg.clone();
        tasks.push(tokio::spawn(async move {
            let mut commits: Vec<(EventId, u128)> = Vec::with_capacity(per_writer as usize);
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for i in 0..per_writer {
                tick.tick().await;
                let global = w + i * writers;
                let e = event(global % 1000, global / 1000, size)?;
                let mut tx = pool.begin().await?;
                match source {
                    Source::Table => {
                        outbox.enqueue(&mut *tx, &e).await?;
                    }
                    Source::Messages => {
                        outbox_wal::enqueue_message(&mut *tx, &prefix, &e).await?;
                    }
                    Source::StreamTable => {
                        outbox_wal::enqueue_streamed(&mut *tx, &outbox, &e).await?;
                    }
                    Source::Debezium => insert_debezium(&mut tx, &cfg, &e).await?,
                }
                tx.commit().await?;
                let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
                commits.push((e.id(), now));
            }
            Res::Ok(commits)
        }));
    }
    let started = Instant::now();
    let mut commits = HashMap::new();
    for t in tasks {
        commits.extend(t.await??);
    }
    let write_secs = started.elapsed().as_secs_f64();
    // While the writers ran: their transactions and the relay's work on the server together.
    let server_seconds = server.seconds()? - server_before;
    let figures = child_figures(child)?;
    let text = std::fs::read_to_string(&recv_file)?;
    let mut lat: Vec<f64> = Vec::with_capacity(commits.len());
    for line in text.lines() {
        let mut parts = line.split(' ');
        let (Some(id), Some(nanos)) = (parts.next(), parts.next()) else {
            continue;
        };
        let (Ok(id), Ok(nanos)) = (id.parse::<EventId>(), nanos.parse::<u128>()) else {
            continue;
        };
        if let Some(committed) = commits.get(&id) {
            // The walsender may send a commit before the writer's COMMIT call returns.
            lat.push(nanos.saturating_sub(*committed) as f64 / 1e6);
        }
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    let events = figures["events"].as_f64().unwrap_or(0.0);
    check_nats_stream(&sink, &cfg.slot, n).await?;
    println!(
        "latency sink={sink} source={source:?} target={rate}/s achieved={:.0}/s events={} writers={writers} payload={size}B: commit→sink p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; relay CPU {:.1} µs/event, PostgreSQL CPU {:.1} µs/event (writers and relay), peak RSS {:.1} MB",
        commits.len() as f64 / write_secs,
        lat.len(),
        pct(0.50),
        pct(0.99),
        lat.last().copied().unwrap_or(f64::NAN),
        figures["cpu_s"].as_f64().unwrap_or(0.0) / events.max(1.0) * 1e6,
        server_seconds / commits.len().max(1) as f64 * 1e6,
        figures["peak_rss_kb"].as_f64().unwrap_or(0.0) / 1024.0
    );
    teardown(&pool, &cfg).await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    // The relay child runs on a current-thread runtime unless WAL_BENCH_THREADS says otherwise:
    // one relay task plus the replication worker gain nothing from cross-thread wakeups.
    let threads: usize = std::env::var("WAL_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let runtime = if args.get(1).map(String::as_str) == Some("relay-child") && threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(2))
            .enable_all()
            .build()?
    };
    match args.get(1).map(String::as_str) {
        Some("relay-child") => runtime.block_on(child(&args)),
        Some("drain") => runtime.block_on(drain(&args)),
        Some("latency") => runtime.block_on(latency(&args)),
        _ => {
            eprintln!(
                "usage: wal_bench drain|latency [--events N] [--source table|messages] [--rate R --seconds S]"
            );
            Ok(())
        }
    }
}
