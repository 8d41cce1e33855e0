//! # outbox-engine
//!
//! The engine that moves committed events from a [`Source`] to a [`Sink`] — the one engine of
//! both relay modes: table claims (every [`Store`](outbox_types::Store) is a source) and `outbox-wal`'s replication
//! stream. Every feature below works the same way over either:
//! **claim** a batch of due events → **publish** them → **ack** the delivered ones in one
//! statement, **retry** the failed ones with backoff, **bury** the hopeless ones, **release** the
//! ones held back by an earlier failure of their aggregate. While claims come back full the loop
//! claims again at once (up to [`RelayConfig::max_batches_in_flight`] batches are published
//! concurrently, plus batches left waiting only on a slow destination, below); when a claim comes
//! back short it waits [`RelayConfig::min_poll_interval`] if it found events, and after claims
//! that found nothing longer and longer, up to [`RelayConfig::poll_interval`].
//!
//! ```no_run
//! # async fn demo(store: std::sync::Arc<dyn outbox_types::Store>, sink: std::sync::Arc<dyn outbox_types::Sink>) {
//! use outbox_engine::{Relay, RelayConfig};
//! let relay = Relay::new(store, sink, RelayConfig::default());
//! let report = relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await;
//! println!("delivered {}", report.delivered);
//! # }
//! ```
//!
//! ## Why leases with a fencing token, not row locks held across the publish
//!
//! The classic poller keeps `SELECT … FOR UPDATE SKIP LOCKED` row locks for as long as it takes
//! to publish the batch. That pins one open transaction (and one pooled connection) per batch in
//! flight, holds back vacuum's horizon for the whole publish (bloat on exactly the table that
//! churns most), hides who is working on what, and cannot express "not while an earlier event of
//! this aggregate is out": the lock is per row, the ordering rule is per aggregate.
//!
//! So a claim here is a short transaction that *commits* the events as `in_flight` with a lease
//! owner, an expiry and a fresh token, then lets go. Publishing holds no database resource. The
//! ack, retry, bury and release that follow name the token and change only rows that still carry
//! it. A relay that crashes leaves rows whose lease runs out and are claimed again by the next
//! relay; a relay that merely *stalls* past its lease (SIGSTOP, GC pause, partition) may still
//! publish what it held — a duplicate, which at-least-once delivery allows and the consumer's
//! inbox absorbs — but its acks are fenced and change nothing. The relay also stops starting new
//! publishes for a batch shortly before its lease would expire, so the window for such
//! duplicates is the stall itself. `SKIP LOCKED` still appears inside the claim statement: it
//! keeps a claim from waiting on a row that an ack is rewriting at that moment.
//!
//! ## Per-aggregate order
//!
//! The store never claims an event while an earlier event of its aggregate is in flight, waiting
//! for a retry, or dead (under [`DeadLetterPolicy::Block`]). Inside a batch the relay publishes in
//! *waves*: a wave holds the next event of every aggregate whose next event goes to the same
//! destination, so aggregates proceed in parallel while one aggregate's events go out one after
//! the other, each only after the previous was confirmed. When an event fails, the rest of its
//! aggregate in this batch is released untouched and waits behind it.
//!
//! ## An outage costs time, not events
//!
//! A sink tells an event it could not deliver because the destination is unreachable or not
//! serving ([`Outcome::Unavailable`]) from one the destination refused or failed
//! ([`Outcome::Reject`], [`Outcome::Retry`]). Only the latter count toward
//! [`RetryPolicy::max_attempts`](outbox_types::RetryPolicy) and the dead letters (an outage costs
//! an event no attempt: a pending row with a `last_error` is what the stores treat as waiting,
//! which holds its aggregate's later events behind it): an event whose destination is
//! down waits, with its aggregate's later events behind it, however long the outage lasts, and
//! goes out in order when the destination is back. The relay does not hammer
//! a down destination with every event: after three failed calls (or one timeout) it leaves it
//! alone for a cooldown and then probes it with one call (below). Users who want an outage
//! bounded set [`RelayConfig::dead_after_unavailable`] (all destinations) or
//! [`RelayConfig::dead_after_unavailable_for`] (one): once a destination has been unavailable
//! that long without answering, its events that meet it unavailable are dead. Off by default:
//! the dead letters are for events a destination refuses; an outage is an operator's matter,
//! not each event's. The clock runs from the first failed call of the outage as this relay saw
//! it, so it restarts with the relay.
//!
//! ## An event that looks like an outage
//!
//! Some events make their destination fail as a whole: a message the broker answers by closing
//! the connection (RabbitMQ's `FRAME_ERROR` for headers over its frame size), a request that
//! crashes the receiver's proxy or hangs it. The sink can only report what it saw, an outage,
//! so such an event would cost no attempt, never be dead-lettered, and bring the destination
//! down again at every retry, delaying every other aggregate. The relay recognises it by what
//! distinguishes it from a real outage: the destination works for the others. An event *causes*
//! an outage when it was in the call that began it, or when it was in a failed call after the
//! destination had answered other calls since this event's previous failed call; an event that
//! causes [`RelayConfig::max_outages_per_event`] outages (5 by default) without being answered
//! once in between is dead as a suspected poison (`suspected poison: present at 5 outages of
//! destination …`, with the last reason). A real outage counts once for the events of its first
//! call and not at all for the others, however long it lasts; an answer for the event (delivered,
//! retry, rejected) starts its count again. Its limits: an event alone on its destination (nothing
//! else delivered between its tries) looks exactly like an outage and waits as one; and an
//! innocent event of a destination that goes down and up again and again may meet five of its
//! outages in a row and be buried with it (raise the limit for such a destination, or set 0 and
//! bound outages with `dead_after_unavailable`). What the relay remembers for this is per relay
//! process (a restart starts every count again), and bounded (at most
//! 10,000 events per destination; past that, new ones are not counted until old ones are
//! answered). `max_outages_per_event = 0` turns it off.
//!
//! One log line marks the start of an outage (`Destination is failing`) and one its end
//! (`Destination answers again`, with how long it lasted); the events in between are logged at
//! debug level only. Gauges: `outbox_destination_failing{destination}` (1 while failing) and
//! `outbox_destination_down_since_seconds{destination}` (Unix time of the outage's first failed
//! call, 0 when up).
//!
//! ## One failing destination does not stall the others
//!
//! With several destinations ([`Relay::with_routes`]) each destination's waves run on their own,
//! each publish with its own timeout: a broker that hangs delays only the aggregates whose next
//! event goes to it. (One wave across all destinations, under one timeout, made a hanging broker
//! fail every event of the wave, delivered ones included, so under broker faults a relay delivered
//! almost nothing.) A destination that times out, or answers every event of three calls in a row
//! with [`Outcome::Unavailable`], is *failing*: for a cooldown (from 500 ms, doubling while it
//! keeps failing, up to [`RelayConfig::destination_cooldown`]) the relay does not call it and
//! records its events as unavailable at once, costing no attempt (each due again after the
//! cooldown, spread over half as long again), so batches do not wait out its timeout again and
//! again. A single destination is treated the same way: it has no others to protect, but its outage
//! is probed, not hammered. After the cooldown one call tries it for real while the others are
//! still refused; an answer (any outcome but `Unavailable`) ends the failing state,
//! another failure starts the next, longer cooldown. Its events stay in the outbox and keep their
//! order; the other destinations keep flowing. A timeout cut short by the lease's end does not
//! count.
//!
//! A batch still waits for its slowest call before it is done. So, with several destinations,
//! once every call a batch has out has been out for a quarter of the publish timeout, the batch
//! writes back what it has settled (freeing those aggregates) and gives its
//! [`RelayConfig::max_batches_in_flight`] slot back: the relay claims on while it waits. At most
//! four batches per slot are alive at once, the one holding it included.
//!
//! ## Fair turns
//!
//! Claims take due events in commit order, whatever their destination. So when one destination
//! comes back from an outage with a backlog, or simply lags, its older events would fill every
//! batch until they are all out, and the other destinations' new events would wait behind them
//! for as long as the drain takes (measured by `outbox-verify`: 7.6–8.8 s p99 for a destination
//! that stayed up, for the 25 s a recovered webhook's backlog took). A claim that comes back full
//! with more than half of its events for one destination makes the next claim skip that
//! destination (a [`Hold`] with it `deferred`): the others get a batch of their own in between.
//! Such a claim reads past the backlog (about 80 ms past 100k rows on PostgreSQL), so fair turns
//! come at most every 250 ms, and 2 s apart after one that found nothing else due; a skipping
//! claim that comes back empty is followed at once by a normal one, so a backlog that is alone
//! drains at full speed. A table claim takes none of the deferred destination's rows, but they
//! still hold back the later events of their aggregates (unlike a paused destination's): when
//! routes split one aggregate over several destinations, a turn changes which aggregates go
//! first, never the order within one. SQLite claims the deferred destination as usual (it has no
//! index to check an aggregate's earlier rows cheaply); the WAL stream does not defer (its events
//! are new, not a backlog).
//!
//! ## Shutdown
//!
//! When the shutdown future completes the relay stops claiming, lets every batch finish the wave
//! it is publishing, acks what was delivered, releases what was not yet published, and returns.
//! Nothing stays claimed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

// The engine reads time only through tokio's clock, so tests can pause and advance it: timing
// behaviour (backoff, cooldown, the lease's end) is tested without sleeping (tests/clock.rs).
use tokio::time::Instant;

pub mod memory;
pub mod router;

