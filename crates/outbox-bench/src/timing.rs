//! Timing wrappers the relay child puts around its sink and its store, so the report can say
//! where a drain spends its time: claiming, publishing, or writing the outcome back.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_types::{
    BuryEvent, Claim, ClaimRequest, Event, Lease, Outcome, PausedDestination, RetryEvent, Sink,
    SinkError, Source, StoreError,
};
use serde::{Deserialize, Serialize};

/// One `publish` call as the relay made it.
#[derive(Clone, Copy, Debug)]
struct Call {
    nanos: u64,
    events: u32,
    not_delivered: u32,
}

/// A sink that records the duration and size of every `publish` call of the sink it wraps.
pub struct TimedSink {
    inner: Arc<dyn Sink>,
    calls: Mutex<Vec<Call>>,
    first_failure: Mutex<Option<String>>,
}

impl TimedSink {
    pub fn new(inner: Arc<dyn Sink>) -> Self {
        TimedSink {
            inner,
            calls: Mutex::new(Vec::with_capacity(4096)),
            first_failure: Mutex::new(None),
        }
    }

    /// Latency figures over every call recorded so far.
    pub fn stats(&self) -> PublishStats {
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let first_failure = self
            .first_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        PublishStats::from_calls(calls, first_failure)
    }
}

#[async_trait]
impl Sink for TimedSink {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let started = Instant::now();
        let outcomes = self.inner.publish(events).await;
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut not_delivered = 0u32;
        for outcome in &outcomes {
            if *outcome != Outcome::Delivered {
                not_delivered += 1;
                let mut first = self.first_failure.lock().unwrap_or_else(|p| p.into_inner());
                if first.is_none() {
                    *first = Some(format!("{outcome:?}"));
                }
            }
        }
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Call {
                nanos,
                events: u32::try_from(events.len()).unwrap_or(u32::MAX),
                not_delivered,
            });
        outcomes
    }

    async fn check(&self) -> Result<(), SinkError> {
        self.inner.check().await
    }
}

/// p50, p99 and max of a latency distribution, in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// What the timing wrapper saw of the sink.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PublishStats {
    /// `publish` calls (one per wave: at most one event per aggregate of the batch).
    pub calls: u64,
    /// Events handed to the sink, over all calls (retries count again).
    pub events: u64,
    /// Events whose outcome was not `Delivered`.
    pub not_delivered: u64,
    /// The reason of the first such outcome.
    pub first_failure: Option<String>,
    /// Sum of the call durations.
    pub seconds_total: f64,
    /// Latency of the first call (it may pay for set-up the readiness check did not do, e.g.
    /// Kafka's producer id and topic metadata).
    pub first_call_ms: f64,
    /// Latency of one call.
    pub per_call: Percentiles,
    /// Latency of the call that carried each event: the call distribution weighted by events.
    pub per_event: Percentiles,
}

impl PublishStats {
    fn from_calls(mut calls: Vec<Call>, first_failure: Option<String>) -> Self {
        let ms = |nanos: u64| nanos as f64 / 1e6;
        let first_call_ms = calls.first().map(|c| ms(c.nanos)).unwrap_or(0.0);
        calls.sort_by_key(|c| c.nanos);
        let events: u64 = calls.iter().map(|c| u64::from(c.events)).sum();
        // Nearest rank: the smallest value with at least p of the weight at or below it.
        let rank = |p: f64, weight: &dyn Fn(&Call) -> u64, total: u64| -> f64 {
            if total == 0 {
                return 0.0;
            }
            let target = ((p * total as f64).ceil() as u64).max(1);
            let mut seen = 0u64;
            for call in &calls {
                seen += weight(call);
                if seen >= target {
                    return ms(call.nanos);
                }
            }
            calls.last().map(|c| ms(c.nanos)).unwrap_or(0.0)
        };
        let one = |_: &Call| 1u64;
        let by_events = |c: &Call| u64::from(c.events);
        let n = calls.len() as u64;
        let max = calls.last().map(|c| ms(c.nanos)).unwrap_or(0.0);
        PublishStats {
            calls: n,
            events,
            not_delivered: calls.iter().map(|c| u64::from(c.not_delivered)).sum(),
            first_failure,
            seconds_total: calls.iter().map(|c| c.nanos as f64 / 1e9).sum(),
            first_call_ms,
            per_call: Percentiles {
                p50_ms: rank(0.50, &one, n),
                p99_ms: rank(0.99, &one, n),
                max_ms: max,
            },
            per_event: Percentiles {
                p50_ms: rank(0.50, &by_events, events),
                p99_ms: rank(0.99, &by_events, events),
                max_ms: max,
            },
        }
    }
}

