//! The demo's in-process message bus: the relay's sink on one side, the delivery and billing
//! consumers on the other, and at-least-once behaviour in between.
//!
//! [`BusSink`] is the relay's [`Sink`]: it hands each event to an
//! [`outbox_sink_channel::ChannelSink`] and remembers what went out (for the demo's lost /
//! phantom / order checks). [`Bus::spawn`] reads that channel and gives every subscriber its own
//! queue, like a broker with one durable consumer per service:
//!
//! - each subscriber gets every event once, in the order the relay published them;
//! - a seeded fraction of messages is delivered **again** a little later (what a broker does
//!   after a lost ack or a consumer restart), so the inboxes have real duplicates to drop;
//! - a message whose handler fails transiently is retried after a pause, and parked after
//!   `max_attempts` — the adapters' policy, in miniature.
//!
//! Why not a broker: the demo must run on a fresh machine with nothing but Rust. The handlers
//! it drives are the same [`InboxHandler`]s the NATS and Kafka transports drive.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_inbox::{Delivery, InboxHandler, ParkedMessage, Processed};
use outbox_sink_channel::ChannelSink;
use outbox_types::{Event, Outcome, Sink, SinkError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;

use crate::consumers::event_headers;

/// The relay's sink in the demo: a channel into the bus, plus a record of what was published.
pub struct BusSink {
    channel: ChannelSink,
    published: Mutex<Vec<Event>>,
    sent: AtomicU64,
}

impl BusSink {
    /// A sink and the receiving end for [`Bus::spawn`].
    pub fn new(capacity: usize) -> (Arc<BusSink>, mpsc::Receiver<Event>) {
        let (channel, rx) = ChannelSink::new(capacity);
        let sink = BusSink {
            channel,
            published: Mutex::new(Vec::new()),
            sent: AtomicU64::new(0),
        };
        (Arc::new(sink), rx)
    }

    /// Every event handed to the bus, in publish order (a relay retry may repeat one).
    pub fn published(&self) -> Vec<Event> {
        self.published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many events went into the channel.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl Sink for BusSink {
    fn name(&self) -> &str {
        "bus"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let outcomes = self.channel.publish(events).await;
        let mut published = self.published.lock().unwrap_or_else(|p| p.into_inner());
        for (event, outcome) in events.iter().zip(&outcomes) {
            if *outcome == Outcome::Delivered {
                published.push(event.clone());
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
        }
        outcomes
    }

    async fn check(&self) -> Result<(), SinkError> {
        self.channel.check().await
    }
}

/// How the bus behaves.
#[derive(Clone, Debug)]
pub struct BusConfig {
    /// Share of messages delivered a second time (0.0 ..= 1.0).
    pub redeliver_ratio: f64,
    /// Seed of the redelivery choices.
    pub seed: u64,
    /// Pause before a failed message is delivered again.
    pub retry_delay: Duration,
    /// Deliveries of one message before it is parked.
    pub max_attempts: u32,
}

impl Default for BusConfig {
    fn default() -> Self {
        BusConfig {
            redeliver_ratio: 0.15,
            seed: 1,
            retry_delay: Duration::from_millis(50),
            max_attempts: 20,
        }
    }
}

/// Counts of what the bus did, shared by all subscribers.
#[derive(Debug, Default)]
pub struct BusCounters {
    /// Events read from the relay's channel.
    pub received: AtomicU64,
    /// Deliveries made on purpose a second time.
    pub redelivered: AtomicU64,
    /// Deliveries retried after a handler error.
    pub retried: AtomicU64,
    /// Messages parked after their last attempt.
    pub parked: AtomicU64,
    /// Deliveries queued or waiting for a retry and not yet settled.
    pub outstanding: AtomicU64,
}

/// A running bus.
pub struct Bus {
    counters: Arc<BusCounters>,
    idle: Arc<Notify>,
    tasks: JoinSet<()>,
}

struct Queue {
    items: Mutex<VecDeque<Delivery>>,
    ready: Notify,
}

impl Queue {
    fn push(&self, d: Delivery) {
        self.items
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(d);
        self.ready.notify_one();
    }

    fn pop(&self) -> Option<Delivery> {
        self.items
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
    }
}

impl Bus {
    /// Start delivering what arrives on `rx` to every handler in `subscribers`. The bus stops
    /// when [`Bus::shutdown`] is called.
    pub fn spawn(
        mut rx: mpsc::Receiver<Event>,
        subscribers: Vec<Arc<dyn InboxHandler>>,
        config: BusConfig,
    ) -> Bus {
        let counters = Arc::new(BusCounters::default());
        let idle = Arc::new(Notify::new());
        let mut tasks = JoinSet::new();
        let queues: Vec<Arc<Queue>> = subscribers
            .iter()
            .map(|_| {
                Arc::new(Queue {
                    items: Mutex::new(VecDeque::new()),
                    ready: Notify::new(),
                })
            })
            .collect();

        {
            let queues = queues.clone();
            let counters = counters.clone();
            tasks.spawn(async move {
                while let Some(event) = rx.recv().await {
                    counters.received.fetch_add(1, Ordering::Relaxed);
                    let headers = event_headers(&event);
                    let mut delivery = Delivery::new(event.id, event.payload.into_bytes(), "bus");
                    delivery.headers = headers;
                    for q in &queues {
                        counters.outstanding.fetch_add(1, Ordering::Relaxed);
                        q.push(delivery.clone());
                    }
                }
            });
        }

        for (i, (handler, queue)) in subscribers.into_iter().zip(queues).enumerate() {
            let counters = counters.clone();
            let idle = idle.clone();
            let config = config.clone();
            tasks.spawn(async move {
                let mut rng = StdRng::seed_from_u64(config.seed.wrapping_add(i as u64));
                loop {
                    let Some(delivery) = queue.pop() else {
                        queue.ready.notified().await;
                        continue;
                    };
                    settle(&*handler, &queue, delivery, &config, &counters, &mut rng).await;
                    if counters.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
                        idle.notify_waiters();
                    }
                }
            });
        }
        Bus {
            counters,
            idle,
            tasks,
        }
    }

    /// Live counters.
    pub fn counters(&self) -> Arc<BusCounters> {
        self.counters.clone()
    }

    /// Whether every queued delivery (including redeliveries and retries) was settled.
    pub fn is_idle(&self) -> bool {
        self.counters.outstanding.load(Ordering::Acquire) == 0
    }

    /// Wait until [`Bus::is_idle`] holds or `limit` passes; returns whether it is idle.
    pub async fn wait_idle(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.idle.notified();
            if self.is_idle() {
                return true;
            }
            // Also re-check now and then: an idle notification may race with the check above.
            let wake = deadline.min(tokio::time::Instant::now() + Duration::from_millis(50));
            if tokio::time::timeout_at(wake, notified).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                return self.is_idle();
            }
        }
    }

    /// Stop the bus (what is still queued is dropped; call [`Bus::wait_idle`] first).
    pub async fn shutdown(mut self) {
        self.tasks.shutdown().await;
    }
}

/// Deliver once; on success maybe schedule a duplicate, on failure retry later or park.
async fn settle(
    handler: &dyn InboxHandler,
    queue: &Arc<Queue>,
    delivery: Delivery,
    config: &BusConfig,
    counters: &Arc<BusCounters>,
    rng: &mut StdRng,
) {
    match handler.handle(&delivery).await {
        Ok(Processed::Applied(())) | Ok(Processed::Duplicate) => {
            if delivery.attempt == 1 && rng.random_bool(config.redeliver_ratio.clamp(0.0, 1.0)) {
                let mut again = delivery;
                again.attempt += 1;
                counters.redelivered.fetch_add(1, Ordering::Relaxed);
                counters.outstanding.fetch_add(1, Ordering::AcqRel);
                queue.push(again);
            }
        }
        Err(error) if error.is_transient() && delivery.attempt < config.max_attempts.max(1) => {
            tracing::debug!(event_id = %delivery.event_id, attempt = delivery.attempt, error = %error, "Bus delivery failed; retrying.");
            let mut again = delivery;
            again.attempt += 1;
            counters.retried.fetch_add(1, Ordering::Relaxed);
            counters.outstanding.fetch_add(1, Ordering::AcqRel);
            let queue = queue.clone();
            let delay = config.retry_delay;
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                queue.push(again);
            });
        }
        Err(error) => {
            let parked = ParkedMessage::new(
                Some(delivery.event_id),
                delivery.source.clone(),
                delivery.payload.clone(),
                delivery.attempt,
                error.to_string(),
            );
            match handler.park(&parked).await {
                Ok(()) => {
                    counters.parked.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(event_id = %delivery.event_id, error = %error, "Bus parked a message.");
                }
                Err(park_error) => {
                    tracing::error!(event_id = %delivery.event_id, error = %park_error, "Bus could not park a message; it is dropped.");
                }
            }
        }
    }
}
