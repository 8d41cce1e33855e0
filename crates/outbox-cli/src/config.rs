//! The relay's configuration: one TOML file, layered with `OUTBOX_…` environment variables and
//! command-line flags (flags win over the environment, which wins over the file).
//!
//! Environment mapping: a double underscore separates levels, so `OUTBOX_DATABASE__URL` sets
//! `database.url` and `OUTBOX_RELAY__BATCH_SIZE` sets `relay.batch_size`.
//!
//! Unknown keys are errors, not silently ignored: a misspelt `bach_size` would otherwise run
//! with the default and nobody would notice.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use outbox_engine::RelayConfig;
use outbox_types::route::{Pattern, RouteRule, RouteTable};
use serde::{Deserialize, Serialize};

/// Top-level sections; environment variables outside them (`OUTBOX_TEST_…`, `OUTBOX_LOG`) are
/// not configuration.
const SECTIONS: [&str; 9] = [
    "database",
    "inbox",
    "relay",
    "destinations",
    "routes",
    "retention",
    "metrics",
    "wal",
    "mode",
];

/// The whole file.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// How the relay finds committed events: `poll` the table (default; every database) or
    /// stream PostgreSQL's `wal` by logical replication (settings in `[wal]`).
    #[serde(default)]
    pub mode: Mode,
    /// Where the outbox lives.
    #[serde(default)]
    pub database: DatabaseConfig,
    /// How the relay claims and retries.
    #[serde(default)]
    pub relay: RelayConfig,
    /// Where events go: one sink per named destination. None configured means one `stdout`.
    #[serde(default)]
    pub destinations: BTreeMap<String, SinkConfig>,
    /// Which destination each event goes to: first match wins.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// How long delivered events are kept.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Prometheus and health endpoints.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// WAL mode settings (used with `mode = "wal"`).
    #[serde(default)]
    pub wal: WalSection,
    /// The consumer-side inbox (`outbox inbox …`).
    #[serde(default)]
    pub inbox: InboxSection,
}

/// `[inbox]`: where a consumer's inbox lives, for `outbox inbox migrate|status|purge|parked`.
/// The database is `[database]`'s unless `database_url` names another one — which is the usual
/// case: the inbox lives in the consuming service's own database, next to the rows its handlers
/// change, while `[database]` is the producing service's outbox.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InboxSection {
    /// The consumer's database (`postgres://…`, `mysql://…`, `sqlite://…`); default: `database.url`.
    #[serde(serialize_with = "outbox_types::redact::serialize_optional_url")]
    pub database_url: Option<String>,
    /// PostgreSQL schema of the inbox tables and the claim function.
    pub schema: String,
    /// Inbox table name; `<table>_parked`, `<table>_migrations` and the claim routine
    /// `<table>_claim` are named after it.
    pub table: String,
    /// Rows processed longer ago than this are deleted by `outbox inbox purge`. A duplicate
    /// arriving later is no longer detected: keep it well above the longest redelivery delay.
    #[serde(with = "outbox_types::humantime_duration")]
    pub retention: std::time::Duration,
    /// Rows deleted per statement (short transactions, no long locks).
    pub batch_size: u32,
}

impl Default for InboxSection {
    fn default() -> Self {
        InboxSection {
            database_url: None,
            schema: "public".into(),
            table: outbox_inbox::DEFAULT_TABLE.into(),
            retention: std::time::Duration::from_secs(7 * 86_400),
            batch_size: 5000,
        }
    }
}

impl Config {
    /// The inbox's database: `inbox.database_url`, else `database.url`.
    pub fn inbox_url(&self) -> &str {
        match &self.inbox.database_url {
            Some(url) if !url.trim().is_empty() => url.trim(),
            _ => self.database.url.trim(),
        }
    }
}

/// What a command needs from the configuration: the outbox's database, or an inbox's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// `[database]`: the relay and the outbox admin commands.
    Outbox,
    /// `[inbox]` (its database may come from `[database]`): `outbox inbox …`.
    Inbox,
}

/// `mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Claim due rows from the outbox table (`FOR UPDATE SKIP LOCKED`, leases).
    #[default]
    Poll,
    /// Stream committed inserts and logical messages from a replication slot.
    Wal,
}

