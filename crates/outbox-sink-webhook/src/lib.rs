//! # outbox-sink-webhook
//!
//! Delivers each outbox event as an HTTP `POST` to a URL. An event counts as delivered only when
//! the receiver answered `2xx`; anything else is data for the relay's retry and dead-letter path.
//!
//! ## The request
//!
//! - **URL**: the event's own `destination` if the writer set one, else the
//!   [`url`](WebhookSinkConfig::url) template rendered over the event (e.g.
//!   `https://hooks.example.com/orders/${event_type}`); both come from
//!   [`outbox_core::routing`], shared by every sink.
//! - **Headers**: `Content-Type` (`application/json`, or `application/cloudevents+json`),
//!   `Idempotency-Key` (the writer's idempotency key if it set one, else the event id: the
//!   receiver deduplicates on it), `X-Event-Id`, `X-Event-Type`, the routing headers
//!   (`outbox-event-id`, `outbox-aggregate-id` — the key —, …, and the event's own headers such
//!   as `traceparent`), `Authorization` when configured, and the signature header when a secret
//!   is configured. An event header that would change how the request is framed or routed
//!   (`Host`, `Content-Length`, `Transfer-Encoding`, `Connection`, …) or that would replace one
//!   of the sink's own is not forwarded.
//! - **Body**: the stored JSON bytes, or a CloudEvents 1.0 structured envelope.
//!
//! Redirects are not followed (a `3xx` is a permanent failure naming the new location), so a
//! signed request is never replayed to a host nobody configured.
//!
//! ## Outcomes
//!
//! | response | outcome |
//! |---|---|
//! | `2xx` | `Delivered` |
//! | `408`, `429`, `5xx` | `Retry`; a `Retry-After` header (seconds or HTTP date) sets when |
//! | no response: refused, reset, DNS failure, timeout | `Retry` |
//! | other `4xx`, `3xx`, a URL or header that cannot be sent | `Reject` |
//!
//! The start of the response body goes into the reason (and so into the event's `last_error`),
//! cut with [`outbox_core::truncate_error`].
//!
//! ## Throughput
//!
//! A relay batch holds at most one event per aggregate, so all of its requests go out at once,
//! at most [`concurrency`](WebhookSinkConfig::concurrency) (default 64) at a time across every
//! batch of this sink, over pooled keep-alive connections.
//!
//! ## Verifying the signature
//!
//! With a `secret` configured, every request carries
//!
//! ```text
//! X-Outbox-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>
//! ```
//!
//! A receiver should:
//!
//! 1. take `t` and every `v1` from the header (there may be several `v1` while a secret is being
//!    rotated),
//! 2. compute `HMAC-SHA256(secret, t + "." + body)` over the **raw** request body bytes (before
//!    any JSON parsing),
//! 3. compare it in constant time with each `v1`, and accept if one matches,
//! 4. refuse `t` too far from its own clock (e.g. 5 minutes), so a captured request cannot be
//!    replayed later,
//! 5. deduplicate on `Idempotency-Key`: delivery is at least once.
//!
//! In Rust, [`verify_signature`] does steps 1–4; by hand it is:
//!
//! ```
//! use hmac::{Hmac, KeyInit, Mac};
//! use sha2::Sha256;
//!
//! let secret = b"whsec_test";
//! let body = br#"{"order_id":42}"#;
//! // What the sink sent (computed here with the sink's own helper).
//! let header = outbox_sink_webhook::sign(secret, 1_700_000_000, body);
//!
//! // Receiver side.
//! let mut t = None;
//! let mut candidates = Vec::new();
//! for part in header.split(',') {
//!     match part.trim().split_once('=') {
//!         Some(("t", v)) => t = v.parse::<u64>().ok(),
//!         Some(("v1", v)) => candidates.push(hex::decode(v).unwrap()),
//!         _ => {}
//!     }
//! }
//! let t = t.unwrap();
//! let now = 1_700_000_030u64; // the receiver's clock
//! assert!(now.abs_diff(t) <= 300, "stale or future timestamp: refuse");
//! let genuine = candidates.iter().any(|candidate| {
//!     let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap();
//!     mac.update(format!("{t}.").as_bytes());
//!     mac.update(body);
//!     mac.verify_slice(candidate).is_ok() // constant-time comparison
//! });
//! assert!(genuine);
//!
//! // The same with the helper.
//! use std::time::Duration;
//! assert!(outbox_sink_webhook::verify_signature(secret, &header, body, now, Duration::from_secs(300)).is_ok());
//! assert!(outbox_sink_webhook::verify_signature(secret, &header, b"{}", now, Duration::from_secs(300)).is_err());
//! ```
//!
//! ## Configuration
//!
//! ```
//! let config: outbox_sink_webhook::WebhookSinkConfig = serde_json::from_str(r#"{
//!     "url": "https://hooks.example.com/orders/${event_type}",
//!     "secret_env": "OUTBOX_WEBHOOK_SECRET",
//!     "concurrency": 32,
//!     "request_timeout": "3s"
//! }"#).unwrap();
//! assert_eq!(config.concurrency, 32);
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use hmac::{Hmac, KeyInit, Mac};
use outbox_core::routing::{PayloadFormat, Routing, Template};
use outbox_core::{Event, Outcome, Sink, SinkError, humantime_duration, truncate_error};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::sync::Semaphore;
use tracing::debug;

