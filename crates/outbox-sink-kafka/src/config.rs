//! The settings of a `type = "kafka"` destination and their translation into librdkafka properties.
//!
//! Validation happens here, before any client exists, so a wrong setting fails at start-up with
//! a message that names the setting and the fix. Nothing in here touches the network: a broker
//! that is down at start-up is the relay's ordinary business (events wait), not a configuration
//! error.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use outbox_types::routing::{Routing, Template};
use outbox_types::sink_config::{self, default_destination};
use outbox_types::{SinkError, humantime_duration};
use rdkafka::ClientConfig;
use serde::{Deserialize, Deserializer, Serialize};

/// The body format named in configuration (`raw`, `cloudevents` or `debezium`), shared by
/// every sink.
pub use outbox_types::routing::BodyFormat;

/// What a record's timestamp says (the `CreateTime` the broker stores and consumers, retention
/// and time-based offset lookups read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordTimestamp {
    /// When the relay published the record (the producer's clock; Kafka's usual meaning).
    #[default]
    PublishTime,
    /// When the event happened: its `occurred_at`, in milliseconds. Consumers that window or
    /// look up offsets by time then see business time, also for a backlog delivered late. A
    /// broker that limits how far a timestamp may lie in the past
    /// (`log.message.timestamp.before.max.ms`, older brokers `…difference.max.ms`) refuses older
    /// events: the sink answers `Reject` naming the topic, and they are dead-lettered.
    OccurredAt,
}

/// Compression of record batches (`compression.type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// No compression (librdkafka's default).
    #[default]
    None,
    /// gzip: smallest, slowest.
    Gzip,
    /// snappy.
    Snappy,
    /// lz4: cheap on CPU, a good default for JSON.
    Lz4,
    /// zstd.
    Zstd,
}

impl Compression {
    fn as_str(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Gzip => "gzip",
            Compression::Snappy => "snappy",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        }
    }
}

/// How a record's key (the aggregate id) picks its partition. Every choice hashes the key, so
/// one aggregate always lands in one partition; `random` is not offered because it would not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Partitioner {
    /// Murmur2 hash of the key, as the Java producer does (default): records of an aggregate go
    /// to the same partition as a Java or Kafka Streams producer would send them.
    #[default]
    Murmur2Random,
    /// Murmur2 hash of the key.
    Murmur2,
    /// CRC32 hash of the key (librdkafka's own default).
    ConsistentRandom,
    /// CRC32 hash of the key.
    Consistent,
    /// FNV-1a hash of the key.
    Fnv1aRandom,
    /// FNV-1a hash of the key.
    Fnv1a,
}

impl Partitioner {
    fn as_str(self) -> &'static str {
        match self {
            Partitioner::Murmur2Random => "murmur2_random",
            Partitioner::Murmur2 => "murmur2",
            Partitioner::ConsistentRandom => "consistent_random",
            Partitioner::Consistent => "consistent",
            Partitioner::Fnv1aRandom => "fnv1a_random",
            Partitioner::Fnv1a => "fnv1a",
        }
    }
}

/// SASL mechanism used with `user` and a password.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum SaslMechanism {
    /// `PLAIN` (default): send it over TLS only.
    #[default]
    #[serde(rename = "PLAIN", alias = "plain")]
    Plain,
    /// `SCRAM-SHA-256`.
    #[serde(rename = "SCRAM-SHA-256", alias = "scram-sha-256")]
    ScramSha256,
    /// `SCRAM-SHA-512`.
    #[serde(rename = "SCRAM-SHA-512", alias = "scram-sha-512")]
    ScramSha512,
}

