//! The relay's HTTP side for operators: Prometheus `/metrics`, `/healthz` (the process is up),
//! `/readyz` (the database answers with a current schema) and `/destinations` (JSON: each
//! destination up or down, since when, whether it is reachable now).
//!
//! `/readyz` does not depend on the destinations. A relay whose broker is down is doing its job
//! (the events wait in the database, in order, costing no attempt) and restarting it would not
//! bring the broker back; an orchestrator that restarts unready pods would only add restarts to
//! an outage. What is down shows in `/destinations`, in `outbox_destination_failing` and
//! `outbox_destination_down_since_seconds`, and in the relay's log (one line when an outage
//! starts, one when it ends).
//!
//! Counters and histograms are recorded by the relay engine through the `metrics` facade as it
//! works; the backlog gauges (pending, in flight, dead, oldest pending age) are refreshed from
//! the store on a timer, so a scrape never runs a query.
//!
//! ## Who can hold the port's sockets, and for how long
//!
//! The port is often bound to every interface (a container's probes come from outside it), so
//! anyone who reaches it may open connections and send nothing, or half a request. Each open
//! connection is a file descriptor of the relay, the same budget its database, broker and
//! webhook sockets come from (19,995 half-sent requests once took them all: `/healthz` stopped
//! answering and webhook deliveries failed with "Too many open files"). So the connections are
//! served with these bounds ([`HttpLimits`], from `[metrics]`):
//!
//! - **header timeout** (`metrics.header_timeout`, 5 s): a request's headers must be complete
//!   this long after the connection, or the previous response, is ready for them; otherwise the
//!   connection is closed. This bounds a slow or half-sent request and an idle keep-alive
//!   connection alike;
//! - **connection cap** (`metrics.max_connections`, 64) and a **per-address cap** (a quarter of
//!   it, at least one): a connection beyond either is answered `503` and closed at once, so the
//!   port never holds more than the cap in sockets, and one client (one address) cannot take the
//!   slots of the kubelet's probes or of the scraper;
//! - **lifetime** ([`MAX_CONNECTION_AGE`]): a connection is closed after a minute whatever it
//!   does (a client that never reads its response);
//! - **header size**: at most [`MAX_HEADER_BYTES`] of request headers are buffered.
//!
//! Many clients from many addresses can still fill the cap and make probes wait or fail; keep
//! the port on a network only the orchestrator and the scraper reach (a `NetworkPolicy`, see
//! `deploy/kubernetes/relay.yaml`), or on localhost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use outbox_types::route::RouteTable;
use outbox_types::{Sink, Store, StoreError};

use crate::config::ConfigError;

#[derive(Clone)]
struct Probe {
    metrics: PrometheusHandle,
    readiness: Arc<Readiness>,
    destinations: DestinationsView,
}

/// The relay's view of its destinations, set once the relay exists (the endpoint starts first).
pub type DestinationsView = Arc<std::sync::OnceLock<outbox_engine::Destinations>>;

/// The answers of `/readyz` and of `/destinations`' reachability, worked out at most once per
/// [`Readiness::FRESH_FOR`].
///
/// A check queries the database and asks every sink; done per request, anyone who can reach the
/// port could make the relay hammer its database and brokers (and concurrent probes would each
/// run their own). One check runs at a time, and its answer is served to every request for a
/// second. The body names what is not ready but never the error itself (which can quote hosts,
/// users or broker replies): that goes to the log.
pub struct Readiness {
    store: Arc<dyn Store>,
    sink: Arc<dyn Sink>,
    /// The database check's answer, separate from the sinks' so `/readyz` never waits for a
    /// broker that is down (a sink check can take its connect timeout).
    ready: Fresh<(StatusCode, String)>,
    /// The destinations the last sink check found unreachable.
    unreachable: Fresh<Vec<String>>,
}

/// An answer served for [`Readiness::FRESH_FOR`]; one check runs at a time, callers meanwhile
/// wait for it and share its answer.
struct Fresh<T>(tokio::sync::Mutex<Option<(std::time::Instant, T)>>);

impl<T: Clone> Fresh<T> {
    fn new() -> Self {
        Fresh(tokio::sync::Mutex::new(None))
    }

    async fn get_or_check<F: std::future::Future<Output = T>>(&self, check: F) -> T {
        let mut last = self.0.lock().await;
        if let Some((at, answer)) = last.as_ref()
            && at.elapsed() < Readiness::FRESH_FOR
        {
            return answer.clone();
        }
        let answer = check.await;
        *last = Some((std::time::Instant::now(), answer.clone()));
        answer
    }
}