use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use outbox_types::route::RouteTable;
use outbox_types::{
    BuryEvent, Claim, ClaimRequest, DeadLetterPolicy, Event, Hold, Lease, Outcome, RetryEvent,
    RetryPolicy, Sink, Source, StoreError, humantime_duration, truncate_error,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

/// Log a line about `event` at `level` (`debug`, `warn`, …) with the fields that identify it
/// (id, type, aggregate, idempotency key), then the line's own fields and message: the lines
/// of one event's life are found by the same fields, written in one place.
macro_rules! event_line {
    ($level:ident, $event:ident, $($rest:tt)+) => {
        $level!(
            event_id = %$event.id,
            event_type = %$event.event_type,
            aggregate_type = %$event.aggregate_type,
            aggregate_id = %$event.aggregate_id,
            idempotency_key = $event.idempotency_key.as_deref().unwrap_or(""),
            $($rest)+
        )
    };
}

/// How a relay behaves. Every field has a default suited to a single relay in front of a busy
/// PostgreSQL; `outbox relay` reads them from its config file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Who this relay is, in lease owner columns and logs. Defaults to `host-pid-random`.
    pub relay_id: String,
    /// Most events claimed at once.
    pub batch_size: u32,
    /// Most bytes claimed at once, counting whole rows (the payload and every other column): a
    /// claim stops adding events once their rows reach this (the first event always comes
    /// back), so memory is bounded by bytes, not only by `batch_size`. Expect the relay to hold up to about six times the larger of this
    /// and `max_payload_bytes` per batch alive: the stored payload, the message the sink
    /// builds, the sink client's buffer (measured: one 50 MB event to the file sink peaked at
    /// 292 MB RSS).
    pub max_batch_bytes: u64,
    /// An event whose payload is larger is not loaded: it is dead-lettered at claim time with a
    /// reason that names this limit (raise it and `outbox dead requeue` the event if the
    /// destination accepts such messages).
    pub max_payload_bytes: u64,
    /// Most bytes all of an event's other columns may take together (id, aggregate type and
    /// id, event type, destination, idempotency key, headers, and in WAL mode a copied row's
    /// fields): a larger event is dead-lettered without being loaded, like one over
    /// [`RelayConfig::max_payload_bytes`], with a reason naming this limit and the size. The
    /// stores measure the columns in the database and send none of them for such a row. These columns are names and routing data, never
    /// bulk; the bound keeps a writer from making the relay load megabytes through them.
    /// 64 KiB.
    pub max_metadata_bytes: u64,
    /// Longest pause between claims: the pause of an idle outbox, which bounds the delivery
    /// latency of its next event. Shorter costs one cheap indexed query per interval while
    /// nothing happens. See [`RelayConfig::min_poll_interval`] for the pause while events trickle
    /// in.
    #[serde(with = "humantime_duration")]
    pub poll_interval: Duration,
    /// Pause after a claim that found events but came back short (events are trickling in):
    /// the delivery latency of a busy outbox. After each claim that finds nothing the pause
    /// doubles, up to [`RelayConfig::poll_interval`], so an idle outbox is asked no more often
    /// than before. Set it equal to `poll_interval` for a fixed interval. A batch that finishes
    /// during a pause ends it (its aggregates' next events may be due), but claims are never
    /// closer than this while events trickle in.
    #[serde(with = "humantime_duration")]
    pub min_poll_interval: Duration,
    /// How long a claim is exclusive. Another relay can re-claim the events after it, so it must
    /// exceed the slowest expected publish of one batch.
    #[serde(with = "humantime_duration")]
    pub lease: Duration,
    /// Longest wait for one publish call to the sink; past it, its events count as failed.
    #[serde(with = "humantime_duration")]
    pub publish_timeout: Duration,
    /// Batches being published at the same time (pipelining: the next claim overlaps the
    /// current publish). With several destinations, a batch left waiting only on slow calls
    /// gives its slot back early (up to four batches per slot stay alive). Worth raising only
    /// when batches span many more aggregates than `batch_size`: a claim skips every aggregate
    /// that has an event in flight, and with few hot aggregates an overlapping claim finds little
    /// and scans the whole backlog to find it.
    pub max_batches_in_flight: usize,
    /// Backoff and attempt limit for failed deliveries.
    pub retry: RetryPolicy,
    /// Whether a dead event holds back the later events of its aggregate.
    pub dead_letter: DeadLetterPolicy,
    /// Longest pause between attempts to reach a database that is down.
    #[serde(with = "humantime_duration")]
    pub max_store_backoff: Duration,
    /// Longest time a failing destination is left alone before it is tried again (see the crate
    /// docs). Its events wait without calling it meanwhile, costing no attempt. `0s` turns this
    /// off: every wave calls every destination.
    #[serde(with = "humantime_duration")]
    pub destination_cooldown: Duration,
    /// Once a destination has been unavailable this long without answering, events that meet it
    /// unavailable are dead (`destination unavailable for …`). `0s` (the default): never; an
    /// outage costs time, not events. See the crate docs.
    #[serde(with = "humantime_duration")]
    pub dead_after_unavailable: Duration,
    /// [`RelayConfig::dead_after_unavailable`] for one destination, by name (`0s`: never, for
    /// that one).
    #[serde(with = "duration_map")]
    pub dead_after_unavailable_for: BTreeMap<String, Duration>,
    /// An event that causes this many outages of its destination, which answers other events in
    /// between, is dead as a suspected poison (see "An event that looks like an outage" in the
    /// crate docs). 5 by default; `0` turns the check off.
    pub max_outages_per_event: u32,
    /// Return once a claim finds nothing due and no batch is in flight (`outbox relay --drain`).
    pub stop_when_idle: bool,
    /// With `stop_when_idle`: once nothing is due, keep claiming for events this relay set to
    /// retry that come due within this long, so a drain does not leave a failed event behind
    /// whose retry is seconds away. What is left after it (retries due later, events of paused
    /// destinations, events that failed before this run) stays pending; `outbox relay --drain`
    /// says how many. `0s`: stop as soon as nothing is due.
    #[serde(with = "humantime_duration")]
    pub drain_wait: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            relay_id: default_relay_id(),
            batch_size: 500,
            max_batch_bytes: 32 * 1024 * 1024,
            max_payload_bytes: 16 * 1024 * 1024,
            max_metadata_bytes: 64 * 1024,
            poll_interval: Duration::from_millis(100),
            min_poll_interval: Duration::from_millis(10),
            lease: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(10),
            max_batches_in_flight: 1,
            retry: RetryPolicy::default(),
            dead_letter: DeadLetterPolicy::default(),
            max_store_backoff: Duration::from_secs(10),
            destination_cooldown: Duration::from_secs(10),
            dead_after_unavailable: Duration::ZERO,
            dead_after_unavailable_for: BTreeMap::new(),
            max_outages_per_event: 5,
            stop_when_idle: false,
            // The default retry cap: a drain waits out one full backoff.
            drain_wait: RetryPolicy::default().cap,
        }
    }
}

impl RelayConfig {
    /// How long `destination` may be unavailable before its events are dead (`None`: forever).
    pub fn unavailable_limit(&self, destination: &str) -> Option<Duration> {
        let limit = self
            .dead_after_unavailable_for
            .get(destination)
            .copied()
            .unwrap_or(self.dead_after_unavailable);
        (!limit.is_zero()).then_some(limit)
    }
}

/// `serde` for a map of names to human durations (`{ webhooks = "15m" }`).
mod duration_map {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use outbox_types::humantime_duration::{format_duration, parse_duration};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        map: &BTreeMap<String, Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(map.iter().map(|(k, v)| (k, format_duration(*v))))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, Duration>, D::Error> {
        BTreeMap::<String, String>::deserialize(d)?
            .into_iter()
            .map(|(k, v)| {
                parse_duration(&v)
                    .map(|d| (k.clone(), d))
                    .map_err(|e| serde::de::Error::custom(format!("`{k}`: {e}")))
            })
            .collect()
    }
}

/// `hostname-pid-xxxx`: unique enough to tell relays apart in `outbox status`.
pub fn default_relay_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "relay".to_owned());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}

/// What one run of the relay did. Also readable live through [`Relay::counters`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RelayReport {
    /// Claims that returned at least one event.
    pub batches: u64,
    /// Events claimed.
    pub claimed: u64,
    /// Events the sink confirmed and the store acknowledged.
    pub delivered: u64,
    /// Failed attempts sent back for a later retry (events that met their destination
    /// unavailable are counted in `unavailable` instead).
    pub retried: u64,
    /// Events answered without calling their destination, because it was failing (each then
    /// waits, costing no attempt).
    pub short_circuited: u64,
    /// Events that met their destination unavailable and wait for it, costing no attempt
    /// (short-circuited ones included).
    pub unavailable: u64,
    /// Events buried (rejected, or out of attempts).
    pub dead: u64,
    /// Events given back unpublished (held behind a failure of their aggregate, or shutdown).
    pub released: u64,
    /// Writes that matched no row because the lease had expired and moved on.
    pub fenced: u64,
    /// Store calls that failed (each retried).
    pub store_errors: u64,
    /// Why the source stopped the relay, when it did (a lost replication slot, say).
    pub failure: Option<String>,
}

/// Live counters of a running relay.
#[derive(Debug, Default)]
pub struct RelayCounters {
    batches: AtomicU64,
    claimed: AtomicU64,
    delivered: AtomicU64,
    retried: AtomicU64,
    short_circuited: AtomicU64,
    unavailable: AtomicU64,
    dead: AtomicU64,
    released: AtomicU64,
    fenced: AtomicU64,
    store_errors: AtomicU64,
}

impl RelayCounters {
    /// A snapshot.
    pub fn report(&self) -> RelayReport {
        RelayReport {
            batches: self.batches.load(Ordering::Relaxed),
            claimed: self.claimed.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            short_circuited: self.short_circuited.load(Ordering::Relaxed),
            unavailable: self.unavailable.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            fenced: self.fenced.load(Ordering::Relaxed),
            store_errors: self.store_errors.load(Ordering::Relaxed),
            failure: None,
        }
    }
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// The relay: one [`Source`], one [`Sink`], one [`RelayConfig`].
pub struct Relay<S: ?Sized, K: ?Sized> {
    source: Arc<S>,
    sink: Arc<K>,
    config: Arc<RelayConfig>,
    counters: Arc<RelayCounters>,
    /// How events map to destinations, when the sink is a [`router::Router`]: used to skip
    /// paused destinations at claim time and to label logs and metrics per destination.
    routes: Option<Arc<RouteTable>>,
    /// Each destination's failure state.
    lanes: Arc<Lanes>,
}

/// What the relay knows of each destination right now: a handle that stays valid while the relay
/// runs ([`Relay::destinations`]), for status endpoints.
#[derive(Clone)]
pub struct Destinations(Arc<Lanes>);

/// One destination as the relay sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DestinationState {
    /// Its name (the sink's name without routes).
    pub destination: String,
    /// `false` from the first call it did not answer until it answers again.
    pub up: bool,
    /// Left alone for a cooldown now (its events wait without calling it).
    pub failing: bool,
    /// When the outage began (the first call it did not answer), as Unix seconds.
    pub down_since_unix: Option<f64>,
    /// The newest reason it gave, while down (URLs without their credentials).
    pub last_error: Option<String>,
}

