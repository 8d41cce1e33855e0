//! The engine's timing, tested on tokio's paused clock over an in-memory source: backoff,
//! cooldown and the lease's end, without sleeping and without a database. Every timer the
//! engine sets is virtual here; the tests read virtual time where the engine acted.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_engine::router::Router;
use outbox_engine::{Relay, RelayConfig};
use outbox_testkit::{MemoryRow, MemorySource, MemoryState, numbered};
use outbox_types::route::{Pattern, RouteRule, RouteTable};
use outbox_types::{Event, NewEvent, Outcome, RetryPolicy, Sink};
use tokio::time::Instant;

/// A sink that records (virtual) call times and answers with `answer`, after `takes`.
struct Timed {
    calls: Mutex<Vec<(Instant, Vec<Event>)>>,
    takes: Duration,
    answer: Box<Answer>,
}

/// How a [`Timed`] sink answers the `n`th attempt at an event.
type Answer = dyn Fn(&Event, usize) -> Outcome + Send + Sync;

impl Timed {
    fn new(
        takes: Duration,
        answer: impl Fn(&Event, usize) -> Outcome + Send + Sync + 'static,
    ) -> Self {
        Timed {
            calls: Mutex::new(Vec::new()),
            takes,
            answer: Box::new(answer),
        }
    }

    fn times(&self) -> Vec<Instant> {
        self.calls.lock().unwrap().iter().map(|(t, _)| *t).collect()
    }
}

#[async_trait]
impl Sink for Timed {
    fn name(&self) -> &str {
        "timed"
    }
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let call = {
            let mut calls = self.calls.lock().unwrap();
            calls.push((Instant::now(), events.to_vec()));
            calls.len()
        };
        tokio::time::sleep(self.takes).await;
        events.iter().map(|e| (self.answer)(e, call)).collect()
    }
}

fn config(id: &str) -> RelayConfig {
    RelayConfig {
        relay_id: id.into(),
        poll_interval: Duration::from_millis(100),
        lease: Duration::from_secs(30),
        publish_timeout: Duration::from_secs(10),
        retry: RetryPolicy {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(1),
            max_attempts: 1_000,
        },
        ..RelayConfig::default()
    }
}

/// Event `n` (type `E`, payload `n`) of `aggregate_type`, spread over `aggregates` aggregates:
/// `{prefix}0`, `{prefix}1`…
fn spread(aggregate_type: &str, prefix: &str, aggregates: u32, n: u32) -> NewEvent {
    NewEvent::new(
        aggregate_type,
        format!("{prefix}{}", n % aggregates),
        "E",
        &n,
    )
    .unwrap()
}

/// The event of type `Bad` (aggregate `order/poison`) that a test's sink always fails.
fn poison() -> NewEvent {
    NewEvent::new("order", "poison", "Bad", &0).unwrap()
}

/// The row of the [`poison`] event.
fn poison_row(rows: &[MemoryRow]) -> &MemoryRow {
    rows.iter().find(|r| r.event.event_type == "Bad").unwrap()
}

/// Every event of `rows` but the [`poison`] one was delivered.
fn assert_the_others_delivered(rows: &[MemoryRow]) {
    assert!(
        rows.iter()
            .filter(|r| r.event.event_type != "Bad")
            .all(|r| r.state == MemoryState::Delivered),
        "{rows:?}"
    );
}

/// Enqueue an event of a new aggregate (`late0`, `late1`, ...) every `every`, `count` times:
/// traffic the destination delivers while the poison event keeps failing.
fn feed_late(
    source: &Arc<MemorySource>,
    count: usize,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    let more = source.clone();
    tokio::spawn(async move {
        for n in 0..count {
            tokio::time::sleep(every).await;
            more.enqueue(&[numbered(&format!("late{n}"), 0)]);
        }
    })
}

