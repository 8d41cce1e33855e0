//! # outbox-testkit
//!
//! What the outbox's own tests (and yours) use to prove delivery properties against real
//! databases:
//!
//! - [`RecordingSink`]: records every publish attempt and every delivery, notices when one event
//!   is being published twice at the same moment, and injects failures (a seeded random rate of
//!   retryable failures, a predicate for permanent rejections, a publish delay).
//! - [`numbered`]: events whose payload carries the aggregate and a per-aggregate sequence number.
//! - [`check_first_delivery_order`]: per-aggregate order among first deliveries.
//! - [`TcpProxy`]: a loopback TCP proxy that can cut every connection, to play a database or a
//!   broker going away and coming back.

mod proxy;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{Event, EventId, NewEvent, Outcome, Sink};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use outbox_core::check_first_delivery_order;
pub use proxy::TcpProxy;

/// Build event number `n` of aggregate `aggregate_id` (type `agg`); the payload records both so a
/// consumer can check order.
pub fn numbered(aggregate_id: &str, n: u64) -> NewEvent {
    NewEvent::new(
        "agg",
        aggregate_id,
        "Numbered",
        &serde_json::json!({ "aggregate": aggregate_id, "n": n }),
    )
    .unwrap_or_else(|e| panic!("a numbered event always serializes: {e}"))
}

/// A test over one event, shared between tasks.
pub type EventPredicate = Arc<dyn Fn(&Event) -> bool + Send + Sync>;

/// Failures a [`RecordingSink`] injects.
#[derive(Clone, Default)]
pub struct Faults {
    /// Fraction (0–1) of publish attempts answered with a retryable failure.
    pub retry_rate: f64,
    /// Events answered with a permanent rejection, every time.
    pub reject: Option<EventPredicate>,
    /// Time each publish call takes.
    pub delay: Duration,
    /// Seed of the failure dice, so a failing run can be replayed.
    pub seed: u64,
}

#[derive(Default)]
struct State {
    in_flight: HashSet<EventId>,
    overlaps: Vec<EventId>,
    attempts: u64,
    delivered: Vec<Event>,
    rejected: Vec<Event>,
}

/// A sink that remembers everything and fails on purpose.
pub struct RecordingSink {
    faults: Faults,
    rng: Mutex<StdRng>,
    state: Mutex<State>,
}

impl RecordingSink {
    /// A sink that delivers everything.
    pub fn new() -> Self {
        Self::with_faults(Faults::default())
    }

    /// A sink with injected failures.
    pub fn with_faults(faults: Faults) -> Self {
        let rng = StdRng::seed_from_u64(faults.seed);
        RecordingSink {
            faults,
            rng: Mutex::new(rng),
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every successful delivery, in the order they were confirmed (duplicates included).
    pub fn delivered(&self) -> Vec<Event> {
        self.state().delivered.clone()
    }

    /// Every permanently rejected attempt.
    pub fn rejected(&self) -> Vec<Event> {
        self.state().rejected.clone()
    }

    /// Events that were handed to this sink while a previous publish of the same event was still
    /// going on. Must stay empty: an event is never in flight twice.
    pub fn overlaps(&self) -> Vec<EventId> {
        self.state().overlaps.clone()
    }

    /// Publish attempts, successful or not.
    pub fn attempts(&self) -> u64 {
        self.state().attempts
    }

    /// Distinct events delivered at least once.
    pub fn distinct_delivered(&self) -> HashSet<EventId> {
        self.state().delivered.iter().map(|e| e.id).collect()
    }
}

impl Default for RecordingSink {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Sink for RecordingSink {
    fn name(&self) -> &str {
        "recording"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        {
            let mut state = self.state();
            for e in events {
                if !state.in_flight.insert(e.id) {
                    state.overlaps.push(e.id);
                }
            }
            state.attempts += events.len() as u64;
        }
        if !self.faults.delay.is_zero() {
            tokio::time::sleep(self.faults.delay).await;
        }
        let rolls: Vec<f64> = {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            events.iter().map(|_| rng.random::<f64>()).collect()
        };
        let mut state = self.state();
        events
            .iter()
            .zip(rolls)
            .map(|(e, roll)| {
                state.in_flight.remove(&e.id);
                if self.faults.reject.as_ref().is_some_and(|f| f(e)) {
                    state.rejected.push(e.clone());
                    Outcome::reject("rejected by test predicate")
                } else if roll < self.faults.retry_rate {
                    Outcome::retry("injected transient failure")
                } else {
                    state.delivered.push(e.clone());
                    Outcome::Delivered
                }
            })
            .collect()
    }
}