impl Destinations {
    /// Every destination, in the order of the routes.
    pub fn snapshot(&self) -> Vec<DestinationState> {
        let lanes = &self.0;
        let now = Instant::now();
        let health = lanes.health.lock().unwrap_or_else(|p| p.into_inner());
        (0..lanes.count())
            .filter(|&lane| !lanes.is_unroutable(lane))
            .map(|lane| {
                let mut h = health.get(lane).cloned().unwrap_or_default();
                // An outage with no failed call for a minute is over, as the relay itself counts
                // it (nothing was sent there since, so nothing says it is down).
                if h.outage_is_stale(now) {
                    h.down_since = None;
                }
                DestinationState {
                    destination: lanes.name(lane).to_owned(),
                    up: h.down_since.is_none(),
                    failing: h.open_until.is_some_and(|t| t > now),
                    down_since_unix: h.down_since.map(|(_, wall)| unix_seconds(wall)),
                    last_error: (h.down_since.is_some() && !h.last_error.is_empty())
                        .then(|| outbox_types::redact::redact_in_text(&h.last_error)),
                }
            })
            .collect()
    }
}

impl<S, K> Relay<S, K>
where
    S: Source + ?Sized,
    K: Sink + ?Sized,
{
    /// A relay over `source` (any [`Store`](outbox_types::Store), or a stream source) and `sink`.
    pub fn new(source: Arc<S>, sink: Arc<K>, config: RelayConfig) -> Self {
        let lanes = Arc::new(Lanes::new(None, sink.name()));
        Relay {
            source,
            sink,
            config: Arc::new(config),
            counters: Arc::new(RelayCounters::default()),
            routes: None,
            lanes,
        }
    }

    /// Serve several destinations: `routes` says which one each event goes to (the sink is then
    /// normally a [`router::Router`] over the same table). The relay then reads the paused
    /// destinations from the store every poll interval and leaves their events unclaimed, and
    /// labels logs and metrics with each event's destination instead of the sink's name.
    pub fn with_routes(mut self, routes: Arc<RouteTable>) -> Self {
        self.lanes = Arc::new(Lanes::new(Some(routes.clone()), self.sink.name()));
        self.routes = Some(routes);
        self
    }

    /// Each destination's state as the relay sees it, live while [`Relay::run`] is going.
    pub fn destinations(&self) -> Destinations {
        Destinations(self.lanes.clone())
    }

    /// Live counters, readable while [`Relay::run`] is going.
    pub fn counters(&self) -> Arc<RelayCounters> {
        self.counters.clone()
    }

    /// Run until `shutdown` completes (or, with [`RelayConfig::stop_when_idle`], until nothing is
    /// due), then finish in-flight batches and return what was done.
    ///
    /// Database outages do not end the run: the relay logs, backs off and carries on once the
    /// database answers again.
    pub async fn run<F>(self, shutdown: F) -> RelayReport
    where
        F: Future<Output = ()> + Send,
    {
        let config = self.config.clone();
        let ctx = Arc::new(BatchContext {
            source: self.source.clone(),
            sink: self.sink.clone(),
            config: config.clone(),
            counters: self.counters.clone(),
            retrying: std::sync::Mutex::new(HashMap::new()),
            stopping: AtomicBool::new(false),
            lanes: self.lanes.clone(),
        });
        let mut request = claim_request(&config);
        let mut pauses = PauseWatch::new(self.routes.clone(), config.poll_interval);
        let mut holds = HoldCache::new(self.routes.clone());
        let slots = Arc::new(Semaphore::new(config.max_batches_in_flight.max(1)));
        // Batches alive at once, counting those that gave their slot back while they wait for a
        // slow destination (see `BatchContext::process`).
        let max_alive = config.max_batches_in_flight.max(1) * MAX_ALIVE_PER_SLOT;
        let mut batches: JoinSet<()> = JoinSet::new();
        let mut turns = Turns::new(&config);
        tokio::pin!(shutdown);
        info!(
            relay_id = %config.relay_id,
            sink = self.sink.name(),
            batch_size = config.batch_size,
            "Relay started."
        );

        loop {
            while batches.try_join_next().is_some() {}
            if batches.len() >= max_alive {
                tokio::select! {
                    biased;
                    _ = &mut shutdown => break,
                    _ = batches.join_next() => {}
                }
                continue;
            }
            let slot = tokio::select! {
                biased;
                _ = &mut shutdown => break,
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
            };
            pauses.refresh(self.source.as_ref()).await;
            let deferred = turns.defer.take();
            request.hold = holds.get(&pauses.current, deferred.as_deref());
            // A claim is never cancelled half-way: a claim that committed but whose result
            // was dropped would leave events in flight until their lease ran out.
            let started = Instant::now();
            let claimed = self.source.claim(&request).await;
            metrics::histogram!("outbox_claim_duration_seconds")
                .record(started.elapsed().as_secs_f64());
            let next = match claimed {
                Ok(claim) => {
                    turns.store_failures = 0;
                    if claim.buried > 0 {
                        // Unreadable or oversized rows the store buried at claim time.
                        add(&self.counters.dead, claim.buried);
                    }
                    if claim.events.is_empty() {
                        drop(slot);
                        self.found_nothing(&mut turns, deferred.is_some(), &ctx, &mut batches)
                            .await
                    } else {
                        let next = turns.found_some(
                            &self.lanes,
                            &claim,
                            request.limit,
                            deferred.is_some(),
                        );
                        add(&self.counters.batches, 1);
                        add(&self.counters.claimed, claim.events.len() as u64);
                        let ctx = ctx.clone();
                        batches.spawn(async move {
                            ctx.process(claim, started, slot).await;
                        });
                        next
                    }
                }
                Err(error) => {
                    drop(slot);
                    self.claim_failed(&mut turns, error)
                }
            };
            match next {
                Next::ClaimNow => {}
                Next::Stop => break,
                Next::Wait(wait) => {
                    // A batch finishing may unblock its aggregates' next events: claim again
                    // once one does, but not sooner than `min_poll_interval` after this claim
                    // (see `claim_after_a_batch`), or after the poll interval.
                    let paced = claim_after_a_batch(started, wait, config.min_poll_interval);
                    tokio::select! {
                        biased;
                        _ = &mut shutdown => break,
                        Some(_) = batches.join_next(), if !batches.is_empty() => {
                            tokio::select! {
                                biased;
                                _ = &mut shutdown => break,
                                _ = self.source.work_ready() => {}
                                _ = tokio::time::sleep_until(paced) => {}
                            }
                        }
                        // A stream source with events waiting: claim them now, not after the poll.
                        _ = self.source.work_ready() => {}
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }

        self.finish(&ctx, batches, turns.failure).await
    }

    /// The end of a run: finish the batches in flight, let the source close, and report.
    async fn finish(
        &self,
        ctx: &BatchContext<S, K>,
        mut batches: JoinSet<()>,
        failure: Option<String>,
    ) -> RelayReport {
        ctx.stopping.store(true, Ordering::SeqCst);
        info!(
            in_flight_batches = batches.len(),
            "Relay stopping: finishing in-flight batches."
        );
        while batches.join_next().await.is_some() {}
        self.source.close().await;
        let mut report = self.counters.report();
        report.failure = failure;
        info!(
            delivered = report.delivered,
            retried = report.retried,
            dead = report.dead,
            fenced = report.fenced,
            "Relay stopped."
        );
        report
    }

    /// A claim found nothing due. With a destination deferred, nothing but it is due: claim it
    /// again at once, and do not look for others again soon. A drain (`stop_when_idle`) stops
    /// once nothing is left, its finishing batches and the retries it waits for included;
    /// otherwise the relay waits, longer each time nothing is found.
    async fn found_nothing(
        &self,
        turns: &mut Turns,
        deferred: bool,
        ctx: &BatchContext<S, K>,
        batches: &mut JoinSet<()>,
    ) -> Next {
        if deferred {
            turns.next_fair_turn = Instant::now() + FAIR_TURN_AFTER_NOTHING;
            return Next::ClaimNow;
        }
        if self.config.stop_when_idle {
            if !batches.is_empty() {
                // Finishing batches may release events: claim again once they are done.
                while batches.join_next().await.is_some() {}
                return Next::ClaimNow;
            }
            if self.source.exhausted() && !turns.waits_for_a_retry(ctx, &self.config) {
                return Next::Stop;
            }
        }
        Next::Wait(turns.pacer.found_nothing())
    }

    /// A claim failed. A source that stopped (a stream whose slot is gone) stops the relay;
    /// anything else is the database being unreachable: log, back off, and claim again.
    fn claim_failed(&self, turns: &mut Turns, error: StoreError) -> Next {
        if let StoreError::Stopped(reason) = error {
            tracing::error!(%reason, "The source stopped; the relay stops.");
            turns.failure = Some(reason);
            return Next::Stop;
        }
        add(&self.counters.store_errors, 1);
        metrics::counter!("outbox_database_errors_total").increment(1);
        turns.store_failures = turns.store_failures.saturating_add(1);
        let pause = store_backoff(turns.store_failures, self.config.max_store_backoff);
        warn!(
            %error,
            retry_in_ms = pause.as_millis() as u64,
            "Claim failed; the database may be down. Events stay in the outbox."
        );
        Next::Wait(pause)
    }
}

/// Which write-back of a batch [`BatchContext::write_back`] is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WriteBack {
    /// What is settled so far, while the rest of the batch waits for a slow destination.
    SoFar,
    /// The batch's last: nothing more is written under its lease after it.
    Last,
}

/// The claim every turn of [`Relay::run`] sends (its hold set per turn).
fn claim_request(config: &RelayConfig) -> ClaimRequest {
    ClaimRequest::new(
        config.relay_id.clone(),
        config.batch_size.max(1),
        config.lease,
        config.dead_letter,
    )
    .with_byte_limits(
        config.max_batch_bytes.max(1),
        config.max_payload_bytes.max(1),
    )
    .with_metadata_limit(config.max_metadata_bytes.max(1))
}

/// When the delivery loop claims again after a batch finished while it waited `wait` past a
/// claim that started at `claimed`: not before `min` after that claim (nor after the wait).
///
/// Why: a finished batch may have freed its aggregates' next events, so the loop claims again
/// without waiting out a long pause. Claiming at once, though, made every batch's end a claim:
/// at 2,000 events/s with one event per transaction the polling relay claimed (and acked) a
/// few events at a time, hundreds of times a second, one SQL round trip each way per handful of
/// events (the store's statements were over half of its CPU). Spaced by `min`, a trickle is
/// claimed about once per `min` (the latency the docs of `min_poll_interval` promise), and
/// an event held behind its aggregate's batch waits at most `min` longer than before. A source
/// with work ready (the WAL stream) is still claimed at once.
fn claim_after_a_batch(claimed: Instant, wait: Duration, min: Duration) -> Instant {
    claimed + min.min(wait)
}

/// What the delivery loop of [`Relay::run`] does after a claim.
enum Next {
    /// Claim again at once.
    ClaimNow,
    /// Claim again after this pause, or sooner when a batch finishes or the source has work.
    Wait(Duration),
    /// Stop: the source stopped, or a drain found nothing left.
    Stop,
}

/// What the delivery loop of [`Relay::run`] remembers from one claim to the next.
struct Turns {
    /// The destination the next claim skips: one whose backlog filled the last claim (see
    /// `Lanes::dominant`).
    defer: Option<String>,
    /// No fair turn before this: they are spaced, and rarer after one that found nothing.
    next_fair_turn: Instant,
    /// Claims failed in a row (the database unreachable), for the backoff.
    store_failures: u32,
    /// Why the source stopped the relay, if it did.
    failure: Option<String>,
    pacer: Pacer,
    /// When a drain first found nothing due: it waits for retries at most `drain_wait` past it.
    idle_since: Option<Instant>,
}

impl Turns {
    fn new(config: &RelayConfig) -> Self {
        Turns {
            defer: None,
            next_fair_turn: Instant::now(),
            store_failures: 0,
            failure: None,
            pacer: Pacer::new(config.min_poll_interval, config.poll_interval),
            idle_since: None,
        }
    }

    /// A claim of up to `limit` found events. After a fair turn, the next fair turn is spaced; a
    /// full claim when one is due defers its dominant destination. A full claim, or one that
    /// served a deferred destination (its backlog is claimed again at once after the others'
    /// turn), claims again at once; a short one waits the pacer's pause.
    fn found_some(&mut self, lanes: &Lanes, claim: &Claim, limit: u32, deferred: bool) -> Next {
        let full = claim.events.len() >= limit as usize;
        if deferred {
            self.next_fair_turn = Instant::now() + FAIR_TURN_SPACING;
        } else if full && Instant::now() >= self.next_fair_turn {
            self.defer = lanes.dominant(&claim.events);
        }
        metrics::histogram!("outbox_claim_batch_size").record(claim.events.len() as f64);
        let pause = self.pacer.found_some();
        if full || deferred {
            Next::ClaimNow
        } else {
            Next::Wait(pause)
        }
    }

    /// Whether a drain that found nothing still waits for one of its retries: one that comes
    /// due within the drain's wait (counted from when the drain first found nothing), claimed
    /// until it is settled or a little past its time (it may wait behind a paused destination
    /// or another failure).
    fn waits_for_a_retry<S: ?Sized, K: ?Sized>(
        &mut self,
        ctx: &BatchContext<S, K>,
        config: &RelayConfig,
    ) -> bool {
        let now = Instant::now();
        let idle = *self.idle_since.get_or_insert(now);
        ctx.retrying
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .any(|due| *due <= idle + config.drain_wait && now <= *due + DRAIN_GRACE)
    }
}

/// Which destinations are paused, re-read from the store at most once per poll interval.
struct PauseWatch {
    routes: Option<Arc<RouteTable>>,
    every: Duration,
    last: Option<Instant>,
    current: Vec<String>,
    unsupported: bool,
}

impl PauseWatch {
    fn new(routes: Option<Arc<RouteTable>>, every: Duration) -> Self {
        PauseWatch {
            routes,
            every,
            last: None,
            current: Vec::new(),
            unsupported: false,
        }
    }

    async fn refresh<S: Source + ?Sized>(&mut self, source: &S) {
        if self.routes.is_none() {
            return;
        }
        if self.unsupported || self.last.is_some_and(|t| t.elapsed() < self.every) {
            return;
        }
        self.last = Some(Instant::now());
        match source.paused().await {
            Ok(list) => {
                let mut names: Vec<String> = list.into_iter().map(|p| p.destination).collect();
                names.sort();
                if names != self.current {
                    for name in names.iter().filter(|n| !self.current.contains(n)) {
                        info!(destination = %name, "Destination paused: its events stay pending until `outbox resume`.");
                    }
                    for name in self.current.iter().filter(|n| !names.contains(n)) {
                        info!(destination = %name, "Destination resumed.");
                    }
                    self.current = names;
                }
            }
            Err(StoreError::Unsupported { .. }) => {
                warn!("This source cannot pause destinations; `outbox pause` has no effect here.");
                self.unsupported = true;
            }
            Err(error) => {
                metrics::counter!("outbox_database_errors_total").increment(1);
                warn!(%error, "Could not read paused destinations; keeping the previous list.");
            }
        }
    }
}

/// The hold of each claim: the paused destinations plus, for one claim, a deferred one; rebuilt
/// only when either changes.
struct HoldCache {
    routes: Option<Arc<RouteTable>>,
    hold: Option<Arc<Hold>>,
}

impl HoldCache {
    fn new(routes: Option<Arc<RouteTable>>) -> Self {
        HoldCache { routes, hold: None }
    }

    fn get(&mut self, paused: &[String], deferred: Option<&str>) -> Option<Arc<Hold>> {
        let routes = self.routes.as_ref()?;
        let current = self.hold.as_deref().map_or((&[][..], None), |h| {
            (h.paused.as_slice(), h.deferred.first().map(String::as_str))
        });
        if current != (paused, deferred) {
            self.hold = (!paused.is_empty() || deferred.is_some()).then(|| {
                Arc::new(Hold {
                    routes: (**routes).clone(),
                    paused: paused.to_vec(),
                    deferred: deferred.into_iter().map(str::to_owned).collect(),
                })
            });
        }
        self.hold.clone()
    }
}

/// The text of a panic's payload (`panic!("…")` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "(no message)".to_owned()
    }
}

