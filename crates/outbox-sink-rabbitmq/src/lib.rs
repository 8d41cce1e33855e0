//! # outbox-sink-rabbitmq
//!
//! Publishes outbox events to **RabbitMQ** (AMQP 0-9-1) with [`lapin`]. An event counts as
//! delivered only once RabbitMQ **confirmed** it (publisher confirms, `confirm.select` on every
//! channel the sink publishes on) and did **not** return it as unroutable: with `persistent`
//! messages and durable queues, a confirm means the message is written to disk in every queue it
//! was routed to.
//!
//! ## How an event becomes a message
//!
//! Everything comes from [`outbox_types::routing`], shared by every sink:
//!
//! - **Exchange**: the [`exchange`](RabbitMqSinkConfig::exchange) template rendered over the
//!   event (default `outbox`; `""` is the default exchange).
//! - **Routing key**: the routing destination — the event's own `destination` if the writer set
//!   one, else the [`routing_key`](RabbitMqSinkConfig::routing_key) template (default
//!   `${event_type}`). So with the defaults a consumer binds its queue to `outbox` with
//!   `OrderCreated`, or `#` on the (topic) exchange for everything.
//! - **Properties**: `message_id` = the event id (what consumers deduplicate on),
//!   `delivery_mode` 2 (persistent), `content_type` (`application/json`, or
//!   `application/cloudevents+json`), `type` = the event type, `timestamp` = when it occurred,
//!   `app_id` = `client_name`.
//! - **Headers** (an AMQP table of long strings): `outbox-event-id`, `outbox-event-type`,
//!   `outbox-aggregate-type`, `outbox-aggregate-id` (the key), `outbox-occurred-at`,
//!   `outbox-idempotency-key`, then the event's own headers such as `traceparent`; and
//!   [`TIMESTAMP_IN_MS`] (`timestamp_in_ms`, a 64-bit integer: the property `timestamp` has
//!   whole seconds only). CloudEvents binary mode adds the attributes as `ce-` headers, as
//!   RabbitMQ's CloudEvents binding names them.
//! - **Body**: the stored JSON bytes, or a CloudEvents 1.0 structured envelope (binary mode:
//!   the stored bytes).
//!
//! The sink **declares nothing** unless `declare = true`, which creates each exchange (durable,
//! of `exchange_type`, default `topic`) on first use. Queues and bindings belong to consumers.
//!
//! ## Throughput
//!
//! A relay batch holds at most one event per aggregate, so the whole batch is published at once
//! on one confirm-mode channel, then all its confirms are awaited together: a batch costs about
//! one round trip, not one per message. Channels are pooled between batches; concurrent
//! batches use separate channels, so a channel error in one does not fail the other.
//!
//! ## Failures
//!
//! | what happened | outcome |
//! |---|---|
//! | confirmed (`basic.ack`) and not returned | `Delivered` |
//! | returned as unroutable (`mandatory`, 312 NO_ROUTE) | `Retry` by default, `Reject` with `unroutable = "reject"`; never `Delivered` |
//! | `basic.nack` (a queue's `reject-publish` overflow, an internal error) | `Unavailable` (no attempt, however long it lasts) |
//! | broker unreachable, connection or channel lost, socket error, no answer within `connect_timeout`, no confirm within `confirm_timeout` | `Unavailable` (no attempt, however long it lasts); the next call reconnects |
//! | the broker closed the channel for another reason (another message of the batch may have caused it) | `Retry` (costs an attempt) |
//! | exchange does not exist (404 NOT_FOUND) | `Reject`, naming the exchange and the fix |
//! | access to the exchange refused (403 ACCESS_REFUSED) | `Reject`, naming the exchange and user |
//! | body larger than `max_message_bytes` or RabbitMQ's `max_message_size` | `Reject` |
//! | properties and headers too large for one frame (`frame_max`, negotiated with the broker: 128 KiB by default) | `Reject`, naming both sizes; checked before sending |
//! | exchange or routing key longer than 255 bytes | `Reject` |
//!
//! **Why unroutable is `Retry` by default**: a message that no queue receives usually means a
//! consumer has not bound its queue *yet* (deployed after the producer, or re-creating its
//! topology). Retrying with backoff delivers the event once the binding exists, and an event
//! that stays unroutable is buried by the relay with the reason when its attempts run out.
//! `unroutable = "reject"` buries it at once instead. With `mandatory = false`, RabbitMQ drops
//! unroutable messages silently and confirms them, so they count as delivered: only use it for
//! exchanges whose messages may be lost.
//!
//! **Why the frame size is checked before sending**: AMQP carries a message's properties and
//! headers in one content-header frame, which may not exceed the connection's `frame_max` (the
//! body is split over as many frames as it needs; the headers cannot be). RabbitMQ answers an
//! oversized header frame by closing the whole *connection* (`FRAME_ERROR`), which looks like
//! an outage: every message of the batch failed, the event was never dead-lettered, and each
//! retry of it took the connection down again (161 reconnects in 75 s, measured, with other
//! aggregates delayed up to 17 s). So each message's header frame is measured with the
//! protocol's own encoder against the negotiated `frame_max`, and one that cannot fit is
//! rejected before anything is sent.
//!
//! Exchanges are checked once (a passive `exchange.declare`, or the real one with `declare`)
//! before the first message goes to them, so a missing exchange is rejected without taking
//! down the channel the rest of the batch travels on.
//!
//! [`RabbitMqSink::connect`] never connects: the first `publish` (or [`Sink::check`]) does, and a
//! lost connection is re-established by the next call. While RabbitMQ is unreachable, `publish`
//! answers `Retry` with the connection error and the relay keeps the events.
//!
//! ## Configuration
//!
//! ```toml
//! [destinations.rabbitmq]
//! type = "rabbitmq"
//! url = "amqp://rabbit:5672/%2f"
//! user = "relay"
//! password_env = "RABBITMQ_PASSWORD"
//! exchange = "${aggregate_type}.events"
//! routing_key = "${event_type}"
//! declare = true
//! exchange_type = "topic"
//! confirm_timeout = "5s"
//! ```

