//! Destinations: where relays deliver and where the harness's consumers read.
//!
//! Why a trait: the checker does not care whether an event went through JetStream, Kafka, an
//! HTTP POST or a file; it needs "what arrived, in which order" and "was the effect applied
//! once". Each [`Destination`] knows three things about its broker — the relay's config table
//! for it, how to break it (a proxy to cut, a broker to stop, a payload it rejects) and how to
//! consume from it — and hands every message it receives to one [`DestinationHandler`], which
//! records the arrival and applies the effect through `outbox-inbox`.
//!
//! The effect is an upsert into an effects table in the consumer's database that counts how
//! many times it ran for each event, committed in the same transaction as the inbox row. A
//! count above 1 is an effect applied twice: the inbox failed. The consumer database is the
//! machine's shared PostgreSQL (never faulted), so consumer failures do not reorder what the
//! harness observes.

pub mod file;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
pub mod webhook;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use outbox_inbox::postgres::PgInbox;
use outbox_inbox::{Delivery, InboxClaim, InboxHandler, ParkedMessage, Processed};
use outbox_testkit::TcpProxy;
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::Error;
use crate::history::Observed;

/// The pseudo-destination of poison events no route matches: with `[destinations]` and one
/// route per destination, an event of this aggregate type must be dead-lettered as unroutable.
pub const UNROUTED: &str = "unrouted";

/// The inbox handler name the harness's consumers use.
pub const HANDLER: &str = "outbox_verify";

/// What every destination has, whatever its broker: a name, the proxy in front of the broker when
/// there is a network in between, and the relay's sink table for it (fixed once it is started).
pub struct Endpoint {
    name: String,
    proxy: Option<TcpProxy>,
    sink_table: serde_json::Value,
}

impl Endpoint {
    /// A destination the relays reach through `proxy`; `sink_table` builds the relay's sink
    /// table from the proxy's address.
    pub fn proxied(
        name: &str,
        proxy: TcpProxy,
        sink_table: impl FnOnce(SocketAddr) -> serde_json::Value,
    ) -> Self {
        Endpoint {
            name: name.to_owned(),
            sink_table: sink_table(proxy.addr()),
            proxy: Some(proxy),
        }
    }

    /// A destination with no network in between (a file).
    pub fn local(name: &str, sink_table: serde_json::Value) -> Self {
        Endpoint {
            name: name.to_owned(),
            proxy: None,
            sink_table,
        }
    }
}

/// A place events go to and come back from.
#[async_trait]
pub trait Destination: Send + Sync {
    /// Its name, its proxy (if it has one) and the sink table a relay is configured with.
    fn endpoint(&self) -> &Endpoint;

    /// The harness's name for it: the `[destinations.<name>]` key, and the aggregate type of
    /// the events routed to it.
    fn name(&self) -> &str {
        &self.endpoint().name
    }

    /// The relay's sink table for it (`type` plus that sink's fields), pointing relays at the
    /// proxy in front of the broker.
    fn sink_table(&self) -> serde_json::Value {
        self.endpoint().sink_table.clone()
    }

    /// The proxy between the relays and the broker, for link faults; `None` when there is no
    /// network in between (a file).
    fn proxy(&self) -> Option<&TcpProxy> {
        self.endpoint().proxy.as_ref()
    }

    /// Whether the broker can be stopped and started again without losing what it stored.
    fn can_restart(&self) -> bool {
        false
    }

