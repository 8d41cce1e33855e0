//! [`WalSource`]: the replication stream as a [`Source`] of the one relay engine.
//!
//! The engine (`outbox_engine::Relay`) claims, publishes and settles exactly as it does over the
//! table; this source decides where each claim's events come from (see the `state` module for
//! the rules):
//!
//! - **from the stream** — events decoded from the WAL, handed out without writing anything to
//!   claim them. Their settlement is written back in batches by a writer task (one `UPDATE` to
//!   mark rows delivered, or a `DELETE` when nothing delivered is kept), and the slot's position
//!   moves past them only once that write committed;
//! - **from the table** — claims like the polling relay's, under a lease, for everything the
//!   table owns: retries waiting for their backoff, events held behind a dead one, events of a
//!   paused destination, rows requeued or replayed by an operator, rows left undelivered when
//!   the session started.
//!
//! A failed stream event is not retried in memory: it goes to the table (a row updated with its
//! attempt and backoff, or a message inserted as a row) together with every later event of its
//! aggregate, and table claims take them up in order. So a destination that is down costs no
//! memory and does not hold the slot: the stream keeps moving for everything else.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_postgresql::PgStore;
use outbox_types::{
    BuryEvent, Claim, ClaimRequest, DeadLetterPolicy, Event, Lease, PausedDestination, RetryEvent,
    Source, Store, StoreError,
};
use sqlx::PgPool;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::config::{Source as Capture, WalConfig};
use crate::counters::{WalCounters, WalReport, add};
use crate::db::{self, MessageRow};
use crate::error::WalError;
use crate::state::{Item, Origin, Out, State};
use crate::stream;

/// How long settled stream events wait for their write, so a trickle of events does not cost
/// one statement each. Only the confirmed WAL position waits for it, not delivery. This is
/// the wait when a failure, a hand-back or a dead item is among them: the table takes those
/// over once written, so they are written soon.
const WRITE_DELAY: Duration = Duration::from_millis(20);

/// The wait when only delivered rows are to be marked: nothing but the confirmed position and
/// what `outbox status` shows waits for that write, so it gathers more rows per statement (at
/// 2,000 events/s, about 200 instead of 40; one statement was 13 % of the relay's CPU at 20 ms).
/// A thousand waiting settlements are written at once either way.
const DELIVERED_WRITE_DELAY: Duration = Duration::from_millis(100);

/// How often the aggregates the table owns are checked against the table (an operator may have
/// discarded the dead event that held one).
const RECONCILE_EVERY: Duration = Duration::from_secs(5);

/// How often an idle table (it owns no aggregate and had nothing at the last claim: only an
/// operator's requeue or replay, or a lease running out, can give it events then) is asked,
/// off the claim path, whether it has anything due. Claiming from it at every poll put a claim
/// query in front of the stream's claims: at 500 events/s that tripled the stream's p99.
const IDLE_TABLE_EVERY: Duration = Duration::from_secs(1);

/// What the stream task and the source share.
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Events are waiting to be claimed.
    pub work: Notify,
    /// Room was freed (the stream may read on), or the position may move.
    pub room: Notify,
    /// Whether the stream task needs [`Shared::room`] when events settle: it waits for room,
    /// or has no confirmation timer armed. Otherwise an ack at a trickle of events would wake
    /// it once per event for nothing (its timer confirms the newest position anyway).
    wants_settlements: AtomicBool,
    /// Whether this instance streams the slot now (a standby claims nothing).
    leading: AtomicBool,
    /// What stopped the stream for good (a lost slot, a server not set up): the relay stops.
    fatal: Mutex<Option<WalError>>,
    /// With a drain: the WAL position to reach (set once the session started).
    drain_target: Mutex<Option<crate::Lsn>>,
    pub counters: Arc<WalCounters>,
}

impl Shared {
    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_leading(&self, leading: bool) {
        self.leading.store(leading, Ordering::SeqCst);
        self.counters
            .role
            .store(if leading { 2 } else { 0 }, Ordering::SeqCst);
        self.work.notify_one();
    }

    /// Events settled: wake the stream task if it waits for that (see `wants_settlements`).
    pub fn settled(&self) {
        if self.wants_settlements.load(Ordering::SeqCst) {
            self.room.notify_one();
        }
    }

    /// The stream task says whether it needs [`Shared::settled`] to wake it.
    pub fn want_settlements(&self, wanted: bool) {
        self.wants_settlements.store(wanted, Ordering::SeqCst);
    }

