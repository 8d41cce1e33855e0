//! Writers for the write-overhead and steady-state scenarios, and the sink wrapper that stamps
//! when each event was acknowledged.
//!
//! A writer's business transaction is what a service does: insert an order row and, depending on
//! the variant, enqueue one event about it. Each writer has its own connection and paces itself
//! on an open-loop schedule (it does not wait for a slow commit before deciding when the next
//! one is due), so a stall shows up as latency and backlog instead of silently lowering the load.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use outbox_postgresql::{PgOutbox, PgStore};
use outbox_types::{Event, NewEvent, Outcome, Sink, SinkError};
use uuid::Uuid;

/// Microseconds since the Unix epoch: the clock writers (parent) and the relay (child) share.
pub fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// What a writer's transaction contains besides the order row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// The business row alone.
    OrderOnly,
    /// The business row and one event through `PgOutbox::enqueue`.
    Outbox,
    /// The business row and the same event row by a hand-written `INSERT`.
    RawInsert,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::OrderOnly => "order only",
            Variant::Outbox => "order + enqueue",
            Variant::RawInsert => "order + raw INSERT",
        }
    }
}

/// The business table the writers insert into, next to the outbox.
pub async fn create_orders(store: &PgStore) -> anyhow::Result<()> {
    let schema = store.outbox().schema();
    crate::execute(
        store,
        format!(
            "CREATE TABLE IF NOT EXISTS \"{schema}\".orders (
             id UUID PRIMARY KEY, customer_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL,
             status TEXT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        ),
    )
    .await?;
    Ok(())
}

/// Empty the orders and the outbox between runs and checkpoint, so every run starts from the
/// same tables and does not pay for writing out the previous run's pages.
pub async fn reset(store: &PgStore) -> anyhow::Result<()> {
    let schema = store.outbox().schema();
    crate::execute(
        store,
        format!(
            "TRUNCATE \"{schema}\".orders, {}",
            store.outbox().qualified_table()
        ),
    )
    .await?;
    crate::execute(store, "CHECKPOINT".to_owned()).await
}

/// A 400-byte-ish order event body.
fn order_payload(order: Uuid, customer: i64, bytes: usize) -> serde_json::Value {
    let head = format!(
        "{{\"order_id\":\"{order}\",\"customer_id\":{customer},\"amount_cents\":1999,\"pad\":\"\"}}"
    );
    let pad = bytes.saturating_sub(head.len());
    serde_json::json!({
        "order_id": order, "customer_id": customer, "amount_cents": 1999, "pad": "x".repeat(pad)
    })
}

/// Settings shared by every writer of a run.
#[derive(Clone)]
pub struct WriterPlan {
    pub variant: Variant,
    pub writers: usize,
    /// Transactions per second over all writers; 0 = as fast as they go.
    pub rate: f64,
    pub duration: Duration,
    pub payload_bytes: usize,
    /// Record (event id, commit time) per event, for latency.
    pub record_commits: bool,
}

/// What the writers did.
#[derive(Default)]
pub struct WriterResult {
    pub commits: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub seconds: f64,
    /// Event id → microseconds since the epoch when its COMMIT returned.
    pub committed_at: HashMap<Uuid, i64>,
    /// Transactions that started later than their slot by more than 100 ms (the database
    /// could not keep up with the schedule).
    pub late: u64,
}

/// A pool of its own to the store's database, apart from the store's own (small) pool, and
/// `writers` connections taken from it: one connection per writer, for every writer benchmark.
/// The pool is the caller's to close when the writers are done.
pub async fn writer_connections(
    store: &PgStore,
    writers: usize,
) -> anyhow::Result<(
    sqlx::PgPool,
    Vec<sqlx::pool::PoolConnection<sqlx::Postgres>>,
)> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(writers.max(1)).unwrap_or(u32::MAX))
        .acquire_timeout(Duration::from_secs(30))
        .connect_with((*store.pool().connect_options()).clone())
        .await?;
    let mut connections = Vec::with_capacity(writers);
    for _ in 0..writers {
        connections.push(pool.acquire().await?);
    }
    Ok((pool, connections))
}

/// Run `plan.writers` writers, each on its own connection, until `plan.duration` is over.
pub async fn run_writers(store: &PgStore, plan: &WriterPlan) -> anyhow::Result<WriterResult> {
    let table = store.outbox().qualified_table().to_owned();
    let orders = format!("\"{}\".orders", store.outbox().schema());
    let sql = Arc::new(WriterSql {
        insert_order: format!(
            "INSERT INTO {orders} (id, customer_id, amount_cents, status) VALUES ($1, $2, $3, 'new')"
        ),
        raw_event: format!(
            "INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, $4, $5::json)"
        ),
    });
    let (pool, connections) = writer_connections(store, plan.writers).await?;
    let started = Instant::now();
    let deadline = started + plan.duration;
    let stop = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (w, mut conn) in connections.into_iter().enumerate() {
        let outbox = store.outbox().clone();
        let plan = plan.clone();
        let sql = sql.clone();
        let commits = commits.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut result = WriterResult::default();
            let interval =
                (plan.rate > 0.0).then(|| Duration::from_secs_f64(plan.writers as f64 / plan.rate));
            // Writers start spread over one interval, not all at once.
            let mut due = started
                + interval
                    .map(|i| i.mul_f64(w as f64 / plan.writers as f64))
                    .unwrap_or_default();
            let customer = w as i64;
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                if let Some(interval) = interval {
                    let now = Instant::now();
                    if due > now {
                        tokio::time::sleep_until(due.into()).await;
                    } else if now - due > Duration::from_millis(100) {
                        result.late += 1;
                    }
                    due += interval;
                    if due > deadline {
                        break;
                    }
                }
                let order = Uuid::now_v7();
                let outcome = write_one(&mut conn, &plan, &sql, &outbox, order, customer).await;
                match outcome {
                    Ok(event_id) => {
                        result.commits += 1;
                        commits.fetch_add(1, Ordering::Relaxed);
                        if plan.record_commits
                            && let Some(id) = event_id
                        {
                            result.committed_at.insert(id, now_micros());
                        }
                    }
                    Err(error) => {
                        result.errors += 1;
                        if result.first_error.is_none() {
                            result.first_error = Some(format!("{error:#}"));
                        }
                        if result.errors > 100 {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                }
            }
            anyhow::Ok(result)
        }));
    }
    let mut total = WriterResult::default();
    for task in tasks {
        total.absorb(task.await??);
    }
    total.seconds = started.elapsed().as_secs_f64();
    pool.close().await;
    Ok(total)
}