impl SaslMechanism {
    fn as_str(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// A secret read from configuration, never printed (one type for every sink,
/// [`outbox_types::redact::Secret`], re-exported under this crate's name).
pub use outbox_types::redact::Secret;

/// A librdkafka property value as written in the file: text, a number or a boolean.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum PropertyValue {
    /// `"lz4"`, `"1000"`.
    Text(String),
    /// `1000`.
    Integer(i64),
    /// `true`.
    Bool(bool),
}

impl fmt::Display for PropertyValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PropertyValue::Text(t) => f.write_str(t),
            PropertyValue::Integer(i) => write!(f, "{i}"),
            PropertyValue::Bool(b) => write!(f, "{b}"),
        }
    }
}

outbox_sink_common::config_struct! {
    /// Settings of the Kafka sink, as read from the relay's configuration file.
    ///
    /// Every field has a default: an empty table publishes raw JSON to `events.${event_type}` on
    /// `127.0.0.1:9092` with the idempotent producer.
    ///
    /// ```
    /// let config: outbox_sink_kafka::KafkaSinkConfig = serde_json::from_str(r#"{
    ///     "brokers": "k1:9092,k2:9092",
    ///     "topic": "${aggregate_type}.events",
    ///     "compression": "lz4",
    ///     "linger": "10ms",
    ///     "properties": { "queue.buffering.max.kbytes": 65536 }
    /// }"#).unwrap();
    /// assert_eq!(config.brokers, vec!["k1:9092".to_owned(), "k2:9092".to_owned()]);
    /// assert!(config.validate().is_ok());
    /// ```
    #[derive(Clone, Debug, Deserialize, Serialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct KafkaSinkConfig {
        /// Bootstrap brokers as `host:port`, a list or one comma-separated string. Prefer IPv4
        /// literals or names that resolve to the address the broker listens on.
        #[serde(
        deserialize_with = "string_or_list",
        serialize_with = "outbox_types::redact::serialize_url_list"
        )]
        pub brokers: Vec<String> = vec!["127.0.0.1:9092".to_owned()],
        /// Topic template for events that name no destination themselves.
        pub topic: Template = default_destination(),
        @format,
        /// The records' timestamp: `publish_time` (default) or `occurred_at`.
        pub record_timestamp: RecordTimestamp = RecordTimestamp::PublishTime,
        @cloudevents,
        /// Talk TLS to the brokers (`security.protocol` `ssl`, or `sasl_ssl` with a `user`).
        pub tls: bool = false,
        /// PEM file of the CA that signed the brokers' certificates (`ssl.ca.location`); the system
        /// store when unset.
        pub tls_ca_file: Option<String> = None,
        /// SASL user; needs `password` or `password_env`.
        pub user: Option<String> = None,
        @password,
        /// `PLAIN` (default), `SCRAM-SHA-256` or `SCRAM-SHA-512`.
        pub sasl_mechanism: SaslMechanism = SaslMechanism::Plain,
        /// `client.id`, shown in broker logs and quotas.
        pub client_id: String = "outbox-relay".to_owned(),
        /// `none` (default), `gzip`, `snappy`, `lz4` or `zstd`.
        pub compression: Compression = Compression::None,
        /// How a key picks its partition (default `murmur2_random`, the Java producer's hash).
        pub partitioner: Partitioner = Partitioner::Murmur2Random,
        /// `allow.auto.create.topics`: let the broker create a missing topic on first use (when the
        /// broker allows it too). With `false`, events for a missing topic are rejected.
        pub allow_auto_create_topics: bool = true,
        /// `linger.ms`: how long the producer waits to fill a record batch.
        #[serde(with = "humantime_duration")]
        pub linger: Duration = Duration::from_millis(5),
        /// `batch.size`: most bytes in one record batch.
        pub batch_size: u32 = 1_000_000,
        /// `batch.num.messages`: most records in one record batch.
        pub batch_num_messages: u32 = 10_000,
        /// `message.max.bytes`: the largest request the producer builds; a record larger than this
        /// is rejected before it is sent. Keep it at or below the broker's and topic's limit.
        pub max_message_bytes: Option<u32> = None,
        /// `message.timeout.ms`: how long librdkafka may try to deliver one record (retries
        /// included) before the sink answers `Retry`. Keep it below the relay's `publish_timeout`
        /// so the reason recorded is the sink's, not a relay timeout.
        #[serde(with = "humantime_duration")]
        pub delivery_timeout: Duration = Duration::from_secs(5),
        /// `request.timeout.ms`: how long one produce request waits for the broker's answer.
        #[serde(with = "humantime_duration")]
        pub request_timeout: Duration = Duration::from_secs(5),
        /// `socket.connection.setup.timeout.ms`: TCP, TLS and SASL set-up of one broker connection
        /// (at least 1s).
        #[serde(with = "humantime_duration")]
        pub connect_timeout: Duration = Duration::from_secs(5),
        /// Further librdkafka properties, passed through as they are (e.g.
        /// `"queue.buffering.max.kbytes" = 65536`). Properties the sink sets from the settings above
        /// cannot be given here, and the ones its guarantees rest on (`enable.idempotence`, `acks`)
        /// cannot be changed at all.
        #[serde(serialize_with = "masked_properties")]
        pub properties: BTreeMap<String, PropertyValue> = BTreeMap::new(),
    }
}

