//! The settings of a `type = "rabbitmq"` destination and their checks.
//!
//! Validation happens here, before any connection exists, so a wrong setting fails at start-up
//! with a message that names the setting and the fix. A broker that is down at start-up is not
//! a configuration error: the sink connects on first use.

use std::time::Duration;

use lapin::ExchangeKind;
use lapin::uri::{AMQPScheme, AMQPUri};
use outbox_types::redact::redact_url as redact;
use outbox_types::routing::{Routing, Template};
use outbox_types::sink_config;
use outbox_types::{SinkError, humantime_duration};
use serde::{Deserialize, Serialize};

/// The body format named in configuration (`raw`, `cloudevents` or `debezium`), shared by
/// every sink.
pub use outbox_types::routing::BodyFormat;

/// The type of the exchanges created with `declare = true`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeType {
    /// Routing-key patterns (`orders.*`, `#`): the default.
    #[default]
    Topic,
    /// Exact routing keys.
    Direct,
    /// Every bound queue.
    Fanout,
    /// Header matching.
    Headers,
}

impl ExchangeType {
    pub(crate) fn kind(self) -> ExchangeKind {
        match self {
            ExchangeType::Topic => ExchangeKind::Topic,
            ExchangeType::Direct => ExchangeKind::Direct,
            ExchangeType::Fanout => ExchangeKind::Fanout,
            ExchangeType::Headers => ExchangeKind::Headers,
        }
    }
}

/// What an unroutable message (returned by RabbitMQ under `mandatory`) counts as.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unroutable {
    /// Retry with backoff (default): a missing binding is usually a deployment-order problem
    /// (the consumer's queue is bound a little later), and the relay buries the event with the
    /// reason once its attempts run out.
    #[default]
    Retry,
    /// Bury it at once (`outbox dead requeue` brings it back after the binding exists).
    Reject,
}

/// A secret read from configuration, never printed (one type for every sink,
/// [`outbox_types::redact::Secret`], re-exported under this crate's name).
pub use outbox_types::redact::Secret;

outbox_sink_common::config_struct! {
    /// Settings of the RabbitMQ sink, as read from the relay's configuration file.
    ///
    /// Every field has a default: an empty table publishes raw JSON, persistent and mandatory, to
    /// the existing exchange `outbox` on `amqp://127.0.0.1:5672/%2f` with routing key
    /// `${event_type}`, as guest/guest.
    ///
    /// ```
    /// let config: outbox_sink_rabbitmq::RabbitMqSinkConfig = serde_json::from_str(r#"{
    ///     "url": "amqp://rabbit:5672/orders",
    ///     "user": "relay",
    ///     "password": "secret",
    ///     "exchange": "${aggregate_type}.events",
    ///     "routing_key": "${event_type}",
    ///     "declare": true,
    ///     "confirm_timeout": "5s"
    /// }"#).unwrap();
    /// assert!(config.validate().is_ok());
    /// ```
    #[derive(Clone, Debug, Deserialize, Serialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct RabbitMqSinkConfig {
        /// `amqp://host:port/vhost` (`%2f` is the vhost `/`), or `amqps://` for TLS. Credentials are
        /// best given with `user` and `password_env` instead of inside the URL. Printed with its
        /// password masked.
        #[serde(serialize_with = "outbox_types::redact::serialize_url")]
        pub url: String = "amqp://127.0.0.1:5672/%2f".to_owned(),
        /// Talk TLS: turns an `amqp://` URL into `amqps://` (port 5672 becomes 5671).
        pub tls: bool = false,
        /// PEM file of the CA that signed the broker's certificate; the system store when unset.
        pub tls_ca_file: Option<String> = None,
        /// AMQP user (PLAIN); `guest` when neither this nor the URL names one.
        pub user: Option<String> = None,
        @password,
        /// Connection name shown in the management UI.
        pub client_name: String = "outbox-relay".to_owned(),
        /// Exchange template (e.g. `outbox`, `${aggregate_type}.events`); `""` is the default
        /// exchange, which routes on queue names.
        pub exchange: String = "outbox".to_owned(),
        /// Routing-key template for events that name no destination themselves. An event's own
        /// destination is its routing key.
        pub routing_key: Template = default_routing_key(),
        @format,
        @cloudevents,
        /// Publish with `mandatory`, so a message no queue receives comes back instead of vanishing.
        pub mandatory: bool = true,
        /// What a message returned as unroutable counts as: `retry` (default) or `reject`. Never
        /// delivered.
        pub unroutable: Unroutable = Unroutable::Retry,
        /// `delivery_mode = 2`: durable queues keep the message across a broker restart.
        pub persistent: bool = true,
        /// Create each exchange (durable, of `exchange_type`) on first use. Off by default: the sink
        /// declares nothing and expects the exchanges to exist.
        pub declare: bool = false,
        /// Type of the exchanges created with `declare = true`.
        pub exchange_type: ExchangeType = ExchangeType::Topic,
        /// Longest wait for the TCP, TLS and AMQP handshake of one connection attempt.
        #[serde(with = "humantime_duration")]
        pub connect_timeout: Duration = Duration::from_secs(5),
        /// Longest wait for the publisher confirms of a batch. Keep it below the relay's
        /// `publish_timeout`, so the reason recorded is the sink's.
        #[serde(with = "humantime_duration")]
        pub confirm_timeout: Duration = Duration::from_secs(5),
        /// AMQP heartbeat interval (a dead connection is noticed after about twice this).
        #[serde(with = "humantime_duration")]
        pub heartbeat: Duration = Duration::from_secs(10),
        /// Largest body published; a larger event is rejected before it is sent. RabbitMQ's own
        /// limit (`max_message_size`) is 128 MiB by default.
        pub max_message_bytes: u64 = 128 * 1024 * 1024,
    }
}

