//! What a row cannot make the webhook sink do, against real HTTP listeners on 127.0.0.1 (and the
//! real PostgreSQL outbox for the end-to-end case): send the sink's `Authorization` and signature
//! to a host nobody configured (the listener there sees no connection at all), climb out of the
//! template's path with `..` or `?`, or put URL credentials into `last_error`. And what it can
//! do: name a path under the configured origin, or a host in `allowed_hosts`; Standard Webhooks
//! signatures that an independent HMAC check accepts.

mod common;

use common::{config, rejection, unix_now};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{OriginalUri, State};
use axum::http::{HeaderMap, StatusCode};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};
use outbox_engine::RelayConfig;
use outbox_sink_webhook::{WebhookSink, standard_webhooks_key, verify_standard_webhook};
use outbox_testkit::numbered;
use outbox_types::{Event, EventState, Outcome, RetryPolicy, Sink, Store};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "tok-only-for-the-configured-origin";
const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

#[derive(Clone, Debug)]
struct Recorded {
    /// The request target exactly as sent (path and query, still percent-encoded).
    uri: String,
    headers: HeaderMap,
    body: Bytes,
}

/// An HTTP receiver answering 200 to every POST, recording each request.
#[derive(Default)]
struct Receiver {
    requests: Mutex<Vec<Recorded>>,
}

impl Receiver {
    fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    /// The one request received, which went to `uri` with the sink's bearer token.
    #[track_caller]
    fn only_request_with_token(&self, uri: &str) -> Recorded {
        let mut requests = self.requests();
        assert_eq!(requests.len(), 1);
        let request = requests.remove(0);
        assert_eq!(request.uri, uri);
        assert_eq!(
            header(&request, "authorization"),
            Some(format!("Bearer {TOKEN}"))
        );
        request
    }
}

async fn record(
    State(receiver): State<Arc<Receiver>>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    receiver.requests.lock().unwrap().push(Recorded {
        uri: uri.to_string(),
        headers,
        body,
    });
    StatusCode::OK
}

async fn start_receiver() -> (Arc<Receiver>, std::net::SocketAddr) {
    let receiver = Arc::new(Receiver::default());
    let app = Router::new().fallback(record).with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (receiver, addr)
}

/// A receiver, and a sink whose `url` is `http://{receiver}{path}` with `settings` added: how
/// most tests here begin.
async fn sink_to_receiver(
    path: &str,
    mut settings: serde_json::Value,
) -> (Arc<Receiver>, std::net::SocketAddr, WebhookSink) {
    let (receiver, addr) = start_receiver().await;
    settings["url"] = format!("http://{addr}{path}").into();
    (
        receiver,
        addr,
        WebhookSink::connect(config(settings)).unwrap(),
    )
}

/// A plain TCP listener standing for an internal service or an attacker's collector: counts
/// connections and keeps every byte it was sent (it answers `200` so a request that does reach
/// it completes, and is recorded before the sink's call returns).
#[derive(Default)]
struct Trap {
    connections: AtomicUsize,
    bytes: Mutex<Vec<u8>>,
}