    pub fn set_standing_by(&self) {
        self.counters.role.store(1, Ordering::SeqCst);
    }

    pub fn is_leading(&self) -> bool {
        self.leading.load(Ordering::SeqCst)
    }

    pub fn set_fatal(&self, error: WalError) {
        *self.fatal.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
        self.work.notify_one();
    }

    pub fn set_drain_target(&self, target: Option<crate::Lsn>) {
        *self.drain_target.lock().unwrap_or_else(|p| p.into_inner()) = target;
    }
}

/// A retry or bury request of one event, for [`WalSource::settle_stream`].
trait Settling: Clone {
    fn seq(&self) -> i64;
    /// The row a message this request settles is inserted as.
    fn message_row(&self, event: Event) -> MessageRow;
    /// Count `n` settled requests (retries are counted; buries are the relay's to count).
    fn count(counters: &WalCounters, n: u64);
    /// Where the table rows it settles wait for the writer task.
    fn waiting(writes: &mut Writes) -> &mut Vec<(Self, Out)>;
}

impl Settling for RetryEvent {
    fn seq(&self) -> i64 {
        self.seq
    }

    fn message_row(&self, event: Event) -> MessageRow {
        let attempts = event.attempts + u32::from(self.counts_attempt);
        MessageRow::pending(event, attempts, Some(self.delay), Some(self.error.clone()))
    }

    fn count(counters: &WalCounters, n: u64) {
        add(&counters.retried, n);
    }

    fn waiting(writes: &mut Writes) -> &mut Vec<(Self, Out)> {
        &mut writes.retries
    }
}

impl Settling for BuryEvent {
    fn seq(&self) -> i64 {
        self.seq
    }

    fn message_row(&self, mut event: Event) -> MessageRow {
        event.attempts += 1;
        MessageRow::dead(event, self.error.clone())
    }

    fn count(_: &WalCounters, _: u64) {}

    fn waiting(writes: &mut Writes) -> &mut Vec<(Self, Out)> {
        &mut writes.buried
    }
}

/// What [`settle_rows`] hands the writer task: table rows with their requests, and messages to
/// insert as rows.
type Settled<E> = (Vec<(E, Out)>, Vec<(MessageRow, Out)>);

/// Settle `seqs` of stream lease `token` for a retry or a bury: each settled event with a
/// request in `events` becomes a table row to write (a table event) or a message to insert as
/// a row. With `own`, the table owns their aggregates from now on (a retry always; a bury when
/// dead events block).
fn settle_rows<E: Settling>(
    state: &mut State,
    token: &Uuid,
    seqs: &[i64],
    events: &[E],
    own: bool,
) -> Settled<E> {
    let settled = state.settle_out(token, seqs.iter().copied());
    let mut rows = Vec::new();
    let mut messages = Vec::new();
    for (seq, out) in settled {
        let Some(request) = events.iter().find(|e| e.seq() == seq).cloned() else {
            continue;
        };
        match out.origin {
            Origin::Table => {
                if own {
                    state.own(out.aggregate.clone(), seq);
                }
                rows.push((request, out));
            }
            Origin::Message => {
                if own {
                    state.own_message(out.aggregate.clone());
                }
                if let Some(event) = out.event.clone() {
                    messages.push((request.message_row(event), out));
                }
            }
        }
    }
    (rows, messages)
}

/// Writes waiting for the writer task.
#[derive(Default)]
struct Writes {
    /// Table rows delivered: mark them (or delete them).
    delivered: Vec<(i64, Out)>,
    /// Table rows that failed: back to pending with their attempt, error and next time.
    retries: Vec<(RetryEvent, Out)>,
    /// Table rows given up on.
    buried: Vec<(BuryEvent, Out)>,
    /// Messages that go to the table as rows (handed back, retried, released or buried).
    messages: Vec<(MessageRow, Out)>,
    /// Items the stream could not deliver at all.
    dead_items: Vec<Item>,
    since: Option<Instant>,
}

impl Writes {
    fn is_empty(&self) -> bool {
        self.delivered.is_empty() && self.only_delivered()
    }

    /// Whether nothing but delivered rows waits (or nothing at all).
    fn only_delivered(&self) -> bool {
        self.retries.is_empty()
            && self.buried.is_empty()
            && self.messages.is_empty()
            && self.dead_items.is_empty()
    }

    /// When the writer task writes what waits (see [`WRITE_DELAY`]).
    fn due(&self) -> Option<Instant> {
        let delay = if self.only_delivered() {
            DELIVERED_WRITE_DELAY
        } else {
            WRITE_DELAY
        };
        self.since.map(|since| since + delay)
    }

