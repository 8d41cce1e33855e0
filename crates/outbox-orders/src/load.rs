//! A small load generator for the order service, over real HTTP: creates a given number of
//! orders, cancels about one in ten (and cancels some of those twice, to exercise idempotency),
//! sends a few invalid requests and a few that break the credit limit on top, reads orders back,
//! and asks for unknown ones.
//!
//! Every choice comes from a generator seeded with `(seed, request number)`, so a run with the
//! same seed makes the same requests (the interleaving between clients still varies). It
//! checks every answer's status and shape as it goes; an unexpected answer is recorded as a
//! violation (not an error that stops the run) and returned in [`LoadReport::unexpected`]. What
//! it saw — which orders exist, which are cancelled — is what [`crate::check`] compares the
//! databases with.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::Error;

/// What to send.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// Orders to create; the invalid and over-limit requests come on top. With `duration`
    /// set, the run ends at whichever comes first.
    pub orders: u64,
    /// Stop starting new requests after this long.
    pub duration: Option<Duration>,
    /// Concurrent clients.
    pub clients: usize,
    /// Orders per second across all clients (`None`: as fast as the service answers).
    pub rate: Option<f64>,
    /// Share of created orders that are cancelled.
    pub cancel_ratio: f64,
    /// Invalid requests (malformed JSON or a bad field) per order, on top of the orders.
    pub invalid_ratio: f64,
    /// Requests exceeding the credit limit (rolled back by the service) per order, on top.
    pub over_limit_ratio: f64,
    /// Seed of every choice.
    pub seed: u64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            orders: 300,
            duration: None,
            clients: 4,
            rate: None,
            cancel_ratio: 0.10,
            invalid_ratio: 0.05,
            over_limit_ratio: 0.02,
            seed: 1,
        }
    }
}

/// Live counts (read by the demo's summary while the load runs).
#[derive(Debug, Default)]
pub struct LoadCounters {
    /// Orders created (201).
    pub created: AtomicU64,
    /// Orders cancelled (first cancel, 200).
    pub cancelled: AtomicU64,
    /// Repeated cancels answered 200 without a new event.
    pub repeat_cancels: AtomicU64,
    /// Requests refused as invalid (400 / 422).
    pub rejected: AtomicU64,
    /// Orders refused by the credit limit (409) after being written and rolled back.
    pub declined: AtomicU64,
    /// Answers that were not what the API promises.
    pub unexpected: AtomicU64,
}

/// What the load generator saw, to compare with the databases.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Ids of orders answered 201.
    pub created: HashSet<Uuid>,
    /// Ids of orders whose first cancel answered 200 with status `cancelled`.
    pub cancelled: HashSet<Uuid>,
    /// Invalid requests refused.
    pub rejected: u64,
    /// Requests declined by the credit limit.
    pub declined: u64,
    /// Repeated cancels that answered 200.
    pub repeat_cancels: u64,
    /// Descriptions of unexpected answers (empty when the API kept every promise).
    pub unexpected: Vec<String>,
}

const PRODUCTS: [&str; 6] = [
    "keyboard",
    "monitor",
    "cable",
    "laptop stand",
    "webcam",
    "desk lamp",
];

