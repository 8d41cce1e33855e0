//! Where an event goes and what the message looks like, shared by every sink — modelled on
//! Debezium's Outbox Event Router.
//!
//! - **Destination**: the event's own `destination` if the writer set one, else a [`Template`]
//!   over the event's fields, e.g. `events.${event_type}` or `${aggregate_type}.events`.
//! - **Key**: the aggregate id, so one aggregate stays in one partition / ordering lane.
//! - **Headers**: the event id, type, aggregate type and id, occurred_at and idempotency key, under
//!   the names in [`header`], then the event's own headers (which may carry a W3C `traceparent`).
//! - **Body**: the stored JSON bytes as they are, or CloudEvents 1.0
//!   ([`PayloadFormat::CloudEvents`]): a structured envelope around them, or (binary mode) the
//!   bytes as they are with the attributes as headers named by the protocol's binding
//!   ([`Routing::cloudevents_headers`]).
//! - **Debezium shape** ([`PayloadFormat::Debezium`]): what consumers of Debezium's Outbox Event
//!   Router read with Kafka Connect's JSON converter — the key as a JSON string, the body as
//!   stored, one `id` header plus the event's own headers as JSON strings; an event read from a
//!   Debezium outbox table carries the whole record the router would have made
//!   ([`DebeziumRecord`]: typed key, headers in order with `null`s, tombstone, timestamp). For
//!   consumers that move over from Debezium.
//!
//! ```
//! use outbox_types::routing::{Routing, Template};
//! # let event = outbox_types::NewEvent::from_json("order", "42", "OrderCreated", r#"{"a":1}"#).unwrap().claimed(1);
//! let routing = Routing::new(Template::parse("events.${event_type}").unwrap());
//! assert_eq!(routing.destination(&event), "events.OrderCreated");
//! assert_eq!(routing.key(&event), "42");
//! assert_eq!(routing.body(&event), br#"{"a":1}"#);
//! ```

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

pub use crate::cloudevents::{Binding, CloudEvents, Mode as CloudEventsMode};
use crate::event::Event;

/// Header names every sink uses for the event's own fields.
pub mod header {
    /// The event id (UUID): what consumers deduplicate on.
    pub const EVENT_ID: &str = "outbox-event-id";
    /// e.g. `OrderCreated`.
    pub const EVENT_TYPE: &str = "outbox-event-type";
    /// e.g. `order`.
    pub const AGGREGATE_TYPE: &str = "outbox-aggregate-type";
    /// The aggregate id (also the message key).
    pub const AGGREGATE_ID: &str = "outbox-aggregate-id";
    /// RFC 3339 time the business fact happened.
    pub const OCCURRED_AT: &str = "outbox-occurred-at";
    /// The writer's idempotency key, when it set one.
    pub const IDEMPOTENCY_KEY: &str = "outbox-idempotency-key";
    /// Not sent: the Kafka partition a Debezium table's `partition` placement chose, which the
    /// Kafka sink honours in the Debezium shape ([`PayloadFormat::Debezium`](super::PayloadFormat::Debezium)).
    pub const PARTITION: &str = "outbox-partition";
    /// Not sent: the parts of the Kafka record Debezium's Outbox Event Router would make of a
    /// Debezium outbox table's row other than the value ([`DebeziumRecord`](super::DebeziumRecord),
    /// as JSON), which the Debezium shape sends instead of its generic key and headers. Set by
    /// the WAL relay's `debezium` source; outside the reserved `outbox-` prefix so that it is
    /// stored with an event handed to the outbox table (and so keeps the shape across retries).
    pub const DEBEZIUM_RECORD: &str = "__outbox.debezium";

    /// Whether a header of an event is one of the relay's own that no shape sends as it is:
    /// a name under the reserved prefix `outbox-` (any case), or [`DEBEZIUM_RECORD`].
    ///
    /// ```
    /// use outbox_types::routing::header::is_internal;
    /// assert!(is_internal("outbox-partition"));
    /// assert!(is_internal("__outbox.debezium"));
    /// assert!(!is_internal("traceparent"));
    /// ```
    pub fn is_internal(name: &str) -> bool {
        crate::is_relay_header(name) || name == DEBEZIUM_RECORD
    }
}

/// A destination template: text with `${field}` placeholders.
///
/// Fields: `event_type`, `aggregate_type`, `aggregate_id`, `event_id`, and `header.NAME` for one
/// of the event's headers (empty when absent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    EventType,
    AggregateType,
    AggregateId,
    EventId,
    Header(String),
}

/// A template that does not parse; the message names the problem and the valid fields.
#[derive(Debug, thiserror::Error)]
#[error("invalid destination template `{template}`: {reason}")]
pub struct TemplateError {
    /// The template as written.
    pub template: String,
    /// What is wrong.
    pub reason: String,
}