impl Readiness {
    /// How long one answer is served.
    pub const FRESH_FOR: Duration = Duration::from_secs(1);

    /// Readiness of `store` and `sink`.
    pub fn new(store: Arc<dyn Store>, sink: Arc<dyn Sink>) -> Self {
        Readiness {
            store,
            sink,
            ready: Fresh::new(),
            unreachable: Fresh::new(),
        }
    }

    /// The status and body of `/readyz`: the database only (see the module docs).
    pub async fn answer(&self) -> (StatusCode, String) {
        self.ready.get_or_check(self.check_store()).await
    }

    async fn check_store(&self) -> (StatusCode, String) {
        match self.store.check().await {
            Err(error) => {
                tracing::warn!(%error, "Not ready: the database does not answer or its schema is not current.");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database not ready (see the relay's log)\n".to_owned(),
                )
            }
            Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        }
    }

    /// The destinations a sink check finds unreachable (the sink's name when it names none).
    pub async fn unreachable(&self) -> Vec<String> {
        self.unreachable.get_or_check(self.check_sinks()).await
    }

    async fn check_sinks(&self) -> Vec<String> {
        match self.sink.check().await {
            Ok(()) => Vec::new(),
            Err(error) => {
                let error = outbox_types::redact::redact_in_text(&error.to_string());
                tracing::debug!(sink = self.sink.name(), %error, "A destination is not reachable.");
                // The router names each failing destination as "destination `NAME`".
                let names: Vec<String> = error
                    .split("destination `")
                    .skip(1)
                    .filter_map(|rest| rest.split('`').next())
                    .map(str::to_owned)
                    .collect();
                if names.is_empty() {
                    vec![self.sink.name().to_owned()]
                } else {
                    names
                }
            }
        }
    }
}

/// How often the recorder's queued histogram samples are folded into its buckets when no scrape
/// did it (the exporter's own default for its upkeep task).
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

/// The bounds of the endpoint's HTTP server (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// `metrics.header_timeout`.
    pub header_timeout: Duration,
    /// `metrics.max_connections`.
    pub max_connections: usize,
}

impl HttpLimits {
    /// Connections one address may hold: a quarter of the cap, at least one.
    fn per_address(&self) -> usize {
        (self.max_connections / 4).max(1)
    }
}

impl From<&crate::config::MetricsConfig> for HttpLimits {
    fn from(config: &crate::config::MetricsConfig) -> Self {
        HttpLimits {
            header_timeout: config.header_timeout,
            max_connections: config.max_connections,
        }
    }
}

/// Longest a connection stays open, whatever it does.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);

/// Most bytes of request headers buffered for one connection (hyper's least is 8 KiB).
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// What a connection beyond the caps is told before it is closed.
const BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";

/// Connections open per peer address; a slot is given back when its [`AddressSlot`] goes.
#[derive(Clone, Default)]
struct PerAddress(Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>);

/// One connection's place in [`PerAddress`].
struct AddressSlot {
    table: PerAddress,
    address: std::net::IpAddr,
}

