//! # outbox-sink-stdout
//!
//! Publishes each event as one JSON line, to standard output or appended to a file. The simplest
//! destination there is: for trying the relay out, for piping into another program, and for
//! tests that read what was delivered.
//!
//! Each line is an envelope around the payload, which is written byte for byte as stored:
//!
//! ```text
//! {"id":"0190…","seq":1,"aggregate_type":"order","aggregate_id":"42","event_type":"OrderCreated",
//!  "destination":null,"headers":{},"idempotency_key":null,"occurred_at":"2026-…Z","attempt":1,"payload":{"amount":1999}}
//! ```
//!
//! With `format = "debezium"` each line is instead the Kafka record a `format = "debezium"`
//! destination would send (Debezium's Outbox Event Router through the JSON converter): the
//! topic, the partition and timestamp when the event names them, the key's and every header's
//! exact bytes as strings, the value (`null` with `"tombstone":true` for a record without one):
//!
//! ```text
//! {"topic":"outbox.event.Order","partition":null,"timestamp":null,"key":"\"order-1\"",
//!  "headers":[["id","\"0190…\""],["eventType","\"OrderCreated\""]],"value":"{\"amount\":42}","tombstone":false}
//! ```
//!
//! The value is the body's bytes as a JSON string too, so that what a consumer receives can be
//! read off exactly (here an expanded payload, `{"amount":42}`; by default Debezium sends the
//! payload's text as a JSON string, which the line then shows quoted twice).
//! The topic of an event without a destination of its own comes from `topic` (default
//! `outbox.event.${aggregate_type}`, the router's default).
//!
//! A batch counts as delivered once its lines were written and flushed (and, for a file with
//! `sync` set, forced to disk). A write error (disk full, closed pipe) is `Unavailable`: the
//! events wait, costing no attempt.
//!
//! ## Why a regular file without `sync` is written on the calling thread
//!
//! Such an append goes to the page cache and returns in microseconds. Through tokio's file type
//! every batch was handed to the blocking pool and back, two thread wake-ups per batch: in WAL
//! mode at 2,000 events/s (a batch per event) that hand-off was 31 % of the relay's CPU. So a
//! regular file is appended with one `write` on the calling thread. A file with `sync` (the
//! forced write waits for the disk) and anything that is not a regular file (a named pipe, a
//! terminal: a write may wait for a reader) still go through the blocking pool, as standard
//! output does.

use std::path::{Path, PathBuf};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_types::routing::{
    BodyFormat, CloudEventsKeys, PayloadFormat, Routing, Template, header,
};
use outbox_types::{Event, EventId, Headers, Outcome, Sink, SinkError};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

/// The envelope written for each event.
#[derive(Serialize)]
struct Line<'a> {
    id: EventId,
    seq: i64,
    aggregate_type: &'a str,
    aggregate_id: &'a str,
    event_type: &'a str,
    destination: Option<&'a str>,
    headers: &'a Headers,
    idempotency_key: Option<&'a str>,
    occurred_at: DateTime<Utc>,
    attempt: u32,
    payload: &'a RawValue,
}

/// The line written for each event with `format = "debezium"`: the Kafka record.
#[derive(Serialize)]
struct RecordLine<'a> {
    topic: String,
    partition: Option<i32>,
    timestamp: Option<i64>,
    key: &'a str,
    headers: Vec<(String, String)>,
    value: Option<String>,
    tombstone: bool,
}

enum Target {
    Stdout(tokio::io::Stdout),
    /// A file forced to disk per batch, or one that is not a regular file: written on the
    /// blocking pool (see the crate docs).
    File {
        file: tokio::fs::File,
        sync: bool,
    },
    /// A regular file without `sync`: appended on the calling thread.
    Append(std::fs::File),
}