    fn len(&self) -> usize {
        self.delivered.len()
            + self.retries.len()
            + self.buried.len()
            + self.messages.len()
            + self.dead_items.len()
    }
}

struct Inner {
    cfg: Arc<WalConfig>,
    shared: Arc<Shared>,
    store: PgStore,
    pool: PgPool,
    dead_letter: DeadLetterPolicy,
    poll_interval: Duration,
    writes: Mutex<Writes>,
    write_signal: Notify,
    /// When the table was last claimed from, and whether that claim came back full.
    table: Mutex<TableTurn>,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct TableTurn {
    last: Option<Instant>,
    full: bool,
    /// The last claim (stream or table) was the table's: the stream goes next.
    was_table: bool,
    reconciled: Option<Instant>,
    /// The table had nothing due at the last look.
    empty: bool,
    /// The idle table's watch found something due: claim from it at the next turn.
    due_seen: bool,
}

impl TableTurn {
    /// The table is idle: it owns no aggregate (`owns_none`), had nothing at its last claim,
    /// and its watch has seen nothing due since. Only the watch looks at it then.
    fn idle(&self, owns_none: bool) -> bool {
        owns_none && self.empty && !self.due_seen
    }
}

/// The replication stream as a [`Source`]: hand it to `outbox_engine::Relay` and the engine
/// delivers WAL mode's events with every feature it has. See the module docs.
///
/// ```no_run
/// # async fn demo(sink: std::sync::Arc<dyn outbox_types::Sink>) -> Result<(), outbox_wal::WalError> {
/// use std::sync::Arc;
/// use outbox_postgresql::{PgOutbox, PgStore};
/// use outbox_engine::{Relay, RelayConfig};
/// use outbox_wal::{WalConfig, WalSource};
///
/// let config = WalConfig::new("postgres://relay@db:5432/app");
/// let store = PgStore::connect(&config.database_url, PgOutbox::new()).await?;
/// let relay_config = RelayConfig::default();
/// let source = Arc::new(WalSource::start(config, store, &relay_config).await?);
/// let report = Relay::new(source.clone(), sink, relay_config)
///     .run(async { tokio::signal::ctrl_c().await.ok(); })
///     .await;
/// let wal = source.shutdown().await?;
/// println!("delivered {}, duplicates {}", report.delivered, wal.duplicates);
/// # Ok(()) }
/// ```
pub struct WalSource {
    inner: Arc<Inner>,
}

impl WalSource {
    /// Check `config`, start streaming (or standing by, while another instance streams the
    /// slot) in the background, and return the source. `store` is the outbox table the stream
    /// reads (its layout and names must match `config`); `relay` gives the settings the source
    /// shares with the engine (the dead-letter policy, the poll interval of table claims).
    pub async fn start(
        config: WalConfig,
        store: PgStore,
        relay: &outbox_engine::RelayConfig,
    ) -> Result<WalSource, WalError> {
        Self::start_with(config, store, relay, Arc::new(WalCounters::default())).await
    }

