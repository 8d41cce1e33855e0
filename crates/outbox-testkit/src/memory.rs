//! [`MemorySource`]: an outbox held in memory, a [`Source`] for testing the relay engine
//! without a database.
//!
//! It keeps the claim contract the stores keep (a claim never hands out an event while an
//! earlier event of its aggregate is in flight under a live lease, waiting for a retry, or dead
//! under `block`; writes after a claim only touch events still held under its token) and reads
//! time from tokio's clock only, so a test with paused time (`#[tokio::test(start_paused =
//! true)]`) drives backoff, cooldown and leases without sleeping.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_types::{
    BuryEvent, Claim, ClaimRequest, DeadLetterPolicy, Event, EventId, Lease, NewEvent,
    PausedDestination, RetryEvent, Source, StoreError,
};
use tokio::time::Instant;

/// Where an event of a [`MemorySource`] stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryState {
    /// Waiting; due at `due`.
    Pending {
        /// When it may be claimed.
        due: Instant,
    },
    /// Claimed under `token` until `expires`.
    InFlight {
        /// The claim's fencing token.
        token: uuid::Uuid,
        /// When the lease runs out.
        expires: Instant,
    },
    /// Acknowledged.
    Delivered,
    /// Given up on.
    Dead,
}

/// One event of a [`MemorySource`].
#[derive(Clone, Debug)]
pub struct MemoryRow {
    /// The event (its `attempts` kept up to date).
    pub event: Event,
    /// Where it stands.
    pub state: MemoryState,
    /// The last failure.
    pub last_error: Option<String>,
}

/// An in-memory outbox. See the module docs.
#[derive(Default)]
pub struct MemorySource {
    rows: Mutex<Vec<MemoryRow>>,
    /// Every ack fails (see [`MemorySource::fail_acks`]).
    acks_fail: AtomicBool,
}

impl MemorySource {
    /// An empty outbox.
    pub fn new() -> Self {
        Self::default()
    }

    fn rows(&self) -> std::sync::MutexGuard<'_, Vec<MemoryRow>> {
        self.rows.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Add events, due now, in order.
    pub fn enqueue(&self, events: &[NewEvent]) {
        let mut rows = self.rows();
        let now = Instant::now();
        for e in events {
            let seq = rows.len() as i64 + 1;
            rows.push(MemoryRow {
                event: Event {
                    seq,
                    id: e.id(),
                    aggregate_type: e.aggregate_type().to_owned(),
                    aggregate_id: e.aggregate_id().to_owned(),
                    event_type: e.event_type().to_owned(),
                    payload: e.payload().to_owned(),
                    destination: e.destination().map(str::to_owned),
                    headers: e.headers().clone(),
                    idempotency_key: e.idempotency_key().map(str::to_owned),
                    occurred_at: e.occurred_at(),
                    enqueued_at: chrono::Utc::now(),
                    attempts: 0,
                },
                state: MemoryState::Pending { due: now },
                last_error: None,
            });
        }
    }

    /// From now on every ack fails as unavailable (`connection reset`): a database that takes
    /// claims and the other writes but whose acks never arrive.
    pub fn fail_acks(&self) {
        self.acks_fail.store(true, Ordering::Relaxed);
    }

    /// A copy of every row.
    pub fn snapshot(&self) -> Vec<MemoryRow> {
        self.rows().clone()
    }

    /// The row of event `id`.
    pub fn row(&self, id: EventId) -> Option<MemoryRow> {
        self.rows().iter().find(|r| r.event.id == id).cloned()
    }

    fn settle(
        &self,
        lease: &Lease,
        seqs: impl IntoIterator<Item = i64>,
        mut f: impl FnMut(&mut MemoryRow, i64),
    ) -> u64 {
        let mut rows = self.rows();
        let mut n = 0;
        for seq in seqs {
            if let Some(row) = rows.iter_mut().find(|r| r.event.seq == seq)
                && matches!(row.state, MemoryState::InFlight { token, .. } if token == lease.token)
            {
                f(row, seq);
                n += 1;
            }
        }
        n
    }
}

#[async_trait]
impl Source for MemorySource {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let token = uuid::Uuid::now_v7();
        let mut rows = self.rows();
        let mut blocked: std::collections::HashSet<(String, String)> = Default::default();
        let mut events = Vec::new();
        for row in rows.iter_mut() {
            let key = (
                row.event.aggregate_type.clone(),
                row.event.aggregate_id.clone(),
            );
            let due = match &row.state {
                MemoryState::Pending { due } => *due <= now,
                MemoryState::InFlight { expires, .. } => *expires <= now,
                MemoryState::Delivered => continue,
                MemoryState::Dead => {
                    if request.dead_letter == DeadLetterPolicy::Block {
                        blocked.insert(key);
                    }
                    continue;
                }
            };
            if blocked.contains(&key) {
                continue;
            }
            if !due || events.len() >= request.limit as usize {
                blocked.insert(key);
                continue;
            }
            row.state = MemoryState::InFlight {
                token,
                expires: now + request.lease,
            };
            events.push(row.event.clone());
        }
        Ok(Claim {
            lease: Lease {
                owner: request.owner.clone(),
                token,
            },
            events,
            buried: 0,
        })
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        if self.acks_fail.load(Ordering::Relaxed) {
            return Err(StoreError::Unavailable("connection reset".into()));
        }
        Ok(self.settle(lease, seqs.iter().copied(), |row, _| {
            row.state = MemoryState::Delivered;
        }))
    }

    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError> {
        let now = Instant::now();
        Ok(
            self.settle(lease, events.iter().map(|e| e.seq), |row, seq| {
                let retry = events.iter().find(|e| e.seq == seq);
                // As the stores do: an attempt only where it counts (an outage costs none); the
                // error is kept either way.
                row.event.attempts += u32::from(retry.is_none_or(|r| r.counts_attempt));
                row.last_error = retry.map(|r| r.error.clone());
                row.state = MemoryState::Pending {
                    due: now + retry.map(|r| r.delay).unwrap_or(Duration::ZERO),
                };
            }),
        )
    }

    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError> {
        Ok(
            self.settle(lease, events.iter().map(|e| e.seq), |row, seq| {
                row.event.attempts += 1;
                row.last_error = events
                    .iter()
                    .find(|e| e.seq == seq)
                    .map(|b| b.error.clone());
                row.state = MemoryState::Dead;
            }),
        )
    }

    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        let now = Instant::now();
        Ok(self.settle(lease, seqs.iter().copied(), |row, _| {
            row.state = MemoryState::Pending { due: now };
        }))
    }

    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError> {
        Ok(Vec::new())
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}