/// Settings of the stdout sink: where the lines go. The default writes to standard output.
///
/// ```
/// let config: outbox_sink_stdout::StdoutSinkConfig =
///     serde_json::from_str(r#"{"path": "/var/log/outbox/events.jsonl", "sync": true}"#).unwrap();
/// assert!(outbox_sink_stdout::StdoutSink::check_config(&config).is_ok());
/// ```
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StdoutSinkConfig {
    /// Append to this file (created if needed) instead of writing to standard output.
    pub path: Option<PathBuf>,
    /// With `path`: force every batch to disk before it counts as delivered.
    pub sync: bool,
    /// `raw` (default): the envelope line above; `debezium`: the Kafka record a `format =
    /// "debezium"` destination sends. (`cloudevents` is refused: a broker destination shows it.)
    pub format: BodyFormat,
    /// With `format = "debezium"`: the topic of an event that names no destination itself.
    /// Default `outbox.event.${aggregate_type}`.
    pub topic: Option<Template>,
}

/// The default topic template of the Debezium lines: the Outbox Event Router's default route.
pub const DEFAULT_DEBEZIUM_TOPIC: &str = "outbox.event.${aggregate_type}";

/// Writes events as JSON lines.
pub struct StdoutSink {
    name: &'static str,
    path: Option<PathBuf>,
    target: Mutex<Target>,
    /// The Debezium shape's routing, with `format = "debezium"`.
    debezium: Option<Routing>,
}

impl StdoutSink {
    /// The sink `config` describes: standard output, or the file at `path`. The constructor
    /// every sink has; the only error is a file that cannot be opened for appending.
    pub async fn connect(config: StdoutSinkConfig) -> Result<Self, SinkError> {
        Self::check_config(&config)?;
        let sink = match &config.path {
            None => Self::stdout(),
            Some(path) => Self::file(path, config.sync).await?,
        };
        sink.with_format(config.format, config.topic)
    }

    /// Check `config` without opening anything: `format` is `raw` or `debezium`.
    pub fn check_config(config: &StdoutSinkConfig) -> Result<(), SinkError> {
        Self::stdout()
            .with_format(config.format, config.topic.clone())
            .map(|_| ())
    }

    /// Write lines in `format` (`raw` or `debezium`, see the [crate docs](crate)); `topic` is
    /// the Debezium lines' topic template for events without a destination.
    pub fn with_format(
        mut self,
        format: BodyFormat,
        topic: Option<Template>,
    ) -> Result<Self, SinkError> {
        match format.payload_format(CloudEventsKeys::default()) {
            Ok(PayloadFormat::Raw) => {
                if topic.is_some() {
                    return Err(SinkError::Config(
                        "`topic` applies only with `format = \"debezium\"`: set that format, or remove `topic`".to_owned(),
                    ));
                }
                self.debezium = None;
            }
            Ok(PayloadFormat::Debezium) => {
                let topic = match topic {
                    Some(t) => t,
                    None => Template::parse(DEFAULT_DEBEZIUM_TOPIC)
                        .map_err(|e| SinkError::Config(e.to_string()))?,
                };
                self.debezium = Some(Routing::new(topic).with_format(PayloadFormat::Debezium));
            }
            Ok(PayloadFormat::CloudEvents(_)) | Err(_) => {
                return Err(SinkError::Config(format!(
                    "`format = \"{}\"` is not a line format of the {} sink: use `raw` (the event as stored) or `debezium` (the Kafka record Debezium's shape sends)",
                    serde_json::to_value(format)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                    self.name
                )));
            }
        }
        Ok(self)
    }

    /// Write to standard output.
    pub fn stdout() -> Self {
        StdoutSink {
            name: "stdout",
            path: None,
            target: Mutex::new(Target::Stdout(tokio::io::stdout())),
            debezium: None,
        }
    }

    /// Append to the file at `path`, creating it if needed. With `sync`, every batch is forced to
    /// disk before it counts as delivered.
    pub async fn file(path: impl AsRef<Path>, sync: bool) -> Result<Self, SinkError> {
        let path = path.as_ref().to_path_buf();
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .await
            .map_err(|e| {
                SinkError::Config(format!(
                    "cannot open `{}` for appending: {e} (check the directory exists and is writable)",
                    path.display()
                ))
            })?;
        let regular = file
            .metadata()
            .await
            .map(|m| m.file_type().is_file())
            .unwrap_or(false);
        let target = if regular && !sync {
            Target::Append(file.into_std().await)
        } else {
            Target::File { file, sync }
        };
        Ok(StdoutSink {
            name: "file",
            path: Some(path),
            target: Mutex::new(target),
            debezium: None,
        })
    }

