//! # outbox-sink-webhook
//!
//! Delivers each outbox event as an HTTP `POST` to a URL. An event counts as delivered only when
//! the receiver answered `2xx`; anything else is data for the relay's retry and dead-letter path.
//!
//! ## Where requests go
//!
//! The sink holds credentials (`Authorization`, the signing secret), and anyone who can insert
//! an outbox row controls the row's fields. So the host of every request is fixed by
//! configuration, never by a row:
//!
//! - The [`url`](WebhookSinkConfig::url) template fixes the **origin** (scheme, host, port).
//!   Placeholders may only appear after the host (`https://hooks.example.com/orders/${event_type}`);
//!   one in the scheme or host is refused unless [`allowed_hosts`](WebhookSinkConfig::allowed_hosts)
//!   lists the hosts it may produce. Placeholder values are **percent-encoded** (every byte but
//!   `A-Z a-z 0-9 - . _ ~`), so an `aggregate_id` of `../../admin?debug=1#` stays one path
//!   segment (`..%2F..%2Fadmin%3Fdebug%3D1%23`) instead of climbing to `/admin`.
//! - An event's own **`destination` column** (the relay's router clears it when it names a
//!   configured destination) may be a path starting with `/` (with a query if wanted), sent to
//!   the configured origin; or an absolute `http(s)://` URL whose origin is the configured one or
//!   whose host is in `allowed_hosts`. Anything else — another host, another scheme, user info in
//!   the URL — is rejected (the event is dead, its `last_error` names the host and
//!   `allowed_hosts`) and **nothing is sent** to that host.
//! - A path with a dot segment (`.`, `..`, or `%2e` spellings, which URL parsers resolve) is
//!   rejected too, whether it came from the template or from the row.
//! - Hosts in `allowed_hosts` are the operator's own: they get the same `Authorization` and
//!   signature as the configured origin (one sink, one set of credentials; list only hosts you
//!   would give those credentials to). No other host ever gets them.
//! - Redirects are not followed (a `3xx` is a permanent failure naming the new location), so a
//!   signed request is never replayed to a host nobody configured.
//!
//! Every URL the sink writes into a reason (and so into `last_error`) or a log goes through
//! [`outbox_types::redact::redact_url`]: a password or token in the URL never shows.
//!
//! ## The request
//!
//! - **Headers**: `Content-Type` (`application/json`, or `application/cloudevents+json`),
//!   `Idempotency-Key` (the writer's idempotency key if it set one, else the event id: the
//!   receiver deduplicates on it), the routing headers
//!   (`outbox-event-id`, `outbox-aggregate-id` — the key —, …, and the event's own headers such
//!   as `traceparent`), `Authorization` when configured, and the signature headers when a secret
//!   is configured. `X-Event-Id` and `X-Event-Type`, which earlier releases sent, come back with
//!   `legacy_headers = true`.
//! - **Which event headers ride along**: the request carries the sink's credentials, so an
//!   event's own header must not change what the receiver makes of it. Never forwarded (and
//!   refused in `allowed_headers`): headers that frame or route the request (`Host`,
//!   `Content-Length`, `Content-Type`, `Transfer-Encoding`, `Connection`, `Keep-Alive`,
//!   `Upgrade`, `TE`, `Trailer`, `Expect`, `User-Agent`), credentials (`Authorization`,
//!   `Proxy-Authorization`) and the sink's own headers (`Idempotency-Key`, `webhook-id`,
//!   `webhook-timestamp`, `webhook-signature`, the `signature_header`, `X-Event-Id`,
//!   `X-Event-Type`). Not forwarded by default (the [`DENIED_HEADERS`] list): the other
//!   hop-by-hop and `Proxy-*` headers; `Cookie`; what proxies add about the client
//!   (`Forwarded`, `Via`, `X-Forwarded-*`, `X-Real-IP`, `True-Client-IP`, …) or the original
//!   request (`X-Original-URL`, `X-Rewrite-URL`); method overrides (`X-HTTP-Method-Override`,
//!   `X-HTTP-Method`, `X-Method-Override`); other `Content-*`, `Range`, `If-*`, `Origin`,
//!   `Referer`; other `webhook-*` and signature headers (`X-Hub-Signature*`,
//!   `X-Outbox-Signature`); and any name that looks like a credential (`X-Api-Key`,
//!   `X-Auth-Token`, `X-CSRF-Token`, `Session-Id`: names ending in `token`, `secret`,
//!   `password`, `apikey`, `auth`, `signature`, `cookie`, `session`…). Such a header is
//!   **dropped**, not the event: the event is valid and other destinations carry the header,
//!   and burying events for a header copied from an inbound request would let any writer hold
//!   up its aggregates; each drop is logged at debug level and counted in
//!   `outbox_webhook_headers_dropped_total`. [`allowed_headers`](WebhookSinkConfig::allowed_headers)
//!   makes it a list: only the event headers it names are forwarded (the relay's own
//!   `outbox-*` and CloudEvents headers always are), and it may name a default-denied header
//!   the receiver needs (`X-Forwarded-For` for an audit log), never a never-forwarded one.
//! - **Body**: the stored JSON bytes, or a CloudEvents 1.0 structured envelope; in CloudEvents
//!   binary mode the stored bytes, with the attributes as `ce-` headers (percent-encoded as the
//!   HTTP binding says).
//! - **`format = "debezium"`**: the body as stored (an empty body for a `null` payload), the
//!   headers `id` and the event's own as JSON strings instead of the routing headers (see
//!   [`PayloadFormat::Debezium`](outbox_types::routing::PayloadFormat::Debezium)); an event
//!   destination that is a topic name (neither a path nor a URL, as the `debezium` WAL source
//!   sets) is not a target: the request goes to `url`, as Debezium Server's HTTP sink sends
//!   every event to its one URL.
//!
//! ## Outcomes
//!
//! | response | outcome |
//! |---|---|
//! | `2xx` | `Delivered` |
//! | `408`, `429`, `502`, `503`, `504` | `Unavailable` (no attempt, however long it lasts); a `Retry-After` header (seconds or HTTP date) sets when |
//! | no response: refused, reset, DNS or TLS failure, timeout | `Unavailable` |
//! | `500` and other `5xx` (the receiver failed on this event) | `Retry` (costs an attempt), `Retry-After` honoured |
//! | other `4xx`, `3xx`, a URL or header that cannot be sent, a host nobody configured | `Reject` |
//!
//! The start of the response body goes into the reason (and so into the event's `last_error`),
//! cut with [`outbox_types::truncate_error`].
//!
//! ## Throughput
//!
//! A relay batch holds at most one event per aggregate, so all of its requests go out at once,
//! at most [`concurrency`](WebhookSinkConfig::concurrency) (default 64) at a time across every
//! batch of this sink, over pooled keep-alive connections.
//!
//! ## Signatures
//!
//! With a `secret` (or `secret_env`) configured, every request is signed with HMAC-SHA256.
//! [`signature_scheme`](WebhookSinkConfig::signature_scheme) picks how:
//!
//! - **`"standard-webhooks"`** (recommended) — [Standard Webhooks](https://www.standardwebhooks.com/):
//!
//!   ```text
//!   webhook-id: <event id>
//!   webhook-timestamp: <unix seconds>
//!   webhook-signature: v1,<base64 HMAC-SHA256(key, "<webhook-id>.<webhook-timestamp>.<raw body>")>
//!   ```
//!
//!   The event id is signed with the body, so a captured signature cannot be replayed with a
//!   different id, and a raw body (which carries no id) is still tied to its event. A secret
//!   written `whsec_<base64>` (the spec's format) is base64-decoded to the key; any other secret
//!   is used as its raw bytes. Receivers can use any Standard Webhooks library, or
//!   [`verify_standard_webhook`]. Deduplicate on `webhook-id`.
//! - **`"outbox-v1"`** (the default, kept for existing receivers) —
//!   `X-Outbox-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>`
//!   (the header name is `signature_header`). It covers timestamp and body only, **not** the
//!   event id or `Idempotency-Key`; [`verify_signature`] checks it.
//!
//! A receiver should, for either scheme: compute the HMAC over the **raw** request body bytes
//! (before any JSON parsing), compare in constant time with each signature given (there may be
//! several while a secret is rotated), refuse a timestamp too far from its own clock (e.g. 5
//! minutes) so a captured request cannot be replayed later, and deduplicate: delivery is at
//! least once.
//!
//! A signature proves who sent a request, not that nobody read it: with a secret or credentials
//! over plain `http://` the sink logs a warning at start-up; use `https://` and `tls = true`.
//!
//! By hand, the outbox-v1 check is:
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
//!     "allowed_hosts": ["audit.example.com", "*.hooks.example.net"],
//!     "secret_env": "OUTBOX_WEBHOOK_SECRET",
//!     "signature_scheme": "standard-webhooks",
//!     "tls": true,
//!     "concurrency": 32,
//!     "request_timeout": "3s"
//! }"#).unwrap();
//! assert_eq!(config.concurrency, 32);
//! ```