    /// [`WalSource::start`], counting into `counters`.
    pub async fn start_with(
        config: WalConfig,
        store: PgStore,
        relay: &outbox_engine::RelayConfig,
        counters: Arc<WalCounters>,
    ) -> Result<WalSource, WalError> {
        config.validate()?;
        for (source, name, events) in [
            (Capture::Messages, "the message source", "message events"),
            (
                Capture::StreamTable,
                "the stream table source",
                "stream events",
            ),
            (
                Capture::Debezium,
                "the debezium source",
                "Debezium table events",
            ),
        ] {
            if config.captures(source) && store.outbox().partitioning().is_some() {
                return Err(WalError::Config(format!(
                    "{name} with the partitioned layout: WAL mode writes {events} that fail or wait into the outbox table, and does not write the partitioned layout's keys table yet; use `sources = [\"table\"]` with the partitioned layout, or the plain layout"
                )));
            }
        }
        // The settings WAL mode shares with the engine come from the engine's own.
        let from_relay = crate::config::FromRelay {
            relay_id: relay.relay_id.clone(),
            stop_when_caught_up: relay.stop_when_idle,
            limits: crate::limits::Limits {
                max_payload_bytes: relay.max_payload_bytes,
                max_metadata_bytes: relay.max_metadata_bytes,
                messages: config.captures(Capture::Messages),
            },
        };
        let cfg = Arc::new(config);
        let _ = counters.started.set(Instant::now());
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new()),
            work: Notify::new(),
            room: Notify::new(),
            wants_settlements: AtomicBool::new(true),
            leading: AtomicBool::new(false),
            fatal: Mutex::new(None),
            drain_target: Mutex::new(None),
            counters,
        });
        let (stop, stop_rx) = watch::channel(false);
        let pool = store.pool().clone();
        let inner = Arc::new(Inner {
            cfg: cfg.clone(),
            shared: shared.clone(),
            store,
            pool: pool.clone(),
            dead_letter: relay.dead_letter,
            poll_interval: relay.poll_interval,
            writes: Mutex::new(Writes::default()),
            write_signal: Notify::new(),
            table: Mutex::new(TableTurn::default()),
            stop,
            tasks: Mutex::new(Vec::new()),
        });
        let streamer = tokio::spawn(stream::run(
            cfg.clone(),
            from_relay,
            shared.clone(),
            pool,
            relay.dead_letter,
            stop_rx.clone(),
        ));
        let writer = tokio::spawn(write_loop(inner.clone(), stop_rx.clone()));
        let watcher = tokio::spawn(watch_table(inner.clone(), stop_rx));
        inner
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend([streamer, writer, watcher]);
        Ok(WalSource { inner })
    }

    /// Live counters, readable while the relay runs.
    pub fn counters(&self) -> Arc<WalCounters> {
        self.inner.shared.counters.clone()
    }

    /// What stopped the stream for good, if something did.
    pub fn failure(&self) -> Option<String> {
        self.inner
            .shared
            .fatal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|e| e.to_string())
    }

    /// Call once the relay has returned: write back what is settled, confirm the position past
    /// it, and stop streaming. Returns what the stream did, or the error that stopped it.
    pub async fn shutdown(&self) -> Result<WalReport, WalError> {
        self.stop_tasks().await;
        if let Some(error) = self
            .inner
            .shared
            .fatal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            return Err(error);
        }
        Ok(self.inner.shared.counters.report())
    }
}

impl WalSource {
    /// Stop streaming and writing back (what waits is written first). Idempotent.
    async fn stop_tasks(&self) {
        let _ = self.inner.stop.send(true);
        self.inner.write_signal.notify_one();
        let tasks: Vec<JoinHandle<()>> =
            std::mem::take(&mut *self.inner.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for task in tasks {
            let _ = task.await;
        }
    }
}

impl Drop for WalSource {
    fn drop(&mut self) {
        let _ = self.inner.stop.send(true);
    }
}

impl Inner {
    fn table_due_seen(&self) -> bool {
        self.table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .due_seen
    }

    /// Queue writes for the writer task, and wake it: when the queue was empty (so it starts
    /// its delay) or is full (so it writes at once).
    fn queue(&self, f: impl FnOnce(&mut Writes)) {
        let mut writes = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let was_empty = writes.since.is_none();
        f(&mut writes);
        writes.since.get_or_insert_with(Instant::now);
        let full = writes.len() >= 1000;
        drop(writes);
        if was_empty || full {
            self.write_signal.notify_one();
        }
    }

    /// One claim from the stream: what may go out now, plus the hand-backs and burials the
    /// look at the waiting events decided.
    async fn claim_stream(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = Uuid::now_v7();
        let taken = {
            let mut state = self.shared.state();
            state.set_paused(request.hold.as_deref());
            state.take(
                request.limit as usize,
                request.max_batch_bytes,
                request.hold.as_deref(),
                token,
            )
        };
        let buried = taken.dead.len() as u64;
        if !taken.hand_back.is_empty() || !taken.dead.is_empty() {
            let mut messages = Vec::with_capacity(taken.hand_back.len());
            for (event, out) in taken.hand_back {
                messages.push((MessageRow::pending(event, 0, None, None), out));
            }
            // An unreadable item under the block policy holds its aggregate like any dead event.
            if self.dead_letter == DeadLetterPolicy::Block {
                let mut state = self.shared.state();
                for item in &taken.dead {
                    if item.origin == Origin::Table && !item.event.aggregate_id.is_empty() {
                        state.own(item.aggregate(), item.event.seq);
                    } else if item.origin == Origin::Message {
                        state.own_message(item.aggregate());
                    }
                }
            }
            add(&self.shared.counters.handed_back, messages.len() as u64);
            self.queue(|w| {
                w.messages.extend(messages);
                w.dead_items.extend(taken.dead);
            });
            self.write_signal.notify_one();
        }
        let mut events = taken.batch;
        if !taken.check.is_empty() {
            // Rows the table may have settled (or be delivering) already: never twice.
            let settled = db::not_pending(&self.pool, &self.cfg, &taken.check)
                .await
                .unwrap_or_else(|error| {
                    tracing::debug!(%error, "Duplicate check failed; publishing anyway.");
                    HashSet::new()
                });
            if !settled.is_empty() {
                events.retain(|e| !settled.contains(&e.seq));
                let mut state = self.shared.state();
                for (seq, out) in state.settle_out(&token, settled.iter().copied()) {
                    state.finish_out(seq, &out);
                }
                add(&self.shared.counters.skipped, settled.len() as u64);
            }
        }
        add(&self.shared.counters.claimed, events.len() as u64);
        Ok(Claim {
            lease: Lease {
                owner: request.owner.clone(),
                token,
            },
            events,
            buried,
        })
    }

