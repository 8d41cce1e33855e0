//! `outbox demo`: the whole Order system in one process, on SQLite files, with no server to
//! install — and checked.
//!
//! What runs: the order service (the real axum app on `127.0.0.1:0`, SQLite `orders.db` holding
//! the orders and the outbox); a load generator making HTTP requests ([`crate::load`]); the
//! relay ([`outbox_engine`]) publishing the outbox through [`BusSink`] into the in-process
//! [`Bus`], which feeds the delivery and billing consumers ([`crate::consumers`], each with its
//! own SQLite file and inbox) and delivers a share of messages twice. A summary line is printed
//! once a second.
//!
//! At the end, once the outbox is drained and the bus idle, two checks run and any violation
//! makes the command fail:
//!
//! - **relay**: every event committed to the outbox was published (none lost), every published
//!   event belongs to an order that exists (no phantom from a rolled-back order or a rejected
//!   request), and each order's events came out in the order they were written;
//! - **effects** ([`crate::check`]): every order has exactly one reservation and one charge,
//!   every cancellation exactly one release and one refund, nothing for rejected requests.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use outbox_engine::{Relay, RelayConfig};
use outbox_types::{EventId, OutboxStats, Sink, Store};
use uuid::Uuid;

use crate::bus::{Bus, BusConfig, BusSink};
use crate::consumers::{Consumer, Service};
use crate::load::{LoadConfig, LoadCounters, LoadReport};
use crate::order::OrderStore;
use crate::{Db, Error};

/// `outbox demo` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct DemoArgs {
    /// Orders to create (a few invalid and over-limit requests come on top) [default: 300,
    /// or no limit with --duration].
    #[arg(long)]
    pub orders: Option<u64>,
    /// Keep making requests for this long (e.g. `30s`, `2m`); with --orders too, whichever
    /// ends first.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Orders per second (0 = as fast as the service answers).
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Concurrent HTTP clients.
    #[arg(long, alias = "clients", default_value_t = 4)]
    pub writers: usize,
    /// Seed of the load generator's and the bus' choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Share of messages the bus delivers twice.
    #[arg(long, default_value_t = 0.15)]
    pub redeliver: f64,
    /// Directory for orders.db, delivery.db and billing.db (recreated); default: a temporary
    /// directory removed afterwards.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print only the final summary.
    #[arg(long)]
    pub quiet: bool,
}