mod signature;
mod target;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use outbox_sink_common::{Login, login};
use outbox_types::redact::{redact_in_text, redact_url, scrub};
use outbox_types::routing::{Binding, Routing, Template};
use outbox_types::{Event, Outcome, Sink, SinkError, humantime_duration, truncate_error};
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

/// A secret read from configuration; prints as `***` (the shared
/// [`outbox_types::redact::Secret`], re-exported under its old name).
pub use outbox_types::redact::Secret;
pub use signature::{
    SignatureError, SignatureScheme, sign, sign_standard_webhook, standard_webhooks_key,
    verify_signature, verify_standard_webhook,
};
use target::Targets;

/// The body format named in configuration (`raw`, `cloudevents` or `debezium`), shared by
/// every sink.
pub use outbox_types::routing::{BodyFormat, CloudEventsMode};
use outbox_types::sink_config::{self, config_error};

/// Printed configurations (`outbox config check`) show the `url` template with a password,
/// token or credential-like query value masked.
fn serialize_template<S: serde::Serializer>(
    url: &Option<Template>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match url {
        Some(template) => s.serialize_some(&redact_url(template.as_str())),
        None => s.serialize_none(),
    }
}

outbox_sink_common::config_struct! {
    /// Settings of the webhook sink, as read from the relay's configuration file. Only `url` is
    /// required.
    #[derive(Clone, Debug, Deserialize, Serialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct WebhookSinkConfig {
        /// URL template for events, e.g. `https://hooks.example.com/orders/${event_type}`. Its
        /// scheme, host and port are the configured origin: placeholders go after the host (values
        /// are percent-encoded). Required.
        #[serde(serialize_with = "serialize_template")]
        pub url: Option<Template> = None,
        /// Hosts other than the `url`'s own that an event's `destination` column may name (and a
        /// placeholder in the `url`'s host may produce): `hooks.example.com`, `*.example.com` (any
        /// subdomain), either with `:port` (without, only the scheme's default port). They get the
        /// same `Authorization` and signature: list only your own hosts. Empty by default: a row
        /// may only pick a path under the `url`'s origin.
        pub allowed_hosts: Vec<String> = Vec::new(),
        @format,
        @cloudevents,
        /// Also send the headers of earlier releases, `x-event-id` and `x-event-type` (the
        /// same values as `outbox-event-id` and `outbox-event-type`); default `false`.
        pub legacy_headers: bool = false,
        /// The event headers forwarded (names, any case), e.g. `["traceparent", "tracestate",
        /// "x-tenant"]`; every other event header is dropped. Unset (default): every event header
        /// but the denied ones (see the [crate docs](crate#the-request)). May name a
        /// default-denied header the receiver needs; naming one that is never forwarded
        /// (`Host`, `Authorization`, the signature headers, …) is a configuration error.
        pub allowed_headers: Option<Vec<String>> = None,
        /// Only send to `https://` URLs (a plain `http://` URL is then rejected).
        pub tls: bool = false,
        /// HTTP Basic user name, with `password` or `password_env` (`user`, as in every sink).
        pub user: Option<String> = None,
        @username,
        @password,
        /// Bearer token sent as `Authorization: Bearer …`.
        pub bearer_token: Option<Secret> = None,
        /// Name of an environment variable holding the bearer token.
        pub bearer_token_env: Option<String> = None,
        /// HMAC-SHA256 signing secret; requests are signed when one is set. With
        /// `signature_scheme = "standard-webhooks"`, `whsec_<base64>` is decoded to the key.
        pub secret: Option<Secret> = None,
        /// Name of an environment variable holding the signing secret.
        pub secret_env: Option<String> = None,
        /// `"outbox-v1"` (default, `X-Outbox-Signature`) or `"standard-webhooks"` (recommended:
        /// `webhook-id`, `webhook-timestamp`, `webhook-signature`, the event id signed too). See
        /// the [crate docs](crate#signatures).
        pub signature_scheme: SignatureScheme = SignatureScheme::OutboxV1,
        /// Header carrying the outbox-v1 signature.
        pub signature_header: String = DEFAULT_SIGNATURE_HEADER.to_owned(),
        /// `User-Agent` of the requests.
        pub client_name: String = concat!("outbox-relay/", env!("CARGO_PKG_VERSION")).to_owned(),
        /// Longest wait to open a connection.
        #[serde(with = "humantime_duration")]
        pub connect_timeout: Duration = Duration::from_secs(2),
        /// Longest wait for one request, from sending to the end of the response. A batch takes up
        /// to `ceil(batch_size / concurrency) × request_timeout` against a slow receiver; keep that
        /// below the relay's `publish_timeout`, or the relay times the whole batch out.
        #[serde(with = "humantime_duration")]
        pub request_timeout: Duration = Duration::from_secs(5),
        /// Requests in flight at once, over all batches.
        pub concurrency: usize = 64,
        /// Longest `Retry-After` honoured; a receiver asking for more gets this.
        #[serde(with = "humantime_duration")]
        pub max_retry_after: Duration = Duration::from_secs(3600),
    }
}