impl Template {
    /// Parse `text`.
    ///
    /// ```
    /// use outbox_types::routing::Template;
    /// assert!(Template::parse("${aggregate_type}.events").is_ok());
    /// let err = Template::parse("events.${evnt_type}").unwrap_err();
    /// assert!(err.to_string().contains("unknown field `evnt_type`"));
    /// ```
    pub fn parse(text: &str) -> Result<Self, TemplateError> {
        let fail = |reason: String| TemplateError {
            template: text.to_owned(),
            reason,
        };
        let mut parts = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find("${") {
            if start > 0 {
                parts.push(Part::Text(rest[..start].to_owned()));
            }
            let after = &rest[start + 2..];
            let end = after
                .find('}')
                .ok_or_else(|| fail("a `${` is never closed with `}`".to_owned()))?;
            let field = after[..end].trim();
            let part = match field {
                "event_type" => Part::EventType,
                "aggregate_type" => Part::AggregateType,
                "aggregate_id" => Part::AggregateId,
                "event_id" | "id" => Part::EventId,
                f if f.starts_with("header.") && f.len() > "header.".len() => {
                    Part::Header(f["header.".len()..].to_owned())
                }
                other => {
                    return Err(fail(format!(
                        "unknown field `{other}` (use event_type, aggregate_type, aggregate_id, event_id or header.NAME)"
                    )));
                }
            };
            parts.push(part);
            rest = &after[end + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        if parts.is_empty() {
            return Err(fail("the template is empty".to_owned()));
        }
        Ok(Template {
            source: text.to_owned(),
            parts,
        })
    }

    /// A template that is plain text (no placeholders).
    pub fn fixed(text: impl Into<String>) -> Self {
        let text = text.into();
        Template {
            parts: vec![Part::Text(text.clone())],
            source: text,
        }
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Fill the placeholders from `event`, values as they are: for topic, subject and stream
    /// names, where every character of a value is just a character.
    pub fn render(&self, event: &Event) -> String {
        self.render_with(event, |out, value| out.push_str(value))
    }

    /// Fill the placeholders from `event` with every value percent-encoded: each byte except the
    /// RFC 3986 unreserved characters `A-Z a-z 0-9 - . _ ~` is written as `%XX`. The template's
    /// own text is kept as written.
    ///
    /// For URLs: a value then stays inside the one path segment or query value it was put in.
    /// With [`render`](Template::render), an aggregate id `../../admin?debug=1#` in
    /// `/orders/${aggregate_id}/events` would end the path, start a query and cut the rest off
    /// as a fragment. Encoding leaves `.` alone (it is unreserved), so a value that is exactly
    /// `.` or `..` still makes a dot segment; a caller building a URL refuses those.
    ///
    /// ```
    /// use outbox_types::routing::Template;
    /// # let mut event = outbox_types::NewEvent::from_json("order", "42", "OrderCreated", "{}").unwrap().claimed(1);
    /// event.aggregate_id = "../../admin?debug=1#".into();
    /// let t = Template::parse("https://h.example/orders/${aggregate_id}/events").unwrap();
    /// assert_eq!(
    ///     t.render_url_encoded(&event),
    ///     "https://h.example/orders/..%2F..%2Fadmin%3Fdebug%3D1%23/events"
    /// );
    /// assert_eq!(t.render(&event), "https://h.example/orders/../../admin?debug=1#/events");
    /// ```
    pub fn render_url_encoded(&self, event: &Event) -> String {
        self.render_with(event, percent_encode_into)
    }

    fn render_with(&self, event: &Event, put: impl Fn(&mut String, &str)) -> String {
        let mut out = String::with_capacity(self.source.len() + 16);
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::EventType => put(&mut out, &event.event_type),
                Part::AggregateType => put(&mut out, &event.aggregate_type),
                Part::AggregateId => put(&mut out, &event.aggregate_id),
                Part::EventId => put(&mut out, &event.id.to_string()),
                Part::Header(name) => {
                    if let Some(v) = event.headers.get(name) {
                        put(&mut out, v);
                    }
                }
            }
        }
        out
    }
}

/// `value` with every byte outside the RFC 3986 unreserved set (`A-Z a-z 0-9 - . _ ~`) written
/// as `%XX`: one URL component (user, password, path segment, query value) whatever it holds.
///
/// ```
/// assert_eq!(outbox_types::routing::percent_encode("s3cr@t/1"), "s3cr%40t%2F1");
/// ```
pub fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    percent_encode_into(&mut out, value);
    out
}

/// Append `value` to `out` with every byte outside the RFC 3986 unreserved set
/// (`A-Z a-z 0-9 - . _ ~`) written as `%XX` (upper-case hex), UTF-8 byte by byte.
fn percent_encode_into(out: &mut String, value: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in value.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
    }
}