/// `[wal]`: what only WAL mode needs. The database comes from `[database]`; everything the
/// engine does (batch size, retries, dead-letter policy, publish timeout, lanes and cooldown,
/// `--drain`) comes from `[relay]`, the same settings as polling mode.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WalSection {
    /// Logical replication slot name.
    pub slot: String,
    /// Publication name (over the outbox table, inserts only).
    pub publication: String,
    /// Capture sources: `table` (outbox inserts), `stream_table` (inserts into the insert-only
    /// `<table>_stream`), `messages` (`pg_logical_emit_message`), `debezium` (a Debezium outbox
    /// table, read as `[wal.debezium]` says).
    pub sources: Vec<outbox_wal::Source>,
    /// Prefix of the logical messages that carry events.
    pub message_prefix: String,
    /// Create the publication and slot when missing.
    pub create_slot: bool,
    /// When a session starts, rows still undelivered in the table go out first, by table
    /// claims, and newer events of their aggregates wait behind them.
    pub catch_up: bool,
    /// Deprecated: `false` used to leave delivered rows `pending`, which made every restart
    /// deliver them again. Rows are now deleted at delivery instead when it is `false` (set
    /// `retention.delivered = "0s"` for that; this key will go).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mark_delivered: Option<bool>,
    /// How often the confirmed position is reported to the server.
    #[serde(with = "outbox_types::humantime_duration")]
    pub status_interval: std::time::Duration,
    /// Heartbeat message interval (`0ms` = off).
    #[serde(with = "outbox_types::humantime_duration")]
    pub heartbeat_interval: std::time::Duration,
    /// Deprecated: the sink calls in flight are `relay.max_batches_in_flight` in both modes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batches_in_flight: Option<usize>,
    /// Most decoded events in memory before the stream is paused.
    pub max_buffered_events: usize,
    /// Most payload bytes in memory before the stream is paused.
    pub max_buffered_bytes: usize,
    /// How often a standby checks whether the streamer is gone.
    #[serde(with = "outbox_types::humantime_duration")]
    pub standby_poll_interval: std::time::Duration,
    /// How long a new leader waits for the server to release the dead streamer's slot.
    #[serde(with = "outbox_types::humantime_duration")]
    pub takeover_timeout: std::time::Duration,
    /// Longest pause between reconnect attempts.
    #[serde(with = "outbox_types::humantime_duration")]
    pub max_reconnect_backoff: std::time::Duration,
    /// `[wal.debezium]`: the Debezium outbox table and the Outbox Event Router options (under
    /// Debezium's own names) that the `debezium` source reads it with.
    pub debezium: outbox_wal::DebeziumTable,
}

impl Default for WalSection {
    fn default() -> Self {
        let d = outbox_wal::WalConfig::default();
        WalSection {
            slot: d.slot,
            publication: d.publication,
            sources: d.sources,
            message_prefix: d.message_prefix,
            create_slot: d.create_slot,
            catch_up: d.catch_up,
            mark_delivered: None,
            status_interval: d.status_interval,
            heartbeat_interval: d.heartbeat_interval,
            max_batches_in_flight: None,
            max_buffered_events: d.max_buffered_events,
            max_buffered_bytes: d.max_buffered_bytes,
            standby_poll_interval: d.standby_poll_interval,
            takeover_timeout: d.takeover_timeout,
            max_reconnect_backoff: d.max_reconnect_backoff,
            debezium: d.debezium,
        }
    }
}

impl Config {
    /// WAL mode's own settings: `[wal]` and the database of `[database]` (the engine's are
    /// `[relay]`, passed to it as they are).
    pub fn wal_config(&self) -> Result<outbox_wal::WalConfig, ConfigError> {
        let url = self.database.url.trim();
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(ConfigError(
                "`mode = \"wal\"` needs a PostgreSQL `database.url` (logical replication); use `mode = \"poll\"` with other databases".into(),
            ));
        }
        let w = &self.wal;
        if w.max_batches_in_flight.is_some() {
            tracing::warn!(
                "`wal.max_batches_in_flight` is deprecated and ignored: both modes use `relay.max_batches_in_flight`."
            );
        }
        if w.mark_delivered == Some(false) {
            tracing::warn!(
                "`wal.mark_delivered = false` is deprecated: delivered rows are deleted instead of left pending (which made every restart deliver them again); set `retention.delivered = \"0s\"` for the same."
            );
        }
        let mut config = outbox_wal::WalConfig::new(url);
        config.schema = self.database.schema.clone();
        config.table = self
            .database
            .table
            .clone()
            .unwrap_or_else(|| "events".to_owned());
        config.slot = w.slot.clone();
        config.publication = w.publication.clone();
        config.sources = w.sources.clone();
        config.message_prefix = w.message_prefix.clone();
        config.create_slot = w.create_slot;
        config.catch_up = w.catch_up;
        config.delete_on_ack =
            self.retention.delivered.is_zero() || w.mark_delivered == Some(false);
        config.status_interval = w.status_interval;
        config.heartbeat_interval = w.heartbeat_interval;
        config.max_buffered_events = w.max_buffered_events;
        config.max_buffered_bytes = w.max_buffered_bytes;
        config.standby_poll_interval = w.standby_poll_interval;
        config.takeover_timeout = w.takeover_timeout;
        config.max_reconnect_backoff = w.max_reconnect_backoff;
        config.debezium = w.debezium.clone();
        config
            .validate()
            .map_err(|e| ConfigError(format!("invalid `[wal]`: {e}")))?;
        Ok(config)
    }
}

/// `[metrics]`: where `/metrics`, `/healthz` and `/readyz` are served (off unless `listen` is
/// set), and the bounds that keep anyone who can reach the port from holding the relay's
/// sockets (see `observe`'s module docs).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// e.g. `0.0.0.0:9464`.
    pub listen: Option<std::net::SocketAddr>,
    /// How often the backlog gauges are read from the database.
    #[serde(with = "outbox_types::humantime_duration")]
    pub refresh: std::time::Duration,
    /// A request's headers must have arrived this long after the connection (or the previous
    /// response) is ready for them, or the connection is closed: bounds a half-sent request and
    /// an idle keep-alive connection alike.
    #[serde(with = "outbox_types::humantime_duration")]
    pub header_timeout: std::time::Duration,
    /// Most connections open at once; a quarter of them (at least one) from one address. One
    /// more is answered `503` and closed at once, so the port never holds more sockets than
    /// this, whatever arrives.
    pub max_connections: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: None,
            refresh: std::time::Duration::from_secs(10),
            header_timeout: std::time::Duration::from_secs(5),
            max_connections: 64,
        }
    }
}

