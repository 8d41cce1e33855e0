//! What every sink crate's integration tests share, so a new sink's tests start from the same
//! pieces: a fresh outbox in its own PostgreSQL schema, transactional enqueue (committed or
//! rolled back), names no other test uses, waiting for the store, an event as a relay hands it
//! to a sink, a sink's configuration from JSON, the per-aggregate order check, the checks of an
//! outcome's kind and reason, and a cut proxy for outage tests.
//!
//! A sink's `tests/common/mod.rs` re-exports this crate and adds what is broker-specific (a
//! consumer, a topic or queue of the test's own); a sink with nothing broker-specific uses the
//! crate directly (`use outbox_sink_tests as common;`).

pub use outbox_testkit::unique;
use std::time::Duration;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use outbox_engine::{Relay, RelayConfig, RelayCounters, RelayReport};
use outbox_postgresql::{Enqueued, PgOutbox, PgStore};
use outbox_testkit::numbered;
use outbox_types::{
    Event, EventId, EventRecord, EventState, NewEvent, OutboxStats, Outcome, RetryPolicy, Sink,
    Store,
};
use sqlx::postgres::PgPoolOptions;

/// `OUTBOX_TEST_DATABASE_URL`, or the machine's local PostgreSQL `test` database.
pub fn database_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A sink's configuration from the JSON a test writes (the TOML table's fields).
pub fn config<C: serde::de::DeserializeOwned>(json: serde_json::Value) -> C {
    serde_json::from_value(json).unwrap()
}

/// A fresh migrated outbox in its own schema (`outbox_t_…`, which `scripts/test.sh` drops before
/// each run).
pub async fn fresh_store() -> PgStore {
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&database_url())
        .await
        .expect("PostgreSQL must be running on 127.0.0.1:5432");
    let outbox = PgOutbox::with_names(&unique("outbox_t_sink"), "events").unwrap();
    outbox.migrate(&pool).await.unwrap();
    PgStore::new(pool, outbox)
}

/// Enqueue `events` in one transaction that commits.
pub async fn enqueue_committed(store: &PgStore, events: &[NewEvent]) -> Vec<EventId> {
    enqueue_batch_committed(store, events)
        .await
        .into_iter()
        .map(|e| e.id)
        .collect()
}

/// Enqueue `events` in one transaction that commits; what `enqueue_batch` answered for each
/// (its id, and whether this call created it).
pub async fn enqueue_batch_committed(store: &PgStore, events: &[NewEvent]) -> Vec<Enqueued> {
    enqueue_in_transaction(store, events, true).await
}

/// Enqueue `events` in one transaction that rolls back: none of them may ever be published.
pub async fn enqueue_rolled_back(store: &PgStore, events: &[NewEvent]) {
    enqueue_in_transaction(store, events, false).await;
}

/// Enqueue `events` in one transaction, then commit it or roll it back.
async fn enqueue_in_transaction(
    store: &PgStore,
    events: &[NewEvent],
    commit: bool,
) -> Vec<Enqueued> {
    let mut tx = store.pool().begin().await.unwrap();
    let done = store
        .outbox()
        .enqueue_batch(&mut *tx, events)
        .await
        .unwrap();
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    done
}

