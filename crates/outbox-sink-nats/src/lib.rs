//! # outbox-sink-nats
//!
//! Publishes outbox events to **NATS JetStream**. An event counts as delivered only once
//! JetStream answered with a `PubAck`, i.e. the message is stored in a stream; a core-NATS
//! publish would be fire-and-forget and could lose events the relay already marked delivered.
//!
//! ## How an event becomes a message
//!
//! Everything comes from [`outbox_types::routing`], shared by every sink:
//!
//! - **Subject**: the event's own `destination` if the writer set one, else the
//!   [`subject`](NatsSinkConfig::subject) template (default `events.${event_type}`).
//! - **Headers**: the routing headers (`outbox-event-id`, `outbox-event-type`,
//!   `outbox-aggregate-type`, `outbox-aggregate-id` — the key —, `outbox-occurred-at`,
//!   `outbox-idempotency-key`, then the event's own headers such as `traceparent`),
//!   `content-type` (`Content-Type` with `legacy_headers = true`), CloudEvents binary mode's
//!   `ce-` attributes, and **`Nats-Msg-Id` = the event id**. JetStream drops a second message with
//!   the same id inside the stream's duplicate window, so the relay's at-least-once redelivery
//!   (an ack lost on the way back, a relay crash) does not store an event twice. An event header
//!   whose name starts with `Nats-` is *not* forwarded: those headers steer JetStream itself
//!   (expected sequence, TTL, rollup…) and are not the writer's to set.
//! - **Body**: the stored JSON bytes, or a CloudEvents 1.0 structured envelope.
//!
//! ## Throughput
//!
//! A relay batch holds at most one event per aggregate, so the whole batch is published at once:
//! every message is written to the connection first, then all the `PubAck` futures are awaited
//! together. A batch costs about one round trip, not one per message.
//!
//! ## Failures
//!
//! | what happened | outcome |
//! |---|---|
//! | `PubAck` received (also for a duplicate) | `Delivered` |
//! | server unreachable, connection lost, no `PubAck` in time, the stream cannot be created or checked | `Unavailable` (no attempt, however long it lasts) |
//! | JetStream says its cluster, stream or resources are not available (no leader, no peers, stream offline, storage or memory limits, JetStream not enabled) | `Unavailable` |
//! | any other JetStream error for the message | `Retry` (costs an attempt) |
//! | no stream captures the subject ("no responders", and a stream lookup confirms it) | `Reject`, naming the subject and how to create the stream |
//! | "no responders" while a stream does capture the subject, or JetStream cannot answer the lookup (a server restarting) | `Unavailable` |
//! | message larger than the server's `max_payload` or the stream's `max_msg_size` | `Reject` |
//! | subject or header that cannot travel in NATS (a space, a wildcard, a line break) | `Reject` |
//!
//! The sink never fails to start because NATS is down: [`NatsSink::connect`] only validates the
//! configuration and lets the client connect (and later reconnect) in the background. While no
//! connection is up, `publish` waits up to `connect_timeout` for one, then answers `Retry` with
//! the last connection error, and the relay keeps the events.
//!
//! ## TLS
//!
//! `tls = true` (or a `tls://` URL) requires TLS, checked against the system's root
//! certificates, or against `tls_ca_file` when set. TLS uses rustls with the aws-lc-rs provider; if the process has no default rustls
//! provider yet, the sink installs that one (`outbox_tls::ensure_crypto_provider` says why).
//!
//! ## Configuration
//!
//! ```
//! let config: outbox_sink_nats::NatsSinkConfig = serde_json::from_str(r#"{
//!     "servers": ["nats://127.0.0.1:4222"],
//!     "subject": "orders.${event_type}",
//!     "create_stream": true,
//!     "stream_name": "ORDERS",
//!     "ack_timeout": "5s"
//! }"#).unwrap();
//! assert_eq!(config.stream_subjects().unwrap(), vec!["orders.>".to_owned()]);
//! ```

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::{self, context::GetStreamByNameErrorKind, context::PublishErrorKind};
use async_nats::{HeaderMap, HeaderName, HeaderValue, ServerAddr};
use async_trait::async_trait;
use bytes::Bytes;
use outbox_sink_common::{Login, login, unique_headers};
use outbox_tls::ensure_crypto_provider;
use outbox_types::redact::redact_url as redact;
use outbox_types::routing::{Binding, Routing, Template};
use outbox_types::sink_config::{self, config_error, default_destination};
use outbox_types::{Event, Outcome, Sink, SinkError, humantime_duration, truncate_error};
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;
use tracing::{debug, warn};