    /// Render one event as the Kafka record the Debezium shape sends (without the newline).
    pub fn render_record(routing: &Routing, event: &Event) -> Result<String, String> {
        let tombstone = routing.is_tombstone(event);
        let partition = match event.headers.get(header::PARTITION) {
            Some(p) => Some(p.parse::<i32>().ok().filter(|p| *p >= 0).ok_or_else(|| {
                format!("partition `{p}` is not a partition number: fix the Debezium `partition` placement's column")
            })?),
            None => None,
        };
        let body = routing.body(event);
        let value = if tombstone {
            None
        } else {
            Some(String::from_utf8(body).map_err(|e| format!("the value is not UTF-8: {e}"))?)
        };
        let line = RecordLine {
            topic: routing.destination(event),
            partition,
            timestamp: routing.record_timestamp(event),
            key: &routing.key(event),
            headers: routing.headers(event),
            value,
            tombstone,
        };
        serde_json::to_string(&line).map_err(|e| e.to_string())
    }

    /// Render one event as its JSON line (without the newline).
    pub fn render(event: &Event) -> Result<String, String> {
        let payload: &RawValue = serde_json::from_str(&event.payload)
            .map_err(|e| format!("stored payload is not valid JSON: {e}"))?;
        let line = Line {
            id: event.id,
            seq: event.seq,
            aggregate_type: &event.aggregate_type,
            aggregate_id: &event.aggregate_id,
            event_type: &event.event_type,
            destination: event.destination.as_deref(),
            headers: &event.headers,
            idempotency_key: event.idempotency_key.as_deref(),
            occurred_at: event.occurred_at,
            attempt: event.attempts + 1,
            payload,
        };
        serde_json::to_string(&line).map_err(|e| e.to_string())
    }
}

async fn write_all<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(bytes).await?;
    w.flush().await
}