const DEFAULT_SIGNATURE_HEADER: &str = "X-Outbox-Signature";

/// How requests are signed, with the key resolved.
enum Signing {
    /// `header: t=…,v1=…`.
    OutboxV1 { secret: Vec<u8>, header: HeaderName },
    /// `webhook-id`, `webhook-timestamp`, `webhook-signature`.
    StandardWebhooks { key: Vec<u8> },
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

/// Event header names that are never forwarded, whatever `allowed_headers` says: they would
/// change how the request is framed or routed, carry credentials, or replace a header the sink
/// sets itself.
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
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "user-agent",
];

/// Event header names not forwarded unless `allowed_headers` names them: hop-by-hop and proxy
/// headers, cookies, what proxies add about the client or the original request, method
/// overrides, headers that make the request conditional or partial, and signature headers.
/// Names ending in `-` are prefixes. Names that look like a credential are denied as well (see
/// [`credential_like`]).
pub const DENIED_HEADERS: &[&str] = &[
    "proxy-",
    "cookie",
    "cookie2",
    "forwarded",
    "via",
    "x-forwarded-",
    "x-real-ip",
    "x-client-ip",
    "true-client-ip",
    "cf-connecting-ip",
    "x-cluster-client-ip",
    "x-original-url",
    "x-rewrite-url",
    "x-original-host",
    "x-original-method",
    "x-host",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "content-",
    "range",
    "if-",
    "origin",
    "referer",
    "webhook-",
    "x-outbox-signature",
    "x-hub-signature",
    "x-hub-signature-",
];