/// `[retention]`: the relay deletes delivered events after a while, in batches by primary key,
/// and never touches an event in any other state.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Run retention inside `outbox relay`.
    pub enabled: bool,
    /// Delivered events older than this are deleted. `"0s"` keeps nothing: on PostgreSQL the
    /// ack deletes each event's row instead of marking it delivered (about half the ack's
    /// writes); SQLite and MySQL delete them at the next retention run. `outbox replay` then
    /// has no delivered events to replay.
    #[serde(with = "outbox_types::humantime_duration")]
    pub delivered: std::time::Duration,
    /// How often the relay runs retention.
    #[serde(with = "outbox_types::humantime_duration")]
    pub interval: std::time::Duration,
    /// Rows deleted per statement (short transactions, no long locks).
    pub batch_size: u32,
    /// Dead events: `"keep"` (default: an operator decides with `outbox dead requeue|purge`) or
    /// a duration after which they are deleted.
    #[serde(with = "keep_or_duration")]
    pub dead: Option<std::time::Duration>,
}

/// `"keep"` ⇄ `None`, a duration ⇄ `Some`.
mod keep_or_duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            None => s.serialize_str("keep"),
            Some(d) => s.serialize_str(&outbox_types::humantime_duration::format_duration(*d)),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = String::deserialize(d)?;
        if text.trim() == "keep" {
            return Ok(None);
        }
        outbox_types::humantime_duration::parse_duration(&text)
            .map(Some)
            .map_err(|e| serde::de::Error::custom(format!("{e} (or \"keep\")")))
    }
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            enabled: true,
            delivered: std::time::Duration::from_secs(7 * 86_400),
            interval: std::time::Duration::from_secs(3600),
            batch_size: 5000,
            dead: None,
        }
    }
}

/// `[database]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `postgres://user:pass@host:5432/db` or `sqlite://path/to/file.db`.
    pub url: String,
    /// PostgreSQL schema of the outbox table.
    pub schema: String,
    /// Outbox table name (default `events` on PostgreSQL, `outbox_events` on SQLite).
    pub table: Option<String>,
    /// PostgreSQL only: `plain` (default) or `partitioned` — the table range-partitioned by
    /// time, old partitions dropped instead of rows deleted (see `[database.partitions]`).
    pub layout: Layout,
    /// The partitioned layout's settings.
    pub partitions: PartitionsConfig,
}

/// `database.layout`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// One table; retention deletes delivered rows in batches.
    #[default]
    Plain,
    /// Range-partitioned by enqueue time; retention drops whole partitions once every event in
    /// them is delivered and past `retention.delivered`.
    Partitioned,
}

/// `[database.partitions]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PartitionsConfig {
    /// `daily` or `hourly`.
    pub interval: PartitionEvery,
    /// Partitions created ahead of the current one.
    pub ahead: u32,
    /// Longest wait for the table lock that creating or dropping a partition takes.
    #[serde(with = "outbox_types::humantime_duration")]
    pub lock_timeout: std::time::Duration,
}

/// `database.partitions.interval`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionEvery {
    /// One partition per UTC day.
    #[default]
    Daily,
    /// One partition per UTC hour.
    Hourly,
}

impl Default for PartitionsConfig {
    fn default() -> Self {
        PartitionsConfig {
            interval: PartitionEvery::Daily,
            ahead: 3,
            lock_timeout: std::time::Duration::from_secs(5),
        }
    }
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: String::new(),
            schema: "outbox".into(),
            table: None,
            layout: Layout::Plain,
            partitions: PartitionsConfig::default(),
        }
    }
}

/// `[destinations.NAME]`: one destination, `type` naming the sink; the other keys are that
/// sink's own settings.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)]
pub enum SinkConfig {
    /// JSON lines on standard output.
    Stdout(StdoutConfig),
    /// JSON lines appended to a file.
    File(FileSinkConfig),
    /// Apache Kafka (or a Kafka-protocol broker).
    Kafka(KafkaConfig),
    /// RabbitMQ (AMQP 0.9.1) with publisher confirms.
    Rabbitmq(RabbitMqConfig),
    /// NATS JetStream.
    Nats(NatsConfig),
    /// Redis Streams.
    Redis(RedisConfig),
    /// HTTP webhooks.
    Webhook(WebhookConfig),
}

// Each broker sink's settings are its crate's type when the build has the sink; without it, the
// settings are kept as written ([`NotBuilt`]) so the file still loads and the error can say
// which feature the destination needs.
macro_rules! sink_settings {
    ($($name:ident = $feature:literal, $built:ty;)*) => {$(
        #[cfg(feature = $feature)]
        type $name = $built;
        #[cfg(not(feature = $feature))]
        type $name = NotBuilt;
    )*};
}

sink_settings! {
    KafkaConfig = "kafka", outbox_sink_kafka::KafkaSinkConfig;
    RabbitMqConfig = "rabbitmq", outbox_sink_rabbitmq::RabbitMqSinkConfig;
    NatsConfig = "nats", outbox_sink_nats::NatsSinkConfig;
    RedisConfig = "redis", outbox_sink_redis::RedisSinkConfig;
    WebhookConfig = "webhook", outbox_sink_webhook::WebhookSinkConfig;
}

/// The settings of a sink this build does not have, as written.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
#[allow(dead_code)] // which variants hold one depends on the features
pub struct NotBuilt(serde_json::Map<String, serde_json::Value>);