    /// One claim from the table, bounded below what the stream holds and within what it saw.
    async fn claim_table(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let bound = self
            .shared
            .state()
            .table_bound(self.cfg.captures(Capture::Table));
        if bound <= 0 {
            tracing::debug!(state = %self.shared.state().summary(), "No table claim: the stream holds the lowest rows.");
            return Ok(Claim {
                lease: Lease {
                    owner: request.owner.clone(),
                    // Nothing is leased: no token to make (the engine never settles an empty
                    // claim).
                    token: Uuid::nil(),
                },
                events: Vec::new(),
                buried: 0,
            });
        }
        let mut bounded = request.clone();
        bounded.up_to_seq = Some(request.up_to_seq.map_or(bound, |b| b.min(bound)));
        let claim = Store::claim(&self.store, &bounded).await?;
        tracing::debug!(
            bound,
            claimed = claim.events.len(),
            owned = self.shared.state().owned_count(),
            "Table claim."
        );
        self.shared
            .state()
            .table_claimed(claim.lease.token, &claim.events);
        add(&self.shared.counters.from_table, claim.events.len() as u64);
        Ok(claim)
    }

    /// Forget owned events the table no longer holds open, every few seconds.
    async fn reconcile(&self) {
        let due = {
            let mut turn = self.table.lock().unwrap_or_else(|p| p.into_inner());
            let due = turn
                .reconciled
                .is_none_or(|at| at.elapsed() >= RECONCILE_EVERY);
            if due {
                turn.reconciled = Some(Instant::now());
            }
            due
        };
        if !due {
            return;
        }
        let seqs = self.shared.state().owned_seqs();
        if seqs.is_empty() {
            return;
        }
        match db::gone(&self.pool, &self.cfg, &seqs, self.dead_letter).await {
            Ok(gone) => self.shared.state().reconcile(&gone),
            Err(error) => tracing::debug!(%error, "Could not check the aggregates the table owns."),
        }
    }
}

#[async_trait]
impl Source for WalSource {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let inner = &self.inner;
        if let Some(error) = inner
            .shared
            .fatal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(StoreError::Stopped(error.to_string()));
        }
        let empty = || Claim {
            lease: Lease {
                owner: request.owner.clone(),
                token: Uuid::nil(),
            },
            events: Vec::new(),
            buried: 0,
        };
        if !inner.shared.is_leading() {
            return Ok(empty());
        }
        inner.reconcile().await;
        let (stream_waiting, table_idle) = {
            let state = inner.shared.state();
            (state.has_ready(), state.owned_count() == 0)
        };
        let table_turn = {
            let turn = inner.table.lock().unwrap_or_else(|p| p.into_inner());
            // An idle table is claimed from only once its watch saw something due.
            let idle = turn.idle(table_idle);
            // The watch's finding makes the turn due at once: `work_ready` wakes the relay on it,
            // and waiting for the poll interval here would spin that wakeup.
            let due = turn.last.is_none_or(|at| {
                turn.full || turn.due_seen || (!idle && at.elapsed() >= inner.poll_interval)
            });
            due && !(turn.was_table && stream_waiting)
        };
        if table_turn {
            let claim = inner.claim_table(request).await?;
            let mut turn = inner.table.lock().unwrap_or_else(|p| p.into_inner());
            turn.last = Some(Instant::now());
            turn.full = claim.events.len() >= request.limit as usize;
            // A claim that skipped a deferred destination (the relay's fair turn) and found
            // nothing else says nothing about that destination's rows: the table is not known
            // to be empty (a drain would stop with them pending), and the next claim is a table
            // turn at once.
            let skipped = request
                .hold
                .as_ref()
                .is_some_and(|h| !h.deferred.is_empty());
            turn.empty = claim.events.is_empty() && !skipped;
            turn.due_seen = claim.events.is_empty() && skipped;
            if !claim.events.is_empty() {
                turn.was_table = true;
                return Ok(claim);
            }
        }
        inner
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .was_table = false;
        if stream_waiting {
            return inner.claim_stream(request).await;
        }
        Ok(empty())
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        let inner = &self.inner;
        if let Some(written) = self
            .table_write(lease, seqs, true, || Store::ack(&inner.store, lease, seqs))
            .await
        {
            return written;
        }
        let settled = {
            let mut state = inner.shared.state();
            let settled = state.settle_out(&lease.token, seqs.iter().copied());
            // Messages need no write: they are settled now.
            for (seq, out) in settled.iter().filter(|(_, o)| o.origin == Origin::Message) {
                state.finish_out(*seq, out);
            }
            settled
        };
        let n = settled.len() as u64;
        add(&inner.shared.counters.delivered, n);
        let rows: Vec<(i64, Out)> = settled
            .into_iter()
            .filter(|(_, o)| o.origin == Origin::Table)
            .collect();
        if !rows.is_empty() {
            inner.queue(|w| w.delivered.extend(rows));
        }
        inner.shared.settled();
        Ok(n)
    }

    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError> {
        let inner = &self.inner;
        self.settle(lease, events, false, true, || {
            Store::retry(&inner.store, lease, events)
        })
        .await
    }

    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError> {
        let inner = &self.inner;
        let block = inner.dead_letter == DeadLetterPolicy::Block;
        self.settle(lease, events, !block, block, || {
            Store::bury(&inner.store, lease, events)
        })
        .await
    }

    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        let inner = &self.inner;
        if let Some(written) = self
            .table_write(lease, seqs, false, || {
                Store::release(&inner.store, lease, seqs)
            })
            .await
        {
            return written;
        }
        let mut state = inner.shared.state();
        // Given back unpublished: the table takes them (a row is there already; a message is
        // inserted), behind the failed event that held them or for the next relay.
        let settled = state.settle_out(&lease.token, seqs.iter().copied());
        let mut messages = Vec::new();
        let n = settled.len() as u64;
        for (seq, out) in settled {
            match out.origin {
                Origin::Table => {
                    state.own(out.aggregate.clone(), seq);
                    state.finish_out(seq, &out);
                }
                Origin::Message => {
                    state.own_message(out.aggregate.clone());
                    if let Some(event) = out.event.clone() {
                        let attempts = event.attempts;
                        messages.push((MessageRow::pending(event, attempts, None, None), out));
                    }
                }
            }
        }
        drop(state);
        add(&inner.shared.counters.handed_back, n);
        if !messages.is_empty() {
            inner.queue(|w| w.messages.extend(messages));
            inner.write_signal.notify_one();
        }
        inner.shared.room.notify_one();
        Ok(n)
    }

    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError> {
        Store::paused(&self.inner.store).await
    }

    async fn work_ready(&self) {
        let inner = &self.inner;
        loop {
            let notified = inner.shared.work.notified();
            if inner.shared.is_leading()
                && (inner.shared.state().has_ready() || inner.table_due_seen())
            {
                return;
            }
            notified.await;
        }
    }

    async fn close(&self) {
        self.stop_tasks().await;
    }

    fn exhausted(&self) -> bool {
        let inner = &self.inner;
        let target = *inner
            .shared
            .drain_target
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(target) = target else {
            // Not draining, or the session has not started yet.
            return inner
                .shared
                .fatal
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some();
        };
        let state = inner.shared.state();
        let writes_empty = inner
            .writes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty();
        let table_empty = inner.table.lock().unwrap_or_else(|p| p.into_inner()).empty;
        state.ack() >= target && state.is_idle() && writes_empty && table_empty
    }

    fn kind(&self) -> &'static str {
        "wal"
    }
}