/// The body format named in configuration (`raw`, `cloudevents` or `debezium`), shared by
/// every sink.
pub use outbox_types::routing::{BodyFormat, CloudEventsMode};

/// A secret read from configuration, never printed (one type for every sink,
/// [`outbox_types::redact::Secret`], re-exported under this crate's name).
pub use outbox_types::redact::Secret;

outbox_sink_common::config_struct! {
    /// Settings of the NATS sink, as read from the relay's configuration file.
    ///
    /// Every field has a default: an empty table publishes raw JSON to `events.${event_type}` on
    /// `nats://127.0.0.1:4222` and expects a stream capturing those subjects to exist.
    #[derive(Clone, Debug, Deserialize, Serialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct NatsSinkConfig {
        /// NATS server URLs (`nats://host:4222`, `tls://host:4222`); the client picks one and fails
        /// over to the others. Printed with passwords and tokens masked.
        #[serde(serialize_with = "outbox_types::redact::serialize_url_list")]
        pub servers: Vec<String> = vec!["nats://127.0.0.1:4222".to_owned()],
        /// Subject template for events that name no destination themselves.
        pub subject: Template = default_destination(),
        @format,
        @cloudevents,
        /// Send the header names of earlier releases (`Content-Type` instead of `content-type`)
        /// for consumers that look them up with case; default `false`.
        pub legacy_headers: bool = false,
        /// Require TLS on every connection (also implied by a `tls://` URL).
        pub tls: bool = false,
        /// A PEM file of CA certificates to trust instead of the system's roots (a private CA).
        pub tls_ca_file: Option<std::path::PathBuf> = None,
        /// User name, with `password` or `password_env`.
        pub user: Option<String> = None,
        @password,
        /// Authentication token (instead of user and password).
        pub token: Option<Secret> = None,
        /// Name of an environment variable holding the token.
        pub token_env: Option<String> = None,
        /// Client name shown by `nats server report connections`.
        pub client_name: String = "outbox-relay".to_owned(),
        /// Longest wait for one connection attempt; also how long a publish waits for a connection
        /// that is being (re-)established before it answers `Retry`.
        #[serde(with = "humantime_duration")]
        pub connect_timeout: Duration = Duration::from_secs(5),
        /// Longest wait for a `PubAck` (and for JetStream API calls). Keep it below the relay's
        /// `publish_timeout`, so the sink reports why instead of the relay reporting a timeout.
        #[serde(with = "humantime_duration")]
        pub ack_timeout: Duration = Duration::from_secs(5),
        /// Longest pause between two reconnection attempts while the server is unreachable.
        #[serde(with = "humantime_duration")]
        pub max_reconnect_delay: Duration = Duration::from_secs(2),
        /// JetStream domain, when the stream lives in another domain (leaf nodes).
        pub domain: Option<String> = None,
        /// Create the stream `stream_name` (capturing `stream_subjects`) if it does not exist.
        pub create_stream: bool = false,
        /// Name of the stream created with `create_stream`.
        pub stream_name: String = "OUTBOX".to_owned(),
        /// Subjects of the stream created with `create_stream`. Empty: derived from `subject`
        /// (`orders.${event_type}` gives `orders.>`).
        pub stream_subjects: Vec<String> = Vec::new(),
        /// Duplicate window of the stream created with `create_stream`: how long JetStream remembers
        /// a `Nats-Msg-Id` to drop a redelivered event.
        #[serde(with = "humantime_duration")]
        pub duplicate_window: Duration = Duration::from_secs(120),
    }
}