async fn start_trap() -> (Arc<Trap>, std::net::SocketAddr) {
    let trap = Arc::new(Trap::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let t = trap.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            t.connections.fetch_add(1, Ordering::SeqCst);
            let t = t.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut seen = Vec::new();
                while let Ok(Ok(n)) =
                    tokio::time::timeout(Duration::from_millis(200), socket.read(&mut buf)).await
                {
                    if n == 0 {
                        break;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    t.bytes.lock().unwrap().extend_from_slice(&buf[..n]);
                    if seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let _ = socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    (trap, addr)
}

/// A sink holding both credentials (the bearer token and the signing secret) that sends to a
/// receiver under `path`, and a trap that must never see them: how the tests of where a row's
/// destination may send begin.
async fn signed_sink_and_trap(
    path: &str,
) -> (
    Arc<Receiver>,
    std::net::SocketAddr,
    WebhookSink,
    Arc<Trap>,
    std::net::SocketAddr,
) {
    let (receiver, addr, sink) = sink_to_receiver(
        path,
        serde_json::json!({ "bearer_token": TOKEN, "secret": SECRET }),
    )
    .await;
    let (trap, trap_addr) = start_trap().await;
    (receiver, addr, sink, trap, trap_addr)
}

impl Trap {
    fn assert_untouched(&self) {
        let bytes = String::from_utf8_lossy(&self.bytes.lock().unwrap()).to_lowercase();
        assert!(
            !bytes.contains("authorization")
                && !bytes.contains(&TOKEN.to_lowercase())
                && !bytes.contains("x-outbox-signature")
                && !bytes.contains("webhook-signature"),
            "credentials reached the trap: {bytes}"
        );
        assert_eq!(
            self.connections.load(Ordering::SeqCst),
            0,
            "the trap was connected to; it received: {bytes}"
        );
    }
}

fn header(r: &Recorded, name: &str) -> Option<String> {
    r.headers.get(name).map(|v| v.to_str().unwrap().to_owned())
}

fn with_destination(mut event: Event, destination: &str) -> Event {
    event.destination = Some(destination.to_owned());
    event
}

/// Issue 22 item 1, end to end: rows whose destination column names another local listener
/// (in several spellings) are dead with a reason naming the host and `allowed_hosts`; that
/// listener sees no connection, so no `Authorization` and no signature; the row without a
/// destination is delivered to the configured receiver with both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_cannot_send_the_credentials_to_a_host_nobody_configured() {
    let (receiver, addr, sink, trap, trap_addr) =
        signed_sink_and_trap("/hooks/${aggregate_id}").await;
    let store = Arc::new(common::fresh_store().await);
    let port = trap_addr.port();
    let hostile = [
        format!("http://127.0.0.1:{port}/steal"),
        format!("http://localhost:{port}/steal"),
        format!("HTTP://127.0.0.1:{port}/steal"),
        format!("http:/127.0.0.1:{port}/steal"),
        format!("http://{addr}@127.0.0.1:{port}/steal"),
        format!(
            "http://{}:{port}/steal",
            u32::from(std::net::Ipv4Addr::LOCALHOST)
        ),
    ];
    let mut events = vec![numbered("plain", 0)];
    for (i, destination) in hostile.iter().enumerate() {
        events.push(numbered(&format!("hostile{i}"), 0).with_destination(destination.clone()));
    }
    let ids = common::enqueue_committed(&store, &events).await;
    let relay_config = RelayConfig {
        relay_id: "webhook-security".into(),
        poll_interval: Duration::from_millis(20),
        retry: RetryPolicy {
            base: Duration::from_millis(50),
            cap: Duration::from_millis(100),
            max_attempts: 3,
        },
        stop_when_idle: true,
        ..RelayConfig::default()
    };
    let report = common::run_to_idle(&store, sink, relay_config).await;
    assert_eq!(report.delivered, 1, "{report:?}");
    assert_eq!(report.dead, hostile.len() as u64, "{report:?}");

    trap.assert_untouched();
    for (id, destination) in ids[1..].iter().zip(&hostile) {
        let record = store.get(*id).await.unwrap().unwrap();
        assert_eq!(record.state, EventState::Dead, "{destination}");
        let error = record.last_error.unwrap_or_default();
        assert!(
            error.contains(&format!(":{port}`")) && error.contains("allowed_hosts"),
            "{destination}: {error}"
        );
    }
    let request = receiver.only_request_with_token("/hooks/plain");
    assert!(header(&request, "x-outbox-signature").is_some());
}

/// A destination column that is a path (with a query) or a URL on the configured origin goes
/// there, with the credentials; another scheme or a bare name is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_destination_goes_to_the_configured_origin_with_the_credentials() {
    let (receiver, addr, sink, trap, trap_addr) =
        signed_sink_and_trap("/hooks/${event_type}").await;
    let events = [
        with_destination(common::event("a", 0), "/audit/special?tenant=7"),
        with_destination(
            common::event("b", 0),
            &format!("http://{addr}/absolute/same-origin"),
        ),
        with_destination(common::event("c", 0), "audit.events"),
        with_destination(common::event("d", 0), &format!("ftp://{trap_addr}/x")),
        with_destination(common::event("e", 0), "/a/%2E%2e/admin"),
        with_destination(common::event("f", 0), &format!("http://u:p@{addr}/x")),
    ];
    let outcomes = sink.publish(&events).await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert_eq!(outcomes[1], Outcome::Delivered);
    assert!(rejection(&outcomes[2]).contains("path starting with `/`"));
    assert!(rejection(&outcomes[3]).contains("path starting with `/`"));
    assert!(rejection(&outcomes[4]).contains("dot segment"));
    assert!(rejection(&outcomes[5]).contains("user info"));
    trap.assert_untouched();

    let mut uris: Vec<_> = receiver.requests().iter().map(|r| r.uri.clone()).collect();
    uris.sort();
    assert_eq!(uris, ["/absolute/same-origin", "/audit/special?tenant=7"]);
    for r in receiver.requests() {
        assert_eq!(header(&r, "authorization"), Some(format!("Bearer {TOKEN}")));
        let signature = header(&r, "x-outbox-signature").expect("signed");
        common::assert_signed_now(SECRET, &signature, &r.body);
    }
}

/// A host in `allowed_hosts` is the operator's own: it gets the request and the credentials.
/// The same host on another port, and any other host, get nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_host_gets_the_request_and_the_credentials_others_get_nothing() {
    let (partner, partner_addr) = start_receiver().await;
    let (configured, _, sink) = sink_to_receiver(
        "/hooks",
        serde_json::json!({
            "allowed_hosts": [format!("127.0.0.1:{}", partner_addr.port()), "*.example.invalid"],
            "bearer_token": TOKEN,
        }),
    )
    .await;
    let (trap, trap_addr) = start_trap().await;
    let events = [
        with_destination(
            common::event("a", 0),
            &format!("http://{partner_addr}/partner/in?x=1"),
        ),
        with_destination(common::event("b", 0), &format!("http://{trap_addr}/steal")),
        with_destination(
            common::event("c", 0),
            &format!("http://localhost:{}/steal", trap_addr.port()),
        ),
    ];
    let outcomes = sink.publish(&events).await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    for outcome in &outcomes[1..] {
        let reason = rejection(outcome);
        assert!(
            reason.contains(&format!(":{}`", trap_addr.port()))
                && reason.contains("not the configured origin")
                && reason.contains("allowed_hosts"),
            "{reason}"
        );
    }
    trap.assert_untouched();
    assert!(configured.requests().is_empty());
    partner.only_request_with_token("/partner/in?x=1");
}

