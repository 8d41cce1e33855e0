//! Relay behaviour runs: real relays over the harness's source with injected sink faults.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_engine::{Relay, RelayConfig};
use outbox_testkit::{Faults, RecordingSink, check_first_delivery_order, numbered};
use outbox_types::{DeadFilter, DeadLetterPolicy, EventState, NewEvent, RetryPolicy, Store};

use crate::harness::*;

/// Two destinations: events whose aggregate type matches `pattern` go to `matched`, every other
/// event to `rest`. Returns the router to hand the relay as its sink and the route table for
/// `Relay::with_routes`, as the CLI builds them from `[[routes]]`.
pub fn split_by_aggregate_type(
    pattern: &str,
    matched: (&str, Arc<dyn outbox_types::Sink>),
    rest: (&str, Arc<dyn outbox_types::Sink>),
) -> (
    outbox_engine::router::Router,
    outbox_types::route::RouteTable,
) {
    use outbox_types::route::{Pattern, RouteRule, RouteTable};
    let routes = RouteTable::new(
        [rest.0, matched.0],
        vec![
            RouteRule::to(matched.0).aggregate_type(Pattern::parse(pattern)),
            RouteRule::to(rest.0),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let router = outbox_engine::router::Router::new(
        routes.clone(),
        vec![
            (rest.0.to_owned(), rest.1),
            (matched.0.to_owned(), matched.1),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    (router, routes)
}

fn relay_config(id: &str) -> RelayConfig {
    RelayConfig {
        relay_id: id.into(),
        batch_size: 200,
        poll_interval: Duration::from_millis(10),
        lease: Duration::from_secs(30),
        retry: RetryPolicy {
            base: Duration::from_millis(5),
            cap: Duration::from_millis(40),
            max_attempts: 25,
        },
        dead_letter: DeadLetterPolicy::Skip,
        ..RelayConfig::default()
    }
}

/// A relay running in a task: the sender that stops it, and the task that ends with its report.
pub type Running = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<outbox_engine::RelayReport>,
);

/// Run `relay` in a task until the returned sender fires (or is dropped).
pub fn spawn_until_stopped<S, K>(relay: Relay<S, K>) -> Running
where
    S: outbox_types::Source + ?Sized + 'static,
    K: outbox_types::Sink + ?Sized + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    (tx, run)
}

/// Poll `store`'s stats every `every` until `done` holds; past `patience`, fail the test with
/// `what` and the last stats. A relay works in the background, so a test can only wait for the
/// counts it expects, never for the relay itself.
pub async fn wait_for_stats<S: Store + ?Sized>(
    store: &S,
    every: Duration,
    patience: Duration,
    what: &str,
    done: impl Fn(&outbox_types::OutboxStats) -> bool,
) {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let stats = store.stats().await.unwrap();
        if done(&stats) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {stats:?}");
        tokio::time::sleep(every).await;
    }
}

/// [`wait_for_stats`], for a minute at most, until exactly `dead` events are dead and
/// `delivered` delivered.
async fn wait_for_dead_and_delivered<S: Store + ?Sized>(
    store: &S,
    every: Duration,
    dead: u64,
    delivered: u64,
) {
    let what = format!("{dead} dead and {delivered} delivered");
    wait_for_stats(store, every, Duration::from_secs(60), &what, |s| {
        s.dead == dead && s.delivered == delivered
    })
    .await;
}

/// A recording sink with `faults` injected.
fn faulty_sink(faults: Faults) -> Arc<RecordingSink> {
    Arc::new(RecordingSink::with_faults(faults))
}

/// A quick retry policy that gives up after three attempts.
fn three_quick_tries() -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_millis(1),
        cap: Duration::from_millis(5),
        max_attempts: 3,
    }
}

/// The payload numbers `sink` delivered for aggregate `aggregate_id`, in delivery order.
fn delivered_of(sink: &RecordingSink, aggregate_id: &str) -> Vec<u64> {
    sink.delivered()
        .iter()
        .filter(|e| e.aggregate_id == aggregate_id)
        .map(payload_n)
        .collect()
}

/// Stop the relay started by [`spawn_until_stopped`] (it must still run), wait for it to end,
/// and return the store's stats after it.
async fn stop_then_stats<S: Store + ?Sized>(
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<outbox_engine::RelayReport>,
    store: &S,
) -> outbox_types::OutboxStats {
    stop.send(())
        .unwrap_or_else(|_| panic!("the relay ended early"));
    run.await.unwrap();
    store.stats().await.unwrap()
}