/// A [`Timed`] answer: aggregate `a`'s events in the first call are told to retry after `after`
/// (a destination's `Retry-After`); every other event is delivered.
fn busy_once_for_a(after: Duration) -> impl Fn(&Event, usize) -> Outcome + Send + Sync + 'static {
    move |e, call| {
        if call == 1 && e.aggregate_id == "a" {
            Outcome::Retry {
                reason: "busy".into(),
                after: Some(after),
            }
        } else {
            Outcome::Delivered
        }
    }
}

/// Run `relay` for `for_` of virtual time, then stop it.
async fn run_for<K: Sink + ?Sized>(relay: Relay<MemorySource, K>, for_: Duration) {
    let run = tokio::spawn(relay.run(tokio::time::sleep(for_)));
    run.await.unwrap();
}

/// A failed event is due again after the delay the destination asked for (`Retry-After`), not
/// before, and not much after: the next claim that finds it due takes it.
#[tokio::test(start_paused = true)]
async fn a_retry_waits_for_its_delay_and_no_longer() {
    let source = Arc::new(MemorySource::new());
    source.enqueue(&[numbered("a", 0), numbered("a", 1)]);
    let sink = Arc::new(Timed::new(
        Duration::from_millis(5),
        busy_once_for_a(Duration::from_secs(30)),
    ));
    let started = Instant::now();
    run_for(
        Relay::new(source.clone(), sink.clone(), config("retry")),
        Duration::from_secs(60),
    )
    .await;
    let times = sink.times();
    assert_eq!(times.len(), 3, "a/0 twice, then a/1: {times:?}");
    let again = times[1] - times[0];
    assert!(
        again >= Duration::from_secs(30)
            && again <= Duration::from_secs(30) + Duration::from_millis(250),
        "retried {again:?} after the failure"
    );
    assert!(times[0] - started < Duration::from_millis(10));
    let rows = source.snapshot();
    assert!(
        rows.iter().all(|r| r.state == MemoryState::Delivered),
        "{rows:?}"
    );
    assert_eq!(rows[0].event.attempts, 1, "one failed attempt counted");
}