fn default_routing_key() -> Template {
    // The text parses; the fallback only keeps an `unwrap` out of library code.
    Template::parse("${event_type}").unwrap_or_else(|_| Template::fixed("event"))
}

pub(crate) use sink_config::config_error;

/// Everything the sink needs, checked.
pub(crate) struct Resolved {
    pub routing: Routing,
    /// `None`: the default exchange `""`.
    pub exchange: Option<Template>,
    pub uri: AMQPUri,
    /// `amqp://host:port/vhost` without credentials, for messages.
    pub display_url: String,
    pub ca_pem: Option<String>,
}

impl RabbitMqSinkConfig {
    /// The routing this configuration describes (its destination is the routing key).
    pub fn routing(&self) -> Result<Routing, SinkError> {
        sink_config::routing(
            self.routing_key.clone(),
            self.format,
            self.cloudevents_keys(),
        )
    }

    /// Check every setting without connecting anywhere.
    pub fn validate(&self) -> Result<(), SinkError> {
        self.resolve().map(|_| ())
    }

    fn password(&self) -> Result<Option<String>, SinkError> {
        sink_config::password(self.password.as_ref(), self.password_env.as_deref())
    }

    pub(crate) fn resolve(&self) -> Result<Resolved, SinkError> {
        let routing = self.routing()?;
        let exchange = if self.exchange.is_empty() {
            None
        } else {
            Some(Template::parse(&self.exchange).map_err(|e| {
                config_error(format!(
                    "`exchange`: {e} (write e.g. `exchange = \"outbox\"`, or `\"\"` for the default exchange)"
                ))
            })?)
        };
        if self.exchange.is_empty() && self.declare {
            return Err(config_error(
                "`declare = true` with `exchange = \"\"`: the default exchange cannot be declared; name an exchange or set `declare = false`",
            ));
        }
        let mut uri: AMQPUri = self.url.parse().map_err(|e| {
            config_error(format!(
                "`url = \"{}\"` is not an AMQP URL ({e}): write e.g. `url = \"amqp://127.0.0.1:5672/%2f\"`",
                redact(&self.url)
            ))
        })?;
        let url_has_credentials = self
            .url
            .split_once("://")
            .is_some_and(|(_, rest)| rest.split('/').next().is_some_and(|a| a.contains('@')));
        let password = self.password()?;
        match (&self.user, password) {
            (Some(_), _) if url_has_credentials => {
                return Err(config_error(
                    "`user` is set and `url` holds credentials too: keep one (prefer `user` with `password_env`)",
                ));
            }
            (Some(user), Some(password)) => {
                if user.is_empty() {
                    return Err(config_error("`user` is empty: name the AMQP user"));
                }
                uri.authority.userinfo.username = user.clone();
                uri.authority.userinfo.password = password;
            }
            (Some(user), None) => {
                return Err(config_error(format!(
                    "`user = \"{user}\"` has no password: set `password_env` (or `password`)"
                )));
            }
            (None, Some(_)) => {
                return Err(config_error(
                    "a password is set without `user`: set `user`, or remove the password",
                ));
            }
            (None, None) => {}
        }
        if self.tls && uri.scheme == AMQPScheme::AMQP {
            uri.scheme = AMQPScheme::AMQPS;
            if uri.authority.port == 5672 {
                uri.authority.port = 5671;
            }
        }
        let ca_pem = match &self.tls_ca_file {
            None => None,
            Some(_) if uri.scheme != AMQPScheme::AMQPS => {
                return Err(config_error(
                    "`tls_ca_file` is set but the connection is not TLS: set `tls = true` (or an `amqps://` URL), or remove `tls_ca_file`",
                ));
            }
            Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                config_error(format!(
                    "`tls_ca_file = \"{path}\"` cannot be read ({e}): point it at a PEM file"
                ))
            })?),
        };
        if self.client_name.trim().is_empty() {
            return Err(config_error(
                "`client_name` is empty: name the relay, e.g. `client_name = \"orders-relay\"`",
            ));
        }
        if self.connect_timeout.is_zero() || self.confirm_timeout.is_zero() {
            return Err(config_error(
                "`connect_timeout` and `confirm_timeout` must be above 0, e.g. \"5s\"",
            ));
        }
        let heartbeat = self.heartbeat.as_secs();
        if heartbeat > u64::from(u16::MAX) {
            return Err(config_error(
                "`heartbeat` is over 65535 s: use a few seconds, e.g. `heartbeat = \"10s\"` (or \"0s\" to turn it off)",
            ));
        }
        uri.query.heartbeat = Some(heartbeat as u16);
        uri.query.connection_timeout =
            Some(u64::try_from(self.connect_timeout.as_millis()).unwrap_or(u64::MAX));
        if self.max_message_bytes == 0 {
            return Err(config_error(
                "`max_message_bytes` is 0: use RabbitMQ's `max_message_size` (134217728 by default)",
            ));
        }
        let display_url = format!(
            "{}://{}:{}/{}",
            uri.scheme,
            uri.authority.host,
            uri.authority.port,
            if uri.vhost == "/" {
                "%2f".to_owned()
            } else {
                uri.vhost.clone()
            }
        );
        Ok(Resolved {
            routing,
            exchange,
            uri,
            display_url,
            ca_pem,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> RabbitMqSinkConfig {
        serde_json::from_str(json).unwrap()
    }

    fn error(json: &str) -> String {
        match parse(json).resolve() {
            Ok(_) => panic!("{json} should not validate"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_are_valid_and_use_guest() {
        let resolved = RabbitMqSinkConfig::default().resolve().unwrap();
        assert_eq!(resolved.uri.authority.userinfo.username, "guest");
        assert_eq!(resolved.display_url, "amqp://127.0.0.1:5672/%2f");
        assert_eq!(resolved.uri.query.heartbeat, Some(10));
        assert!(resolved.exchange.is_some());
    }

    #[test]
    fn unknown_settings_are_refused() {
        let err = serde_json::from_str::<RabbitMqSinkConfig>(r#"{"exchang": "x"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `exchang`"), "{err}");
    }

    #[test]
    fn credentials_come_from_user_and_the_environment() {
        let resolved = parse(r#"{"user": "relay", "password": "pw"}"#)
            .resolve()
            .unwrap();
        assert_eq!(resolved.uri.authority.userinfo.username, "relay");
        assert_eq!(resolved.uri.authority.userinfo.password, "pw");
        assert!(!resolved.display_url.contains("pw"));
        assert!(error(r#"{"user": "relay"}"#).contains("has no password"));
        assert!(
            error(r#"{"user": "relay", "password_env": "OUTBOX_RMQ_TEST_UNSET"}"#)
                .contains("export OUTBOX_RMQ_TEST_UNSET")
        );
        assert!(
            error(r#"{"url": "amqp://a:b@h:5672/%2f", "user": "relay", "password": "x"}"#)
                .contains("keep one")
        );
        assert!(
            !format!("{:?}", parse(r#"{"user": "u", "password": "hunter2"}"#)).contains("hunter2")
        );
    }

    #[test]
    fn tls_switches_the_scheme_and_port() {
        let resolved = parse(r#"{"url": "amqp://rabbit:5672/%2f", "tls": true}"#)
            .resolve()
            .unwrap();
        assert_eq!(resolved.uri.scheme, AMQPScheme::AMQPS);
        assert_eq!(resolved.uri.authority.port, 5671);
        assert!(error(r#"{"tls_ca_file": "/nonexistent.pem"}"#).contains("not TLS"));
        assert!(
            error(r#"{"tls": true, "tls_ca_file": "/nonexistent.pem"}"#).contains("cannot be read")
        );
    }

    #[test]
    fn bad_urls_templates_and_combinations_are_named() {
        assert!(error(r#"{"url": "http://x"}"#).contains("`url = \"http://x\"`"));
        assert!(error(r#"{"exchange": "${evnt}"}"#).contains("`exchange`"));
        assert!(error(r#"{"exchange": "", "declare": true}"#).contains("default exchange"));
        assert!(error(r#"{"format": "cloudevents"}"#).contains("cloudevents_source"));
        assert!(error(r#"{"heartbeat": "1d"}"#).contains("heartbeat"));
        let err = serde_json::from_str::<RabbitMqSinkConfig>(r#"{"routing_key": "${nope}"}"#)
            .unwrap_err();
        assert!(err.to_string().contains("unknown field `nope`"), "{err}");
    }
}