/// The proof: 3 relays, 20k events over 500 aggregates, 10% random transient failures
/// and a few poison events. Every healthy event is delivered exactly once, first deliveries keep
/// per-aggregate order, no event is ever in flight twice at once, exactly the poison events end
/// up dead, and the relays' counters balance.
pub async fn three_relays_deliver_everything_in_order_despite_failures<H: Harness>(h: &H) {
    three_relays(h, DeadLetterPolicy::Skip).await;
}

/// The same run under the default `Block` policy: a poison event's aggregate stops behind it,
/// every other aggregate is delivered in full.
pub async fn three_relays_deliver_in_order_under_the_block_policy<H: Harness>(h: &H) {
    three_relays(h, DeadLetterPolicy::Block).await;
}

async fn three_relays<H: Harness>(h: &H, policy: DeadLetterPolicy) {
    const AGGREGATES: u64 = 500;
    const PER_AGGREGATE: u64 = 40;
    const POISON_N: u64 = 13;
    let total = AGGREGATES * PER_AGGREGATE;
    let store = h.fresh().await;
    let mut events = Vec::with_capacity(total as usize);
    for n in 0..PER_AGGREGATE {
        for a in 0..AGGREGATES {
            events.push(numbered(&format!("r{a}"), n));
        }
    }
    for chunk in events.chunks(2_000) {
        h.enqueue(&store, chunk).await;
    }
    let poisoned_aggregate = |aggregate_id: &str| aggregate_id.ends_with('7');
    let poison = move |e: &outbox_types::Event| {
        poisoned_aggregate(&e.aggregate_id) && payload_n(e) == POISON_N
    };
    // A publish takes a moment, so two publishes of one event at once would overlap and be
    // caught by the sink.
    let sink = faulty_sink(Faults {
        retry_rate: 0.10,
        reject: Some(Arc::new(poison)),
        delay: Duration::from_millis(1),
        seed: 7,
        ..Faults::default()
    });
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut relays = Vec::new();
    for i in 0..3 {
        let config = RelayConfig {
            dead_letter: policy,
            ..relay_config(&format!("relay-{i}"))
        };
        let relay = Relay::new(h.source(&store, &config).await, sink.clone(), config);
        let mut stop = stop_tx.subscribe();
        relays.push(tokio::spawn(relay.run(async move {
            let _ = stop.recv().await;
        })));
    }
    let poisoned = (0..AGGREGATES)
        .filter(|a| poisoned_aggregate(&format!("r{a}")))
        .count() as u64;
    let expected_dead = poisoned;
    // Under Block, everything after the poison event of its aggregate stays pending.
    let expected_held = match policy {
        DeadLetterPolicy::Block => poisoned * (PER_AGGREGATE - POISON_N - 1),
        DeadLetterPolicy::Skip => 0,
    };
    let expected_delivered = total - expected_dead - expected_held;
    wait_for_stats(
        &*store,
        Duration::from_millis(50),
        Duration::from_secs(300),
        "relays did not finish",
        |stats| {
            stats.delivered + stats.dead == expected_delivered + expected_dead
                && stats.in_flight == 0
        },
    )
    .await;
    stop_tx.send(()).unwrap();
    let mut reports = Vec::new();
    for r in relays {
        reports.push(r.await.unwrap());
    }
    let stats = store.stats().await.unwrap();
    assert_eq!(
        stats.dead, expected_dead,
        "exactly the poison events are dead: {stats:?}"
    );
    assert_eq!(stats.delivered, expected_delivered, "{stats:?}");
    assert_eq!(
        (stats.pending, stats.in_flight),
        (expected_held, 0),
        "{stats:?}"
    );

    let delivered = sink.delivered();
    let distinct = sink.distinct_delivered();
    assert_eq!(distinct.len() as u64, expected_delivered);
    assert_eq!(
        delivered.len(),
        distinct.len(),
        "no event delivered twice: no lease ran out, so no relay may publish another's event"
    );
    if policy == DeadLetterPolicy::Block {
        assert!(
            delivered
                .iter()
                .all(|e| !poisoned_aggregate(&e.aggregate_id) || payload_n(e) < POISON_N),
            "nothing after a poison event was delivered under Block"
        );
    }
    sink.assert_in_order_without_overlaps();

    // The relays' books balance: every claimed event was settled exactly one way, every
    // delivery and burial was recorded once, and nothing was fenced under a 30 s lease.
    let sum = |f: fn(&outbox_engine::RelayReport) -> u64| reports.iter().map(f).sum::<u64>();
    assert_eq!(sum(|r| r.fenced), 0, "{reports:?}");
    assert_eq!(sum(|r| r.delivered), expected_delivered, "{reports:?}");
    assert_eq!(sum(|r| r.dead), expected_dead, "{reports:?}");
    assert_eq!(
        sum(|r| r.claimed),
        sum(|r| r.delivered) + sum(|r| r.retried) + sum(|r| r.dead) + sum(|r| r.released),
        "{reports:?}"
    );
    assert_eq!(
        sink.attempts(),
        sum(|r| r.delivered) + sum(|r| r.retried) + sum(|r| r.dead),
        "each publish attempt was settled as delivered, retried or dead: {reports:?}"
    );
    let retried = sum(|r| r.retried);
    assert!(
        retried > 1_000,
        "the failure path was exercised: {retried} retries"
    );
    if h.relays_share_work() {
        assert!(
            reports.iter().all(|r| r.delivered > 0),
            "all three relays worked: {reports:?}"
        );
    } else {
        assert_eq!(
            reports.iter().filter(|r| r.delivered > 0).count(),
            1,
            "one relay streams, the others stand by: {reports:?}"
        );
    }
    let dead = store.list_dead(None, 1000).await.unwrap();
    assert!(dead.iter().all(|r| poison(&r.event)));
    assert!(
        dead.iter()
            .all(|r| r.last_error.as_deref().unwrap_or("").contains("rejected"))
    );
}