impl WalSource {
    /// The write-back of a lease the table's store claimed (not the stream): `write`, the
    /// store's own write, then [`after_table_write`](Self::after_table_write) once it succeeded.
    /// `None` for a stream lease, which the caller settles itself (`write` is not called).
    async fn table_write<F>(
        &self,
        lease: &Lease,
        seqs: &[i64],
        finished: bool,
        write: impl FnOnce() -> F,
    ) -> Option<Result<u64, StoreError>>
    where
        F: Future<Output = Result<u64, StoreError>>,
    {
        if self.inner.shared.state().is_stream_lease(&lease.token) {
            return None;
        }
        Some(
            write()
                .await
                .inspect(|_| self.after_table_write(lease, seqs, finished)),
        )
    }

    /// A retry or bury of `events`: for a table lease the store's `write`, then
    /// [`after_table_write`](Self::after_table_write) with `finished`; for a stream lease
    /// [`settle_stream`](Self::settle_stream) with `own`.
    async fn settle<E: Settling, F>(
        &self,
        lease: &Lease,
        events: &[E],
        finished: bool,
        own: bool,
        write: impl FnOnce() -> F,
    ) -> Result<u64, StoreError>
    where
        F: Future<Output = Result<u64, StoreError>>,
    {
        let seqs: Vec<i64> = events.iter().map(Settling::seq).collect();
        if let Some(written) = self.table_write(lease, &seqs, finished, write).await {
            return written;
        }
        Ok(self.settle_stream(lease, &seqs, events, own))
    }