impl Serialize for Template {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.source)
    }
}

impl<'de> Deserialize<'de> for Template {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Template::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The body format a sink's configuration names (`format = "raw" | "cloudevents" |
/// "debezium"`): one word list for every sink.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BodyFormat {
    /// The stored JSON bytes, untouched (`application/json`).
    #[default]
    Raw,
    /// CloudEvents 1.0 (needs `cloudevents_source`; `cloudevents_mode` picks structured or
    /// binary), see [`crate::cloudevents`].
    #[serde(alias = "cloud_events")]
    Cloudevents,
    /// The message shape of Debezium's Outbox Event Router with the JSON converter
    /// ([`PayloadFormat::Debezium`]).
    Debezium,
}

/// The CloudEvents keys of a sink's configuration, as written: `cloudevents_source`,
/// `cloudevents_mode`, `cloudevents_type_prefix`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CloudEventsKeys<'a> {
    /// `cloudevents_source`.
    pub source: Option<&'a str>,
    /// `cloudevents_mode`.
    pub mode: Option<CloudEventsMode>,
    /// `cloudevents_type_prefix`.
    pub type_prefix: Option<&'a str>,
}

impl BodyFormat {
    /// The [`PayloadFormat`] this names, with the sink's CloudEvents keys. The error names the
    /// key to add or remove.
    pub fn payload_format(self, ce: CloudEventsKeys<'_>) -> Result<PayloadFormat, String> {
        // Binary mode asked for with another format is a mistake that would go unnoticed (the
        // consumer would get no attributes): refused. The other CloudEvents keys, like
        // `cloudevents_source`, are only read with that format, so switching `format` back and
        // forth does not mean editing them out.
        if self != BodyFormat::Cloudevents && ce.mode == Some(CloudEventsMode::Binary) {
            return Err(
                "`cloudevents_mode = \"binary\"` applies only with `format = \"cloudevents\"`: set that format, or remove `cloudevents_mode`"
                    .to_owned(),
            );
        }
        Ok(match self {
            BodyFormat::Raw => PayloadFormat::Raw,
            BodyFormat::Debezium => PayloadFormat::Debezium,
            BodyFormat::Cloudevents => {
                let source = ce
                    .source
                    .filter(|s| !s.trim().is_empty())
                    .ok_or("`format = \"cloudevents\"` needs `cloudevents_source`, the CloudEvents `source` attribute (e.g. `cloudevents_source = \"/orders-service\"`)")?;
                let mut out = CloudEvents::new(source).with_mode(ce.mode.unwrap_or_default());
                if let Some(prefix) = ce.type_prefix {
                    if prefix.trim().is_empty() || prefix.chars().any(char::is_whitespace) {
                        return Err(format!(
                            "`cloudevents_type_prefix = {prefix:?}` is not a type prefix: use reverse-DNS text without spaces, e.g. `com.example.orders`"
                        ));
                    }
                    out = out.with_type_prefix(prefix);
                }
                PayloadFormat::CloudEvents(out)
            }
        })
    }
}

/// How the message body is built.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "format", deny_unknown_fields)]
pub enum PayloadFormat {
    /// The stored JSON bytes, untouched.
    #[default]
    Raw,
    /// CloudEvents 1.0, structured (a JSON envelope with the payload as `data`) or binary (the
    /// payload as the body, the attributes as headers): see [`crate::cloudevents`].
    CloudEvents(CloudEvents),
    /// What Debezium's Outbox Event Router emits through Kafka Connect's JSON converter
    /// (`converter.schemas.enable=false`), so its consumers read our messages unchanged.
    ///
    /// An event read from a Debezium outbox table (the WAL relay's `debezium` source) carries
    /// the record the router would make of its row ([`DebeziumRecord`], in the
    /// [`header::DEBEZIUM_RECORD`] header): its key, its headers in order (the connector's
    /// `__debezium.context.*` ones, `id`, the `header` placements, with JSON values and `null`
    /// for NULL), whether it is a tombstone and its timestamp; the body is the payload the
    /// source shaped (a JSON string holding the payload's text, the expanded JSON, an envelope
    /// with additional fields, or `null`).
    ///
    /// Any other event is sent as the router would send a row with text columns:
    ///
    /// - key: the aggregate id as a JSON string (`"order-1"`, quotes included);
    /// - body: the stored payload as it is (a `null` payload is the value `null`, not a
    ///   tombstone: the router's `route.tombstone.on.empty.payload` is off by default);
    /// - headers: `id` (the event id as a JSON string), then the event's own headers as JSON
    ///   strings; none of the relay's internal headers ([`header::is_internal`]).
    Debezium,
}