/// A relay gives up on an event that fails every time once it reached `max_attempts`: the event
/// is dead with the attempt count and a "gave up after" error, and under `Block` its aggregate's
/// later events wait behind it.
pub async fn relay_gives_up_after_max_attempts<H: Harness>(h: &H) {
    let (store, ids) = fresh_holding(h, &numbered_all(&[("m", 1), ("m", 2), ("n", 1)])).await;
    let sink = faulty_sink(Faults {
        fail: Some(Arc::new(|e: &outbox_types::Event| {
            e.aggregate_id == "m" && payload_n(e) == 1
        })),
        ..Faults::default()
    });
    let config = RelayConfig {
        retry: three_quick_tries(),
        dead_letter: DeadLetterPolicy::Block,
        ..relay_config("giver-upper")
    };
    let relay = Relay::new(h.source(&store, &config).await, sink.clone(), config);
    let (tx, run) = spawn_until_stopped(relay);
    wait_for_dead_and_delivered(&*store, Duration::from_millis(10), 1, 1).await;
    tx.send(()).unwrap();
    let report = run.await.unwrap();
    assert_eq!((report.retried, report.dead, report.delivered), (2, 1, 1));
    let m1 = store.get(ids[0].0).await.unwrap().unwrap();
    assert_eq!(m1.state, EventState::Dead);
    assert_eq!(m1.event.attempts, 3);
    let error = m1.last_error.unwrap_or_default();
    assert!(error.contains("gave up after 3 attempts"), "{error}");
    assert!(error.contains("failing by test predicate"), "{error}");
    let m2 = store.get(ids[1].0).await.unwrap().unwrap();
    assert_eq!(m2.state, EventState::Pending, "m/2 waits behind dead m/1");
    assert_eq!(m2.event.attempts, 0);
    assert_eq!(sink.attempts(), 4, "three tries of m/1, one of n/1");
}

/// Under the default `Block` policy a poison event stops its aggregate (and only it) in a real
/// relay run.
pub async fn dead_policy_block_holds_the_aggregate_in_a_relay_run<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let mut events = Vec::new();
    for n in 0..5u64 {
        for a in ["x", "y", "z"] {
            events.push(numbered(a, n));
        }
    }
    h.enqueue(&store, &events).await;
    let sink = faulty_sink(Faults {
        reject: Some(Arc::new(|e: &outbox_types::Event| {
            e.aggregate_id == "y" && payload_n(e) == 2
        })),
        ..Faults::default()
    });
    let config = RelayConfig {
        dead_letter: DeadLetterPolicy::Block,
        stop_when_idle: true,
        ..relay_config("blocker")
    };
    let report = Relay::new(h.source(&store, &config).await, sink.clone(), config)
        .run(std::future::pending())
        .await;
    assert_eq!(report.dead, 1);
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.dead, stats.pending),
        (12, 1, 2),
        "{stats:?}"
    );
    assert_eq!(delivered_of(&sink, "y"), vec![0, 1]);
}