    /// Events of a table claim were written back by the table's store: the aggregates of the
    /// events it `finished` (delivered, or dead under `skip`) go back to the stream once the
    /// table holds nothing else of them.
    fn after_table_write(&self, lease: &Lease, seqs: &[i64], finished: bool) {
        let mut state = self.inner.shared.state();
        if finished {
            for (seq, aggregate) in state.table_events(&lease.token, seqs) {
                state.table_done(&aggregate, seq);
            }
        }
        state.end_table_lease(&lease.token, seqs);
    }

    /// A retry or bury of stream lease `lease`: [`settle_rows`] (with `own`, see there), then
    /// the rows and messages queued for the writer task, woken. Returns how many were settled.
    fn settle_stream<E: Settling>(
        &self,
        lease: &Lease,
        seqs: &[i64],
        events: &[E],
        own: bool,
    ) -> u64 {
        let inner = &self.inner;
        let (rows, messages) =
            settle_rows(&mut inner.shared.state(), &lease.token, seqs, events, own);
        let n = (rows.len() + messages.len()) as u64;
        E::count(&inner.shared.counters, n);
        inner.queue(|w| {
            E::waiting(w).extend(rows);
            w.messages.extend(messages);
        });
        inner.write_signal.notify_one();
        n
    }
}

/// The idle table's watch: every [`IDLE_TABLE_EVERY`], while the table is idle, ask it whether a
/// claim would find anything, and wake the relay when it would.
async fn watch_table(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(IDLE_TABLE_EVERY) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let bound = {
            let state = inner.shared.state();
            let idle = inner
                .table
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .idle(state.owned_count() == 0);
            if !idle || !inner.shared.is_leading() {
                continue;
            }
            state.table_bound(inner.cfg.captures(Capture::Table))
        };
        if bound <= 0 {
            continue;
        }
        match db::any_due(&inner.pool, &inner.cfg, bound).await {
            Ok(true) => {
                inner
                    .table
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .due_seen = true;
                inner.shared.work.notify_one();
            }
            Ok(false) => {}
            // The next claim's turn finds the database down and says so; not the watch's job.
            Err(error) => tracing::debug!(%error, "Could not ask the table for due rows."),
        }
    }
}