/// Properties as printed by `outbox config check`: values of credential-like keys
/// (`sasl.password`, `ssl.key.password`, `*.secret`, tokens, inline `*.pem`,
/// `sasl.oauthbearer.config`: [`outbox_types::redact::is_secret_key`]) are masked.
fn masked_properties<S: serde::Serializer>(
    properties: &BTreeMap<String, PropertyValue>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = s.serialize_map(Some(properties.len()))?;
    for (key, value) in properties {
        if outbox_types::redact::is_secret_key(key) {
            map.serialize_entry(key, outbox_types::redact::MASK)?;
        } else {
            map.serialize_entry(key, value)?;
        }
    }
    map.end()
}

fn string_or_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let items = match OneOrMany::deserialize(d)? {
        OneOrMany::One(text) => text.split(',').map(str::to_owned).collect(),
        OneOrMany::Many(list) => list,
    };
    Ok(items
        .into_iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect())
}

/// Properties the sink owns: the setting to use instead, or `None` when it cannot be changed.
const MANAGED: &[(&str, Option<&str>)] = &[
    ("enable.idempotence", None),
    ("acks", None),
    ("request.required.acks", None),
    ("bootstrap.servers", Some("brokers")),
    ("metadata.broker.list", Some("brokers")),
    ("security.protocol", Some("tls / user")),
    ("sasl.mechanism", Some("sasl_mechanism")),
    ("sasl.mechanisms", Some("sasl_mechanism")),
    ("sasl.username", Some("user")),
    ("sasl.password", Some("password / password_env")),
    ("ssl.ca.location", Some("tls_ca_file")),
    ("client.id", Some("client_id")),
    ("compression.type", Some("compression")),
    ("compression.codec", Some("compression")),
    ("partitioner", Some("partitioner")),
    ("allow.auto.create.topics", Some("allow_auto_create_topics")),
    ("linger.ms", Some("linger")),
    ("queue.buffering.max.ms", Some("linger")),
    ("batch.size", Some("batch_size")),
    ("batch.num.messages", Some("batch_num_messages")),
    ("message.max.bytes", Some("max_message_bytes")),
    ("message.timeout.ms", Some("delivery_timeout")),
    ("delivery.timeout.ms", Some("delivery_timeout")),
    ("request.timeout.ms", Some("request_timeout")),
    (
        "socket.connection.setup.timeout.ms",
        Some("connect_timeout"),
    ),
];

pub(crate) use sink_config::config_error;

fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

impl KafkaSinkConfig {
    /// The routing this configuration describes.
    pub fn routing(&self) -> Result<Routing, SinkError> {
        sink_config::routing(self.topic.clone(), self.format, self.cloudevents_keys())
    }