/// A destination that fails every call is left alone for a cooldown that doubles (500 ms, 1 s,
/// 2 s, …) while the other destination is served without a pause; a trial call after each
/// cooldown, and the first answer ends it.
#[tokio::test(start_paused = true)]
async fn a_failing_destination_cools_down_doubling_while_the_other_flows() {
    let source = Arc::new(MemorySource::new());
    let events: Vec<_> = (0..20)
        .flat_map(|n| [spread("down", "d", 4, n), spread("up", "u", 4, n)])
        .collect();
    source.enqueue(&events);
    let heal_at = Instant::now() + Duration::from_secs(6);
    let down = Arc::new(Timed::new(Duration::from_millis(5), move |_, _| {
        if Instant::now() < heal_at {
            Outcome::unavailable("connection refused")
        } else {
            Outcome::Delivered
        }
    }));
    let up = Arc::new(Timed::new(Duration::from_millis(5), |_, _| {
        Outcome::Delivered
    }));
    let routes = RouteTable::new(
        ["down", "up"],
        vec![
            RouteRule::to("down").aggregate_type(Pattern::parse("down")),
            RouteRule::to("up"),
        ],
    )
    .unwrap();
    let router = Router::new(
        routes.clone(),
        vec![
            ("down".into(), down.clone() as Arc<dyn Sink>),
            ("up".into(), up.clone() as Arc<dyn Sink>),
        ],
    )
    .unwrap();
    let relay = Relay::new(
        source.clone(),
        Arc::new(router),
        RelayConfig {
            destination_cooldown: Duration::from_secs(2),
            ..config("cooler")
        },
    )
    .with_routes(Arc::new(routes));
    let started = Instant::now();
    run_for(relay, Duration::from_secs(20)).await;

    // The healthy destination got everything within the first second.
    let up_times = up.times();
    assert!(
        up_times
            .iter()
            .all(|t| *t - started < Duration::from_secs(1)),
        "{:?}",
        up_times.iter().map(|t| *t - started).collect::<Vec<_>>()
    );
    // The failing one: three failed calls trip it; then one trial call per cooldown, the gaps
    // growing 0.5 s → 1 s → 2 s (the cap) until it answers. Each gap is the cooldown plus the
    // wait for the first of its events to come due: they are spread over up to half the cooldown
    // again (random jitter), so a gap lies between 1× and 1.5× its cooldown (plus a poll).
    let gaps: Vec<Duration> = down.times().windows(2).map(|w| w[1] - w[0]).collect();
    let long: Vec<Duration> = gaps
        .iter()
        .copied()
        .filter(|g| *g >= Duration::from_millis(400))
        .collect();
    assert!(long.len() >= 3, "cooldowns: {gaps:?}");
    assert!(
        long[0] >= Duration::from_millis(500) && long[0] < Duration::from_millis(850),
        "first cooldown: {long:?}"
    );
    assert!(
        long[1] >= Duration::from_secs(1) && long[1] < Duration::from_millis(1600),
        "doubled: {long:?}"
    );
    assert!(
        long[2] >= Duration::from_secs(2) && long[2] < Duration::from_millis(3100),
        "capped at 2 s: {long:?}"
    );
    // While cooling down it is not called at all: the calls that are not trials follow one
    // another quickly (a trip), never in the middle of a cooldown.
    // After a trip the next call is a single trial after the cooldown; a failed trial trips it
    // again at once, so until it heals every gap past the first trip is a cooldown.
    let before_heal: Vec<Duration> = down
        .times()
        .windows(2)
        .filter(|w| w[1] < heal_at)
        .map(|w| w[1] - w[0])
        .collect();
    let first_trip = before_heal
        .iter()
        .position(|g| *g >= Duration::from_millis(400))
        .expect("it tripped");
    assert!(
        before_heal[first_trip..]
            .iter()
            .all(|g| *g >= Duration::from_millis(500)),
        "one trial per cooldown: {gaps:?}"
    );
    let rows = source.snapshot();
    assert!(
        rows.iter().all(|r| r.state == MemoryState::Delivered),
        "everything delivered once it answered"
    );
}

/// A batch stops starting publishes a fifth of the lease (at most 5 s) before its lease ends, so
/// no event is published after another relay may have claimed it; what it did not publish is
/// released and claimed again.
#[tokio::test(start_paused = true)]
async fn publishing_stops_before_the_lease_ends() {
    let source = Arc::new(MemorySource::new());
    let events: Vec<_> = (0..10).map(|n| numbered("long", n)).collect();
    source.enqueue(&events);
    let sink = Arc::new(Timed::new(Duration::from_secs(1), |_, _| {
        Outcome::Delivered
    }));
    let lease = Duration::from_secs(5);
    let started = Instant::now();
    run_for(
        Relay::new(
            source.clone(),
            sink.clone(),
            RelayConfig {
                lease,
                publish_timeout: Duration::from_secs(2),
                ..config("leaser")
            },
        ),
        Duration::from_secs(60),
    )
    .await;
    // One aggregate: one event per call, one call a second. The first claim's deadline is at
    // 4 s (5 s lease − 1 s margin): calls at 0, 1, 2 and 3 s, then a new claim.
    let offsets: Vec<u64> = sink
        .times()
        .iter()
        .map(|t| (*t - started).as_millis() as u64 / 100)
        .collect();
    assert_eq!(&offsets[..4], &[0, 10, 20, 30], "{offsets:?}");
    assert!(
        offsets[4] >= 40,
        "nothing published past the deadline: {offsets:?}"
    );
    assert_eq!(offsets.len(), 10);
    let rows = source.snapshot();
    assert!(rows.iter().all(|r| r.state == MemoryState::Delivered));
    assert!(
        outbox_testkit::check_first_delivery_order(
            &sink
                .calls
                .lock()
                .unwrap()
                .iter()
                .flat_map(|(_, e)| e.clone())
                .collect::<Vec<_>>()
        )
        .is_empty()
    );
}