/// Destination, key, headers and body for events: what every sink needs to turn an event into a
/// message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routing {
    /// Used when the event names no destination itself.
    pub destination: Template,
    /// Raw or CloudEvents.
    pub format: PayloadFormat,
}

impl Routing {
    /// Raw bodies, destination from `template` unless the event sets one.
    pub fn new(destination: Template) -> Self {
        Routing {
            destination,
            format: PayloadFormat::Raw,
        }
    }

    /// Use `format` for bodies.
    pub fn with_format(mut self, format: PayloadFormat) -> Self {
        self.format = format;
        self
    }

    /// The event's own destination, else the template rendered over it.
    pub fn destination(&self, event: &Event) -> String {
        match &event.destination {
            Some(d) if !d.is_empty() => d.clone(),
            _ => self.destination.render(event),
        }
    }

    /// The message key: the aggregate id (as a JSON string in the Debezium shape, or the
    /// [`DebeziumRecord`]'s key).
    pub fn key<'e>(&self, event: &'e Event) -> Cow<'e, str> {
        match self.format {
            PayloadFormat::Debezium => match DebeziumRecord::of(event) {
                Some(record) => Cow::Owned(record.key),
                None => Cow::Owned(json_string(&event.aggregate_id)),
            },
            _ => Cow::Borrowed(&event.aggregate_id),
        }
    }

    /// Whether the message carries no body at all: in the Debezium shape, an event whose
    /// [`DebeziumRecord`] is a tombstone (a Kafka record without a value; an empty body
    /// elsewhere). Never in the other shapes, nor for a `null` payload as such.
    pub fn is_tombstone(&self, event: &Event) -> bool {
        matches!(self.format, PayloadFormat::Debezium)
            && DebeziumRecord::of(event).is_some_and(|r| r.tombstone)
    }

    /// The Kafka record timestamp (milliseconds since the epoch) the shape asks for: in the
    /// Debezium shape, the [`DebeziumRecord`]'s (the router's `table.field.event.timestamp`
    /// column); `None` leaves it to the sink.
    pub fn record_timestamp(&self, event: &Event) -> Option<i64> {
        match self.format {
            PayloadFormat::Debezium => DebeziumRecord::of(event).and_then(|r| r.timestamp_ms),
            _ => None,
        }
    }

    /// Headers to put on the message: the event's fields under [`header`] names, then its own
    /// headers (an own header never replaces one of ours, and internal ones are never sent: none
    /// whose name starts with `outbox-` in any case, [`crate::is_relay_header`], nor
    /// [`header::DEBEZIUM_RECORD`]). In the Debezium shape: the [`DebeziumRecord`]'s headers with
    /// `id` among them, else `id` then the own headers (none named `id` in any case), every value
    /// as a JSON string.
    pub fn headers(&self, event: &Event) -> Vec<(String, String)> {
        if matches!(self.format, PayloadFormat::Debezium) {
            let id = ("id".to_owned(), json_string(&event.id.to_string()));
            if let Some(record) = DebeziumRecord::of(event) {
                let mut out = Vec::with_capacity(1 + record.context.len() + record.headers.len());
                out.extend(record.context);
                out.push(id);
                // The id consumers deduplicate on is the event's, never a second one.
                out.extend(
                    record
                        .headers
                        .into_iter()
                        .filter(|(name, _)| !name.eq_ignore_ascii_case("id")),
                );
                return out;
            }
            let mut out = Vec::with_capacity(1 + event.headers.len());
            out.push(id);
            for (name, value) in &event.headers {
                if !header::is_internal(name) && !name.eq_ignore_ascii_case("id") {
                    out.push((name.clone(), json_string(value)));
                }
            }
            return out;
        }
        let mut out = Vec::with_capacity(6 + event.headers.len());
        out.push((header::EVENT_ID.to_owned(), event.id.to_string()));
        out.push((header::EVENT_TYPE.to_owned(), event.event_type.clone()));
        out.push((
            header::AGGREGATE_TYPE.to_owned(),
            event.aggregate_type.clone(),
        ));
        out.push((header::AGGREGATE_ID.to_owned(), event.aggregate_id.clone()));
        out.push((
            header::OCCURRED_AT.to_owned(),
            event.occurred_at.to_rfc3339(),
        ));
        if let Some(k) = &event.idempotency_key {
            out.push((header::IDEMPOTENCY_KEY.to_owned(), k.clone()));
        }
        let binary = matches!(&self.format, PayloadFormat::CloudEvents(ce) if ce.mode == CloudEventsMode::Binary);
        for (name, value) in &event.headers {
            if header::is_internal(name)
                || (binary && crate::cloudevents::is_binding_attribute(name))
            {
                continue;
            }
            out.push((name.clone(), value.clone()));
        }
        out
    }

    /// The message body.
    pub fn body(&self, event: &Event) -> Vec<u8> {
        match &self.format {
            PayloadFormat::Raw => event.payload.as_bytes().to_vec(),
            PayloadFormat::Debezium if self.is_tombstone(event) => Vec::new(),
            PayloadFormat::Debezium => event.payload.as_bytes().to_vec(),
            PayloadFormat::CloudEvents(ce) if ce.mode == CloudEventsMode::Binary => {
                event.payload.as_bytes().to_vec()
            }
            PayloadFormat::CloudEvents(ce) => ce.envelope(event).into_bytes(),
        }
    }

    /// The body's content type.
    pub fn content_type(&self) -> &'static str {
        match &self.format {
            PayloadFormat::Raw | PayloadFormat::Debezium => "application/json",
            PayloadFormat::CloudEvents(ce) => ce.content_type(),
        }
    }

    /// CloudEvents binary mode's attribute headers for `binding` (see
    /// [`CloudEvents::headers`]); empty in every other format. A sink sends them beside
    /// [`headers`](Routing::headers).
    pub fn cloudevents_headers(&self, event: &Event, binding: Binding) -> Vec<(String, String)> {
        match &self.format {
            PayloadFormat::CloudEvents(ce) => ce.headers(event, binding),
            _ => Vec::new(),
        }
    }
}

