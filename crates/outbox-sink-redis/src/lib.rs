//! # outbox-sink-redis
//!
//! Publishes outbox events to **Redis Streams** with `XADD`. An event counts as delivered once
//! Redis answered its `XADD` with the new entry id: the entry is in the stream (and, with Redis
//! persistence or replication configured, as durable as Redis makes it).
//!
//! ## How an event becomes a stream entry
//!
//! The stream key comes from [`outbox_types::routing`], shared by every sink: the event's own
//! `destination` if the writer set one, else the [`stream`](RedisSinkConfig::stream) template
//! (default `events.${event_type}`). Each entry has these fields:
//!
//! | field | value |
//! |---|---|
//! | `id` | the event id (UUID): what consumers deduplicate on |
//! | `type` | the event type, e.g. `OrderCreated` |
//! | `key` | the aggregate id (the routing key) |
//! | `aggregate_type` | e.g. `order` |
//! | `occurred_at` | RFC 3339 |
//! | `idempotency_key` | the writer's key; only present when it set one |
//! | `headers` | a JSON object: the routing headers (`outbox-event-id`, …) and the event's own headers, such as `traceparent` |
//! | `payload` | the stored JSON bytes, or a CloudEvents 1.0 envelope |
//!
//! With `format = "debezium"`, `key` is the aggregate id as a JSON string and `headers` holds
//! `id` and the event's own headers as JSON strings (Debezium's shape). All destinations:
//! `docs/wire-format.md`.
//!
//! Redis assigns entry ids itself (`*`), so a redelivered event (an `XADD` reply lost on the way
//! back, a relay crash) appears twice in the stream; consumers deduplicate on the `id` field,
//! as they must with any at-least-once outbox.
//!
//! ## Throughput
//!
//! All the `XADD`s of a batch go out as one pipeline: one write, one round trip, one reply per
//! command. Per-aggregate order is safe because a relay batch holds at most one event per
//! aggregate, and a pipeline on one connection is executed in order anyway.
//!
//! ## Failures
//!
//! | what happened | outcome |
//! |---|---|
//! | `XADD` answered with an entry id | `Delivered` |
//! | Redis unreachable, connection lost, no reply in time, the whole pipeline failing, `LOADING`, `BUSY`, `OOM`, `READONLY`, `TRYAGAIN`, `MASTERDOWN`, `CLUSTERDOWN`, authentication errors | `Unavailable` (no attempt, however long it lasts) |
//! | any other error for one `XADD` | `Retry` (costs an attempt) |
//! | the key holds another type (`WRONGTYPE`), or the user's ACL does not allow the key (`NOPERM`) | `Reject` |
//! | the entry is larger than [`max_message_bytes`](RedisSinkConfig::max_message_bytes) | `Reject` |
//!
//! [`RedisSink::connect`] never contacts Redis: it validates the configuration, and the first
//! publish connects. After a connection error the connection is dropped and the next publish
//! connects again, so a Redis that is down at start-up or restarts costs retries, not a relay
//! restart.
//!
//! ## TLS
//!
//! A `rediss://` URL (or `tls = true`) connects with TLS, checked against the system's root
//! certificates. TLS uses rustls with the aws-lc-rs provider; if the process has no default rustls
//! provider yet, the sink installs that one (`outbox_tls::ensure_crypto_provider` says why).
//!
//! ```
//! let config: outbox_sink_redis::RedisSinkConfig = serde_json::from_str(r#"{
//!     "url": "redis://127.0.0.1:6379/0",
//!     "stream": "orders:${aggregate_type}",
//!     "maxlen": 1000000,
//!     "response_timeout": "2s"
//! }"#).unwrap();
//! assert_eq!(config.maxlen, Some(1_000_000));
//! ```

use std::time::Duration;

use async_trait::async_trait;
use outbox_sink_common::unique_headers;
use outbox_tls::ensure_crypto_provider;
use outbox_types::redact::redact_url as redact;
use outbox_types::routing::{Routing, Template};
use outbox_types::sink_config::{self, config_error, default_destination};
use outbox_types::{Event, Outcome, Sink, SinkError, humantime_duration, truncate_error};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, ErrorKind, IntoConnectionInfo, RedisError, Value};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tracing::{debug, warn};