/// Whether an event header's name looks like a credential (`X-Api-Key`, `X-Auth-Token`,
/// `Session-Id`): its letters and digits, in lower case, end with one of these words. A writer
/// who sets one could make the receiver read the request as someone else's.
fn credential_like(lower: &str) -> bool {
    let squashed: String = lower.chars().filter(char::is_ascii_alphanumeric).collect();
    [
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "auth",
        "authorization",
        "credential",
        "credentials",
        "signature",
        "cookie",
        "session",
        "sessionid",
        "jwt",
    ]
    .iter()
    .any(|word| squashed.ends_with(word))
}

/// Whether `lower` (a header name in lower case) is on [`DENIED_HEADERS`] or looks like a
/// credential.
fn denied_by_default(lower: &str) -> bool {
    DENIED_HEADERS
        .iter()
        .any(|denied| match denied.strip_suffix('-') {
            Some(_) => lower.starts_with(denied),
            None => lower == *denied,
        })
        || credential_like(lower)
}

/// Which event headers a request carries (see the crate docs' "Which event headers ride
/// along").
#[derive(Debug)]
enum HeaderPolicy {
    /// Every event header but the reserved and the denied ones.
    Default,
    /// Only these (lower case), never a reserved one.
    Allow(std::collections::HashSet<String>),
}

impl HeaderPolicy {
    fn from_config(config: &WebhookSinkConfig) -> Result<Self, SinkError> {
        let Some(list) = &config.allowed_headers else {
            return Ok(HeaderPolicy::Default);
        };
        let mut allowed = std::collections::HashSet::with_capacity(list.len());
        for name in list {
            let lower = name.trim().to_ascii_lowercase();
            if HeaderName::from_bytes(lower.as_bytes()).is_err() {
                return Err(config_error(format!(
                    "`allowed_headers` entry `{name}` is not a valid HTTP header name"
                )));
            }
            if RESERVED.contains(&lower.as_str())
                || lower.eq_ignore_ascii_case(&config.signature_header)
            {
                return Err(config_error(format!(
                    "`allowed_headers` names `{name}`, which an event may never set on the request (it frames or routes the request, carries credentials, or is one of the sink's own headers): remove it"
                )));
            }
            allowed.insert(lower);
        }
        Ok(HeaderPolicy::Allow(allowed))
    }

    /// Whether an event's header named `lower` (lower case, not reserved) is forwarded.
    fn forwards(&self, lower: &str) -> bool {
        match self {
            HeaderPolicy::Default => !denied_by_default(lower),
            HeaderPolicy::Allow(allowed) => allowed.contains(lower),
        }
    }
}

/// Posts events to a webhook. See the [crate docs](crate).
pub struct WebhookSink {
    routing: Routing,
    /// See the configuration's `legacy_headers`.
    legacy_headers: bool,
    /// Which of an event's own headers ride along (`allowed_headers`).
    header_policy: HeaderPolicy,
    /// Decides each event's URL; the only way to get a URL credentials may go to.
    targets: Targets,
    client: reqwest::Client,
    limit: Arc<Semaphore>,
    authorization: Option<HeaderValue>,
    signing: Option<Signing>,
    request_timeout: Duration,
    max_retry_after: Duration,
    /// What the redactor masks in the `url` template (a path token, a query key's value), kept
    /// to scrub from reasons: a receiver's error page may quote the request's path, where no
    /// redactor could recognise it without knowing the URL.
    secrets: Vec<String>,
}