/// The body format named in configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BodyFormat {
    /// The stored JSON bytes, untouched (`application/json`).
    #[default]
    Raw,
    /// A CloudEvents 1.0 structured-mode envelope (`application/cloudevents+json`; needs
    /// `cloudevents_source`).
    #[serde(alias = "cloud_events")]
    Cloudevents,
}

/// A secret read from configuration; never printed.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

/// Printed configurations (`outbox config check`) show `***`, never the value.
impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("***")
    }
}

impl Secret {
    /// Wrap a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"***\"")
    }
}

/// Settings of the webhook sink, as read from the relay's configuration file. Only `url` is
/// required.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhookSinkConfig {
    /// URL template for events that name no destination themselves, e.g.
    /// `https://hooks.example.com/orders/${event_type}`. Required.
    pub url: Option<Template>,
    /// `raw` (default) or `cloudevents`.
    pub format: BodyFormat,
    /// The CloudEvents `source` attribute (e.g. `/orders-service`); required with
    /// `format = "cloudevents"`.
    pub cloudevents_source: Option<String>,
    /// Only send to `https://` URLs (a plain `http://` URL is then rejected).
    pub tls: bool,
    /// HTTP Basic user name, with `password` or `password_env`.
    pub username: Option<String>,
    /// HTTP Basic password.
    pub password: Option<Secret>,
    /// Name of an environment variable holding the HTTP Basic password.
    pub password_env: Option<String>,
    /// Bearer token sent as `Authorization: Bearer …`.
    pub bearer_token: Option<Secret>,
    /// Name of an environment variable holding the bearer token.
    pub bearer_token_env: Option<String>,
    /// HMAC-SHA256 signing secret; requests are signed when one is set.
    pub secret: Option<Secret>,
    /// Name of an environment variable holding the signing secret.
    pub secret_env: Option<String>,
    /// Header carrying the signature.
    pub signature_header: String,
    /// `User-Agent` of the requests.
    pub client_name: String,
    /// Longest wait to open a connection.
    #[serde(with = "humantime_duration")]
    pub connect_timeout: Duration,
    /// Longest wait for one request, from sending to the end of the response. A batch takes up
    /// to `ceil(batch_size / concurrency) × request_timeout` against a slow receiver; keep that
    /// below the relay's `publish_timeout`, or the relay times the whole batch out.
    #[serde(with = "humantime_duration")]
    pub request_timeout: Duration,
    /// Requests in flight at once, over all batches.
    pub concurrency: usize,
    /// Longest `Retry-After` honoured; a receiver asking for more gets this.
    #[serde(with = "humantime_duration")]
    pub max_retry_after: Duration,
}