impl NatsSinkConfig {
    /// The routing this configuration describes.
    pub fn routing(&self) -> Result<Routing, SinkError> {
        let routing =
            sink_config::routing(self.subject.clone(), self.format, self.cloudevents_keys())?;
        let subject = self.subject.as_str();
        if subject.chars().any(char::is_whitespace)
            || subject.starts_with('.')
            || subject.ends_with('.')
            || subject.contains("..")
        {
            return Err(config_error(format!(
                "`subject = \"{subject}\"` cannot be a NATS subject: no spaces, no empty `.`-separated tokens (e.g. `events.${{event_type}}`)"
            )));
        }
        Ok(routing)
    }

    /// The subjects of the stream created with `create_stream`: `stream_subjects`, or derived
    /// from the subject template's fixed prefix.
    pub fn stream_subjects(&self) -> Result<Vec<String>, SinkError> {
        if !self.stream_subjects.is_empty() {
            return Ok(self.stream_subjects.clone());
        }
        let template = self.subject.as_str();
        match template.find("${") {
            None => Ok(vec![template.to_owned()]),
            Some(start) if start > 1 && template[..start].ends_with('.') => {
                Ok(vec![format!("{}>", &template[..start])])
            }
            Some(_) => Err(config_error(format!(
                "cannot derive `stream_subjects` from `subject = \"{template}\"` (it does not start with a fixed `prefix.`): set `stream_subjects`, e.g. `stream_subjects = [\"orders.>\"]`"
            ))),
        }
    }
}

/// Whether `subject` can be published to: non-empty tokens, no whitespace, no wildcards.
fn check_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty() {
        return Err("the subject is empty".to_owned());
    }
    if subject.chars().any(|c| c.is_whitespace()) {
        return Err("a subject cannot contain whitespace".to_owned());
    }
    for token in subject.split('.') {
        match token {
            "" => {
                return Err(
                    "a subject cannot have an empty token (`..`, or a leading or trailing `.`)"
                        .to_owned(),
                );
            }
            "*" | ">" => {
                return Err(
                    "a subject to publish to cannot contain the wildcards `*` or `>`".to_owned(),
                );
            }
            _ => {}
        }
    }
    Ok(())
}

/// The stream this sink creates when `create_stream` is set.
#[derive(Clone, Debug)]
struct StreamSpec {
    name: String,
    subjects: Vec<String>,
    duplicate_window: Duration,
}

/// What the connection last reported, for `Retry` reasons while it is down.
#[derive(Default)]
struct ConnectionNews {
    last_problem: Option<String>,
}

/// Publishes events to NATS JetStream. See the [crate docs](crate).
pub struct NatsSink {
    routing: Routing,
    /// See the configuration's `legacy_headers`.
    legacy_headers: bool,
    client: async_nats::Client,
    jetstream: jetstream::Context,
    servers: String,
    ack_timeout: Duration,
    connect_timeout: Duration,
    stream: Option<StreamSpec>,
    stream_ready: OnceCell<()>,
    news: Arc<Mutex<ConnectionNews>>,
}

impl NatsSink {
    /// Validate `config` and start connecting in the background.
    ///
    /// Fails only on configuration that cannot work (bad URL, half-given credentials, a missing
    /// secret variable, an unusable template); a server that is down at start-up is not an
    /// error. Must be called inside a Tokio runtime.
    pub async fn connect(config: NatsSinkConfig) -> Result<Self, SinkError> {
        let Prepared {
            routing,
            addrs,
            servers,
            options,
            stream,
            news,
        } = prepare(&config)?;
        let client = options.connect(addrs).await.map_err(|e| {
            config_error(format!("cannot set up the NATS client for {servers}: {e}"))
        })?;
        let builder = jetstream::context::ContextBuilder::new().timeout(config.ack_timeout);
        let jetstream = match &config.domain {
            Some(domain) => builder.domain(domain.clone()).build(client.clone()),
            None => builder.build(client.clone()),
        };
        Ok(NatsSink {
            routing,
            legacy_headers: config.legacy_headers,
            client,
            jetstream,
            servers,
            ack_timeout: config.ack_timeout,
            connect_timeout: config.connect_timeout,
            stream,
            stream_ready: OnceCell::new(),
            news,
        })
    }