/// Count and total duration of one kind of store call.
#[derive(Default)]
struct Tally {
    calls: AtomicU64,
    nanos: AtomicU64,
}

impl Tally {
    fn add(&self, elapsed: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.nanos.fetch_add(
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Await `call`, counting it and its duration here: every timed store call, written once.
    async fn time<T>(&self, call: impl std::future::Future<Output = T>) -> T {
        let started = Instant::now();
        let done = call.await;
        self.add(started.elapsed());
        done
    }

    fn seconds(&self) -> f64 {
        self.nanos.load(Ordering::Relaxed) as f64 / 1e9
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

/// What the timing wrapper saw of the store.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StoreStats {
    pub claims: u64,
    pub empty_claims: u64,
    pub claim_seconds: f64,
    pub acks: u64,
    pub ack_seconds: f64,
    /// retry, bury and release calls.
    pub other_writes: u64,
    pub other_write_seconds: f64,
}

/// The relay's source with its claims and the writes after a publish timed. A [`Source`] and
/// not a `Store`: it forwards exactly what the engine calls, so nothing the relay asks for can
/// fall back to a trait default the wrapped store overrides.
pub struct TimedSource<S: ?Sized> {
    inner: Arc<S>,
    claim: Tally,
    empty_claims: AtomicU64,
    ack: Tally,
    other: Tally,
}

impl<S: ?Sized> TimedSource<S> {
    pub fn new(inner: Arc<S>) -> Self {
        TimedSource {
            inner,
            claim: Tally::default(),
            empty_claims: AtomicU64::new(0),
            ack: Tally::default(),
            other: Tally::default(),
        }
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats {
            claims: self.claim.calls(),
            empty_claims: self.empty_claims.load(Ordering::Relaxed),
            claim_seconds: self.claim.seconds(),
            acks: self.ack.calls(),
            ack_seconds: self.ack.seconds(),
            other_writes: self.other.calls(),
            other_write_seconds: self.other.seconds(),
        }
    }
}

#[async_trait]
impl<S: Source + ?Sized> Source for TimedSource<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let claim = self.claim.time(self.inner.claim(request)).await;
        if claim.as_ref().is_ok_and(|c| c.events.is_empty()) {
            self.empty_claims.fetch_add(1, Ordering::Relaxed);
        }
        claim
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        self.ack.time(self.inner.ack(lease, seqs)).await
    }

    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError> {
        self.other.time(self.inner.retry(lease, events)).await
    }

    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError> {
        self.other.time(self.inner.bury(lease, events)).await
    }

    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        self.other.time(self.inner.release(lease, seqs)).await
    }

    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError> {
        self.inner.paused().await
    }

    async fn work_ready(&self) {
        self.inner.work_ready().await
    }

    async fn close(&self) {
        self.inner.close().await
    }

    fn exhausted(&self) -> bool {
        self.inner.exhausted()
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(ms: u64, events: u32) -> Call {
        Call {
            nanos: ms * 1_000_000,
            events,
            not_delivered: 0,
        }
    }

    #[test]
    fn per_event_percentiles_weight_calls_by_their_events() {
        // 99 small fast calls and one slow call carrying most events.
        let mut calls: Vec<Call> = (0..99).map(|_| call(1, 1)).collect();
        calls.push(call(100, 901));
        let stats = PublishStats::from_calls(calls, None);
        assert_eq!(stats.calls, 100);
        assert_eq!(stats.events, 1000);
        assert_eq!(stats.per_call.p50_ms, 1.0);
        assert_eq!(stats.per_call.p99_ms, 1.0);
        assert_eq!(stats.per_call.max_ms, 100.0);
        // 901 of 1000 events travelled in the slow call.
        assert_eq!(stats.per_event.p50_ms, 100.0);
        assert_eq!(stats.per_event.p99_ms, 100.0);
    }

    #[test]
    fn empty_stats_are_zero() {
        let stats = PublishStats::from_calls(Vec::new(), None);
        assert_eq!(stats.calls, 0);
        assert_eq!(stats.per_event.p99_ms, 0.0);
    }
}