/// The Kafka record Debezium's Outbox Event Router makes of a Debezium outbox table's row,
/// but for its value (the event's payload) and topic (its destination): what the WAL relay's
/// `debezium` source stores with such an event under [`header::DEBEZIUM_RECORD`], so that the
/// Debezium shape ([`PayloadFormat::Debezium`]) sends it byte for byte, also when the event is
/// retried from the outbox table. Every value is the exact text Kafka Connect's JSON converter
/// writes (a JSON string with its quotes, a number, `null`).
///
/// ```
/// use outbox_types::routing::DebeziumRecord;
/// let record = DebeziumRecord {
///     key: r#""order-1""#.into(),
///     headers: vec![("tracingspancontext".into(), "null".into())],
///     ..DebeziumRecord::default()
/// };
/// let text = record.to_header();
/// assert_eq!(DebeziumRecord::parse(&text), Some(record));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebeziumRecord {
    /// The key's bytes: the key column as JSON (`"order-1"`, or `42` for an integer column).
    #[serde(rename = "k")]
    pub key: String,
    /// Headers before `id`: the connector's `__debezium.context.*` headers (unless
    /// `extended.headers.enabled = false`).
    #[serde(rename = "c", default, skip_serializing_if = "Vec::is_empty")]
    pub context: Vec<(String, String)>,
    /// Headers after `id`: the `header` placements in the option's order, a NULL column as
    /// `null`.
    #[serde(rename = "h", default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<(String, String)>,
    /// A record without a value (`route.tombstone.on.empty.payload` and an empty payload).
    #[serde(rename = "t", default, skip_serializing_if = "std::ops::Not::not")]
    pub tombstone: bool,
    /// The record timestamp in milliseconds since the epoch, from the
    /// `table.field.event.timestamp` column; `None` leaves it to the sink (its publish time,
    /// as Debezium's processing time).
    #[serde(rename = "ts", default, skip_serializing_if = "Option::is_none")]
    pub timestamp_ms: Option<i64>,
}