/// Stopping a relay mid-run finishes the batches in flight and leaves no event claimed.
pub async fn shutdown_leaves_nothing_claimed<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let events: Vec<NewEvent> = (0..3000)
        .map(|i| numbered(&format!("g{}", i % 300), i / 300))
        .collect();
    h.enqueue(&store, &events).await;
    let sink = faulty_sink(Faults {
        delay: Duration::from_millis(5),
        ..Faults::default()
    });
    let config = RelayConfig {
        batch_size: 100,
        ..relay_config("stopper")
    };
    let relay = Relay::new(h.source(&store, &config).await, sink.clone(), config);
    let counters = relay.counters();
    let (tx, run) = spawn_until_stopped(relay);
    while counters.report().delivered < 200 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tx.send(()).unwrap();
    let report = run.await.unwrap();
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.in_flight, 0, "nothing left claimed: {stats:?}");
    assert!(stats.pending > 0, "stopped before the end: {stats:?}");
    assert_eq!(stats.delivered, report.delivered);
    assert_eq!(
        sink.distinct_delivered().len() as u64,
        report.delivered,
        "every published event was acked"
    );
}

/// A destination whose publish never returns (a broker behind a cut link). Counts its calls
/// and how many were out at once.
#[derive(Default)]
struct Hanging {
    calls: std::sync::atomic::AtomicU64,
    out: std::sync::atomic::AtomicU64,
    most_out: std::sync::atomic::AtomicU64,
}

/// Decrements `out` when a hanging call is dropped (its timeout fired).
struct OutGuard<'a>(&'a Hanging);

impl Drop for OutGuard<'_> {
    fn drop(&mut self) {
        self.0.out.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait]
impl outbox_types::Sink for Hanging {
    fn name(&self) -> &str {
        "stuck"
    }
    async fn publish(&self, _events: &[outbox_types::Event]) -> Vec<outbox_types::Outcome> {
        use std::sync::atomic::Ordering::SeqCst;
        self.calls.fetch_add(1, SeqCst);
        let out = self.out.fetch_add(1, SeqCst) + 1;
        self.most_out.fetch_max(out, SeqCst);
        let _guard = OutGuard(self);
        std::future::pending().await
    }
}

const GOOD: u64 = 40;
const STUCK: u64 = 8;
const PER_AGGREGATE: u64 = 10;

/// A relay over two destinations, `good` (a [`RecordingSink`]) and `stuck` (a [`Hanging`]
/// one), with 40 good and 8 stuck aggregates of 10 events each enqueued interleaved, run with
/// `config` until `done` says so; returns the sinks, the report, and how long it took.
async fn run_with_a_hanging_destination<H: Harness>(
    h: &H,
    config: RelayConfig,
    done: impl Fn(&RecordingSink, &outbox_engine::RelayReport) -> bool,
) -> (
    Arc<H::Store>,
    Arc<RecordingSink>,
    Arc<Hanging>,
    outbox_engine::RelayReport,
    Duration,
) {
    let store = h.fresh().await;
    let event = |aggregate_type: &str, a: u64, n: u64| {
        NewEvent::new(
            aggregate_type,
            format!("{aggregate_type}{a}"),
            "Numbered",
            &serde_json::json!({ "n": n }),
        )
        .unwrap()
    };
    let mut events = Vec::new();
    for n in 0..PER_AGGREGATE {
        for a in 0..GOOD {
            events.push(event("good", a, n));
            if a < STUCK {
                events.push(event("stuck", a, n));
            }
        }
    }
    h.enqueue(&store, &events).await;
    let good = Arc::new(RecordingSink::new());
    let stuck = Arc::new(Hanging::default());
    let (router, routes) =
        split_by_aggregate_type("stuck", ("stuck", stuck.clone()), ("good", good.clone()));
    let relay = Relay::new(h.source(&store, &config).await, Arc::new(router), config)
        .with_routes(Arc::new(routes));
    let counters = relay.counters();
    let started = std::time::Instant::now();
    let (tx, run) = spawn_until_stopped(relay);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !done(&good, &counters.report()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the healthy destination got {} of {} events: {:?}",
            good.distinct_delivered().len(),
            GOOD * PER_AGGREGATE,
            counters.report()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    tx.send(()).unwrap();
    let report = run.await.unwrap();
    (store, good, stuck, report, elapsed)
}

fn hanging_config(id: &str) -> RelayConfig {
    RelayConfig {
        publish_timeout: Duration::from_secs(1),
        retry: RetryPolicy {
            base: Duration::from_millis(5),
            cap: Duration::from_millis(20),
            max_attempts: 10_000,
        },
        ..relay_config(id)
    }
}

/// The healthy destination's events were each published once and in order, and the hanging
/// one's all wait in the outbox.
async fn check_isolation<S: Store + ?Sized>(
    store: &S,
    good: &RecordingSink,
    report: &outbox_engine::RelayReport,
) {
    assert_eq!(
        good.attempts(),
        GOOD * PER_AGGREGATE,
        "each healthy event was published exactly once: none shared a timeout with the hanging \
         destination ({report:?})"
    );
    let violations = check_first_delivery_order(&good.delivered());
    assert!(violations.is_empty(), "{violations:?}");
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.delivered, GOOD * PER_AGGREGATE, "{stats:?}");
    assert_eq!(
        (stats.pending, stats.in_flight, stats.dead),
        (STUCK * PER_AGGREGATE, 0, 0),
        "the hanging destination's events all wait in the outbox: {stats:?}"
    );
}

