//! Against a real HTTP server (axum on 127.0.0.1:0, started here) and the real PostgreSQL
//! outbox: exactly the committed events are posted, signed, with their headers and per-aggregate
//! order; 500 is retried, 429 waits for its `Retry-After` (seconds and HTTP-date forms), 400 is
//! dead with the response body in `last_error`, 200 is delivered; an unreachable receiver keeps
//! the events pending until it is back.

mod common;

use common::config;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use outbox_engine::RelayConfig;
use outbox_sink_webhook::WebhookSink;
use outbox_testkit::numbered;
use outbox_types::{EventState, RetryPolicy, Store};

const SECRET: &str = "whsec_integration";

/// What the server answers to the `attempt`-th request (1-based) on `path`.
type Script =
    dyn Fn(&str, usize) -> (StatusCode, Vec<(&'static str, String)>, String) + Send + Sync;

#[derive(Clone, Debug)]
struct Recorded {
    path: String,
    headers: HeaderMap,
    body: Bytes,
    at: Instant,
}

struct Receiver {
    script: Box<Script>,
    requests: Mutex<Vec<Recorded>>,
    attempts: Mutex<HashMap<String, usize>>,
}

impl Receiver {
    fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }
    fn on(&self, path: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.path == path)
            .collect()
    }
}

async fn hook(
    State(receiver): State<Arc<Receiver>>,
    Path(path): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let attempt = {
        let mut attempts = receiver.attempts.lock().unwrap();
        let n = attempts.entry(path.clone()).or_insert(0);
        *n += 1;
        *n
    };
    receiver.requests.lock().unwrap().push(Recorded {
        path: path.clone(),
        headers,
        body,
        at: Instant::now(),
    });
    let (status, headers, body) = (receiver.script)(&path, attempt);
    let mut response = (status, body).into_response();
    for (name, value) in headers {
        response.headers_mut().insert(name, value.parse().unwrap());
    }
    response
}

/// Start the receiver on 127.0.0.1:0; returns its address.
async fn start(script: Box<Script>) -> (Arc<Receiver>, std::net::SocketAddr) {
    let receiver = Arc::new(Receiver {
        script,
        requests: Mutex::new(Vec::new()),
        attempts: Mutex::new(HashMap::new()),
    });
    let app = Router::new()
        .route("/{*path}", post(hook))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (receiver, addr)
}

fn relay_config(stop_when_idle: bool) -> RelayConfig {
    common::relay_config("webhook-test", stop_when_idle)
}