/// Poll `fetch` every 50 ms until what it returns satisfies `done`, or fail after `limit`
/// (the message names `what` and shows the last value).
async fn poll_until<T: std::fmt::Debug, F: std::future::Future<Output = T>>(
    limit: Duration,
    what: &str,
    mut fetch: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let value = fetch().await;
        if done(&value) {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {value:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Poll `stats` until `done` holds, or fail after `limit`.
pub async fn wait_for_stats(
    store: &PgStore,
    limit: Duration,
    what: &str,
    done: impl Fn(&OutboxStats) -> bool,
) -> OutboxStats {
    poll_until(limit, what, || async { store.stats().await.unwrap() }, done).await
}

/// Poll the record of `id` until `done` holds, or fail after `limit`.
pub async fn wait_for_record(
    store: &PgStore,
    id: EventId,
    limit: Duration,
    what: &str,
    done: impl Fn(&EventRecord) -> bool,
) -> EventRecord {
    let fetch = || async { store.get(id).await.unwrap().expect("event exists") };
    poll_until(limit, what, fetch, done).await
}

/// Wait (up to 20 s) until the event `id` failed a call and waits to be tried again: pending,
/// with a `last_error`. `what` names the wait if it times out.
pub async fn wait_until_failed_and_pending(
    store: &PgStore,
    id: EventId,
    what: &str,
) -> EventRecord {
    wait_for_record(store, id, Duration::from_secs(20), what, |r| {
        r.state == EventState::Pending && r.last_error.is_some()
    })
    .await
}

/// The relay of a sink test that runs one against its broker: batches of 100, a fast poll,
/// short retries and never dead (1000 attempts), named `relay_id`.
pub fn relay_config(relay_id: &str, stop_when_idle: bool) -> RelayConfig {
    RelayConfig {
        relay_id: relay_id.into(),
        batch_size: 100,
        poll_interval: Duration::from_millis(20),
        lease: Duration::from_secs(10),
        publish_timeout: Duration::from_secs(5),
        retry: RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(300),
            max_attempts: 1000,
        },
        stop_when_idle,
        ..RelayConfig::default()
    }
}

/// `per_aggregate` numbered events for each of `aggregates` aggregates (`a0`, `a1`, …),
/// interleaved as writers would enqueue them; `a0`'s carry a `traceparent` header and `a1`'s an
/// idempotency key, so a test can check that both travel.
pub fn numbered_batch(aggregates: u64, per_aggregate: u64) -> Vec<NewEvent> {
    let mut events = Vec::new();
    for n in 0..per_aggregate {
        for a in 0..aggregates {
            let mut event = numbered(&format!("a{a}"), n);
            if a == 0 {
                event = event.with_header(
                    "traceparent",
                    format!("00-{:032x}-{:016x}-01", n + 1, a + 1),
                );
            }
            if a == 1 {
                event = event.with_idempotency_key(format!("key-{a}-{n}"));
            }
            events.push(event);
        }
    }
    events
}

/// `config` for an outage test: it does not stop when idle, and an event is dead after three
/// attempts 200 to 500 ms apart, spent within two seconds if an outage cost attempts.
pub fn dead_after_three_quick_attempts(config: RelayConfig) -> RelayConfig {
    RelayConfig {
        stop_when_idle: false,
        retry: RetryPolicy {
            base: Duration::from_millis(200),
            cap: Duration::from_millis(500),
            max_attempts: 3,
        },
        ..config
    }
}

/// Start a relay of `sink` over `store` with `config` in a task of its own; its counters, the
/// sender that stops it (sent or dropped) and its task, which ends with its report.
pub fn spawn_relay<K: Sink + 'static>(
    store: &Arc<PgStore>,
    sink: Arc<K>,
    config: RelayConfig,
) -> (
    Arc<RelayCounters>,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<RelayReport>,
) {
    let relay = Relay::new(store.clone(), sink, config);
    let counters = relay.counters();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    (counters, stop, run)
}

/// A relay a test started, with the events it was started on.
pub struct RunningRelay {
    /// The events enqueued before it started.
    pub ids: Vec<EventId>,
    /// Send (or drop) to stop it.
    pub stop: tokio::sync::oneshot::Sender<()>,
    /// Its task; the report once stopped.
    pub run: tokio::task::JoinHandle<RelayReport>,
}

/// The outage check of a sink whose destination the test made unreachable (a cut
/// `outbox_testkit::TcpProxy`): 30 events over 5 aggregates go to a relay (named `relay_id`)
/// that would make them dead after 3 attempts; after longer than those attempts take, the first
/// event is waiting, has spent no attempt, and its `last_error` contains `unreachable` (e.g.
/// `"NATS unreachable"`); nothing is delivered or dead. Returns the relay still running, for the
/// test to restore the destination and see the events delivered.
pub async fn outage_costs_no_attempt<K: Sink>(
    store: &Arc<PgStore>,
    sink: K,
    relay_id: &str,
    unreachable: &str,
) -> RunningRelay {
    let events: Vec<_> = (0..30u64)
        .map(|i| numbered(&format!("a{}", i % 5), i / 5))
        .collect();
    let ids = enqueue_committed(store, &events).await;
    // Three attempts at most 300 ms apart: an outage of seconds would dead-letter everything if
    // it cost attempts.
    let (_, stop, run) = spawn_relay(
        store,
        Arc::new(sink),
        RelayConfig {
            retry: RetryPolicy {
                max_attempts: 3,
                ..relay_config(relay_id, false).retry
            },
            ..relay_config(relay_id, false)
        },
    );

    wait_until_failed_and_pending(store, ids[0], "pending after failed calls").await;
    assert_outage_cost_no_attempt(store, ids[0], &[unreachable]).await;
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.delivered, 0, "{stats:?}");
    assert_eq!(stats.dead, 0, "{stats:?}");
    RunningRelay { ids, stop, run }
}