/// The statements a writer runs besides the library's enqueue.
struct WriterSql {
    insert_order: String,
    raw_event: String,
}

/// One writer transaction: the order row and, per `plan.variant`, its event; the event's id.
async fn write_one(
    conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
    plan: &WriterPlan,
    sql: &WriterSql,
    outbox: &PgOutbox,
    order: Uuid,
    customer: i64,
) -> anyhow::Result<Option<Uuid>> {
    let mut tx = sqlx::Connection::begin(&mut **conn).await?;
    sqlx::query(sqlx::AssertSqlSafe(sql.insert_order.as_str()))
        .bind(order)
        .bind(customer)
        .bind(1999_i64)
        .execute(&mut *tx)
        .await?;
    let event_id = match plan.variant {
        Variant::OrderOnly => None,
        Variant::Outbox => {
            let event = NewEvent::new(
                "order",
                order.to_string(),
                "OrderCreated",
                &order_payload(order, customer, plan.payload_bytes),
            )?;
            Some(*outbox.enqueue(&mut *tx, &event).await?.id.as_uuid())
        }
        Variant::RawInsert => {
            let id = Uuid::now_v7();
            let body = serde_json::to_string(&order_payload(order, customer, plan.payload_bytes))?;
            sqlx::query(sqlx::AssertSqlSafe(sql.raw_event.as_str()))
                .bind(id)
                .bind("order")
                .bind(order.to_string())
                .bind("OrderCreated")
                .bind(body)
                .execute(&mut *tx)
                .await?;
            Some(id)
        }
    };
    tx.commit().await?;
    Ok(event_id)
}

impl WriterResult {
    /// The figures, or an error naming `what` ran when any transaction failed: a run with
    /// failed transactions measured something else.
    pub fn all_committed(self, what: &str) -> anyhow::Result<Self> {
        if self.errors > 0 {
            anyhow::bail!(
                "{what}: {} transactions failed; first: {}",
                self.errors,
                self.first_error.unwrap_or_default()
            );
        }
        Ok(self)
    }

    /// Adds one writer's figures to the total.
    fn absorb(&mut self, r: WriterResult) {
        self.commits += r.commits;
        self.errors += r.errors;
        self.late += r.late;
        if self.first_error.is_none() {
            self.first_error = r.first_error;
        }
        self.committed_at.extend(r.committed_at);
    }
}

/// A sink that stamps, for every event its inner sink confirmed, when the confirmation came.
pub struct AckStampSink {
    inner: Arc<dyn Sink>,
    acks: Mutex<Vec<(Uuid, i64)>>,
}

impl AckStampSink {
    pub fn new(inner: Arc<dyn Sink>) -> Self {
        AckStampSink {
            inner,
            acks: Mutex::new(Vec::with_capacity(1 << 16)),
        }
    }

    /// Write `uuid micros` lines.
    pub fn write_to(&self, path: &std::path::Path) -> anyhow::Result<()> {
        use std::io::Write;
        let acks = self.acks.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        for (id, micros) in acks.iter() {
            writeln!(out, "{id} {micros}")?;
        }
        out.flush()?;
        Ok(())
    }
}

#[async_trait]
impl Sink for AckStampSink {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let outcomes = self.inner.publish(events).await;
        let at = now_micros();
        let mut acks = self.acks.lock().unwrap_or_else(|p| p.into_inner());
        for (event, outcome) in events.iter().zip(&outcomes) {
            if *outcome == Outcome::Delivered {
                acks.push((*event.id.as_uuid(), at));
            }
        }
        outcomes
    }

    async fn check(&self) -> Result<(), SinkError> {
        self.inner.check().await
    }
}

/// Read what [`AckStampSink::write_to`] wrote: the first ack of each event.
pub fn read_acks(path: &std::path::Path) -> anyhow::Result<HashMap<Uuid, i64>> {
    let text = std::fs::read_to_string(path)?;
    let mut acks = HashMap::new();
    for line in text.lines() {
        let Some((id, micros)) = line.split_once(' ') else {
            continue;
        };
        acks.entry(id.parse()?).or_insert(micros.parse()?);
    }
    Ok(acks)
}