    /// Stop the broker (only when [`Destination::can_restart`]).
    async fn stop_broker(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Start the broker again.
    async fn start_broker(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Turn an ordinary payload into one this destination's sink always rejects, or `None`
    /// when it has no such payload.
    fn poison(&self, payload: serde_json::Value) -> Option<serde_json::Value> {
        let _ = payload;
        None
    }

    /// Start consuming into `handler` until `stop` turns true.
    async fn start_consumer(
        &self,
        handler: Arc<DestinationHandler>,
        stop: watch::Receiver<bool>,
    ) -> Result<JoinHandle<()>, Error>;

    /// Every event id the broker holds, read back from it directly rather than through the
    /// consumer, or `None` where the broker cannot be read that way. It places a lost event:
    /// never stored by the broker, or stored and never consumed.
    async fn held_by_broker(&self) -> Option<BrokerReadBack> {
        None
    }

    /// Release what it started (broker processes, servers).
    async fn shutdown(&self) {}
}

/// `payload` padded past a sink's `max_message` bytes: the poison of a broker with a size limit.
pub fn oversized(mut payload: serde_json::Value, max_message: usize) -> Option<serde_json::Value> {
    payload["pad"] = serde_json::Value::String("x".repeat(max_message + 1024));
    Some(payload)
}

/// What a broker's log holds at the end of a run, read back directly.
#[derive(Clone, Debug, Default)]
pub struct BrokerReadBack {
    /// Every event id in the log.
    pub held: HashSet<outbox_types::EventId>,
    /// Events not in the log that the broker acknowledged storing at a partition and offset
    /// (as the relays logged the acks): dropped by the broker after its ack.
    pub dropped_after_ack: HashSet<outbox_types::EventId>,
}

/// The consumer side shared by every destination: the consumer's database, its inbox and
/// effects table, and the log of arrivals.
pub struct ConsumerSide {
    pool: PgPool,
    inbox: PgInbox,
    effects: String,
    observed: Mutex<Vec<Observed>>,
    parked: Mutex<Vec<String>>,
    /// Probability that the consumer "crashes" right after committing an effect, before it
    /// acks: the broker redelivers and the inbox must drop the duplicate.
    crash_after_commit: f64,
}

impl ConsumerSide {
    /// Create the inbox and effects tables in `schema` of the consumer database.
    pub async fn setup(pool: PgPool, schema: &str, crash_after_commit: f64) -> Result<Self, Error> {
        let inbox = PgInbox::with_names(schema, "inbox")?;
        inbox.migrate(&pool).await?;
        let effects = format!("\"{schema}\".\"effects\"");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {effects} (event_id UUID PRIMARY KEY, applied INTEGER NOT NULL)"
        )))
        .execute(&pool)
        .await?;
        Ok(ConsumerSide {
            pool,
            inbox,
            effects,
            observed: Mutex::new(Vec::new()),
            parked: Mutex::new(Vec::new()),
            crash_after_commit,
        })
    }

    /// A handler for destination `name`.
    pub fn handler(self: &Arc<Self>, name: &str) -> Arc<DestinationHandler> {
        Arc::new(DestinationHandler {
            side: self.clone(),
            name: name.to_owned(),
            next: AtomicU64::new(0),
        })
    }

    /// Everything received so far.
    pub fn observed(&self) -> Vec<Observed> {
        self.observed.lock().map(|o| o.clone()).unwrap_or_default()
    }

    /// How many messages were received so far.
    pub fn received(&self) -> usize {
        self.observed.lock().map(|o| o.len()).unwrap_or(0)
    }

    /// Messages the inbox adapters parked (should be none).
    pub fn parked(&self) -> Vec<String> {
        self.parked.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// How many times each event's effect ran.
    pub async fn effects(
        &self,
    ) -> Result<std::collections::HashMap<outbox_types::EventId, u32>, Error> {
        let rows: Vec<(uuid::Uuid, i32)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT event_id, applied FROM {}",
            self.effects
        )))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, n)| {
                (
                    outbox_types::EventId::from_uuid(id),
                    u32::try_from(n).unwrap_or(0),
                )
            })
            .collect())
    }
}

/// Records every arrival at one destination and applies the effect through the inbox.
pub struct DestinationHandler {
    side: Arc<ConsumerSide>,
    name: String,
    next: AtomicU64,
}

impl DestinationHandler {
    /// The destination's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Record one arrival (call once per message received, before handling it).
    pub fn record(&self, event_id: Option<outbox_types::EventId>, payload: &[u8]) {
        let parsed: Option<serde_json::Value> = serde_json::from_slice(payload).ok();
        let aggregate = parsed
            .as_ref()
            .and_then(|p| p.get("agg"))
            .and_then(|a| a.as_str())
            .map(str::to_owned);
        let seq = parsed
            .as_ref()
            .and_then(|p| p.get("seq"))
            .and_then(serde_json::Value::as_u64);
        if let Ok(mut observed) = self.side.observed.lock() {
            let index = self.next.fetch_add(1, Ordering::SeqCst);
            observed.push(Observed {
                destination: self.name.clone(),
                index,
                event_id,
                aggregate,
                seq,
                received_unix_ms: Some(crate::history::unix_ms()),
            });
        }
    }

    /// Apply the effect for `delivery` (without recording it).
    pub async fn apply(&self, delivery: &Delivery) -> Result<Processed<()>, outbox_inbox::Error> {
        let side = &self.side;
        let mut tx = side.pool.begin().await?;
        match side
            .inbox
            .claim(&mut *tx, delivery.event_id, HANDLER)
            .await?
        {
            InboxClaim::Duplicate => Ok(Processed::Duplicate),
            InboxClaim::Fresh => {
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {t} (event_id, applied) VALUES ($1, 1)
                     ON CONFLICT (event_id) DO UPDATE SET applied = {t}.applied + 1",
                    t = side.effects
                )))
                .bind(delivery.event_id.as_uuid())
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                if side.crash_after_commit > 0.0 && rand::random::<f64>() < side.crash_after_commit
                {
                    return Err(outbox_inbox::Error::Handler(
                        "injected fault: the consumer crashed after its commit, before the ack"
                            .into(),
                    ));
                }
                Ok(Processed::Applied(()))
            }
        }
    }
}

#[async_trait]
impl InboxHandler for DestinationHandler {
    async fn handle(&self, delivery: &Delivery) -> Result<Processed<()>, outbox_inbox::Error> {
        self.record(Some(delivery.event_id), &delivery.payload);
        self.apply(delivery).await
    }

    async fn park(&self, message: &ParkedMessage) -> Result<(), outbox_inbox::Error> {
        if let Ok(mut parked) = self.side.parked.lock() {
            parked.push(format!(
                "{}: {:?} after {} attempts: {}",
                self.name, message.event_id, message.attempts, message.error
            ));
        }
        self.side
            .inbox
            .park(&self.side.pool, HANDLER, message)
            .await
    }
}
