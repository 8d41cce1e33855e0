//! CloudEvents 1.0 for every sink: one set of attributes per event, written either as a JSON
//! envelope (structured mode) or as message headers beside the payload bytes (binary mode),
//! following each protocol binding's naming.
//!
//! Why both modes: structured mode is one self-describing body that survives any hop, but a
//! consumer that only wants the payload must unwrap it; binary mode leaves the payload bytes
//! as they were committed (the same body as `format = "raw"`) and puts the attributes where the
//! protocol's CloudEvents binding says, so CloudEvents SDKs and plain consumers read the same
//! message.
//!
//! The attributes of an event:
//!
//! | attribute | value |
//! |---|---|
//! | `specversion` | `1.0` |
//! | `id` | the event id |
//! | `source` | the sink's `cloudevents_source` |
//! | `type` | the event type, after `cloudevents_type_prefix` when one is set |
//! | `subject` | the aggregate id |
//! | `time` | `occurred_at`, RFC 3339 |
//! | `datacontenttype` | `application/json` |
//! | `partitionkey` | the aggregate id ([Partitioning extension]) |
//! | `aggregatetype` | the aggregate type |
//! | `idempotencykey` | the writer's idempotency key, when set |
//! | extensions | each writer header, its name lower-cased with everything but `a-z 0-9` removed (`Tenant-Id` → `tenantid`, `traceparent` stays); a header whose name becomes empty, names one of the attributes above or `data`/`data_base64`/`dataschema`, starts with `outbox-` (in any case), or maps to a name an earlier header (in name order) took, is not made an extension — it still travels as a message header |
//!
//! [Partitioning extension]: https://github.com/cloudevents/spec/blob/main/cloudevents/extensions/partitioning.md
//!
//! ```
//! use outbox_types::cloudevents::{Binding, CloudEvents, Mode};
//! # let mut event = outbox_types::NewEvent::from_json("order", "42", "OrderCreated", r#"{"a":1}"#).unwrap().claimed(1);
//! event.headers.insert("Tenant-Id".into(), "acme".into());
//! let ce = CloudEvents::new("/orders-service").with_type_prefix("com.example.orders");
//! let envelope: serde_json::Value = serde_json::from_str(&ce.envelope(&event)).unwrap();
//! assert_eq!(envelope["type"], "com.example.orders.OrderCreated");
//! assert_eq!(envelope["tenantid"], "acme");
//! assert_eq!(envelope["data"]["a"], 1);
//!
//! let binary = ce.with_mode(Mode::Binary);
//! let headers = binary.headers(&event, Binding::Kafka);
//! assert!(headers.contains(&("ce_type".to_owned(), "com.example.orders.OrderCreated".to_owned())));
//! assert!(headers.contains(&("ce_partitionkey".to_owned(), "42".to_owned())));
//! ```

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::event::Event;

/// How the attributes travel (`cloudevents_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One JSON envelope as the body (`application/cloudevents+json`), the payload as `data`.
    #[default]
    Structured,
    /// The payload bytes as the body (`application/json`), the attributes as headers named by
    /// the protocol binding ([`Binding`]).
    Binary,
}

/// A protocol binding's rules for binary mode: the attribute prefix, where `datacontenttype`
/// goes, and how values are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    /// Kafka: `ce_` headers; `datacontenttype` is the `content-type` header.
    Kafka,
    /// HTTP: `ce-` headers with values percent-encoded as the binding requires (space, `"`,
    /// `%` and everything outside printable ASCII); `datacontenttype` is `Content-Type`.
    Http,
    /// RabbitMQ (AMQP 0-9-1), as its CloudEvents protocol binding (written by Knative's
    /// eventing-rabbitmq and read by the official SDKs' `rabbitmq` bindings): `ce-` headers;
    /// `datacontenttype` is the `content_type` property. The AMQP binding's `cloudEvents_`
    /// application properties are AMQP 1.0's, which a RabbitMQ sink does not speak.
    RabbitMq,
    /// NATS: `ce-` headers for every attribute, `datacontenttype` included.
    Nats,
}

impl Binding {
    fn prefix(self) -> &'static str {
        match self {
            Binding::Kafka => "ce_",
            Binding::Http | Binding::Nats | Binding::RabbitMq => "ce-",
        }
    }
}

/// Names an extension may not take: the context attributes, the ones we always set, and the
/// names event formats reserve.
const RESERVED: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
    "data_base64",
    "partitionkey",
    "aggregatetype",
    "idempotencykey",
];

/// The content type of the payload (`datacontenttype`): stored payloads are JSON.
pub const DATA_CONTENT_TYPE: &str = "application/json";
/// The content type of a structured-mode body.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// A sink's CloudEvents settings: `cloudevents_source`, `cloudevents_mode`,
/// `cloudevents_type_prefix`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudEvents {
    /// The `source` attribute, e.g. `/orders-service`.
    pub source: String,
    /// Structured (default) or binary.
    #[serde(default)]
    pub mode: Mode,
    /// Put before the event type in `type`, joined with a `.` unless it already ends with one
    /// (reverse-DNS, e.g. `com.example.orders` → `com.example.orders.OrderCreated`).
    #[serde(default)]
    pub type_prefix: Option<String>,
}