/// The check at the heart of every outage test, once event `id` has recorded a failed call:
/// after longer than three attempts with their backoff would take, it is waiting (or claimed
/// for the trial call the relay makes now and then), never delivered or dead, has spent no
/// attempt, and its `last_error` contains each of `names` (the broker's address, the topic…).
pub async fn assert_outage_cost_no_attempt(store: &PgStore, id: EventId, names: &[&str]) {
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_no_attempt_spent(store, id, names).await;
}

/// Wait (up to 30 s) until event `id`, whose destination is down, has recorded a failed call,
/// then [`assert_outage_cost_no_attempt`]: a test whose relay runs on its own checks the outage
/// with it.
pub async fn outage_recorded_at_no_cost(store: &PgStore, id: EventId, names: &[&str]) {
    wait_for_record(
        store,
        id,
        Duration::from_secs(30),
        "a failed attempt recorded",
        |r| r.last_error.is_some(),
    )
    .await;
    assert_outage_cost_no_attempt(store, id, names).await;
}

/// The record of event `id` now: waiting (or claimed for the trial call the relay makes now and
/// then), never delivered or dead, no attempt spent, and its `last_error` contains each of
/// `names`. [`assert_outage_cost_no_attempt`] without its wait, for a test that waits its own way.
pub async fn assert_no_attempt_spent(store: &PgStore, id: EventId, names: &[&str]) {
    let record = store.get(id).await.unwrap().unwrap();
    assert!(
        matches!(record.state, EventState::Pending | EventState::InFlight),
        "{record:?}"
    );
    assert!(
        record.event.attempts == 0,
        "an outage costs no attempt: {record:?}"
    );
    let error = record.last_error.clone().unwrap_or_default();
    println!("last_error while down: {error}");
    for name in names {
        assert!(error.contains(name), "last_error names {name}: {error}");
    }
}

/// An event as a relay would hand it to a sink, for tests that call `publish` directly.
pub fn event(aggregate_id: &str, n: u64) -> outbox_types::Event {
    let payload = serde_json::json!({ "aggregate": aggregate_id, "n": n });
    outbox_types::NewEvent::new("agg", aggregate_id, "Numbered", &payload)
        .expect("a JSON value serializes")
        .claimed(n as i64)
}

/// The aggregate and the number a numbered event ([`event`], `outbox_testkit::numbered`)
/// carries in its payload, as a message brings it back.
pub fn aggregate_and_n(payload: &[u8]) -> (String, u64) {
    let value: serde_json::Value = serde_json::from_slice(payload).unwrap();
    (
        value["aggregate"].as_str().unwrap().to_owned(),
        value["n"].as_u64().unwrap(),
    )
}

/// The reason of `outcome`, which must be a rejection (the test fails otherwise).
#[track_caller]
pub fn rejection(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Reject { reason } => reason,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// `outcome` is a rejection whose reason contains each of `words`; otherwise the test fails,
/// saying `what`.
#[track_caller]
pub fn assert_rejected(outcome: &Outcome, words: &[&str], what: &str) {
    let Outcome::Reject { reason } = outcome else {
        panic!("{what}: expected a rejection, got {outcome:?}");
    };
    assert!(words.iter().all(|w| reason.contains(w)), "{what}: {reason}");
}

/// The reason of `outcome`, which must say the destination is unavailable (the test fails
/// otherwise).
#[track_caller]
pub fn unavailability(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Unavailable { reason, .. } => reason,
        other => panic!("expected unavailable, got {other:?}"),
    }
}

/// A proxy to `upstream`, cut from the start: what an outage test puts between a sink and its
/// destination, which looks down until the test restores the proxy.
pub async fn cut_proxy(upstream: std::net::SocketAddr) -> outbox_testkit::TcpProxy {
    let proxy = outbox_testkit::TcpProxy::start(upstream).await.unwrap();
    proxy.cut();
    proxy
}

/// Which aggregates' payload sequence numbers are not increasing in `delivered` (aggregate, n).
pub fn order_violations(delivered: &[(String, u64)]) -> Vec<String> {
    let mut last: std::collections::HashMap<&str, u64> = Default::default();
    let mut bad = Vec::new();
    for (aggregate, n) in delivered {
        if let Some(prev) = last.get(aggregate.as_str())
            && n <= prev
        {
            bad.push(format!("{aggregate}: {n} after {prev}"));
        }
        last.insert(aggregate, *n);
    }
    bad
}