/// The body format named in configuration (`raw`, `cloudevents` or `debezium`), shared by
/// every sink.
pub use outbox_types::routing::{BodyFormat, CloudEventsMode};

/// A secret read from configuration, never printed (one type for every sink,
/// [`outbox_types::redact::Secret`], re-exported under this crate's name).
pub use outbox_types::redact::Secret;

outbox_sink_common::config_struct! {
    /// Settings of the Redis sink, as read from the relay's configuration file.
    ///
    /// Every field has a default: an empty table appends raw JSON to the stream
    /// `events.${event_type}` on `redis://127.0.0.1:6379`.
    #[derive(Clone, Debug, Deserialize, Serialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct RedisSinkConfig {
        /// `redis://[user[:password]@]host[:port][/db]`; `rediss://` for TLS. Printed with its
        /// password masked.
        #[serde(serialize_with = "outbox_types::redact::serialize_url")]
        pub url: String = "redis://127.0.0.1:6379".to_owned(),
        /// Stream key template for events that name no destination themselves.
        pub stream: Template = default_destination(),
        @format,
        @cloudevents,
        /// Trim each stream to about this many entries (`XADD … MAXLEN ~ N`); unset keeps everything.
        pub maxlen: Option<u64> = None,
        /// Use TLS even when the URL says `redis://` (a `rediss://` URL always does).
        pub tls: bool = false,
        /// ACL user name (overrides the URL's, as `password` does); `user`, as in every sink.
        pub user: Option<String> = None,
        @username,
        @password,
        /// Connection name shown by `CLIENT LIST` (`CLIENT SETNAME`); no spaces.
        pub client_name: String = "outbox-relay".to_owned(),
        /// Longest wait to connect.
        #[serde(with = "humantime_duration")]
        pub connect_timeout: Duration = Duration::from_secs(5),
        /// Longest wait for the replies of one batch. Keep it below the relay's `publish_timeout`.
        #[serde(with = "humantime_duration")]
        pub response_timeout: Duration = Duration::from_secs(5),
        /// Largest entry (sum of its field sizes) to send; a larger event is rejected instead of
        /// bloating Redis' memory.
        pub max_message_bytes: usize = 16 * 1024 * 1024,
    }
}

impl RedisSinkConfig {
    /// The routing this configuration describes.
    pub fn routing(&self) -> Result<Routing, SinkError> {
        let routing =
            sink_config::routing(self.stream.clone(), self.format, self.cloudevents_keys())?;
        if self.format == BodyFormat::Cloudevents
            && self.cloudevents_mode == Some(CloudEventsMode::Binary)
        {
            return Err(config_error(
                "`cloudevents_mode = \"binary\"` is not available on Redis Streams: CloudEvents defines no Redis binding, so there are no attribute names a consumer could expect; use `cloudevents_mode = \"structured\"` (the default), whose entry `payload` is the JSON envelope",
            ));
        }
        Ok(routing)
    }
}