/// The pause between claims that come back short. While claims find events, the next one
/// follows after `min` (a trickle is delivered within about `min`); each claim that finds nothing
/// doubles the pause, up to `max`, so an idle outbox costs the database what a fixed `max`
/// interval did (after a handful of claims) while a busy one is not held to it. A wake-up signal
/// from writers (`NOTIFY`) was the alternative; it was not taken because `NOTIFY` in a business
/// transaction takes a database-wide lock at commit, serialising every writer's commits.
#[derive(Debug)]
struct Pacer {
    min: Duration,
    max: Duration,
    /// The pause after the next claim that finds nothing.
    idle: Duration,
}

impl Pacer {
    fn new(min: Duration, max: Duration) -> Self {
        let min = min.min(max);
        Pacer {
            min,
            max,
            idle: min,
        }
    }

    /// The claim found events (and came back short): claim again soon.
    fn found_some(&mut self) -> Duration {
        self.idle = self.min;
        self.min
    }

    /// The claim found nothing: wait, and wait longer next time.
    fn found_nothing(&mut self) -> Duration {
        let pause = self.idle;
        self.idle = self
            .idle
            .saturating_mul(2)
            .max(Duration::from_millis(1))
            .min(self.max);
        pause
    }
}

/// `outcome` with its reason through [`outbox_types::redact::redact_in_text`].
fn redacted(outcome: Outcome) -> Outcome {
    use outbox_types::redact::redact_in_text;
    let clean = |reason: String| {
        if reason.contains("://") || reason.contains('@') {
            redact_in_text(&reason)
        } else {
            reason
        }
    };
    match outcome {
        Outcome::Delivered => Outcome::Delivered,
        Outcome::Unavailable { reason, after } => Outcome::Unavailable {
            reason: clean(reason),
            after,
        },
        Outcome::Retry { reason, after } => Outcome::Retry {
            reason: clean(reason),
            after,
        },
        Outcome::Reject { reason } => Outcome::Reject {
            reason: clean(reason),
        },
    }
}

/// Exponential pause between attempts to reach the database: 100 ms, 200 ms, … up to `max`.
fn store_backoff(failures: u32, max: Duration) -> Duration {
    let exponent = failures.saturating_sub(1).min(20);
    Duration::from_millis(100u64.saturating_mul(1 << exponent)).min(max)
}

struct BatchContext<S: ?Sized, K: ?Sized> {
    source: Arc<S>,
    sink: Arc<K>,
    config: Arc<RelayConfig>,
    counters: Arc<RelayCounters>,
    /// A drain's retries (`stop_when_idle` only): event seq → when it comes due. Settling the
    /// event removes it.
    retrying: std::sync::Mutex<HashMap<i64, Instant>>,
    stopping: AtomicBool,
    /// The destinations, from the routes when there are any (else the sink alone).
    lanes: Arc<Lanes>,
}

/// The destinations a batch is published to, each with its failure state. Without routes there
/// is one lane, the sink; with routes one per destination plus one for events no route matches
/// (the router rejects those).
struct Lanes {
    names: Vec<String>,
    routes: Option<Arc<RouteTable>>,
    health: std::sync::Mutex<Vec<Health>>,
    /// Per destination, the events suspected of causing its outages.
    suspects: std::sync::Mutex<Vec<Suspects>>,
}

/// What a destination's outages say about its events (see "An event that looks like an outage"
/// in the crate docs).
#[derive(Default)]
struct Suspects {
    /// Outages begun so far (numbers them; never reset, unlike [`Health`]).
    outages: u64,
    /// Calls it answered so far.
    answers: u64,
    /// Events present at a failed call and not answered since.
    events: HashMap<outbox_types::EventId, Suspect>,
    /// Events whose count reached the limit, for `settle` to bury.
    poisoned: std::collections::HashSet<outbox_types::EventId>,
}