impl SinkConfig {
    /// The `type` as written in the file.
    pub fn kind(&self) -> &'static str {
        match self {
            SinkConfig::Stdout(_) => "stdout",
            SinkConfig::File(_) => "file",
            SinkConfig::Kafka(_) => "kafka",
            SinkConfig::Rabbitmq(_) => "rabbitmq",
            SinkConfig::Nats(_) => "nats",
            SinkConfig::Redis(_) => "redis",
            SinkConfig::Webhook(_) => "webhook",
        }
    }

    /// Why this build cannot deliver to the destination: its sink was not built.
    pub fn built(&self) -> Result<(), NotInBuild> {
        require_feature(self.kind(), format!("`{}` sink", self.kind()))
    }
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig::Stdout(StdoutConfig::default())
    }
}

/// `type = "stdout"`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdoutConfig {
    /// `raw` (default, the event as stored) or `debezium` (the Kafka record a `format =
    /// "debezium"` destination sends: topic, key, headers, value).
    #[serde(default)]
    pub format: outbox_types::routing::BodyFormat,
    /// With `format = "debezium"`: the topic of an event without a destination of its own
    /// (default `outbox.event.${aggregate_type}`).
    #[serde(default)]
    pub topic: Option<outbox_types::routing::Template>,
}

/// `type = "file"`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSinkConfig {
    /// The file (JSON lines, appended).
    pub path: PathBuf,
    /// Force each batch to disk before it counts as delivered.
    #[serde(default)]
    pub sync: bool,
    /// `raw` (default) or `debezium`, as for `stdout`.
    #[serde(default)]
    pub format: outbox_types::routing::BodyFormat,
    /// With `format = "debezium"`: the topic of an event without a destination of its own.
    #[serde(default)]
    pub topic: Option<outbox_types::routing::Template>,
}

impl FileSinkConfig {
    /// The file `path`, raw lines, not synced: the `--sink file:PATH` flag.
    pub fn at(path: impl Into<PathBuf>) -> Self {
        FileSinkConfig {
            path: path.into(),
            sync: false,
            format: Default::default(),
            topic: None,
        }
    }
}

/// `[[routes]]`: events matching `when` go to `to`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// What to match; every key optional; an absent `when` matches every event.
    #[serde(default)]
    pub when: MatchConfig,
    /// The destination name.
    pub to: String,
}

/// Patterns of a route: exact text, `prefix*`, or `*`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    /// Over the event type, e.g. `Order*`.
    pub event_type: Option<Pattern>,
    /// Over the aggregate type, e.g. `order`.
    pub aggregate_type: Option<Pattern>,
    /// Over the event's `destination` column, e.g. `https://*`.
    pub destination: Option<Pattern>,
}

impl Config {
    /// The destinations in effect: those configured, or one `stdout` when none is.
    pub fn effective_destinations(&self) -> BTreeMap<String, SinkConfig> {
        if self.destinations.is_empty() {
            BTreeMap::from([("stdout".to_owned(), SinkConfig::default())])
        } else {
            self.destinations.clone()
        }
    }

    /// Send every event to `sink` (the `--sink` flag): replaces the configured destinations and
    /// routes.
    pub fn override_sink(&mut self, name: &str, sink: SinkConfig) {
        self.destinations = BTreeMap::from([(name.to_owned(), sink)]);
        self.routes.clear();
    }

    /// The route table of the effective destinations and routes.
    pub fn route_table(&self) -> Result<RouteTable, ConfigError> {
        let destinations = self.effective_destinations();
        let rules = self
            .routes
            .iter()
            .map(|r| {
                let mut rule = RouteRule::to(r.to.clone());
                rule.event_type = r.when.event_type.clone();
                rule.aggregate_type = r.when.aggregate_type.clone();
                rule.destination = r.when.destination.clone();
                rule
            })
            .collect();
        RouteTable::new(destinations.keys().cloned(), rules).map_err(|e| {
            let known: Vec<&str> = destinations.keys().map(String::as_str).collect();
            let hint = self
                .routes
                .iter()
                .find(|r| !destinations.contains_key(&r.to))
                .and_then(|r| nearest(&r.to, &known))
                .map(|s| format!("; did you mean `{s}`?"))
                .unwrap_or_default();
            ConfigError(format!("invalid `routes`: {e}{hint}"))
        })
    }
}

/// A configuration problem: the message names the key or value and how to fix it. Exit code 2.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Read `file` (if any), then the environment, then `overrides` (flags), and check the result
/// for the outbox commands.
pub fn load(file: Option<&Path>, overrides: Figment) -> Result<Config, ConfigError> {
    load_for(file, overrides, Need::Outbox)
}

/// [`load`], checked for what the command `need`s.
pub fn load_for(
    file: Option<&Path>,
    overrides: Figment,
    need: Need,
) -> Result<Config, ConfigError> {
    let mut figment = Figment::new();
    if let Some(path) = file {
        if !path.exists() {
            return Err(ConfigError(format!(
                "config file `{}` does not exist",
                path.display()
            )));
        }
        figment = figment.merge(Toml::file(path));
    }
    figment = figment
        .merge(
            Env::prefixed("OUTBOX_")
                .filter(|key| {
                    let key = key.as_str().to_ascii_lowercase();
                    key == "mode" || SECTIONS.iter().any(|s| key.starts_with(&format!("{s}__")))
                })
                .split("__"),
        )
        .merge(overrides);
    let config: Config = figment.extract().map_err(|e| ConfigError(describe(e)))?;
    validate_for(&config, need)?;
    Ok(config)
}