/// A destination that is down much longer than `max_attempts` × backoff costs at most one
/// attempt: when
/// it comes back every event goes out, in order per aggregate, none dead; an event it rejects
/// in the same run is still dead. It is probed, not hammered: after three failed calls, one
/// call per cooldown.
#[tokio::test(start_paused = true)]
async fn an_outage_costs_time_not_attempts() {
    let source = Arc::new(MemorySource::new());
    let mut events: Vec<_> = (0..12).map(|n| spread("order", "o", 3, n)).collect();
    events.push(poison());
    source.enqueue(&events);
    let back_at = Instant::now() + Duration::from_secs(120);
    let sink = Arc::new(Timed::new(Duration::from_millis(5), move |e, _| {
        if Instant::now() < back_at {
            Outcome::unavailable("connection refused")
        } else if e.event_type == "Bad" {
            Outcome::reject("schema violation")
        } else {
            Outcome::Delivered
        }
    }));
    let relay = Relay::new(
        source.clone(),
        sink.clone(),
        RelayConfig {
            retry: RetryPolicy {
                base: Duration::from_millis(100),
                cap: Duration::from_secs(1),
                max_attempts: 3,
            },
            ..config("outage")
        },
    );
    let report = relay.counters();
    run_for(relay, Duration::from_secs(180)).await;

    let rows = source.snapshot();
    let dead: Vec<_> = rows
        .iter()
        .filter(|r| r.state == MemoryState::Dead)
        .map(|r| r.event.aggregate_id.clone())
        .collect();
    assert_eq!(
        dead,
        ["poison"],
        "only the rejected event is dead: {rows:?}"
    );
    assert!(
        rows.iter()
            .filter(|r| r.event.event_type != "Bad")
            .all(|r| r.state == MemoryState::Delivered && r.event.attempts == 0),
        "delivered, no attempt spent on the outage: {rows:?}"
    );
    // In order per aggregate: each aggregate's payloads went out ascending.
    let calls = sink.calls.lock().unwrap();
    let delivered: Vec<&Event> = calls
        .iter()
        .filter(|(t, _)| *t >= back_at)
        .flat_map(|(_, events)| events)
        .collect();
    for agg in ["o0", "o1", "o2"] {
        let order: Vec<&str> = delivered
            .iter()
            .filter(|e| e.aggregate_id == agg)
            .map(|e| e.payload.as_str())
            .collect();
        let mut sorted = order.clone();
        sorted.sort_by_key(|p| p.parse::<u32>().unwrap());
        assert_eq!(order, sorted, "{agg}");
        assert_eq!(order.len(), 4, "{agg}: each event once after the outage");
    }
    // Probed, not hammered: 120 s of outage with a 10 s cooldown cap is a few dozen calls.
    let during = calls.iter().filter(|(t, _)| *t < back_at).count();
    assert!(during <= 40, "{during} calls while down");
    let report = report.report();
    assert!(report.unavailable > 0 && report.dead == 1, "{report:?}");
}

/// `dead_after_unavailable` bounds an outage for those who want it: once the destination has
/// been unavailable that long, events that meet it unavailable are dead, with the reason.
#[tokio::test(start_paused = true)]
async fn dead_after_unavailable_bounds_an_outage() {
    let source = Arc::new(MemorySource::new());
    source.enqueue(&[numbered("a", 0), numbered("b", 0)]);
    let sink = Arc::new(Timed::new(Duration::from_millis(5), |_, _| {
        Outcome::unavailable("connection refused")
    }));
    let relay = Relay::new(
        source.clone(),
        sink.clone(),
        RelayConfig {
            dead_after_unavailable_for: [("timed".to_owned(), Duration::from_secs(30))].into(),
            ..config("bounded")
        },
    );
    run_for(relay, Duration::from_secs(20)).await;
    assert!(
        source
            .snapshot()
            .iter()
            .all(|r| r.state != MemoryState::Dead),
        "not before 30 s of outage"
    );
    let relay = Relay::new(
        source.clone(),
        sink.clone(),
        RelayConfig {
            dead_after_unavailable: Duration::from_secs(30),
            ..config("bounded")
        },
    );
    run_for(relay, Duration::from_secs(60)).await;
    let rows = source.snapshot();
    assert!(
        rows.iter().all(|r| r.state == MemoryState::Dead
            && r.last_error
                .as_deref()
                .is_some_and(|e| e.contains("dead_after_unavailable = 30s"))),
        "{rows:?}"
    );
}