/// Restore the cut `proxy` and wait (up to 30 s) until `delivered` events are delivered; `what`
/// names the wait if it times out.
pub async fn restore_until_delivered(
    store: &PgStore,
    proxy: &outbox_testkit::TcpProxy,
    delivered: u64,
    what: &str,
) {
    proxy.restore();
    wait_for_stats(store, Duration::from_secs(30), what, |s| {
        s.delivered == delivered
    })
    .await;
}

/// The connection lost while the relay runs, after [`outage_costs_no_attempt`]'s 30 events were
/// delivered: 20 more events (aggregates `a0`..`a4`, numbers 6 to 9) are enqueued with `proxy`
/// cut; the first fails a call and waits; once `proxy` is restored all 50 are delivered.
/// Returns the ids of the 20.
pub async fn cut_while_running(store: &PgStore, proxy: &outbox_testkit::TcpProxy) -> Vec<EventId> {
    proxy.cut();
    let later: Vec<_> = (6..10u64)
        .flat_map(|n| (0..5).map(move |a| numbered(&format!("a{a}"), n)))
        .collect();
    let later_ids = enqueue_committed(store, &later).await;
    let record = wait_until_failed_and_pending(
        store,
        later_ids[0],
        "pending after a failed attempt after the cut",
    )
    .await;
    assert_eq!(record.state, EventState::Pending);
    restore_until_delivered(store, proxy, 50, "delivery after the reconnect").await;
    later_ids
}

/// The whole outage story of a sink whose destination sits behind the cut `proxy`: its `check`
/// fails, an outage at start-up costs no attempt ([`outage_costs_no_attempt`]), the 30 events go out once `proxy`
/// is restored, then the connection is lost while the relay runs ([`cut_while_running`]) and
/// all 50 go out after the reconnect; the relay stops with no dead event. Returns its report
/// and the ids of the 50 events, in enqueue order.
pub async fn outage_then_cut_while_running<K: Sink>(
    store: &Arc<PgStore>,
    sink: K,
    proxy: &outbox_testkit::TcpProxy,
    relay_id: &str,
    unreachable: &str,
) -> (RelayReport, Vec<EventId>) {
    assert!(
        sink.check().await.is_err(),
        "{relay_id}: the sink's check must fail while its destination is cut off"
    );
    let RunningRelay { ids, stop, run } =
        outage_costs_no_attempt(store, sink, relay_id, unreachable).await;
    restore_until_delivered(store, proxy, 30, "delivery after the outage").await;
    let later_ids = cut_while_running(store, proxy).await;
    let report = stop_with_no_dead(stop, run).await;
    (report, ids.into_iter().chain(later_ids).collect())
}

/// Stop a running relay; its report, which counts no dead event.
pub async fn stop_with_no_dead(
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<RelayReport>,
) -> RelayReport {
    let _ = stop.send(());
    let report = run.await.unwrap();
    assert_eq!(report.dead, 0, "{report:?}");
    report
}

/// The `traceparent` header the special event of a delivery test carries.
pub const SPECIAL_TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The special event of a delivery test: number 0 of aggregate `special`, sent to its own
/// `destination`, with the trace context [`SPECIAL_TRACEPARENT`], the idempotency key
/// `special-0` and a forged `Outbox-Event-Id` header (which must not shadow the real one). A
/// sink's test adds the headers it must not let through as they are.
pub fn special_event(destination: impl Into<String>) -> NewEvent {
    numbered("special", 0)
        .with_destination(destination)
        .with_header("traceparent", SPECIAL_TRACEPARENT)
        .with_header("Outbox-Event-Id", "forged")
        .with_idempotency_key("special-0")
}

/// Row header names that pose as the relay's own in another case (and one more in the
/// reserved prefix): no consumer may receive any of them, whatever the broker's rule for case.
pub const FORGED_RELAY_HEADERS: [&str; 4] = [
    "Outbox-Event-Id",
    "OUTBOX-IDEMPOTENCY-KEY",
    "outbox-Aggregate-Id",
    "Outbox-Tenant",
];

/// `event` with every name of [`FORGED_RELAY_HEADERS`] set to `forged`, and an ordinary
/// `tenant` header: what a writer who wants to forge a relay header stores.
pub fn with_forged_relay_headers(mut event: Event) -> Event {
    for name in FORGED_RELAY_HEADERS {
        event.headers.insert(name.to_owned(), "forged".to_owned());
    }
    event.headers.insert("tenant".to_owned(), "acme".to_owned());
    event
}