/// The `url` template, required, with a scheme `tls` allows.
fn checked_url(config: &WebhookSinkConfig) -> Result<Template, SinkError> {
    let template = config.url.clone().ok_or_else(|| {
        config_error(
            "`url` is required, e.g. `url = \"https://hooks.example.com/orders/${event_type}\"`",
        )
    })?;
    let text = template.as_str();
    let shown = redact_url(text);
    let scheme_ok = if config.tls {
        text.starts_with("https://")
    } else {
        text.starts_with("https://") || text.starts_with("http://")
    };
    if !scheme_ok {
        return Err(config_error(if config.tls {
            format!(
                "`url = \"{shown}\"` must start with `https://` because `tls = true` (or set `tls = false` to allow `http://`)"
            )
        } else {
            format!(
                "`url = \"{shown}\"` must start with `http://` or `https://` (placeholders may come after the host)"
            )
        }));
    }
    Ok(template)
}

/// The `Authorization` header: HTTP Basic from `user` and a password, or a bearer token; never
/// both, and never half of Basic.
fn authorization(config: &WebhookSinkConfig) -> Result<Option<HeaderValue>, SinkError> {
    let password = sink_config::password(config.password.as_ref(), config.password_env.as_deref())?;
    let bearer = outbox_sink_common::secret!(config, bearer_token, bearer_token_env)?;
    let (user, deprecated) =
        sink_config::user("webhook", config.user.as_ref(), config.username.as_ref())?;
    if let Some(warning) = deprecated {
        tracing::warn!("{warning}");
    }
    let authorization = match login(
        user.cloned(),
        password,
        bearer,
        "both HTTP Basic (`user`/`password`) and `bearer_token` are set: keep one",
    )? {
        Login::UserPassword { user, password } => Some(basic_auth(&user, &password)?),
        Login::Token(token) => {
            let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                config_error("the bearer token contains characters not allowed in a header")
            })?;
            value.set_sensitive(true);
            Some(value)
        }
        Login::Anonymous => None,
    };
    Ok(authorization)
}

/// How bodies are signed, when a signing secret is set.
fn signing(config: &WebhookSinkConfig) -> Result<Option<Signing>, SinkError> {
    let secret = outbox_sink_common::secret!(config, secret, secret_env)?;
    let signing = match (secret, config.signature_scheme) {
        (None, _) => None,
        (Some(secret), SignatureScheme::OutboxV1) => {
            let header = HeaderName::from_bytes(config.signature_header.as_bytes()).map_err(|_| {
                config_error(format!(
                    "`signature_header = \"{}\"` is not a valid header name (e.g. `X-Outbox-Signature`)",
                    config.signature_header
                ))
            })?;
            Some(Signing::OutboxV1 {
                secret: secret.into_bytes(),
                header,
            })
        }
        (Some(secret), SignatureScheme::StandardWebhooks) => {
            if config.signature_header != DEFAULT_SIGNATURE_HEADER {
                return Err(config_error(format!(
                    "`signature_header = \"{}\"` applies to `signature_scheme = \"outbox-v1\"` only; standard-webhooks always uses `webhook-signature`: remove `signature_header`",
                    config.signature_header
                )));
            }
            let key = standard_webhooks_key(&secret).ok_or_else(|| {
                config_error(
                    "the signing secret starts with `whsec_` but the rest is not base64 of a non-empty key: use `whsec_` + base64 of 24 to 64 random bytes (e.g. `whsec_$(openssl rand -base64 32)`), or a secret without the `whsec_` prefix, which is used as raw bytes",
                )
            })?;
            Some(Signing::StandardWebhooks { key })
        }
    };
    Ok(signing)
}

/// Concurrency and timeouts that can send something.
fn check_limits(config: &WebhookSinkConfig) -> Result<(), SinkError> {
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
    Ok(())
}

