//! The delivery engine: per-aggregate queues, waves to the sink, retries, dead letters, and the
//! bookkeeping that decides which WAL position may be confirmed.
//!
//! # Which position is safe to confirm
//!
//! PostgreSQL re-sends, after a restart, every transaction whose commit record lies at or after
//! the slot's confirmed position. So the relay confirms the *end* of a transaction's commit
//! record only once every event of that transaction **and of every earlier transaction** is
//! settled: delivered (and, for table rows, marked `delivered`) or durably dead-lettered. Events
//! of one transaction may settle out of order (different aggregates go in parallel); the
//! confirmed position only moves over a contiguous prefix of settled transactions. Confirming
//! anything earlier than the sink's ack is what loses events; confirming later only costs
//! duplicates after a crash.
//!
//! # Order and waves
//!
//! Events go into a queue per aggregate in stream (= commit) order. A *wave* takes the head of up
//! to `max_batch` ready aggregates and hands them to the sink in one call, so one call holds at
//! most one event per aggregate (the `Sink` contract) and aggregates proceed in parallel; up to
//! `max_batches_in_flight` waves run at once. An aggregate's next event is published only after
//! the previous one settled. A retryable failure keeps the event at the head of its queue until
//! its backoff passes; other aggregates go on.
//!
//! # Memory
//!
//! The engine counts decoded events and payload bytes it holds; past the configured bounds the
//! caller stops reading the replication stream, which stops the client's bounded buffer, which
//! stops TCP, which stops the walsender. A huge transaction is therefore delivered as it streams
//! in (pgoutput v1 only sends committed transactions), never held whole.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use outbox_core::{Event, Outcome, truncate_error};
use serde::Serialize;

use crate::config::WalConfig;
use crate::lsn::Lsn;

/// Where an event came from: decides how it is marked delivered or dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// A row of the outbox table (its `seq` is the row's primary key).
    Table,
    /// A logical message (its `seq` is the message's LSN).
    Message,
}

/// What travels with an event inside the engine.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Meta {
    /// The transaction it belongs to (`None` for rows read by the catch-up scan).
    pub tx: Option<u64>,
    pub origin: Origin,
    pub bytes: usize,
    /// Whether to check the row's status before publishing (it may have been delivered by the
    /// catch-up scan already).
    pub check: bool,
    /// When it was decoded (publish latency).
    pub decoded_at: Instant,
}

/// What became of one event of a wave.
#[derive(Clone, Debug)]
pub(crate) enum Settle {
    Sink(Outcome),
    /// Already delivered or dead in the table: not published again.
    Skipped,
}

/// An item handed to a wave and back.
pub(crate) struct Item {
    pub agg: usize,
    pub event: Event,
    pub meta: Meta,
}

/// A dead letter waiting to be written.
pub(crate) struct Dead {
    pub event: Event,
    pub meta: Meta,
    pub error: String,
}

/// The writes one write-back batch makes.
#[derive(Default)]
pub(crate) struct WriteBack {
    /// Table rows to mark delivered: `(seq, tx)`.
    pub delivered: Vec<(i64, Option<u64>)>,
    /// Events to dead-letter.
    pub dead: Vec<Dead>,
}

impl WriteBack {
    pub fn is_empty(&self) -> bool {
        self.delivered.is_empty() && self.dead.is_empty()
    }
}

/// What a finished write-back reports.
pub(crate) struct WriteBackDone {
    pub txs: Vec<Option<u64>>,
    pub marked: u64,
    pub already_done: u64,
    pub dead: u64,
}

struct Agg {
    key: String,
    queue: VecDeque<(Event, Meta)>,
    /// In a wave, or waiting for a retry.
    busy: bool,
}

struct Tx {
    end: Option<Lsn>,
    open: u64,
}