/// The database `url` (the value of `key`) names, when it is one this build supports; else the
/// error naming the key and the fix.
pub fn database_of(key: &str, url: &str) -> Result<Database, ConfigError> {
    let database = Database::of(url).ok_or_else(|| {
        ConfigError(format!(
            "unsupported `{key}` `{}`: use postgres://user@host:5432/db, mysql://user@host:3306/db or sqlite://path/to/file.db",
            outbox_types::redact::redact_url(url)
        ))
    })?;
    database
        .built()
        .map_err(|e| ConfigError(format!("`{key}`: {e}")))?;
    Ok(database)
}

/// The cargo features of this build, in the order `outbox --version` lists them; the sinks'
/// names are their `type`s (stdout and file are always built).
const FEATURES: [(&str, bool); 11] = [
    ("postgres", cfg!(feature = "postgres")),
    ("mysql", cfg!(feature = "mysql")),
    ("sqlite", cfg!(feature = "sqlite")),
    ("kafka", cfg!(feature = "kafka")),
    ("rabbitmq", cfg!(feature = "rabbitmq")),
    ("nats", cfg!(feature = "nats")),
    ("redis", cfg!(feature = "redis")),
    ("webhook", cfg!(feature = "webhook")),
    ("stdout", true),
    ("file", true),
    ("demo", cfg!(feature = "demo")),
];

/// The features this build has, e.g. `["postgres", "webhook", "stdout", "file"]`.
pub fn built_features() -> impl Iterator<Item = &'static str> {
    FEATURES
        .into_iter()
        .filter_map(|(name, on)| on.then_some(name))
}

/// `Ok` when this build has `feature`; else the error saying `what` is missing.
pub fn require_feature(feature: &'static str, what: String) -> Result<(), NotInBuild> {
    if built_features().any(|f| f == feature) {
        Ok(())
    } else {
        Err(NotInBuild { what, feature })
    }
}

/// The kind of database a URL names, whether or not this build supports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Database {
    /// `postgres://…` or `postgresql://…`
    Postgres,
    /// `mysql://…` or `mariadb://…`
    MySql,
    /// `sqlite:…`
    Sqlite,
}

impl Database {
    /// The database `url` names, by its scheme.
    pub fn of(url: &str) -> Option<Database> {
        let url = url.trim();
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Database::Postgres)
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            Some(Database::MySql)
        } else if url.starts_with("sqlite:") {
            Some(Database::Sqlite)
        } else {
            None
        }
    }

    /// `Ok` when this build has the database's cargo feature; else the error naming it.
    pub fn built(self) -> Result<(), NotInBuild> {
        let (name, feature) = match self {
            Database::Postgres => ("PostgreSQL", "postgres"),
            Database::MySql => ("MySQL/MariaDB", "mysql"),
            Database::Sqlite => ("SQLite", "sqlite"),
        };
        require_feature(feature, format!("{name} support"))
    }
}

/// The URL the MySQL driver takes: `mariadb://` is our alias of its `mysql://`.
#[cfg(feature = "mysql")]
pub fn mysql_driver_url(url: &str) -> String {
    match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_owned(),
    }
}

/// A database or sink this binary was built without (its cargo feature was off).
#[derive(Debug)]
pub struct NotInBuild {
    /// What is missing, e.g. "`kafka` sink".
    pub what: String,
    /// The cargo feature that builds it.
    pub feature: &'static str,
}

impl std::fmt::Display for NotInBuild {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { what, feature } = self;
        write!(
            f,
            "this build of outbox has no {what} (built without the `{feature}` cargo feature): use a build that has it — the default `cargo install outbox-cli` has every database and sink — or add the feature to the build's list (`--features postgres,{feature},...`)"
        )
    }
}

impl std::error::Error for NotInBuild {}

