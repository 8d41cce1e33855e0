//! What the WAL source did, live ([`WalCounters`]) and as a snapshot ([`WalReport`]). The
//! engine's own figures (delivered, retried, dead per destination) are in the relay's report
//! and metrics; these are the stream's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::Serialize;

use crate::lsn::Lsn;

/// Live counters of a WAL source.
#[derive(Debug, Default)]
pub struct WalCounters {
    pub(crate) decoded: AtomicU64,
    pub(crate) claimed: AtomicU64,
    pub(crate) from_table: AtomicU64,
    pub(crate) handed_back: AtomicU64,
    pub(crate) delivered: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) already_delivered: AtomicU64,
    pub(crate) marked_delivered: AtomicU64,
    pub(crate) undecodable: AtomicU64,
    pub(crate) messages_unreadable: AtomicU64,
    pub(crate) heartbeats: AtomicU64,
    pub(crate) sessions: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) transactions: AtomicU64,
    pub(crate) last_acked_lsn: AtomicU64,
    pub(crate) started: std::sync::OnceLock<Instant>,
    /// 0: starting, 1: standing by, 2: streaming.
    pub(crate) role: std::sync::atomic::AtomicU8,
}

/// What a WAL source did: returned by [`WalSource::shutdown`](crate::WalSource::shutdown) and
/// [`WalRelay::run`](crate::WalRelay::run), readable live through [`WalCounters::report`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WalReport {
    /// Events decoded from the stream (including re-sent ones after a reconnect).
    pub decoded: u64,
    /// Events handed to the engine from the stream.
    pub claimed: u64,
    /// Events the engine claimed from the table: those the table owned (retries, events held
    /// behind a failure or a dead event, paused destinations, rows requeued, rows left
    /// undelivered when the session started).
    pub from_table: u64,
    /// Stream events handed to the table because the table owned their aggregate (or their
    /// destination was paused, or an earlier event of theirs failed).
    pub handed_back: u64,
    /// Stream events the sink confirmed.
    pub delivered: u64,
    /// Stream events that failed and went to the table for their retry.
    pub retried: u64,
    /// Events dead-lettered from the stream into the outbox table (rejected, out of
    /// attempts, unreadable, too large).
    pub dead: u64,
    /// Stream events not published because the table had them settled already.
    pub skipped: u64,
    /// Table rows that were already `delivered` when the stream marked them: each is a
    /// duplicate delivery (after a restart, a takeover or a mode switch).
    pub duplicates: u64,
    /// Table rows marked `delivered` (or deleted) by the stream's write-back.
    pub marked_delivered: u64,
    /// Table rows and messages that could not be read as events, or were too large; each is
    /// dead-lettered with the reason (or, when even its `seq` is unreadable, logged with its
    /// position).
    pub undecodable: u64,
    /// Logical messages with the outbox prefix too large to read (over what the relay reads of
    /// one record): read past, not delivered, not dead-lettered (nothing of them was kept).
    /// The metric `outbox_wal_messages_unreadable_total`.
    pub messages_unreadable: u64,
    /// Heartbeat messages seen.
    pub heartbeats: u64,
    /// Transactions seen.
    pub transactions: u64,
    /// Streaming sessions started (1 + reconnects and takeovers).
    pub sessions: u64,
    /// Errors that ended a session (each followed by a reconnect).
    pub errors: u64,
    /// The last WAL position this source confirmed.
    pub last_acked_lsn: Lsn,
    /// Decoded events per second since the source started.
    pub decode_rate_per_sec: f64,
}

impl WalCounters {
    /// Whether this instance streams the slot now (its session set up: the table's share
    /// known, the replication session started).
    pub fn streaming(&self) -> bool {
        self.role.load(Ordering::SeqCst) == 2
    }

    /// Whether this instance stands by while another streams the slot.
    pub fn standing_by(&self) -> bool {
        self.role.load(Ordering::SeqCst) == 1
    }

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
            claimed: load(&self.claimed),
            from_table: load(&self.from_table),
            handed_back: load(&self.handed_back),
            delivered: load(&self.delivered),
            retried: load(&self.retried),
            dead: load(&self.dead),
            skipped: load(&self.skipped),
            duplicates: load(&self.already_delivered),
            marked_delivered: load(&self.marked_delivered),
            undecodable: load(&self.undecodable),
            messages_unreadable: load(&self.messages_unreadable),
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

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}