/// With two destinations, one of which hangs, the other's events are each published once, in
/// order, while the hanging one's wait in the outbox: a wave of the healthy destination never
/// shares a timeout with the hanging one, and once it timed out the hanging destination is left
/// alone for a cooldown instead of being waited on by every batch.
pub async fn a_hanging_destination_does_not_hold_back_the_others<H: Harness>(h: &H) {
    let config = RelayConfig {
        batch_size: 100,
        destination_cooldown: Duration::from_secs(30),
        ..hanging_config("isolated")
    };
    // Wait until the stuck destination's events were also claimed during its cooldown.
    let (store, good, stuck, report, elapsed) =
        run_with_a_hanging_destination(h, config, |g, r| {
            g.distinct_delivered().len() as u64 >= GOOD * PER_AGGREGATE
                && r.short_circuited >= STUCK
        })
        .await;
    check_isolation(store.as_ref(), &good, &report).await;
    // Calls start at 0 s, then after each 1 s timeout plus a cooldown of 0.5 s, 1 s, 2 s …: by
    // 6.5 s at most 4. Without the cooldown every batch would call it again.
    let calls = stuck.calls.load(std::sync::atomic::Ordering::SeqCst);
    let elapsed = elapsed.as_secs_f64();
    let allowed = if elapsed < 6.0 {
        4
    } else {
        2 + (elapsed / 2.0) as u64
    };
    assert!(
        (1..=allowed).contains(&calls),
        "after its first timeout the hanging destination was left alone for the cooldown: \
         {calls} calls in {elapsed:.1} s ({report:?})"
    );
    assert!(report.short_circuited >= STUCK, "{report:?}");
}

/// A batch whose remaining events all wait for a hanging destination writes back what it
/// settled and gives its slot back, so the relay claims the next batch meanwhile: with one slot
/// and the cooldown off, calls to the hanging destination from several batches are out at
/// once (never more than the four batches a slot may have alive), and the healthy destination
/// is served in full.
pub async fn a_batch_waiting_on_a_hanging_destination_gives_its_slot_back<H: Harness>(h: &H) {
    let config = RelayConfig {
        batch_size: 10,
        max_batches_in_flight: 1,
        destination_cooldown: Duration::ZERO,
        ..hanging_config("slot-giver")
    };
    let (store, good, stuck, report, _) = run_with_a_hanging_destination(h, config, |g, _| {
        g.distinct_delivered().len() as u64 >= GOOD * PER_AGGREGATE
    })
    .await;
    check_isolation(store.as_ref(), &good, &report).await;
    let most_out = stuck.most_out.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (2..=4).contains(&most_out),
        "calls to the hanging destination out at once: {most_out} ({report:?})"
    );
    assert_eq!(report.short_circuited, 0, "the cooldown is off: {report:?}");
}

