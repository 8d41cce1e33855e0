//! The `outbox relay` binary serving several destinations from one config file: events are
//! routed by rules over their fields (or by naming a destination), reach a real NATS JetStream
//! and a real HTTP receiver, rolled-back events never do, unroutable events are dead-lettered
//! with the fix named; an operator pauses a destination while the relay runs and resumes it.

mod common;

use common::{fresh_pg_store, outbox};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::routing::post;
use outbox_postgresql::PgStore;
use outbox_types::{EventState, NewEvent, Store};

const NATS: &str = "nats://127.0.0.1:4222";

/// One request the receiver got: the event type from the path, headers, body.
type Request = (String, HashMap<String, String>, String);

#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<Request>>>, Arc<std::sync::atomic::AtomicU64>);

impl Received {
    /// Make every later request take this long to answer (a slow receiver).
    fn slow_down(&self, ms: u64) {
        self.1.store(ms, std::sync::atomic::Ordering::SeqCst);
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

async fn receive(
    State(received): State<Received>,
    Path(event_type): Path<String>,
    headers: HeaderMap,
    body: String,
) -> &'static str {
    let headers = common::header_pairs(&headers);
    received.0.lock().unwrap().push((event_type, headers, body));
    let delay = received.1.load(std::sync::atomic::Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    "ok"
}

async fn webhook_receiver() -> (u16, Received) {
    let received = Received::default();
    let app = Router::new()
        .route("/hook/{event_type}", post(receive))
        .with_state(received.clone());
    let port = common::serve(app).await;
    (port, received)
}

async fn stream_messages(stream: &str) -> Vec<jetstream::message::StreamMessage> {
    let js = jetstream::new(async_nats::connect(NATS).await.unwrap());
    let mut handle = js.get_stream(stream).await.unwrap();
    let info = handle.info().await.unwrap().clone();
    let mut out = Vec::new();
    if info.state.messages == 0 {
        return out;
    }
    for seq in info.state.first_sequence..=info.state.last_sequence {
        out.push(handle.get_raw_message(seq).await.unwrap());
    }
    out
}

struct Fixture {
    schema: String,
    store: PgStore,
    stream: String,
    subject_prefix: String,
    received: Received,
    config: tempfile::NamedTempFile,
}

async fn fixture(tag: &str) -> Fixture {
    let schema = format!("outbox_t_{tag}_{}", std::process::id());
    let store = fresh_pg_store(&schema).await;
    let subject_prefix = schema.clone();
    let stream = schema.to_uppercase();
    let (port, received) = webhook_receiver().await;
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        config.path(),
        format!(
            r#"
{database}
[relay]
poll_interval = "20ms"
lease = "10s"
publish_timeout = "5s"

[destinations.orders]
type = "nats"
servers = ["{NATS}"]
subject = "{subject_prefix}.${{event_type}}"
create_stream = true
stream_name = "{stream}"
stream_subjects = ["{subject_prefix}.>"]

[destinations.hooks]
type = "webhook"
url = "http://127.0.0.1:{port}/hook/${{event_type}}"
secret = "s3cret"

[[routes]]
when = {{ aggregate_type = "partner" }}
to = "hooks"

[[routes]]
when = {{ event_type = "Order*" }}
to = "orders"
"#,
            database = common::pg_database(&schema),
        ),
    )
    .unwrap();
    Fixture {
        schema,
        store,
        stream,
        subject_prefix,
        received,
        config,
    }
}

impl Fixture {
    async fn enqueue(&self, events: &[NewEvent], commit: bool) {
        let mut tx = self.store.pool().begin().await.unwrap();
        for e in events {
            self.store.outbox().enqueue(&mut *tx, e).await.unwrap();
        }
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
    }

    fn config_path(&self) -> &str {
        self.config.path().to_str().unwrap()
    }