impl CloudEvents {
    /// Structured mode, no type prefix.
    pub fn new(source: impl Into<String>) -> Self {
        CloudEvents {
            source: source.into(),
            mode: Mode::Structured,
            type_prefix: None,
        }
    }

    /// Use `mode`.
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Prefix every `type` with `prefix` (see [`CloudEvents::type_prefix`]).
    pub fn with_type_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.type_prefix = Some(prefix.into());
        self
    }

    /// The `type` attribute of `event`.
    pub fn event_type(&self, event: &Event) -> String {
        match self.type_prefix.as_deref().filter(|p| !p.is_empty()) {
            Some(prefix) if prefix.ends_with('.') => format!("{prefix}{}", event.event_type),
            Some(prefix) => format!("{prefix}.{}", event.event_type),
            None => event.event_type.clone(),
        }
    }

    /// Every attribute of `event` except `data`, in a fixed order: the context attributes, then
    /// `partitionkey`, `aggregatetype`, `idempotencykey` (when set) and the extensions from the
    /// writer's headers (see the [module docs](self)).
    pub fn attributes(&self, event: &Event) -> Vec<(String, String)> {
        let mut out = Vec::with_capacity(10 + event.headers.len());
        let mut put = |name: &str, value: String| out.push((name.to_owned(), value));
        put("specversion", "1.0".to_owned());
        put("id", event.id.to_string());
        put("source", self.source.clone());
        put("type", self.event_type(event));
        put("subject", event.aggregate_id.clone());
        put("time", event.occurred_at.to_rfc3339());
        put("datacontenttype", DATA_CONTENT_TYPE.to_owned());
        put("partitionkey", event.aggregate_id.clone());
        put("aggregatetype", event.aggregate_type.clone());
        if let Some(key) = &event.idempotency_key {
            put("idempotencykey", key.clone());
        }
        let mut taken = BTreeSet::new();
        for (name, value) in &event.headers {
            if let Some(ext) = extension_name(name)
                && taken.insert(ext.clone())
            {
                out.push((ext, value.clone()));
            }
        }
        out
    }

    /// A structured-mode JSON envelope: the attributes, then `data`, the stored payload spliced
    /// in byte for byte (its whitespace and key order kept).
    pub fn envelope(&self, event: &Event) -> String {
        let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned());
        let mut out = String::with_capacity(event.payload.len() + 320);
        out.push('{');
        for (name, value) in self.attributes(event) {
            out.push_str(&quote(&name));
            out.push(':');
            out.push_str(&quote(&value));
            out.push(',');
        }
        out.push_str("\"data\":");
        out.push_str(&event.payload);
        out.push('}');
        out
    }

    /// Binary mode's headers for `binding`: each attribute under the binding's prefix, except
    /// `datacontenttype` where the binding maps it to the protocol's content type (which the
    /// sink sets from [`Routing::content_type`](crate::routing::Routing::content_type)). Empty
    /// in structured mode.
    pub fn headers(&self, event: &Event, binding: Binding) -> Vec<(String, String)> {
        if self.mode != Mode::Binary {
            return Vec::new();
        }
        let prefix = binding.prefix();
        self.attributes(event)
            .into_iter()
            .filter(|(name, _)| binding == Binding::Nats || name != "datacontenttype")
            .map(|(name, value)| {
                let value = match binding {
                    Binding::Http => http_header_value(&value),
                    _ => value,
                };
                (format!("{prefix}{name}"), value)
            })
            .collect()
    }

    /// The body's content type in this mode.
    pub fn content_type(&self) -> &'static str {
        match self.mode {
            Mode::Structured => STRUCTURED_CONTENT_TYPE,
            Mode::Binary => DATA_CONTENT_TYPE,
        }
    }
}

/// Whether a header name is one a CloudEvents binding uses for an attribute in binary mode
/// (`ce_…`, `ce-…`, `cloudEvents_…`, `cloudEvents:…`, any case): a writer header with such a
/// name is not sent in binary mode, so it cannot pose as an attribute (its value still travels
/// as the extension it maps to).
///
/// ```
/// use outbox_types::cloudevents::is_binding_attribute;
/// assert!(is_binding_attribute("CE-Type"));
/// assert!(is_binding_attribute("cloudEvents:id"));
/// assert!(!is_binding_attribute("center"));
/// ```
pub fn is_binding_attribute(header: &str) -> bool {
    let lower = header.to_ascii_lowercase();
    ["ce_", "ce-", "cloudevents_", "cloudevents:"]
        .iter()
        .any(|p| lower.starts_with(p))
}