mod config;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind};
use outbox_types::routing::{Binding, Routing, Template};
use outbox_types::{Event, Outcome, Sink, SinkError, truncate_error};
use tracing::{debug, info, warn};

pub use config::{BodyFormat, ExchangeType, RabbitMqSinkConfig, Secret, Unroutable};

/// Idle confirm-mode channels kept for the next batches.
const MAX_IDLE_CHANNELS: usize = 8;

/// The longest AMQP short string (exchange, routing key, header name, property).
const SHORT_STRING_MAX: usize = 255;
/// The header holding `occurred_at` in Unix milliseconds (a signed 64-bit integer).
pub const TIMESTAMP_IN_MS: &str = "timestamp_in_ms";

/// Publishes events to RabbitMQ. See the [crate docs](crate).
pub struct RabbitMqSink {
    routing: Routing,
    exchange: Option<Template>,
    uri: AMQPUri,
    tls: OwnedTLSConfig,
    display_url: String,
    user: String,
    client_name: String,
    mandatory: bool,
    unroutable: Unroutable,
    persistent: bool,
    declare: Option<ExchangeType>,
    connect_timeout: Duration,
    confirm_timeout: Duration,
    max_message_bytes: u64,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    /// The `frame_max` the current connection negotiated (0 before the first connection).
    frame_max: std::sync::atomic::AtomicU32,
    idle: Mutex<Vec<Channel>>,
    known_exchanges: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for RabbitMqSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqSink")
            .field("url", &self.display_url)
            .field("exchange", &self.exchange.as_ref().map(Template::as_str))
            .field("routing_key", &self.routing.destination.as_str())
            .finish_non_exhaustive()
    }
}

/// One event ready to go.
struct Prepared {
    index: usize,
    exchange: String,
    routing_key: String,
    body: Vec<u8>,
    properties: BasicProperties,
}

/// Why a channel could not be had: every event of the call is retried with this reason.
struct Unavailable(String);

impl RabbitMqSink {
    /// Check `config`. Does not connect: the first publish does.
    ///
    /// Fails only on configuration that cannot work, with a message naming the setting. The
    /// constructor every sink has: settings in, sink out, no broker needed.
    pub fn connect(config: RabbitMqSinkConfig) -> Result<Self, SinkError> {
        Self::build(&config)
    }