/// One event's record of the outages it met.
struct Suspect {
    /// The outage of its latest failed call.
    outage: u64,
    /// [`Suspects::answers`] at its latest failed call.
    answers: u64,
    /// Outages it caused.
    caused: u32,
}

/// Most events a destination's [`Suspects`] remembers.
const MAX_SUSPECTS: usize = 10_000;

/// How a failed call stood in its destination's outage.
#[derive(Clone, Copy)]
struct FailedCall {
    /// The outage's number.
    outage: u64,
    /// The call began it (the destination had answered, or nothing was failing, before).
    began: bool,
}

/// How a destination has been answering lately.
#[derive(Clone, Default)]
struct Health {
    /// Calls in a row that failed every event (a timeout counts), since it last answered.
    failed_calls: u32,
    /// Times it was found failing since it last answered; sets the cooldown.
    trips: u32,
    /// Not called before this instant.
    open_until: Option<Instant>,
    /// After the cooldown, one call tries it; the others are refused until that one is back.
    trying: bool,
    last_error: String,
    /// The first failed call since it last answered: when this outage began.
    down_since: Option<(Instant, std::time::SystemTime)>,
    /// The latest failed call: an outage with no failed call for [`STALE_OUTAGE`] is over (the
    /// relay may simply have had nothing for the destination since).
    last_failed: Option<Instant>,
}