/// Issue 22 item 7: an `aggregate_id` of `../../admin?debug=1#` stays one encoded path segment;
/// a value that is exactly `..` is rejected; nothing reaches `/admin`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_values_are_percent_encoded_and_cannot_leave_their_segment() {
    let (receiver, _, sink) = sink_to_receiver(
        "/orders/${aggregate_id}/events",
        serde_json::json!({ "bearer_token": TOKEN }),
    )
    .await;
    let events = [
        common::event("../../admin?debug=1#", 0),
        common::event("..", 0),
        common::event("%2e%2e", 0),
        common::event("a b/ü", 0),
    ];
    let outcomes = sink.publish(&events).await;
    let mut uris: Vec<_> = receiver.requests().iter().map(|r| r.uri.clone()).collect();
    uris.sort();
    assert!(!uris.iter().any(|u| u.starts_with("/admin")), "{uris:?}");
    assert_eq!(outcomes[0], Outcome::Delivered);
    let reason = rejection(&outcomes[1]);
    assert!(reason.contains("dot segment"), "{reason}");
    assert_eq!(outcomes[2], Outcome::Delivered);
    assert_eq!(outcomes[3], Outcome::Delivered);
    assert_eq!(
        uris,
        [
            "/orders/%252e%252e/events",
            "/orders/..%2F..%2Fadmin%3Fdebug%3D1%23/events",
            "/orders/a%20b%2F%C3%BC/events",
        ]
    );
}