    /// The earlier name of [`RabbitMqSink::connect`], taking the settings by reference.
    #[deprecated(note = "use `RabbitMqSink::connect(config)`, the constructor every sink has")]
    pub fn new(config: &RabbitMqSinkConfig) -> Result<Self, SinkError> {
        Self::build(config)
    }

    /// Check `config` as [`RabbitMqSink::connect`] does, without contacting the broker (what
    /// `outbox config check` runs).
    pub fn check_config(config: &RabbitMqSinkConfig) -> Result<(), SinkError> {
        config.validate()
    }

    fn build(config: &RabbitMqSinkConfig) -> Result<Self, SinkError> {
        let resolved = config.resolve()?;
        let user = resolved.uri.authority.userinfo.username.clone();
        // AMQP's PLAIN authentication sends the password as it is: say so unless TLS carries it
        // (the default guest/guest of a local broker is not a secret worth a warning).
        let password = &resolved.uri.authority.userinfo.password;
        if !password.is_empty()
            && password != "guest"
            && let Some(warning) = outbox_types::redact::cleartext_warning(
                "the RabbitMQ password",
                &resolved.display_url,
                resolved.uri.scheme == lapin::uri::AMQPScheme::AMQPS,
                "an `amqps://` URL or `tls = true`",
            )
        {
            tracing::warn!("{warning}");
        }
        Ok(RabbitMqSink {
            routing: resolved.routing,
            exchange: resolved.exchange,
            uri: resolved.uri,
            tls: OwnedTLSConfig {
                identity: None,
                cert_chain: resolved.ca_pem,
            },
            display_url: resolved.display_url,
            user,
            client_name: config.client_name.trim().to_owned(),
            mandatory: config.mandatory,
            unroutable: config.unroutable,
            persistent: config.persistent,
            declare: config.declare.then_some(config.exchange_type),
            connect_timeout: config.connect_timeout,
            confirm_timeout: config.confirm_timeout,
            max_message_bytes: config.max_message_bytes,
            connection: tokio::sync::Mutex::new(None),
            frame_max: std::sync::atomic::AtomicU32::new(0),
            idle: Mutex::new(Vec::new()),
            known_exchanges: Mutex::new(HashSet::new()),
        })
    }

    /// The routing in use (its destination is the routing key).
    pub fn routing(&self) -> &Routing {
        &self.routing
    }

    /// The exchange `event` goes to (`""`: the default exchange).
    pub fn exchange_for(&self, event: &Event) -> String {
        self.exchange
            .as_ref()
            .map(|t| t.render(event))
            .unwrap_or_default()
    }