/// The extension a writer header becomes, if any (see the [module docs](self)).
///
/// ```
/// use outbox_types::cloudevents::extension_name;
/// assert_eq!(extension_name("Tenant-Id").as_deref(), Some("tenantid"));
/// assert_eq!(extension_name("traceparent").as_deref(), Some("traceparent"));
/// assert_eq!(extension_name("outbox-partition"), None);
/// assert_eq!(extension_name("__outbox.debezium"), None);
/// assert_eq!(extension_name("Outbox-Event-Id"), None);
/// assert_eq!(extension_name("Type"), None);
/// assert_eq!(extension_name("--"), None);
/// ```
pub fn extension_name(header: &str) -> Option<String> {
    if crate::routing::header::is_internal(header) {
        return None;
    }
    let name: String = header
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect();
    (!name.is_empty() && !RESERVED.contains(&name.as_str())).then_some(name)
}

/// `value` percent-encoded as the HTTP binding requires of a header value: space, `"`, `%`, and
/// every byte outside printable ASCII (U+0021–U+007E) as `%XX` of its UTF-8 bytes.
///
/// ```
/// assert_eq!(outbox_types::cloudevents::http_header_value("a b\"%ü"), "a%20b%22%25%C3%BC");
/// ```
pub fn http_header_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for &b in value.as_bytes() {
        if (0x21..=0x7e).contains(&b) && b != b'"' && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::NewEvent;

    fn event() -> Event {
        let mut e = NewEvent::from_json(
            "order",
            "42",
            "OrderCreated",
            "{\"amount\": 1999,\n \"a\": [1]}",
        )
        .unwrap()
        .with_idempotency_key("k-1")
        .claimed(1);
        for (k, v) in [
            ("traceparent", "00-abc-def-01"),
            ("Tenant-Id", "acme"),
            ("tenant_id", "second"),
            ("type", "forged"),
            ("outbox-partition", "3"),
            ("région", "eu west"),
        ] {
            e.headers.insert(k.into(), v.into());
        }
        e
    }

    #[test]
    fn structured_envelope_has_every_attribute_and_the_payload_verbatim() {
        let e = event();
        let ce = CloudEvents::new("/orders").with_type_prefix("com.example.");
        let body = ce.envelope(&e);
        assert!(
            body.ends_with(",\"data\":{\"amount\": 1999,\n \"a\": [1]}}"),
            "{body}"
        );
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["id"], e.id.to_string());
        assert_eq!(v["source"], "/orders");
        assert_eq!(v["type"], "com.example.OrderCreated");
        assert_eq!(v["subject"], "42");
        assert_eq!(v["partitionkey"], "42");
        assert_eq!(v["aggregatetype"], "order");
        assert_eq!(v["idempotencykey"], "k-1");
        assert_eq!(v["datacontenttype"], "application/json");
        assert_eq!(v["traceparent"], "00-abc-def-01");
        // `Tenant-Id` sorts before `tenant_id`: it takes `tenantid`, the second is left out.
        assert_eq!(v["tenantid"], "acme");
        assert_eq!(v["rgion"], "eu west");
        // A header cannot replace an attribute, and reserved headers are not extensions.
        assert_eq!(v["type"], "com.example.OrderCreated");
        assert!(v.get("outboxpartition").is_none());
        assert_eq!(ce.content_type(), "application/cloudevents+json");
        assert!(ce.headers(&e, Binding::Kafka).is_empty());
    }

    #[test]
    fn type_prefix_is_joined_with_one_dot() {
        let e = event();
        for prefix in ["com.example", "com.example."] {
            let ce = CloudEvents::new("/s").with_type_prefix(prefix);
            assert_eq!(ce.event_type(&e), "com.example.OrderCreated");
        }
        assert_eq!(CloudEvents::new("/s").event_type(&e), "OrderCreated");
    }

    #[test]
    fn binary_headers_follow_each_binding() {
        let e = event();
        let ce = CloudEvents::new("/orders").with_mode(Mode::Binary);
        assert_eq!(ce.content_type(), "application/json");
        let get = |h: &[(String, String)], n: &str| {
            h.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone())
        };
        let kafka = ce.headers(&e, Binding::Kafka);
        assert_eq!(get(&kafka, "ce_specversion").as_deref(), Some("1.0"));
        assert_eq!(get(&kafka, "ce_id"), Some(e.id.to_string()));
        assert_eq!(get(&kafka, "ce_partitionkey").as_deref(), Some("42"));
        assert_eq!(get(&kafka, "ce_datacontenttype"), None);
        let http = ce.headers(&e, Binding::Http);
        assert_eq!(get(&http, "ce-rgion").as_deref(), Some("eu%20west"));
        assert_eq!(get(&http, "ce-source").as_deref(), Some("/orders"));
        assert_eq!(get(&http, "ce-time"), Some(e.occurred_at.to_rfc3339()));
        let rabbitmq = ce.headers(&e, Binding::RabbitMq);
        assert_eq!(get(&rabbitmq, "ce-type").as_deref(), Some("OrderCreated"));
        assert_eq!(get(&rabbitmq, "ce-datacontenttype"), None);
        let nats = ce.headers(&e, Binding::Nats);
        assert_eq!(
            get(&nats, "ce-datacontenttype").as_deref(),
            Some("application/json")
        );
        assert_eq!(get(&nats, "ce-rgion").as_deref(), Some("eu west"));
    }
}