#[async_trait]
impl Sink for StdoutSink {
    fn name(&self) -> &str {
        self.name
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut outcomes = vec![Outcome::Delivered; events.len()];
        let mut buffer = String::with_capacity(events.len() * 256);
        let mut written = Vec::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            let line = match &self.debezium {
                Some(routing) => Self::render_record(routing, event),
                None => Self::render(event),
            };
            match line {
                Ok(line) => {
                    buffer.push_str(&line);
                    buffer.push('\n');
                    written.push(i);
                }
                Err(reason) => outcomes[i] = Outcome::reject(reason),
            }
        }
        if written.is_empty() {
            return outcomes;
        }
        let mut target = self.target.lock().await;
        let result = match &mut *target {
            Target::Stdout(out) => write_all(out, buffer.as_bytes()).await,
            Target::File { file, sync } => {
                let mut result = write_all(file, buffer.as_bytes()).await;
                if result.is_ok() && *sync {
                    result = file.sync_data().await;
                }
                result
            }
            Target::Append(file) => std::io::Write::write_all(file, buffer.as_bytes()),
        };
        if let Err(e) = result {
            let place = self
                .path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "standard output".to_owned());
            let reason = format!("writing to {place} failed: {e}");
            for i in written {
                outcomes[i] = Outcome::unavailable(reason.clone());
            }
        }
        outcomes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: i64, payload: &str) -> Event {
        let event = outbox_types::NewEvent::from_json("order", "1", "OrderCreated", "{}")
            .unwrap()
            .with_idempotency_key("k")
            .claimed(seq);
        Event {
            payload: payload.into(),
            ..event
        }
    }

    #[tokio::test]
    async fn file_gets_one_line_per_event_with_the_payload_verbatim() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let sink = StdoutSink::connect(StdoutSinkConfig {
            path: Some(path.clone()),
            sync: true,
            ..StdoutSinkConfig::default()
        })
        .await
        .unwrap();
        let outcomes = sink
            .publish(&[event(1, r#"{"b":2,  "a":1}"#), event(2, "[1,2]")])
            .await;
        assert_eq!(outcomes, vec![Outcome::Delivered, Outcome::Delivered]);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(
            lines[0].contains(r#""payload":{"b":2,  "a":1}"#),
            "{}",
            lines[0]
        );
        let parsed: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(parsed["seq"], 2);
        assert_eq!(parsed["idempotency_key"], "k");
    }

    #[tokio::test]
    async fn a_regular_file_without_sync_is_appended_inline_and_keeps_what_it_had() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        std::fs::write(&path, "earlier\n").unwrap();
        let sink = StdoutSink::file(&path, false).await.unwrap();
        assert!(matches!(*sink.target.lock().await, Target::Append(_)));
        for seq in 1..=3 {
            assert_eq!(
                sink.publish(&[event(seq, "{}")]).await,
                vec![Outcome::Delivered]
            );
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(lines[0], "earlier");
        let last: serde_json::Value = serde_json::from_str(lines[3]).unwrap();
        assert_eq!(last["seq"], 3);
        // A synced file, and anything but a regular file, go through the blocking pool.
        let synced = StdoutSink::file(&path, true).await.unwrap();
        assert!(matches!(*synced.target.lock().await, Target::File { .. }));
        let device = StdoutSink::file("/dev/null", false).await.unwrap();
        assert!(matches!(*device.target.lock().await, Target::File { .. }));
    }

    #[tokio::test]
    async fn a_corrupt_payload_is_rejected_and_the_rest_delivered() {
        let dir = tempfile::tempdir().unwrap();
        let sink = StdoutSink::file(dir.path().join("e.jsonl"), false)
            .await
            .unwrap();
        let outcomes = sink.publish(&[event(1, "{not json"), event(2, "{}")]).await;
        assert!(matches!(outcomes[0], Outcome::Reject { .. }));
        assert_eq!(outcomes[1], Outcome::Delivered);
    }

    #[tokio::test]
    async fn an_unwritable_path_names_the_file() {
        let err = StdoutSink::file("/nonexistent-dir/x.jsonl", false)
            .await
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("/nonexistent-dir/x.jsonl"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn debezium_lines_show_topic_key_headers_and_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("records.jsonl");
        let sink = StdoutSink::connect(StdoutSinkConfig {
            path: Some(path.clone()),
            format: BodyFormat::Debezium,
            ..StdoutSinkConfig::default()
        })
        .await
        .unwrap();
        let mut plain = event(1, "null");
        plain.headers.insert("tenant".into(), "a\u{1f}".into());
        let mut tombstone = event(2, "null");
        tombstone.destination = Some("outbox.event.Customer".into());
        tombstone.headers.insert(
            header::DEBEZIUM_RECORD.into(),
            outbox_types::routing::DebeziumRecord {
                key: "\"c-9\"".into(),
                headers: vec![("span".into(), "null".into())],
                tombstone: true,
                timestamp_ms: Some(5),
                ..Default::default()
            }
            .to_header(),
        );
        tombstone
            .headers
            .insert(header::PARTITION.into(), "3".into());
        let outcomes = sink.publish(&[plain.clone(), tombstone.clone()]).await;
        assert_eq!(outcomes, vec![Outcome::Delivered, Outcome::Delivered]);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            format!(
                r#"{{"topic":"outbox.event.order","partition":null,"timestamp":null,"key":"\"1\"","headers":[["id","\"{}\""],["tenant","\"a\\u001F\""]],"value":"null","tombstone":false}}"#,
                plain.id
            )
        );
        assert_eq!(
            lines[1],
            format!(
                r#"{{"topic":"outbox.event.Customer","partition":3,"timestamp":5,"key":"\"c-9\"","headers":[["id","\"{}\""],["span","null"]],"value":null,"tombstone":true}}"#,
                tombstone.id
            )
        );
        let err = StdoutSink::check_config(&StdoutSinkConfig {
            format: BodyFormat::Cloudevents,
            ..StdoutSinkConfig::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("`raw`"), "{err}");
    }
}