/// A sink that panics fails its call, not the relay: the events of the call count an attempt
/// each and are retried, the poison one ends dead after `max_attempts`, the others are
/// delivered, and nothing stays in flight.
pub async fn a_panicking_sink_costs_attempts_not_a_stuck_claim<H: Harness>(h: &H) {
    let (store, ids) = fresh_holding(h, &numbered_all(&[("p", 1), ("q", 1), ("q", 2)])).await;
    let sink = faulty_sink(Faults {
        panic: Some(Arc::new(|e: &outbox_types::Event| e.aggregate_id == "p")),
        ..Faults::default()
    });
    let config = RelayConfig {
        retry: three_quick_tries(),
        // One event per call, so the panic is the poison event's alone.
        batch_size: 1,
        stop_when_idle: true,
        ..relay_config("panicker")
    };
    let report = tokio::time::timeout(
        Duration::from_secs(60),
        Relay::new(h.source(&store, &config).await, sink.clone(), config)
            .run(std::future::pending()),
    )
    .await
    .expect("the relay finishes although its sink panics");
    assert_eq!(report.dead, 1, "{report:?}");
    let poison = store.get(ids[0].0).await.unwrap().unwrap();
    assert_eq!(poison.state, EventState::Dead);
    assert_eq!(poison.event.attempts, 3);
    let error = poison.last_error.unwrap_or_default();
    assert!(
        error.contains("panicked: panicking by test predicate"),
        "{error}"
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.in_flight, stats.pending),
        (2, 0, 0),
        "{stats:?}"
    );
}

/// The `main` and `hooks` sinks of a running [`two_destination_relay`], and the relay.
type TwoDestinations = (
    Arc<RecordingSink>,
    Arc<RecordingSink>,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<outbox_engine::RelayReport>,
);

/// Two destinations by aggregate type (`hooks` for `h*`, `main` for the rest), a router over
/// two recording sinks, and a relay over `h`'s source, running until the returned sender fires.
async fn two_destination_relay<H: Harness>(
    h: &H,
    store: &Arc<H::Store>,
    config: RelayConfig,
) -> TwoDestinations {
    two_destination_relay_with(h, store, config, RecordingSink::new()).await
}

/// [`two_destination_relay`] with `hooks` as the sink of the `hooks` destination (events of
/// aggregate types starting with `h`).
async fn two_destination_relay_with<H: Harness>(
    h: &H,
    store: &Arc<H::Store>,
    config: RelayConfig,
    hooks: RecordingSink,
) -> TwoDestinations {
    let main = Arc::new(RecordingSink::new());
    let hooks = Arc::new(hooks);
    let (router, routes) =
        split_by_aggregate_type("h*", ("hooks", hooks.clone()), ("main", main.clone()));
    let relay = Relay::new(h.source(store, &config).await, Arc::new(router), config)
        .with_routes(Arc::new(routes));
    let (tx, run) = spawn_until_stopped(relay);
    (main, hooks, tx, run)
}

