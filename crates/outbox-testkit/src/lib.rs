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
//! - [`logical_cluster_url`], [`kafka_brokers`], [`tansu_binary`]: the throwaway servers the repository's scripts
//!   start.
//! - [`rabbitmq`]: a durable topic exchange with a durable queue bound to
//!   it, and the messages ready in a queue.

pub mod concurrent;
mod memory;
mod postgres_cpu;
mod proxy;
pub mod rabbitmq;
mod servers;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use outbox_types::{Event, EventId, NewEvent, Outcome, Sink};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use memory::{MemoryRow, MemorySource, MemoryState};
pub use outbox_types::check_first_delivery_order;
pub use postgres_cpu::PostgresCpu;
pub use proxy::TcpProxy;
pub use servers::{kafka_brokers, logical_cluster_url, tansu_binary};

/// A name no other test (or test process) uses, for schemas, tables, streams and queues:
/// `prefix`, the process id, a per-process counter and the clock's nanoseconds; letters, digits
/// and `_` when `prefix` is.
pub fn unique(prefix: &str) -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}_{}_{}_{}", std::process::id(), n, nanos % 100_000)
}

/// An `OrderCreated` event of order `id` (aggregate `order`, amount 1999): the business event of
/// the stores' atomicity tests, which enqueue it next to an insert into their `orders` table.
pub fn order_created(id: i64) -> NewEvent {
    NewEvent::new(
        "order",
        id.to_string(),
        "OrderCreated",
        &serde_json::json!({"id": id, "amount": 1999}),
    )
    .unwrap_or_else(|e| panic!("an order event always serializes: {e}"))
}

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
    /// Events answered with a retryable failure, every time (until the relay gives up on them).
    pub fail: Option<EventPredicate>,
    /// A publish call that holds one of these events panics (a sink bug).
    pub panic: Option<EventPredicate>,
    /// Time each publish call takes.
    pub delay: Duration,
    /// Seed of the failure dice, so a failing run can be replayed.
    pub seed: u64,
}

#[derive(Default)]
struct State {
    /// Publishes of each event under way right now.
    in_flight: HashMap<EventId, u32>,
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

