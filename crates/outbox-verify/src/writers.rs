//! Writers: business transactions that enqueue events, the way an application does.
//!
//! Each transaction locks one aggregate's business row and bumps its sequence number
//! (`UPDATE … SET next_seq = next_seq + k RETURNING next_seq`), inserts a business row keyed by
//! the transaction id, and enqueues `k` events whose payload carries the aggregate and its
//! sequence numbers. Because the sequence number lives in the same transaction, committed
//! events of an aggregate are numbered 1, 2, 3, … in commit order with no gaps, whatever rolled
//! back — the order the relay must preserve.
//!
//! Then the transaction's fate, drawn from the writer's seeded generator: COMMIT (most), a
//! deliberate ROLLBACK, or a crash — `pg_terminate_backend` of its own backend, or dropping the
//! socket — before COMMIT. The writer records a transaction as committed only after COMMIT
//! returned; an error on the COMMIT itself is recorded as ambiguous (the server may have
//! committed before the answer was lost) and resolved afterwards against the business row.
//!
//! Writers connect through a proxy so the link to the database can be cut under them: that is
//! what produces ambiguous commits.

use std::io::Write;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use outbox_postgresql::PgOutbox;
use outbox_types::{EventId, NewEvent};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};
use tokio::sync::watch;
use uuid::Uuid;

use crate::Error;
use crate::history::{Txn, TxnOutcome, WrittenEvent};

/// The event type of ordinary events.
pub const EVENT_TYPE: &str = "Verified";

/// What writers do.
#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// Connection URL (normally through the writers' proxy).
    pub url: String,
    /// Transactions per second per writer; `None`: as fast as the database goes.
    pub rate: Option<f64>,
    /// Fraction of transactions rolled back on purpose.
    pub rollback: f64,
    /// Fraction of transactions whose connection the writer kills before COMMIT.
    pub crash: f64,
    /// Events per transaction: 1 to this.
    pub max_events: u32,
    /// Aggregates per destination.
    pub aggregates: u32,
    /// Destinations (aggregate types) events go to.
    pub destinations: Vec<String>,
    /// Filler bytes in each payload.
    pub pad: usize,
    /// The outbox.
    pub outbox: PgOutbox,
    /// Schema of the business tables (`aggregates`, `business`) in the outbox's database.
    pub schema: String,
}

/// The shared record of every transaction, in memory and as JSON lines on disk.
pub struct WriterLog {
    txns: Mutex<Vec<Txn>>,
    file: Mutex<Option<std::io::BufWriter<std::fs::File>>>,
}

impl WriterLog {
    /// A log that also appends to `path`.
    pub fn new(path: &std::path::Path) -> Result<Self, Error> {
        let file = std::fs::File::create(path)
            .map_err(Error::io(format!("creating {}", path.display())))?;
        Ok(WriterLog {
            txns: Mutex::new(Vec::new()),
            file: Mutex::new(Some(std::io::BufWriter::new(file))),
        })
    }

    /// Record one finished transaction.
    pub fn push(&self, txn: Txn) {
        if let Ok(mut file) = self.file.lock()
            && let Some(f) = file.as_mut()
            && let Ok(line) = serde_json::to_string(&txn)
        {
            let _ = writeln!(f, "{line}");
        }
        if let Ok(mut txns) = self.txns.lock() {
            txns.push(txn);
        }
    }