/// Checks serde cannot express (names, cross-references, sink settings), for what the command
/// `need`s: the outbox commands need `database.url`; the
/// inbox commands need `inbox.database_url` or `database.url`, and a valid `[inbox]`.
pub fn validate_for(config: &Config, need: Need) -> Result<(), ConfigError> {
    let url = config.database.url.trim();
    match need {
        Need::Outbox if url.is_empty() => {
            return Err(ConfigError(
                "no database URL: set `database.url` in the config file, OUTBOX_DATABASE__URL, or --database-url".into(),
            ));
        }
        Need::Inbox if config.inbox_url().is_empty() => {
            return Err(ConfigError(
                "no inbox database URL: set `inbox.database_url` (the consumer's database) or `database.url` in the config file, OUTBOX_INBOX__DATABASE_URL, or --database-url".into(),
            ));
        }
        _ => {}
    }
    if !url.is_empty() {
        if need == Need::Outbox {
            // The names of the outbox, checked by the validator of the commands that use them.
            crate::store::check_outbox(config)?;
        } else {
            database_of("database.url", url)?;
        }
    }
    if let Some(inbox_url) = &config.inbox.database_url {
        database_of("inbox.database_url", inbox_url.trim())?;
    }
    if config.metrics.max_connections == 0 {
        return Err(ConfigError(
            "`metrics.max_connections = 0` would refuse every probe and scrape: use at least 1 (default 64)".into(),
        ));
    }
    if config.metrics.header_timeout.is_zero() {
        return Err(ConfigError(
            "`metrics.header_timeout` must be above zero, e.g. \"5s\"".into(),
        ));
    }
    if config.inbox.batch_size == 0 {
        return Err(ConfigError("`inbox.batch_size` must be at least 1".into()));
    }
    outbox_inbox::postgres::PgInbox::with_names(&config.inbox.schema, &config.inbox.table)
        .map_err(|e| ConfigError(format!("invalid `[inbox]`: {e}")))?;
    if config.relay.retry.max_attempts == 0 {
        return Err(ConfigError(
            "`relay.retry.max_attempts` must be at least 1 (the first delivery is an attempt)"
                .into(),
        ));
    }
    if config.relay.batch_size == 0 {
        return Err(ConfigError("`relay.batch_size` must be at least 1".into()));
    }
    if config.relay.lease <= config.relay.publish_timeout {
        return Err(ConfigError(format!(
            "`relay.lease` ({}) must be longer than `relay.publish_timeout` ({}): a publish must end before another relay may claim the same events",
            outbox_types::humantime_duration::format_duration(config.relay.lease),
            outbox_types::humantime_duration::format_duration(config.relay.publish_timeout),
        )));
    }
    let effective = config.effective_destinations();
    for name in config.relay.dead_after_unavailable_for.keys() {
        if !effective.contains_key(name) {
            let known: Vec<&str> = effective.keys().map(String::as_str).collect();
            let hint = nearest(name, &known)
                .map(|s| format!("; did you mean `{s}`?"))
                .unwrap_or_default();
            return Err(ConfigError(format!(
                "`relay.dead_after_unavailable_for` names `{name}`, which is not a destination{hint} (destinations: {})",
                known.join(", ")
            )));
        }
    }
    for name in config.destinations.keys() {
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        {
            return Err(ConfigError(format!(
                "invalid destination name `{name}`: use letters, digits, `_`, `-` and `.`"
            )));
        }
    }
    for (name, sink) in &config.destinations {
        validate_sink(sink)
            .map_err(|e| ConfigError(format!("invalid `destinations.{name}`: {e}")))?;
    }
    config.route_table()?;
    if config.mode == Mode::Wal && need == Need::Outbox {
        config.wal_config()?;
    }
    Ok(())
}

/// The sink's own consistency checks, where it has them.
fn validate_sink(sink: &SinkConfig) -> Result<(), String> {
    sink.built().map_err(|e| e.to_string())?;
    match sink {
        #[cfg(feature = "kafka")]
        SinkConfig::Kafka(c) => c.validate().map_err(|e| e.to_string()),
        #[cfg(feature = "rabbitmq")]
        SinkConfig::Rabbitmq(c) => c.validate().map_err(|e| e.to_string()),
        _ => Ok(()),
    }
}

/// One line per problem, naming the key.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            let key = if e.path.is_empty() { None } else { Some(e.path.join(".")) };
            let source = e
                .metadata
                .as_ref()
                .and_then(|m| m.source.as_ref())
                .map(|s| format!(" (from {s})"))
                .unwrap_or_default();
            match (key, &e.kind) {
                (_, figment::error::Kind::UnknownField(field, _)) if field == "sink" && e.path.len() <= 1 => {
                    format!(
                        "invalid configuration: unknown key `sink`{source}: the single [sink] section became named destinations; write [destinations.NAME] with the same keys (`type = \"...\"` and the sink's settings)"
                    )
                }
                (_, figment::error::Kind::UnknownField(field, expected)) => {
                    let suggestion = nearest(field, expected)
                        .map(|s| format!("; did you mean `{s}`?"))
                        .unwrap_or_default();
                    format!(
                        "invalid configuration: unknown key `{}`{source}{suggestion} (valid keys here: {})",
                        qualified(&e.path, field),
                        expected.join(", ")
                    )
                }
                (Some(key), kind) => format!("invalid configuration: `{key}`{source}: {kind}"),
                (None, kind) => format!("invalid configuration{source}: {kind}"),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn qualified(path: &[String], field: &str) -> String {
    let mut parts: Vec<&str> = path.iter().map(String::as_str).collect();
    if parts.last() != Some(&field) {
        parts.push(field);
    }
    parts.join(".")
}

/// The name among `known` closest to `name`, if it is close enough to be a typo.
pub fn nearest_name<'a>(name: &str, known: &[&'a str]) -> Option<&'a str> {
    nearest(name, known)
}