/// Live counters of a running WAL relay.
#[derive(Debug, Default)]
pub struct WalCounters {
    pub(crate) decoded: AtomicU64,
    pub(crate) delivered: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) already_delivered: AtomicU64,
    pub(crate) marked_delivered: AtomicU64,
    pub(crate) caught_up: AtomicU64,
    pub(crate) undecodable: AtomicU64,
    pub(crate) messages_ignored: AtomicU64,
    pub(crate) heartbeats: AtomicU64,
    pub(crate) sessions: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) transactions: AtomicU64,
    pub(crate) last_acked_lsn: AtomicU64,
    pub(crate) started: std::sync::OnceLock<Instant>,
}

/// What a WAL relay did: returned by [`WalRelay::run`](crate::WalRelay::run), and readable live
/// through [`WalCounters::report`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WalReport {
    /// Events decoded from the stream (including re-sent ones after a reconnect).
    pub decoded: u64,
    /// Events the sink confirmed.
    pub delivered: u64,
    /// Failed attempts retried.
    pub retried: u64,
    /// Events dead-lettered into the outbox table.
    pub dead: u64,
    /// Events not published because the table already had them delivered or dead.
    pub skipped: u64,
    /// Table rows that were already `delivered` when this relay marked them: each is a
    /// duplicate delivery (after a restart, a takeover or a mode switch).
    pub duplicates: u64,
    /// Table rows marked `delivered`.
    pub marked_delivered: u64,
    /// Events delivered by the catch-up scan of the table (see the crate docs).
    pub caught_up: u64,
    /// Table rows and messages that could not be read as events; each is dead-lettered with
    /// the reason (or, when even its `seq` is unreadable, logged with its position).
    pub undecodable: u64,
    /// Logical messages with the outbox prefix that were ignored because the message source is
    /// off (see the crate docs, "Capture sources").
    pub messages_ignored: u64,
    /// Heartbeat messages seen.
    pub heartbeats: u64,
    /// Transactions seen.
    pub transactions: u64,
    /// Streaming sessions started (1 + reconnects and takeovers).
    pub sessions: u64,
    /// Errors that ended a session (each followed by a reconnect).
    pub errors: u64,
    /// The last WAL position this relay confirmed.
    pub last_acked_lsn: Lsn,
    /// Decoded events per second since the relay started.
    pub decode_rate_per_sec: f64,
}

impl WalCounters {
    /// A snapshot.
    pub fn report(&self) -> WalReport {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let decoded = load(&self.decoded);
        let elapsed = self
            .started
            .get()
            .map(|s| s.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        WalReport {
            decoded,
            delivered: load(&self.delivered),
            retried: load(&self.retried),
            dead: load(&self.dead),
            skipped: load(&self.skipped),
            duplicates: load(&self.already_delivered),
            marked_delivered: load(&self.marked_delivered),
            caught_up: load(&self.caught_up),
            undecodable: load(&self.undecodable),
            messages_ignored: load(&self.messages_ignored),
            heartbeats: load(&self.heartbeats),
            transactions: load(&self.transactions),
            sessions: load(&self.sessions),
            errors: load(&self.errors),
            last_acked_lsn: Lsn(load(&self.last_acked_lsn)),
            decode_rate_per_sec: if elapsed > 0.0 {
                decoded as f64 / elapsed
            } else {
                0.0
            },
        }
    }
}

/// Longest a delivered table row waits for its `delivered` mark (batched with others). Only the
/// confirmed WAL position waits for it, not delivery.
pub(crate) const WRITEBACK_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// The state of one streaming (or catch-up) session.
pub(crate) struct Engine {
    cfg: Arc<WalConfig>,
    counters: Arc<WalCounters>,
    index: HashMap<String, usize>,
    aggs: Vec<Agg>,
    free: Vec<usize>,
    ready: VecDeque<usize>,
    timers: BTreeMap<(Instant, u64), usize>,
    timer_seq: u64,
    txs: VecDeque<Tx>,
    tx_base: u64,
    current_tx: Option<u64>,
    current_commit_time: Option<chrono::DateTime<chrono::Utc>>,
    ack: Lsn,
    buffered_events: usize,
    buffered_bytes: usize,
    writeback: WriteBack,
    writeback_since: Option<Instant>,
    /// Table rows up to this seq may have been delivered by the catch-up scan.
    pub check_high_water: i64,
    latency: metrics::Histogram,
}

impl Engine {
    pub fn new(cfg: Arc<WalConfig>, counters: Arc<WalCounters>, ack: Lsn) -> Self {
        Engine {
            cfg,
            counters,
            index: HashMap::new(),
            aggs: Vec::new(),
            free: Vec::new(),
            ready: VecDeque::new(),
            timers: BTreeMap::new(),
            timer_seq: 0,
            txs: VecDeque::new(),
            tx_base: 0,
            current_tx: None,
            current_commit_time: None,
            ack,
            buffered_events: 0,
            buffered_bytes: 0,
            writeback: WriteBack::default(),
            writeback_since: None,
            check_high_water: 0,
            latency: metrics::histogram!("outbox_wal_decode_to_ack_seconds"),
        }
    }