    /// Every transaction so far.
    pub fn txns(&self) -> Vec<Txn> {
        self.txns.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Transactions so far.
    pub fn len(&self) -> usize {
        self.txns.lock().map(|t| t.len()).unwrap_or(0)
    }

    /// Whether nothing was recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Flush the file.
    pub fn flush(&self) {
        if let Ok(mut file) = self.file.lock()
            && let Some(f) = file.as_mut()
        {
            let _ = f.flush();
        }
    }
}

/// Create the business tables and one row per aggregate.
pub async fn setup(conn: &mut PgConnection, options: &WriterOptions) -> Result<(), Error> {
    let schema = &options.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {schema}.aggregates (agg TEXT PRIMARY KEY, next_seq BIGINT NOT NULL DEFAULT 0);
         CREATE TABLE IF NOT EXISTS {schema}.business (txn UUID PRIMARY KEY, writer INTEGER NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now());"
    )))
    .execute(&mut *conn)
    .await?;
    let mut names = Vec::new();
    for dest in &options.destinations {
        for k in 0..options.aggregates {
            names.push(format!("{dest}/{k}"));
        }
    }
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {schema}.aggregates (agg) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING"
    )))
    .bind(&names)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Open a writer connection (named, so faults can find writers' backends).
pub async fn connect(url: &str) -> Result<PgConnection, Error> {
    let options: PgConnectOptions = url.parse()?;
    Ok(PgConnection::connect_with(&options.application_name("outbox_verify_writer")).await?)
}

/// How a transaction is to end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Commit,
    Rollback,
    Terminate,
    DropSocket,
}

/// One event to write: everything but the sequence number, which the database hands out.
struct Planned {
    destination: String,
    aggregate_id: String,
    count: u32,
    poison: Option<serde_json::Value>,
}

/// Run writer `id` until `stop` turns true.
pub async fn run(
    id: u32,
    options: Arc<WriterOptions>,
    seed: u64,
    log: Arc<WriterLog>,
    mut stop: watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (u64::from(id) << 32) ^ 0x5eed);
    let mut conn: Option<PgConnection> = None;
    let mut ticker = options.rate.map(|rate| {
        let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.001)));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    while !*stop.borrow() {
        if let Some(t) = ticker.as_mut() {
            tokio::select! {
                _ = t.tick() => {}
                _ = stop.changed() => continue,
            }
        }
        let c = match conn.as_mut() {
            Some(c) => c,
            None => match connect(&options.url).await {
                Ok(c) => conn.insert(c),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let destination =
            options.destinations[rng.random_range(0..options.destinations.len())].clone();
        let plan = Planned {
            destination,
            aggregate_id: rng.random_range(0..options.aggregates).to_string(),
            count: rng.random_range(1..=options.max_events.max(1)),
            poison: None,
        };
        let roll: f64 = rng.random();
        let fate = if roll < options.crash / 2.0 {
            Fate::Terminate
        } else if roll < options.crash {
            Fate::DropSocket
        } else if roll < options.crash + options.rollback {
            Fate::Rollback
        } else {
            Fate::Commit
        };
        let (txn, keep) = transaction(c, id, &options, plan, fate).await;
        if !keep {
            conn = None;
        }
        log.push(txn);
    }
}

/// Write one committed poison event for `destination` through its own connection (a new
/// aggregate holding only that event, so it blocks nothing behind it).
pub async fn write_poison(
    options: &WriterOptions,
    destination: &str,
    number: u64,
    payload_for: impl Fn(serde_json::Value) -> Option<serde_json::Value>,
    log: &WriterLog,
) -> Result<(), Error> {
    let mut conn = connect(&options.url).await?;
    let aggregate_id = format!("poison-{number}");
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {}.aggregates (agg) VALUES ($1) ON CONFLICT DO NOTHING",
        options.schema
    )))
    .bind(format!("{destination}/{aggregate_id}"))
    .execute(&mut conn)
    .await?;
    let probe = payload_for(serde_json::json!({}));
    if probe.is_none() {
        return Err(Error::Invalid(format!(
            "destination {destination} has no poison payload"
        )));
    }
    let plan = Planned {
        destination: destination.to_owned(),
        aggregate_id,
        count: 1,
        poison: Some(serde_json::Value::Null),
    };
    let (mut txn, _) = transaction_with(&mut conn, u32::MAX, options, plan, Fate::Commit, |p| {
        payload_for(p)
    })
    .await;
    for e in &mut txn.events {
        e.poison = true;
    }
    log.push(txn);
    Ok(())
}