    /// The open connection, or a new one.
    async fn connection(&self) -> Result<Arc<Connection>, Unavailable> {
        let mut slot = self.connection.lock().await;
        if let Some(connection) = slot.as_ref() {
            if connection.status().connected() {
                return Ok(connection.clone());
            }
            *slot = None;
            self.drop_idle_channels();
        }
        let properties =
            ConnectionProperties::default().with_connection_name(self.client_name.clone().into());
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| Unavailable(format!("no async runtime for lapin: {e}")))?;
        let attempt = Connection::connect_uri_with_config(
            self.uri.clone(),
            properties,
            self.tls.clone(),
            runtime,
        );
        match tokio::time::timeout(self.connect_timeout, attempt).await {
            Ok(Ok(connection)) => {
                let frame_max = connection.configuration().frame_max();
                self.frame_max
                    .store(frame_max, std::sync::atomic::Ordering::Relaxed);
                info!(url = %self.display_url, frame_max, "Connected to RabbitMQ.");
                let connection = Arc::new(connection);
                *slot = Some(connection.clone());
                Ok(connection)
            }
            Ok(Err(error)) => Err(Unavailable(format!(
                "cannot connect to RabbitMQ at {} as `{}`: {}",
                self.display_url,
                self.user,
                describe(&error)
            ))),
            Err(_) => Err(Unavailable(format!(
                "cannot connect to RabbitMQ at {}: no answer within {} ms (`connect_timeout`)",
                self.display_url,
                self.connect_timeout.as_millis()
            ))),
        }
    }

    /// Forget the connection (after it failed), so the next call reconnects.
    async fn reset_connection(&self) {
        let mut slot = self.connection.lock().await;
        if slot.as_ref().is_some_and(|c| !c.status().connected()) {
            *slot = None;
        }
        drop(slot);
        self.drop_idle_channels();
    }

    fn drop_idle_channels(&self) {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// A channel in confirm mode: an idle one, or a new one.
    async fn channel(&self) -> Result<Channel, Unavailable> {
        loop {
            let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            match idle {
                Some(channel) if channel.status().connected() => return Ok(channel),
                Some(_) => continue,
                None => break,
            }
        }
        let connection = self.connection().await?;
        let open = async {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(channel)
        };
        match tokio::time::timeout(self.connect_timeout, open).await {
            Ok(Ok(channel)) => Ok(channel),
            Ok(Err(error)) => {
                self.reset_connection().await;
                Err(Unavailable(format!(
                    "cannot open a channel on RabbitMQ at {}: {}",
                    self.display_url,
                    describe(&error)
                )))
            }
            Err(_) => {
                self.reset_connection().await;
                Err(Unavailable(format!(
                    "RabbitMQ at {} did not open a channel within {} ms",
                    self.display_url,
                    self.connect_timeout.as_millis()
                )))
            }
        }
    }

    fn give_back(&self, channel: Channel) {
        if channel.status().connected() {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < MAX_IDLE_CHANNELS {
                idle.push(channel);
            }
        }
    }

    /// Make sure `exchange` exists (declaring it with `declare`), once per exchange. `Err` is
    /// the outcome for every event bound to it.
    async fn ensure_exchange(&self, exchange: &str) -> Result<(), Outcome> {
        if exchange.is_empty()
            || self
                .known_exchanges
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(exchange)
        {
            return Ok(());
        }
        let connection = self
            .connection()
            .await
            .map_err(|u| Outcome::unavailable(u.0))?;
        // A failed declaration closes its channel: use one of its own.
        // With `declare`, create the exchange (durable, of its type); without, only ask whether
        // it exists (passive: the type is not compared).
        let (kind, options) = match self.declare {
            Some(kind) => (
                kind.kind(),
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
            ),
            None => (
                lapin::ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                },
            ),
        };
        let check = async {
            let channel = connection.create_channel().await?;
            let result = channel
                .exchange_declare(exchange.into(), kind, options, FieldTable::default())
                .await;
            if result.is_ok() {
                let _ = channel.close(200, "OK".into()).await;
            }
            result
        };
        let result = match tokio::time::timeout(self.connect_timeout, check).await {
            Ok(result) => result,
            Err(_) => {
                return Err(Outcome::unavailable(format!(
                    "RabbitMQ at {} did not answer the check of exchange `{exchange}` within {} ms",
                    self.display_url,
                    self.connect_timeout.as_millis()
                )));
            }
        };
        match result {
            Ok(()) => {
                if self.declare.is_some() {
                    debug!(exchange, "Declared exchange.");
                }
                self.known_exchanges
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(exchange.to_owned());
                Ok(())
            }
            Err(error) => Err(match soft_error(&error) {
                Some((AMQPSoftError::NOTFOUND, message)) => Outcome::reject(format!(
                    "exchange `{exchange}` does not exist on {} ({message}): declare it, set `declare = true`, or fix the `exchange` template",
                    self.display_url
                )),
                Some((AMQPSoftError::ACCESSREFUSED, message)) => Outcome::reject(format!(
                    "user `{}` may not {} exchange `{exchange}` ({message}): grant the permission (rabbitmqctl set_permissions), or fix the `exchange` template",
                    self.user,
                    if self.declare.is_some() {
                        "declare"
                    } else {
                        "use"
                    }
                )),
                Some((AMQPSoftError::PRECONDITIONFAILED, message)) => Outcome::reject(format!(
                    "exchange `{exchange}` exists with other settings than `declare` asks for ({message}): align `exchange_type` with it (durable), or set `declare = false`"
                )),
                _ => {
                    let reason = format!(
                        "checking exchange `{exchange}` on {} failed: {}",
                        self.display_url,
                        describe(&error)
                    );
                    if error.is_io_error() || error.is_amqp_hard_error() {
                        self.reset_connection().await;
                        Outcome::unavailable(reason)
                    } else {
                        Outcome::retry(reason)
                    }
                }
            }),
        }
    }

    /// Turn an event into a message, or the reason it can never be one.
    fn prepare(&self, index: usize, event: &Event) -> Result<Prepared, Outcome> {
        let exchange = self.exchange_for(event);
        let routing_key = self.routing.destination(event);
        if exchange.len() > SHORT_STRING_MAX {
            return Err(Outcome::reject(truncate_error(&format!(
                "exchange `{exchange}` is longer than 255 bytes: fix the `exchange` template"
            ))));
        }
        if routing_key.len() > SHORT_STRING_MAX {
            return Err(Outcome::reject(truncate_error(&format!(
                "routing key `{routing_key}` is longer than 255 bytes: fix the `routing_key` template or the event's destination"
            ))));
        }
        let body = self.routing.body(event);
        if body.len() as u64 > self.max_message_bytes {
            return Err(Outcome::reject(format!(
                "message of {} bytes for exchange `{exchange}` is larger than `max_message_bytes` ({}): make the event smaller, or raise `max_message_bytes` together with RabbitMQ's `max_message_size`",
                body.len(),
                self.max_message_bytes
            )));
        }
        let mut headers = FieldTable::default();
        let mut routing_headers = self.routing.headers(event);
        routing_headers.extend(self.routing.cloudevents_headers(event, Binding::RabbitMq));
        for (name, value) in routing_headers {
            // Ours, set below; a row's header of that name (in any case) does not travel
            // beside it.
            if name.eq_ignore_ascii_case(TIMESTAMP_IN_MS) {
                continue;
            }
            if name.len() > SHORT_STRING_MAX {
                return Err(Outcome::reject(truncate_error(&format!(
                    "header name `{name}` is longer than 255 bytes, which AMQP cannot carry: shorten it"
                ))));
            }
            headers.insert(
                ShortString::from(name),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        // The `timestamp` property has whole seconds only; this header keeps the milliseconds,
        // under the name RabbitMQ's own message-timestamp plugin uses.
        headers.insert(
            ShortString::from(TIMESTAMP_IN_MS),
            AMQPValue::LongLongInt(event.occurred_at.timestamp_millis()),
        );
        let mut properties = BasicProperties::default()
            .with_message_id(ShortString::from(event.id.to_string()))
            .with_content_type(ShortString::from(self.routing.content_type()))
            .with_headers(headers)
            .with_app_id(ShortString::from(self.client_name.as_str()))
            .with_timestamp(u64::try_from(event.occurred_at.timestamp()).unwrap_or(0));
        if event.event_type.len() <= SHORT_STRING_MAX {
            properties = properties.with_type(ShortString::from(event.event_type.as_str()));
        }
        if self.persistent {
            properties = properties.with_delivery_mode(2);
        }
        Ok(Prepared {
            index,
            exchange,
            routing_key,
            body,
            properties,
        })
    }

    fn unroutable_outcome(&self, message: &Prepared, returned: &BasicReturnMessage) -> Outcome {
        let reason = truncate_error(&format!(
            "unroutable: RabbitMQ returned the message ({} {}): no queue is bound to exchange `{}` for routing key `{}`; bind a queue (or an alternate exchange), fix the `routing_key`/`exchange` templates, or set `mandatory = false` to let RabbitMQ drop unroutable messages",
            returned.reply_code,
            returned.reply_text.as_str(),
            display_exchange(&message.exchange),
            message.routing_key
        ));
        match self.unroutable {
            Unroutable::Retry => Outcome::retry(reason),
            Unroutable::Reject => Outcome::reject(reason),
        }
    }

    /// The failure classification of this sink: the outcome of a message whose publish or
    /// confirm failed with `error` (unavailable: no attempt; retry or reject: costs one).
    fn classify(&self, message: &Prepared, error: &lapin::Error) -> Outcome {
        let exchange = display_exchange(&message.exchange);
        if let Some((kind, text)) = soft_error(error) {
            let about_this_exchange =
                mentioned_exchange(&text).is_some_and(|e| e == message.exchange);
            match kind {
                AMQPSoftError::NOTFOUND if about_this_exchange => {
                    self.forget_exchange(&message.exchange);
                    return Outcome::reject(format!(
                        "exchange {exchange} does not exist on {} ({text}): declare it, set `declare = true`, or fix the `exchange` template",
                        self.display_url
                    ));
                }
                AMQPSoftError::ACCESSREFUSED if about_this_exchange => {
                    return Outcome::reject(format!(
                        "user `{}` may not write to exchange {exchange} ({text}): grant write permission (rabbitmqctl set_permissions), or fix the `exchange` template",
                        self.user
                    ));
                }
                AMQPSoftError::PRECONDITIONFAILED
                    if message_size_in(&text) == Some(message.body.len() as u64) =>
                {
                    return Outcome::reject(format!(
                        "message of {} bytes for exchange {exchange} is larger than RabbitMQ accepts ({text}): make the event smaller, or raise RabbitMQ's `max_message_size`; set `max_message_bytes` to the same limit so the sink rejects such events before sending",
                        message.body.len()
                    ));
                }
                _ => {
                    if matches!(kind, AMQPSoftError::NOTFOUND) {
                        self.forget_exchange(&message.exchange);
                    }
                    return Outcome::retry(truncate_error(&format!(
                        "RabbitMQ closed the channel while publishing to exchange {exchange} ({text}); another message of the batch may have caused it"
                    )));
                }
            }
        }
        // Not a channel-level error about this message: the connection or channel is gone, or
        // the socket failed. The broker, not the event.
        Outcome::unavailable(truncate_error(&format!(
            "publishing to exchange {exchange} on {} failed: {}",
            self.display_url,
            describe(error)
        )))
    }

    /// The rejection of `message` when its properties and headers cannot travel in one
    /// content-header frame of the current connection (see the crate docs: the broker would
    /// close the connection).
    fn oversized_header(&self, message: &Prepared) -> Option<Outcome> {
        let frame_max = self.frame_max.load(std::sync::atomic::Ordering::Relaxed);
        if frame_max == 0 {
            return None;
        }
        let frame = header_frame_size(&message.properties);
        (frame > u64::from(frame_max)).then(|| {
            Outcome::reject(format!(
                "the message's properties and headers for exchange {} take {frame} bytes in their AMQP frame, more than the {frame_max} bytes RabbitMQ's frame size (`frame_max`) allows: the broker would close the connection; make the event's headers (or its type, id or key) smaller, or raise the broker's `frame_max`",
                display_exchange(&message.exchange)
            ))
        })
    }

    fn forget_exchange(&self, exchange: &str) {
        self.known_exchanges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(exchange);
    }
}

/// The size of the content-header frame that carries `properties`: the frame's own 8 bytes
/// (type, channel, size, end), class id, weight and body size (12), and the properties as the
/// protocol's encoder writes them. `u64::MAX` if they cannot be encoded at all.
fn header_frame_size(properties: &BasicProperties) -> u64 {
    let encode = lapin::protocol::basic::gen_properties::<Vec<u8>>(properties);
    match encode(Vec::new().into()) {
        Ok(written) => 8 + 12 + written.position,
        Err(_) => u64::MAX,
    }
}

/// `exchange `x``, or `the default exchange`.
fn display_exchange(exchange: &str) -> String {
    if exchange.is_empty() {
        "the default exchange".to_owned()
    } else {
        format!("`{exchange}`")
    }
}

/// A channel-level AMQP error and its text, e.g. `NOT_FOUND - no exchange 'x' in vhost '/'`.
fn soft_error(error: &lapin::Error) -> Option<(AMQPSoftError, String)> {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(soft) => Some((soft.clone(), amqp.get_message().to_string())),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}

/// The exchange named in a RabbitMQ error text (`… exchange 'orders' in vhost '/' …`).
fn mentioned_exchange(text: &str) -> Option<&str> {
    let start = text.find("exchange '")? + "exchange '".len();
    let len = text[start..].find('\'')?;
    Some(&text[start..start + len])
}

/// The size in `message size 2000 is larger than configured max size 1000`.
fn message_size_in(text: &str) -> Option<u64> {
    let start = text.find("message size ")? + "message size ".len();
    let digits: String = text[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// An error as a person reads it.
fn describe(error: &lapin::Error) -> String {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => {
            let text = amqp.get_message().to_string();
            if text.contains("ACCESS_REFUSED") && text.contains("PLAIN") {
                format!("{text} (check `user` and the password)")
            } else {
                text
            }
        }
        ErrorKind::IOError(io) => format!("{io}"),
        _ => error.to_string(),
    }
}

#[async_trait]
impl Sink for RabbitMqSink {
    fn name(&self) -> &str {
        "rabbitmq"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        let mut ready = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            match self.prepare(index, event) {
                Ok(prepared) => ready.push(prepared),
                Err(outcome) => outcomes[index] = Some(outcome),
            }
        }

        // Exchanges first, so a missing one rejects its events without closing the channel
        // the others travel on.
        let mut verdicts: HashMap<String, Result<(), Outcome>> = HashMap::new();
        for message in &ready {
            if !verdicts.contains_key(&message.exchange) {
                let verdict = self.ensure_exchange(&message.exchange).await;
                verdicts.insert(message.exchange.clone(), verdict);
            }
        }
        ready.retain(|message| match verdicts.get(&message.exchange) {
            Some(Err(outcome)) => {
                outcomes[message.index] = Some(outcome.clone());
                false
            }
            _ => true,
        });

        if !ready.is_empty() {
            match self.channel().await {
                Err(Unavailable(reason)) => {
                    for message in &ready {
                        outcomes[message.index] = Some(Outcome::unavailable(reason.clone()));
                    }
                }
                Ok(channel) => {
                    // Only now is the connection's frame size known.
                    ready.retain(|message| match self.oversized_header(message) {
                        Some(outcome) => {
                            outcomes[message.index] = Some(outcome);
                            false
                        }
                        None => true,
                    });
                    let healthy = self.publish_on(&channel, &ready, &mut outcomes).await;
                    if healthy {
                        self.give_back(channel);
                    } else if !channel.status().connected() {
                        self.reset_connection().await;
                    }
                }
            }
        }

        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Outcome::retry("the sink lost track of this event (a bug)"))
            })
            .collect()
    }

    /// Connects (if not connected) and opens a confirm-mode channel.
    async fn check(&self) -> Result<(), SinkError> {
        match self.channel().await {
            Ok(channel) => {
                self.give_back(channel);
                Ok(())
            }
            Err(Unavailable(reason)) => Err(SinkError::Unavailable(reason)),
        }
    }
}