/// Invalid bodies, each with the status and field the API must answer with: what the load
/// sends among its orders, and what the API's tests check (with more cases of their own).
pub const INVALID: [(&str, u16, Option<&str>); 8] = [
    (r#"{"product": "lamp", "quantity": }"#, 400, None),
    (r#"["lamp", 1]"#, 400, None),
    (
        r#"{"product": "lamp", "quantity": 0}"#,
        422,
        Some("quantity"),
    ),
    (
        r#"{"product": "lamp", "quantity": -3}"#,
        422,
        Some("quantity"),
    ),
    (r#"{"product": "lamp"}"#, 422, Some("quantity")),
    (r#"{"product": "", "quantity": 1}"#, 422, Some("product")),
    (
        r#"{"product": "lamp", "quantity": 1, "amount": -5}"#,
        422,
        Some("amount"),
    ),
    (
        r#"{"product": "lamp", "quantity": 1, "colour": "red"}"#,
        422,
        Some("colour"),
    ),
];

struct Shared {
    base: String,
    http: reqwest::Client,
    config: LoadConfig,
    counters: Arc<LoadCounters>,
    next: AtomicU64,
    started: Instant,
    report: Mutex<LoadReport>,
}

impl Shared {
    /// The report so far, locked (a client that panicked holding it leaves it readable).
    fn report(&self) -> std::sync::MutexGuard<'_, LoadReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Run the load against the service at `base` (e.g. `http://127.0.0.1:8080`) and return what
/// it saw. `counters` are updated live.
pub async fn run(
    base: &str,
    config: LoadConfig,
    counters: Arc<LoadCounters>,
) -> Result<LoadReport, Error> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(config.clients.max(1))
        .build()
        .map_err(|e| Error::Http(format!("cannot build the HTTP client: {e}")))?;
    let shared = Arc::new(Shared {
        base: base.trim_end_matches('/').to_owned(),
        http,
        counters,
        next: AtomicU64::new(0),
        started: Instant::now(),
        report: Mutex::new(LoadReport::default()),
        config,
    });
    let mut clients = JoinSet::new();
    for _ in 0..shared.config.clients.max(1) {
        let shared = shared.clone();
        clients.spawn(async move { client(&shared).await });
    }
    while let Some(done) = clients.join_next().await {
        done.map_err(|e| Error::Io(format!("load client task: {e}")))??;
    }
    let report = shared.report().clone();
    Ok(report)
}

async fn client(s: &Shared) -> Result<(), Error> {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= s.config.orders {
            return Ok(());
        }
        if let Some(d) = s.config.duration
            && s.started.elapsed() >= d
        {
            return Ok(());
        }
        if let Some(rate) = s.config.rate.filter(|r| *r > 0.0) {
            let due = s.started + Duration::from_secs_f64(i as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        one_request(s, i).await?;
    }
}

/// An answer: status and parsed JSON body (`Value::Null` when the body is not JSON).
async fn send(
    s: &Shared,
    method: reqwest::Method,
    path: &str,
    body: Option<String>,
) -> Result<(u16, Value), Error> {
    let mut request = s.http.request(method, format!("{}{path}", s.base));
    if let Some(body) = body {
        request = request
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
    }
    let response = request
        .send()
        .await
        .map_err(|e| Error::Http(format!("request to {path} failed: {e}")))?;
    let status = response.status().as_u16();
    let bytes = response
        .bytes()
        .await
        .map_err(|e| Error::Http(format!("reading the answer of {path} failed: {e}")))?;
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    ))
}

fn unexpected(s: &Shared, what: String) {
    s.counters.unexpected.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(problem = %what, "Unexpected answer from the order service.");
    s.report().unexpected.push(what);
}

/// The answers counted by number, both live (in [`LoadCounters`]) and in the [`LoadReport`].
#[derive(Clone, Copy)]
enum Tally {
    Rejected,
    Declined,
    RepeatCancel,
}

/// Count one answer under `tally`, live and in the report.
fn count(s: &Shared, tally: Tally) {
    let mut report = s.report();
    let (live, reported) = match tally {
        Tally::Rejected => (&s.counters.rejected, &mut report.rejected),
        Tally::Declined => (&s.counters.declined, &mut report.declined),
        Tally::RepeatCancel => (&s.counters.repeat_cancels, &mut report.repeat_cancels),
    };
    live.fetch_add(1, Ordering::Relaxed);
    *reported += 1;
}

/// Count an answer under `tally` when it is the one the API promises (`as_promised`); otherwise
/// record it as unexpected, described by `problem`.
fn expect(s: &Shared, as_promised: bool, tally: Tally, problem: impl FnOnce() -> String) {
    if as_promised {
        count(s, tally);
    } else {
        unexpected(s, problem());
    }
}

async fn one_request(s: &Shared, i: u64) -> Result<(), Error> {
    let mut rng = StdRng::seed_from_u64(s.config.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i);

    if rng.random_bool(s.config.invalid_ratio.clamp(0.0, 1.0)) {
        let (body, status, field) = INVALID[rng.random_range(0..INVALID.len())];
        let (got, answer) =
            send(s, reqwest::Method::POST, "/orders", Some(body.to_owned())).await?;
        let field_ok = match field {
            Some(f) => answer["field"] == f,
            None => true,
        };
        expect(
            s,
            got == status && answer["error"].is_string() && field_ok,
            Tally::Rejected,
            || format!("invalid body {body} answered {got} {answer}, expected {status}"),
        );
    }

    if rng.random_bool(s.config.over_limit_ratio.clamp(0.0, 1.0)) {
        let body = json!({
            "product": "grand piano",
            "quantity": 1,
            "customer": format!("whale-{i}"),
            "amount": 20_000.00,
        });
        let (got, answer) =
            send(s, reqwest::Method::POST, "/orders", Some(body.to_string())).await?;
        expect(
            s,
            got == 409 && answer["field"] == "amount",
            Tally::Declined,
            || format!("over-limit order answered {got} {answer}, expected 409"),
        );
    }

    let product = PRODUCTS[rng.random_range(0..PRODUCTS.len())];
    let quantity = rng.random_range(1..=5);
    let mut body = json!({"product": product, "quantity": quantity});
    if rng.random_bool(0.8) {
        body["customer"] = json!(format!("customer-{}", rng.random_range(0..97)));
    }
    if rng.random_bool(0.7) {
        body["amount"] = json!(rng.random_range(500..15_000) as f64 / 100.0);
    }
    let (got, answer) = send(s, reqwest::Method::POST, "/orders", Some(body.to_string())).await?;
    if got == 409 {
        // A regular customer reached the credit limit (long runs only): declined, rolled back.
        count(s, Tally::Declined);
        return Ok(());
    }
    let id = answer["id"]
        .as_str()
        .and_then(|id| Uuid::parse_str(id).ok());
    let Some(id) = id.filter(|_| got == 201 && answer["status"] == "created") else {
        unexpected(
            s,
            format!("order {body} answered {got} {answer}, expected 201"),
        );
        return Ok(());
    };
    s.counters.created.fetch_add(1, Ordering::Relaxed);
    s.report().created.insert(id);

    let (got, answer) = send(s, reqwest::Method::GET, &format!("/orders/{id}"), None).await?;
    if got != 200 || answer["id"] != id.to_string() {
        unexpected(s, format!("GET /orders/{id} answered {got} {answer}"));
    }
    if rng.random_bool(0.05) {
        let unknown = Uuid::now_v7();
        let (got, _) = send(s, reqwest::Method::GET, &format!("/orders/{unknown}"), None).await?;
        let (got_cancel, _) = send(
            s,
            reqwest::Method::POST,
            &format!("/orders/{unknown}/cancel"),
            None,
        )
        .await?;
        if got != 404 || got_cancel != 404 {
            unexpected(
                s,
                format!("unknown order answered {got} / {got_cancel}, expected 404"),
            );
        }
    }

    if rng.random_bool(s.config.cancel_ratio.clamp(0.0, 1.0)) {
        let path = format!("/orders/{id}/cancel");
        let (got, answer) = send(s, reqwest::Method::POST, &path, None).await?;
        if got == 200 && answer["status"] == "cancelled" {
            s.counters.cancelled.fetch_add(1, Ordering::Relaxed);
            s.report().cancelled.insert(id);
        } else {
            unexpected(
                s,
                format!("POST {path} answered {got} {answer}, expected 200"),
            );
            return Ok(());
        }
        if rng.random_bool(0.3) {
            let (got, answer) = send(s, reqwest::Method::POST, &path, None).await?;
            expect(
                s,
                got == 200 && answer["status"] == "cancelled",
                Tally::RepeatCancel,
                || format!("repeated POST {path} answered {got} {answer}, expected 200"),
            );
        }
    }
    Ok(())
}