    async fn wait_for(&self, what: &str, done: impl FnMut(&outbox_types::OutboxStats) -> bool) {
        common::stats_until(&self.store, Duration::from_secs(60), what, done).await;
    }
}

fn order(id: u32, n: u32) -> NewEvent {
    NewEvent::new(
        "order",
        format!("o{id}"),
        if n == 0 {
            "OrderCreated"
        } else {
            "OrderUpdated"
        },
        &serde_json::json!({ "order": id, "n": n }),
    )
    .unwrap()
}

fn partner(n: u32) -> NewEvent {
    NewEvent::new(
        "partner",
        "p1",
        "PartnerPinged",
        &serde_json::json!({ "n": n }),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_routed_to_their_destinations_and_unroutable_ones_are_dead_lettered() {
    let f = fixture("dest").await;
    let mut orders = Vec::new();
    for n in 0..5 {
        for id in 0..6 {
            orders.push(order(id, n));
        }
    }
    f.enqueue(&orders, true).await;
    let partners: Vec<NewEvent> = (0..4).map(partner).collect();
    f.enqueue(&partners, true).await;
    // Names a destination in its own column: goes there whatever the rules say.
    let named = order(99, 0).with_destination("hooks");
    f.enqueue(std::slice::from_ref(&named), true).await;
    // Matches no rule.
    let stray = NewEvent::new("user", "u1", "UserRenamed", &serde_json::json!({})).unwrap();
    f.enqueue(std::slice::from_ref(&stray), true).await;
    // Rolled back: must never be published anywhere.
    f.enqueue(&[order(500, 0), partner(500)], false).await;

    let o = outbox(&["relay", "--config", f.config_path(), "--drain"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let stats = f.store.stats().await.unwrap();
    assert_eq!(stats.delivered, 30 + 4 + 1, "{stats:?}");
    assert_eq!(stats.dead, 1, "{stats:?}");
    assert_eq!(stats.pending + stats.in_flight, 0, "{stats:?}");

    let dead = f.store.get(stray.id()).await.unwrap().unwrap();
    assert_eq!(dead.state, EventState::Dead);
    let error = dead.last_error.unwrap();
    common::assert_contains(&error, "no route matches");
    common::assert_contains(&error, "UserRenamed");
    common::assert_contains(&error, "outbox dead requeue");

    // NATS got exactly the committed order events, in order per aggregate.
    let messages = stream_messages(&f.stream).await;
    assert_eq!(messages.len(), 30);
    let mut last_n: HashMap<String, u64> = HashMap::new();
    for m in &messages {
        let subject = m.subject.to_string();
        assert!(
            subject == format!("{}.OrderCreated", f.subject_prefix)
                || subject == format!("{}.OrderUpdated", f.subject_prefix),
            "{subject}"
        );
        let aggregate = m
            .headers
            .get("outbox-aggregate-id")
            .unwrap()
            .as_str()
            .to_owned();
        let payload: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        assert_ne!(payload["order"], 500, "a rolled-back event was published");
        let n = payload["n"].as_u64().unwrap();
        if let Some(prev) = last_n.insert(aggregate.clone(), n) {
            assert!(n > prev, "order broken for {aggregate}: {n} after {prev}");
        }
    }

    // The webhook got the partner events and the one that named it, signed.
    let received = f.received.0.lock().unwrap().clone();
    assert_eq!(received.len(), 5, "{received:?}");
    let partner_ns: Vec<u64> = received
        .iter()
        .filter(|(t, _, _)| t == "PartnerPinged")
        .map(|(_, _, body)| {
            serde_json::from_str::<serde_json::Value>(body).unwrap()["n"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(partner_ns, [0, 1, 2, 3], "in order, rolled back one absent");
    assert!(received.iter().any(|(t, h, _)| t == "OrderCreated"
        && h.get("idempotency-key").map(String::as_str) == Some(named.id().to_string().as_str())));
    assert!(
        received
            .iter()
            .all(|(_, h, _)| h.contains_key("x-outbox-signature")),
        "{received:?}"
    );

    // `outbox status` reads the same config and reports per destination.
    let o = outbox(&["status", "--config", f.config_path(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(status["delivered"], 35, "{status}");
    assert_eq!(status["dead"], 1, "{status}");
    let per: Vec<&serde_json::Value> = status["destinations"].as_array().unwrap().iter().collect();
    let unroutable = per
        .iter()
        .find(|d| d["destination"].is_null())
        .expect("the unroutable event is counted under no destination");
    assert_eq!(unroutable["dead"], 1, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_destination_holds_its_events_while_the_others_flow() {
    let f = fixture("pause").await;
    let mut relay = common::spawn_relay(f.config_path(), "info");

    let o = outbox(&["pause", "hooks", "--config", f.config_path()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("hooks: paused"));
    let o = outbox(&["pause", "hoks", "--config", f.config_path()]);
    common::exits_2_saying(&o, "did you mean `hooks`?");
    // Let the running relay notice (one poll interval is 20 ms).
    tokio::time::sleep(Duration::from_millis(300)).await;

    let orders: Vec<NewEvent> = (0..10).map(|id| order(id, 0)).collect();
    let partners: Vec<NewEvent> = (0..5).map(partner).collect();
    f.enqueue(&partners, true).await;
    f.enqueue(&orders, true).await;
    f.wait_for("the unpaused destination's events", |s| s.delivered == 10)
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stats = f.store.stats().await.unwrap();
    assert_eq!(
        stats.delivered, 10,
        "paused events stayed pending: {stats:?}"
    );
    assert_eq!(stats.pending, 5, "{stats:?}");
    assert_eq!(stats.in_flight, 0, "{stats:?}");
    assert!(f.received.0.lock().unwrap().is_empty());

    let o = outbox(&["status", "--config", f.config_path(), "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let hooks = common::destination(&status, "hooks").unwrap();
    assert_eq!(hooks["pending"], 5, "{status}");
    assert_eq!(hooks["paused"], true, "{status}");
    assert_eq!(status["paused"][0]["destination"], "hooks", "{status}");

    let o = outbox(&["resume", "hooks", "--config", f.config_path()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    f.wait_for("the resumed destination's events", |s| s.delivered == 15)
        .await;
    let received = f.received.0.lock().unwrap().clone();
    let ns: Vec<u64> = received
        .iter()
        .map(|(_, _, body)| {
            serde_json::from_str::<serde_json::Value>(body).unwrap()["n"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(ns, [0, 1, 2, 3, 4], "delivered in order after the resume");

    // Replay: everything delivered goes again, ids unchanged.
    let o = outbox(&[
        "replay",
        "--config",
        f.config_path(),
        "--from",
        "1h",
        "--destination",
        "hooks",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let replay: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(replay["replayed"], 5, "{replay}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while f.received.0.lock().unwrap().len() < 10 {
        assert!(
            Instant::now() < deadline,
            "replayed events were not sent again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let received = f.received.0.lock().unwrap().clone();
    let first: Vec<&String> = received[..5]
        .iter()
        .map(|(_, h, _)| &h["outbox-event-id"])
        .collect();
    let again: Vec<&String> = received[5..]
        .iter()
        .map(|(_, h, _)| &h["outbox-event-id"])
        .collect();
    assert_eq!(first, again, "replays keep the event ids (and their order)");
    let _ = relay.0.kill();
    let _ = relay.0.wait();
    let _ = f.schema;
}

/// SIGTERM and SIGINT in the middle of a batch: the relay stops claiming, lets the wave it is
/// publishing finish, acks it, gives the rest back untouched, and exits 0 with nothing claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_and_sigint_mid_batch_finish_the_wave_and_leave_nothing_claimed() {
    for (round, sig) in ["-TERM", "-INT"].into_iter().enumerate() {
        let f = fixture(&format!("stop{round}")).await;
        f.received.slow_down(200);
        // 400 partner events of one aggregate: one per wave, each wave a slow request.
        let partners: Vec<NewEvent> = (0..400).map(partner).collect();
        f.enqueue(&partners, true).await;
        let mut relay = common::relay_command(f.config_path(), "warn")
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while f.received.len() < 3 {
            assert!(Instant::now() < deadline, "the relay never published");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mid = f.store.stats().await.unwrap();
        assert!(mid.in_flight > 0, "stopped mid-batch: {mid:?}");
        common::signal(&relay, sig);
        let exit = common::exit_within(
            &mut relay,
            Duration::from_secs(15),
            &format!("the relay did not stop after {sig}"),
        )
        .await;
        assert_eq!(exit.code(), Some(0), "{sig}");
        let stats = f.store.stats().await.unwrap();
        assert_eq!(stats.in_flight, 0, "{sig}: nothing left claimed: {stats:?}");
        assert_eq!(stats.delivered + stats.pending, 400, "{sig}: {stats:?}");
        assert!(
            stats.delivered >= 3,
            "{sig}: the wave in progress was acked: {stats:?}"
        );
        assert!(
            stats.pending > 0,
            "{sig}: stopped before the end: {stats:?}"
        );
        let received = f.received.len() as u64;
        assert!(
            received >= stats.delivered && received <= stats.delivered + 1,
            "{sig}: delivered = what the receiver got (at most the one in progress extra): {received} vs {stats:?}"
        );
        let attempted: i64 = common::pg_value(
            f.store.pool(),
            format!(
                "SELECT count(*) FROM \"{}\".events WHERE status = 'pending' AND attempts > 0",
                f.schema
            ),
        )
        .await;
        assert_eq!(attempted, 0, "{sig}: released events count no attempt");
    }
}