/// An event the destination calls unavailable while it delivers the others of the same call is
/// about the event (a handler crashing on it behind a proxy, one request timing out): it costs
/// attempts and ends dead, instead of waiting forever and holding its aggregate.
#[tokio::test(start_paused = true)]
async fn unavailable_for_one_event_while_others_are_delivered_costs_attempts() {
    let source = Arc::new(MemorySource::new());
    let mut events = vec![poison()];
    for n in 0..5 {
        events.push(numbered(&format!("ok{n}"), 0));
    }
    source.enqueue(&events);
    // Each call carries the poison event and, while they last, events that go through.
    let sink = Arc::new(Timed::new(Duration::from_millis(5), |e, _| {
        if e.event_type == "Bad" {
            Outcome::unavailable("HTTP 502 Bad Gateway")
        } else {
            Outcome::Delivered
        }
    }));
    let feeder = feed_late(&source, 20, Duration::from_millis(300));
    run_for(
        Relay::new(
            source.clone(),
            sink.clone(),
            RelayConfig {
                retry: RetryPolicy {
                    base: Duration::from_millis(50),
                    cap: Duration::from_millis(100),
                    max_attempts: 3,
                },
                ..config("poison")
            },
        ),
        Duration::from_secs(10),
    )
    .await;
    feeder.await.unwrap();
    let rows = source.snapshot();
    let poison = poison_row(&rows);
    assert_eq!(poison.state, MemoryState::Dead, "{poison:?}");
    assert_the_others_delivered(&rows);
}

/// `relay --drain` (`stop_when_idle`) waits for an event of its own that failed and comes due
/// again within `drain_wait`, delivers it and returns; with a shorter wait it returns as soon as
/// nothing is due and leaves the event pending.
#[tokio::test(start_paused = true)]
async fn a_drain_waits_for_a_retry_due_within_its_wait_and_not_longer() {
    for (wait, expect_delivered) in [(Duration::from_secs(10), 2), (Duration::from_secs(1), 1)] {
        let source = Arc::new(MemorySource::new());
        source.enqueue(&[numbered("a", 0), numbered("b", 0)]);
        let sink = Arc::new(Timed::new(
            Duration::ZERO,
            busy_once_for_a(Duration::from_secs(5)),
        ));
        let config = RelayConfig {
            stop_when_idle: true,
            drain_wait: wait,
            ..config("drain")
        };
        let started = Instant::now();
        let report = tokio::time::timeout(
            Duration::from_secs(120),
            Relay::new(source.clone(), sink.clone(), config).run(std::future::pending::<()>()),
        )
        .await
        .expect("a drain returns by itself");
        let took = started.elapsed();
        assert_eq!(report.delivered, expect_delivered, "drain_wait {wait:?}");
        let a = source
            .snapshot()
            .into_iter()
            .find(|r| r.event.aggregate_id == "a")
            .unwrap();
        if expect_delivered == 2 {
            assert_eq!(a.state, MemoryState::Delivered);
            assert!(
                took >= Duration::from_secs(5) && took < Duration::from_secs(7),
                "waited for the retry due after 5 s, then stopped: {took:?}"
            );
        } else {
            assert!(matches!(a.state, MemoryState::Pending { .. }), "{a:?}");
            assert!(
                took < Duration::from_secs(1),
                "a retry due after the wait is not waited for: {took:?}"
            );
        }
    }
}