fn header(r: &Recorded, name: &str) -> Option<String> {
    r.headers.get(name).map(|v| v.to_str().unwrap().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_posts_exactly_the_committed_events_signed_with_headers_and_order() {
    let (receiver, addr) = start(Box::new(|_, _| (StatusCode::OK, vec![], String::new()))).await;
    let store = Arc::new(common::fresh_store().await);

    let (committed, committed_ids) = common::enqueue_with_ghosts(
        &store,
        common::special_event(format!("http://{addr}/audit/special"))
            .with_header("Host", "evil.example"),
    )
    .await;

    let sink = WebhookSink::connect(config(serde_json::json!({
        "url": format!("http://{addr}/hooks/${{aggregate_id}}/${{event_type}}"),
        "secret": SECRET,
        "bearer_token": "tok-123",
        "concurrency": 4,
    })))
    .unwrap();
    let report = common::run_to_idle(&store, sink, relay_config(true)).await;
    common::assert_all_delivered(&store, &report, &committed).await;

    let requests = receiver.requests();
    assert_eq!(
        requests.len(),
        committed.len(),
        "one request per committed event"
    );
    let got: HashSet<String> = requests
        .iter()
        .map(|r| header(r, "outbox-event-id").unwrap())
        .collect();
    let want: HashSet<String> = committed_ids.iter().map(|i| i.to_string()).collect();
    assert_eq!(got, want, "exactly the committed events");

    let mut order = Vec::new();
    for r in &requests {
        let id = header(r, "outbox-event-id").unwrap();
        let payload: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        let aggregate = payload["aggregate"].as_str().unwrap().to_owned();
        assert_ne!(aggregate, "ghost");
        assert_eq!(header(r, "outbox-event-type").as_deref(), Some("Numbered"));
        assert!(
            header(r, "x-event-id").is_none(),
            "legacy_headers is off by default"
        );
        assert_eq!(
            header(r, "content-type").as_deref(),
            Some("application/json")
        );
        assert_eq!(
            header(r, "authorization").as_deref(),
            Some("Bearer tok-123")
        );
        let ids: Vec<_> = r.headers.get_all("outbox-event-id").iter().collect();
        assert_eq!(
            ids.len(),
            1,
            "an own Outbox-Event-Id cannot add a second value"
        );
        assert_eq!(ids[0].to_str().unwrap(), id);
        assert_eq!(
            header(r, "outbox-aggregate-id").as_deref(),
            Some(aggregate.as_str())
        );
        assert_ne!(header(r, "host").as_deref(), Some("evil.example"));
        let signature = header(r, "X-Outbox-Signature").expect("signed");
        common::assert_signed_now(SECRET, &signature, &r.body);
        if aggregate == "special" {
            assert_eq!(r.path, "audit/special", "own destination wins");
            assert_eq!(header(r, "Idempotency-Key").as_deref(), Some("special-0"));
            assert_eq!(
                header(r, "traceparent").as_deref(),
                Some(common::SPECIAL_TRACEPARENT)
            );
        } else {
            assert_eq!(r.path, format!("hooks/{aggregate}/Numbered"));
            assert_eq!(header(r, "Idempotency-Key").as_deref(), Some(id.as_str()));
        }
        order.push((aggregate, payload["n"].as_u64().unwrap()));
    }
    let violations = common::order_violations(&order);
    assert!(violations.is_empty(), "{violations:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statuses_500_429_400_200_are_retried_waited_buried_and_delivered_429_costing_no_attempt() {
    let (receiver, addr) = start(Box::new(|path, attempt| {
        let agg = path.rsplit('/').next().unwrap_or("");
        match (agg, attempt) {
            ("fail500", 1) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                vec![],
                "database is on fire".into(),
            ),
            ("busy429", 1) => (
                StatusCode::TOO_MANY_REQUESTS,
                vec![("retry-after", "2".into())],
                "slow down".into(),
            ),
            ("date429", 1) => (
                StatusCode::TOO_MANY_REQUESTS,
                vec![(
                    "retry-after",
                    httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3)),
                )],
                String::new(),
            ),
            ("bad400", _) => (
                StatusCode::BAD_REQUEST,
                vec![],
                format!(
                    "invalid order: {}",
                    "field `amount` must be positive. ".repeat(200)
                ),
            ),
            _ => (StatusCode::OK, vec![], "thanks".into()),
        }
    }))
    .await;
    let store = Arc::new(common::fresh_store().await);
    let ids = common::enqueue_committed(
        &store,
        &[
            numbered("fail500", 0),
            numbered("busy429", 0),
            numbered("date429", 0),
            numbered("bad400", 0),
            numbered("ok200", 0),
        ],
    )
    .await;
    let sink = WebhookSink::connect(config(serde_json::json!({
        "url": format!("http://{addr}/hooks/${{aggregate_id}}"),
    })))
    .unwrap();
    let (_, stop, run) = common::spawn_relay(&store, Arc::new(sink), relay_config(false));
    common::wait_for_stats(&store, Duration::from_secs(30), "all settled", |s| {
        s.delivered == 4 && s.dead == 1
    })
    .await;
    let _ = stop.send(());
    let report = run.await.unwrap();
    assert_eq!(report.retried, 1, "500 failed once: {report:?}");
    assert_eq!(
        report.unavailable, 2,
        "both 429s: the receiver not serving, not retries: {report:?}"
    );
    for id in [ids[1], ids[2]] {
        let record = store.get(id).await.unwrap().unwrap();
        assert_eq!(record.state, EventState::Delivered);
        assert!(
            record.event.attempts == 0,
            "a 429 costs no attempt: {record:?}"
        );
    }
    assert_eq!(report.dead, 1, "{report:?}");

    // 500: retried, then delivered.
    let fail = receiver.on("hooks/fail500");
    assert_eq!(fail.len(), 2);
    let record = store.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Delivered);
    assert_eq!(record.event.attempts, 1);
    assert!(
        record
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("database is on fire")
            || record.last_error.is_none(),
        "{record:?}"
    );

    // 429 with `Retry-After: 2`: the next attempt came no sooner.
    let busy = receiver.on("hooks/busy429");
    assert_eq!(busy.len(), 2);
    let gap = busy[1].at - busy[0].at;
    assert!(gap >= Duration::from_millis(1900), "retried after {gap:?}");
    // 429 with an HTTP date ~3 s ahead (1 s resolution): at least ~2 s.
    let dated = receiver.on("hooks/date429");
    assert_eq!(dated.len(), 2);
    let gap = dated[1].at - dated[0].at;
    assert!(gap >= Duration::from_millis(1900), "retried after {gap:?}");

    // 400: dead after one attempt, with the response body (cut) as the reason.
    assert_eq!(receiver.on("hooks/bad400").len(), 1);
    let record = store.get(ids[3]).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Dead);
    let error = record.last_error.unwrap_or_default();
    assert!(error.contains("400"), "{error}");
    assert!(error.contains("invalid order"), "{error}");
    assert!(
        error.len() <= outbox_types::MAX_LAST_ERROR_LEN,
        "{}",
        error.len()
    );

    // 200: delivered once.
    assert_eq!(receiver.on("hooks/ok200").len(), 1);
    assert_eq!(
        store.get(ids[4]).await.unwrap().unwrap().state,
        EventState::Delivered
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_receiver_keeps_events_pending_until_it_is_back() {
    // A closed port: refused at once, unavailable with a clear reason.
    let closed = common::closed_addr();
    let outcome =
        common::publish_one(format!("http://{closed}/hooks"), common::event("x", 1)).await;
    let reason = common::unavailability(&outcome);
    assert!(reason.contains("cannot connect"), "{reason}");

    // A receiver behind a proxy that is cut at start-up, restored later.
    let (receiver, addr) = start(Box::new(|_, _| (StatusCode::OK, vec![], String::new()))).await;
    let proxy = common::cut_proxy(addr).await;
    let store = Arc::new(common::fresh_store().await);
    let events: Vec<_> = (0..30u64)
        .map(|i| numbered(&format!("a{}", i % 5), i / 5))
        .collect();
    let ids = common::enqueue_committed(&store, &events).await;
    let sink = WebhookSink::connect(config(serde_json::json!({
        "url": format!("http://{}/hooks/${{aggregate_id}}", proxy.addr()),
        "request_timeout": "1s",
    })))
    .unwrap();
    // Three attempts with at most 300 ms between them: an outage of a few seconds would have
    // dead-lettered everything if it cost attempts.
    let (counters, stop, run) = common::spawn_relay(
        &store,
        Arc::new(sink),
        RelayConfig {
            retry: RetryPolicy {
                max_attempts: 3,
                ..relay_config(false).retry
            },
            ..relay_config(false)
        },
    );

    let record =
        common::wait_until_failed_and_pending(&store, ids[0], "pending after failed calls").await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        counters.report().unavailable >= 3,
        "{:?}",
        counters.report()
    );
    common::assert_no_attempt_spent(&store, record.event.id, &[&proxy.addr().to_string()]).await;
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.delivered + stats.dead, 0, "{stats:?}");
    assert!(receiver.requests().is_empty());

    common::restore_until_delivered(&store, &proxy, 30, "delivery after the outage").await;
    common::stop_with_no_dead(stop, run).await;
    let got: HashSet<String> = receiver
        .requests()
        .iter()
        .map(|r| header(r, "outbox-event-id").unwrap())
        .collect();
    let want: HashSet<String> = ids.iter().map(|i| i.to_string()).collect();
    assert_eq!(got, want);
}