/// Warn when credentials would travel unencrypted: a plain `http://` URL, or `allowed_hosts`
/// without `tls = true` (an event may then name an `http://` URL).
fn warn_if_credentials_travel_in_clear(
    config: &WebhookSinkConfig,
    text: &str,
    authorization: Option<&HeaderValue>,
    signing: Option<&Signing>,
) {
    let shown = redact_url(text);
    let credentials = match (authorization, signing) {
        (Some(_), Some(_)) => {
            Some("the `Authorization` header and the signing secret's signatures")
        }
        (Some(_), None) => Some("the `Authorization` header"),
        (None, Some(_)) => Some("signatures made with the secret"),
        (None, None) => None,
    };
    if let Some(credentials) = credentials {
        if text.starts_with("http://") {
            warn!(
                url = %shown,
                "The webhook destination {shown} is plain http://: {credentials} travel unencrypted, readable and reusable by anyone on the path. Use an https:// URL and set `tls = true`."
            );
        } else if !config.tls && !config.allowed_hosts.is_empty() {
            warn!(
                url = %shown,
                "The webhook destination {shown} has `allowed_hosts` but not `tls = true`: an event may name an http:// URL on an allowed host, and {credentials} would travel unencrypted. Set `tls = true`."
            );
        }
    }
}

/// The HTTP client: no redirects and no retries of its own (the relay retries), the timeouts,
/// and `https_only` under `tls = true`.
fn http_client(config: &WebhookSinkConfig) -> Result<reqwest::Client, SinkError> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .retry(reqwest::retry::never())
        .timeout(config.request_timeout)
        .connect_timeout(config.connect_timeout)
        .user_agent(config.client_name.clone())
        .pool_max_idle_per_host(config.concurrency)
        .tcp_nodelay(true)
        .https_only(config.tls)
        .build()
        .map_err(|e| {
            config_error(format!(
                "cannot build the HTTP client: {}",
                redact_in_text(&chain(&e))
            ))
        })
}

impl WebhookSink {
    /// Validate `config` and build the HTTP client. Nothing is sent: a receiver that is down at
    /// start-up is not an error. Credentials or a secret over plain `http://` are allowed, with
    /// a warning in the log.
    pub fn connect(config: WebhookSinkConfig) -> Result<Self, SinkError> {
        let template = checked_url(&config)?;
        let text = template.as_str().to_owned();
        let targets = Targets::new(template.clone(), &config.allowed_hosts, config.tls)
            .map_err(config_error)?
            .with_topic_destinations(config.format == BodyFormat::Debezium);
        let routing = sink_config::routing(template, config.format, config.cloudevents_keys())?;
        let authorization = authorization(&config)?;
        let signing = signing(&config)?;
        check_limits(&config)?;
        warn_if_credentials_travel_in_clear(
            &config,
            &text,
            authorization.as_ref(),
            signing.as_ref(),
        );
        let client = http_client(&config)?;
        Ok(WebhookSink {
            routing,
            legacy_headers: config.legacy_headers,
            header_policy: HeaderPolicy::from_config(&config)?,
            targets,
            client,
            limit: Arc::new(Semaphore::new(config.concurrency)),
            authorization,
            signing,
            request_timeout: config.request_timeout,
            max_retry_after: config.max_retry_after,
            secrets: outbox_types::redact::url_secrets(&text),
        })
    }

    /// Check `config` as [`WebhookSink::connect`] does (which sends nothing either; what
    /// `outbox config check` runs).
    pub fn check_config(config: &WebhookSinkConfig) -> Result<(), SinkError> {
        Self::connect(config.clone()).map(|_| ())
    }