/// A batch whose ack cannot be written before its lease runs out says so once, after its last
/// write was tried, naming its lease and that nothing more is written under it: what
/// `outbox-verify` reads to tell a relay that gave a batch up from one whose late write went
/// through.
#[tokio::test(start_paused = true)]
async fn a_batch_given_up_says_so_once_with_its_lease_after_its_last_write() {
    let source = Arc::new(MemorySource::new());
    source.fail_acks();
    source.enqueue(&[numbered("a", 1), numbered("b", 1)]);
    let sink = Arc::new(Timed::new(Duration::ZERO, |_, _| Outcome::Delivered));
    let relay = Relay::new(
        source.clone(),
        sink,
        RelayConfig {
            lease: Duration::from_secs(2),
            ..config("giver-up")
        },
    );
    let logs = outbox_testkit::LogBuffer::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let run = relay.run(tokio::time::sleep(Duration::from_secs(1)));
    run.await;

    let text = logs.text();
    let given_up: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.contains("Could not record the batch before its lease ran out"))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(given_up.len(), 1, "one line for the batch: {text}");
    let line = &given_up[0];
    assert_eq!(line["last_write"], serde_json::json!(true), "{line}");
    assert_eq!(line["operations"], serde_json::json!("ack"), "{line}");
    let lease = line["lease"].as_str().unwrap_or_default();
    assert!(uuid_like(lease), "the lease's token: {line}");
    assert!(
        text.find("Store write failed; retrying.")
            .is_some_and(|retrying| retrying < text.find("Could not record").unwrap()),
        "the ack was retried before it was given up: {text}"
    );
}

fn uuid_like(s: &str) -> bool {
    s.len() == 36 && s.chars().filter(|c| *c == '-').count() == 4
}

/// An event that brings its whole destination down at every try (a broker that closes the
/// connection on it: every event of the call comes back unavailable), while the destination
/// delivers the others in between, is dead as a suspected poison after
/// `max_outages_per_event` outages, with the reason; the others are delivered, none dead.
/// Without the cap it would wait forever, costing no attempt, and take the destination down
/// again at every retry.
#[tokio::test(start_paused = true)]
async fn an_event_that_causes_every_outage_is_dead_as_a_suspected_poison() {
    let source = Arc::new(MemorySource::new());
    let mut events = vec![poison()];
    for n in 0..5 {
        events.push(numbered(&format!("ok{n}"), 0));
    }
    source.enqueue(&events);
    // A call with the poison event fails as a whole, as a closed connection does.
    let sink = Arc::new(Timed::new(Duration::from_millis(5), |_, _| {
        Outcome::Delivered
    }));
    let poisoned_calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = poisoned_calls.clone();
    let sink_calls = sink.clone();
    let closing = Arc::new(CallWide {
        inner: sink_calls,
        fails_the_call: Box::new(move |events: &[Event]| {
            let poisoned = events.iter().any(|e| e.event_type == "Bad");
            if poisoned {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            poisoned
        }),
    });
    let feeder = feed_late(&source, 60, Duration::from_millis(250));
    let relay = Relay::new(
        source.clone(),
        closing,
        RelayConfig {
            retry: RetryPolicy {
                base: Duration::from_millis(200),
                cap: Duration::from_millis(400),
                max_attempts: 3,
            },
            ..config("poison-outages")
        },
    );
    run_for(relay, Duration::from_secs(20)).await;
    feeder.await.unwrap();
    let rows = source.snapshot();
    let poison = poison_row(&rows);
    assert_eq!(poison.state, MemoryState::Dead, "{poison:?}");
    let error = poison.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains("suspected poison: present at 5 outages")
            && error.contains("relay.max_outages_per_event = 5")
            && error.contains("connection closed"),
        "{error}"
    );
    assert_eq!(
        poison.event.attempts, 1,
        "outages cost no attempt: the one counted is the burial's"
    );
    // Five outages caused; a try that met the destination still down from its previous one
    // (nothing delivered in between) is the same outage and counts no more.
    let tries = poisoned_calls.load(std::sync::atomic::Ordering::SeqCst);
    assert!((5..=15).contains(&tries), "{tries} tries");
    assert_the_others_delivered(&rows);
}