    /// Check every setting without connecting anywhere.
    pub fn validate(&self) -> Result<(), SinkError> {
        self.client_config().map(|_| ())
    }

    /// The SASL password, from `password` or the variable named by `password_env`.
    fn password(&self) -> Result<Option<String>, SinkError> {
        sink_config::password(self.password.as_ref(), self.password_env.as_deref())
    }

    /// The brokers as one `bootstrap.servers` string, checked.
    pub(crate) fn bootstrap_servers(&self) -> Result<String, SinkError> {
        if self.brokers.is_empty() {
            return Err(config_error(
                "`brokers` is empty: list at least one broker, e.g. `brokers = [\"127.0.0.1:9092\"]`",
            ));
        }
        for broker in &self.brokers {
            let valid = broker.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty()
                    && !host.contains("://")
                    && port.parse::<u16>().is_ok_and(|p| p > 0)
            });
            if !valid {
                return Err(config_error(format!(
                    "`brokers` entry `{broker}` is not `host:port`: write e.g. `brokers = [\"kafka-1:9092\"]` (no scheme; TLS is `tls = true`)"
                )));
            }
        }
        Ok(self.brokers.join(","))
    }

    /// The librdkafka configuration of the producer, after checking every setting.
    pub(crate) fn client_config(&self) -> Result<ClientConfig, SinkError> {
        self.routing()?;
        let servers = self.bootstrap_servers()?;
        if self.client_id.trim().is_empty() {
            return Err(config_error(
                "`client_id` is empty: name the relay, e.g. `client_id = \"orders-relay\"`",
            ));
        }
        if self.delivery_timeout.is_zero() {
            return Err(config_error(
                "`delivery_timeout` is 0, which librdkafka reads as \"wait forever\": give a bound below the relay's `publish_timeout`, e.g. `delivery_timeout = \"5s\"`",
            ));
        }
        if self.delivery_timeout <= self.linger {
            return Err(config_error(format!(
                "`delivery_timeout` ({} ms) must be longer than `linger` ({} ms): raise `delivery_timeout` or lower `linger`",
                self.delivery_timeout.as_millis(),
                self.linger.as_millis()
            )));
        }
        if self.linger > Duration::from_secs(900) {
            return Err(config_error(
                "`linger` is over 15 minutes, librdkafka's limit: use a few milliseconds, e.g. `linger = \"5ms\"`",
            ));
        }
        if self.request_timeout.is_zero() || self.request_timeout > Duration::from_secs(900) {
            return Err(config_error(
                "`request_timeout` must be between 1ms and 15m, e.g. `request_timeout = \"5s\"`",
            ));
        }
        if self.connect_timeout < Duration::from_secs(1) {
            return Err(config_error(
                "`connect_timeout` must be at least 1s (librdkafka's minimum), e.g. `connect_timeout = \"5s\"`",
            ));
        }
        if self.batch_size == 0 || self.batch_num_messages == 0 {
            return Err(config_error(
                "`batch_size` and `batch_num_messages` must be at least 1 (defaults: 1000000 bytes, 10000 records)",
            ));
        }
        if let Some(max) = self.max_message_bytes
            && !(1000..=1_000_000_000).contains(&max)
        {
            return Err(config_error(format!(
                "`max_message_bytes = {max}` is outside librdkafka's range 1000..=1000000000"
            )));
        }
        let password = self.password()?;
        match (&self.user, &password) {
            (Some(user), None) => {
                return Err(config_error(format!(
                    "`user = \"{user}\"` has no password: set `password_env` (or `password`)"
                )));
            }
            (None, Some(_)) => {
                return Err(config_error(
                    "a SASL password is set without `user`: set `user`, or remove the password",
                ));
            }
            (Some(user), Some(_)) if user.trim().is_empty() => {
                return Err(config_error("`user` is empty: name the SASL user"));
            }
            _ => {}
        }
        if self.tls_ca_file.is_some() && !self.tls {
            return Err(config_error(
                "`tls_ca_file` is set but `tls = false`: set `tls = true`, or remove `tls_ca_file`",
            ));
        }
        for key in self.properties.keys() {
            if let Some((_, instead)) = MANAGED.iter().find(|(k, _)| k == key) {
                return Err(config_error(match instead {
                    Some(setting) => format!(
                        "`properties.\"{key}\"` is set by the sink: use the `{setting}` setting instead"
                    ),
                    None => format!(
                        "`properties.\"{key}\"` cannot be changed: the sink relies on the idempotent producer with acks=all to count a record as delivered only once every in-sync replica has it, without duplicates from its own retries"
                    ),
                }));
            }
        }

        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", servers)
            .set("client.id", self.client_id.trim())
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("compression.type", self.compression.as_str())
            .set("partitioner", self.partitioner.as_str())
            .set(
                "allow.auto.create.topics",
                self.allow_auto_create_topics.to_string(),
            )
            .set("linger.ms", millis(self.linger))
            .set("batch.size", self.batch_size.to_string())
            .set("batch.num.messages", self.batch_num_messages.to_string())
            .set("message.timeout.ms", millis(self.delivery_timeout))
            .set("request.timeout.ms", millis(self.request_timeout))
            .set(
                "socket.connection.setup.timeout.ms",
                millis(self.connect_timeout),
            );
        if let Some(max) = self.max_message_bytes {
            config.set("message.max.bytes", max.to_string());
        }
        let protocol = match (self.tls, self.user.is_some()) {
            (false, false) => "plaintext",
            (true, false) => "ssl",
            (false, true) => "sasl_plaintext",
            (true, true) => "sasl_ssl",
        };
        config.set("security.protocol", protocol);
        if let Some(ca) = &self.tls_ca_file {
            config.set("ssl.ca.location", ca);
        }
        if let (Some(user), Some(password)) = (&self.user, password) {
            config
                .set("sasl.mechanism", self.sasl_mechanism.as_str())
                .set("sasl.username", user)
                .set("sasl.password", password);
        }
        for (key, value) in &self.properties {
            config.set(key, value.to_string());
        }
        Ok(config)
    }
}

