//! [`WalConfig`]: everything WAL mode needs, readable from the `outbox` config file.
//!
//! The database location is part of it (`database_url`, `schema`, `table`) so that the library
//! functions take one value; the CLI fills these from its `[database]` section.

use std::time::Duration;

use outbox_types::humantime_duration;
use serde::{Deserialize, Serialize};

use crate::debezium::DebeziumTable;
use crate::error::WalError;

/// Where events come from in the WAL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Inserts into the outbox table (`PgOutbox::enqueue`), through a publication on that table
    /// that publishes inserts only.
    Table,
    /// Transactional logical messages written by [`enqueue_message`](crate::enqueue_message)
    /// with the configured prefix: no table row, nothing to vacuum.
    Messages,
    /// Inserts into the stream table `<table>_stream` ([`enqueue_streamed`](crate::enqueue_streamed),
    /// or a plain `INSERT`): an insert-only table with the event columns and its primary key
    /// only. Nothing is written back for a delivered event: the slot's confirmed position is
    /// the record of what was delivered, as for messages.
    StreamTable,
    /// Inserts into a Debezium outbox table (`[wal.debezium]`, default `public.outbox` with
    /// Debezium's columns), read with the Outbox Event Router's options and shaped as it
    /// shapes them; deletes are ignored. Nothing is written back, as for the stream table.
    Debezium,
}

/// How WAL mode behaves. Every field has a default; only `database_url` must be set.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WalConfig {
    /// PostgreSQL URL, e.g. `postgres://relay:secret@db:5432/app`. The role needs the
    /// `REPLICATION` attribute (or superuser) and a `host replication` line in `pg_hba.conf`.
    /// TLS settings (`sslmode`, `sslrootcert`, or `PGSSLMODE`, `PGSSLROOTCERT`) apply to the
    /// replication session too; the default is `prefer`. Serialized with the password masked.
    #[serde(serialize_with = "outbox_types::redact::serialize_url")]
    pub database_url: String,
    /// Schema of the outbox table.
    pub schema: String,
    /// Name of the outbox table.
    pub table: String,
    /// Logical replication slot name (lowercase letters, digits, `_`).
    pub slot: String,
    /// Publication name (lowercase letters, digits, `_`).
    pub publication: String,
    /// Which capture sources to deliver. Default: `[table]`. `messages` is opt-in: the relay
    /// refuses to start with it while every role may call `pg_logical_emit_message` (see the
    /// crate docs, "Capture sources"); with it off, messages with the prefix are ignored.
    pub sources: Vec<Source>,
    /// Prefix of the logical messages that carry events; other prefixes are ignored.
    pub message_prefix: String,
    /// Create the publication and the slot when they are missing (first start). When `false`,
    /// a missing slot is an error.
    pub create_slot: bool,
    /// When a session starts, every row still undelivered in the table that the stream will not
    /// send again (left by the polling relay, requeued, committed before the slot existed,
    /// handed to the table by a predecessor: at or below the slot's table watermark, see the
    /// crate docs) is the table's: table claims deliver it, and newer events of its aggregate
    /// wait behind it; the stream delivers the rest. Without it,
    /// only rows that hold their aggregate back (retries, dead events under `block`, live
    /// claims) are; other undelivered rows are left to the stream, and rows it never sends
    /// (committed before the slot existed) are delivered by table claims later, possibly
    /// after newer events of their aggregate. See the crate docs on switching modes.
    pub catch_up: bool,
    /// Keep nothing delivered: the stream's write-back deletes delivered rows instead of
    /// marking them (`retention.delivered = "0s"` in the CLI). Cheaper for the server; leaves
    /// nothing to `outbox replay`.
    pub delete_on_ack: bool,
    /// How often the confirmed position is reported to PostgreSQL (standby status update).
    #[serde(with = "humantime_duration")]
    pub status_interval: Duration,
    /// How often to write a heartbeat logical message, so an idle outbox in a busy cluster
    /// still lets its slot advance and release WAL. `0ms` turns it off.
    #[serde(with = "humantime_duration")]
    pub heartbeat_interval: Duration,
    /// Most decoded events held in memory; beyond it the replication stream is paused (TCP
    /// backpressure reaches the server) until deliveries free room.
    pub max_buffered_events: usize,
    /// Most payload bytes held in memory, same effect as `max_buffered_events`.
    pub max_buffered_bytes: usize,
    /// How often a standby instance checks whether the active one is gone.
    #[serde(with = "humantime_duration")]
    pub standby_poll_interval: Duration,
    /// How long a new leader keeps trying to start streaming while PostgreSQL still reports the
    /// slot active for its dead predecessor.
    #[serde(with = "humantime_duration")]
    pub takeover_timeout: Duration,
    /// Longest pause between attempts to reach a database that is down.
    #[serde(with = "humantime_duration")]
    pub max_reconnect_backoff: Duration,
    /// The Debezium outbox table and the Outbox Event Router options it is read with, when
    /// `sources` has `debezium`.
    pub debezium: DebeziumTable,
}

/// What WAL mode takes from the engine's settings (`RelayConfig`), set by
/// [`WalSource::start`](crate::WalSource::start): one place for each setting.
#[derive(Clone, Debug)]
pub(crate) struct FromRelay {
    /// Who this instance is in logs and `application_name`.
    pub relay_id: String,
    /// Return once every event committed before the start is delivered and confirmed (the
    /// relay's `stop_when_idle`, `outbox relay --drain`).
    pub stop_when_caught_up: bool,
    /// `relay.max_payload_bytes` and `relay.max_metadata_bytes`: what one record may take
    /// (the `limits` module).
    pub limits: crate::limits::Limits,
}