    /// Whether more events may be read from the stream.
    pub fn has_room(&self) -> bool {
        self.buffered_events < self.cfg.max_buffered_events
            && self.buffered_bytes < self.cfg.max_buffered_bytes
    }

    /// Nothing held: every event read was settled and written back.
    pub fn is_idle(&self) -> bool {
        self.buffered_events == 0 && self.writeback.is_empty() && self.txs.is_empty()
    }

    /// The newest position that may be confirmed.
    pub fn ack(&self) -> Lsn {
        self.ack
    }

    /// The commit time of the transaction being read (`enqueued_at` of message events).
    pub fn commit_time(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        self.current_commit_time
    }

    pub fn begin(&mut self, commit_time: chrono::DateTime<chrono::Utc>) {
        let id = self.tx_base + self.txs.len() as u64;
        self.txs.push_back(Tx { end: None, open: 0 });
        self.current_tx = Some(id);
        self.current_commit_time = Some(commit_time);
        add(&self.counters.transactions, 1);
    }

    pub fn commit(&mut self, end: Lsn) {
        if let Some(id) = self.current_tx.take() {
            if let Some(tx) = self.tx_mut(id) {
                tx.end = Some(end);
            }
        } else {
            // A commit without a begin (cannot happen with pgoutput): confirm nothing new.
            tracing::warn!(%end, "Commit without Begin in the replication stream.");
        }
        self.current_commit_time = None;
        self.advance();
    }

    /// A keepalive: with nothing open, everything up to `wal_end` is settled.
    pub fn keepalive(&mut self, wal_end: Lsn) {
        if self.txs.is_empty() && self.current_tx.is_none() && wal_end > self.ack {
            self.ack = wal_end;
        }
    }

    fn tx_mut(&mut self, id: u64) -> Option<&mut Tx> {
        let i = id.checked_sub(self.tx_base)?;
        self.txs.get_mut(usize::try_from(i).ok()?)
    }

    fn advance(&mut self) {
        while let Some(front) = self.txs.front() {
            match front.end {
                Some(end) if front.open == 0 => {
                    if end > self.ack {
                        self.ack = end;
                    }
                    self.txs.pop_front();
                    self.tx_base += 1;
                }
                _ => break,
            }
        }
    }

    fn settle(&mut self, tx: Option<u64>) {
        if let Some(id) = tx {
            if let Some(t) = self.tx_mut(id) {
                t.open = t.open.saturating_sub(1);
            }
            self.advance();
        }
    }

    /// The transaction an event joins: the current one (`in_tx`), a standalone
    /// non-transactional message that ends at `standalone_end`, or none (the catch-up scan).
    /// The transaction's position is held until the event settles.
    fn join_tx(&mut self, in_tx: bool, standalone_end: Option<Lsn>) -> Option<u64> {
        let tx = if in_tx {
            self.current_tx
        } else if let Some(end) = standalone_end {
            let id = self.tx_base + self.txs.len() as u64;
            self.txs.push_back(Tx {
                end: Some(end),
                open: 0,
            });
            Some(id)
        } else {
            None
        };
        if let Some(id) = tx
            && let Some(t) = self.tx_mut(id)
        {
            t.open += 1;
        }
        tx
    }