/// Check the headers a consumer received for a [`with_forged_relay_headers`] event: every
/// header whose name starts with `outbox-` in any case is one of the relay's own, in lower case,
/// once, never `forged`; the event's id and key are the real ones; `tenant` arrived.
#[track_caller]
pub fn assert_no_forged_relay_headers(event: &Event, headers: &[(String, String)]) {
    let ours: Vec<&(String, String)> = headers
        .iter()
        .filter(|(name, _)| name.to_ascii_lowercase().starts_with("outbox-"))
        .collect();
    for (name, value) in &ours {
        assert_eq!(
            name,
            &name.to_ascii_lowercase(),
            "a forged name travels: {headers:?}"
        );
        assert_ne!(value, "forged", "a forged value travels: {headers:?}");
    }
    let mut names: Vec<&str> = ours.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    let count = names.len();
    names.dedup();
    assert_eq!(count, names.len(), "each relay header once: {headers:?}");
    let get = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(get("outbox-event-id"), Some(event.id.to_string().as_str()));
    assert_eq!(
        get("outbox-aggregate-id"),
        Some(event.aggregate_id.as_str())
    );
    assert_eq!(get("tenant"), Some("acme"), "{headers:?}");
}

/// Check that a message carried `event`'s trace context and idempotency key, as the headers
/// `traceparent` and `outbox-idempotency-key`; `header` reads one of the message's headers.
#[track_caller]
pub fn assert_trace_and_key_headers(event: &NewEvent, header: impl Fn(&str) -> Option<String>) {
    assert_eq!(
        header("traceparent"),
        event.headers().get("traceparent").cloned()
    );
    assert_eq!(
        header("outbox-idempotency-key").as_deref(),
        event.idempotency_key()
    );
}

/// The events of a delivery test, enqueued: 6 numbered events for each of 8 aggregates (`a0`…
/// `a7`) interleaved, then `special`, committed; then 5 `ghost` events in a transaction rolled
/// back. Returns the committed events and their ids.
pub async fn enqueue_with_ghosts(
    store: &PgStore,
    special: NewEvent,
) -> (Vec<NewEvent>, Vec<EventId>) {
    let mut committed = Vec::new();
    for n in 0..6u64 {
        for a in 0..8 {
            committed.push(numbered(&format!("a{a}"), n));
        }
    }
    committed.push(special);
    let committed_ids = enqueue_committed(store, &committed).await;
    let ghosts: Vec<_> = (0..5).map(|n| numbered("ghost", n)).collect();
    enqueue_rolled_back(store, &ghosts).await;
    (committed, committed_ids)
}

/// Enqueue the first half of `committed` in a transaction that commits, then `ghosts` in one
/// that rolls back, then the second half of `committed`: the rolled-back events sit between
/// committed ones, and none of them may ever be published.
pub async fn enqueue_ghosts_between(store: &PgStore, committed: &[NewEvent], ghosts: &[NewEvent]) {
    enqueue_committed(store, &committed[..committed.len() / 2]).await;
    enqueue_rolled_back(store, ghosts).await;
    enqueue_committed(store, &committed[committed.len() / 2..]).await;
}

/// A claimed `OrderCreated` event of `aggregate_type` `aggregate_id` carrying `payload` (as is,
/// even when it is not JSON) and a W3C trace parent: what a sink test hands a sink directly.
pub fn claimed_event(aggregate_type: &str, aggregate_id: &str, payload: &str) -> Event {
    let event = NewEvent::from_json(aggregate_type, aggregate_id, "OrderCreated", "{}")
        .unwrap()
        .with_traceparent(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            None,
        )
        .unwrap()
        .claimed(1);
    Event {
        payload: payload.into(),
        ..event
    }
}

/// Run a relay of `sink` over `store` with `config` (whose `stop_when_idle` is set) until it is
/// idle, failing the test if that takes longer than a minute; its report.
pub async fn run_to_idle<K: Sink + 'static>(
    store: &Arc<PgStore>,
    sink: K,
    config: RelayConfig,
) -> RelayReport {
    let relay = Relay::new(store.clone(), Arc::new(sink), config);
    tokio::time::timeout(Duration::from_secs(60), relay.run(std::future::pending()))
        .await
        .expect("relay drained")
}