    /// The request for one event; `Err` is a permanent rejection, and nothing was sent.
    fn request(&self, event: &Event) -> Result<(reqwest::Url, HeaderMap, Vec<u8>), String> {
        // The URL first: a host nobody configured is refused before anything is built for it.
        let target = self.targets.resolve(event)?;
        let body = self.routing.body(event);
        let mut headers = HeaderMap::with_capacity(16);
        let signature_header = match &self.signing {
            Some(Signing::OutboxV1 { header, .. }) => Some(header.as_str()),
            _ => None,
        };
        let debezium = self.routing.format == outbox_types::routing::PayloadFormat::Debezium;
        // The event's own headers are those routing did not make itself (`outbox-*`, Debezium's
        // `id`); the CloudEvents attributes come after them, never from the row.
        let from_row =
            |name: &str| !(outbox_types::is_relay_header(name) || (debezium && name == "id"));
        let mut routing_headers: Vec<(String, String, bool)> = self
            .routing
            .headers(event)
            .into_iter()
            .map(|(name, value)| {
                let own = from_row(&name);
                (name, value, own)
            })
            .collect();
        routing_headers.extend(
            self.routing
                .cloudevents_headers(event, Binding::Http)
                .into_iter()
                .map(|(name, value)| (name, value, false)),
        );
        let mut seen = std::collections::HashSet::with_capacity(routing_headers.len());
        for (name, value, own) in routing_headers {
            let lower = name.to_ascii_lowercase();
            // Each name once, the first (the relay's own come first) winning.
            if !seen.insert(lower.clone()) {
                continue;
            }
            if RESERVED.contains(&lower.as_str())
                || signature_header == Some(lower.as_str())
                || (own && !self.header_policy.forwards(&lower))
            {
                debug!(
                    event_id = %event.id,
                    header = %outbox_types::redact::escape_control(&name),
                    "Event header not forwarded to the webhook (see `allowed_headers`)."
                );
                metrics::counter!("outbox_webhook_headers_dropped_total").increment(1);
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
        if self.legacy_headers {
            headers.insert(
                HeaderName::from_static("x-event-id"),
                text(&id, "event id")?,
            );
            headers.insert(
                HeaderName::from_static("x-event-type"),
                text(&event.event_type, "event type")?,
            );
        }
        // `target` is the configured origin or an allowed host (see `target`): the only
        // places the credentials may go.
        if let Some(auth) = &self.authorization {
            headers.insert(reqwest::header::AUTHORIZATION, auth.clone());
        }
        if let Some(signing) = &self.signing {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            match signing {
                Signing::OutboxV1 { secret, header } => {
                    let signature = sign(secret, now, &body);
                    headers.insert(header.clone(), text(&signature, "signature")?);
                }
                Signing::StandardWebhooks { key } => {
                    let signature = sign_standard_webhook(key, &id, now, &body);
                    headers.insert(
                        HeaderName::from_static("webhook-id"),
                        text(&id, "event id")?,
                    );
                    headers.insert(
                        HeaderName::from_static("webhook-timestamp"),
                        text(&now.to_string(), "timestamp")?,
                    );
                    headers.insert(
                        HeaderName::from_static("webhook-signature"),
                        text(&signature, "signature")?,
                    );
                }
            }
        }
        Ok((target.into_url(), headers, body))
    }

    /// Post one event and classify what came back.
    async fn deliver(&self, event: &Event) -> Outcome {
        // Wait for a slot first, so the signature's timestamp is the time of sending.
        let Ok(_permit) = self.limit.acquire().await else {
            return Outcome::unavailable("the webhook sink is shutting down");
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
        // Every URL in a reason ends up in `last_error`: never with its user info.
        let shown = redact_url(url.as_str());
        let mut response = match sent {
            Ok(r) => r,
            Err(e) => {
                let why = if e.is_timeout() {
                    format!(
                        "no response from {shown} within {} ms",
                        self.request_timeout.as_millis()
                    )
                } else if e.is_connect() {
                    format!("cannot connect to {shown}: {}", chain(&e))
                } else {
                    format!("request to {shown} failed: {}", chain(&e))
                };
                return Outcome::unavailable(truncate_error(&scrub(&why, &self.secrets)));
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
        let body = read_prefix(&mut response, outbox_types::MAX_LAST_ERROR_LEN).await;
        if status.is_success() {
            return Outcome::Delivered;
        }
        classify(
            status,
            &shown,
            &scrub(&body, &self.secrets),
            retry_after,
            location.as_deref(),
        )
    }
}

/// The failure classification of this sink: the outcome of a request the receiver answered
/// with a status other than 2xx. A request that got no answer (connection refused, timeout, TLS)
/// is unavailable and does not get here.
///
/// 408, 429, 502, 503, 504: the receiver (or its proxy) is not serving, unavailable (no attempt);
/// other 5xx: retry (costs an attempt); 3xx (not followed) and other 4xx: reject.
fn classify(
    status: StatusCode,
    shown: &str,
    body: &str,
    retry_after: Option<Duration>,
    location: Option<&str>,
) -> Outcome {
    let mut reason = format!("HTTP {status} from {shown}");
    if !body.trim().is_empty() {
        reason.push_str(": ");
        reason.push_str(body.trim());
    }
    if matches!(
        status,
        StatusCode::REQUEST_TIMEOUT
            | StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT
    ) {
        // The receiver (or the proxy in front of it) is not serving: not this event's fault.
        Outcome::Unavailable {
            reason: truncate_error(&reason),
            after: retry_after,
        }
    } else if status.is_server_error() {
        Outcome::Retry {
            reason: truncate_error(&reason),
            after: retry_after,
        }
    } else if status.is_redirection() {
        Outcome::reject(truncate_error(&format!(
            "HTTP {status} from {shown} redirects to {}: redirects are not followed; set `url` to the final address",
            location
                .map(redact_url)
                .unwrap_or_else(|| "(no Location)".to_owned())
        )))
    } else if status.is_client_error() {
        Outcome::reject(truncate_error(&reason))
    } else {
        Outcome::retry(truncate_error(&reason))
    }
}

/// `Authorization: Basic base64(user:password)`.
fn basic_auth(user: &str, password: &str) -> Result<HeaderValue, SinkError> {
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let mut value = HeaderValue::from_str(&format!("Basic {encoded}"))
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
            (r#"{"url": "http://x", "user": "u"}"#, "password_env"),
            (r#"{"url": "http://x", "username": "u"}"#, "password_env"),
            (
                r#"{"url": "http://x", "user": "u", "username": "u", "password": "p"}"#,
                "keep `user`",
            ),
            (
                r#"{"url": "http://x", "user": "u", "password": "p", "bearer_token": "t"}"#,
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
            // An empty signing secret (or token, or password) signs nothing: refused.
            (
                r#"{"url": "http://x", "secret": ""}"#,
                "`secret = \"\"` is empty",
            ),
            (
                r#"{"url": "http://x", "bearer_token": ""}"#,
                "`bearer_token = \"\"` is empty",
            ),
            // The host of a request is the configuration's, not an event's.
            (
                r#"{"url": "https://${header.tenant}.example.com/hooks"}"#,
                "allowed_hosts",
            ),
            (
                r#"{"url": "https://x:${header.port}/hooks"}"#,
                "allowed_hosts",
            ),
            (
                r#"{"url": "https://x", "allowed_hosts": ["https://y/"]}"#,
                "`allowed_hosts` entry `https://y/`",
            ),
            (r#"{"url": "https://x/a/../${event_type}"}"#, "dot segment"),
            (
                r#"{"url": "https://x", "secret": "whsec_!!", "signature_scheme": "standard-webhooks"}"#,
                "whsec_",
            ),
            (
                r#"{"url": "https://x", "secret": "s", "signature_scheme": "standard-webhooks", "signature_header": "X-Sig"}"#,
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
    fn a_placeholder_in_the_host_needs_allowed_hosts() {
        let ok = config(
            r#"{"url": "https://${header.tenant}.example.com/hooks", "allowed_hosts": ["*.example.com"]}"#,
        );
        assert!(WebhookSink::connect(ok).is_ok());
    }

    /// `outbox config check` prints the sink configuration through `Serialize`: the `url`
    /// template's password, token and credential-like query values are masked, and so is every
    /// secret field.
    #[test]
    fn printed_configuration_masks_the_url_credentials_and_every_secret() {
        let c = config(
            r#"{"url": "https://user:pw-in-url@hooks.example.com/o/${event_type}?token=tok-in-query&region=eu",
                "username": "user", "password": "basic-pw", "secret": "hunter2"}"#,
        );
        let text = serde_json::to_string(&c).unwrap();
        for secret in ["pw-in-url", "tok-in-query", "basic-pw", "hunter2"] {
            assert!(!text.contains(secret), "{secret} printed: {text}");
        }
        assert!(
            text.contains(
                r#""url":"https://user:***@hooks.example.com/o/${event_type}?token=***&region=eu""#
            ),
            "{text}"
        );
        assert!(text.contains(r#""password":"***""#), "{text}");
        assert!(text.contains(r#""secret":"***""#), "{text}");
        let c = config(r#"{"url": "https://h/x", "bearer_token": "bearer-tok"}"#);
        let text = serde_json::to_string(&c).unwrap();
        assert!(text.contains(r#""bearer_token":"***""#), "{text}");
        assert!(!text.contains("bearer-tok"), "{text}");
    }

    /// Collects what `warn!` writes while `f` runs.
    fn logged(f: impl FnOnce()) -> String {
        let buffer = outbox_testkit::LogBuffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        buffer.text()
    }

    #[test]
    fn credentials_over_plain_http_are_warned_about_with_the_fix() {
        for json in [
            r#"{"url": "http://user:pw@hooks.example.com/x", "secret": "s"}"#,
            r#"{"url": "http://user:pw@hooks.example.com/x", "bearer_token": "t"}"#,
            r#"{"url": "http://user:pw@hooks.example.com/x", "username": "u", "password": "p"}"#,
        ] {
            let out = logged(|| {
                WebhookSink::connect(config(json)).unwrap();
            });
            assert!(out.contains("WARN"), "{json}: {out}");
            assert!(
                out.contains("http://user:***@hooks.example.com/x"),
                "{json}: {out}"
            );
            assert!(
                out.contains("https://") && out.contains("tls = true"),
                "{out}"
            );
            assert!(!out.contains("pw@"), "{out}");
        }
        let out = logged(|| {
            WebhookSink::connect(config(
                r#"{"url": "https://h/x", "allowed_hosts": ["a.example"], "secret": "s"}"#,
            ))
            .unwrap();
        });
        assert!(out.contains("tls = true"), "{out}");
        for quiet in [
            r#"{"url": "https://hooks.example.com/x", "secret": "s"}"#,
            r#"{"url": "http://hooks.example.com/x"}"#,
        ] {
            let out = logged(|| {
                WebhookSink::connect(config(quiet)).unwrap();
            });
            assert!(!out.contains("WARN"), "{quiet}: {out}");
        }
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