    /// Add an event of the current transaction (`in_tx`), of a standalone non-transactional
    /// message that ends at `standalone_end`, or of the catch-up scan (neither).
    pub fn push(
        &mut self,
        mut event: Event,
        origin: Origin,
        in_tx: bool,
        standalone_end: Option<Lsn>,
    ) {
        let size = event.payload.len() as u64;
        if size > self.cfg.max_payload_bytes {
            let error =
                outbox_core::bury_oversized(event.seq, size, self.cfg.max_payload_bytes).error;
            // A table row keeps its payload in the table; a message's dead row needs it.
            if origin == Origin::Table {
                event.payload = String::new();
            }
            self.push_dead(event, origin, in_tx, standalone_end, error);
            return;
        }
        let tx = self.join_tx(in_tx, standalone_end);
        let check = origin == Origin::Table && tx.is_some() && event.seq <= self.check_high_water;
        let meta = Meta {
            tx,
            origin,
            bytes: event.payload.len() + 64,
            check,
            decoded_at: Instant::now(),
        };
        add(&self.counters.decoded, 1);
        self.buffered_events += 1;
        self.buffered_bytes += meta.bytes;

        let mut key =
            String::with_capacity(event.aggregate_type.len() + event.aggregate_id.len() + 1);
        key.push_str(&event.aggregate_type);
        key.push('\u{0}');
        key.push_str(&event.aggregate_id);
        let slot = match self.index.get(&key) {
            Some(&slot) => slot,
            None => {
                let agg = Agg {
                    key: key.clone(),
                    queue: VecDeque::new(),
                    busy: false,
                };
                let slot = match self.free.pop() {
                    Some(slot) => {
                        self.aggs[slot] = agg;
                        slot
                    }
                    None => {
                        self.aggs.push(agg);
                        self.aggs.len() - 1
                    }
                };
                self.index.insert(key, slot);
                slot
            }
        };
        let agg = &mut self.aggs[slot];
        let was_empty = agg.queue.is_empty();
        agg.queue.push_back((event, meta));
        if was_empty && !agg.busy {
            self.ready.push_back(slot);
        }
    }

    /// An item that cannot be read as an event (a malformed row or message): it goes straight
    /// to the dead letters with `error`, never to the sink, and holds its transaction's
    /// position only until the dead letter is written. Its aggregate is not held either.
    pub fn push_dead(
        &mut self,
        event: Event,
        origin: Origin,
        in_tx: bool,
        standalone_end: Option<Lsn>,
        error: String,
    ) {
        let tx = self.join_tx(in_tx, standalone_end);
        let meta = Meta {
            tx,
            origin,
            bytes: event.payload.len() + 64,
            check: false,
            decoded_at: Instant::now(),
        };
        add(&self.counters.decoded, 1);
        add(&self.counters.undecodable, 1);
        self.buffered_events += 1;
        self.buffered_bytes += meta.bytes;
        tracing::warn!(
            seq = event.seq,
            origin = ?origin,
            error = %error,
            "An outbox item cannot be read as an event; it is dead-lettered (`outbox dead list` shows it) and the stream moves on."
        );
        self.writeback_since.get_or_insert_with(Instant::now);
        self.writeback.dead.push(Dead {
            event,
            meta,
            error: truncate_error(&error),
        });
    }

    /// The next wave, if an aggregate is ready.
    pub fn next_wave(&mut self) -> Option<Vec<Item>> {
        if self.ready.is_empty() {
            return None;
        }
        let n = self.ready.len().min(self.cfg.max_batch);
        let mut wave = Vec::with_capacity(n);
        for _ in 0..n {
            let Some(slot) = self.ready.pop_front() else {
                break;
            };
            let agg = &mut self.aggs[slot];
            if let Some((event, meta)) = agg.queue.pop_front() {
                agg.busy = true;
                wave.push(Item {
                    agg: slot,
                    event,
                    meta,
                });
            }
        }
        (!wave.is_empty()).then_some(wave)
    }

    fn release(&mut self, meta: &Meta) {
        self.buffered_events = self.buffered_events.saturating_sub(1);
        self.buffered_bytes = self.buffered_bytes.saturating_sub(meta.bytes);
    }