impl Default for DemoArgs {
    fn default() -> Self {
        DemoArgs {
            orders: None,
            duration: None,
            rate: 100.0,
            writers: 4,
            seed: 1,
            redeliver: 0.15,
            dir: None,
            quiet: false,
        }
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = s.split_at(
        s.find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len()),
    );
    let n: f64 = number
        .parse()
        .map_err(|_| format!("`{s}` is not a duration like 10s, 500ms or 2m"))?;
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{s}`: use ms, s, m or h"
            ));
        }
    };
    Ok(Duration::from_secs_f64(secs))
}

/// Run the demo; `Err(Error::Violations(n))` when the final check failed.
pub async fn run(args: DemoArgs) -> Result<(), Error> {
    // Kept until the end: dropping it removes the temporary directory.
    let (dir, _temp) = demo_dir(args.dir.as_ref())?;
    let db_url = |name: &str| fresh_sqlite_url(&dir, name);

    let orders = OrderStore::new(Db::connect(&db_url("orders.db")?, None, 4).await?, None);
    orders.migrate().await?;
    let delivery = open_consumer(Service::Delivery, &db_url("delivery.db")?).await?;
    let billing = open_consumer(Service::Billing, &db_url("billing.db")?).await?;
    let (addr, stop_http, server) = start_order_service(&orders).await?;

    // The relay, its sink, the bus and the consumers.
    let (sink, rx) = BusSink::new(256);
    let bus = Bus::spawn(
        rx,
        vec![delivery.clone(), billing.clone()],
        BusConfig {
            redeliver_ratio: args.redeliver.clamp(0.0, 1.0),
            seed: args.seed,
            ..BusConfig::default()
        },
    );
    let store = orders.relay_store();
    let relay = Relay::new(
        store.clone(),
        sink.clone() as Arc<dyn Sink>,
        RelayConfig {
            relay_id: "demo".into(),
            batch_size: 200,
            poll_interval: Duration::from_millis(20),
            ..RelayConfig::default()
        },
    );
    let relay_counters = relay.counters();
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run(async move {
        let _ = relay_stopped.await;
    }));

    let load_counters = Arc::new(LoadCounters::default());
    let load_config = load_config(&args);
    if !args.quiet {
        print_intro(&args, &load_config, &addr, &dir);
    }

    let started = Instant::now();
    let live = Live {
        load: load_counters.clone(),
        relay: relay_counters.clone(),
        bus: bus.counters(),
        delivery: delivery.counters(),
        billing: billing.counters(),
    };
    let ticker = (!args.quiet).then(|| spawn_ticker(live.clone(), started));

    let load = crate::load::run(
        &format!("http://{addr}"),
        load_config,
        load_counters.clone(),
    )
    .await;
    let load = match load {
        Ok(load) => load,
        Err(e) => {
            if let Some(t) = &ticker {
                t.abort();
            }
            return Err(e);
        }
    };
    let load_done = started.elapsed();

    let stats = settle(store.as_ref(), &bus, &sink).await?;
    let settled = started.elapsed();
    if let Some(t) = &ticker {
        t.abort();
    }
    let _ = stop_relay.send(());
    let relay_report = relay
        .await
        .map_err(|e| Error::Io(format!("relay task: {e}")))?;
    bus.shutdown().await;
    let _ = stop_http.send(());
    let _ = server.await;

    let relayed = relay_findings(&orders, &sink).await?;
    let report = crate::check::verify(&orders, &delivery, &billing, Some(&load)).await?;

    print_summary(&Summary {
        load: &load,
        stats: &stats,
        relayed: &relayed,
        batches: relay_report.batches,
        report: &report,
        bus: bus_snapshot(&live),
        load_done,
        settled,
    });

    let mut violations = report.violation_count;
    for (what, n) in [
        ("committed events never published", relayed.lost),
        (
            "published events of orders that do not exist",
            relayed.phantom,
        ),
        (
            "events of an order published out of order",
            relayed.order_broken,
        ),
    ] {
        if n > 0 {
            violations += 1;
            println!("  VIOLATION: {n} {what}");
        }
    }
    if !report.ok() {
        println!("  VIOLATION: {report}");
    }
    if violations > 0 {
        return Err(Error::Violations(violations));
    }
    println!(
        "  result                    OK: every order reserved and charged once, every cancellation released and refunded once, nothing for rejected requests"
    );
    Ok(())
}

/// A consumer service on its own SQLite file.
async fn open_consumer(service: Service, url: &str) -> Result<Arc<Consumer>, Error> {
    Ok(Arc::new(
        Consumer::open(service, Db::connect(url, None, 2).await?).await?,
    ))
}

/// The order service (the real axum app) on a free port of 127.0.0.1: its address, the sender
/// that stops it, and its task.
async fn start_order_service(
    orders: &OrderStore,
) -> Result<
    (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ),
    Error,
> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Error::Io(format!("cannot listen on 127.0.0.1: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Io(format!("listener address: {e}")))?;
    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crate::http::serve(listener, orders.clone(), async move {
        let _ = http_stopped.await;
    }));
    Ok((addr, stop_http, server))
}

/// The load the arguments ask for: 300 orders unless told otherwise, no limit with a duration.
fn load_config(args: &DemoArgs) -> LoadConfig {
    LoadConfig {
        orders: args.orders.unwrap_or(if args.duration.is_some() {
            u64::MAX
        } else {
            300
        }),
        duration: args.duration,
        clients: args.writers.max(1),
        rate: (args.rate > 0.0).then_some(args.rate),
        seed: args.seed,
        ..LoadConfig::default()
    }
}

fn print_intro(args: &DemoArgs, load_config: &LoadConfig, addr: &std::net::SocketAddr, dir: &Path) {
    println!(
        "outbox demo: order service on http://{addr}, SQLite files in {}",
        dir.display()
    );
    println!(
        "  {} HTTP clients, {} (seed {}); the bus delivers {:.0}% of messages twice",
        load_config.clients,
        match (args.duration, load_config.rate) {
            (Some(d), _) => format!("for {:.0} s", d.as_secs_f64()),
            (None, Some(r)) => format!("{} orders at {r:.0}/s", load_config.orders),
            (None, None) => format!("{} orders", load_config.orders),
        },
        args.seed,
        args.redeliver * 100.0
    );
}

/// Prints the live line once a second.
fn spawn_ticker(live: Live, started: Instant) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        loop {
            tick.tick().await;
            println!("{}", live.line(started.elapsed()));
        }
    })
}

/// The demo's directory: `dir` (created if missing), or a temporary one that lives as long as
/// the returned guard.
fn demo_dir(dir: Option<&PathBuf>) -> Result<(PathBuf, Option<tempfile::TempDir>), Error> {
    match dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::Io(format!("cannot create {}: {e}", dir.display())))?;
            Ok((dir.clone(), None))
        }
        None => {
            let temp = tempfile::tempdir()
                .map_err(|e| Error::Io(format!("cannot create a temporary directory: {e}")))?;
            Ok((temp.path().to_owned(), Some(temp)))
        }
    }
}

/// The URL of SQLite file `name` in `dir`, with the file and its `-wal`/`-shm` companions of an
/// earlier run removed.
fn fresh_sqlite_url(dir: &Path, name: &str) -> Result<String, Error> {
    for suffix in ["", "-wal", "-shm"] {
        let path = dir.join(format!("{name}{suffix}"));
        if path.exists() {
            std::fs::remove_file(&path)
                .map_err(|e| Error::Io(format!("cannot remove {}: {e}", path.display())))?;
        }
    }
    Ok(format!("sqlite://{}", dir.join(name).display()))
}

/// Waits until the outbox has nothing left, everything published reached the bus, and the bus
/// settled every delivery (including its own redeliveries and retries); at most 60 s.
async fn settle(store: &dyn Store, bus: &Bus, sink: &BusSink) -> Result<OutboxStats, Error> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = store.stats().await?;
        let received = bus.counters().received.load(Ordering::Acquire);
        if stats.pending == 0
            && stats.in_flight == 0
            && received >= sink.sent()
            && bus.wait_idle(Duration::from_millis(20)).await
            && bus.counters().received.load(Ordering::Acquire) == received
        {
            return Ok(stats);
        }
        if Instant::now() > deadline {
            return Err(Error::Io(format!(
                "the system did not settle within 60 s after the load ended: {stats:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The relay's checks: lost, phantom, per-order order.
struct RelayFindings {
    /// Events in the outbox table.
    committed: usize,
    /// Distinct events published.
    distinct: usize,
    /// Publishes, repeats included.
    publishes: usize,
    lost: usize,
    phantom: usize,
    order_broken: usize,
}

async fn relay_findings(orders: &OrderStore, sink: &BusSink) -> Result<RelayFindings, Error> {
    let published = sink.published();
    let published_ids: HashSet<EventId> = published.iter().map(|e| e.id).collect();
    let committed = committed_event_ids(orders).await?;
    let existing: HashSet<String> = orders
        .statuses()
        .await?
        .into_iter()
        .map(|(id, _)| id.to_string())
        .collect();
    Ok(RelayFindings {
        committed: committed.len(),
        distinct: published_ids.len(),
        publishes: published.len(),
        lost: committed.difference(&published_ids).count(),
        phantom: published
            .iter()
            .filter(|e| !existing.contains(&e.aggregate_id))
            .count(),
        order_broken: outbox_types::check_first_delivery_order(&published).len(),
    })
}

/// What the summary prints.
struct Summary<'a> {
    load: &'a LoadReport,
    stats: &'a OutboxStats,
    relayed: &'a RelayFindings,
    batches: u64,
    report: &'a crate::check::CheckReport,
    /// Duplicates suppressed, redelivered on purpose, retries.
    bus: (u64, u64, u64),
    load_done: Duration,
    settled: Duration,
}

fn print_summary(s: &Summary<'_>) {
    println!();
    println!("outbox demo summary");
    println!("  orders created            {}", s.load.created.len());
    println!(
        "  cancellations             {} (+{} repeated cancels answered 200, no second event)",
        s.load.cancelled.len(),
        s.load.repeat_cancels
    );
    println!(
        "  rejected requests         {} invalid (400/422), {} over the credit limit (409, rolled back)",
        s.load.rejected, s.load.declined
    );
    println!(
        "  events committed          {} ({} delivered, {} pending, {} dead in the outbox)",
        s.relayed.committed, s.stats.delivered, s.stats.pending, s.stats.dead
    );
    println!(
        "  events relayed            {} ({} publishes, {} batches)",
        s.relayed.distinct, s.relayed.publishes, s.batches
    );
    println!("  lost                      {}", s.relayed.lost);
    println!("  phantom (no such order)   {}", s.relayed.phantom);
    println!("  per-order order broken    {}", s.relayed.order_broken);
    println!(
        "  deliveries reserved       {} (released {})",
        s.report.reserved, s.report.released
    );
    println!(
        "  charges                   {} (refunds {})",
        s.report.charged, s.report.refunded
    );
    println!(
        "  duplicates suppressed     {} ({} redelivered on purpose, {} retries)",
        s.bus.0, s.bus.1, s.bus.2
    );
    println!(
        "  time                      load {:.2} s, all effects applied after {:.2} s",
        s.load_done.as_secs_f64(),
        s.settled.as_secs_f64()
    );
}

/// Ids of every event in the outbox table (all delivered by now; retention does not run in
/// the demo).
async fn committed_event_ids(orders: &OrderStore) -> Result<HashSet<EventId>, Error> {
    let ids: Vec<(String,)> = orders.outbox_rows("CAST(id AS TEXT)").await?;
    ids.iter()
        .map(|(id,)| {
            Uuid::parse_str(id)
                .map(EventId::from_uuid)
                .map_err(|e| Error::Invalid(format!("outbox event id `{id}`: {e}")))
        })
        .collect()
}

#[derive(Clone)]
struct Live {
    load: Arc<LoadCounters>,
    relay: Arc<outbox_engine::RelayCounters>,
    bus: Arc<crate::bus::BusCounters>,
    delivery: Arc<crate::consumers::ConsumerCounters>,
    billing: Arc<crate::consumers::ConsumerCounters>,
}

fn bus_snapshot(live: &Live) -> (u64, u64, u64) {
    (
        live.delivery.duplicates.load(Ordering::Relaxed)
            + live.billing.duplicates.load(Ordering::Relaxed),
        live.bus.redelivered.load(Ordering::Relaxed),
        live.bus.retried.load(Ordering::Relaxed),
    )
}

impl Live {
    fn line(&self, elapsed: Duration) -> String {
        let l = &self.load;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let (duplicates, _, _) = bus_snapshot(self);
        format!(
            "[{:>4.1}s] orders {} created, {} cancelled, {} rejected | relayed {} | delivery {} reserved, {} released | billing {} charged, {} refunded | duplicates suppressed {}",
            elapsed.as_secs_f64(),
            get(&l.created),
            get(&l.cancelled),
            get(&l.rejected) + get(&l.declined),
            self.relay.report().delivered,
            get(&self.delivery.opened),
            get(&self.delivery.closed),
            get(&self.billing.opened),
            get(&self.billing.closed),
            duplicates,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("3d").is_err());
    }
}