impl PerAddress {
    /// A slot for `address`, unless it holds `max` already.
    fn take(&self, address: std::net::IpAddr, max: usize) -> Option<AddressSlot> {
        let mut table = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let open = table.entry(address).or_insert(0);
        if *open >= max {
            return None;
        }
        *open += 1;
        Some(AddressSlot {
            table: self.clone(),
            address,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut table = self.table.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(open) = table.get_mut(&self.address) {
            *open -= 1;
            if *open == 0 {
                table.remove(&self.address);
            }
        }
    }
}

/// Accept connections on `listener` and serve `app` on each, within `limits` (see the module
/// docs). Runs until the task is dropped.
async fn accept_loop(listener: tokio::net::TcpListener, app: Router, limits: HttpLimits) {
    let open = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let per_address = PerAddress::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors, most likely (another part of the relay holds them): the
                // waiting connections stay in the kernel's queue; try again shortly.
                tracing::warn!(%error, "The metrics endpoint could not accept a connection.");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let slots = open
            .clone()
            .try_acquire_owned()
            .ok()
            .zip(per_address.take(peer.ip(), limits.per_address()));
        let Some((permit, slot)) = slots else {
            // Beyond a cap: told so and closed now, never queued.
            tracing::debug!(%peer, "Metrics endpoint busy: connection refused.");
            let _ = stream.try_write(BUSY);
            continue;
        };
        let app = app.clone();
        tokio::spawn(async move {
            let _held = (permit, slot);
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(MAX_HEADER_BYTES);
            let connection = http.serve_connection(
                hyper_util::rt::TokioIo::new(stream),
                hyper_util::service::TowerToHyperService::new(app),
            );
            match tokio::time::timeout(MAX_CONNECTION_AGE, connection).await {
                Ok(Err(error)) => tracing::debug!(%peer, %error, "Metrics connection ended."),
                Err(_) => tracing::debug!(%peer, "Metrics connection closed after its lifetime."),
                Ok(Ok(())) => {}
            }
        });
    }
}

/// Install the Prometheus recorder, start refreshing backlog gauges every `refresh`, and serve
/// the endpoints on `listen` within `limits`. Returns the bound address.
pub async fn serve(
    listen: SocketAddr,
    limits: HttpLimits,
    refresh: Duration,
    store: Arc<dyn Store>,
    sink: Arc<dyn Sink>,
    routes: Arc<RouteTable>,
    destinations: DestinationsView,
) -> Result<SocketAddr, ConfigError> {
    let metrics = PrometheusBuilder::new()
        .set_buckets(&[
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ])
        .map_err(|e| ConfigError(format!("metrics: {e}")))?
        .install_recorder()
        .map_err(|e| ConfigError(format!("metrics: {e}")))?;
    describe();
    // Histogram samples queue in the recorder until something drains them: a scrape does, and
    // so must this upkeep, or a relay nobody scrapes grows by every sample it records (several
    // per delivered event) for as long as it runs.
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(METRICS_UPKEEP);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| ConfigError(format!("cannot listen on `metrics.listen` {listen}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| ConfigError(format!("cannot listen on `metrics.listen` {listen}: {e}")))?;
    tokio::spawn(refresh_gauges(store.clone(), routes, refresh));
    let app = Router::new()
        .route("/metrics", get(render))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/destinations", get(destinations_json))
        .with_state(Probe {
            metrics,
            readiness: Arc::new(Readiness::new(store, sink)),
            destinations,
        });
    tokio::spawn(accept_loop(listener, app, limits));
    tracing::info!(
        %bound,
        header_timeout_ms = limits.header_timeout.as_millis() as u64,
        max_connections = limits.max_connections,
        "Serving /metrics, /healthz, /readyz and /destinations."
    );
    Ok(bound)
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "outbox_events_delivered_total",
        "Events the destination acked (delivered)."
    );
    describe_counter!(
        "outbox_events_published_total",
        "Deprecated: the same count as outbox_events_delivered_total, under its old name."
    );
    describe_counter!(
        "outbox_events_failed_total",
        "Publish calls that failed for an event (unavailable, retryable or rejected)."
    );
    describe_counter!(
        "outbox_events_retried_total",
        "Failed publish attempts scheduled for a retry (counted toward max_attempts)."
    );
    describe_counter!(
        "outbox_events_unavailable_total",
        "Events that met their destination unavailable and wait for it (no attempt counted)."
    );
    describe_gauge!(
        "outbox_destination_failing",
        "1 while the destination is left alone for a cooldown after failed calls."
    );
    describe_gauge!(
        "outbox_destination_down_since_seconds",
        "Unix time of the first call the destination did not answer in the current outage; 0 when up."
    );
    describe_counter!(
        "outbox_events_dead_total",
        "Events buried: rejected, or out of attempts."
    );
    describe_counter!(
        "outbox_webhook_headers_dropped_total",
        "Event headers a webhook destination did not forward (never forwarded, denied by default, or not in allowed_headers)."
    );
    describe_counter!(
        "outbox_events_poisoned_total",
        "Events buried as suspected poison: they caused relay.max_outages_per_event outages of their destination (also counted in outbox_events_dead_total)."
    );
    describe_counter!(
        "outbox_events_fenced_total",
        "Writes refused because the claim's lease had moved on."
    );
    describe_counter!(
        "outbox_database_errors_total",
        "Failed store calls (each retried)."
    );
    describe_histogram!(
        "outbox_publish_duration_seconds",
        Unit::Seconds,
        "Time of one publish call to the sink."
    );
    describe_histogram!(
        "outbox_claim_duration_seconds",
        Unit::Seconds,
        "Time of one claim."
    );
    describe_histogram!("outbox_claim_batch_size", "Events per non-empty claim.");
    describe_histogram!(
        "outbox_relay_batch_duration_seconds",
        Unit::Seconds,
        "One relay loop turn for a batch: claim, publish, and the write-back of its outcomes."
    );
    describe_gauge!(
        "outbox_destination_events_pending",
        "Events waiting for delivery, per destination."
    );
    describe_gauge!(
        "outbox_destination_events_dead",
        "Dead events, per destination."
    );
    describe_gauge!(
        "outbox_destination_oldest_pending_age_seconds",
        Unit::Seconds,
        "Age of the oldest undelivered event of a destination (its lag)."
    );
    describe_gauge!(
        "outbox_destination_paused",
        "1 while an operator has paused the destination."
    );
    describe_gauge!("outbox_events_pending", "Events waiting for delivery.");
    describe_gauge!("outbox_events_in_flight", "Events claimed by a relay.");
    describe_gauge!("outbox_events_dead", "Dead events waiting for an operator.");
    describe_gauge!(
        "outbox_oldest_pending_age_seconds",
        Unit::Seconds,
        "Age of the oldest undelivered event (lag)."
    );
}

async fn refresh_gauges(store: Arc<dyn Store>, routes: Arc<RouteTable>, every: Duration) {
    let mut ticker = tokio::time::interval(every.max(Duration::from_millis(100)));
    let mut per_destination = true;
    loop {
        ticker.tick().await;
        match store.stats().await {
            Ok(stats) => {
                metrics::gauge!("outbox_events_pending").set(stats.pending as f64);
                metrics::gauge!("outbox_events_in_flight").set(stats.in_flight as f64);
                metrics::gauge!("outbox_events_dead").set(stats.dead as f64);
                metrics::gauge!("outbox_oldest_pending_age_seconds").set(
                    stats
                        .oldest_pending_age()
                        .map(|a| a.as_secs_f64())
                        .unwrap_or(0.0),
                );
                if per_destination {
                    let now = stats.observed_at.unwrap_or_else(chrono::Utc::now);
                    per_destination = refresh_destinations(store.as_ref(), &routes, now).await;
                }
            }
            Err(error) => {
                metrics::counter!("outbox_database_errors_total").increment(1);
                tracing::warn!(%error, "Could not read the backlog for metrics.");
            }
        }
    }
}

/// Per-destination gauges; returns false when the store cannot report them (stop asking).
async fn refresh_destinations(
    store: &dyn Store,
    routes: &RouteTable,
    now: chrono::DateTime<chrono::Utc>,
) -> bool {
    let stats = match store.destination_stats(routes).await {
        Ok(stats) => stats,
        Err(StoreError::Unsupported { .. }) => return false,
        Err(error) => {
            metrics::counter!("outbox_database_errors_total").increment(1);
            tracing::warn!(%error, "Could not read the backlog per destination for metrics.");
            return true;
        }
    };
    let paused = store.paused().await.unwrap_or_default();
    // Every configured destination gets a value, zero when it has no backlog, so a drained
    // destination's gauge falls to 0 instead of keeping its last value.
    let mut names: Vec<String> = routes.destinations().to_vec();
    names.push("(no route)".into());
    for name in names {
        let entry = stats
            .iter()
            .find(|d| d.destination.as_deref().unwrap_or("(no route)") == name.as_str());
        let pending = entry.map_or(0, |d| d.pending + d.in_flight);
        let dead = entry.map_or(0, |d| d.dead);
        let lag = entry
            .and_then(|d| d.oldest_pending_enqueued_at)
            .map_or(0.0, |t| {
                ((now - t).num_milliseconds().max(0) as f64) / 1000.0
            });
        let is_paused = paused.iter().any(|p| p.destination == name);
        metrics::gauge!("outbox_destination_events_pending", "destination" => name.clone())
            .set(pending as f64);
        metrics::gauge!("outbox_destination_events_dead", "destination" => name.clone())
            .set(dead as f64);
        metrics::gauge!("outbox_destination_oldest_pending_age_seconds", "destination" => name.clone())
            .set(lag);
        metrics::gauge!("outbox_destination_paused", "destination" => name).set(if is_paused {
            1.0
        } else {
            0.0
        });
    }
    true
}

/// WAL mode's slot gauges, refreshed every `every` (one query each time).
pub async fn refresh_wal_gauges(config: outbox_wal::WalConfig, every: Duration) {
    metrics::describe_gauge!(
        "outbox_wal_lag_bytes",
        metrics::Unit::Bytes,
        "Current WAL position minus the slot's confirmed position: delivery lag in bytes."
    );
    metrics::describe_gauge!(
        "outbox_wal_retained_bytes",
        metrics::Unit::Bytes,
        "WAL kept on disk for the slot."
    );
    metrics::describe_gauge!(
        "outbox_wal_confirmed_lsn",
        "The slot's confirmed flush position (last acked LSN) as a number."
    );
    metrics::describe_gauge!(
        "outbox_wal_decoded_bytes_per_second",
        "Bytes decoded through the slot per second."
    );
    metrics::describe_counter!(
        "outbox_wal_messages_unreadable_total",
        "Logical messages with the outbox prefix too large to read (over the record limits): read past, not delivered."
    );
    let mut ticker = tokio::time::interval(every.max(Duration::from_secs(1)));
    let mut last: Option<(std::time::Instant, i64)> = None;
    loop {
        ticker.tick().await;
        match outbox_wal::wal_status(&config).await {
            Ok(s) => {
                metrics::gauge!("outbox_wal_lag_bytes").set(s.lag_bytes.unwrap_or(0) as f64);
                metrics::gauge!("outbox_wal_retained_bytes")
                    .set(s.retained_wal_bytes.unwrap_or(0) as f64);
                if let Some(lsn) = s.confirmed_flush_lsn {
                    metrics::gauge!("outbox_wal_confirmed_lsn").set(lsn.0 as f64);
                }
                if let Some(total) = s.total_bytes {
                    let now = std::time::Instant::now();
                    if let Some((at, before)) = last {
                        let secs = now.duration_since(at).as_secs_f64();
                        if secs > 0.0 {
                            metrics::gauge!("outbox_wal_decoded_bytes_per_second")
                                .set((total - before).max(0) as f64 / secs);
                        }
                    }
                    last = Some((now, total));
                }
            }
            Err(error) => {
                metrics::counter!("outbox_database_errors_total").increment(1);
                tracing::warn!(%error, "Could not read the replication slot for metrics.");
            }
        }
    }
}

async fn render(State(probe): State<Probe>) -> String {
    probe.metrics.render()
}

async fn ready(State(probe): State<Probe>) -> (StatusCode, String) {
    probe.readiness.answer().await
}

/// `/destinations`: the relay's view of each destination (up, failing, since when) and whether a
/// check reaches it now. Not the last error: like `/readyz`, this port may be reachable by more
/// people than the logs (an error can quote hosts, users, broker replies); the error is in the
/// log line that starts the outage and in the waiting events' `last_error` (`outbox dead show`,
/// `outbox status --json` readers with database access).
async fn destinations_json(State(probe): State<Probe>) -> axum::Json<serde_json::Value> {
    let unreachable = probe.readiness.unreachable().await;
    let states = probe
        .destinations
        .get()
        .map(outbox_engine::Destinations::snapshot)
        .unwrap_or_default();
    let list: Vec<serde_json::Value> = states
        .into_iter()
        .map(|d| {
            let reachable = !unreachable.contains(&d.destination);
            let mut value = serde_json::to_value(&d).unwrap_or_default();
            if let Some(fields) = value.as_object_mut() {
                fields.remove("last_error");
            }
            value["reachable"] = serde_json::Value::Bool(reachable);
            value
        })
        .collect();
    axum::Json(serde_json::json!({ "destinations": list }))
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A sink that counts readiness checks and answers them after a pause.
    struct Counting(AtomicU32);

    #[async_trait::async_trait]
    impl Sink for Counting {
        fn name(&self) -> &str {
            "counting"
        }
        async fn publish(&self, events: &[outbox_types::Event]) -> Vec<outbox_types::Outcome> {
            vec![outbox_types::Outcome::Delivered; events.len()]
        }
        async fn check(&self) -> Result<(), outbox_types::SinkError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            Err(outbox_types::SinkError::Unavailable(
                "cannot connect to nats://relay:s3cret@broker.internal:4222".into(),
            ))
        }
    }

    #[tokio::test]
    async fn readiness_and_reachability_are_checked_once_per_second_and_a_down_sink_leaves_it_ready()
     {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("o.db").display());
        let store = outbox_sqlite::SqliteStore::connect(&url, outbox_sqlite::SqliteOutbox::new())
            .await
            .unwrap();
        store.outbox().migrate(store.pool()).await.unwrap();
        let sink = Arc::new(Counting(AtomicU32::new(0)));
        let readiness = Arc::new(Readiness::new(Arc::new(store), sink.clone()));
        let answers = futures::future::join_all((0..50).map(|_| {
            let readiness = readiness.clone();
            async move { readiness.answer().await }
        }))
        .await;
        assert_eq!(
            sink.0.load(Ordering::SeqCst),
            0,
            "readiness never asks the sinks"
        );
        for (status, body) in answers {
            assert_eq!(
                (status, body.as_str()),
                (StatusCode::OK, "ready\n"),
                "the database answers: ready, whatever the broker does"
            );
        }
        let lists = futures::future::join_all((0..50).map(|_| {
            let readiness = readiness.clone();
            async move { readiness.unreachable().await }
        }))
        .await;
        assert!(lists.iter().all(|l| l == &["counting"]), "{lists:?}");
        assert_eq!(sink.0.load(Ordering::SeqCst), 1, "50 asks, one sink check");
    }
}