/// `signature_scheme = "standard-webhooks"`: the request the sink really sent carries
/// `webhook-id` (the event id), `webhook-timestamp` and `webhook-signature`, which both an HMAC
/// computed here from the spec's definition and `verify_standard_webhook` accept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_webhooks_requests_verify_independently() {
    let (receiver, _, sink) = sink_to_receiver(
        "/hooks",
        serde_json::json!({ "secret": SECRET, "signature_scheme": "standard-webhooks" }),
    )
    .await;
    let mut event = common::event("a", 1);
    event.headers.insert("webhook-id".into(), "forged".into());
    event
        .headers
        .insert("webhook-signature".into(), "v1,forged".into());
    let outcomes = sink.publish(std::slice::from_ref(&event)).await;
    assert_eq!(outcomes, [Outcome::Delivered]);
    let requests = receiver.requests();
    let r = &requests[0];
    let id = header(r, "webhook-id").expect("webhook-id");
    assert_eq!(id, event.id.to_string());
    assert_eq!(r.headers.get_all("webhook-id").iter().count(), 1);
    let timestamp = header(r, "webhook-timestamp").expect("webhook-timestamp");
    let signature = header(r, "webhook-signature").expect("webhook-signature");
    assert!(header(r, "x-outbox-signature").is_none());
    assert!(unix_now().abs_diff(timestamp.parse().unwrap()) < 60);

    // Independent check, from the spec: key = base64 of what follows `whsec_`, signed content
    // = "{id}.{timestamp}.{body}", header = "v1," + base64(HMAC-SHA256).
    let key = BASE64.decode(SECRET.trim_start_matches("whsec_")).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(&r.body);
    let expected = format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()));
    assert_eq!(signature, expected);

    let key = standard_webhooks_key(SECRET).unwrap();
    let tolerance = Duration::from_secs(300);
    verify_standard_webhook(
        &key,
        &id,
        &timestamp,
        &signature,
        &r.body,
        unix_now(),
        tolerance,
    )
    .unwrap();
    assert!(
        verify_standard_webhook(
            &key,
            "other-id",
            &timestamp,
            &signature,
            &r.body,
            unix_now(),
            tolerance
        )
        .is_err()
    );
}

/// A URL with user info in the configuration never reaches `last_error` with its password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasons_show_urls_without_their_credentials() {
    let closed = common::closed_addr();
    let outcome = common::publish_one(
        format!("http://hook-user:pw-in-url@{closed}/hooks?token=query-token"),
        common::event("x", 1),
    )
    .await;
    let reason = common::unavailability(&outcome);
    assert!(reason.contains("cannot connect"), "{reason}");
    assert!(reason.contains("hook-user:***@"), "{reason}");
    assert!(
        !reason.contains("pw-in-url") && !reason.contains("query-token"),
        "{reason}"
    );

    // A rejected row destination is shown redacted too.
    let (_receiver, addr) = start_receiver().await;
    let event = with_destination(
        common::event("x", 1),
        "http://row-user:row-pw@elsewhere.invalid/x?sig=row-sig",
    );
    let outcome = common::publish_one(format!("http://{addr}/hooks"), event).await;
    let reason = rejection(&outcome);
    assert!(
        !reason.contains("row-pw") && !reason.contains("row-sig"),
        "{reason}"
    );
}

/// Every header name of a recorded request, with its values, in the receiver's (lower) case.
fn header_pairs(r: &Recorded) -> Vec<(String, String)> {
    r.headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect()
}

/// An event whose own headers try to ride on the authenticated request: a cookie, client
/// addresses, a method override, a credential of their own, headers that make it conditional or
/// encoded, a signature header; beside two ordinary ones.
fn event_with_hostile_headers() -> Event {
    let mut event = common::event("a", 1);
    for (name, value) in [
        ("Cookie", "session=attacker"),
        ("X-Forwarded-For", "10.0.0.1"),
        ("X-Forwarded-Host", "admin.internal"),
        ("Forwarded", "for=10.0.0.1;host=admin.internal"),
        ("X-Real-IP", "10.0.0.1"),
        ("X-HTTP-Method-Override", "DELETE"),
        ("X-Method-Override", "DELETE"),
        ("Proxy-Authorization", "Basic eDp5"),
        ("Proxy-Foo", "x"),
        ("X-Api-Key", "attackers-key"),
        ("X-Auth-Token", "attackers-token"),
        ("Content-Encoding", "gzip"),
        ("If-Match", "\"x\""),
        ("Range", "bytes=0-1"),
        ("Webhook-Version", "2"),
        ("X-Hub-Signature-256", "sha256=forged"),
        ("User-Agent", "forged"),
        ("x-tenant", "acme"),
    ] {
        event.headers.insert(name.into(), value.into());
    }
    event
}