async fn transaction(
    conn: &mut PgConnection,
    writer: u32,
    options: &WriterOptions,
    plan: Planned,
    fate: Fate,
) -> (Txn, bool) {
    transaction_with(conn, writer, options, plan, fate, Some).await
}

/// Run one transaction; returns its record and whether the connection is still usable.
async fn transaction_with(
    conn: &mut PgConnection,
    writer: u32,
    options: &WriterOptions,
    plan: Planned,
    fate: Fate,
    shape: impl Fn(serde_json::Value) -> Option<serde_json::Value>,
) -> (Txn, bool) {
    let txn_id = Uuid::now_v7();
    let mut record = Txn {
        id: txn_id,
        writer,
        outcome: TxnOutcome::Failed,
        events: Vec::new(),
        committed_unix_ms: None,
    };
    let aggregate = format!("{}/{}", plan.destination, plan.aggregate_id);
    let body = async {
        conn.execute("BEGIN").await?;
        let next: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "UPDATE {}.aggregates SET next_seq = next_seq + $2 WHERE agg = $1 RETURNING next_seq",
            options.schema
        )))
        .bind(&aggregate)
        .bind(i64::from(plan.count))
        .fetch_one(&mut *conn)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.business (txn, writer) VALUES ($1, $2)",
            options.schema
        )))
        .bind(txn_id)
        .bind(i32::try_from(writer).unwrap_or(-1))
        .execute(&mut *conn)
        .await?;
        let first = next - i64::from(plan.count) + 1;
        let mut events = Vec::with_capacity(plan.count as usize);
        for i in 0..i64::from(plan.count) {
            let seq = u64::try_from(first + i).unwrap_or(0);
            let payload = serde_json::json!({
                "agg": aggregate,
                "seq": seq,
                "txn": txn_id,
                "writer": writer,
                "pad": "x".repeat(options.pad),
            });
            let payload = shape(payload).unwrap_or(serde_json::Value::Null);
            let id = EventId::new();
            let event = NewEvent::new(&plan.destination, &plan.aggregate_id, EVENT_TYPE, &payload)
                .map_err(|e| Error::Invalid(e.to_string()))?
                .with_id(id)
                .with_header("verify-txn", txn_id.to_string());
            record.events.push(WrittenEvent {
                id,
                aggregate: aggregate.clone(),
                seq,
                destination: plan.destination.clone(),
                poison: plan.poison.is_some(),
            });
            events.push(event);
        }
        if events.len() == 1 {
            options.outbox.enqueue(&mut *conn, &events[0]).await?;
        } else {
            options.outbox.enqueue_batch(&mut *conn, &events).await?;
        }
        Ok::<(), Error>(())
    };
    if body.await.is_err() {
        // COMMIT was never sent: nothing of this transaction can have committed.
        record.outcome = TxnOutcome::Failed;
        return (record, false);
    }
    match fate {
        Fate::Commit => match conn.execute("COMMIT").await {
            Ok(_) => {
                record.outcome = TxnOutcome::Committed;
                record.committed_unix_ms = Some(crate::history::unix_ms());
                (record, true)
            }
            Err(_) => {
                record.outcome = TxnOutcome::Ambiguous;
                (record, false)
            }
        },
        Fate::Rollback => {
            let ok = conn.execute("ROLLBACK").await.is_ok();
            record.outcome = TxnOutcome::RolledBack;
            (record, ok)
        }
        Fate::Terminate => {
            let _ = conn
                .execute("SELECT pg_terminate_backend(pg_backend_pid())")
                .await;
            record.outcome = TxnOutcome::Crashed;
            (record, false)
        }
        Fate::DropSocket => {
            record.outcome = TxnOutcome::Crashed;
            (record, false)
        }
    }
}