impl KafkaSinkConfig {
    /// Why these settings would send a credential in clear text, if they would: SASL `PLAIN`
    /// without TLS puts the password on the wire as it is (SCRAM sends only a proof of it).
    pub fn cleartext_warning(&self) -> Option<String> {
        if self.tls || self.user.is_none() || self.sasl_mechanism != SaslMechanism::Plain {
            return None;
        }
        Some(format!(
            "SASL PLAIN without TLS sends the Kafka password for `{}` in clear text to {}: set `tls = true` (or use `sasl_mechanism = \"SCRAM-SHA-512\"`)",
            self.user.as_deref().unwrap_or_default(),
            self.brokers.join(",")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> KafkaSinkConfig {
        serde_json::from_str(json).unwrap()
    }

    fn message(result: Result<ClientConfig, SinkError>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn defaults_give_the_idempotent_producer() {
        let config = KafkaSinkConfig::default().client_config().unwrap();
        assert_eq!(config.get("enable.idempotence"), Some("true"));
        assert_eq!(config.get("acks"), Some("all"));
        assert_eq!(config.get("partitioner"), Some("murmur2_random"));
        assert_eq!(config.get("security.protocol"), Some("plaintext"));
        assert_eq!(config.get("message.timeout.ms"), Some("5000"));
    }

    #[test]
    fn unknown_settings_and_bare_numbers_for_durations_are_refused() {
        let err = serde_json::from_str::<KafkaSinkConfig>(r#"{"broker": "x:1"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `broker`"), "{err}");
        let err = serde_json::from_str::<KafkaSinkConfig>(r#"{"linger": "5"}"#).unwrap_err();
        assert!(err.to_string().contains("invalid duration"), "{err}");
    }

    #[test]
    fn brokers_must_be_host_and_port() {
        let err = message(parse(r#"{"brokers": ["kafka"]}"#).client_config());
        assert!(err.contains("`brokers` entry `kafka`"), "{err}");
        let err = message(parse(r#"{"brokers": "PLAINTEXT://k:9092"}"#).client_config());
        assert!(err.contains("no scheme"), "{err}");
        let err = message(parse(r#"{"brokers": []}"#).client_config());
        assert!(err.contains("`brokers` is empty"), "{err}");
    }

    #[test]
    fn plain_sasl_without_tls_is_warned_about() {
        let warning = |json: &str| parse(json).cleartext_warning();
        let w = warning(r#"{"user": "relay", "password": "pw"}"#).unwrap();
        assert!(w.contains("clear text") && w.contains("tls = true"), "{w}");
        assert!(!w.contains("pw\""), "{w}");
        assert!(warning(r#"{"user": "relay", "password": "pw", "tls": true}"#).is_none());
        assert!(
            warning(r#"{"user": "relay", "password": "pw", "sasl_mechanism": "SCRAM-SHA-256"}"#)
                .is_none()
        );
        assert!(warning("{}").is_none());
    }

    #[test]
    fn sasl_and_tls_settings_become_the_security_protocol() {
        let config = parse(
            r#"{"tls": true, "user": "relay", "password": "pw", "sasl_mechanism": "SCRAM-SHA-512"}"#,
        )
        .client_config()
        .unwrap();
        assert_eq!(config.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(config.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(config.get("sasl.password"), Some("pw"));
        let err = message(parse(r#"{"user": "relay"}"#).client_config());
        assert!(err.contains("has no password"), "{err}");
        let err = message(
            parse(r#"{"user": "relay", "password_env": "OUTBOX_KAFKA_TEST_UNSET_VAR"}"#)
                .client_config(),
        );
        assert!(err.contains("export OUTBOX_KAFKA_TEST_UNSET_VAR"), "{err}");
    }

    #[test]
    fn secrets_are_not_printed() {
        let config = parse(r#"{"user": "relay", "password": "hunter2"}"#);
        assert!(!format!("{config:?}").contains("hunter2"));
    }

    #[test]
    fn properties_pass_through_but_cannot_break_the_guarantees() {
        let config = parse(
            r#"{"properties": {"queue.buffering.max.kbytes": 65536, "enable.ssl.certificate.verification": false}}"#,
        )
        .client_config()
        .unwrap();
        assert_eq!(config.get("queue.buffering.max.kbytes"), Some("65536"));
        assert_eq!(
            config.get("enable.ssl.certificate.verification"),
            Some("false")
        );
        let err = message(parse(r#"{"properties": {"acks": "1"}}"#).client_config());
        assert!(err.contains("cannot be changed"), "{err}");
        let err = message(parse(r#"{"properties": {"linger.ms": 50}}"#).client_config());
        assert!(err.contains("use the `linger` setting"), "{err}");
    }

    #[test]
    fn cloudevents_needs_a_source() {
        let err = message(parse(r#"{"format": "cloudevents"}"#).client_config());
        assert!(err.contains("cloudevents_source"), "{err}");
        assert!(
            parse(r#"{"format": "cloudevents", "cloudevents_source": "/orders"}"#)
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn timeouts_are_checked() {
        let err = message(parse(r#"{"delivery_timeout": "0s"}"#).client_config());
        assert!(err.contains("wait forever"), "{err}");
        let err =
            message(parse(r#"{"delivery_timeout": "10ms", "linger": "20ms"}"#).client_config());
        assert!(err.contains("longer than `linger`"), "{err}");
        let err = message(parse(r#"{"connect_timeout": "100ms"}"#).client_config());
        assert!(err.contains("at least 1s"), "{err}");
    }
}