/// The expected key closest to `field` by edit distance, if it is close enough to be a typo.
fn nearest<'a>(field: &str, expected: &[&'a str]) -> Option<&'a str> {
    expected
        .iter()
        .map(|candidate| (levenshtein(field, candidate), *candidate))
        .filter(|(d, c)| *d <= (c.len() / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(row[j]).min(row[j + 1])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

/// Flags given on the command line, as a figment layer.
pub fn flags(pairs: Vec<(&'static str, Option<serde_json::Value>)>) -> Figment {
    let mut figment = Figment::new();
    for (key, value) in pairs {
        if let Some(value) = value {
            figment = figment.merge(Serialized::global(key, value));
        }
    }
    figment
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    /// `text` as the config file is refused, the error naming each of `says`.
    fn refused_saying(text: &str, says: &[&str]) {
        let f = write(text);
        let err = load(Some(f.path()), Figment::new()).unwrap_err().0;
        for needle in says {
            assert!(err.contains(needle), "`{needle}` not in: {err}");
        }
    }

    #[test]
    fn unknown_key_is_named_with_a_suggestion() {
        refused_saying(
            "[database]\nurl = \"postgres://x/y\"\n[relay]\nbach_size = 10\n",
            &[
                "unknown key `relay.bach_size`",
                "did you mean `batch_size`?",
            ],
        );
    }

    #[test]
    fn bad_duration_names_the_key() {
        refused_saying(
            "[database]\nurl = \"postgres://x/y\"\n[relay]\npoll_interval = \"5 parsecs\"\n",
            &["relay.poll_interval", "unknown unit `parsecs`"],
        );
    }

    #[test]
    fn missing_url_says_where_to_set_it() {
        refused_saying("[relay]\nbatch_size = 10\n", &["database.url"]);
    }

    #[test]
    fn flags_override_the_file() {
        let f = write("[database]\nurl = \"postgres://x/y\"\n[relay]\nbatch_size = 10\n");
        let over = flags(vec![("relay.batch_size", Some(serde_json::json!(77)))]);
        let config = load(Some(f.path()), over).unwrap();
        assert_eq!(config.relay.batch_size, 77);
    }

    #[test]
    fn unknown_sink_type_is_rejected_naming_the_destination() {
        refused_saying(
            "[database]\nurl = \"postgres://x/y\"\n[destinations.main]\ntype = \"kafak\"\n",
            &["destinations.main", "kafak", "kafka"],
        );
    }

    #[test]
    fn a_sink_setting_typo_is_named_with_a_suggestion() {
        refused_saying(
            "[database]\nurl = \"postgres://x/y\"\n[destinations.orders]\ntype = \"nats\"\nsubjct = \"orders.>\"\n",
            &["subjct", "destinations.orders", "did you mean `subject`?"],
        );
    }

    #[test]
    fn destinations_and_routes_build_a_route_table() {
        let f = write(
            r#"
[database]
url = "postgres://x/y"
[destinations.orders]
type = "nats"
subject = "orders.${event_type}"
[destinations.hooks]
type = "webhook"
url = "http://127.0.0.1:9/${event_type}"
[[routes]]
when = { aggregate_type = "partner", event_type = "Partner*" }
to = "hooks"
[[routes]]
to = "orders"
"#,
        );
        let config = load(Some(f.path()), Figment::new()).unwrap();
        let routes = config.route_table().unwrap();
        assert_eq!(
            routes.resolve("PartnerPinged", "partner", None),
            Some("hooks")
        );
        assert_eq!(
            routes.resolve("PartnerPinged", "order", None),
            Some("orders")
        );
        assert!(matches!(config.destinations["orders"], SinkConfig::Nats(_)));
    }

    #[test]
    fn a_route_to_a_missing_destination_is_refused() {
        refused_saying(
            "[database]\nurl = \"postgres://x/y\"\n[destinations.orders]\ntype = \"stdout\"\n[[routes]]\nto = \"ordres\"\n",
            &["invalid `routes`", "`ordres`", "did you mean `orders`?"],
        );
    }

    #[test]
    fn no_destination_means_stdout_and_the_flag_replaces_them() {
        let f = write("[database]\nurl = \"postgres://x/y\"\n");
        let mut config = load(Some(f.path()), Figment::new()).unwrap();
        assert_eq!(
            config.route_table().unwrap().resolve("X", "y", None),
            Some("stdout")
        );
        config.override_sink("file", SinkConfig::default());
        assert_eq!(config.route_table().unwrap().destinations(), ["file"]);
    }

    #[test]
    fn dead_retention_is_keep_or_a_duration() {
        let f = write("[database]\nurl = \"postgres://x/y\"\n[retention]\ndead = \"30d\"\n");
        let config = load(Some(f.path()), Figment::new()).unwrap();
        assert_eq!(
            config.retention.dead,
            Some(std::time::Duration::from_secs(30 * 86_400))
        );
        refused_saying(
            "[database]\nurl = \"postgres://x/y\"\n[retention]\ndead = \"forever\"\n",
            &["retention.dead"],
        );
    }
}

#[cfg(test)]
mod example {
    /// The commented example in the repository must stay a valid configuration.
    #[test]
    fn the_example_config_parses() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox.example.toml");
        let config = super::load(Some(&path), figment::Figment::new()).unwrap();
        assert_eq!(config.relay.batch_size, 500);
        assert_eq!(config.relay.retry.max_attempts, 10);
    }

    /// The example with every setting it shows switched off (`#key = …`, `#[table]`) switched
    /// on, and how many it switched.
    fn example_with_every_setting_on() -> (String, usize) {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox.example.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let mut switched = 0;
        let on: String = text
            .lines()
            .map(|line| {
                let rest = line.strip_prefix('#').unwrap_or("");
                let is_setting = rest.starts_with('[')
                    || rest
                        .split_once(" =")
                        .is_some_and(|(k, _)| setting_key(k).is_some());
                if is_setting {
                    switched += 1;
                    format!("{rest}\n")
                } else {
                    format!("{line}\n")
                }
            })
            .collect();
        (on, switched)
    }

    /// Set the environment variables the example's `*_env` settings name.
    fn example_secrets() {
        for var in [
            "KAFKA_PASSWORD",
            "RABBITMQ_PASSWORD",
            "NATS_TOKEN",
            "REDIS_PASSWORD",
            "WEBHOOK_SECRET",
        ] {
            // SAFETY: no other test of this binary reads or writes these variables.
            unsafe { std::env::set_var(var, "example-secret") };
        }
    }

    /// Every setting the example shows switched off (`#key = …`, `#[table]`) must be valid too:
    /// switch them all on and load the result.
    #[test]
    fn the_example_config_parses_with_every_optional_setting_on() {
        let (on, switched) = example_with_every_setting_on();
        assert!(switched > 40, "only {switched} optional settings found");
        example_secrets();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), &on).unwrap();
        let config = super::load(Some(file.path()), figment::Figment::new())
            .unwrap_or_else(|e| panic!("{e}\n---\n{on}"));
        assert_eq!(
            config.destinations.len(),
            7,
            "{:?}",
            config.destinations.keys()
        );
        let routes = config.route_table().unwrap();
        assert_eq!(
            routes.resolve("PartnerPinged", "partner", None),
            Some("partner")
        );
        assert_eq!(routes.resolve("X", "y", Some("audit.log")), Some("kafka"));
        assert_eq!(routes.resolve("X", "y", None), Some("events"));
    }

    /// `(section, key)` of every setting the example mentions: on (`key = …`), switched off
    /// (`#key = …`) or described as an alternative (`# key = …`, e.g. an inline secret beside
    /// its `*_env` twin), under the last `[section]` or `#[section]` header.
    fn mentioned(text: &str) -> std::collections::HashSet<(String, String)> {
        let mut section = String::new();
        let mut keys = std::collections::HashSet::new();
        for line in text.lines() {
            let l = line.trim_start_matches('#').trim_start();
            let list = l.strip_prefix("[[").and_then(|r| r.split_once("]]"));
            if let Some((name, _)) = list {
                // A list of tables is a key of the section above it.
                let (parent, key) = name.rsplit_once('.').unwrap_or(("", name));
                keys.insert((parent.to_owned(), key.to_owned()));
            }
            let header = list.or_else(|| l.strip_prefix('[').and_then(|r| r.split_once(']')));
            if let Some((name, _)) = header {
                section = name.to_owned();
            } else if let Some((key, _)) = l.split_once(" =")
                && let Some(key) = setting_key(key)
            {
                keys.insert((section.clone(), key.to_owned()));
            }
        }
        keys
    }

    /// The key of a setting line: a bare key, or a quoted one with dots (the Debezium option
    /// names of `[wal.debezium]`); `None` for prose.
    fn setting_key(key: &str) -> Option<&str> {
        let name = |k: &str, dots: bool| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || (dots && c == '.'))
        };
        match key.strip_prefix('"').and_then(|k| k.strip_suffix('"')) {
            Some(quoted) if name(quoted, true) => Some(quoted),
            None if name(key, false) => Some(key),
            _ => None,
        }
    }

    /// Every key the configuration accepts, as the loaded example serializes it (every section,
    /// every setting of each sink type the example configures), is in the example, so the
    /// example stays the one place that shows them all. User-named maps (a Kafka destination's
    /// `properties`) are not walked, nor are lists (`routes`).
    #[test]
    fn every_accepted_key_is_in_the_example() {
        let (on, _) = example_with_every_setting_on();
        example_secrets();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), &on).unwrap();
        let config = super::load(Some(file.path()), figment::Figment::new()).unwrap();
        let serialized = serde_json::to_value(&config).unwrap();
        let types: std::collections::HashSet<&str> = serialized["destinations"]
            .as_object()
            .unwrap()
            .values()
            .filter_map(|d| d["type"].as_str())
            .collect();
        assert_eq!(
            types.len(),
            7,
            "the example configures every sink type: {types:?}"
        );
        let mentioned = mentioned(&on);
        fn walk(
            value: &serde_json::Value,
            path: &mut Vec<String>,
            mentioned: &std::collections::HashSet<(String, String)>,
            missing: &mut Vec<String>,
        ) {
            let serde_json::Value::Object(map) = value else {
                return;
            };
            for (key, inner) in map {
                if inner.is_object() {
                    // A section (its keys are checked) or a user-named map.
                    if key != "properties" {
                        path.push(key.clone());
                        walk(inner, path, mentioned, missing);
                        path.pop();
                    }
                } else if !mentioned.contains(&(path.join("."), key.clone())) {
                    missing.push(format!("{}.{key}", path.join(".")));
                }
            }
        }
        let mut missing = Vec::new();
        walk(&serialized, &mut Vec::new(), &mentioned, &mut missing);
        assert!(
            missing.is_empty(),
            "keys the relay accepts that outbox.example.toml does not show: {missing:?}"
        );
    }

    #[test]
    fn dead_after_unavailable_for_names_a_destination() {
        let dir = tempfile::tempdir().unwrap();
        let load = |destination: &str| {
            let path = dir.path().join("outbox.toml");
            std::fs::write(
                &path,
                format!(
                    r#"
[database]
url = "sqlite://outbox.db"
[relay]
dead_after_unavailable = "1h"
[relay.dead_after_unavailable_for]
{destination} = "15m"
[destinations.hook]
type = "stdout"
"#
                ),
            )
            .unwrap();
            crate::config::load(Some(&path), figment::Figment::new())
        };
        let err = load("hooks").unwrap_err().0;
        assert!(
            err.contains("`hooks`, which is not a destination; did you mean `hook`?"),
            "{err}"
        );
        let config = load("hook").unwrap();
        assert_eq!(
            config.relay.unavailable_limit("hook"),
            Some(std::time::Duration::from_secs(900))
        );
        assert_eq!(
            config.relay.unavailable_limit("other"),
            Some(std::time::Duration::from_secs(3600))
        );
    }
}