impl Default for WebhookSinkConfig {
    fn default() -> Self {
        WebhookSinkConfig {
            url: None,
            format: BodyFormat::Raw,
            cloudevents_source: None,
            tls: false,
            username: None,
            password: None,
            password_env: None,
            bearer_token: None,
            bearer_token_env: None,
            secret: None,
            secret_env: None,
            signature_header: "X-Outbox-Signature".to_owned(),
            client_name: concat!("outbox-relay/", env!("CARGO_PKG_VERSION")).to_owned(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            concurrency: 64,
            max_retry_after: Duration::from_secs(3600),
        }
    }
}

fn config_error(message: impl Into<String>) -> SinkError {
    SinkError::Config(message.into())
}

/// Read a secret given either inline or through an environment variable.
fn resolve_secret(
    inline_key: &str,
    inline: Option<&Secret>,
    env_key: &str,
    env: Option<&str>,
) -> Result<Option<String>, SinkError> {
    match (inline, env) {
        (Some(_), Some(_)) => Err(config_error(format!(
            "both `{inline_key}` and `{env_key}` are set: keep one (prefer `{env_key}`, so the secret stays out of the file)"
        ))),
        (Some(secret), None) => Ok(Some(secret.expose().to_owned())),
        (None, Some(var)) => match std::env::var(var) {
            Ok(value) if !value.is_empty() => Ok(Some(value)),
            Ok(_) => Err(config_error(format!(
                "`{env_key} = \"{var}\"` names an empty environment variable: export {var} with the secret"
            ))),
            Err(_) => Err(config_error(format!(
                "`{env_key} = \"{var}\"` names an environment variable that is not set: export {var}, or set `{inline_key}`"
            ))),
        },
        (None, None) => Ok(None),
    }
}

/// A signature header value is malformed, wrong, or too old. Returned by [`verify_signature`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignatureError {
    /// The header lacks `t=` or `v1=`, or they do not parse.
    #[error("malformed signature header (expected `t=<unix seconds>,v1=<hex>`)")]
    Malformed,
    /// No `v1` matches the body and timestamp: wrong secret, or the body was changed.
    #[error("signature does not match the body")]
    Mismatch,
    /// The timestamp is further from now than the tolerance: a replay, or a skewed clock.
    #[error("signature timestamp is {skew_seconds} s away from now, beyond the tolerance")]
    Stale {
        /// How far `t` is from now.
        skew_seconds: u64,
    },
}

fn mac(secret: &[u8], timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this never falls back in practice.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret)
        .unwrap_or_else(|_| Hmac::<Sha256>::new(&Default::default()));
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The signature header value for `body` sent at `timestamp` (unix seconds):
/// `t=<timestamp>,v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
///
/// ```
/// let header = outbox_sink_webhook::sign(b"secret", 1_700_000_000, b"{}");
/// assert!(header.starts_with("t=1700000000,v1="));
/// assert_eq!(header.len(), "t=1700000000,v1=".len() + 64);
/// ```
pub fn sign(secret: &[u8], timestamp: u64, body: &[u8]) -> String {
    let tag = mac(secret, timestamp, body).finalize().into_bytes();
    format!("t={timestamp},v1={}", hex::encode(tag))
}

/// Check a signature header against the raw `body`, in constant time, accepting a timestamp at
/// most `tolerance` away from `now` (unix seconds). Any of several `v1` entries may match (secret
/// rotation).
pub fn verify_signature(
    secret: &[u8],
    header: &str,
    body: &[u8],
    now: u64,
    tolerance: Duration,
) -> Result<(), SignatureError> {
    let mut timestamp = None;
    let mut candidates = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => timestamp = v.parse::<u64>().ok(),
            Some(("v1", v)) => {
                candidates.push(hex::decode(v).map_err(|_| SignatureError::Malformed)?)
            }
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or(SignatureError::Malformed)?;
    if candidates.is_empty() {
        return Err(SignatureError::Malformed);
    }
    let matched = candidates
        .iter()
        .any(|tag| mac(secret, timestamp, body).verify_slice(tag).is_ok());
    if !matched {
        return Err(SignatureError::Mismatch);
    }
    let skew = now.abs_diff(timestamp);
    if skew > tolerance.as_secs() {
        return Err(SignatureError::Stale { skew_seconds: skew });
    }
    Ok(())
}