    /// The aggregate's head settled: let its next event go.
    fn next_of(&mut self, slot: usize) {
        let agg = &mut self.aggs[slot];
        agg.busy = false;
        if agg.queue.is_empty() {
            let key = std::mem::take(&mut agg.key);
            self.index.remove(&key);
            self.free.push(slot);
        } else {
            self.ready.push_back(slot);
        }
    }

    /// Record what became of a wave.
    pub fn on_wave(&mut self, items: Vec<Item>, outcomes: Vec<Settle>) {
        let now = Instant::now();
        for (item, settle) in items.into_iter().zip(outcomes) {
            let Item {
                agg,
                mut event,
                meta,
            } = item;
            match settle {
                Settle::Skipped => {
                    add(&self.counters.skipped, 1);
                    self.release(&meta);
                    self.settle(meta.tx);
                    self.next_of(agg);
                }
                Settle::Sink(Outcome::Delivered) => {
                    add(&self.counters.delivered, 1);
                    if meta.tx.is_none() {
                        add(&self.counters.caught_up, 1);
                    }
                    self.latency
                        .record(now.duration_since(meta.decoded_at).as_secs_f64());
                    tracing::debug!(
                        event_id = %event.id,
                        event_type = %event.event_type,
                        aggregate_type = %event.aggregate_type,
                        aggregate_id = %event.aggregate_id,
                        attempts = event.attempts + 1,
                        "Event published."
                    );
                    self.release(&meta);
                    if meta.origin == Origin::Table && self.cfg.mark_delivered {
                        self.writeback_since.get_or_insert(now);
                        self.writeback.delivered.push((event.seq, meta.tx));
                    } else {
                        self.settle(meta.tx);
                    }
                    self.next_of(agg);
                }
                Settle::Sink(Outcome::Retry { reason, after }) => {
                    let failed = event.attempts + 1;
                    if self.cfg.retry.is_exhausted(failed) {
                        event.attempts = failed;
                        self.bury(
                            agg,
                            event,
                            meta,
                            format!("gave up after {failed} attempts: {reason}"),
                        );
                    } else {
                        add(&self.counters.retried, 1);
                        event.attempts = failed;
                        let delay = after.unwrap_or_else(|| {
                            self.cfg.retry.backoff(failed, rand::random::<f64>())
                        });
                        tracing::warn!(
                            event_id = %event.id,
                            event_type = %event.event_type,
                            aggregate_type = %event.aggregate_type,
                            aggregate_id = %event.aggregate_id,
                            idempotency_key = event.idempotency_key.as_deref().unwrap_or(""),
                            attempts = failed,
                            retry_in_ms = delay.as_millis() as u64,
                            error = %reason,
                            "Publish failed; will retry."
                        );
                        self.aggs[agg].queue.push_front((event, meta));
                        self.timer_seq += 1;
                        self.timers.insert((now + delay, self.timer_seq), agg);
                    }
                }
                Settle::Sink(Outcome::Reject { reason }) => {
                    event.attempts += 1;
                    self.bury(agg, event, meta, format!("rejected by the sink: {reason}"));
                }
            }
        }
    }

    fn bury(&mut self, agg: usize, event: Event, meta: Meta, error: String) {
        tracing::warn!(
            event_id = %event.id,
            event_type = %event.event_type,
            aggregate_type = %event.aggregate_type,
            aggregate_id = %event.aggregate_id,
            idempotency_key = event.idempotency_key.as_deref().unwrap_or(""),
            attempts = event.attempts,
            error = %error,
            "Event is dead; it goes to the outbox table for `outbox dead retry` or `discard`."
        );
        self.writeback_since.get_or_insert_with(Instant::now);
        self.writeback.dead.push(Dead {
            event,
            meta,
            error: truncate_error(&error),
        });
        // The dead event stays counted in the buffer until written.
        self.next_of(agg);
    }

    /// When the next retry is due.
    pub fn next_timer(&self) -> Option<Instant> {
        self.timers.keys().next().map(|(at, _)| *at)
    }

