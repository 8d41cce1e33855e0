//! `outbox demo`: the whole write → relay → deliver path on an embedded SQLite file, visibly,
//! and checked.
//!
//! Concurrent writers create orders, each in one transaction with its `OrderCreated` event; one
//! order in ten is rolled back on purpose (as if payment was declined); one committed order in five
//! is cancelled later in a second transaction with an `OrderCancelled` event. A relay delivers
//! the outbox to standard output (one JSON line per event) while the writers are still writing.
//! At the end the demo compares what was committed with what came out: every committed event
//! delivered, no rolled-back event delivered, and each order's events in the order they were
//! written. Any violation makes the command fail.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use async_trait::async_trait;
use outbox_core::{Event, EventId, NewEvent, Outcome, Sink, Store};
use outbox_relay::{Relay, RelayConfig};
use outbox_sink_stdout::StdoutSink;
use outbox_sqlite::{SqliteOutbox, SqliteStore};
use serde_json::json;

/// `outbox demo` arguments.
#[derive(clap::Args)]
pub struct DemoArgs {
    /// SQLite file to use (recreated on every run).
    #[arg(long, default_value = "outbox-demo.db")]
    db: PathBuf,
    /// Orders to attempt.
    #[arg(long, default_value_t = 200)]
    orders: u64,
    /// Concurrent writers.
    #[arg(long, default_value_t = 4)]
    writers: u64,
    /// Do not print the delivered events, only the summary.
    #[arg(long)]
    quiet: bool,
}

/// Prints through the stdout sink (unless quiet) and remembers what was delivered.
struct Observed {
    print: Option<StdoutSink>,
    delivered: Mutex<Vec<Event>>,
}

#[async_trait]
impl Sink for Observed {
    fn name(&self) -> &str {
        "stdout"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let outcomes = match &self.print {
            Some(sink) => sink.publish(events).await,
            None => vec![Outcome::Delivered; events.len()],
        };
        let mut delivered = self.delivered.lock().unwrap_or_else(|p| p.into_inner());
        for (event, outcome) in events.iter().zip(&outcomes) {
            if *outcome == Outcome::Delivered {
                delivered.push(event.clone());
            }
        }
        outcomes
    }
}

#[derive(Default)]
struct Ledger {
    committed: Vec<EventId>,
    rolled_back: Vec<EventId>,
    orders: u64,
    declined: u64,
    cancelled: u64,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    for suffix in ["", "-wal", "-shm"] {
        let mut path = args.db.clone().into_os_string();
        path.push(suffix);
        let _ = std::fs::remove_file(&path);
    }
    let target = args.db.to_string_lossy().to_string();
    let store = SqliteStore::connect(&target, SqliteOutbox::new()).await?;
    store.outbox().migrate(store.pool()).await?;
    sqlx::query(
        "CREATE TABLE demo_orders (
             id INTEGER PRIMARY KEY, product TEXT NOT NULL, quantity INTEGER NOT NULL,
             amount_cents INTEGER NOT NULL, status TEXT NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    eprintln!(
        "demo: {} orders from {} writers into {} (SQLite, WAL mode); relaying to stdout as they commit",
        args.orders,
        args.writers,
        args.db.display()
    );

    let sink = Arc::new(Observed {
        print: (!args.quiet).then(StdoutSink::stdout),
        delivered: Mutex::new(Vec::new()),
    });
    let store = Arc::new(store);
    let relay = Relay::new(
        store.clone() as Arc<dyn Store>,
        sink.clone() as Arc<dyn Sink>,
        RelayConfig {
            relay_id: "demo".into(),
            batch_size: 100,
            poll_interval: Duration::from_millis(20),
            ..RelayConfig::default()
        },
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));