/// The writer task: every [`WRITE_DELAY`] (or at once when a thousand settlements wait), write
/// the settled stream events back and let their positions go. A write that fails is retried
/// (nothing is confirmed meanwhile); when the source stops, what waits is written first.
async fn write_loop(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    let mut failures = 0u32;
    loop {
        let stopping = *stop.borrow();
        let due = {
            let writes = inner.writes.lock().unwrap_or_else(|p| p.into_inner());
            writes.due()
        };
        if !stopping {
            match due {
                Some(at) if at > Instant::now() => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = inner.write_signal.notified() => {}
                        _ = stop.changed() => {}
                    }
                }
                Some(_) => {}
                None => {
                    tokio::select! {
                        _ = inner.write_signal.notified() => {}
                        _ = stop.changed() => {}
                    }
                    continue;
                }
            }
        }
        let batch = std::mem::take(&mut *inner.writes.lock().unwrap_or_else(|p| p.into_inner()));
        if batch.is_empty() {
            if stopping {
                return;
            }
            continue;
        }
        match write(&inner, &batch).await {
            Ok(inserted) => {
                failures = 0;
                finish(&inner, batch, inserted);
            }
            Err(error) => {
                failures += 1;
                let pause = db::backoff(failures, inner.cfg.max_reconnect_backoff);
                tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, "Write-back to the outbox table failed; retrying. Nothing is confirmed meanwhile.");
                // Put it back in front of what came since.
                {
                    let mut writes = inner.writes.lock().unwrap_or_else(|p| p.into_inner());
                    let newer = std::mem::replace(&mut *writes, batch);
                    writes.delivered.extend(newer.delivered);
                    writes.retries.extend(newer.retries);
                    writes.buried.extend(newer.buried);
                    writes.messages.extend(newer.messages);
                    writes.dead_items.extend(newer.dead_items);
                    writes.since = Some(Instant::now());
                }
                if stopping && failures > 5 {
                    tracing::warn!(
                        "Stopping with write-backs undone; those events will be delivered again."
                    );
                    return;
                }
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// Perform one batch of writes; returns what became of the rows inserted for messages, in
/// order (see [`db::insert_messages`]).
async fn write(inner: &Inner, batch: &Writes) -> Result<Vec<db::Inserted>, WalError> {
    let cfg = &inner.cfg;
    let pool = &inner.pool;
    if !batch.delivered.is_empty() {
        let seqs: Vec<i64> = batch.delivered.iter().map(|(s, _)| *s).collect();
        let (marked, already) = db::settle_delivered(pool, cfg, &seqs).await?;
        add(&inner.shared.counters.marked_delivered, marked);
        add(&inner.shared.counters.already_delivered, already);
    }
    if !batch.retries.is_empty() {
        let retries: Vec<&RetryEvent> = batch.retries.iter().map(|(r, _)| r).collect();
        db::retry_rows(pool, cfg, &retries).await?;
    }
    let mut dead_rows: Vec<(i64, u32, String)> = batch
        .buried
        .iter()
        .map(|(b, _)| (b.seq, 0, b.error.clone()))
        .collect();
    let mut rows: Vec<MessageRow> = batch.messages.iter().map(|(m, _)| m.clone()).collect();
    for item in &batch.dead_items {
        let error = item.dead.clone().unwrap_or_default();
        match item.origin {
            Origin::Table => dead_rows.push((item.event.seq, item.event.attempts, error)),
            Origin::Message => rows.push(MessageRow::dead(item.event.clone(), error)),
        }
    }
    if !dead_rows.is_empty() {
        let n = db::bury_rows(pool, cfg, &dead_rows).await?;
        add(&inner.shared.counters.dead, n);
    }
    let inserted = if rows.is_empty() {
        Vec::new()
    } else {
        db::insert_messages(pool, cfg, &rows).await?
    };
    let dead_messages = rows
        .iter()
        .zip(&inserted)
        .filter(|(r, i)| r.is_dead() || i.cut)
        .count() as u64;
    add(&inner.shared.counters.dead, dead_messages);
    Ok(inserted)
}

/// The writes of `batch` are durable: let their positions go, and tell the state the seqs of
/// the rows inserted for messages.
fn finish(inner: &Inner, batch: Writes, inserted: Vec<db::Inserted>) {
    let mut state = inner.shared.state();
    for (seq, out) in batch.delivered.iter() {
        state.finish_out(*seq, out);
    }
    for (retry, out) in batch.retries.iter() {
        state.finish_out(retry.seq, out);
    }
    for (bury, out) in batch.buried.iter() {
        state.finish_out(bury.seq, out);
    }
    // A row the table refused as it was is dead (in cut form), whatever it was to be.
    let owned_by_table = |row: &MessageRow, written: db::Inserted| {
        !(row.is_dead() || written.cut) || inner.dead_letter == DeadLetterPolicy::Block
    };
    for (i, (row, out)) in batch.messages.iter().enumerate() {
        let written = inserted.get(i).copied().unwrap_or_default();
        let seq = written.seq;
        if owned_by_table(row, written) {
            state.inserted(&out.aggregate, seq);
        }
        state.written(out);
    }
    let offset = batch.messages.len();
    let mut message_dead = 0usize;
    for item in batch.dead_items.iter() {
        if item.origin == Origin::Message {
            let seq = inserted
                .get(offset + message_dead)
                .and_then(|written| written.seq);
            message_dead += 1;
            if inner.dead_letter == DeadLetterPolicy::Block {
                state.inserted(&item.aggregate(), seq);
            }
        }
        state.buried_item(item);
    }
    drop(state);
    inner.shared.room.notify_one();
    inner.shared.work.notify_one();
}