    /// Make aggregates whose backoff passed ready again.
    pub fn fire_timers(&mut self, now: Instant) {
        while let Some((&(at, seq), &slot)) = self.timers.iter().next() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, seq));
            self.aggs[slot].busy = false;
            if !self.aggs[slot].queue.is_empty() {
                self.ready.push_back(slot);
            }
        }
    }

    /// When the pending writes should go out at the latest: writes are batched for up to
    /// [`WRITEBACK_DELAY`] so a trickle of events does not cost one UPDATE each.
    pub fn writeback_due(&self) -> Option<Instant> {
        self.writeback_since.map(|since| since + WRITEBACK_DELAY)
    }

    /// Take the pending writes if there are any and they are due (`force`: now).
    pub fn take_writeback(&mut self, force: bool) -> Option<WriteBack> {
        if self.writeback.is_empty() {
            return None;
        }
        let full = self.writeback.delivered.len() + self.writeback.dead.len() >= self.cfg.max_batch;
        let due = self
            .writeback_due()
            .is_some_and(|due| Instant::now() >= due);
        if force || full || due {
            self.writeback_since = None;
            Some(std::mem::take(&mut self.writeback))
        } else {
            None
        }
    }

    /// A write-back finished.
    pub fn on_writeback(&mut self, done: WriteBackDone, dead_bytes: &[Meta]) {
        add(&self.counters.marked_delivered, done.marked);
        add(&self.counters.already_delivered, done.already_done);
        add(&self.counters.dead, done.dead);
        for meta in dead_bytes {
            self.release(meta);
        }
        for tx in done.txs {
            self.settle(tx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use outbox_core::EventId;
    use std::time::Duration;

    fn event(agg: &str, seq: i64) -> Event {
        Event {
            seq,
            id: EventId::new(),
            aggregate_type: "a".into(),
            aggregate_id: agg.into(),
            event_type: "T".into(),
            payload: "{}".into(),
            destination: None,
            headers: Default::default(),
            idempotency_key: None,
            occurred_at: Utc::now(),
            enqueued_at: Utc::now(),
            attempts: 0,
        }
    }

    fn engine() -> Engine {
        let cfg = WalConfig {
            mark_delivered: false,
            ..WalConfig::new("postgres://x/y")
        };
        Engine::new(Arc::new(cfg), Arc::new(WalCounters::default()), Lsn(10))
    }

    fn deliver(e: &mut Engine, wave: Vec<Item>) {
        let n = wave.len();
        e.on_wave(wave, vec![Settle::Sink(Outcome::Delivered); n]);
    }

    #[test]
    fn ack_moves_only_over_settled_prefix_of_transactions() {
        let mut e = engine();
        e.begin(Utc::now());
        e.push(event("x", 1), Origin::Message, true, None);
        e.commit(Lsn(100));
        e.begin(Utc::now());
        e.push(event("y", 2), Origin::Message, true, None);
        e.commit(Lsn(200));
        assert_eq!(e.ack(), Lsn(10), "nothing delivered yet");
        let mut wave = e.next_wave().unwrap();
        assert_eq!(wave.len(), 2, "two aggregates go in one wave");
        // The later transaction settles first: the ack must not move.
        let first = wave.remove(0);
        deliver(&mut e, wave);
        assert_eq!(e.ack(), Lsn(10));
        deliver(&mut e, vec![first]);
        assert_eq!(e.ack(), Lsn(200));
        assert!(e.is_idle());
    }

    #[test]
    fn one_event_per_aggregate_per_wave_and_retry_blocks_only_its_aggregate() {
        let mut e = engine();
        e.begin(Utc::now());
        for (agg, seq) in [("x", 1), ("x", 2), ("y", 3)] {
            e.push(event(agg, seq), Origin::Message, true, None);
        }
        e.commit(Lsn(100));
        let wave = e.next_wave().unwrap();
        let seqs: Vec<i64> = wave.iter().map(|i| i.event.seq).collect();
        assert_eq!(seqs, [1, 3]);
        e.on_wave(
            wave,
            vec![
                Settle::Sink(Outcome::Retry {
                    reason: "down".into(),
                    after: Some(Duration::from_millis(1)),
                }),
                Settle::Sink(Outcome::Delivered),
            ],
        );
        assert!(e.next_wave().is_none(), "x waits for its backoff");
        std::thread::sleep(Duration::from_millis(2));
        e.fire_timers(Instant::now());
        let wave = e.next_wave().unwrap();
        assert_eq!(wave[0].event.seq, 1);
        assert_eq!(wave[0].event.attempts, 1);
        deliver(&mut e, wave);
        let wave = e.next_wave().unwrap();
        assert_eq!(wave[0].event.seq, 2);
        deliver(&mut e, wave);
        assert_eq!(e.ack(), Lsn(100));
    }

    #[test]
    fn rejected_events_wait_for_their_dead_letter_write() {
        let mut e = engine();
        e.begin(Utc::now());
        e.push(event("x", 1), Origin::Message, true, None);
        e.commit(Lsn(100));
        let wave = e.next_wave().unwrap();
        e.on_wave(wave, vec![Settle::Sink(Outcome::reject("no"))]);
        assert_eq!(
            e.ack(),
            Lsn(10),
            "not settled before the dead letter is written"
        );
        let wb = e.take_writeback(true).unwrap();
        assert_eq!(wb.dead.len(), 1);
        let metas: Vec<Meta> = wb.dead.iter().map(|d| d.meta).collect();
        e.on_writeback(
            WriteBackDone {
                txs: wb.dead.iter().map(|d| d.meta.tx).collect(),
                marked: 0,
                already_done: 0,
                dead: 1,
            },
            &metas,
        );
        assert_eq!(e.ack(), Lsn(100));
        assert!(e.is_idle());
    }

    #[test]
    fn undecodable_items_hold_the_position_only_until_their_dead_letter_is_written() {
        let mut e = engine();
        e.begin(Utc::now());
        e.push(event("x", 1), Origin::Table, true, None);
        e.push_dead(
            event("y", 2),
            Origin::Table,
            true,
            None,
            "column `headers` is bad".into(),
        );
        e.push(event("y", 3), Origin::Table, true, None);
        e.commit(Lsn(100));
        // The bad row holds nothing back: both aggregates go out at once.
        let wave = e.next_wave().unwrap();
        let seqs: Vec<i64> = wave.iter().map(|i| i.event.seq).collect();
        assert_eq!(seqs, [1, 3]);
        deliver(&mut e, wave);
        assert_eq!(e.ack(), Lsn(10), "not past the bad row before it is buried");
        let wb = e.take_writeback(true).unwrap();
        assert_eq!(wb.dead.len(), 1);
        assert_eq!(wb.dead[0].event.seq, 2);
        assert!(wb.dead[0].error.contains("headers"));
        let metas: Vec<Meta> = wb.dead.iter().map(|d| d.meta).collect();
        e.on_writeback(
            WriteBackDone {
                txs: wb.dead.iter().map(|d| d.meta.tx).collect(),
                marked: 0,
                already_done: 0,
                dead: 1,
            },
            &metas,
        );
        assert_eq!(e.ack(), Lsn(100));
        assert!(e.is_idle());
    }

    #[test]
    fn keepalive_confirms_only_when_nothing_is_open() {
        let mut e = engine();
        e.begin(Utc::now());
        e.push(event("x", 1), Origin::Message, true, None);
        e.keepalive(Lsn(500));
        assert_eq!(e.ack(), Lsn(10));
        e.commit(Lsn(100));
        let wave = e.next_wave().unwrap();
        deliver(&mut e, wave);
        e.keepalive(Lsn(500));
        assert_eq!(e.ack(), Lsn(500));
    }

    #[test]
    fn buffer_bound_reports_no_room() {
        let cfg = WalConfig {
            max_buffered_events: 2,
            ..WalConfig::new("postgres://x/y")
        };
        let mut e = Engine::new(Arc::new(cfg), Arc::new(WalCounters::default()), Lsn(0));
        e.begin(Utc::now());
        e.push(event("x", 1), Origin::Message, true, None);
        assert!(e.has_room());
        e.push(event("x", 2), Origin::Message, true, None);
        assert!(!e.has_room());
    }
}