/// `wall` as Unix seconds, for the down-since gauge and [`DestinationState::down_since_unix`].
fn unix_seconds(wall: std::time::SystemTime) -> f64 {
    wall.duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// How long after its last failed call an outage counts as over when nothing answered since.
const STALE_OUTAGE: Duration = Duration::from_secs(60);

impl Health {
    /// Whether the outage it records is over by [`STALE_OUTAGE`] (no failed call since).
    fn outage_is_stale(&self, now: Instant) -> bool {
        self.last_failed
            .is_some_and(|t| now.saturating_duration_since(t) > STALE_OUTAGE)
    }
}

/// How long events are put off while the one trial call after a cooldown is out.
const WHILE_TRYING: Duration = Duration::from_millis(500);

/// Least time between two fair turns (see "Fair turns" in the module docs): a claim that skips
/// a destination's backlog reads past it (about 80 ms past 100k rows on PostgreSQL, measured),
/// so while the backlog drains the others get a turn at least this often, not after every claim.
const FAIR_TURN_SPACING: Duration = Duration::from_millis(250);

/// How long past a retry's due time a drain keeps claiming for it.
const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// Least time before the next fair turn after one that found nothing of the others due.
const FAIR_TURN_AFTER_NOTHING: Duration = Duration::from_secs(2);

/// How many batches may be alive per slot of [`RelayConfig::max_batches_in_flight`]: a batch
/// whose remaining events all wait for a slow call gives its slot back early (see
/// `BatchContext::process`), and this bounds how many such batches pile up.
const MAX_ALIVE_PER_SLOT: usize = 4;

/// Calls in a row that fail every event before a destination counts as failing (one timeout is
/// enough). One failed call says little: a batch of one event may fail on its own.
const FAILED_CALLS_TO_TRIP: u32 = 3;

impl Lanes {
    fn new(routes: Option<Arc<RouteTable>>, sink_name: &str) -> Self {
        let names: Vec<String> = match &routes {
            Some(routes) => routes
                .destinations()
                .iter()
                .cloned()
                .chain(std::iter::once("(unroutable)".to_owned()))
                .collect(),
            None => vec![sink_name.to_owned()],
        };
        let health = std::sync::Mutex::new(vec![Health::default(); names.len()]);
        let suspects =
            std::sync::Mutex::new((0..names.len()).map(|_| Suspects::default()).collect());
        Lanes {
            names,
            routes,
            health,
            suspects,
        }
    }

    fn count(&self) -> usize {
        self.names.len()
    }

    fn name(&self, lane: usize) -> &str {
        self.names.get(lane).map(String::as_str).unwrap_or("")
    }

    /// The destination that took more than half of a full claim, when there are others: the
    /// next claim skips it (see "Fair turns" in the module docs). Never the events no route
    /// matches.
    fn dominant(&self, events: &[Event]) -> Option<String> {
        if !self.several() {
            return None;
        }
        let mut per_lane = vec![0usize; self.count()];
        for event in events {
            per_lane[self.of(event)] += 1;
        }
        let (lane, &n) = per_lane.iter().enumerate().max_by_key(|&(_, n)| *n)?;
        (n * 2 > events.len() && !self.is_unroutable(lane)).then(|| self.name(lane).to_owned())
    }

    /// The lane an event goes to.
    fn of(&self, event: &Event) -> usize {
        let Some(routes) = &self.routes else {
            return 0;
        };
        let unroutable = self.names.len() - 1;
        routes
            .resolve_event(event)
            .and_then(|d| routes.destinations().iter().position(|n| n == d))
            .unwrap_or(unroutable)
    }

    /// Whether the cooldown applies: to every destination, not to the events no route matches.
    fn guarded(&self, lane: usize, cooldown: Duration) -> bool {
        !cooldown.is_zero() && !self.is_unroutable(lane)
    }

    /// The lane of events no route matches (the router rejects them).
    fn is_unroutable(&self, lane: usize) -> bool {
        self.routes.is_some() && lane + 1 == self.names.len()
    }

    /// How long `lane` has been failing calls without answering, if it is.
    fn down_for(&self, lane: usize, now: Instant) -> Option<Duration> {
        let health = self.health.lock().unwrap_or_else(|p| p.into_inner());
        let h = health.get(lane)?;
        if h.outage_is_stale(now) {
            return None;
        }
        h.down_since
            .map(|(at, _)| now.saturating_duration_since(at))
    }

    /// Whether there are several destinations (the CLI routes even a single `[sink]`).
    fn several(&self) -> bool {
        self.routes
            .as_ref()
            .is_some_and(|r| r.destinations().len() > 1)
    }

    /// Why `lane` is not to be called now, and for how much longer, if it is failing. Once its
    /// cooldown is over, the first caller gets `None` and makes the one trial call.
    fn refusal(&self, lane: usize, now: Instant) -> Option<(String, Duration)> {
        let mut health = self.health.lock().unwrap_or_else(|p| p.into_inner());
        let h = health.get_mut(lane)?;
        let until = h.open_until?;
        let remaining = if until > now {
            until - now
        } else if h.trying {
            WHILE_TRYING
        } else {
            h.trying = true;
            return None;
        };
        let reason = format!(
            "destination `{}` is failing ({}); not called for another {} ms",
            self.name(lane),
            h.last_error,
            remaining.as_millis()
        );
        Some((reason, remaining))
    }

    /// Count `events`, all of a failed `call` to `lane`, toward the outages they caused; returns
    /// how many of them reached `limit` (they are then marked for [`Lanes::take_poisoned`]).
    fn suspect(&self, lane: usize, events: &[Event], call: FailedCall, limit: u32) -> usize {
        let mut all = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        let Some(suspects) = all.get_mut(lane) else {
            return 0;
        };
        let answers = suspects.answers;
        let mut reached = 0;
        for event in events {
            if !suspects.events.contains_key(&event.id) && suspects.events.len() >= MAX_SUSPECTS {
                // Forget events whose latest failure was in an earlier outage; if none, this one
                // goes uncounted (the bound keeps a long outage from growing the map).
                let current = call.outage;
                suspects.events.retain(|_, s| s.outage >= current);
                if suspects.events.len() >= MAX_SUSPECTS {
                    continue;
                }
            }
            let entry = suspects.events.entry(event.id).or_insert(Suspect {
                outage: 0,
                answers,
                caused: 0,
            });
            if entry.outage == call.outage {
                continue;
            }
            // It caused this outage: it began it, or the destination answered others since this
            // event last failed.
            let caused = call.began || (entry.outage != 0 && answers > entry.answers);
            entry.outage = call.outage;
            entry.answers = answers;
            if caused {
                entry.caused += 1;
                if entry.caused >= limit {
                    suspects.poisoned.insert(event.id);
                    reached += 1;
                }
            }
        }
        reached
    }

    /// Whether `event` was marked a suspected poison of `lane`, with the outages it caused; the
    /// mark and the record go (it is buried).
    fn take_poisoned(&self, lane: usize, event: &Event) -> Option<u32> {
        let mut all = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        let suspects = all.get_mut(lane)?;
        if !suspects.poisoned.remove(&event.id) {
            return None;
        }
        Some(suspects.events.remove(&event.id).map_or(0, |r| r.caused))
    }

    /// Forget what `lane`'s outages said about `event`: the destination answered about it.
    fn forget_suspect(&self, lane: usize, event: &Event) {
        let mut all = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(suspects) = all.get_mut(lane)
            && !suspects.events.is_empty()
        {
            suspects.events.remove(&event.id);
            suspects.poisoned.remove(&event.id);
        }
    }

    /// Record how a call to `lane` went; for a failed call, where it stands in the outage.
    fn record(
        &self,
        lane: usize,
        outcomes: &[Outcome],
        timed_out: bool,
        max_cooldown: Duration,
    ) -> Option<FailedCall> {
        let name = self.name(lane);
        // Any outcome but `Unavailable` is the destination answering about an event (a per-event
        // `Retry` included: an unroutable message, a 500 for one payload); only a call it did
        // not answer at all counts toward failing.
        let answered = outcomes
            .iter()
            .any(|o| !matches!(o, Outcome::Unavailable { .. }));
        let now = Instant::now();
        let (tripped, failed) = {
            let mut health = self.health.lock().unwrap_or_else(|p| p.into_inner());
            let h = health.get_mut(lane)?;
            if answered || outcomes.is_empty() {
                if let Some(s) = self
                    .suspects
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_mut(lane)
                {
                    s.answers += 1;
                }
                let was_failing = h.trips > 0;
                let down_for = h
                    .down_since
                    .map(|(at, _)| now.saturating_duration_since(at));
                *h = Health::default();
                drop(health);
                if was_failing {
                    info!(
                        destination = name,
                        down_ms = down_for.unwrap_or_default().as_millis() as u64,
                        "Destination answers again; publishing to it resumes."
                    );
                    metrics::gauge!("outbox_destination_failing", "destination" => name.to_owned())
                        .set(0.0);
                }
                if down_for.is_some() {
                    metrics::gauge!("outbox_destination_down_since_seconds", "destination" => name.to_owned())
                        .set(0.0);
                }
                return None;
            }
            if let Some(reason) = outcomes.first().and_then(Outcome::reason) {
                h.last_error = truncate_error(reason);
            }
            // A failed call long after the last one starts a new outage: nothing may have been
            // sent there in between (another relay delivered, the destination was paused).
            if h.outage_is_stale(now) {
                h.down_since = None;
            }
            h.last_failed = Some(now);
            let began = h.down_since.is_none();
            if began {
                let wall = std::time::SystemTime::now();
                h.down_since = Some((now, wall));
                metrics::gauge!("outbox_destination_down_since_seconds", "destination" => name.to_owned())
                    .set(unix_seconds(wall));
            }
            let failed = {
                let mut all = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
                all.get_mut(lane).map(|s| {
                    if began {
                        s.outages += 1;
                    }
                    FailedCall {
                        outage: s.outages,
                        began,
                    }
                })
            };
            // Calls that were out while it tripped come back failed too: one trip, not one each.
            if h.open_until.is_some_and(|t| t > now) {
                return failed;
            }
            h.failed_calls += 1;
            // A failed trial call (the one call after a cooldown) starts the next cooldown at
            // once: the destination already proved itself down three calls in a row.
            let trial_failed = h.trips > 0 && h.trying;
            if timed_out || trial_failed || h.failed_calls >= FAILED_CALLS_TO_TRIP {
                h.trips += 1;
                let exponent = (h.trips - 1).min(16);
                let cooldown = Duration::from_millis(500u64 << exponent).min(max_cooldown);
                h.open_until = Some(now + cooldown);
                h.trying = false;
                h.failed_calls = 0;
                (Some((cooldown, h.last_error.clone())), failed)
            } else {
                h.trying = false;
                (None, failed)
            }
        };
        if let Some((cooldown, error)) = tripped {
            metrics::gauge!("outbox_destination_failing", "destination" => name.to_owned())
                .set(1.0);
            warn!(
                destination = name,
                cooldown_ms = cooldown.as_millis() as u64,
                %error,
                "Destination is failing: its events wait, costing no attempt, without calling it until the cooldown ends; other destinations keep flowing."
            );
        }
        failed
    }
}

/// What a batch decided for each of its events, written back at the end.
#[derive(Default)]
struct Settlement {
    delivered: Vec<i64>,
    retries: Vec<RetryEvent>,
    buries: Vec<BuryEvent>,
    released: Vec<i64>,
}

impl Settlement {
    /// Put event `seq` back for another publish after `delay`, counting an attempt or not
    /// (a destination that was unavailable spends none).
    fn retry(&mut self, seq: i64, counts_attempt: bool, delay: Duration, reason: &str) {
        self.retries.push(RetryEvent {
            counts_attempt,
            seq,
            delay,
            error: truncate_error(reason),
        });
    }
}

impl<S, K> BatchContext<S, K>
where
    S: Source + ?Sized,
    K: Sink + ?Sized,
{
    /// `claimed_at` is when the claim was *sent*: the lease runs from the database's commit,
    /// which can be long before the result reached this process (a pause, a slow network), and
    /// counting from the send keeps the stop-publishing deadline inside the lease.
    ///
    /// `slot` is this batch's share of [`RelayConfig::max_batches_in_flight`]. With several
    /// destinations, once every call the batch has out has been out for a quarter of the publish
    /// timeout (a destination that hangs), the batch writes back what is settled so far — those
    /// aggregates are free again — and gives the slot back, so the relay claims on while this
    /// batch waits; otherwise one hanging destination would hold up every other destination's
    /// next batch until its timeout.
    async fn process(
        &self,
        claim: Claim,
        claimed_at: Instant,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) {
        let mut slot = Some(slot);
        let slow_after = self.config.publish_timeout / 4;
        // Stop starting publishes a little before the lease runs out, so an event is not being
        // published here after another relay may have claimed it.
        let margin = (self.config.lease / 5).min(Duration::from_secs(5));
        let deadline = claimed_at + self.config.lease.saturating_sub(margin);
        let lease = claim.lease;

        let mut queues: Vec<VecDeque<Event>> = Vec::new();
        let mut index: HashMap<(String, String), usize> = HashMap::new();
        for event in claim.events {
            let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
            let slot = *index.entry(key).or_insert_with(|| {
                queues.push(VecDeque::new());
                queues.len() - 1
            });
            queues[slot].push_back(event);
        }
        drop(index);

        // Per destination, the aggregates whose next event goes there; at most one call per
        // destination is out at a time, and an aggregate is in at most one call.
        let lanes = &self.lanes;
        let mut ready: Vec<Vec<usize>> = vec![Vec::new(); lanes.count()];
        for (i, queue) in queues.iter().enumerate() {
            if let Some(event) = queue.front() {
                ready[lanes.of(event)].push(i);
            }
        }
        // When each lane's call went out, while it is out.
        let mut busy: Vec<Option<Instant>> = vec![None; lanes.count()];
        let mut calls = FuturesUnordered::new();
        // Calls that came back while an early write-back was going on, not yet settled.
        let mut finished = Vec::new();
        let mut settlement = Settlement::default();
        loop {
            let now = Instant::now();
            if !self.stopping.load(Ordering::SeqCst) && now < deadline {
                for lane in 0..lanes.count() {
                    if busy[lane].is_some() || ready[lane].is_empty() {
                        continue;
                    }
                    let mut members = std::mem::take(&mut ready[lane]);
                    members.sort_unstable();
                    let wave: Vec<Event> = members
                        .iter()
                        .filter_map(|&i| queues[i].pop_front())
                        .collect();
                    busy[lane] = Some(now);
                    calls.push(self.publish_wave(lane, members, wave, deadline - now));
                }
            }
            // Everything startable is out; wait for a call to come back. With several
            // destinations, a batch still holding its slot stops waiting once every call it has
            // out is slow: it writes back what is settled and gives the slot back.
            let newest = busy.iter().flatten().max().copied();
            let next = match (slot.is_some() && lanes.several(), newest) {
                _ if !finished.is_empty() => finished.pop(),
                (true, Some(newest)) => {
                    tokio::select! {
                        biased;
                        next = calls.next() => next,
                        _ = tokio::time::sleep_until(newest + slow_after) => {
                            let settled = std::mem::take(&mut settlement);
                            let write =
                                self.write_back(&lease, settled, claimed_at, WriteBack::SoFar);
                            tokio::pin!(write);
                            // Keep the calls going meanwhile (a sink's call may need polling
                            // to make progress); what comes back is settled afterwards.
                            loop {
                                tokio::select! {
                                    biased;
                                    _ = &mut write => break,
                                    Some(done) = calls.next(), if !calls.is_empty() => finished.push(done),
                                }
                            }
                            slot = None;
                            continue;
                        }
                    }
                }
                _ => calls.next().await,
            };
            // Nothing out means nothing is ready either: every aggregate left is released below.
            let Some((lane, members, wave, outcomes)) = next else {
                break;
            };
            busy[lane] = None;
            for ((i, event), outcome) in members.into_iter().zip(&wave).zip(outcomes) {
                let queue = &mut queues[i];
                if self.settle(event, outcome, &mut settlement) {
                    settlement.released.extend(queue.drain(..).map(|e| e.seq));
                } else if let Some(next) = queue.front() {
                    ready[lanes.of(next)].push(i);
                }
            }
        }
        // Shutdown or the lease's end stopped new waves: what was not published goes back.
        for queue in &mut queues {
            settlement.released.extend(queue.drain(..).map(|e| e.seq));
        }

        self.write_back(&lease, settlement, claimed_at, WriteBack::Last)
            .await;
        drop(slot);
        metrics::histogram!("outbox_relay_batch_duration_seconds")
            .record(claimed_at.elapsed().as_secs_f64());
    }

    /// Publish one wave to one destination (`lane`) within `remaining` of the lease, unless that
    /// destination is failing; returns the wave with one outcome per event.
    async fn publish_wave(
        &self,
        lane: usize,
        members: Vec<usize>,
        wave: Vec<Event>,
        remaining: Duration,
    ) -> (usize, Vec<usize>, Vec<Event>, Vec<Outcome>) {
        let guarded = self.lanes.guarded(lane, self.config.destination_cooldown);
        if guarded && let Some((reason, remaining)) = self.lanes.refusal(lane, Instant::now()) {
            add(&self.counters.short_circuited, wave.len() as u64);
            // Not due again before the destination is tried again, nor before its own backoff.
            let outcomes = wave
                .iter()
                .map(|event| Outcome::Unavailable {
                    reason: reason.clone(),
                    // Spread over up to half the cooldown again, so its events do not all come
                    // due the instant it ends.
                    after: Some(
                        self.config
                            .retry
                            .backoff(event.attempts + 1, rand::random::<f64>())
                            .max(remaining.mul_f64(1.0 + rand::random::<f64>() / 2.0)),
                    ),
                })
                .collect();
            return (lane, members, wave, outcomes);
        }
        let budget = self.config.publish_timeout.min(remaining);
        let started = Instant::now();
        let mut timed_out = false;
        // A sink that panics fails this call, not the batch: caught here, every event of the
        // call counts a failed attempt (the panic may be caused by one of them, which then
        // ends dead after its attempts instead of being re-claimed forever), and the batch
        // settles and writes back as usual.
        let call = std::panic::AssertUnwindSafe(self.sink.publish(&wave)).catch_unwind();
        let outcomes = match tokio::time::timeout(budget, call).await {
            Ok(Ok(outcomes)) if outcomes.len() == wave.len() => outcomes,
            Ok(Err(panic)) => {
                let reason = format!(
                    "sink of `{}` panicked: {} (a bug in the sink; please report it)",
                    self.lanes.name(lane),
                    panic_message(panic.as_ref())
                );
                tracing::error!(destination = self.lanes.name(lane), events = wave.len(), %reason, "Sink panicked; its events are retried.");
                vec![Outcome::retry(reason); wave.len()]
            }
            Ok(Ok(outcomes)) => {
                let reason = format!(
                    "sink `{}` returned {} outcomes for {} events (a sink bug); retrying all",
                    self.lanes.name(lane),
                    outcomes.len(),
                    wave.len()
                );
                vec![Outcome::retry(reason); wave.len()]
            }
            Err(_) => {
                // Cut short by the lease's end, it says nothing about the destination.
                timed_out = budget >= self.config.publish_timeout;
                let reason = format!(
                    "publish to `{}` timed out after {} ms",
                    self.lanes.name(lane),
                    budget.as_millis()
                );
                vec![Outcome::unavailable(reason); wave.len()]
            }
        };
        // An event the destination called unavailable while it delivered others of the same call
        // (a handler that crashes on this payload behind a proxy: 502; one request that times
        // out): the destination is up, the failure is about the event, and it costs an attempt,
        // so a poison event cannot wait forever. Not when the destination said when to come back
        // (`Retry-After` on a 429 or 503): that is it asking to be spared, not a failed event.
        let outcomes = if outcomes.contains(&Outcome::Delivered) {
            outcomes
                .into_iter()
                .map(|o| match o {
                    Outcome::Unavailable {
                        reason,
                        after: None,
                    } => Outcome::Retry {
                        reason: format!(
                            "{reason} (the destination delivered other events of the same call)"
                        ),
                        after: None,
                    },
                    other => other,
                })
                .collect()
        } else {
            outcomes
        };
        // Every reason goes to logs and `last_error`: through the one redactor, whatever the
        // sink did, so a URL a sink or its client quoted never shows its credentials.
        let outcomes: Vec<Outcome> = outcomes.into_iter().map(redacted).collect();
        // With routes, the router records this per destination.
        if self.lanes.routes.is_none() {
            metrics::histogram!("outbox_publish_duration_seconds", "destination" => self.sink.name().to_owned())
                .record(started.elapsed().as_secs_f64());
        }
        if !self.lanes.is_unroutable(lane)
            && let Some(call) =
                self.lanes
                    .record(lane, &outcomes, timed_out, self.config.destination_cooldown)
            && self.config.max_outages_per_event > 0
        {
            self.lanes
                .suspect(lane, &wave, call, self.config.max_outages_per_event);
        }
        (lane, members, wave, outcomes)
    }

    /// Record the outcome of one event; returns whether the rest of its aggregate must wait.
    fn settle(&self, event: &Event, outcome: Outcome, settlement: &mut Settlement) -> bool {
        let lane = self.lanes.of(event);
        let sink = self.lanes.name(lane);
        let label = || sink.to_owned();
        match &outcome {
            Outcome::Delivered => {
                metrics::counter!("outbox_events_delivered_total", "destination" => label())
                    .increment(1);
                // The name of earlier releases (it counted acks, not publishes), kept for
                // dashboards until a later release; see CHANGELOG.md.
                metrics::counter!("outbox_events_published_total", "destination" => label())
                    .increment(1);
            }
            Outcome::Retry { .. } | Outcome::Reject { .. } | Outcome::Unavailable { .. } => {
                metrics::counter!("outbox_events_failed_total", "destination" => label())
                    .increment(1);
            }
        }
        // An answer about the event ends what its destination's outages said about it; an event
        // that caused too many of them is buried here.
        let poisoned = match &outcome {
            Outcome::Unavailable { .. } => self.lanes.take_poisoned(lane, event),
            _ => {
                self.lanes.forget_suspect(lane, event);
                None
            }
        };
        match outcome {
            Outcome::Unavailable { reason, .. } if let Some(caused) = poisoned => {
                let error = format!(
                    "suspected poison: present at {caused} outages of destination `{sink}`, each begun by a call with this event or met again after the destination had delivered others (relay.max_outages_per_event = {}); `outbox dead requeue` it once the cause is fixed: {reason}",
                    self.config.max_outages_per_event
                );
                metrics::counter!("outbox_events_poisoned_total", "destination" => label())
                    .increment(1);
                self.bury(event, sink, &error, settlement)
            }
            Outcome::Unavailable { reason, after } => {
                // The outage's length is looked up only where a limit applies.
                if let Some(limit) = self.config.unavailable_limit(sink)
                    && let Some(down_for) = self.lanes.down_for(lane, Instant::now())
                    && down_for >= limit
                {
                    let error = format!(
                        "destination `{sink}` unavailable for {} (longer than dead_after_unavailable = {}): {reason}",
                        humantime_duration::format_duration(Duration::from_secs(
                            down_for.as_secs()
                        )),
                        humantime_duration::format_duration(limit)
                    );
                    return self.bury(event, sink, &error, settlement);
                }
                // No attempt is spent: the backoff is that of the attempts made so far; the
                // destination's cooldown spaces the calls while it stays down.
                let delay = after.unwrap_or_else(|| {
                    self.config
                        .retry
                        .backoff(event.attempts.max(1), rand::random::<f64>())
                });
                self.wait(event, sink, false, delay, &reason, settlement)
            }
            Outcome::Delivered => {
                event_line!(
                    debug,
                    event,
                    attempts = event.attempts + 1,
                    destination = sink,
                    "Event published."
                );
                settlement.delivered.push(event.seq);
                false
            }
            Outcome::Retry { reason, after } => {
                let failed = event.attempts + 1;
                if self.config.retry.is_exhausted(failed) {
                    let error = format!("gave up after {failed} attempts: {reason}");
                    self.bury(event, sink, &error, settlement)
                } else {
                    let delay = after.unwrap_or_else(|| {
                        self.config.retry.backoff(failed, rand::random::<f64>())
                    });
                    self.wait(event, sink, true, delay, &reason, settlement)
                }
            }
            Outcome::Reject { reason } => {
                let error = format!("rejected by {sink}: {reason}");
                self.bury(event, sink, &error, settlement)
            }
        }
    }

    /// Put `event`, bound for `destination`, back for another publish after `delay`, logged and
    /// counted: a failed attempt (`counts_attempt`) as a retry, a warning; an unavailable
    /// destination (no attempt spent) as such, at debug. The rest of its aggregate waits.
    fn wait(
        &self,
        event: &Event,
        destination: &str,
        counts_attempt: bool,
        delay: Duration,
        reason: &str,
        settlement: &mut Settlement,
    ) -> bool {
        let attempts = event.attempts + u32::from(counts_attempt);
        let retry_in_ms = delay.as_millis() as u64;
        // One line, at the level and with the message of the case.
        macro_rules! wait_line {
            ($level:ident, $message:literal) => {
                event_line!(
                    $level,
                    event,
                    attempts,
                    destination,
                    retry_in_ms,
                    error = %reason,
                    $message
                )
            };
        }
        if counts_attempt {
            metrics::counter!("outbox_events_retried_total", "destination" => destination.to_owned())
                .increment(1);
            wait_line!(warn, "Publish failed; will retry.");
        } else {
            add(&self.counters.unavailable, 1);
            metrics::counter!("outbox_events_unavailable_total", "destination" => destination.to_owned())
                .increment(1);
            wait_line!(
                debug,
                "Destination unavailable; the event waits (no attempt counted)."
            );
        }
        settlement.retry(event.seq, counts_attempt, delay, reason);
        true
    }

    /// Record `event`, bound for `destination`, as dead with `error`; returns whether the rest of
    /// its aggregate must wait (the dead-letter policy).
    fn bury(
        &self,
        event: &Event,
        destination: &str,
        error: &str,
        settlement: &mut Settlement,
    ) -> bool {
        self.log_dead(event, destination, error);
        metrics::counter!("outbox_events_dead_total", "destination" => destination.to_owned())
            .increment(1);
        settlement.buries.push(BuryEvent {
            seq: event.seq,
            error: truncate_error(error),
        });
        self.config.dead_letter == DeadLetterPolicy::Block
    }

    fn log_dead(&self, event: &Event, destination: &str, error: &str) {
        event_line!(
            warn,
            event,
            attempts = event.attempts + 1,
            destination,
            error,
            "Event is dead; it stays in the outbox for `outbox dead requeue` or `purge`."
        );
    }

    /// Persist a batch's decisions. Each write is retried while the database is unreachable and
    /// the lease could still be ours; after that the lease has run out anyway and the events will
    /// be claimed again (delivered ones then go out a second time, which at-least-once allows).
    /// `which` says whether more of the batch may be written back later under this lease.
    async fn write_back(
        &self,
        lease: &Lease,
        settlement: Settlement,
        claimed_at: Instant,
        which: WriteBack,
    ) {
        let give_up_at = claimed_at + self.config.lease;
        let Settlement {
            delivered,
            retries,
            buries,
            released,
        } = settlement;
        // The writes given up, each with its last error: logged once, after this write-back's
        // last write was tried; with `last_write`, nothing more is written under this lease.
        let mut given_up: Vec<(&str, StoreError)> = Vec::new();

        if let Some(done) = self
            .write_part("ack", &mut given_up, &delivered, give_up_at, || {
                self.source.ack(lease, &delivered)
            })
            .await
        {
            add(&self.counters.delivered, done);
            self.settled(&delivered);
        }
        if let Some(done) = self
            .write_part("retry", &mut given_up, &retries, give_up_at, || {
                self.source.retry(lease, &retries)
            })
            .await
        {
            // Events that waited for an unavailable destination are counted as unavailable
            // when settled, not as retries (attempts).
            let waiting = retries.iter().filter(|r| !r.counts_attempt).count() as u64;
            if self.config.stop_when_idle {
                let now = Instant::now();
                let mut retrying = self.retrying.lock().unwrap_or_else(|p| p.into_inner());
                for r in &retries {
                    retrying.insert(r.seq, now + r.delay);
                }
            }
            add(&self.counters.retried, done.saturating_sub(waiting));
        }
        if let Some(done) = self
            .write_part("bury", &mut given_up, &buries, give_up_at, || {
                self.source.bury(lease, &buries)
            })
            .await
        {
            add(&self.counters.dead, done);
            let seqs: Vec<i64> = buries.iter().map(|b| b.seq).collect();
            self.settled(&seqs);
        }
        if let Some(done) = self
            .write_part("release", &mut given_up, &released, give_up_at, || {
                self.source.release(lease, &released)
            })
            .await
        {
            add(&self.counters.released, done);
        }
        if let Some((_, error)) = given_up.last() {
            let operations: Vec<&str> = given_up.iter().map(|(what, _)| *what).collect();
            warn!(
                lease = %lease.token,
                last_write = which == WriteBack::Last,
                operations = %operations.join(","),
                %error,
                "Could not record the batch before its lease ran out; its events will be claimed and published again."
            );
        }
    }

    /// One write of [`write_back`](Self::write_back), the same for acks, retries, burials and
    /// releases: nothing to do without `items`; else the write, retried by `with_retries`, and
    /// the rows it did not change counted as fenced (another relay owns them now). Returns the
    /// rows changed, `None` when there was nothing to write or the write was given up (then
    /// added to `given_up` with its last error).
    async fn write_part<'a, 'w, T, F, Fut>(
        &'a self,
        what: &'w str,
        given_up: &mut Vec<(&'w str, StoreError)>,
        items: &[T],
        give_up_at: Instant,
        op: F,
    ) -> Option<u64>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<u64, StoreError>> + 'a,
    {
        if items.is_empty() {
            return None;
        }
        let expected = items.len() as u64;
        match self.with_retries(what, give_up_at, op).await {
            Ok(done) => {
                self.note_fenced(what, expected, done);
                Some(done)
            }
            Err(error) => {
                given_up.push((what, error));
                None
            }
        }
    }

    /// A drain's retried events that are now settled (acked or dead) no longer keep it waiting.
    fn settled(&self, seqs: &[i64]) {
        if !self.config.stop_when_idle {
            return;
        }
        let mut retrying = self.retrying.lock().unwrap_or_else(|p| p.into_inner());
        if !retrying.is_empty() {
            for seq in seqs {
                retrying.remove(seq);
            }
        }
    }

    fn note_fenced(&self, what: &str, expected: u64, done: u64) {
        if done < expected {
            let fenced = expected - done;
            add(&self.counters.fenced, fenced);
            metrics::counter!("outbox_events_fenced_total").increment(fenced);
            warn!(
                operation = what,
                fenced,
                "Lease expired before the write: another relay owns these events now and will deliver them again."
            );
        }
    }

    /// Run `op` until it answers, backing off while the database is unreachable; its last error
    /// once the next try would come after `give_up_at` (the lease has run out by then).
    async fn with_retries<'a, F, Fut>(
        &'a self,
        what: &str,
        give_up_at: Instant,
        op: F,
    ) -> Result<u64, StoreError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<u64, StoreError>> + 'a,
    {
        let mut failures = 0u32;
        loop {
            match op().await {
                Ok(n) => return Ok(n),
                Err(error) => {
                    add(&self.counters.store_errors, 1);
                    metrics::counter!("outbox_database_errors_total").increment(1);
                    failures += 1;
                    let pause = store_backoff(failures, self.config.max_store_backoff);
                    if Instant::now() + pause >= give_up_at {
                        // Given up: the batch says so once, after its last write.
                        return Err(error);
                    }
                    warn!(operation = what, %error, retry_in_ms = pause.as_millis() as u64, "Store write failed; retrying.");
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_is_quick_while_events_trickle_in_and_slows_to_the_interval_when_idle() {
        let ms = Duration::from_millis;
        let mut pacer = Pacer::new(ms(10), ms(100));
        // Busy: every claim found something.
        assert_eq!(pacer.found_some(), ms(10));
        assert_eq!(pacer.found_some(), ms(10));
        // Idle: the pause doubles up to the poll interval, and stays there.
        let idle: Vec<Duration> = (0..6).map(|_| pacer.found_nothing()).collect();
        assert_eq!(idle, [ms(10), ms(20), ms(40), ms(80), ms(100), ms(100)]);
        // One event: quick again at once.
        assert_eq!(pacer.found_some(), ms(10));
        assert_eq!(pacer.found_nothing(), ms(10));
        // A minimum above the interval is the interval: a fixed pause.
        let mut fixed = Pacer::new(ms(500), ms(100));
        assert_eq!(fixed.found_some(), ms(100));
        assert_eq!(fixed.found_nothing(), ms(100));
        assert_eq!(fixed.found_nothing(), ms(100));
        // A zero minimum does not spin on an idle outbox.
        let mut zero = Pacer::new(Duration::ZERO, ms(100));
        assert_eq!(zero.found_nothing(), Duration::ZERO);
        assert!(zero.found_nothing() > Duration::ZERO);
    }

    #[test]
    fn store_backoff_grows_then_caps() {
        let max = Duration::from_secs(10);
        assert_eq!(store_backoff(1, max), Duration::from_millis(100));
        assert_eq!(store_backoff(2, max), Duration::from_millis(200));
        assert_eq!(store_backoff(30, max), max);
    }

    fn two_destinations() -> Lanes {
        use outbox_types::route::RouteRule;
        let routes = RouteTable::new(["a", "b"], vec![RouteRule::to("a")]).unwrap();
        Lanes::new(Some(Arc::new(routes)), "router")
    }

    #[test]
    fn the_destination_with_more_than_half_of_a_claim_is_deferred() {
        let lanes = Lanes::new(Some(Arc::new(outbox_testkit::hooks_and_kafka())), "router");
        let event = |event_type: &str| {
            outbox_types::NewEvent::from_json("order", "1", event_type, "{}")
                .unwrap()
                .claimed(1)
        };
        let claim = |hooks: usize, kafka: usize| -> Vec<Event> {
            std::iter::repeat_with(|| event("HookSent"))
                .take(hooks)
                .chain(std::iter::repeat_with(|| event("Created")).take(kafka))
                .collect()
        };
        assert_eq!(lanes.dominant(&claim(6, 4)), Some("hooks".to_owned()));
        assert_eq!(lanes.dominant(&claim(1, 9)), Some("kafka".to_owned()));
        assert_eq!(
            lanes.dominant(&claim(5, 5)),
            None,
            "half is not more than half"
        );
        // One destination only: nobody to make room for.
        let single = Lanes::new(None, "kafka");
        assert_eq!(single.dominant(&claim(0, 10)), None);
    }

    fn failed(n: usize) -> Vec<Outcome> {
        vec![Outcome::unavailable("connection refused"); n]
    }

    #[test]
    fn a_destination_fails_after_three_failed_calls_or_one_timeout() {
        let max = Duration::from_secs(10);
        let lanes = two_destinations();
        assert!(lanes.guarded(0, max) && lanes.guarded(1, max));
        assert!(
            !lanes.guarded(2, max),
            "unroutable events are rejected, never guarded"
        );
        assert!(
            !lanes.guarded(0, Duration::ZERO),
            "a zero cooldown turns it off"
        );
        lanes.record(0, &failed(5), false, max);
        lanes.record(0, &failed(1), false, max);
        assert!(
            lanes.refusal(0, Instant::now()).is_none(),
            "two failed calls are not enough"
        );
        lanes.record(0, &failed(2), false, max);
        let (refusal, remaining) = lanes.refusal(0, Instant::now()).unwrap();
        assert!(remaining <= Duration::from_millis(500), "{remaining:?}");
        assert!(
            refusal.contains("destination `a` is failing (connection refused)"),
            "{refusal}"
        );
        assert!(
            lanes.refusal(1, Instant::now()).is_none(),
            "only that destination"
        );
        assert!(
            lanes
                .refusal(0, Instant::now() + Duration::from_millis(501))
                .is_none(),
            "the first cooldown is 500 ms"
        );

        lanes.record(1, &failed(1), true, max);
        assert!(
            lanes.refusal(1, Instant::now()).is_some(),
            "one timeout is enough"
        );
    }

    #[test]
    fn cooldown_doubles_up_to_the_cap_and_an_answer_ends_it() {
        let max = Duration::from_secs(3);
        let lanes = two_destinations();
        let open_for = |lanes: &Lanes| {
            let h = lanes.health.lock().unwrap()[0].clone();
            h.open_until
                .unwrap()
                .saturating_duration_since(Instant::now())
        };
        // Let the cooldown run out: the next call is the one trial, the others are refused.
        let expire = |lanes: &Lanes| {
            lanes.health.lock().unwrap()[0].open_until = Some(Instant::now());
            assert!(lanes.refusal(0, Instant::now()).is_none(), "the trial call");
            let (_, wait) = lanes.refusal(0, Instant::now()).unwrap();
            assert_eq!(wait, WHILE_TRYING, "only one trial call at a time");
        };
        let mut seen = Vec::new();
        for _ in 0..5 {
            lanes.record(0, &failed(1), true, max);
            seen.push(open_for(&lanes).as_millis().div_ceil(100) * 100);
            // Calls that were out when it tripped come back failed too: no second trip.
            lanes.record(0, &failed(1), true, max);
            assert_eq!(
                open_for(&lanes).as_millis().div_ceil(100) * 100,
                seen[seen.len() - 1]
            );
            expire(&lanes);
        }
        assert_eq!(seen, [500, 1000, 2000, 3000, 3000]);
        // A rejection is an answer: the destination is up, the event is bad.
        lanes.record(0, &[Outcome::reject("too large")], false, max);
        assert!(lanes.refusal(0, Instant::now()).is_none());
        lanes.record(0, &failed(1), true, max);
        assert!(
            open_for(&lanes) <= Duration::from_millis(500),
            "the schedule starts again"
        );
        lanes.record(0, &[Outcome::Delivered, Outcome::retry("x")], false, max);
        assert!(lanes.refusal(0, Instant::now()).is_none());
    }

    #[test]
    fn config_rejects_unknown_keys_and_reads_durations() {
        let err = serde_json::from_str::<RelayConfig>(r#"{"batch_sise": 10}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `batch_sise`"),
            "{err}"
        );
        let cfg: RelayConfig =
            serde_json::from_str(r#"{"poll_interval": "250ms", "lease": "1m"}"#).unwrap();
        assert_eq!(cfg.poll_interval, Duration::from_millis(250));
        assert_eq!(cfg.lease, Duration::from_secs(60));
    }
}