/// The fields of one stream entry, in order.
type Fields = Vec<(&'static str, Vec<u8>)>;

/// Appends events to Redis Streams. See the [crate docs](crate).
pub struct RedisSink {
    routing: Routing,
    client: Client,
    url: String,
    connection_config: AsyncConnectionConfig,
    client_name: String,
    maxlen: Option<u64>,
    connect_timeout: Duration,
    response_timeout: Duration,
    max_message_bytes: usize,
    /// The live connection and its generation (so a failure seen on an old connection does
    /// not throw away a newer one).
    connection: Mutex<Option<(u64, MultiplexedConnection)>>,
    generation: std::sync::atomic::AtomicU64,
}

impl RedisSink {
    /// Validate `config`; no connection is made until the first publish (or [`Sink::check`]).
    ///
    /// Fails only on configuration that cannot work: a URL that does not parse, a password
    /// variable that is not set, an invalid client name, `maxlen = 0`.
    pub fn connect(config: RedisSinkConfig) -> Result<Self, SinkError> {
        ensure_crypto_provider();
        let routing = config.routing()?;
        let mut url = config.url.trim().to_owned();
        if config.tls {
            if let Some(rest) = url.strip_prefix("redis://") {
                url = format!("rediss://{rest}");
            } else if !url.starts_with("rediss://") {
                return Err(config_error(format!(
                    "`tls = true` needs a `redis://` or `rediss://` URL, not `{}`",
                    redact(&url)
                )));
            }
        }
        let shown = redact(&url);
        let info = url.as_str().into_connection_info().map_err(|e| {
            config_error(format!(
                "`url = \"{shown}\"` is not a Redis URL ({e}): write e.g. `redis://127.0.0.1:6379/0` (or `rediss://` for TLS)"
            ))
        })?;
        let mut settings = info.redis_settings().clone();
        let (user, deprecated) =
            sink_config::user("Redis", config.user.as_ref(), config.username.as_ref())?;
        if let Some(warning) = deprecated {
            tracing::warn!("{warning}");
        }
        if let Some(user) = user {
            settings = settings.set_username(user);
        }
        if let Some(password) =
            sink_config::password(config.password.as_ref(), config.password_env.as_deref())?
        {
            settings = settings.set_password(password);
        }
        if settings.password().is_some()
            && let Some(warning) = outbox_types::redact::cleartext_warning(
                "the Redis password",
                &url,
                url.starts_with("rediss://"),
                "a `rediss://` URL or `tls = true`",
            )
        {
            tracing::warn!("{warning}");
        }
        let info = info.set_redis_settings(settings);
        let client = Client::open(info).map_err(|e| {
            config_error(format!("cannot set up the Redis client for `{shown}`: {e}"))
        })?;

        if config.client_name.is_empty() || config.client_name.chars().any(|c| c.is_whitespace()) {
            return Err(config_error(format!(
                "`client_name = \"{}\"` must be non-empty and without spaces (Redis refuses such names), e.g. `outbox-relay`",
                config.client_name
            )));
        }
        if config.maxlen == Some(0) {
            return Err(config_error(
                "`maxlen = 0` would trim every stream to nothing: remove it to keep every entry, or set e.g. `maxlen = 1000000`",
            ));
        }
        if config.response_timeout.is_zero() || config.connect_timeout.is_zero() {
            return Err(config_error(
                "`connect_timeout` and `response_timeout` must be above zero, e.g. `\"5s\"`",
            ));
        }
        let connection_config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.response_timeout));
        Ok(RedisSink {
            routing,
            client,
            url: shown,
            connection_config,
            client_name: config.client_name,
            maxlen: config.maxlen,
            connect_timeout: config.connect_timeout,
            response_timeout: config.response_timeout,
            max_message_bytes: config.max_message_bytes,
            connection: Mutex::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Check `config` as [`RedisSink::connect`] does (which contacts nothing either; what
    /// `outbox config check` runs).
    pub fn check_config(config: &RedisSinkConfig) -> Result<(), SinkError> {
        Self::connect(config.clone()).map(|_| ())
    }

    /// The connection to use: the current one, or a new one.
    async fn connection(&self) -> Result<(u64, MultiplexedConnection), String> {
        let mut current = self.connection.lock().await;
        if let Some((generation, connection)) = &*current {
            return Ok((*generation, connection.clone()));
        }
        let unreachable = |why: String| {
            format!(
                "Redis unreachable at {}: {why}; the events stay in the outbox and are retried once it is back",
                self.url
            )
        };
        let connect = self
            .client
            .get_multiplexed_async_connection_with_config(&self.connection_config);
        let mut connection =
            match tokio::time::timeout(self.connect_timeout + self.response_timeout, connect).await
            {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return Err(unreachable(e.to_string())),
                Err(_) => {
                    return Err(unreachable(format!(
                        "no connection within {} ms",
                        self.connect_timeout.as_millis()
                    )));
                }
            };
        let named: Result<(), RedisError> = redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg(&self.client_name)
            .query_async(&mut connection)
            .await;
        if let Err(e) = named {
            // Not worth failing deliveries for; the name is only for operators.
            warn!(error = %e, "Redis refused CLIENT SETNAME");
        }
        debug!(url = %self.url, "connected to Redis");
        let generation = self
            .generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        *current = Some((generation, connection.clone()));
        Ok((generation, connection))
    }

    /// Forget connection `generation` so the next publish connects again.
    async fn drop_connection(&self, generation: u64) {
        let mut current = self.connection.lock().await;
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            *current = None;
        }
    }

    /// The stream key and fields of one event; `Err` is a permanent rejection.
    fn entry(&self, event: &Event) -> Result<(String, Fields), String> {
        let key = self.routing.destination(event);
        if key.is_empty() {
            return Err(format!(
                "the stream key is empty (check the event's destination or `stream = \"{}\"`)",
                self.routing.destination.as_str()
            ));
        }
        let headers: serde_json::Map<String, serde_json::Value> =
            unique_headers(self.routing.headers(event))
                .into_iter()
                .map(|(k, v)| (k, serde_json::Value::String(v)))
                .collect();
        let headers = serde_json::to_vec(&headers).map_err(|e| e.to_string())?;
        let mut fields: Fields = Vec::with_capacity(8);
        fields.push(("id", event.id.to_string().into_bytes()));
        fields.push(("type", event.event_type.clone().into_bytes()));
        fields.push(("key", self.routing.key(event).as_bytes().to_vec()));
        fields.push(("aggregate_type", event.aggregate_type.clone().into_bytes()));
        fields.push(("occurred_at", event.occurred_at.to_rfc3339().into_bytes()));
        if let Some(k) = &event.idempotency_key {
            fields.push(("idempotency_key", k.clone().into_bytes()));
        }
        fields.push(("headers", headers));
        fields.push(("payload", self.routing.body(event)));
        let size: usize = key.len() + fields.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        if size > self.max_message_bytes {
            return Err(format!(
                "entry of {size} bytes for stream `{key}` is larger than `max_message_bytes` ({}): message too large",
                self.max_message_bytes
            ));
        }
        Ok((key, fields))
    }
}

/// Whether an error means the connection is no longer usable.
fn breaks_connection(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

/// The failure classification of this sink: the outcome for one `XADD` that Redis answered with
/// an error (unavailable: no attempt; retry or reject: costs one). A batch that fails as a whole
/// is unavailable (see `publish`).
fn classify(key: &str, e: &RedisError) -> Outcome {
    let code = e.code().unwrap_or("");
    let text = truncate_error(&e.to_string());
    match code {
        "WRONGTYPE" => Outcome::reject(format!(
            "key `{key}` holds a value that is not a stream (WRONGTYPE): rename or delete it, or route these events to another key ({text})"
        )),
        "ERR" if text.contains("exceeds maximum") || text.contains("too large") => Outcome::reject(
            format!("Redis refused the entry for `{key}` as too large: {text}"),
        ),
        // NOPERM is about this key (an ACL key pattern): refused for good, like Kafka's topic
        // authorization. Grant the key and `outbox dead requeue`.
        "NOPERM" => Outcome::reject(format!(
            "Redis refused the XADD to `{key}`: the user's ACL does not allow this key ({text}); grant it (ACL SETUSER … ~pattern) or route these events to another key"
        )),
        _ if matches!(e.kind(), ErrorKind::AuthenticationFailed)
            || code == "NOAUTH"
            || code == "WRONGPASS" =>
        {
            Outcome::unavailable(format!(
                "Redis refused the XADD to `{key}` for lack of permission: {text} (check `user`, `password_env` and the user's ACL)"
            ))
        }
        "LOADING" | "BUSY" | "OOM" | "READONLY" | "TRYAGAIN" | "MASTERDOWN" | "CLUSTERDOWN"
        | "NOREPLICAS" => {
            Outcome::unavailable(format!("Redis cannot take the XADD to `{key}` now: {text}"))
        }
        _ if breaks_connection(e) => {
            Outcome::unavailable(format!("XADD to `{key}` failed: {text}"))
        }
        _ => Outcome::retry(format!("XADD to `{key}` failed: {text}")),
    }
}

#[async_trait]
impl Sink for RedisSink {
    fn name(&self) -> &str {
        "redis"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        let mut sent: Vec<(usize, String)> = Vec::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            match self.entry(event) {
                Ok((key, fields)) => {
                    let cmd = pipe.cmd("XADD").arg(&key);
                    if let Some(n) = self.maxlen {
                        cmd.arg("MAXLEN").arg("~").arg(n);
                    }
                    cmd.arg("*");
                    for (name, value) in fields {
                        cmd.arg(name).arg(value);
                    }
                    sent.push((i, key));
                }
                Err(reason) => outcomes[i] = Some(Outcome::reject(truncate_error(&reason))),
            }
        }
        if !sent.is_empty() {
            match self.connection().await {
                Err(reason) => {
                    for (i, _) in &sent {
                        outcomes[*i] = Some(Outcome::unavailable(truncate_error(&reason)));
                    }
                }
                Ok((generation, mut connection)) => {
                    let replies = tokio::time::timeout(
                        self.response_timeout,
                        pipe.query_async::<Vec<redis::RedisResult<Value>>>(&mut connection),
                    )
                    .await;
                    let failure = match replies {
                        Ok(Ok(replies)) if replies.len() == sent.len() => {
                            for ((i, key), reply) in sent.iter().zip(replies) {
                                outcomes[*i] = Some(match reply {
                                    Ok(_) => Outcome::Delivered,
                                    Err(e) => {
                                        if breaks_connection(&e) {
                                            self.drop_connection(generation).await;
                                        }
                                        classify(key, &e)
                                    }
                                });
                            }
                            None
                        }
                        Ok(Ok(replies)) => Some(format!(
                            "Redis answered {} replies to a pipeline of {} XADDs",
                            replies.len(),
                            sent.len()
                        )),
                        Ok(Err(e)) => {
                            if breaks_connection(&e) {
                                self.drop_connection(generation).await;
                            }
                            Some(format!(
                                "Redis at {} failed the batch: {e}; the events stay in the outbox and are retried",
                                self.url
                            ))
                        }
                        Err(_) => {
                            self.drop_connection(generation).await;
                            Some(format!(
                                "no reply from Redis at {} within {} ms",
                                self.url,
                                self.response_timeout.as_millis()
                            ))
                        }
                    };
                    if let Some(reason) = failure {
                        let reason = truncate_error(&reason);
                        for (i, _) in &sent {
                            outcomes[*i] = Some(Outcome::unavailable(reason.clone()));
                        }
                    }
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("internal: no outcome recorded")))
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        let (generation, mut connection) =
            self.connection().await.map_err(SinkError::Unavailable)?;
        let pong: Result<String, RedisError> = tokio::time::timeout(
            self.response_timeout,
            redis::cmd("PING").query_async(&mut connection),
        )
        .await
        .unwrap_or_else(|_| Err(RedisError::from((ErrorKind::Io, "PING timed out"))));
        match pong {
            Ok(_) => Ok(()),
            Err(e) => {
                if breaks_connection(&e) {
                    self.drop_connection(generation).await;
                }
                Err(SinkError::Unavailable(format!(
                    "Redis at {} did not answer PING: {e}",
                    self.url
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_usable() {
        let config: RedisSinkConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config.stream.as_str(), "events.${event_type}");
        assert_eq!(config.url, "redis://127.0.0.1:6379");
        assert!(RedisSink::connect(config).is_ok());
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = serde_json::from_str::<RedisSinkConfig>(r#"{"max_len": 5}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `max_len`"), "{err}");
    }

    #[test]
    fn configuration_mistakes_are_named() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"password_env": "OUTBOX_REDIS_TEST_SURELY_UNSET"}"#,
                "OUTBOX_REDIS_TEST_SURELY_UNSET",
            ),
            (
                r#"{"password": "p", "password_env": "X"}"#,
                "both `password` and `password_env`",
            ),
            (r#"{"url": "http://x"}"#, "not a Redis URL"),
            (r#"{"maxlen": 0}"#, "maxlen = 0"),
            (r#"{"client_name": "a b"}"#, "client_name"),
            (r#"{"format": "cloudevents"}"#, "cloudevents_source"),
            (
                r#"{"format": "cloudevents", "cloudevents_source": "/s", "cloudevents_mode": "binary"}"#,
                "no Redis binding",
            ),
            (
                r#"{"cloudevents_mode": "binary"}"#,
                "applies only with `format = \"cloudevents\"`",
            ),
        ];
        for (json, expected) in cases {
            let config: RedisSinkConfig = serde_json::from_str(json).unwrap();
            let err = match RedisSink::connect(config) {
                Ok(_) => panic!("{json} was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(expected), "{json}: {err}");
        }
    }

    #[test]
    fn urls_are_redacted_and_secrets_hidden() {
        assert_eq!(
            redact("redis://u:p@host:6379/0"),
            "redis://u:***@host:6379/0"
        );
        let config: RedisSinkConfig = serde_json::from_str(r#"{"password": "hunter2"}"#).unwrap();
        assert!(!format!("{config:?}").contains("hunter2"));
    }
}