/// The delay a `Retry-After` value asks for: delta-seconds (`120`) or an HTTP date
/// (`Wed, 21 Oct 2015 07:28:00 GMT`, relative to `now`), capped at `max`. `None` when it parses
/// as neither.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use outbox_sink_webhook::parse_retry_after;
/// let now = SystemTime::now();
/// let max = Duration::from_secs(3600);
/// assert_eq!(parse_retry_after("120", now, max), Some(Duration::from_secs(120)));
/// let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
/// let d = parse_retry_after(&later, now, max).unwrap();
/// assert!(d <= Duration::from_secs(30) && d >= Duration::from_secs(29));
/// assert_eq!(parse_retry_after("soon", now, max), None);
/// ```
pub fn parse_retry_after(value: &str, now: SystemTime, max: Duration) -> Option<Duration> {
    let value = value.trim();
    let delay = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        let at = httpdate::parse_http_date(value).ok()?;
        at.duration_since(now).unwrap_or(Duration::ZERO)
    };
    Some(delay.min(max))
}

/// Event header names that are not forwarded: they would change how the request is framed or
/// routed, or replace a header the sink sets itself.
const RESERVED: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "proxy-authorization",
    "proxy-connection",
    "authorization",
    "idempotency-key",
    "x-event-id",
    "x-event-type",
];

/// Posts events to a webhook. See the [crate docs](crate).
pub struct WebhookSink {
    routing: Routing,
    client: reqwest::Client,
    limit: Arc<Semaphore>,
    https_only: bool,
    authorization: Option<HeaderValue>,
    signing: Option<(Vec<u8>, HeaderName)>,
    request_timeout: Duration,
    max_retry_after: Duration,
}