/// Row headers such as `Cookie`, `X-Forwarded-For` or `X-HTTP-Method-Override` never ride on
/// the authenticated request; ordinary ones (`traceparent`, `x-tenant`) do, and the event is
/// delivered (a denied header is dropped, not the event), with a debug line per drop.
#[tokio::test]
async fn denied_event_headers_are_dropped_and_the_event_is_delivered() {
    let (receiver, _, sink) =
        sink_to_receiver("/hooks", serde_json::json!({ "bearer_token": TOKEN })).await;
    let event = event_with_hostile_headers();
    let logs = outbox_testkit::LogBuffer::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    let outcomes = sink.publish(std::slice::from_ref(&event)).await;
    drop(guard);
    assert_eq!(outcomes, [Outcome::Delivered]);
    let r = receiver.only_request_with_token("/hooks");
    let names: Vec<String> = header_pairs(&r).into_iter().map(|(n, _)| n).collect();
    for denied in [
        "cookie",
        "x-forwarded-for",
        "x-forwarded-host",
        "forwarded",
        "x-real-ip",
        "x-http-method-override",
        "x-method-override",
        "proxy-authorization",
        "proxy-foo",
        "x-api-key",
        "x-auth-token",
        "content-encoding",
        "if-match",
        "range",
        "webhook-version",
        "x-hub-signature-256",
    ] {
        assert!(!names.iter().any(|n| n == denied), "{denied}: {names:?}");
    }
    assert_ne!(header(&r, "user-agent").as_deref(), Some("forged"));
    assert_eq!(header(&r, "x-tenant").as_deref(), Some("acme"));
    assert_eq!(
        header(&r, "traceparent"),
        event.headers.get("traceparent").cloned()
    );
    let text = logs.text();
    assert!(
        text.contains("Event header not forwarded") && text.contains("X-HTTP-Method-Override"),
        "{text}"
    );
}

/// `allowed_headers` forwards only the event headers it names (any case), may let a
/// default-denied one through for a receiver that needs it, never a reserved one; the relay's
/// own `outbox-*` headers always travel.
#[tokio::test]
async fn allowed_headers_is_the_list_of_event_headers_forwarded() {
    let (receiver, _, sink) = sink_to_receiver(
        "/hooks",
        serde_json::json!({ "allowed_headers": ["X-Tenant", "x-forwarded-for"] }),
    )
    .await;
    let event = event_with_hostile_headers();
    assert_eq!(
        sink.publish(std::slice::from_ref(&event)).await,
        [Outcome::Delivered]
    );
    let requests = receiver.requests();
    let r = &requests[0];
    assert_eq!(header(r, "x-tenant").as_deref(), Some("acme"));
    assert_eq!(header(r, "x-forwarded-for").as_deref(), Some("10.0.0.1"));
    assert!(header(r, "traceparent").is_none(), "not listed");
    assert!(header(r, "cookie").is_none());
    assert_eq!(
        header(r, "outbox-event-id"),
        Some(event.id.to_string()),
        "the relay's own headers always travel"
    );
    for reserved in [
        "Host",
        "authorization",
        "Content-Length",
        "webhook-signature",
        "X-Outbox-Signature",
    ] {
        let err = WebhookSink::connect(config(serde_json::json!({
            "url": "http://127.0.0.1:1/x",
            "allowed_headers": [reserved],
        })))
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("allowed_headers") && err.contains(reserved),
            "{reserved}: {err}"
        );
    }
}

/// A row's headers in the reserved prefix, in any case, never reach the receiver
/// (`Outbox-Tenant` would arrive as `outbox-tenant`, posing as one of the relay's).
#[tokio::test]
async fn forged_relay_headers_in_any_case_do_not_travel() {
    let (receiver, _, sink) = sink_to_receiver("/hooks", serde_json::json!({})).await;
    let event = common::with_forged_relay_headers(common::event("a", 1));
    assert_eq!(
        sink.publish(std::slice::from_ref(&event)).await,
        [Outcome::Delivered]
    );
    common::assert_no_forged_relay_headers(&event, &header_pairs(&receiver.requests()[0]));
}
