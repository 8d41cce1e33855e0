//! The operator-facing part of the contract: paused destinations and claims that hold them,
//! per-destination backlog, lease holders, replay, and dead-letter retention. Also the property
//! tests: the SQL route `CASE` agrees with [`RouteTable::resolve`], and retention never deletes
//! an undelivered event.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use outbox_testkit::hooks_and_kafka;
use outbox_types::route::{Pattern, RouteRule, RouteTable};
use outbox_types::{
    BuryEvent, ClaimRequest, DeadLetterPolicy, DestinationStats, EventId, EventState, Hold,
    NewEvent, ReplayFilter, Store,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::harness::*;

const HOUR: Duration = Duration::from_secs(3600);

/// Event number `n` of aggregate `aggregate_id`, of type `event_type`.
fn typed(aggregate_id: &str, n: u64, event_type: &str) -> NewEvent {
    NewEvent::new(
        "agg",
        aggregate_id,
        event_type,
        &serde_json::json!({ "aggregate": aggregate_id, "n": n }),
    )
    .unwrap_or_else(|e| panic!("a test event always serializes: {e}"))
}

/// Events `1, 2, …` of aggregate `aggregate_id`, one per event type, in that order.
fn history(aggregate_id: &str, event_types: &[&str]) -> Vec<NewEvent> {
    (1..)
        .zip(event_types)
        .map(|(n, event_type)| typed(aggregate_id, n, event_type))
        .collect()
}

/// A fresh store holding, enqueued in one transaction, each aggregate's [`history`] of
/// `histories` (aggregate id, its event types in order), one aggregate after the other.
async fn fresh_with_histories<H: Harness>(h: &H, histories: &[(&str, &[&str])]) -> Arc<H::Store> {
    let events: Vec<NewEvent> = histories
        .iter()
        .flat_map(|(aggregate_id, event_types)| history(aggregate_id, event_types))
        .collect();
    fresh_holding(h, &events).await.0
}

/// One event (number 0) per event type, each of its own aggregate `{prefix}0`, `{prefix}1`, ….
fn singles(prefix: &str, event_types: &[&str]) -> Vec<NewEvent> {
    event_types
        .iter()
        .enumerate()
        .map(|(i, event_type)| typed(&format!("{prefix}{i}"), 0, event_type))
        .collect()
}

/// A claim of up to 1000 with `paused` destinations held back and `deferred` ones skipped.
fn held(routes: &RouteTable, paused: &[&str], deferred: &[&str]) -> ClaimRequest {
    let names = |list: &[&str]| list.iter().map(|d| (*d).to_owned()).collect();
    ClaimRequest {
        hold: Some(Arc::new(Hold {
            routes: routes.clone(),
            paused: names(paused),
            deferred: names(deferred),
        })),
        ..claim_up_to(1000)
    }
}

fn hold(routes: &RouteTable, paused: &[&str]) -> ClaimRequest {
    held(routes, paused, &[])
}

/// Run an async property under proptest's runner (with shrinking) from inside the multi-thread
/// runtime the conformance tests use.
fn run_property<S, F, Fut>(cases: u32, strategy: S, test: F)
where
    S: Strategy,
    S::Value: Clone,
    F: Fn(S::Value) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let handle = tokio::runtime::Handle::current();
    let mut runner = TestRunner::new(Config {
        cases,
        max_shrink_iters: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let result = tokio::task::block_in_place(|| {
        runner.run(&strategy, |value| {
            handle.block_on(test(value));
            Ok(())
        })
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

/// Pause is idempotent and listed; a claim holding the paused destination skips only its
/// events, and an aggregate with events for both destinations goes on with the unpaused one.
/// Resumed, the held events are claimed in seq order.
pub async fn pause_holds_only_that_destinations_events<H: Harness>(h: &H) {
    let store = fresh_with_histories(
        h,
        &[
            ("a", &["Created", "HookSent", "Created"]),
            ("b", &["HookSent", "HookSent"]),
            ("c", &["Created"]),
        ],
    )
    .await;
    let routes = hooks_and_kafka();
    assert!(store.pause("hooks", "ops@host-1").await.unwrap());
    assert!(
        !store.pause("hooks", "someone else").await.unwrap(),
        "pausing twice changes nothing"
    );
    let paused = store.paused().await.unwrap();
    assert_eq!(paused.len(), 1, "{paused:?}");
    assert_eq!(paused[0].destination, "hooks");
    assert_eq!(paused[0].paused_by, "ops@host-1", "the first pause is kept");
    let age = Utc::now() - paused[0].paused_at;
    assert!(age.num_seconds().abs() < 60, "paused_at {age:?} ago");

    let names: Vec<&str> = paused.iter().map(|p| p.destination.as_str()).collect();
    let held = store.claim(&hold(&routes, &names)).await.unwrap();
    assert_eq!(
        labels(&held.events),
        [("a", 1), ("a", 3), ("c", 1)],
        "hooks' events stay; a/3 goes on past the held a/2"
    );
    let seqs = seqs_of(&held.events);
    store.ack(&held.lease, &seqs).await.unwrap();
    assert!(
        store
            .claim(&hold(&routes, &names))
            .await
            .unwrap()
            .events
            .is_empty(),
        "only held events are left"
    );

    assert!(store.resume("hooks").await.unwrap());
    assert!(!store.resume("hooks").await.unwrap(), "not paused any more");
    assert!(store.paused().await.unwrap().is_empty());
    let resumed = store.claim(&claim_up_to(1000)).await.unwrap();
    assert_eq!(labels(&resumed.events), [("a", 2), ("b", 1), ("b", 2)]);
    assert!(resumed.events.windows(2).all(|w| w[0].seq < w[1].seq));
}

/// A held destination's event waiting for a retry does not hold back the other destination's
/// later events of its aggregate (it does once the destination is resumed).
pub async fn held_events_do_not_block_other_destinations<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let routes = hooks_and_kafka();
    h.enqueue(&store, &history("d", &["HookSent", "Created"]))
        .await;
    let first = store.claim(&claim_up_to(1)).await.unwrap();
    assert_eq!(labels(&first.events), [("d", 1)]);
    store
        .retry(
            &first.lease,
            &[counted_retry(
                first.events[0].seq,
                HOUR,
                "hook endpoint down",
            )],
        )
        .await
        .unwrap();
    assert!(
        claims_nothing(&*store).await,
        "unpaused: d/2 waits behind the retrying d/1"
    );
    let held = store.claim(&hold(&routes, &["hooks"])).await.unwrap();
    assert_eq!(labels(&held.events), [("d", 2)]);
}

fn defer(routes: &RouteTable, deferred: &[&str]) -> ClaimRequest {
    held(routes, &[], deferred)
}

/// A deferred destination (the relay's fair turn) is skipped by one claim, but unlike a paused
/// one its rows keep their place in their aggregates: another destination's event never passes
/// an earlier event of the same aggregate, whether that one is merely due, in flight or waiting
/// for a retry. Stores that claim a deferred destination as usual ([`Harness::defers`] false)
/// must still return every due event in order.
pub async fn a_deferred_destination_keeps_its_place_in_each_aggregate<H: Harness>(h: &H) {
    let store = fresh_with_histories(
        h,
        &[
            ("a", &["Created", "HookSent", "Created"]),
            ("b", &["HookSent", "Created"]),
            ("c", &["Created"]),
            ("d", &["HookSent"]),
        ],
    )
    .await;
    let routes = hooks_and_kafka();
    let turn = store.claim(&defer(&routes, &["hooks"])).await.unwrap();
    if !h.defers() {
        assert_eq!(
            labels(&turn.events),
            [
                ("a", 1),
                ("a", 2),
                ("a", 3),
                ("b", 1),
                ("b", 2),
                ("c", 1),
                ("d", 1)
            ],
        );
        return;
    }
    assert_eq!(
        labels(&turn.events),
        [("a", 1), ("c", 1)],
        "hooks' events wait for the next claim, and a/3 and b/2 wait behind them"
    );
    let seqs = seqs_of(&turn.events);
    store.ack(&turn.lease, &seqs).await.unwrap();
    // b/1 in flight, then waiting for a retry: b/2 still waits behind it while hooks is
    // deferred.
    let hooks = store.claim(&claim_up_to(1000)).await.unwrap();
    assert_eq!(
        labels(&hooks.events),
        [("a", 2), ("a", 3), ("b", 1), ("b", 2), ("d", 1)],
    );
    let b1 = hooks.events[2].seq;
    let rest = seqs_except(&hooks.events, b1);
    store.release(&hooks.lease, &rest).await.unwrap();
    assert!(
        store
            .claim(&defer(&routes, &["hooks"]))
            .await
            .unwrap()
            .events
            .iter()
            .all(|e| e.aggregate_id != "b"),
        "b/2 waits behind b/1 in flight"
    );
    store
        .retry(
            &hooks.lease,
            &[unavailable_retry(b1, HOUR, "hook endpoint down")],
        )
        .await
        .unwrap();
    let turn = store.claim(&defer(&routes, &["hooks"])).await.unwrap();
    assert!(
        turn.events.iter().all(|e| e.aggregate_id != "b"),
        "b/2 waits behind b/1 waiting for its retry: {:?}",
        labels(&turn.events)
    );
}

const EVENT_TYPES: &[&str] = &[
    "OrderCreated",
    "Order",
    "order",
    "Ordér",
    "Order ",
    "AuditLogged",
    "audit",
    "Ping",
];
const AGGREGATE_TYPES: &[&str] = &["order", "Order", "partner", "partner ", "user", "usér"];
const DESTINATIONS: &[Option<&str>] = &[
    None,
    Some("kafka"),
    Some("Kafka"),
    Some("kafka "),
    Some("hooks"),
    Some("https://a.example/x"),
    Some("HTTPS://b"),
    Some("orders.v2"),
    Some(""),
];

/// Rules over every field, exact and prefix, with case, accent and trailing-space traps, and
/// no catch-all (some events are unroutable).
fn property_routes() -> RouteTable {
    RouteTable::new(
        ["kafka", "hooks", "audit"],
        vec![
            RouteRule::to("audit").event_type(Pattern::parse("Audit*")),
            RouteRule::to("hooks")
                .aggregate_type(Pattern::parse("partner"))
                .destination(Pattern::parse("https://*")),
            RouteRule::to("kafka")
                .event_type(Pattern::parse("Order*"))
                .aggregate_type(Pattern::parse("order")),
            RouteRule::to("hooks").destination(Pattern::parse("orders.v2")),
            RouteRule::to("audit").aggregate_type(Pattern::parse("us*")),
            RouteRule::to("kafka")
                .event_type(Pattern::parse("Ping"))
                .destination(Pattern::parse("*")),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn stats_key(s: &DestinationStats) -> (u64, u64, u64, u64) {
    (s.pending, s.retrying, s.in_flight, s.dead)
}

/// Random events × a fixed route table: the destination the database computes (in
/// `destination_stats` and in a claim's hold) is the one [`RouteTable::resolve`] computes, for
/// every state the stats count.
pub async fn routes_in_sql_agree_with_resolve<H: Harness>(h: &H) {
    let routes = property_routes();
    let strategy = prop::collection::vec(
        (
            0..EVENT_TYPES.len(),
            0..AGGREGATE_TYPES.len(),
            0..DESTINATIONS.len(),
        ),
        1..40,
    );
    run_property(6, strategy, |picks| {
        let routes = routes.clone();
        async move {
            let store = h.fresh().await;
            let events: Vec<NewEvent> = picks
                .iter()
                .enumerate()
                .map(|(i, &(et, at, d))| {
                    let e = NewEvent::new(
                        AGGREGATE_TYPES[at],
                        format!("p{i}"),
                        EVENT_TYPES[et],
                        &serde_json::json!({ "n": i }),
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                    match DESTINATIONS[d] {
                        Some(dest) => e.with_destination(dest),
                        None => e,
                    }
                })
                .collect();
            h.enqueue(&store, &events).await;
            let resolved: HashMap<EventId, Option<String>> = events
                .iter()
                .map(|e| {
                    let to = routes.resolve(e.event_type(), e.aggregate_type(), e.destination());
                    (e.id(), to.map(str::to_owned))
                })
                .collect();

            let mut want: BTreeMap<Option<String>, (u64, u64, u64, u64)> = BTreeMap::new();
            for to in resolved.values() {
                want.entry(to.clone()).or_default().0 += 1;
            }
            let got: BTreeMap<Option<String>, (u64, u64, u64, u64)> = store
                .destination_stats(&routes)
                .await
                .unwrap()
                .iter()
                .map(|s| (s.destination.clone(), stats_key(s)))
                .collect();
            assert_eq!(got, want, "pending per destination, events {picks:?}");

            for paused in [
                &["kafka"][..],
                &["hooks"][..],
                &["audit"][..],
                &["kafka", "audit"][..],
            ] {
                let claim = store.claim(&hold(&routes, paused)).await.unwrap();
                let claimed: HashSet<EventId> = claim.events.iter().map(|e| e.id).collect();
                let expected: HashSet<EventId> = resolved
                    .iter()
                    .filter(|(_, to)| !to.as_deref().is_some_and(|to| paused.contains(&to)))
                    .map(|(id, _)| *id)
                    .collect();
                assert_eq!(claimed, expected, "paused {paused:?}, events {picks:?}");
                let seqs = seqs_of(&claim.events);
                store.release(&claim.lease, &seqs).await.unwrap();
            }

            // Every state the stats count: i % 4 = 0 dead, 1 delivered (not counted), 2 waiting
            // for a retry, 3 in flight.
            let claim = store.claim(&claim_up_to(1000)).await.unwrap();
            assert_eq!(claim.events.len(), events.len());
            let mut want: BTreeMap<Option<String>, (u64, u64, u64, u64)> = BTreeMap::new();
            let (mut ack, mut retry, mut bury) = (Vec::new(), Vec::new(), Vec::new());
            for e in &claim.events {
                let to = resolved.get(&e.id).cloned().flatten();
                match payload_n(e) % 4 {
                    0 => {
                        want.entry(to).or_default().3 += 1;
                        bury.push(buried(e.seq, "x"));
                    }
                    1 => ack.push(e.seq),
                    2 => {
                        let w = want.entry(to).or_default();
                        w.0 += 1;
                        w.1 += 1;
                        retry.push(counted_retry(e.seq, HOUR, "x"));
                    }
                    _ => want.entry(to).or_default().2 += 1,
                }
            }
            store.ack(&claim.lease, &ack).await.unwrap();
            store.retry(&claim.lease, &retry).await.unwrap();
            store.bury(&claim.lease, &bury).await.unwrap();
            let stats = store.destination_stats(&routes).await.unwrap();
            let got: BTreeMap<Option<String>, (u64, u64, u64, u64)> = stats
                .iter()
                .map(|s| (s.destination.clone(), stats_key(s)))
                .collect();
            assert_eq!(got, want, "every state, events {picks:?}");
            for s in &stats {
                assert_eq!(
                    s.oldest_pending_enqueued_at.is_some(),
                    s.pending + s.in_flight > 0,
                    "{s:?}"
                );
            }
        }
    });
}

/// Backlog per destination counts each state, leaves delivered events out, reports unroutable
/// events under `None`, and dates the oldest undelivered event.
pub async fn destination_stats_count_each_state<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let routes = RouteTable::new(
        ["kafka", "hooks"],
        vec![
            RouteRule::to("hooks").event_type(Pattern::parse("Hook*")),
            RouteRule::to("kafka").event_type(Pattern::parse("Created")),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(store.destination_stats(&routes).await.unwrap().is_empty());
    let events = [
        singles("k", &["Created"; 5]),
        singles("h", &["HookSent"]),
        singles("u", &["Unknown"]),
    ];
    let ids = h.enqueue(&store, &events.concat()).await;
    // k0 pending, k1 retrying, k2 in flight, k3 dead, k4 delivered.
    let claim = store.claim(&claim_up_to(4)).await.unwrap();
    let seq = |i: usize| claim.events[i].seq;
    store.release(&claim.lease, &[seq(0)]).await.unwrap();
    store
        .retry(
            &claim.lease,
            &[counted_retry(seq(1), HOUR, "connection refused")],
        )
        .await
        .unwrap();
    store
        .bury(&claim.lease, &[buried(seq(3), "x")])
        .await
        .unwrap();
    let k4 = store.claim(&claim_up_to(1)).await.unwrap();
    assert_eq!(k4.events.len(), 1);
    store.ack(&k4.lease, &[k4.events[0].seq]).await.unwrap();
    h.backdate(&store, &[ids[1].0], HOUR).await;

    let stats = store.destination_stats(&routes).await.unwrap();
    let by: HashMap<Option<&str>, &DestinationStats> = stats
        .iter()
        .map(|s| (s.destination.as_deref(), s))
        .collect();
    assert_eq!(by.len(), 3, "{stats:?}");
    let kafka = by[&Some("kafka")];
    assert_eq!(stats_key(kafka), (2, 1, 1, 1), "{kafka:?}");
    assert_eq!(
        kafka.last_error.as_deref(),
        Some("connection refused"),
        "the waiting event's error, not the dead one's: {kafka:?}"
    );
    let oldest = kafka.oldest_pending_enqueued_at.unwrap();
    let age = Utc::now() - oldest;
    assert!(
        age.num_minutes() >= 59 && age.num_minutes() < 70,
        "the backdated retrying event is the oldest: {age:?}"
    );
    assert_eq!(stats_key(by[&Some("hooks")]), (1, 0, 0, 0));
    assert_eq!(stats_key(by[&None]), (1, 0, 0, 0), "unroutable");
}

/// Lease holders: per relay, its in-flight events, since when, until when, and how many of its
/// leases already ran out.
pub async fn leases_report_who_holds_what_since_when<H: Harness>(h: &H) {
    let store = h.fresh().await;
    assert!(store.leases().await.unwrap().is_empty());
    h.enqueue(&store, &singles("l", &["Created"; 6])).await;
    let before = Utc::now() - chrono::TimeDelta::seconds(30);
    let short = store
        .claim(&ClaimRequest {
            lease: Duration::from_millis(200),
            ..claim_as("relay-b", 1)
        })
        .await
        .unwrap();
    assert_eq!(short.events.len(), 1);
    let long = store.claim(&claim_as("relay-a", 3)).await.unwrap();
    store.ack(&long.lease, &[long.events[2].seq]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let leases = store.leases().await.unwrap();
    assert_eq!(leases.len(), 2, "{leases:?}");
    let a = leases.iter().find(|l| l.owner == "relay-a").unwrap();
    let b = leases.iter().find(|l| l.owner == "relay-b").unwrap();
    assert_eq!((a.events, a.expired), (2, 0), "{a:?}");
    assert_eq!((b.events, b.expired), (1, 1), "{b:?}");
    let after = Utc::now() + chrono::TimeDelta::seconds(30);
    for l in [a, b] {
        let since = l.claimed_since.unwrap();
        assert!(since > before && since < after, "{l:?}");
    }
    assert!(a.expires_at.unwrap() > Utc::now() + chrono::TimeDelta::seconds(20));
    assert!(b.expires_at.unwrap() < b.claimed_since.unwrap() + chrono::TimeDelta::seconds(5));
    assert!(
        b.claimed_since <= a.claimed_since,
        "relay-b claimed first: {leases:?}"
    );
}

/// Replay puts delivered events in a time range back to pending (attempts reset, ids and seqs
/// kept), filtered by destination and event type, page by page, and never touches events in
/// other states.
pub async fn replay_sends_delivered_events_again<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let routes = hooks_and_kafka();
    // r0 kafka, r1 hooks, r2 kafka (delivered after a retry), r3 kafka "Other", r4 recent,
    // r5 dead, r6 pending, r7 in flight.
    let mut types = ["Created"; 8];
    types[1] = "HookSent";
    types[3] = "Other";
    let events = singles("r", &types);
    let ids = ids_of(h.enqueue(&store, &events).await);
    let claim = store.claim(&claim_up_to(100)).await.unwrap();
    assert_eq!(claim.events.len(), 8);
    let seqs = seqs_of(&claim.events);
    store
        .ack(&claim.lease, &[seqs[0], seqs[1], seqs[3], seqs[4]])
        .await
        .unwrap();
    store
        .retry(
            &claim.lease,
            &[counted_retry(seqs[2], Duration::ZERO, "blip")],
        )
        .await
        .unwrap();
    store
        .bury(&claim.lease, &[buried(seqs[5], "x")])
        .await
        .unwrap();
    store.release(&claim.lease, &[seqs[6]]).await.unwrap();
    let again = store.claim(&claim_up_to(1)).await.unwrap();
    assert_eq!(again.events[0].id, ids[2]);
    store.ack(&again.lease, &[seqs[2]]).await.unwrap();
    let old: Vec<EventId> = [0, 1, 2, 3, 5, 6, 7].iter().map(|&i| ids[i]).collect();
    h.backdate(&store, &old, 2 * HOUR).await;
    let before: Vec<_> = futures_all(&*store, &ids).await;

    let now = Utc::now();
    let window = |destination: Option<&str>, event_type: Option<&str>| ReplayFilter {
        from: now - chrono::TimeDelta::hours(3),
        to: now - chrono::TimeDelta::hours(1),
        destination: destination.map(str::to_owned),
        event_type: event_type.map(str::to_owned),
    };
    let step = store
        .replay(&window(Some("kafka"), None), &routes, None, 100)
        .await
        .unwrap();
    assert_eq!(step.replayed, 3, "r0, r2, r3: {step:?}");
    assert_eq!(step.next_after, None);
    let after = futures_all(&*store, &ids).await;
    for i in [0, 2, 3] {
        let r = &after[i];
        assert_eq!(r.state, EventState::Pending, "r{i}");
        assert_eq!(r.event.id, ids[i]);
        assert_eq!(r.event.seq, seqs[i], "r{i} keeps its place");
        assert_eq!(r.event.attempts, 0, "r{i}");
        assert!(r.last_error.is_none() && r.delivered_at.is_none(), "{r:?}");
        assert!(
            r.lease_owner.is_none() && r.lease_expires_at.is_none(),
            "{r:?}"
        );
        // Due no later than when it was last claimed (see `Store::requeue_dead`).
        assert!(
            r.next_attempt_at <= before[i].next_attempt_at,
            "r{i}: {r:?} was due at {}",
            before[i].next_attempt_at
        );
    }
    for i in [1, 4, 5, 6, 7] {
        assert_eq!(after[i].state, before[i].state, "r{i} untouched");
        assert_eq!(after[i].event.attempts, before[i].event.attempts, "r{i}");
        assert_eq!(after[i].lease_owner, before[i].lease_owner, "r{i}");
        assert_eq!(after[i].next_attempt_at, before[i].next_attempt_at, "r{i}");
    }
    let replayed = store.claim(&claim_up_to(100)).await.unwrap();
    let got: Vec<EventId> = replayed.events.iter().map(|e| e.id).collect();
    assert_eq!(
        got,
        vec![ids[0], ids[2], ids[3], ids[6]],
        "claimable in order"
    );
    store
        .ack(&replayed.lease, &[seqs[0], seqs[2], seqs[3]])
        .await
        .unwrap();
    store.release(&replayed.lease, &[seqs[6]]).await.unwrap();

    let step = store
        .replay(&window(None, Some("HookSent")), &routes, None, 100)
        .await
        .unwrap();
    assert_eq!(step.replayed, 1);
    assert_eq!(state_of(&*store, ids[1]).await, EventState::Pending);
    let c = store.claim(&claim_up_to(100)).await.unwrap();
    store.ack(&c.lease, &[seqs[1]]).await.unwrap();
    store.release(&c.lease, &[seqs[6]]).await.unwrap();

    // Paging: four old delivered events, two per step.
    let mut after_seq = None;
    let mut steps = Vec::new();
    loop {
        let step = store
            .replay(&window(None, None), &routes, after_seq, 2)
            .await
            .unwrap();
        steps.push(step.clone());
        match step.next_after {
            Some(next) => after_seq = Some(next),
            None => break,
        }
        assert!(steps.len() < 10, "{steps:?}");
    }
    let total: u64 = steps.iter().map(|s| s.replayed).sum();
    assert_eq!(total, 4, "{steps:?}");
    assert_eq!(steps[0].next_after, Some(seqs[1]), "{steps:?}");
    assert_eq!(
        state_of(&*store, ids[4]).await,
        EventState::Delivered,
        "out of range"
    );
    let empty = ReplayFilter {
        from: now - chrono::TimeDelta::hours(10),
        to: now - chrono::TimeDelta::hours(9),
        destination: None,
        event_type: None,
    };
    let step = store.replay(&empty, &routes, None, 10).await.unwrap();
    assert_eq!((step.replayed, step.next_after), (0, None));
}

async fn futures_all<S: Store + ?Sized>(
    store: &S,
    ids: &[EventId],
) -> Vec<outbox_types::EventRecord> {
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        out.push(store.get(*id).await.unwrap().unwrap());
    }
    out
}

/// Dead-letter retention deletes dead events buried longer ago than the cutoff, in batches, and
/// nothing else.
pub async fn purge_dead_deletes_only_old_dead_events<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let ids = ids_of(h.enqueue(&store, &singles("x", &["Created"; 5])).await);
    // x0, x1 dead long ago; x2 dead just now; x3 delivered long ago; x4 pending, enqueued long ago.
    let claim = store.claim(&claim_up_to(4)).await.unwrap();
    let buries: Vec<BuryEvent> = claim.events[..3]
        .iter()
        .map(|e| buried(e.seq, "x"))
        .collect();
    store.bury(&claim.lease, &buries).await.unwrap();
    store
        .ack(&claim.lease, &[claim.events[3].seq])
        .await
        .unwrap();
    h.backdate(&store, &[ids[0], ids[1], ids[3], ids[4]], 2 * HOUR)
        .await;
    assert_eq!(store.purge_dead(3 * HOUR, 100).await.unwrap(), 0);
    assert_eq!(store.purge_dead(HOUR, 1).await.unwrap(), 1, "batch limit");
    assert_eq!(store.purge_dead(HOUR, 100).await.unwrap(), 1);
    assert_eq!(store.purge_dead(HOUR, 100).await.unwrap(), 0);
    assert!(store.get(ids[0]).await.unwrap().is_none());
    assert!(store.get(ids[1]).await.unwrap().is_none());
    for i in [2, 3, 4] {
        assert!(store.get(ids[i]).await.unwrap().is_some(), "x{i} kept");
    }
}

/// The states a property test puts an event in.
#[derive(Clone, Copy, Debug)]
enum Shape {
    Pending,
    Retrying,
    InFlight,
    Delivered,
    Dead,
}

fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        Just(Shape::Pending),
        Just(Shape::Retrying),
        Just(Shape::InFlight),
        Just(Shape::Delivered),
        Just(Shape::Dead),
    ]
}

/// Retention over random mixes of states and ages: `purge_delivered` deletes exactly the
/// delivered events older than the cutoff, whatever the batch size, and never an event in any
/// other state, however old.
pub async fn purge_never_deletes_an_undelivered_event<H: Harness>(h: &H) {
    let strategy = (
        prop::collection::vec((shape(), any::<bool>()), 1..30),
        1..8u32,
    );
    run_property(10, strategy, |(mix, batch)| async move {
        let store = h.fresh().await;
        let events: Vec<NewEvent> = (0..mix.len())
            .map(|i| typed(&format!("m{i}"), i as u64, "Created"))
            .collect();
        let ids = ids_of(h.enqueue(&store, &events).await);
        let claim = store.claim(&claim_up_to(1000)).await.unwrap();
        assert_eq!(claim.events.len(), mix.len());
        let (mut ack, mut retry, mut bury, mut release) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for e in &claim.events {
            match mix[payload_n(e) as usize].0 {
                Shape::Pending => release.push(e.seq),
                Shape::Retrying => retry.push(counted_retry(e.seq, HOUR, "x")),
                Shape::InFlight => {}
                Shape::Delivered => ack.push(e.seq),
                Shape::Dead => bury.push(buried(e.seq, "x")),
            }
        }
        store.ack(&claim.lease, &ack).await.unwrap();
        store.retry(&claim.lease, &retry).await.unwrap();
        store.bury(&claim.lease, &bury).await.unwrap();
        store.release(&claim.lease, &release).await.unwrap();
        let old: Vec<EventId> = ids
            .iter()
            .zip(&mix)
            .filter(|(_, (_, old))| *old)
            .map(|(id, _)| *id)
            .collect();
        h.backdate(&store, &old, 2 * HOUR).await;

        let mut deleted = 0;
        loop {
            let n = store.purge_delivered(HOUR, batch).await.unwrap();
            assert!(n <= u64::from(batch));
            if n == 0 {
                break;
            }
            deleted += n;
        }
        let expected = mix
            .iter()
            .filter(|(s, old)| matches!(s, Shape::Delivered) && *old)
            .count() as u64;
        assert_eq!(deleted, expected, "mix {mix:?}");
        for (id, (s, old)) in ids.iter().zip(&mix) {
            let gone = store.get(*id).await.unwrap().is_none();
            assert_eq!(
                gone,
                matches!(s, Shape::Delivered) && *old,
                "{s:?} old={old}, mix {mix:?}"
            );
        }
    });
}

/// A claim with a hold but with events of the held destination only returns nothing, and
/// `DeadLetterPolicy` still applies to the rest.
pub async fn hold_respects_the_dead_letter_policy<H: Harness>(h: &H) {
    let store =
        fresh_with_histories(h, &[("z", &["Created", "Created"]), ("y", &["HookSent"])]).await;
    let routes = hooks_and_kafka();
    let first = store.claim(&claim_up_to(1)).await.unwrap();
    store
        .bury(&first.lease, &[buried(first.events[0].seq, "x")])
        .await
        .unwrap();
    let blocked = store.claim(&hold(&routes, &["hooks"])).await.unwrap();
    assert!(blocked.events.is_empty(), "z/2 waits behind dead z/1");
    let skip = ClaimRequest {
        dead_letter: DeadLetterPolicy::Skip,
        ..hold(&routes, &["hooks"])
    };
    let skipped = store.claim(&skip).await.unwrap();
    assert_eq!(labels(&skipped.events), [("z", 2)]);
}