    /// Check `config` exactly as [`NatsSink::connect`] does, without contacting a server (what
    /// `outbox config check` runs).
    pub fn check_config(config: &NatsSinkConfig) -> Result<(), SinkError> {
        prepare(config).map(|_| ())
    }

    /// The underlying client (e.g. to subscribe in tests or share the connection).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Wait (up to `connect_timeout`) for a connection that is being set up or re-established;
    /// `Some(reason)` when there is still none.
    async fn wait_connected(&self) -> Option<String> {
        let deadline = tokio::time::Instant::now() + self.connect_timeout;
        loop {
            let reason = self.unavailable()?;
            if tokio::time::Instant::now() >= deadline {
                return Some(reason);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Why the connection is not usable right now, or `None` when it is.
    fn unavailable(&self) -> Option<String> {
        let state = self.client.connection_state();
        if state == State::Connected {
            return None;
        }
        let last = self
            .news
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last_problem
            .clone();
        let state = match state {
            State::Pending => "not connected yet",
            State::Disconnected => "disconnected",
            State::Connected => "connected",
        };
        Some(match last {
            Some(problem) => format!(
                "NATS unreachable at {} ({state}; last error: {problem}); the events stay in the outbox and are retried once it is back",
                self.servers
            ),
            None => format!(
                "NATS unreachable at {} ({state}); the events stay in the outbox and are retried once it is back",
                self.servers
            ),
        })
    }

    /// Create the configured stream once, if `create_stream` is set.
    async fn ensure_stream(&self) -> Result<(), String> {
        let Some(spec) = &self.stream else {
            return Ok(());
        };
        self.stream_ready
            .get_or_try_init(|| async {
                let config = jetstream::stream::Config {
                    name: spec.name.clone(),
                    subjects: spec.subjects.clone(),
                    duplicate_window: spec.duplicate_window,
                    ..Default::default()
                };
                match self.jetstream.get_or_create_stream(config).await {
                    Ok(stream) => {
                        debug!(stream = %spec.name, subjects = ?stream.cached_info().config.subjects, "JetStream stream ready");
                        Ok(())
                    }
                    Err(e) => Err(format!(
                        "could not create or find JetStream stream `{}` (subjects {:?}): {e}",
                        spec.name, spec.subjects
                    )),
                }
            })
            .await
            .map(|_| ())
    }

    /// Turn one event into subject, headers and body; `Err` is a permanent rejection.
    fn message(&self, event: &Event) -> Result<(String, HeaderMap, Bytes), String> {
        let subject = self.routing.destination(event);
        check_subject(&subject).map_err(|why| {
            format!(
                "subject `{subject}` cannot be published to: {why} (check the event's destination or `subject = \"{}\"`)",
                self.routing.destination.as_str()
            )
        })?;
        let mut headers = HeaderMap::new();
        let mut routing_headers = self.routing.headers(event);
        routing_headers.extend(self.routing.cloudevents_headers(event, Binding::Nats));
        for (name, value) in unique_headers(routing_headers) {
            if name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-") {
                debug!(event_id = %event.id, header = %name, "NATS control header from the event not forwarded");
                continue;
            }
            // One content type per message: the body's, set below.
            if name.eq_ignore_ascii_case("content-type") {
                continue;
            }
            let header_name = HeaderName::from_str(&name).map_err(|e| {
                format!("header name `{name}` cannot travel in a NATS message: {e}")
            })?;
            let header_value = HeaderValue::from_str(&value).map_err(|e| {
                format!("value of header `{name}` cannot travel in a NATS message: {e}")
            })?;
            headers.append(header_name, header_value);
        }
        let content_type = if self.legacy_headers {
            "Content-Type"
        } else {
            "content-type"
        };
        headers.insert(content_type, self.routing.content_type());
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            event.id.to_string().as_str(),
        );
        Ok((subject, headers, Bytes::from(self.routing.body(event))))
    }

    /// The failure classification of this sink: the outcome of a failed publish to `subject`
    /// (unavailable: no attempt; retry or reject: costs one). A "no responders" reject is
    /// confirmed by a stream lookup in `publish` before it stands.
    fn classify(&self, subject: &str, error: &jetstream::context::PublishError) -> Outcome {
        match error.kind() {
            PublishErrorKind::StreamNotFound => Outcome::reject(match &self.stream {
                Some(spec) => format!(
                    "no JetStream stream captures subject `{subject}` (NATS answered \"no responders\"): stream `{}` has subjects {:?}; add a matching pattern to `stream_subjects`, or route the event elsewhere",
                    spec.name, spec.subjects
                ),
                None => format!(
                    "no JetStream stream captures subject `{subject}` (NATS answered \"no responders\"): create one, e.g. `nats stream add OUTBOX --subjects '{}' --dupe-window 2m --defaults`, or set `create_stream = true` (with `stream_name` and `stream_subjects`) in the NATS sink settings",
                    suggest_pattern(subject)
                ),
            }),
            PublishErrorKind::MaxPayloadExceeded => Outcome::reject(truncate_error(&format!(
                "message for `{subject}` is too large for NATS: {error}"
            ))),
            PublishErrorKind::TimedOut => Outcome::unavailable(format!(
                "no PubAck for `{subject}` within {} ms (NATS at {} slow or unreachable)",
                self.ack_timeout.as_millis(),
                self.servers
            )),
            PublishErrorKind::BrokenPipe => Outcome::unavailable(format!(
                "connection to NATS at {} lost before the PubAck for `{subject}` arrived",
                self.servers
            )),
            _ => {
                let api = std::error::Error::source(error)
                    .and_then(|s| s.downcast_ref::<jetstream::Error>());
                match api {
                    Some(api)
                        if api.error_code()
                            == jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM =>
                    {
                        Outcome::reject(truncate_error(&format!(
                            "JetStream refused the message for `{subject}` as too large: {api}"
                        )))
                    }
                    // The stream or its cluster cannot take messages now: not this message.
                    Some(api)
                        if [
                            jetstream::ErrorCode::CLUSTER_NOT_AVAILABLE,
                            jetstream::ErrorCode::CLUSTER_NOT_ACTIVE,
                            jetstream::ErrorCode::CLUSTER_NOT_LEADER,
                            jetstream::ErrorCode::CLUSTER_NO_PEERS,
                            jetstream::ErrorCode::CLUSTER_INCOMPLETE,
                            jetstream::ErrorCode::INSUFFICIENT_RESOURCES,
                            jetstream::ErrorCode::STORAGE_RESOURCES_EXCEEDED,
                            jetstream::ErrorCode::MEMORY_RESOURCES_EXCEEDED,
                            jetstream::ErrorCode::ACCOUNT_RESOURCES_EXCEEDED,
                            jetstream::ErrorCode::STREAM_OFFLINE,
                            jetstream::ErrorCode::JETSTREAM_NOT_ENABLED,
                            jetstream::ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
                        ]
                        .contains(&api.error_code()) =>
                    {
                        Outcome::unavailable(truncate_error(&format!(
                            "JetStream cannot take messages for `{subject}` now: {api}"
                        )))
                    }
                    _ => Outcome::retry(truncate_error(&format!(
                        "JetStream publish to `{subject}` failed: {error}"
                    ))),
                }
            }
        }
    }
}

/// A stream subject pattern covering `subject`: its first token and `>`.
fn suggest_pattern(subject: &str) -> String {
    match subject.split_once('.') {
        Some((first, _)) => format!("{first}.>"),
        None => subject.to_owned(),
    }
}

#[async_trait]
impl Sink for NatsSink {
    fn name(&self) -> &str {
        "nats"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        if let Some(reason) = self.wait_connected().await {
            return vec![Outcome::unavailable(reason); events.len()];
        }
        if let Err(reason) = self.ensure_stream().await {
            return vec![Outcome::unavailable(truncate_error(&reason)); events.len()];
        }

        // Write every message first; the acks come back while the rest is being written.
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        let mut pending = Vec::with_capacity(events.len());
        let mut no_responders: Vec<(usize, String)> = Vec::new();
        for (i, event) in events.iter().enumerate() {
            let (subject, headers, body) = match self.message(event) {
                Ok(m) => m,
                Err(reason) => {
                    outcomes[i] = Some(Outcome::reject(truncate_error(&reason)));
                    continue;
                }
            };
            let message = jetstream::message::PublishMessage::build()
                .payload(body)
                .headers(headers);
            match self.jetstream.send_publish(subject.clone(), message).await {
                Ok(ack) => pending.push((i, subject, ack)),
                Err(e) => {
                    if e.kind() == PublishErrorKind::StreamNotFound {
                        no_responders.push((i, subject.clone()));
                    }
                    outcomes[i] = Some(self.classify(&subject, &e));
                }
            }
        }

        let acks = futures::future::join_all(
            pending
                .into_iter()
                .map(|(i, subject, ack)| async move { (i, subject, ack.await) }),
        )
        .await;
        for (i, subject, result) in acks {
            outcomes[i] = Some(match result {
                Ok(ack) => {
                    if ack.duplicate {
                        debug!(event_id = %events[i].id, stream = %ack.stream, "JetStream already had this event (duplicate Nats-Msg-Id)");
                    }
                    Outcome::Delivered
                }
                Err(e) => {
                    if e.kind() == PublishErrorKind::StreamNotFound {
                        no_responders.push((i, subject.clone()));
                    }
                    self.classify(&subject, &e)
                }
            });
        }
        // "No responders" means no stream captures the subject — or that JetStream cannot
        // answer at this moment (a server restarting, a leader election). Only a stream lookup
        // tells them apart; everything short of a definite "not found" is retried.
        let mut checked: std::collections::HashMap<String, Option<String>> = Default::default();
        for (i, subject) in no_responders {
            let transient = match checked.get(&subject) {
                Some(t) => t.clone(),
                None => {
                    let t = match tokio::time::timeout(
                        self.ack_timeout,
                        self.jetstream.stream_by_subject(subject.clone()),
                    )
                    .await
                    {
                        Ok(Err(e)) if e.kind() == GetStreamByNameErrorKind::NotFound => None,
                        Ok(Ok(stream)) => Some(format!(
                            "JetStream answered \"no responders\" for `{subject}` although stream `{stream}` captures it (server restarting or electing a leader?)"
                        )),
                        Ok(Err(e)) => Some(format!(
                            "JetStream answered \"no responders\" for `{subject}` and cannot list its streams right now ({e})"
                        )),
                        Err(_) => Some(format!(
                            "JetStream answered \"no responders\" for `{subject}` and did not answer a stream lookup in time"
                        )),
                    };
                    checked.insert(subject.clone(), t.clone());
                    t
                }
            };
            match transient {
                Some(reason) => outcomes[i] = Some(Outcome::unavailable(reason)),
                None => {
                    warn!(event_id = %events[i].id, %subject, "No JetStream stream captures the subject; the event is rejected.")
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("internal: no outcome recorded")))
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        match self.unavailable() {
            None => Ok(()),
            Some(reason) => Err(SinkError::Unavailable(reason)),
        }
    }
}

/// A NATS sink's settings checked and turned into client options, before any connection.
struct Prepared {
    routing: Routing,
    addrs: Vec<ServerAddr>,
    servers: String,
    options: async_nats::ConnectOptions,
    stream: Option<StreamSpec>,
    news: Arc<Mutex<ConnectionNews>>,
}

/// The earlier place of [`NatsSink::check_config`].
#[deprecated(note = "use `NatsSink::check_config(config)`, the check every sink has")]
pub fn check_config(config: &NatsSinkConfig) -> Result<(), SinkError> {
    NatsSink::check_config(config)
}

/// Warn when `what` would reach a server without TLS (`tls = false` and a `nats://` URL).
fn warn_cleartext(config: &NatsSinkConfig, what: &str) {
    for url in &config.servers {
        let encrypted = config.tls || url.starts_with("tls://") || url.starts_with("wss://");
        if let Some(warning) = outbox_types::redact::cleartext_warning(
            what,
            url,
            encrypted,
            "`tls = true` or a `tls://` URL",
        ) {
            tracing::warn!("{warning}");
        }
    }
}

fn prepare(config: &NatsSinkConfig) -> Result<Prepared, SinkError> {
    ensure_crypto_provider();
    let routing = config.routing()?;
    if config.servers.is_empty() {
        return Err(config_error(
            "`servers` is empty: list at least one, e.g. `servers = [\"nats://127.0.0.1:4222\"]`",
        ));
    }
    let mut addrs = Vec::with_capacity(config.servers.len());
    for url in &config.servers {
        let addr = ServerAddr::from_str(url).map_err(|e| {
                config_error(format!(
                    "`servers` entry `{}` is not a NATS URL ({e}): write e.g. `nats://host:4222` or `tls://host:4222`",
                    redact(url)
                ))
            })?;
        addrs.push(addr);
    }
    let servers = config
        .servers
        .iter()
        .map(|u| redact(u))
        .collect::<Vec<_>>()
        .join(", ");

    let password = sink_config::password(config.password.as_ref(), config.password_env.as_deref())?;
    let token = outbox_sink_common::secret!(config, token, token_env)?;
    let mut options = async_nats::ConnectOptions::new();
    match login(
        config.user.clone(),
        password,
        token,
        "both `user`/`password` and `token` are set: authenticate with one of them",
    )? {
        Login::UserPassword { user, password } => {
            warn_cleartext(config, "the NATS password");
            options = options.user_and_password(user, password);
        }
        Login::Token(token) => {
            warn_cleartext(config, "the NATS token");
            options = options.token(token);
        }
        Login::Anonymous => {}
    }

    let stream = if config.create_stream {
        let name = config.stream_name.trim();
        if name.is_empty()
            || name
                .chars()
                .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
        {
            return Err(config_error(format!(
                "`stream_name = \"{name}\"` is not a valid stream name: use letters, digits, `-` and `_` (e.g. `OUTBOX`)"
            )));
        }
        let subjects = config.stream_subjects()?;
        Some(StreamSpec {
            name: name.to_owned(),
            subjects,
            duplicate_window: config.duplicate_window,
        })
    } else {
        None
    };
    if config.ack_timeout.is_zero() {
        return Err(config_error(
            "`ack_timeout` is zero: give JetStream time to answer, e.g. `ack_timeout = \"5s\"`",
        ));
    }

    if let Some(ca) = &config.tls_ca_file {
        if !ca.is_file() {
            return Err(config_error(format!(
                "`tls_ca_file = \"{}\"` is not a readable file: point it at a PEM file of CA certificates",
                ca.display()
            )));
        }
        options = options.add_root_certificates(ca.clone());
    }

    let news = Arc::new(Mutex::new(ConnectionNews::default()));
    let max_delay = config.max_reconnect_delay.max(Duration::from_millis(10));
    let callback_news = news.clone();
    let options = options
        .name(&config.client_name)
        .connection_timeout(config.connect_timeout)
        .require_tls(config.tls)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .reconnect_delay_callback(move |attempts| {
            let exp = u32::try_from(attempts.saturating_sub(1))
                .unwrap_or(u32::MAX)
                .min(16);
            Duration::from_millis(50u64.saturating_mul(1u64 << exp)).min(max_delay)
        })
        .event_callback(move |event| {
            let news = callback_news.clone();
            async move {
                let mut news = news.lock().unwrap_or_else(|p| p.into_inner());
                match event {
                    async_nats::Event::Connected => news.last_problem = None,
                    async_nats::Event::Disconnected if news.last_problem.is_none() => {
                        news.last_problem = Some("connection lost".to_owned());
                    }
                    async_nats::Event::ServerError(e) => {
                        news.last_problem = Some(format!("server error: {e}"));
                    }
                    async_nats::Event::ClientError(e) => {
                        news.last_problem = Some(format!("{e}"));
                    }
                    _ => {}
                }
            }
        });
    Ok(Prepared {
        routing,
        addrs,
        servers,
        options,
        stream,
        news,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_usable() {
        let config: NatsSinkConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config.subject.as_str(), "events.${event_type}");
        assert_eq!(config.servers, vec!["nats://127.0.0.1:4222".to_owned()]);
        assert_eq!(
            config.stream_subjects().unwrap(),
            vec!["events.>".to_owned()]
        );
        assert_eq!(config.ack_timeout, Duration::from_secs(5));
    }

    #[test]
    fn unknown_keys_and_bad_templates_are_refused() {
        let err = serde_json::from_str::<NatsSinkConfig>(r#"{"subjekt": "x"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `subjekt`"), "{err}");
        let err =
            serde_json::from_str::<NatsSinkConfig>(r#"{"subject": "a.${evnt}"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `evnt`"), "{err}");
        let err = serde_json::from_str::<NatsSinkConfig>(r#"{"ack_timeout": 5}"#).unwrap_err();
        assert!(err.to_string().contains("invalid type"), "{err}");
    }

    #[test]
    fn stream_subjects_need_a_fixed_prefix() {
        let config: NatsSinkConfig =
            serde_json::from_str(r#"{"subject": "${aggregate_type}.events"}"#).unwrap();
        let err = config.stream_subjects().unwrap_err().to_string();
        assert!(err.contains("stream_subjects"), "{err}");
        let config: NatsSinkConfig = serde_json::from_str(r#"{"subject": "audit"}"#).unwrap();
        assert_eq!(config.stream_subjects().unwrap(), vec!["audit".to_owned()]);
    }

    #[test]
    fn subjects_are_checked() {
        assert!(check_subject("events.OrderCreated").is_ok());
        assert!(check_subject("events.Order Created").is_err());
        assert!(check_subject("events..x").is_err());
        assert!(check_subject("events.>").is_err());
        assert!(check_subject("").is_err());
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact("nats://u:p@host:4222"), "nats://u:***@host:4222");
        assert_eq!(redact("nats://host:4222"), "nats://host:4222");
    }

    #[test]
    fn secrets_are_not_printed() {
        let config: NatsSinkConfig =
            serde_json::from_str(r#"{"user": "u", "password": "hunter2"}"#).unwrap();
        assert!(!format!("{config:?}").contains("hunter2"));
    }

    #[tokio::test]
    async fn configuration_mistakes_are_named() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"password_env": "OUTBOX_NATS_TEST_SURELY_UNSET", "user": "u"}"#,
                "OUTBOX_NATS_TEST_SURELY_UNSET",
            ),
            (r#"{"user": "u"}"#, "password_env"),
            (r#"{"password": "p"}"#, "`user`"),
            (
                r#"{"user": "u", "password": "p", "password_env": "X"}"#,
                "both `password` and `password_env`",
            ),
            (r#"{"servers": []}"#, "`servers` is empty"),
            (r#"{"servers": ["http://[::1"]}"#, "not a NATS URL"),
            (r#"{"format": "cloudevents"}"#, "cloudevents_source"),
            (
                r#"{"create_stream": true, "stream_name": "a.b"}"#,
                "stream_name",
            ),
        ];
        for (json, expected) in cases {
            let config: NatsSinkConfig = serde_json::from_str(json).unwrap();
            let err = match NatsSink::connect(config).await {
                Ok(_) => panic!("{json} was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(expected), "{json}: {err}");
        }
    }
}