impl WebhookSink {
    /// Validate `config` and build the HTTP client. Nothing is sent: a receiver that is down at
    /// start-up is not an error.
    pub fn connect(config: WebhookSinkConfig) -> Result<Self, SinkError> {
        let template = config.url.clone().ok_or_else(|| {
            config_error(
                "`url` is required, e.g. `url = \"https://hooks.example.com/orders/${event_type}\"`",
            )
        })?;
        let text = template.as_str();
        let scheme_ok = if config.tls {
            text.starts_with("https://")
        } else {
            text.starts_with("https://") || text.starts_with("http://")
        };
        if !scheme_ok {
            return Err(config_error(if config.tls {
                format!(
                    "`url = \"{text}\"` must start with `https://` because `tls = true` (or set `tls = false` to allow `http://`)"
                )
            } else {
                format!(
                    "`url = \"{text}\"` must start with `http://` or `https://` (placeholders may come after the host)"
                )
            }));
        }
        let format = match config.format {
            BodyFormat::Raw => PayloadFormat::Raw,
            BodyFormat::Cloudevents => {
                let source = config
                    .cloudevents_source
                    .clone()
                    .filter(|s| !s.trim().is_empty())
                    .ok_or_else(|| {
                        config_error(
                            "`format = \"cloudevents\"` needs `cloudevents_source`, the CloudEvents `source` attribute (e.g. `cloudevents_source = \"/orders-service\"`)",
                        )
                    })?;
                PayloadFormat::CloudEvents { source }
            }
        };
        let routing = Routing::new(template).with_format(format);

        let password = resolve_secret(
            "password",
            config.password.as_ref(),
            "password_env",
            config.password_env.as_deref(),
        )?;
        let bearer = resolve_secret(
            "bearer_token",
            config.bearer_token.as_ref(),
            "bearer_token_env",
            config.bearer_token_env.as_deref(),
        )?;
        let authorization = match (&config.username, password, bearer) {
            (Some(_), _, Some(_)) | (None, Some(_), Some(_)) => {
                return Err(config_error(
                    "both HTTP Basic (`username`/`password`) and `bearer_token` are set: keep one",
                ));
            }
            (None, Some(_), None) => {
                return Err(config_error(
                    "a password is set but `username` is not: add `username = \"…\"`",
                ));
            }
            (Some(_), None, None) => {
                return Err(config_error(
                    "`username` is set without a password: add `password_env = \"VAR\"` (or `password`)",
                ));
            }
            (Some(user), Some(password), None) => Some(basic_auth(user, &password)?),
            (None, None, Some(token)) => {
                let mut value =
                    HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                        config_error("the bearer token contains characters not allowed in a header")
                    })?;
                value.set_sensitive(true);
                Some(value)
            }
            (None, None, None) => None,
        };
        let secret = resolve_secret(
            "secret",
            config.secret.as_ref(),
            "secret_env",
            config.secret_env.as_deref(),
        )?;
        let signing = match secret {
            Some(secret) => {
                let header = HeaderName::from_bytes(config.signature_header.as_bytes()).map_err(|_| {
                    config_error(format!(
                        "`signature_header = \"{}\"` is not a valid header name (e.g. `X-Outbox-Signature`)",
                        config.signature_header
                    ))
                })?;
                Some((secret.into_bytes(), header))
            }
            None => None,
        };
        if config.concurrency == 0 {
            return Err(config_error(
                "`concurrency = 0` would never send anything: use at least 1 (default 64)",
            ));
        }
        if config.request_timeout.is_zero() || config.connect_timeout.is_zero() {
            return Err(config_error(
                "`connect_timeout` and `request_timeout` must be above zero, e.g. `\"5s\"`",
            ));
        }
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .retry(reqwest::retry::never())
            .timeout(config.request_timeout)
            .connect_timeout(config.connect_timeout)
            .user_agent(config.client_name.clone())
            .pool_max_idle_per_host(config.concurrency)
            .tcp_nodelay(true)
            .https_only(config.tls)
            .build()
            .map_err(|e| config_error(format!("cannot build the HTTP client: {}", chain(&e))))?;
        Ok(WebhookSink {
            routing,
            client,
            limit: Arc::new(Semaphore::new(config.concurrency)),
            https_only: config.tls,
            authorization,
            signing,
            request_timeout: config.request_timeout,
            max_retry_after: config.max_retry_after,
        })
    }

    /// The request for one event; `Err` is a permanent rejection.
    fn request(&self, event: &Event) -> Result<(Url, HeaderMap, Vec<u8>), String> {
        let target = self.routing.destination(event);
        let url = Url::parse(&target).map_err(|e| {
            format!(
                "`{target}` is not a valid URL ({e}); check the event's destination or `url = \"{}\"`",
                self.routing.destination.as_str()
            )
        })?;
        match url.scheme() {
            "https" => {}
            "http" if !self.https_only => {}
            other => {
                return Err(format!(
                    "`{target}` uses `{other}://`, but only {} is allowed",
                    if self.https_only {
                        "`https://` (tls = true)"
                    } else {
                        "`http://` or `https://`"
                    }
                ));
            }
        }
        let body = self.routing.body(event);
        let mut headers = HeaderMap::with_capacity(16);
        for (name, value) in unique_headers(self.routing.headers(event)) {
            let lower = name.to_ascii_lowercase();
            if RESERVED.contains(&lower.as_str())
                || self
                    .signing
                    .as_ref()
                    .is_some_and(|(_, h)| h.as_str() == lower)
            {
                debug!(event_id = %event.id, header = %name, "event header not forwarded");
                continue;
            }
            let header_name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("header name `{name}` is not a valid HTTP header name"))?;
            let header_value = HeaderValue::from_str(&value).map_err(|_| {
                format!("value of header `{name}` cannot be sent in HTTP (control characters?)")
            })?;
            headers.append(header_name, header_value);
        }
        let id = event.id.to_string();
        let text = |v: &str, what: &str| {
            HeaderValue::from_str(v)
                .map_err(|_| format!("{what} `{v}` cannot be sent as an HTTP header value"))
        };
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static(self.routing.content_type()),
        );
        headers.insert(
            HeaderName::from_static("idempotency-key"),
            text(
                event.idempotency_key.as_deref().unwrap_or(&id),
                "idempotency key",
            )?,
        );
        headers.insert(
            HeaderName::from_static("x-event-id"),
            text(&id, "event id")?,
        );
        headers.insert(
            HeaderName::from_static("x-event-type"),
            text(&event.event_type, "event type")?,
        );
        if let Some(auth) = &self.authorization {
            headers.insert(reqwest::header::AUTHORIZATION, auth.clone());
        }
        if let Some((secret, header)) = &self.signing {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let signature = sign(secret, now, &body);
            headers.insert(header.clone(), text(&signature, "signature")?);
        }
        Ok((url, headers, body))
    }

    /// Post one event and classify what came back.
    async fn deliver(&self, event: &Event) -> Outcome {
        // Wait for a slot first, so the signature's timestamp is the time of sending.
        let Ok(_permit) = self.limit.acquire().await else {
            return Outcome::retry("the webhook sink is shutting down");
        };
        let (url, headers, body) = match self.request(event) {
            Ok(r) => r,
            Err(reason) => return Outcome::reject(truncate_error(&reason)),
        };
        let sent = self
            .client
            .post(url.clone())
            .headers(headers)
            .body(body)
            .send()
            .await;
        let mut response = match sent {
            Ok(r) => r,
            Err(e) => {
                let why = if e.is_timeout() {
                    format!(
                        "no response from {url} within {} ms",
                        self.request_timeout.as_millis()
                    )
                } else if e.is_connect() {
                    format!("cannot connect to {url}: {}", chain(&e))
                } else {
                    format!("request to {url} failed: {}", chain(&e))
                };
                return Outcome::retry(truncate_error(&why));
            }
        };
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now(), self.max_retry_after));
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = read_prefix(&mut response, outbox_core::MAX_LAST_ERROR_LEN).await;
        if status.is_success() {
            return Outcome::Delivered;
        }
        let mut reason = format!("HTTP {status} from {url}");
        if !body.trim().is_empty() {
            reason.push_str(": ");
            reason.push_str(body.trim());
        }
        if status == StatusCode::REQUEST_TIMEOUT
            || status == StatusCode::TOO_MANY_REQUESTS
            || status.is_server_error()
        {
            Outcome::Retry {
                reason: truncate_error(&reason),
                after: retry_after,
            }
        } else if status.is_redirection() {
            Outcome::reject(truncate_error(&format!(
                "HTTP {status} from {url} redirects to {}: redirects are not followed; set `url` to the final address",
                location.as_deref().unwrap_or("(no Location)")
            )))
        } else if status.is_client_error() {
            Outcome::reject(truncate_error(&reason))
        } else {
            Outcome::retry(truncate_error(&reason))
        }
    }
}