fn typed_event(aggregate_type: &str, aggregate_id: &str, n: u64) -> NewEvent {
    NewEvent::new(
        aggregate_type,
        aggregate_id,
        "Numbered",
        &serde_json::json!({ "aggregate": aggregate_id, "n": n }),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `outbox pause` while a relay runs: the paused destination's events wait (in the table) while
/// the other destination's events flow, an aggregate with events for both keeps going on the
/// other one, and after the resume the waiting events go out, in order.
pub async fn a_paused_destination_waits_in_a_running_relay_while_others_flow<H: Harness>(h: &H) {
    let store = h.fresh().await;
    assert!(store.pause("hooks", "test").await.unwrap());
    let (main, hooks, stop, run) = two_destination_relay(h, &store, relay_config("pauser")).await;
    let mut events = Vec::new();
    for n in 0..5 {
        events.push(typed_event("main", "m", n));
        events.push(typed_event("hook", "k", n));
    }
    h.enqueue(&store, &events).await;
    wait_until("main's events", || main.distinct_delivered().len() == 5).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(hooks.delivered().is_empty(), "hooks is paused");
    assert!(store.resume("hooks").await.unwrap());
    wait_until("hooks' events after the resume", || {
        hooks.distinct_delivered().len() == 5
    })
    .await;
    let ns: Vec<u64> = hooks.delivered().iter().map(payload_n).collect();
    assert_eq!(ns, [0, 1, 2, 3, 4], "in order, once each");
    // Newer events of the resumed destination go after the ones that waited.
    h.enqueue(&store, &[typed_event("hook", "k", 5)]).await;
    wait_until("the newer one", || hooks.distinct_delivered().len() == 6).await;
    assert!(check_first_delivery_order(&hooks.delivered()).is_empty());
    let stats = stop_then_stats(stop, run, &*store).await;
    assert_eq!(
        (stats.delivered, stats.pending, stats.in_flight),
        (11, 0, 0),
        "{stats:?}"
    );
}

/// A backlog of one destination (a slow one, or one back from an outage) does not make the
/// others' new events wait until it is drained: after a claim it filled, the next claim skips it
/// (the relay's fair turn), so `main`'s events, committed after 600 of `hooks`', go out while
/// most of that backlog still waits. And the backlog still drains in order.
pub async fn a_backlog_of_one_destination_does_not_starve_the_others<H: Harness>(h: &H) {
    if !h.defers() {
        eprintln!("this store claims a deferred destination as usual: no fair turns to test");
        return;
    }
    let store = h.fresh().await;
    let mut events = Vec::new();
    for n in 0..100 {
        for k in 0..6 {
            events.push(typed_event("hook", &format!("k{k}"), n));
        }
    }
    for n in 0..5 {
        for m in 0..4 {
            events.push(typed_event("main", &format!("m{m}"), n));
        }
    }
    h.enqueue(&store, &events).await;
    let slow = RecordingSink::with_faults(Faults {
        delay: Duration::from_millis(20),
        ..Faults::default()
    });
    let (main, hooks, stop, run) =
        two_destination_relay_with(h, &store, relay_config("fair"), slow).await;
    wait_until("main's events", || main.distinct_delivered().len() == 20).await;
    let hooks_by_then = hooks.distinct_delivered().len();
    assert!(
        hooks_by_then <= 400,
        "main waited for {hooks_by_then} of the 600 hooks events: claims must not hand the whole backlog out first"
    );
    wait_until("the hooks backlog", || {
        hooks.distinct_delivered().len() == 600
    })
    .await;
    assert!(check_first_delivery_order(&hooks.delivered()).is_empty());
    assert!(check_first_delivery_order(&main.delivered()).is_empty());
    stop.send(())
        .unwrap_or_else(|_| panic!("the relay ended early"));
    run.await.unwrap();
}

/// Under `block`, a rejected event holds its aggregate; `outbox dead requeue` while the relay
/// runs sends it again, and it and the events held behind it go out in order, without a
/// restart; other aggregates are never held.
pub async fn a_requeued_dead_event_goes_out_while_the_relay_runs<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let reject = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let rejecting = reject.clone();
    let sink = faulty_sink(Faults {
        reject: Some(Arc::new(move |e: &outbox_types::Event| {
            rejecting.load(std::sync::atomic::Ordering::SeqCst)
                && e.aggregate_id == "p"
                && payload_n(e) == 1
        })),
        ..Faults::default()
    });
    let config = RelayConfig {
        dead_letter: DeadLetterPolicy::Block,
        ..relay_config("requeuer")
    };
    let relay = Relay::new(h.source(&store, &config).await, sink.clone(), config);
    let (tx, run) = spawn_until_stopped(relay);
    let mut events = Vec::new();
    for n in 0..4 {
        events.push(numbered("p", n));
        events.push(numbered("q", n));
    }
    h.enqueue(&store, &events).await;
    wait_for_dead_and_delivered(&*store, Duration::from_millis(20), 1, 5).await;
    assert_eq!(
        delivered_of(&sink, "p"),
        [0],
        "p waits behind its dead event"
    );
    // The operator fixes the cause and requeues; the relay keeps running.
    reject.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(store.requeue_dead(&DeadFilter::All).await.unwrap(), 1);
    wait_until("p after the requeue", || {
        sink.distinct_delivered().len() == 8
    })
    .await;
    assert_eq!(
        delivered_of(&sink, "p"),
        [0, 1, 2, 3],
        "in order, without a restart"
    );
    let stats = stop_then_stats(tx, run, &*store).await;
    assert_eq!(
        (stats.delivered, stats.dead, stats.pending),
        (8, 0, 0),
        "{stats:?}"
    );
}
