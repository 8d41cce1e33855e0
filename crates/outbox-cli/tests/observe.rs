//! The relay's operator endpoints: metrics move as events flow, readiness follows the database.

mod common;

use common::{Killed, pg_url};
use std::time::{Duration, Instant};

use outbox_testkit::TcpProxy;
use outbox_types::NewEvent;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_and_readiness_follows_the_database() {
    let schema = format!("outbox_t_obs_{}", std::process::id());
    let store = common::migrated_store(&pg_url(), &schema).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap())
        .await
        .unwrap();
    let via_proxy = pg_url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let _relay = Killed(
        common::background(
            &[
                "relay",
                "--database-url",
                &via_proxy,
                "--schema",
                &schema,
                "--poll-interval",
                "20ms",
            ],
            "warn",
        )
        .args([
            "--sink",
            &format!("file:{}", dir.path().join("out.jsonl").display()),
        ])
        .args(["--metrics-listen", &format!("127.0.0.1:{port}")])
        .env("OUTBOX_METRICS__REFRESH", "200ms")
        .spawn()
        .unwrap(),
    );
    let deadline = endpoint_up(port).await;
    assert_eq!(get(port, "/healthz").await.unwrap().0, 200);
    assert_eq!(get(port, "/readyz").await.unwrap().0, 200);

    let events: Vec<NewEvent> = (0..250)
        .map(|i| outbox_testkit::numbered(&format!("m{}", i % 10), i / 10))
        .collect();
    enqueue_committed!(store, &events);
    let body = metrics_until(
        port,
        deadline,
        "delivered counter never reached 250",
        |body| metric(body, "outbox_events_delivered_total") >= 250.0,
    )
    .await;
    common::assert_contains(&body, "outbox_publish_duration_seconds");
    common::assert_contains(&body, "outbox_claim_batch_size");
    common::assert_contains(&body, "outbox_events_pending");
    // The deprecated name counts the same acks.
    assert_eq!(
        metric(&body, "outbox_events_published_total"),
        metric(&body, "outbox_events_delivered_total"),
        "{body}"
    );
    // The counter moves when the sink answers; the ack is written when the batch ends.
    common::stats_until(
        &store,
        deadline.saturating_duration_since(Instant::now()),
        "acks written",
        |stats| stats.delivered >= 250,
    )
    .await;

    proxy.cut();
    // The answer is worked out at most once a second: the cut shows within about that.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (status, body) = loop {
        let (status, body) = get(port, "/readyz").await.unwrap();
        if status == 503 || Instant::now() > deadline {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status, 503, "{body}");
    common::assert_contains(&body, "database not ready");
    assert!(!body.contains("127.0.0.1"), "no error text: {body}");
    proxy.restore();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if get(port, "/readyz").await.map(|r| r.0) == Some(200) {
            break;
        }
        assert!(Instant::now() < deadline, "readiness did not come back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Wait (up to 30 s) for the relay's metrics endpoint to answer; that deadline, for the waits
/// that follow.
async fn endpoint_up(port: u16) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(port, "/healthz").await.is_none() {
        assert!(Instant::now() < deadline, "metrics endpoint never came up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    deadline
}

/// Read `/metrics` every 100 ms until `settled` holds for the body, and return that body;
/// past `deadline` the test fails with `never` and the last body.
async fn metrics_until(
    port: u16,
    deadline: Instant,
    never: &str,
    settled: impl Fn(&str) -> bool,
) -> String {
    loop {
        let (_, body) = get(port, "/metrics").await.unwrap();
        if settled(&body) {
            return body;
        }
        assert!(Instant::now() < deadline, "{never}: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn metric_with(body: &str, name: &str, label: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(name) && l.contains(label) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Per-destination counters and gauges move with what happens to each destination's events:
/// published on one, failed → retried → delivered and a rejected one dead on another; pausing
/// shows in the gauge; a destination whose broker is unreachable leaves `/readyz` ready and shows
/// in `/destinations`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_destination_metrics_and_sink_readiness() {
    use axum::extract::State;
    use axum::http::StatusCode;
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<HashSet<String>>>);
    async fn hook(State(seen): State<Seen>, headers: axum::http::HeaderMap) -> StatusCode {
        let id = headers["outbox-event-id"].to_str().unwrap().to_owned();
        if headers["outbox-event-type"] == "Poison" {
            return StatusCode::BAD_REQUEST;
        }
        // Every event fails once, then goes through.
        if seen.0.lock().unwrap().insert(id) {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::OK
        }
    }
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(hook))
        .with_state(Seen::default());
    let hook_port = common::serve(app).await;

    let schema = format!("outbox_t_obs2_{}", std::process::id());
    let store = common::migrated_store(&pg_url(), &schema).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let dead_nats = free_port();
    let config = dir.path().join("outbox.toml");
    let write = |with_nats: bool| {
        std::fs::write(
            &config,
            format!(
                r#"
{database}[relay]
poll_interval = "20ms"
[relay.retry]
base = "50ms"
cap = "100ms"
max_attempts = 5
[metrics]
listen = "127.0.0.1:{port}"
refresh = "100ms"
[destinations.ok]
type = "file"
path = "{out}"
[destinations.hook]
type = "webhook"
url = "http://127.0.0.1:{hook_port}/hook"
{nats}
[[routes]]
when = {{ aggregate_type = "partner" }}
to = "hook"
[[routes]]
to = "ok"
"#,
                database = common::pg_database(&schema),
                out = dir.path().join("out.jsonl").display(),
                nats = if with_nats {
                    format!(
                        "[destinations.nats]\ntype = \"nats\"\nservers = [\"nats://127.0.0.1:{dead_nats}\"]\nconnect_timeout = \"200ms\"\n[[routes]]\nwhen = {{ aggregate_type = \"signal\" }}\nto = \"nats\"\n"
                    )
                } else {
                    String::new()
                }
            ),
        )
        .unwrap();
    };
    write(false);
    let relay = common::spawn_relay(&config, "warn");
    let deadline = endpoint_up(port).await;
    let mut events: Vec<NewEvent> = (0..40)
        .map(|i| outbox_testkit::numbered(&format!("o{}", i % 4), i / 4))
        .collect();
    for n in 0..6u32 {
        events.push(
            NewEvent::new(
                "partner",
                format!("p{n}"),
                "PartnerPinged",
                &serde_json::json!({ "n": n }),
            )
            .unwrap(),
        );
    }
    events.push(NewEvent::new("partner", "px", "Poison", &serde_json::json!({})).unwrap());
    enqueue_committed!(store, &events);

    let ok = "destination=\"ok\"";
    let hook_label = "destination=\"hook\"";
    let body = metrics_until(port, deadline, "metrics never settled", |body| {
        metric_with(body, "outbox_events_delivered_total", ok) >= 40.0
            && metric_with(body, "outbox_events_delivered_total", hook_label) >= 6.0
            && metric_with(body, "outbox_destination_events_dead", hook_label) >= 1.0
    })
    .await;
    // (metric, label, value, why)
    let expected = [
        ("outbox_events_delivered_total", ok, 40.0, ""),
        ("outbox_events_failed_total", ok, 0.0, ""),
        ("outbox_events_delivered_total", hook_label, 6.0, ""),
        (
            "outbox_events_failed_total",
            hook_label,
            7.0,
            "6 × 503 + the 400: ",
        ),
        (
            "outbox_events_unavailable_total",
            hook_label,
            6.0,
            "503 is the receiver not serving, not a failed attempt: ",
        ),
        ("outbox_events_retried_total", hook_label, 0.0, ""),
        ("outbox_events_dead_total", hook_label, 1.0, ""),
        ("outbox_destination_events_dead", hook_label, 1.0, ""),
        ("outbox_destination_events_pending", ok, 0.0, ""),
    ];
    for (metric, label, value, why) in expected {
        assert_eq!(
            metric_with(&body, metric, label),
            value,
            "{metric}{{{label}}}: {why}{body}"
        );
    }
    assert!(
        body.contains("outbox_relay_batch_duration_seconds"),
        "{body}"
    );
    assert!(
        body.contains("outbox_publish_duration_seconds_bucket{destination=\"hook\""),
        "{body}"
    );

    let config_arg = config.to_str().unwrap();
    let o = common::outbox(&["pause", "hook", "--config", config_arg]);
    assert!(o.status.success());
    let body = metrics_until(port, deadline, "paused gauge never moved", |body| {
        metric_with(body, "outbox_destination_paused", hook_label) == 1.0
    })
    .await;
    assert_eq!(
        metric_with(&body, "outbox_destination_paused", ok),
        0.0,
        "{body}"
    );
    drop(relay);

    // A destination whose broker is unreachable: the relay is ready (restarting it would not
    // help), and `/destinations` says which one is unreachable.
    write(true);
    let port2 = free_port();
    let _relay = Killed(
        common::relay_command(&config, "warn")
            .env("OUTBOX_METRICS__LISTEN", format!("127.0.0.1:{port2}"))
            .spawn()
            .unwrap(),
    );
    let deadline = endpoint_up(port2).await;
    let (status, body) = get(port2, "/readyz").await.unwrap();
    assert_eq!(status, 200, "{body}");
    // The relay's view is there once the relay is built, right after the endpoint starts.
    let (body, json) = loop {
        let (status, body) = get(port2, "/destinations").await.unwrap();
        assert_eq!(status, 200, "{body}");
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        if json["destinations"]
            .as_array()
            .is_some_and(|d| !d.is_empty())
        {
            break (body, json);
        }
        assert!(Instant::now() < deadline, "no destinations: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let reachable = |name: &str| common::destination(&json, name).map(|d| d["reachable"].clone());
    assert_eq!(reachable("nats"), Some(serde_json::json!(false)), "{body}");
    assert_eq!(reachable("ok"), Some(serde_json::json!(true)), "{body}");

    // An event for it: the relay finds it down, the event waits without an attempt, and
    // `outbox status` shows the destination down since when, with the error the event keeps.
    let mut tx = store.pool().begin().await.unwrap();
    store
        .outbox()
        .enqueue(
            &mut *tx,
            &NewEvent::new("signal", "s1", "Signalled", &serde_json::json!({})).unwrap(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let status = |relay: &str| {
        let o = common::outbox(&["status", "--json", "--relay", relay, "--config", config_arg]);
        common::assert_succeeded(&o, "outbox status");
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let relay_url = format!("http://127.0.0.1:{port2}");
    let nats = loop {
        let json = status(&relay_url);
        let nats = common::destination(&json, "nats").cloned();
        if let Some(nats) = nats
            && nats["up"] == false
            && !nats["last_error"].is_null()
        {
            assert_eq!(json["relay"]["answered"], true, "{json}");
            break nats;
        }
        assert!(Instant::now() < deadline, "nats never shown down: {json}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(nats["down_since"].is_string(), "{nats}");
    assert_eq!(
        nats["pending"].as_u64().unwrap() + nats["in_flight"].as_u64().unwrap(),
        1,
        "waiting, or out on a probe: {nats}"
    );
    assert_eq!(nats["dead"], 0, "{nats}");
    // No relay at that address: the status still answers from the database, and says so.
    let json = status(&format!("http://127.0.0.1:{}", free_port()));
    assert_eq!(json["relay"]["answered"], false, "{json}");
    let nats = common::destination(&json, "nats").unwrap();
    assert!(nats["up"].is_null(), "unknown, not guessed: {nats}");
    assert!(!nats["last_error"].is_null(), "{nats}");
    // The table form names the state and the error.
    let o = common::outbox(&["status", "--relay", &relay_url, "--config", config_arg]);
    let text = String::from_utf8_lossy(&o.stdout);
    common::assert_contains(&text, "DOWN for");
    common::assert_contains(&text, "last error  nats:");
    let attempts: i32 = common::pg_value(
        store.pool(),
        format!("SELECT max(attempts) FROM \"{schema}\".events WHERE aggregate_type = 'signal'"),
    )
    .await;
    assert_eq!(attempts, 0, "an outage costs no attempt");
}