/// With `max_outages_per_event = 0` the same event is never dead: it waits, costing no
/// attempt, as every outage does.
#[tokio::test(start_paused = true)]
async fn max_outages_per_event_zero_turns_the_poison_check_off() {
    let source = Arc::new(MemorySource::new());
    source.enqueue(&[poison(), numbered("ok", 0)]);
    let sink = Arc::new(Timed::new(Duration::from_millis(5), |_, _| {
        Outcome::Delivered
    }));
    let closing = Arc::new(CallWide {
        inner: sink,
        fails_the_call: Box::new(|events: &[Event]| events.iter().any(|e| e.event_type == "Bad")),
    });
    let feeder = feed_late(&source, 60, Duration::from_millis(250));
    let relay = Relay::new(
        source.clone(),
        closing,
        RelayConfig {
            max_outages_per_event: 0,
            retry: RetryPolicy {
                base: Duration::from_millis(200),
                cap: Duration::from_millis(400),
                max_attempts: 3,
            },
            ..config("poison-off")
        },
    );
    run_for(relay, Duration::from_secs(20)).await;
    feeder.await.unwrap();
    let rows = source.snapshot();
    let poison = poison_row(&rows);
    assert!(
        matches!(poison.state, MemoryState::Pending { .. }),
        "{poison:?}"
    );
}

/// A sink over [`Timed`] whose whole call fails as unavailable (`connection closed`) when
/// `fails_the_call` says so of its events: what a broker that closes the connection on one
/// message does to every message of the call.
struct CallWide {
    inner: Arc<Timed>,
    fails_the_call: Box<FailsTheCall>,
}

/// Whether a [`CallWide`] call with these events fails as a whole.
type FailsTheCall = dyn Fn(&[Event]) -> bool + Send + Sync;

#[async_trait]
impl Sink for CallWide {
    fn name(&self) -> &str {
        "call-wide"
    }
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let outcomes = self.inner.publish(events).await;
        if (self.fails_the_call)(events) {
            vec![Outcome::unavailable("connection closed (FRAME_ERROR)"); events.len()]
        } else {
            outcomes
        }
    }
}

/// Events trickling in (one a millisecond, each its own aggregate) while each batch takes a
/// millisecond: a batch's end does not make a claim of its own, claims are spaced by
/// `min_poll_interval` (10 ms), and every event still goes out within about that of its
/// arrival.
#[tokio::test(start_paused = true)]
async fn a_trickle_is_claimed_once_per_min_poll_interval_not_after_every_batch() {
    let source = Arc::new(MemorySource::new());
    let sink = Arc::new(Timed::new(Duration::from_millis(1), |_, _| {
        Outcome::Delivered
    }));
    let started = Instant::now();
    let writer = {
        let source = source.clone();
        tokio::spawn(async move {
            for n in 0..200u32 {
                source.enqueue(&[spread("t", "a", 1_000, n)]);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    run_for(
        Relay::new(source.clone(), sink.clone(), config("trickle")),
        Duration::from_millis(300),
    )
    .await;
    writer.await.unwrap();
    let calls = sink.calls.lock().unwrap().clone();
    let events: usize = calls.iter().map(|(_, e)| e.len()).sum();
    assert_eq!(events, 200, "every event once");
    assert!(
        calls.len() <= 25,
        "{} calls for 200 events over 200 ms: a claim after every batch",
        calls.len()
    );
    for (at, wave) in &calls {
        for event in wave {
            let n: u64 = event.payload.parse().unwrap();
            let arrived = started + Duration::from_millis(n);
            assert!(
                *at - arrived <= Duration::from_millis(12),
                "event {n} went out {:?} after it arrived",
                *at - arrived
            );
        }
    }
}