/// The routing headers with each name kept once, first occurrence wins, names compared without
/// case. The event's own headers come after the standard ones, so an own `Outbox-Event-Id`
/// (which routing's case-sensitive `outbox-` filter lets through) cannot shadow the real one.
fn unique_headers(headers: Vec<(String, String)>) -> Vec<(String, String)> {
    let mut seen = std::collections::HashSet::with_capacity(headers.len());
    headers
        .into_iter()
        .filter(|(name, _)| seen.insert(name.to_ascii_lowercase()))
        .collect()
}

/// `Authorization: Basic base64(user:password)`.
fn basic_auth(user: &str, password: &str) -> Result<HeaderValue, SinkError> {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let input = format!("{user}:{password}").into_bytes();
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4 + 6);
    out.push_str("Basic ");
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    let mut value = HeaderValue::from_str(&out)
        .map_err(|_| config_error("the HTTP Basic credentials cannot be sent as a header"))?;
    value.set_sensitive(true);
    Ok(value)
}

/// An error and its causes, `a: b: c` (reqwest's own message names only the outermost).
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Up to `limit` bytes of the response body as text; the rest is drained (up to a bound) so the
/// connection can be reused.
async fn read_prefix(response: &mut reqwest::Response, limit: usize) -> String {
    let mut prefix = Vec::new();
    let mut drained = 0usize;
    while let Ok(Some(chunk)) = response.chunk().await {
        if prefix.len() < limit {
            let take = (limit - prefix.len()).min(chunk.len());
            prefix.extend_from_slice(&chunk[..take]);
        }
        drained += chunk.len();
        if drained > 1024 * 1024 {
            break;
        }
    }
    String::from_utf8_lossy(&prefix).into_owned()
}