/// After a relay ran to idle on `committed`: its report and the outbox count every one of them
/// delivered and nothing retried, waiting or dead, and each record is `Delivered`.
pub async fn assert_all_delivered(store: &PgStore, report: &RelayReport, committed: &[NewEvent]) {
    assert_eq!(report.delivered, committed.len() as u64, "{report:?}");
    assert_eq!(report.retried + report.dead, 0, "{report:?}");

    let stats = store.stats().await.unwrap();
    assert_eq!(stats.delivered, committed.len() as u64, "{stats:?}");
    assert_eq!(stats.pending + stats.in_flight + stats.dead, 0, "{stats:?}");
    for event in committed {
        let record = store.get(event.id()).await.unwrap().unwrap();
        assert_eq!(record.state, EventState::Delivered);
    }
}

/// An address nothing listens on: a port the system handed out, closed again at once.
pub fn closed_addr() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// The relay of an end-to-end test that drains the outbox into a broker and stops once idle:
/// batches of `batch_size`, a fast poll, a 30 s lease and 10 s to publish a batch, named
/// `relay_id`.
pub fn drain_relay_config(relay_id: &str, batch_size: u32) -> RelayConfig {
    RelayConfig {
        relay_id: relay_id.into(),
        batch_size,
        poll_interval: Duration::from_millis(20),
        lease: Duration::from_secs(30),
        publish_timeout: Duration::from_secs(10),
        stop_when_idle: true,
        ..RelayConfig::default()
    }
}

/// The events of an end-to-end delivery test, enqueued: [`numbered_batch`] of `aggregates` ×
/// `per_aggregate` and one `AuditWritten` event that names its own `destination`, committed
/// around 20 rolled-back `ghost` events ([`enqueue_ghosts_between`]). Returns the committed
/// events (the audit event last) and the audit event.
pub async fn enqueue_numbered_and_audit(
    store: &PgStore,
    aggregates: u64,
    per_aggregate: u64,
    destination: impl Into<String>,
) -> (Vec<NewEvent>, NewEvent) {
    let mut committed = numbered_batch(aggregates, per_aggregate);
    let audit = NewEvent::from_json("audit", "x", "AuditWritten", r#"{"who":"me"}"#)
        .unwrap()
        .with_destination(destination);
    committed.push(audit.clone());
    let ghosts: Vec<NewEvent> = (0..20).map(|n| numbered("ghost", n)).collect();
    enqueue_ghosts_between(store, &committed, &ghosts).await;
    (committed, audit)
}

/// The read-back check of an end-to-end delivery test, message by message: each is one of the
/// committed events, none arrives twice, and the numbered events of an aggregate arrive in
/// order (their payload's `n` counts up from 0).
pub struct Arrivals<'a> {
    by_id: HashMap<String, &'a NewEvent>,
    seen: HashSet<String>,
    last_n: HashMap<String, i64>,
}

impl<'a> Arrivals<'a> {
    /// Nothing arrived yet of `committed`.
    pub fn new(committed: &'a [NewEvent]) -> Self {
        Arrivals {
            by_id: committed.iter().map(|e| (e.id().to_string(), e)).collect(),
            seen: HashSet::new(),
            last_n: HashMap::new(),
        }
    }

    /// The committed event whose id a message carries; fails the test for an id that was never
    /// committed or that arrived before.
    pub fn arrived(&mut self, id: &str) -> &'a NewEvent {
        let event = self
            .by_id
            .get(id)
            .copied()
            .unwrap_or_else(|| panic!("unexpected event {id}"));
        assert!(self.seen.insert(id.to_owned()), "event {id} arrived twice");
        event
    }

    /// `body`, a numbered event's payload, is the next of `aggregate`.
    pub fn in_order(&mut self, aggregate: &str, body: &[u8]) {
        let body: serde_json::Value = serde_json::from_slice(body).unwrap();
        let n = body["n"].as_i64().unwrap();
        let last = self.last_n.insert(aggregate.to_owned(), n);
        assert_eq!(
            last.map_or(0, |l| l + 1),
            n,
            "aggregate {aggregate} out of order"
        );
    }

    /// After the last message: numbered events of all `aggregates` arrived, none of the
    /// rolled-back `ghost` aggregate.
    pub fn assert_complete(&self, aggregates: u64) {
        assert_eq!(self.last_n.len(), aggregates as usize);
        assert!(
            !self.last_n.contains_key("ghost"),
            "a rolled-back event was published"
        );
    }
}