    /// Fail the test unless each aggregate's first deliveries kept its order (the first few
    /// violations are shown) and no event was ever in two publish calls at once: what every
    /// relay run must keep, whatever faults it went through.
    pub fn assert_in_order_without_overlaps(&self) {
        let violations = check_first_delivery_order(&self.delivered());
        assert!(
            violations.is_empty(),
            "order violations: {:?}",
            &violations[..violations.len().min(5)]
        );
        let overlaps = self.overlaps();
        assert!(overlaps.is_empty(), "events in flight twice: {overlaps:?}");
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
        if let Some(panics) = &self.faults.panic
            && events.iter().any(|e| panics(e))
        {
            self.state().attempts += events.len() as u64;
            panic!("panicking by test predicate");
        }
        {
            let mut state = self.state();
            for e in events {
                let running = state.in_flight.entry(e.id).or_insert(0);
                *running += 1;
                if *running > 1 {
                    state.overlaps.push(e.id);
                }
            }
            state.attempts += events.len() as u64;
        }
        // A publish always gives other tasks a turn while its events are marked in flight (and
        // waits `delay` when set): a second publish of the same event running at the same moment
        // then finds the mark, so the overlap check can fail, not just pass.
        if self.faults.delay.is_zero() {
            tokio::task::yield_now().await;
        } else {
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
                if let Some(running) = state.in_flight.get_mut(&e.id) {
                    *running -= 1;
                    if *running == 0 {
                        state.in_flight.remove(&e.id);
                    }
                }
                if self.faults.reject.as_ref().is_some_and(|f| f(e)) {
                    state.rejected.push(e.clone());
                    Outcome::reject("rejected by test predicate")
                } else if self.faults.fail.as_ref().is_some_and(|f| f(e)) {
                    Outcome::retry("failing by test predicate")
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

/// `kafka` gets every event but those of `Hook*` event types, which go to `hooks`: the route
/// table the stores' statement tests and the conformance suite hold, pause and replay by.
pub fn hooks_and_kafka() -> outbox_types::route::RouteTable {
    use outbox_types::route::{Pattern, RouteRule, RouteTable};
    RouteTable::new(
        ["kafka", "hooks"],
        vec![
            RouteRule::to("hooks").event_type(Pattern::parse("Hook*")),
            RouteRule::to("kafka"),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// An in-memory [`std::io::Write`] for what a test logs: hand clones to a `tracing_subscriber`
/// (`.with_writer(move || buffer.clone())`) and read it all back with [`LogBuffer::text`].
#[derive(Clone, Default)]
pub struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    /// Everything written so far, as UTF-8 text.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Fail unless `error`'s message contains `text`; the failure shows the whole message. What a
/// test of a refusal checks: the reason is named, whatever else the database adds around it.
#[track_caller]
pub fn assert_mentions(error: &impl std::fmt::Display, text: &str) {
    let message = error.to_string();
    assert!(message.contains(text), "{message}");
}

/// Check a store's table-name rule: plain names (up to 48 bytes) pass; the names every store
/// refuses (empty, upper case, a leading digit, a dash, 49 bytes) and the store's own `more`
/// (its quoting, its reserved prefixes) are [`StoreError::Invalid`](outbox_types::StoreError).
#[track_caller]
pub fn check_table_name_rule(
    check: impl Fn(&str) -> Result<(), outbox_types::StoreError>,
    more: &[&str],
) {
    for good in ["outbox_events", "_x1", &"a".repeat(48)] {
        assert!(check(good).is_ok(), "{good:?}");
    }
    let too_long = "a".repeat(49);
    let common = ["", "Events", "1events", "bad-name", too_long.as_str()];
    for bad in common.iter().chain(more) {
        assert!(
            matches!(check(bad), Err(outbox_types::StoreError::Invalid(_))),
            "{bad:?}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: u64) -> Event {
        let e = numbered("a", n);
        Event {
            seq: n as i64,
            id: e.id(),
            aggregate_type: e.aggregate_type().to_owned(),
            aggregate_id: e.aggregate_id().to_owned(),
            event_type: e.event_type().to_owned(),
            payload: e.payload().to_owned(),
            destination: None,
            headers: Default::default(),
            idempotency_key: None,
            occurred_at: e.occurred_at(),
            enqueued_at: e.occurred_at(),
            attempts: 0,
        }
    }

    /// The overlap check is only worth something if it fires: two publishes of one event at the
    /// same moment are caught, with or without a publish delay; one after the other are not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_publishes_of_one_event_are_caught() {
        for delay in [Duration::ZERO, Duration::from_millis(5)] {
            let sink = Arc::new(RecordingSink::with_faults(Faults {
                delay,
                ..Faults::default()
            }));
            let e = event(1);
            sink.publish(std::slice::from_ref(&e)).await;
            sink.publish(std::slice::from_ref(&e)).await;
            assert!(sink.overlaps().is_empty(), "sequential publishes overlap");
            let pair = [e.clone(), event(2)];
            let (first, second) =
                tokio::join!(sink.publish(std::slice::from_ref(&e)), sink.publish(&pair));
            assert_eq!((first.len(), second.len()), (1, 2));
            assert_eq!(sink.overlaps(), vec![e.id], "delay {delay:?}");
            assert_eq!(sink.delivered().len(), 5);
            assert_eq!(sink.distinct_delivered().len(), 2);
        }
    }

    #[tokio::test]
    async fn failing_events_always_retry() {
        let sink = RecordingSink::with_faults(Faults {
            fail: Some(Arc::new(|e: &Event| e.seq == 1)),
            ..Faults::default()
        });
        let outcomes = sink.publish(&[event(1), event(2)]).await;
        assert!(matches!(outcomes[0], Outcome::Retry { .. }));
        assert!(matches!(outcomes[1], Outcome::Delivered));
    }
}