#[async_trait]
impl Sink for WebhookSink {
    fn name(&self) -> &str {
        "webhook"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        futures::future::join_all(events.iter().map(|e| self.deliver(e))).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> WebhookSinkConfig {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn signatures_verify_and_detect_tampering_and_replays() {
        let header = sign(b"s3cret", 1_000, b"{\"a\":1}");
        let tolerance = Duration::from_secs(300);
        assert_eq!(
            verify_signature(b"s3cret", &header, b"{\"a\":1}", 1_100, tolerance),
            Ok(())
        );
        assert_eq!(
            verify_signature(b"s3cret", &header, b"{\"a\":2}", 1_100, tolerance),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify_signature(b"other", &header, b"{\"a\":1}", 1_100, tolerance),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify_signature(b"s3cret", &header, b"{\"a\":1}", 2_000, tolerance),
            Err(SignatureError::Stale {
                skew_seconds: 1_000
            })
        );
        assert_eq!(
            verify_signature(b"s3cret", "v1=00", b"{}", 0, tolerance),
            Err(SignatureError::Malformed)
        );
        // Rotation: a second v1 that matches is enough.
        let rotated = format!("{header},v1={}", "ab".repeat(32));
        assert_eq!(
            verify_signature(b"s3cret", &rotated, b"{\"a\":1}", 1_000, tolerance),
            Ok(())
        );
    }

    #[test]
    fn retry_after_reads_seconds_and_dates_and_is_capped() {
        let now = SystemTime::now();
        let max = Duration::from_secs(60);
        assert_eq!(
            parse_retry_after(" 7 ", now, max),
            Some(Duration::from_secs(7))
        );
        assert_eq!(parse_retry_after("86400", now, max), Some(max));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(10));
        assert_eq!(parse_retry_after(&past, now, max), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("", now, max), None);
        assert_eq!(parse_retry_after("-1", now, max), None);
    }

    #[test]
    fn basic_auth_is_base64() {
        let v = basic_auth("Aladdin", "open sesame").unwrap();
        assert_eq!(v.to_str().unwrap(), "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==");
        let v = basic_auth("a", "b").unwrap();
        assert_eq!(v.to_str().unwrap(), "Basic YTpi");
    }

    #[test]
    fn configuration_mistakes_are_named() {
        let cases: &[(&str, &str)] = &[
            ("{}", "`url` is required"),
            (
                r#"{"url": "ftp://x/${event_type}"}"#,
                "must start with `http://`",
            ),
            (r#"{"url": "http://x", "tls": true}"#, "`https://`"),
            (
                r#"{"url": "http://x", "secret_env": "OUTBOX_WEBHOOK_TEST_SURELY_UNSET"}"#,
                "OUTBOX_WEBHOOK_TEST_SURELY_UNSET",
            ),
            (r#"{"url": "http://x", "username": "u"}"#, "password_env"),
            (
                r#"{"url": "http://x", "username": "u", "password": "p", "bearer_token": "t"}"#,
                "keep one",
            ),
            (
                r#"{"url": "http://x", "concurrency": 0}"#,
                "concurrency = 0",
            ),
            (
                r#"{"url": "http://x", "format": "cloudevents"}"#,
                "cloudevents_source",
            ),
            (
                r#"{"url": "http://x", "secret": "s", "signature_header": "bad header"}"#,
                "signature_header",
            ),
        ];
        for (json, expected) in cases {
            let err = match WebhookSink::connect(config(json)) {
                Ok(_) => panic!("{json} was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(expected), "{json}: {err}");
        }
        let err = serde_json::from_str::<WebhookSinkConfig>(r#"{"uri": "http://x"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `uri`"), "{err}");
    }

    #[test]
    fn secrets_are_not_printed() {
        let c = config(r#"{"url": "http://x", "secret": "hunter2", "bearer_token": "tok"}"#);
        let text = format!("{c:?}");
        assert!(
            !text.contains("hunter2") && !text.contains("tok\""),
            "{text}"
        );
    }
}