    let started = Instant::now();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut writers = Vec::new();
    for w in 0..args.writers.max(1) {
        let store = store.clone();
        let ledger = ledger.clone();
        let (orders, writers_n) = (args.orders, args.writers.max(1));
        writers.push(tokio::spawn(async move {
            let mut id = w + 1;
            while id <= orders {
                write_order(&store, id, &ledger).await?;
                id += writers_n;
            }
            anyhow::Ok(())
        }));
    }
    for w in writers {
        w.await.context("writer task")??;
    }
    let written_in = started.elapsed();

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = store.stats().await?;
        if stats.pending == 0 && stats.in_flight == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("the relay did not drain the outbox within 60 s: {stats:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    let report = relay.await.context("relay task")?;
    let elapsed = started.elapsed();

    let delivered = sink
        .delivered
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let ledger = std::mem::take(&mut *ledger.lock().unwrap_or_else(|p| p.into_inner()));
    let delivered_ids: HashSet<EventId> = delivered.iter().map(|e| e.id).collect();
    let committed: HashSet<EventId> = ledger.committed.iter().copied().collect();
    let lost: Vec<&EventId> = committed.difference(&delivered_ids).collect();
    let phantom: Vec<&EventId> = ledger
        .rolled_back
        .iter()
        .filter(|id| delivered_ids.contains(id))
        .collect();
    let order_violations = outbox_core::check_first_delivery_order(&delivered).len();
    let stats = store.stats().await?;

    println!();
    println!("outbox demo summary");
    println!("  orders attempted          {}", ledger.orders);
    println!(
        "  rolled back on purpose    {} (their events must never appear)",
        ledger.declined
    );
    println!("  cancellations             {}", ledger.cancelled);
    println!("  events committed          {}", committed.len());
    println!(
        "  events relayed            {} ({} deliveries)",
        delivered_ids.len(),
        delivered.len()
    );
    println!("  lost                      {}", lost.len());
    println!("  phantom (rolled back)     {}", phantom.len());
    println!("  per-order order broken    {}", order_violations);
    println!(
        "  outbox now                {} delivered, {} pending, {} dead",
        stats.delivered, stats.pending, stats.dead
    );
    println!(
        "  time                      writes {:.2} s, all delivered after {:.2} s (relay: {} batches)",
        written_in.as_secs_f64(),
        elapsed.as_secs_f64(),
        report.batches
    );
    if !lost.is_empty() || !phantom.is_empty() || order_violations > 0 {
        bail!("the demo found a delivery violation (see the summary above)");
    }
    println!("  result                    OK: exactly the committed events, in order per order");
    Ok(())
}

async fn write_order(store: &SqliteStore, id: u64, ledger: &Mutex<Ledger>) -> anyhow::Result<()> {
    let products = ["keyboard", "monitor", "cable", "laptop stand", "webcam"];
    let product = products[(id as usize) % products.len()];
    let quantity = (id % 3 + 1) as i64;
    let amount = 1999 * quantity;
    let declined = id % 10 == 7;
    let created = NewEvent::new(
        "order",
        id.to_string(),
        "OrderCreated",
        &json!({"order_id": id, "product": product, "quantity": quantity, "amount_cents": amount}),
    )?
    .with_idempotency_key(format!("order-{id}-created"));

    let mut tx = store.pool().begin().await?;
    sqlx::query("INSERT INTO demo_orders (id, product, quantity, amount_cents, status) VALUES (?, ?, ?, ?, 'created')")
        .bind(id as i64)
        .bind(product)
        .bind(quantity)
        .bind(amount)
        .execute(&mut *tx)
        .await?;
    store.outbox().enqueue(&mut *tx, &created).await?;
    if declined {
        tx.rollback().await?;
        let mut l = ledger.lock().unwrap_or_else(|p| p.into_inner());
        l.orders += 1;
        l.declined += 1;
        l.rolled_back.push(created.id());
        return Ok(());
    }
    tx.commit().await?;
    {
        let mut l = ledger.lock().unwrap_or_else(|p| p.into_inner());
        l.orders += 1;
        l.committed.push(created.id());
    }
    if id.is_multiple_of(5) {
        let cancelled = NewEvent::new(
            "order",
            id.to_string(),
            "OrderCancelled",
            &json!({"order_id": id, "reason": "customer request"}),
        )?
        .with_idempotency_key(format!("order-{id}-cancelled"));
        let mut tx = store.pool().begin().await?;
        sqlx::query("UPDATE demo_orders SET status = 'cancelled' WHERE id = ?")
            .bind(id as i64)
            .execute(&mut *tx)
            .await?;
        store.outbox().enqueue(&mut *tx, &cancelled).await?;
        tx.commit().await?;
        let mut l = ledger.lock().unwrap_or_else(|p| p.into_inner());
        l.cancelled += 1;
        l.committed.push(cancelled.id());
    }
    Ok(())
}