impl Default for WalConfig {
    fn default() -> Self {
        WalConfig {
            database_url: String::new(),
            schema: "outbox".to_owned(),
            table: "events".to_owned(),
            slot: "outbox_wal".to_owned(),
            publication: "outbox_wal".to_owned(),
            sources: vec![Source::Table],
            message_prefix: crate::message::DEFAULT_PREFIX.to_owned(),
            create_slot: true,
            catch_up: true,
            delete_on_ack: false,
            status_interval: Duration::from_secs(1),
            heartbeat_interval: Duration::from_secs(10),
            max_buffered_events: 20_000,
            max_buffered_bytes: 32 * 1024 * 1024,
            standby_poll_interval: Duration::from_secs(1),
            takeover_timeout: Duration::from_secs(30),
            max_reconnect_backoff: Duration::from_secs(10),
            debezium: DebeziumTable::default(),
        }
    }
}

impl WalConfig {
    /// A configuration with defaults for the outbox at `database_url`.
    pub fn new(database_url: impl Into<String>) -> Self {
        WalConfig {
            database_url: database_url.into(),
            ..WalConfig::default()
        }
    }

    /// Whether `source` is captured.
    pub fn captures(&self, source: Source) -> bool {
        self.sources.contains(&source)
    }

    /// The name of the stream table (`<table>_stream`, in `schema`).
    pub fn stream_table(&self) -> String {
        format!("{}_stream", self.table)
    }

    /// Check the values before anything connects; the error says which setting is wrong.
    pub fn validate(&self) -> Result<(), WalError> {
        if self.database_url.trim().is_empty() {
            return Err(WalError::Config(
                "`database_url` is empty: set it to the PostgreSQL URL of the outbox".into(),
            ));
        }
        check_name("slot", &self.slot, 63)?;
        check_name("publication", &self.publication, 63)?;
        check_name("schema", &self.schema, 48)?;
        check_name("table", &self.table, 48)?;
        if self.sources.is_empty() {
            return Err(WalError::Config(
                "`sources` is empty: list one or more of `table`, `stream_table`, `messages` and `debezium`"
                    .into(),
            ));
        }
        if self.captures(Source::Debezium) {
            self.debezium.validate()?;
            let (schema, name) = self.debezium.schema_and_name();
            if schema == self.schema && (name == self.table || name == self.stream_table()) {
                return Err(WalError::Config(format!(
                    "[wal.debezium] table = `{}` is the relay's own {} table: name the table your services write for Debezium (the relay keeps its own in `{}.{}`)",
                    self.debezium.table,
                    if name == self.table {
                        "outbox"
                    } else {
                        "stream"
                    },
                    self.schema,
                    self.table
                )));
            }
        }
        if self.captures(Source::Messages) && self.message_prefix.is_empty() {
            return Err(WalError::Config(
                "`message_prefix` is empty: logical messages need a prefix (default `outbox`)"
                    .into(),
            ));
        }
        if self.max_buffered_events == 0 || self.max_buffered_bytes == 0 {
            return Err(WalError::Config(
                "`max_buffered_events` and `max_buffered_bytes` must be at least 1".into(),
            ));
        }
        if self.status_interval.is_zero() {
            return Err(WalError::Config(
                "`status_interval` must be longer than 0ms".into(),
            ));
        }
        Ok(())
    }
}

/// Names end up in SQL and replication commands: plain identifiers only. The stores' check
/// ([`outbox_types::sql_store::check_identifier`]), with the same rule and words, as a
/// configuration error.
pub(crate) fn check_name(what: &str, name: &str, max: usize) -> Result<(), WalError> {
    outbox_types::sql_store::check_identifier(what, name, max).map_err(|e| match e {
        outbox_types::StoreError::Invalid(message) => WalError::Config(message),
        other => WalError::Config(other.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_rejects_unknown_keys_and_reads_durations() {
        let err = serde_json::from_str::<WalConfig>(r#"{"slott": "x"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `slott`"), "{err}");
        let cfg: WalConfig = serde_json::from_str(
            r#"{"database_url": "postgres://x@h/db", "status_interval": "250ms", "heartbeat_interval": "1m", "sources": ["messages"]}"#,
        )
        .unwrap();
        assert_eq!(cfg.status_interval, Duration::from_millis(250));
        assert_eq!(cfg.heartbeat_interval, Duration::from_secs(60));
        assert!(cfg.captures(Source::Messages) && !cfg.captures(Source::Table));
        cfg.validate().unwrap();
    }

    #[test]
    fn the_message_source_is_opt_in_and_the_url_is_masked() {
        let cfg = WalConfig::new("postgres://relay:hunter2@db/app");
        assert_eq!(cfg.sources, [Source::Table]);
        let json = serde_json::to_string(&cfg).unwrap();
        assert!(
            !json.contains("hunter2") && json.contains("relay:***@db"),
            "{json}"
        );
    }

    #[test]
    fn a_debezium_table_cannot_be_the_relays_own() {
        let mut c = WalConfig::new("postgres://x");
        c.sources = vec![Source::Debezium];
        c.debezium.table = "outbox.events".into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("relay's own outbox table"), "{err}");
        c.debezium.table = "outbox.events_stream".into();
        assert!(c.validate().unwrap_err().to_string().contains("stream"));
        c.debezium.table = "public.outbox".into();
        c.validate().unwrap();
    }

    #[test]
    fn bad_names_and_empty_url_are_explained() {
        let err = WalConfig::default().validate().unwrap_err();
        assert!(err.to_string().contains("database_url"), "{err}");
        let cfg = WalConfig {
            slot: "Bad-Slot".into(),
            ..WalConfig::new("postgres://h/db")
        };
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("slot `Bad-Slot`")
        );
    }
}