impl RabbitMqSink {
    /// Publish every message of `ready` on `channel`, then wait for all their confirms. Returns
    /// whether the channel can be used again.
    async fn publish_on(
        &self,
        channel: &Channel,
        ready: &[Prepared],
        outcomes: &mut [Option<Outcome>],
    ) -> bool {
        let options = BasicPublishOptions {
            mandatory: self.mandatory,
            ..BasicPublishOptions::default()
        };
        let deadline = tokio::time::Instant::now() + self.confirm_timeout;
        // All publishes are started together: each hands its frames to lapin's I/O loop in
        // order, and the loop writes them out in a few syscalls.
        let publishes = join_all(ready.iter().map(|message| {
            channel.basic_publish(
                message.exchange.as_str().into(),
                message.routing_key.as_str().into(),
                options,
                &message.body,
                message.properties.clone(),
            )
        }));
        let published = match tokio::time::timeout_at(deadline, publishes).await {
            Ok(published) => published,
            Err(_) => {
                for message in ready {
                    outcomes[message.index] = Some(Outcome::unavailable(format!(
                        "RabbitMQ at {} did not take the messages within {} ms (`confirm_timeout`)",
                        self.display_url,
                        self.confirm_timeout.as_millis()
                    )));
                }
                return false;
            }
        };
        let mut healthy = true;
        let mut waiting = Vec::with_capacity(ready.len());
        for (message, result) in ready.iter().zip(published) {
            match result {
                Ok(confirm) => waiting.push((message, confirm)),
                Err(error) => {
                    healthy = false;
                    outcomes[message.index] = Some(self.classify(message, &error));
                }
            }
        }
        let confirms = join_all(waiting.into_iter().map(|(message, confirm)| async move {
            (message, tokio::time::timeout_at(deadline, confirm).await)
        }))
        .await;
        for (message, confirmed) in confirms {
            let outcome = match confirmed {
                Ok(Ok(Confirmation::Ack(None))) => Outcome::Delivered,
                Ok(Ok(Confirmation::Ack(Some(returned)))) => {
                    self.unroutable_outcome(message, &returned)
                }
                Ok(Ok(Confirmation::Nack(returned))) => match returned {
                    Some(returned) => self.unroutable_outcome(message, &returned),
                    None => Outcome::unavailable(format!(
                        "RabbitMQ refused (basic.nack) the message for exchange {}: a queue it routes to may be full with `overflow = reject-publish`, or the broker had an internal error",
                        display_exchange(&message.exchange)
                    )),
                },
                Ok(Ok(Confirmation::NotRequested)) => {
                    healthy = false;
                    Outcome::retry("the channel was not in confirm mode (a sink bug); retrying")
                }
                Ok(Err(error)) => {
                    healthy = false;
                    self.classify(message, &error)
                }
                Err(_) => {
                    healthy = false;
                    Outcome::unavailable(format!(
                        "no publisher confirm from RabbitMQ at {} within {} ms (`confirm_timeout`) for exchange {}",
                        self.display_url,
                        self.confirm_timeout.as_millis(),
                        display_exchange(&message.exchange)
                    ))
                }
            };
            outcomes[message.index] = Some(outcome);
        }
        if !healthy {
            warn!(url = %self.display_url, "RabbitMQ channel failed during a batch; it is not reused.");
        }
        healthy && channel.status().connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rabbitmq_error_texts_are_read() {
        assert_eq!(
            mentioned_exchange("NOT_FOUND - no exchange 'orders.x' in vhost '/'"),
            Some("orders.x")
        );
        assert_eq!(
            mentioned_exchange(
                "ACCESS_REFUSED - access to exchange 'e' in vhost '/' refused for user 'u'"
            ),
            Some("e")
        );
        assert_eq!(mentioned_exchange("PRECONDITION_FAILED - x"), None);
        assert_eq!(
            message_size_in(
                "PRECONDITION_FAILED - message size 2000 is larger than configured max size 1000"
            ),
            Some(2000)
        );
    }

    fn event(aggregate: &str) -> Event {
        outbox_types::NewEvent::from_json("order", aggregate, "OrderCreated", r#"{"a":1}"#)
            .unwrap()
            .with_header("traceparent", "00-x-y-01")
            .with_idempotency_key("k")
            .claimed(1)
    }

    #[test]
    fn messages_carry_the_id_persistence_and_headers() {
        let config: RabbitMqSinkConfig =
            serde_json::from_str(r#"{"exchange": "${aggregate_type}.events"}"#).unwrap();
        let sink = RabbitMqSink::connect(config).unwrap();
        let e = event("42");
        let p = sink.prepare(0, &e).unwrap();
        assert_eq!(p.exchange, "order.events");
        assert_eq!(p.routing_key, "OrderCreated");
        assert_eq!(
            p.properties.message_id().as_ref().map(|s| s.as_str()),
            Some(e.id.to_string().as_str())
        );
        assert_eq!(*p.properties.delivery_mode(), Some(2));
        let headers = p.properties.headers().as_ref().unwrap();
        assert!(
            headers
                .inner()
                .contains_key(&ShortString::from("traceparent"))
        );
        assert!(
            headers
                .inner()
                .contains_key(&ShortString::from("outbox-idempotency-key"))
        );

        let mut own = event("1");
        own.destination = Some("audit.special".into());
        assert_eq!(sink.prepare(0, &own).unwrap().routing_key, "audit.special");
        own.destination = Some("k".repeat(300));
        assert!(matches!(sink.prepare(0, &own), Err(Outcome::Reject { .. })));
    }

    #[tokio::test]
    async fn an_unreachable_broker_means_unavailable_not_a_failed_start() {
        let config: RabbitMqSinkConfig =
            serde_json::from_str(r#"{"url": "amqp://127.0.0.1:1/%2f", "connect_timeout": "1s"}"#)
                .unwrap();
        let sink = RabbitMqSink::connect(config).unwrap();
        let outcomes = sink.publish(&[event("1")]).await;
        assert!(
            matches!(&outcomes[..], [Outcome::Unavailable { reason, .. }] if reason.contains("127.0.0.1:1")),
            "{outcomes:?}"
        );
        assert!(sink.check().await.is_err());
    }
}