impl DebeziumRecord {
    /// The record as the [`header::DEBEZIUM_RECORD`] header's value (compact JSON).
    pub fn to_header(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A header value written by [`DebeziumRecord::to_header`]; `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        serde_json::from_str(text).ok()
    }

    /// The record `event` carries, if any (a header that does not parse counts as none: the
    /// event is then sent in the generic Debezium shape).
    pub fn of(event: &Event) -> Option<Self> {
        event
            .headers
            .get(header::DEBEZIUM_RECORD)
            .and_then(|text| Self::parse(text))
    }
}

/// `value` as a JSON string, quotes included, written as Debezium's JSON converter (Jackson)
/// writes it: `"` and `\` escaped, backspace, tab, newline, form feed and carriage return as
/// `\b \t \n \f \r`, other control characters as `\u00XX` with upper-case hex (`\u001F`),
/// characters beyond the Basic Multilingual Plane as a `\uXXXX\uXXXX` surrogate pair (see
/// [`escape_non_bmp`]), everything else as it is.
///
/// ```
/// use outbox_types::routing::json_string;
/// assert_eq!(json_string("a\"😀"), r#""a\"\uD83D\uDE00""#);
/// assert_eq!(json_string("\u{1f}\n\u{7f}é"), "\"\\u001F\\n\u{7f}é\"");
/// ```
pub fn json_string(value: &str) -> String {
    let mut out = String::with_capacity(json_string_len(value));
    push_json_string(&mut out, value);
    out
}

/// The length in bytes of [`json_string`]`(value)`, counted without building it: what a caller
/// checks against a size limit before it encodes a large value.
///
/// ```
/// use outbox_types::routing::{json_string, json_string_len};
/// for s in ["", "plain", "\u{1}\"\\ü😀\t"] {
///     assert_eq!(json_string_len(s), json_string(s).len());
/// }
/// ```
pub fn json_string_len(value: &str) -> usize {
    2 + value
        .chars()
        .map(|c| match c {
            '"' | '\\' | '\u{8}' | '\t' | '\n' | '\u{c}' | '\r' => 2,
            c if u32::from(c) < 0x20 => 6,
            c if u32::from(c) > 0xFFFF => 12,
            c => c.len_utf8(),
        })
        .sum::<usize>()
}

/// Append [`json_string`]`(value)` to `out`.
pub fn push_json_string(out: &mut String, value: &str) {
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if u32::from(c) < 0x20 || u32::from(c) > 0xFFFF => push_utf16_escapes(out, c),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `c` as `\uXXXX` escapes of its UTF-16 code units, upper-case hex.
fn push_utf16_escapes(out: &mut String, c: char) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut units = [0u16; 2];
    for unit in c.encode_utf16(&mut units) {
        out.push_str("\\u");
        for shift in [12, 8, 4, 0] {
            out.push(char::from(HEX[usize::from((*unit >> shift) & 0xF)]));
        }
    }
}

/// JSON text with every character outside the Basic Multilingual Plane written as a
/// `\uXXXX\uXXXX` surrogate pair (upper-case hex), as Java's JSON writers (and so Debezium's
/// messages) have it; other text is unchanged. Such characters only occur inside strings, where
/// the escape means the same character.
///
/// ```
/// use outbox_types::routing::escape_non_bmp;
/// assert_eq!(escape_non_bmp(r#"{"s":"😀 ü"}"#), r#"{"s":"\uD83D\uDE00 ü"}"#);
/// ```
pub fn escape_non_bmp(json: &str) -> Cow<'_, str> {
    if !json.chars().any(|c| u32::from(c) > 0xFFFF) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 8);
    for c in json.chars() {
        if u32::from(c) > 0xFFFF {
            push_utf16_escapes(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Headers, NewEvent};

    fn event() -> Event {
        let mut headers = Headers::new();
        headers.insert("traceparent".into(), "00-abc-def-01".into());
        headers.insert("outbox-event-id".into(), "forged".into());
        NewEvent::from_json("order", "42", "OrderCreated", r#"{"amount": 1999}"#)
            .unwrap()
            .with_headers(headers)
            .with_idempotency_key("k-1")
            .claimed(1)
    }

    #[test]
    fn own_destination_wins_over_the_template() {
        let routing = Routing::new(Template::parse("${aggregate_type}.events").unwrap());
        let mut e = event();
        assert_eq!(routing.destination(&e), "order.events");
        e.destination = Some("audit".into());
        assert_eq!(routing.destination(&e), "audit");
    }

    #[test]
    fn templates_fill_every_field() {
        let e = event();
        let t = Template::parse("x.${event_type}.${aggregate_type}.${aggregate_id}.${header.traceparent}.${header.none}").unwrap();
        assert_eq!(t.render(&e), "x.OrderCreated.order.42.00-abc-def-01.");
        assert!(Template::parse("a.${event_type").is_err());
        assert!(Template::parse("").is_err());
    }

    #[test]
    fn url_rendering_encodes_every_value_byte_outside_the_unreserved_set() {
        let mut e = event();
        e.aggregate_id = "a/b?c=d#e f%2e%2E\\ü@:".into();
        e.event_type = "Az09-._~".into();
        e.headers.insert("tenant".into(), "x&y=z".into());
        let t = Template::parse("http://h:8080/p/${aggregate_id}/${event_type}?t=${header.tenant}")
            .unwrap();
        assert_eq!(
            t.render_url_encoded(&e),
            "http://h:8080/p/a%2Fb%3Fc%3Dd%23e%20f%252e%252E%5C%C3%BC%40%3A/Az09-._~?t=x%26y%3Dz"
        );
        // The template's own text is not touched, and the raw rendering is unchanged.
        assert_eq!(
            t.render(&e),
            "http://h:8080/p/a/b?c=d#e f%2e%2E\\ü@:/Az09-._~?t=x&y=z"
        );
    }

    #[test]
    fn headers_carry_the_event_fields_and_cannot_be_forged() {
        let e = event();
        let h = Routing::new(Template::fixed("t")).headers(&e);
        let get = |n: &str| {
            h.iter()
                .filter(|(k, _)| k == n)
                .map(|(_, v)| v.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(get(header::EVENT_ID), vec![e.id.to_string()]);
        assert_eq!(get(header::IDEMPOTENCY_KEY), vec!["k-1".to_owned()]);
        assert_eq!(get("traceparent"), vec!["00-abc-def-01".to_owned()]);
    }

    #[test]
    fn cloudevents_envelope_is_valid_json_with_the_payload_as_data() {
        let e = event();
        let routing = Routing::new(Template::fixed("t"))
            .with_format(PayloadFormat::CloudEvents(CloudEvents::new("/orders")));
        let body = String::from_utf8(routing.body(&e)).unwrap();
        assert!(body.contains(r#""data":{"amount": 1999}"#), "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["type"], "OrderCreated");
        assert_eq!(v["source"], "/orders");
        assert_eq!(v["id"], e.id.to_string());
        assert_eq!(v["traceparent"], "00-abc-def-01");
        assert_eq!(routing.content_type(), "application/cloudevents+json");
    }

    #[test]
    fn binary_cloudevents_carry_attribute_headers_and_no_forged_ones() {
        let mut e = event();
        e.headers.insert("ce-type".into(), "Forged".into());
        e.headers.insert("CE_ID".into(), "forged".into());
        let binary = Routing::new(Template::fixed("t")).with_format(PayloadFormat::CloudEvents(
            CloudEvents::new("/orders").with_mode(CloudEventsMode::Binary),
        ));
        let names: Vec<String> = binary.headers(&e).into_iter().map(|(k, _)| k).collect();
        assert!(
            !names.iter().any(|n| n.eq_ignore_ascii_case("ce-type")),
            "{names:?}"
        );
        assert!(
            !names.iter().any(|n| n.eq_ignore_ascii_case("ce_id")),
            "{names:?}"
        );
        assert!(names.contains(&"traceparent".to_owned()), "{names:?}");
        let ce = binary.cloudevents_headers(&e, Binding::Kafka);
        assert!(
            ce.contains(&("ce_type".to_owned(), "OrderCreated".to_owned())),
            "{ce:?}"
        );
        assert!(
            ce.contains(&("ce_id".to_owned(), e.id.to_string())),
            "{ce:?}"
        );
        assert_eq!(binary.body(&e), e.payload.as_bytes());
        assert_eq!(binary.content_type(), "application/json");
        // Structured mode sends writer headers as they are, and no attribute headers.
        let structured = Routing::new(Template::fixed("t"))
            .with_format(PayloadFormat::CloudEvents(CloudEvents::new("/orders")));
        assert!(structured.headers(&e).iter().any(|(k, _)| k == "ce-type"));
        assert!(
            structured
                .cloudevents_headers(&e, Binding::Kafka)
                .is_empty()
        );
    }

    /// A row header in the reserved prefix is never sent, in any case: a forged
    /// `Outbox-Event-Id` does not travel beside the real one (nor an `ID` beside Debezium's
    /// `id`).
    #[test]
    fn reserved_headers_are_dropped_in_any_case() {
        let mut e = event();
        for name in ["Outbox-Event-Id", "OUTBOX-TENANT", "outbox-Aggregate-Id"] {
            e.headers.insert(name.into(), "forged".into());
        }
        e.headers.insert("ID".into(), "forged-id".into());
        e.headers.insert("Outboxed".into(), "kept".into());
        for format in [PayloadFormat::Raw, PayloadFormat::Debezium] {
            let h = Routing::new(Template::fixed("t"))
                .with_format(format.clone())
                .headers(&e);
            assert!(
                !h.iter()
                    .any(|(_, v)| v.contains("forged\"") || v == "forged"),
                "{format:?}: {h:?}"
            );
            assert!(h.iter().any(|(k, _)| k == "Outboxed"), "{format:?}: {h:?}");
        }
        let debezium = Routing::new(Template::fixed("t"))
            .with_format(PayloadFormat::Debezium)
            .headers(&e);
        assert!(
            !debezium.iter().any(|(_, v)| v.contains("forged-id")),
            "{debezium:?}"
        );
    }

    #[test]
    fn debezium_shape_quotes_key_and_headers_and_sends_a_null_payload_as_null() {
        let mut e = event();
        e.headers.insert("eventType".into(), "OrderCreated".into());
        let routing = Routing::new(Template::fixed("t")).with_format(PayloadFormat::Debezium);
        assert_eq!(routing.key(&e), "\"42\"");
        let h = routing.headers(&e);
        assert_eq!(h[0], ("id".to_owned(), format!("\"{}\"", e.id)));
        assert!(h.contains(&("eventType".to_owned(), "\"OrderCreated\"".to_owned())));
        assert!(h.contains(&("traceparent".to_owned(), "\"00-abc-def-01\"".to_owned())));
        assert!(!h.iter().any(|(k, _)| k.starts_with("outbox-")), "{h:?}");
        assert_eq!(routing.body(&e), br#"{"amount": 1999}"#);
        assert!(!routing.is_tombstone(&e));
        // A `null` payload is the value `null`, as the router sends it by default.
        e.payload = "null".into();
        assert!(!routing.is_tombstone(&e));
        assert_eq!(routing.body(&e), b"null");
        assert_eq!(Routing::new(Template::fixed("t")).body(&e), b"null");
    }

    #[test]
    fn a_debezium_record_decides_key_headers_tombstone_and_timestamp() {
        let mut e = event();
        let record = DebeziumRecord {
            key: "42".into(),
            context: vec![("__debezium.context.taskId".into(), "\"0\"".into())],
            headers: vec![
                ("span".into(), "null".into()),
                ("id".into(), "\"forged\"".into()),
                ("n".into(), "7".into()),
            ],
            tombstone: true,
            timestamp_ms: Some(1_714_558_830_123),
        };
        e.payload = "null".into();
        e.headers
            .insert(header::DEBEZIUM_RECORD.into(), record.to_header());
        let routing = Routing::new(Template::fixed("t")).with_format(PayloadFormat::Debezium);
        assert_eq!(routing.key(&e), "42");
        let names: Vec<(String, String)> = routing.headers(&e);
        assert_eq!(
            names,
            vec![
                ("__debezium.context.taskId".to_owned(), "\"0\"".to_owned()),
                ("id".to_owned(), format!("\"{}\"", e.id)),
                ("span".to_owned(), "null".to_owned()),
                ("n".to_owned(), "7".to_owned()),
            ]
        );
        assert!(routing.is_tombstone(&e));
        assert!(routing.body(&e).is_empty());
        assert_eq!(routing.record_timestamp(&e), Some(1_714_558_830_123));
        // The other shapes never send the record, nor treat anything as a tombstone.
        let raw = Routing::new(Template::fixed("t"));
        assert!(!raw.is_tombstone(&e));
        assert_eq!(raw.record_timestamp(&e), None);
        assert!(
            !raw.headers(&e)
                .iter()
                .any(|(k, _)| k == header::DEBEZIUM_RECORD)
        );
        // A record that does not parse counts as none.
        e.headers
            .insert(header::DEBEZIUM_RECORD.into(), "{\"k\":".into());
        assert_eq!(routing.key(&e), "\"42\"");
        assert!(!routing.is_tombstone(&e));
    }

    #[test]
    fn json_strings_escape_as_jackson_does() {
        let all: String = (0u32..0x20).filter_map(char::from_u32).collect();
        assert_eq!(
            json_string(&all),
            "\"\\u0000\\u0001\\u0002\\u0003\\u0004\\u0005\\u0006\\u0007\\b\\t\\n\\u000B\\f\\r\\u000E\\u000F\\u0010\\u0011\\u0012\\u0013\\u0014\\u0015\\u0016\\u0017\\u0018\\u0019\\u001A\\u001B\\u001C\\u001D\\u001E\\u001F\""
        );
        assert_eq!(json_string("/\u{7f}\u{2028}"), "\"/\u{7f}\u{2028}\"");
        assert_eq!(json_string_len(&all), json_string(&all).len());
    }

    #[test]
    fn body_format_names_its_payload_format_and_what_cloudevents_needs() {
        let keys = CloudEventsKeys::default();
        assert_eq!(
            BodyFormat::Debezium.payload_format(keys),
            Ok(PayloadFormat::Debezium)
        );
        let blank = CloudEventsKeys {
            source: Some(" "),
            ..keys
        };
        let err = BodyFormat::Cloudevents.payload_format(blank).unwrap_err();
        assert!(err.contains("cloudevents_source"), "{err}");
        let binary = CloudEventsKeys {
            mode: Some(CloudEventsMode::Binary),
            ..keys
        };
        let err = BodyFormat::Raw.payload_format(binary).unwrap_err();
        assert!(
            err.contains("`cloudevents_mode = \"binary\"` applies only"),
            "{err}"
        );
        let spaced = CloudEventsKeys {
            source: Some("/s"),
            type_prefix: Some("com example"),
            ..keys
        };
        let err = BodyFormat::Cloudevents.payload_format(spaced).unwrap_err();
        assert!(err.contains("cloudevents_type_prefix"), "{err}");
        let ok = CloudEventsKeys {
            source: Some("/s"),
            type_prefix: Some("com.example"),
            ..binary
        };
        assert_eq!(
            BodyFormat::Cloudevents.payload_format(ok),
            Ok(PayloadFormat::CloudEvents(
                CloudEvents::new("/s")
                    .with_mode(CloudEventsMode::Binary)
                    .with_type_prefix("com.example")
            ))
        );
        let f: BodyFormat = serde_json::from_str("\"cloud_events\"").unwrap();
        assert_eq!(f, BodyFormat::Cloudevents);
    }
}
