//! Reading a Debezium outbox table as it is ([`Source::Debezium`]).
//!
//! Services that run Debezium with its Outbox Event Router already write an `outbox` table with
//! Debezium's columns (`id`, `aggregatetype`, `aggregateid`, `type`, `payload`, …), and their
//! consumers read the router's message shape. This source reads such a table from the WAL with
//! the router's own options ([`DebeziumTable`], spelled as in Debezium: `table.field.event.key`,
//! `route.by.field`, …) and turns each inserted row into an event shaped as the router would
//! shape it: the topic, the key, the payload (a JSON string holding the payload's text, or the
//! expanded JSON, or an envelope with additional fields), the `header` placements. A sink with
//! `format = "debezium"` then puts it on the wire as Debezium's JSON converter does
//! ([`PayloadFormat::Debezium`](outbox_types::routing::PayloadFormat::Debezium)). The mapping is
//! at the edges only: the events go through the same engine as every other source, with
//! per-aggregate order, retries and dead letters, none of which Debezium has.
//!
//! Rows are never updated or written back: as for the stream table, the slot's confirmed
//! position records what was delivered, and an event that fails is copied into the outbox
//! table, where retries, `outbox dead …` and `outbox status` find it. Deletes are ignored, so
//! writers that insert and delete in one transaction (to keep the table empty) work unchanged;
//! updates follow `table.op.invalid.behavior`.
//!
//! [`Source::Debezium`]: crate::Source::Debezium

mod expand;

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_types::routing::{
    DebeziumRecord, header, json_string, json_string_len, push_json_string,
};
use outbox_types::{Event, EventId, Headers};
use regex::Regex;
use serde::{Deserialize, Serialize};
use tracing::warn;
use uuid::Uuid;

use crate::error::WalError;
use crate::pgoutput::{Relation, parse_timestamptz};

/// What the source does with an update of a Debezium outbox table row (Debezium's
/// `table.op.invalid.behavior`). Deletes are always ignored silently: deleting right after
/// inserting is how many writers keep the table empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InvalidOp {
    /// Log a warning and skip the update.
    #[default]
    Warn,
    /// Log an error and skip the update.
    Error,
    /// Stop the relay: the error names the table (Debezium fails the connector).
    Fatal,
}

/// How to read a Debezium outbox table: its name and the Outbox Event Router's options, under
/// the router's own option names, with the router's defaults. Written in `[wal.debezium]`:
///
/// ```toml
/// [wal]
/// sources = ["debezium"]
///
/// [wal.debezium]
/// table = "public.outbox"
/// "table.expand.json.payload" = true
/// "table.fields.additional.placement" = "type:header:eventType"
/// ```
///
/// ```
/// let t: outbox_wal::DebeziumTable = serde_json::from_str(
///     r#"{"table": "app.outbox", "route.topic.replacement": "events.${routedByValue}"}"#,
/// ).unwrap();
/// t.validate().unwrap();
/// assert_eq!(t.schema_and_name(), ("app".to_owned(), "outbox".to_owned()));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DebeziumTable {
    /// The outbox table, `schema.table` (a bare name is in `public`): what the connector's
    /// `table.include.list` names.
    pub table: String,
    /// Column holding the event id, a UUID (`table.field.event.id`, default `id`). Consumers
    /// deduplicate on it (the `id` header).
    #[serde(rename = "table.field.event.id")]
    pub field_event_id: String,
    /// Column holding the message key (`table.field.event.key`, default `aggregateid`); it is
    /// also the aggregate id, the unit of ordering.
    #[serde(rename = "table.field.event.key")]
    pub field_event_key: String,
    /// Column holding the event type (`table.field.event.type`, default `type`). Optional in the
    /// table: without it (or when NULL) the event type is the routed-by value.
    #[serde(rename = "table.field.event.type")]
    pub field_event_type: String,
    /// Column holding the payload, `jsonb`, `json` or text (`table.field.event.payload`, default
    /// `payload`).
    #[serde(rename = "table.field.event.payload")]
    pub field_event_payload: String,
    /// Column holding when the event happened (`table.field.event.timestamp`); the event's
    /// `occurred_at` (a `timestamp` without time zone is read as UTC). Default: the commit time.
    #[serde(
        rename = "table.field.event.timestamp",
        skip_serializing_if = "Option::is_none"
    )]
    pub field_event_timestamp: Option<String>,
    /// Extra columns put on the message (`table.fields.additional.placement`):
    /// `column:header[:alias]`, `column:envelope[:alias]` or `column:partition`,
    /// comma-separated. A header carries the column's value as JSON (`"text"`, `7`, `null` for
    /// NULL), after `id`, in the option's order; an envelope placement wraps the payload as
    /// `{"payload": …, "alias": value}`; a partition placement (an integer column, at most one)
    /// picks the Kafka partition with `format = "debezium"` instead of the key's hash (events of
    /// one key then keep their order only if they name one partition). A header may not be
    /// called `id`: that is the event id's, which consumers deduplicate on.
    #[serde(rename = "table.fields.additional.placement")]
    pub additional_placement: String,
    /// Column whose value routes the event (`route.by.field`, default `aggregatetype`); it is
    /// also the aggregate type.
    #[serde(rename = "route.by.field")]
    pub route_by_field: String,
    /// Regular expression over the routed-by value (`route.topic.regex`, default
    /// `(?<routedByValue>.*)`); it must match the whole value, else the value itself is the
    /// topic (as Kafka Connect's `RegexRouter`).
    #[serde(rename = "route.topic.regex")]
    pub route_topic_regex: String,
    /// The topic (`route.topic.replacement`, default `outbox.event.${routedByValue}`), in
    /// Java's replacement syntax: `${name}` / `$1` for the regex's groups, `\$` for a dollar
    /// sign. It is the event's destination: the Kafka topic, the RabbitMQ routing key, the NATS
    /// subject, the Redis stream; a webhook sink with `format = "debezium"` posts to its `url`.
    #[serde(rename = "route.topic.replacement")]
    pub route_topic_replacement: String,
    /// A NULL payload (or, in a text column, one of blanks only) becomes a message without a
    /// body, a Kafka tombstone (`route.tombstone.on.empty.payload`, default `false`). Without
    /// it such a payload is the value `null` (or `{"payload":null,…}` with envelope
    /// placements), as Debezium sends it.
    #[serde(rename = "route.tombstone.on.empty.payload")]
    pub tombstone_on_empty_payload: bool,
    /// Put the payload on the message as JSON rather than as a string holding its text
    /// (`table.expand.json.payload`, default `false`), as Debezium infers a schema for it and
    /// writes it: objects compact, in key order, without `null` and empty-array fields; the
    /// objects of an array with every field of the array's schema; a payload that is not an
    /// object (a JSON string, number, array, `null`) or that Debezium cannot expand stays the
    /// string, with a warning. Bounded by `relay.max_payload_bytes`: see docs/from-debezium.md.
    #[serde(rename = "table.expand.json.payload")]
    pub expand_json_payload: bool,
    /// What an update of a row does (`table.op.invalid.behavior`): `warn` (default), `error`
    /// or `fatal`. Only seen when the publication publishes updates (a reused Debezium
    /// publication does); with the relay's own publication, which publishes inserts only, it
    /// never fires.
    #[serde(rename = "table.op.invalid.behavior")]
    pub op_invalid_behavior: InvalidOp,
    /// Send the four `__debezium.context.*` headers Debezium's connector adds before `id`
    /// (`extended.headers.enabled`, a connector option): `connectorLogicalName` (from
    /// `topic.prefix`), `taskId` (`"0"`), `connectorName` (`"postgresql"`) and `runId` (new at
    /// each start of the relay). Debezium's default is `true`; the relay's is `false`, because
    /// the headers' values come from the connector's `topic.prefix`, which the relay cannot
    /// know, and a configuration written before this option keeps its messages as they were.
    /// `outbox config import-debezium` writes it, with `topic.prefix`, explicitly.
    #[serde(rename = "extended.headers.enabled")]
    pub extended_headers_enabled: bool,
    /// The connector's `topic.prefix` (its logical name): the
    /// `__debezium.context.connectorLogicalName` header. Needed with
    /// `extended.headers.enabled`.
    #[serde(rename = "topic.prefix", skip_serializing_if = "Option::is_none")]
    pub topic_prefix: Option<String>,
}

impl Default for DebeziumTable {
    fn default() -> Self {
        DebeziumTable {
            table: "public.outbox".to_owned(),
            field_event_id: "id".to_owned(),
            field_event_key: "aggregateid".to_owned(),
            field_event_type: "type".to_owned(),
            field_event_payload: "payload".to_owned(),
            field_event_timestamp: None,
            additional_placement: String::new(),
            route_by_field: "aggregatetype".to_owned(),
            route_topic_regex: DEFAULT_REGEX.to_owned(),
            route_topic_replacement: "outbox.event.${routedByValue}".to_owned(),
            tombstone_on_empty_payload: false,
            expand_json_payload: false,
            op_invalid_behavior: InvalidOp::Warn,
            extended_headers_enabled: false,
            topic_prefix: None,
        }
    }
}

const DEFAULT_REGEX: &str = "(?<routedByValue>.*)";

/// Where an additional field goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    Header,
    Envelope,
    Partition,
}

/// One parsed `table.fields.additional.placement` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Additional {
    pub column: String,
    pub placement: Placement,
    pub alias: String,
}

impl DebeziumTable {
    /// `(schema, table)` of [`table`](DebeziumTable::table).
    pub fn schema_and_name(&self) -> (String, String) {
        match self.table.split_once('.') {
            Some((schema, name)) => (schema.to_owned(), name.to_owned()),
            None => ("public".to_owned(), self.table.clone()),
        }
    }

    /// The table, quoted for SQL.
    pub(crate) fn quoted(&self) -> String {
        let (schema, name) = self.schema_and_name();
        format!("\"{schema}\".\"{name}\"")
    }

    /// Check the options before anything connects; the error names the option and the fix.
    pub fn validate(&self) -> Result<(), WalError> {
        let (schema, name) = self.schema_and_name();
        for (what, value) in [("schema", &schema), ("table", &name)] {
            if value.is_empty() || value.contains('"') || value.contains('.') {
                return Err(WalError::Config(format!(
                    "[wal.debezium] table = `{}`: the {what} name is empty or holds `\"` or a second `.`; write `schema.table`, e.g. `public.outbox`",
                    self.table
                )));
            }
        }
        for (option, value) in [
            ("table.field.event.id", &self.field_event_id),
            ("table.field.event.key", &self.field_event_key),
            ("table.field.event.type", &self.field_event_type),
            ("table.field.event.payload", &self.field_event_payload),
            ("route.by.field", &self.route_by_field),
            ("route.topic.replacement", &self.route_topic_replacement),
        ] {
            if value.trim().is_empty() {
                return Err(WalError::Config(format!(
                    "[wal.debezium] `{option}` is empty: name a column (or remove the option for Debezium's default)"
                )));
            }
        }
        self.replacement(&self.regex()?)?;
        self.additional()?;
        if self.extended_headers_enabled
            && self
                .topic_prefix
                .as_deref()
                .is_none_or(|p| p.trim().is_empty())
        {
            return Err(WalError::Config(
                "[wal.debezium] `extended.headers.enabled = true` needs `topic.prefix`, the connector's logical name (the `__debezium.context.connectorLogicalName` header): copy it from the connector's configuration, or set `extended.headers.enabled = false`".to_owned(),
            ));
        }
        Ok(())
    }

    /// `route.topic.replacement` in the regex crate's syntax. Debezium's is Java's
    /// (`Matcher.replaceFirst`): `$n` takes as many digits as name an existing group, `${name}`
    /// a named group, and `\x` is `x` as it is (`\$` a dollar sign).
    pub(crate) fn replacement(&self, regex: &Regex) -> Result<String, WalError> {
        let text = &self.route_topic_replacement;
        let groups = regex.captures_len() - 1;
        let bad = |why: String| {
            WalError::Config(format!(
                "[wal.debezium] `route.topic.replacement` = `{text}`: {why}"
            ))
        };
        let mut out = String::with_capacity(text.len() + 8);
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('$') => out.push_str("$$"),
                    Some(other) => out.push(other),
                    None => return Err(bad("it ends in a lone `\\`".into())),
                },
                '$' => match chars.next() {
                    Some('{') => {
                        let name: String = chars.by_ref().take_while(|&c| c != '}').collect();
                        if !regex.capture_names().any(|n| n == Some(name.as_str())) {
                            return Err(bad(format!(
                                "`route.topic.regex` has no group named `{name}`"
                            )));
                        }
                        out.push_str(&format!("${{{name}}}"));
                    }
                    Some(d) if d.is_ascii_digit() => {
                        let mut number = d.to_digit(10).unwrap_or(0) as usize;
                        if number > groups {
                            return Err(bad(format!(
                                "`${number}` names a group `route.topic.regex` does not have"
                            )));
                        }
                        while let Some(next) = chars.peek().and_then(|c| c.to_digit(10)) {
                            let longer = number * 10 + next as usize;
                            if longer > groups {
                                break;
                            }
                            number = longer;
                            chars.next();
                        }
                        out.push_str(&format!("${{{number}}}"));
                    }
                    _ => {
                        return Err(bad(
                            "a `$` must start a group reference (`$1`, `${name}`); write `\\$` for a dollar sign".into(),
                        ));
                    }
                },
                other => out.push(other),
            }
        }
        Ok(out)
    }

    /// The compiled `route.topic.regex`, anchored at both ends (Java's `matches()`).
    pub(crate) fn regex(&self) -> Result<Regex, WalError> {
        Regex::new(&format!("^(?:{})$", self.route_topic_regex)).map_err(|e| {
            WalError::Config(format!(
                "[wal.debezium] `route.topic.regex` = `{}` is not a valid regular expression: {e}",
                self.route_topic_regex
            ))
        })
    }

    /// The parsed `table.fields.additional.placement`.
    pub(crate) fn additional(&self) -> Result<Vec<Additional>, WalError> {
        let mut out = Vec::new();
        for entry in self
            .additional_placement
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            let parts: Vec<&str> = entry.split(':').map(str::trim).collect();
            let bad = |why: &str| {
                WalError::Config(format!(
                    "[wal.debezium] `table.fields.additional.placement` entry `{entry}`: {why}; write `column:header[:alias]` or `column:envelope[:alias]`, comma-separated"
                ))
            };
            if parts.len() < 2 || parts.len() > 3 || parts[0].is_empty() {
                return Err(bad("expected two or three `:`-separated parts"));
            }
            let placement = match parts[1] {
                "header" => Placement::Header,
                "envelope" => Placement::Envelope,
                "partition" => Placement::Partition,
                other => return Err(bad(&format!("unknown placement `{other}`"))),
            };
            let alias = parts.get(2).filter(|a| !a.is_empty()).unwrap_or(&parts[0]);
            if placement == Placement::Header && *alias == "id" {
                return Err(bad(
                    "the header `id` is the event id's (consumers deduplicate on it); give the column another alias",
                ));
            }
            if placement == Placement::Envelope && *alias == "payload" {
                return Err(bad(
                    "the envelope already has a field `payload`; give the column another alias",
                ));
            }
            if placement == Placement::Partition
                && out
                    .iter()
                    .any(|a: &Additional| a.placement == Placement::Partition)
            {
                return Err(bad(
                    "a record has one partition; keep one `partition` placement",
                ));
            }
            out.push(Additional {
                column: parts[0].to_owned(),
                placement,
                alias: (*alias).to_owned(),
            });
        }
        Ok(out)
    }

    /// Every column the options name, with the option that names it: what the table must have.
    pub(crate) fn required_columns(&self) -> Result<Vec<(String, String)>, WalError> {
        let mut out = vec![
            (
                self.field_event_id.clone(),
                "table.field.event.id".to_owned(),
            ),
            (
                self.field_event_key.clone(),
                "table.field.event.key".to_owned(),
            ),
            (
                self.field_event_payload.clone(),
                "table.field.event.payload".to_owned(),
            ),
            (self.route_by_field.clone(), "route.by.field".to_owned()),
        ];
        if let Some(t) = &self.field_event_timestamp {
            out.push((t.clone(), "table.field.event.timestamp".to_owned()));
        }
        for a in self.additional()? {
            out.push((a.column, "table.fields.additional.placement".to_owned()));
        }
        Ok(out)
    }
}

/// Debezium's documented outbox table (`id uuid` primary key, `aggregatetype`, `aggregateid`,
/// `type`, `payload jsonb`) under `table`'s name, `CREATE TABLE IF NOT EXISTS`: for trying the
/// `debezium` source out, and for tests. Services moving over from Debezium keep their own.
///
/// ```
/// let ddl = outbox_wal::debezium_table_ddl(&outbox_wal::DebeziumTable::default());
/// assert!(ddl.starts_with("CREATE TABLE IF NOT EXISTS \"public\".\"outbox\""));
/// ```
pub fn debezium_table_ddl(table: &DebeziumTable) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (
             id            UUID         NOT NULL PRIMARY KEY,
             aggregatetype VARCHAR(255) NOT NULL,
             aggregateid   VARCHAR(255) NOT NULL,
             type          VARCHAR(255) NOT NULL,
             payload       JSONB
         )",
        table.quoted()
    )
}

/// Check that the table exists and has every column the options name, before the publication
/// is created over it; the error names the table, the column, the option and the fix.
pub(crate) async fn check_table(
    pool: &sqlx::PgPool,
    table: &DebeziumTable,
) -> Result<(), WalError> {
    let (schema, name) = table.schema_and_name();
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2",
    )
    .bind(&schema)
    .bind(&name)
    .fetch_all(pool)
    .await
    .map_err(crate::error::map_sqlx)?;
    if columns.is_empty() {
        return Err(WalError::Config(format!(
            "the Debezium outbox table {} does not exist (or this role cannot see it): create it, or set `table` in [wal.debezium] to the table your services write (`schema.table`)",
            table.quoted()
        )));
    }
    for (column, option) in table.required_columns()? {
        if !columns.contains(&column) {
            return Err(WalError::Config(format!(
                "the Debezium outbox table {} has no column `{column}` (named by `{option}` in [wal.debezium]); its columns are {}: fix the option",
                table.quoted(),
                columns.join(", ")
            )));
        }
    }
    Ok(())
}

/// Column types Debezium's JSON converter writes as JSON numbers: `int2`, `int4`, `int8`
/// (as they are), `float4`, `float8` (as Java prints a float or double). (`numeric` is a
/// base64 decimal with its default `decimal.handling.mode`, and timestamps are epoch numbers
/// with its default `time.precision.mode`: both are sent as PostgreSQL's text here, see
/// docs/from-debezium.md.)
const INTEGER_TYPES: [u32; 3] = [20, 21, 23];
const FLOAT4_TYPE: u32 = 700;
const FLOAT8_TYPE: u32 = 701;
const BOOL_TYPE: u32 = 16;
const TIMESTAMP_TYPE: u32 = 1114;

/// The run id of this process in the `__debezium.context.runId` header: Debezium's changes at
/// each start of its connector task, the relay's at each start of the relay (a UUIDv7, as
/// Debezium's).
fn run_id() -> &'static str {
    static RUN_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RUN_ID.get_or_init(|| Uuid::now_v7().to_string())
}

/// Where each mapped column sits in the table's relation, and the compiled options.
#[derive(Clone, Debug)]
pub(crate) struct DebeziumLayout {
    id: usize,
    key: (usize, u32),
    event_type: Option<usize>,
    payload: usize,
    timestamp: Option<(usize, bool)>,
    route_by: usize,
    /// `route.topic.regex` anchored at both ends (Java's `matches()`), and as written (for
    /// `replaceFirst`, which replaces the first match it finds).
    anchored: Regex,
    regex: Regex,
    replacement: String,
    /// `(index, type oid, placement, alias)`.
    additional: Vec<(usize, u32, Placement, String)>,
    tombstone_on_empty_payload: bool,
    expand_json_payload: bool,
    /// The `__debezium.context.*` headers, when `extended.headers.enabled`.
    context: Vec<(String, String)>,
    limits: expand::Limits,
}

impl DebeziumLayout {
    /// The position of the payload column (`table.field.event.payload`): what the record
    /// limits check apart from the others (the `limits` module).
    pub fn payload_index(&self) -> usize {
        self.payload
    }

    /// Map the columns the options name; the error names a missing column and its option.
    /// `max_payload_bytes` bounds the value a row's payload becomes (see [`expand`]).
    pub fn of(
        relation: &Relation,
        table: &DebeziumTable,
        max_payload_bytes: u64,
    ) -> Result<Self, WalError> {
        let index = relation.column_index();
        let need = |column: &str, option: &str| {
            index.get(column).copied().ok_or_else(|| {
                WalError::Config(format!(
                    "the Debezium outbox table {}.{} has no column `{column}` (named by `{option}` in [wal.debezium]): fix the option or the table",
                    relation.namespace, relation.name
                ))
            })
        };
        let type_of = |i: usize| relation.types.get(i).copied().unwrap_or(0);
        let payload = need(&table.field_event_payload, "table.field.event.payload")?;
        let timestamp = match &table.field_event_timestamp {
            Some(c) => {
                let i = need(c, "table.field.event.timestamp")?;
                Some((i, type_of(i) == TIMESTAMP_TYPE))
            }
            None => None,
        };
        let mut additional = Vec::new();
        for a in table.additional()? {
            let i = need(&a.column, "table.fields.additional.placement")?;
            additional.push((i, type_of(i), a.placement, a.alias));
        }
        let regex = table.regex()?;
        let key = need(&table.field_event_key, "table.field.event.key")?;
        let context = match (&table.topic_prefix, table.extended_headers_enabled) {
            (Some(prefix), true) => vec![
                (
                    "__debezium.context.connectorLogicalName".to_owned(),
                    json_string(prefix),
                ),
                ("__debezium.context.taskId".to_owned(), json_string("0")),
                (
                    "__debezium.context.connectorName".to_owned(),
                    json_string("postgresql"),
                ),
                ("__debezium.context.runId".to_owned(), json_string(run_id())),
            ],
            _ => Vec::new(),
        };
        Ok(DebeziumLayout {
            id: need(&table.field_event_id, "table.field.event.id")?,
            key: (key, type_of(key)),
            event_type: index.get(table.field_event_type.as_str()).copied(),
            payload,
            timestamp,
            route_by: need(&table.route_by_field, "route.by.field")?,
            replacement: table.replacement(&regex)?,
            anchored: table.regex()?,
            regex: Regex::new(&table.route_topic_regex).map_err(|e| {
                WalError::Config(format!(
                    "[wal.debezium] `route.topic.regex` = `{}` is not a valid regular expression: {e}",
                    table.route_topic_regex
                ))
            })?,
            additional,
            tombstone_on_empty_payload: table.tombstone_on_empty_payload,
            expand_json_payload: table.expand_json_payload,
            context,
            limits: expand::Limits::for_max_payload_bytes(max_payload_bytes),
        })
    }

    /// Turn an inserted row into an event as the Outbox Event Router shapes it; `seq` is its
    /// position in the WAL, `committed` its commit time. The error names the column (the row
    /// is then dead-lettered, the payload left in the table).
    ///
    /// The payload is measured before it is encoded or expanded: a row whose value would be
    /// larger than `relay.max_payload_bytes` is refused without building it.
    pub fn event(
        &self,
        values: &[Option<&[u8]>],
        seq: i64,
        committed: DateTime<Utc>,
    ) -> Result<Event, String> {
        let text = |i: usize, what: &str| -> Result<Option<&str>, String> {
            match values.get(i).copied().flatten() {
                None => Ok(None),
                Some(bytes) => std::str::from_utf8(bytes)
                    .map(Some)
                    .map_err(|e| format!("the {what} column is not UTF-8 ({e})")),
            }
        };
        let required = |i: usize, what: &str| {
            text(i, what)?.ok_or_else(|| format!("the {what} column is NULL; it needs a value"))
        };
        let id = required(self.id, "id (`table.field.event.id`)")?;
        let id = Uuid::parse_str(id).map_err(|e| {
            format!("the id column (`table.field.event.id`) is not a UUID ({e}): the relay needs UUID event ids")
        })?;
        let key = required(self.key.0, "key (`table.field.event.key`)")?;
        let routed_by = required(self.route_by, "routed-by (`route.by.field`)")?;
        let topic = self.topic(routed_by)?;
        let event_type = match self.event_type {
            Some(i) => text(i, "type (`table.field.event.type`)")?,
            None => None,
        }
        .unwrap_or(routed_by);
        let (occurred_at, timestamp_ms) = match self.timestamp {
            Some((i, naive)) => match text(i, "timestamp (`table.field.event.timestamp`)")? {
                Some(t) => {
                    let at = if naive {
                        parse_timestamp(t)?
                    } else {
                        parse_timestamptz(t).map_err(|e| {
                            format!("the timestamp column (`table.field.event.timestamp`): {e}")
                        })?
                    };
                    // Debezium's `MicroTimestamp` divided by 1,000 as Java divides (towards
                    // zero), not floored.
                    (at, Some(at.timestamp_micros() / 1000))
                }
                None => (committed, None),
            },
            None => (committed, None),
        };
        let payload = text(self.payload, "payload (`table.field.event.payload`)")?;
        let too_large = |bytes: String| {
            format!(
                "the payload is {bytes} bytes as Debezium shapes it, above relay.max_payload_bytes = {}: the relay does not deliver it; raise relay.max_payload_bytes (if the destination accepts such messages) or make the event smaller",
                self.limits.max_bytes
            )
        };
        if let Some(p) = payload
            && p.len() > self.limits.max_bytes
        {
            return Err(too_large(format!("at least {}", p.len())));
        }
        let mut value = match payload {
            None => "null".to_owned(),
            Some(p) if self.expand_json_payload => match expand::expand(p, self.limits) {
                expand::Expanded::Json(json) => json,
                expand::Expanded::TooLarge => {
                    return Err(too_large(format!("more than {}", self.limits.max_bytes)));
                }
                expand::Expanded::Text(why) => {
                    warn!(event_id = %id, reason = %why, "JSON expansion failed: the payload is sent as a string holding its text, as Debezium does (`table.expand.json.payload`).");
                    self.quoted(p).map_err(too_large)?
                }
            },
            Some(p) => self.quoted(p).map_err(too_large)?,
        };
        let mut headers = Headers::new();
        let mut record_headers = Vec::new();
        let mut envelope = Vec::new();
        for (i, type_oid, placement, alias) in &self.additional {
            let v = text(*i, "additional placement")?;
            match placement {
                Placement::Header => {
                    record_headers.push((alias.clone(), typed_json(*type_oid, v)));
                    if let Some(v) = v {
                        headers.insert(alias.clone(), v.to_owned());
                    }
                }
                Placement::Envelope => envelope.push((alias, typed_json(*type_oid, v))),
                Placement::Partition => {
                    if let Some(v) = v {
                        if v.parse::<u16>().is_err() {
                            return Err(format!(
                                "the partition column (`table.fields.additional.placement`) holds `{v}`, not a partition number"
                            ));
                        }
                        headers.insert(header::PARTITION.to_owned(), v.to_owned());
                    }
                }
            }
        }
        // Debezium: `payload == null || payload.toString().trim().isEmpty()`; Java's `trim`
        // strips every character up to U+0020.
        let tombstone =
            self.tombstone_on_empty_payload && payload.is_none_or(|p| p.chars().all(|c| c <= ' '));
        if tombstone {
            value = "null".to_owned();
        } else if !envelope.is_empty() {
            let size = envelope
                .iter()
                .map(|(alias, v)| json_string_len(alias) + v.len() + 2)
                .sum::<usize>()
                + value.len()
                + 12;
            if size > self.limits.max_bytes {
                return Err(too_large(size.to_string()));
            }
            let mut out = String::with_capacity(size);
            out.push_str("{\"payload\":");
            out.push_str(&value);
            for (alias, v) in envelope {
                out.push(',');
                push_json_string(&mut out, alias);
                out.push(':');
                out.push_str(&v);
            }
            out.push('}');
            value = out;
        }
        let record = DebeziumRecord {
            key: typed_json(self.key.1, Some(key)),
            context: self.context.clone(),
            headers: record_headers,
            tombstone,
            timestamp_ms,
        };
        headers.insert(header::DEBEZIUM_RECORD.to_owned(), record.to_header());
        Ok(Event {
            seq,
            id: EventId::from_uuid(id),
            aggregate_type: routed_by.to_owned(),
            aggregate_id: key.to_owned(),
            event_type: event_type.to_owned(),
            payload: value,
            destination: Some(topic),
            headers,
            idempotency_key: None,
            occurred_at,
            enqueued_at: committed,
            attempts: 0,
        })
    }

    /// The payload's text as a JSON string, measured before it is built; the error is its size.
    fn quoted(&self, text: &str) -> Result<String, String> {
        let size = json_string_len(text);
        if size > self.limits.max_bytes {
            return Err(size.to_string());
        }
        Ok(json_string(text))
    }

    /// The topic for a routed-by value, as Kafka Connect's `RegexRouter` makes it: when the
    /// regex matches the whole value (`matches()`), the value with its first match replaced
    /// (`replaceFirst`); else the value itself.
    ///
    /// A value with a control character or a line break is refused: Java's `.` stops at
    /// `\r`, `\u0085`, `\u2028` and `\u2029` as well as `\n` (the regex crate's only at `\n`),
    /// so the default regex would not match it in Debezium and the raw value would be the
    /// topic, without its `outbox.event.` prefix — a name no broker should get.
    fn topic(&self, routed_by: &str) -> Result<String, String> {
        if let Some(c) = routed_by
            .chars()
            .find(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}'))
        {
            return Err(format!(
                "the routed-by column (`route.by.field`) holds the control character or line break U+{:04X}: Debezium's `route.topic.regex` does not match such a value and would use it as the topic as it is; fix the writer",
                u32::from(c)
            ));
        }
        if !self.anchored.is_match(routed_by) {
            return Ok(routed_by.to_owned());
        }
        Ok(self
            .regex
            .replacen(routed_by, 1, self.replacement.as_str())
            .into_owned())
    }
}

/// A column's text as the JSON value Debezium's converter writes for it: integers as they
/// are, floats as Java prints them, booleans as `true`/`false`, everything else (also
/// `json`/`jsonb`, which Debezium sends as a string) as a JSON string; NULL as `null`.
fn typed_json(type_oid: u32, text: Option<&str>) -> String {
    let Some(t) = text else {
        return "null".to_owned();
    };
    if INTEGER_TYPES.contains(&type_oid) && t.parse::<i64>().is_ok() {
        return t.to_owned();
    }
    if type_oid == FLOAT8_TYPE
        && let Ok(x) = t.parse::<f64>()
        && x.is_finite()
    {
        return java_double(x);
    }
    if type_oid == FLOAT4_TYPE
        && let Ok(x) = t.parse::<f32>()
        && x.is_finite()
    {
        return java_format(
            x == 0.0 || (1e-3..1e7).contains(&x.abs()),
            format!("{x}"),
            format!("{x:e}"),
        );
    }
    if type_oid == BOOL_TYPE {
        return (if t == "t" { "true" } else { "false" }).to_owned();
    }
    json_string(t)
}

/// A `double` as Jackson writes it: Java's `Double.toString` (plain between 10⁻³ and 10⁷,
/// `42.5`, `2.0`; else in scientific notation, `1.0E-4`, `1.23456785E7`; the shortest digits
/// that read back the same), and infinities as the strings `"Infinity"` / `"-Infinity"`.
pub(crate) fn java_double(x: f64) -> String {
    if x.is_nan() {
        return "\"NaN\"".to_owned();
    }
    if x.is_infinite() {
        return (if x > 0.0 {
            "\"Infinity\""
        } else {
            "\"-Infinity\""
        })
        .to_owned();
    }
    java_format(
        x == 0.0 || (1e-3..1e7).contains(&x.abs()),
        format!("{x}"),
        format!("{x:e}"),
    )
}

/// Java's `toString` layout of a float or double from Rust's shortest `{}` and `{:e}` forms.
fn java_format(plain_range: bool, plain: String, sci: String) -> String {
    if plain_range {
        return if plain.contains('.') {
            plain
        } else {
            plain + ".0"
        };
    }
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let mut out = String::with_capacity(sci.len() + 3);
    out.push_str(mantissa);
    if !mantissa.contains('.') {
        out.push_str(".0");
    }
    out.push('E');
    out.push_str(exponent);
    out
}

/// A `timestamp without time zone` read as UTC.
fn parse_timestamp(text: &str) -> Result<DateTime<Utc>, String> {
    text.replacen(' ', "T", 1)
        .parse::<NaiveDateTime>()
        .map(|n| DateTime::from_naive_utc_and_offset(n, Utc))
        .map_err(|_| {
            format!(
                "the timestamp column (`table.field.event.timestamp`): invalid timestamp `{text}`"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation(columns: &[(&str, u32)]) -> Relation {
        Relation {
            relid: 1,
            namespace: "public".into(),
            name: "outbox".into(),
            columns: columns.iter().map(|(c, _)| (*c).to_owned()).collect(),
            types: columns.iter().map(|(_, t)| *t).collect(),
        }
    }

    /// Debezium's documented table: id uuid, aggregatetype, aggregateid, type, payload jsonb.
    fn documented() -> Relation {
        relation(&[
            ("id", 2950),
            ("aggregatetype", 1043),
            ("aggregateid", 1043),
            ("type", 1043),
            ("payload", 3802),
        ])
    }

    const ID: &str = "00000000-0000-4000-8000-000000000001";
    const JSONB: &str = r#"{"items": [{"qty": 2, "sku": "A-1"}], "amount": 42}"#;
    const LIMIT: u64 = 1 << 20;

    fn row(payload: Option<&str>) -> Vec<Option<&[u8]>> {
        vec![
            Some(ID.as_bytes()),
            Some(b"Order"),
            Some(b"order-1"),
            Some(b"OrderCreated"),
            payload.map(str::as_bytes),
        ]
    }

    fn layout(table: &DebeziumTable) -> DebeziumLayout {
        DebeziumLayout::of(&documented(), table, LIMIT).unwrap()
    }

    fn event(table: &DebeziumTable, payload: Option<&str>) -> Event {
        layout(table).event(&row(payload), 7, Utc::now()).unwrap()
    }

    fn record(e: &Event) -> DebeziumRecord {
        DebeziumRecord::of(e).expect("a Debezium record")
    }

    #[test]
    fn defaults_give_the_recorded_shape() {
        let e = event(&DebeziumTable::default(), Some(JSONB));
        assert_eq!(e.destination.as_deref(), Some("outbox.event.Order"));
        assert_eq!(e.aggregate_id, "order-1");
        assert_eq!(e.aggregate_type, "Order");
        assert_eq!(e.event_type, "OrderCreated");
        assert_eq!(e.id.to_string(), ID);
        // The jsonb text as a JSON string (double-encoded), as recorded.
        assert_eq!(
            e.payload,
            r#""{\"items\": [{\"qty\": 2, \"sku\": \"A-1\"}], \"amount\": 42}""#
        );
        assert_eq!(
            record(&e),
            DebeziumRecord {
                key: "\"order-1\"".into(),
                ..DebeziumRecord::default()
            }
        );
        assert_eq!(e.headers.len(), 1);
    }

    #[test]
    fn expanded_payloads_follow_debeziums_schema_and_fall_back_to_text() {
        let t = DebeziumTable {
            expand_json_payload: true,
            ..DebeziumTable::default()
        };
        let e = event(&t, Some(JSONB));
        assert_eq!(
            e.payload,
            r#"{"items":[{"qty":2,"sku":"A-1"}],"amount":42}"#
        );
        // The JSON literal null, a string, a number: not expanded, sent as the string holding
        // the text (`"null"`), never a tombstone or the value null.
        for (payload, value) in [
            ("null", r#""null""#),
            (r#""text""#, r#""\"text\"""#),
            ("42", r#""42""#),
            ("[1, \"a\"]", r#""[1, \"a\"]""#),
        ] {
            let e = event(&t, Some(payload));
            assert_eq!(e.payload, value, "{payload}");
            assert!(!record(&e).tombstone);
        }
        // Even with tombstones asked for: the text `null` is not empty.
        let tombstones = DebeziumTable {
            tombstone_on_empty_payload: true,
            ..t.clone()
        };
        assert!(!record(&event(&tombstones, Some("null"))).tombstone);
    }

    #[test]
    fn null_payloads_are_the_value_null_unless_tombstones_are_asked_for() {
        let plain = event(&DebeziumTable::default(), None);
        assert_eq!(plain.payload, "null");
        assert!(!record(&plain).tombstone);
        let t = DebeziumTable {
            tombstone_on_empty_payload: true,
            ..DebeziumTable::default()
        };
        let e = event(&t, None);
        assert_eq!(e.payload, "null");
        assert!(record(&e).tombstone);
        // Java's trim(): blanks and control characters only count as empty.
        assert!(record(&event(&t, Some(" \t\u{1}"))).tombstone);
        assert!(!record(&event(&t, Some(" x"))).tombstone);
    }

    #[test]
    fn placements_routing_and_tombstones() {
        let t = DebeziumTable {
            additional_placement:
                "type:header:eventType,aggregatetype:envelope:aggType,payload:header:raw".into(),
            route_by_field: "type".into(),
            route_topic_replacement: "events.${routedByValue}".into(),
            ..DebeziumTable::default()
        };
        let e = event(&t, Some(JSONB));
        assert_eq!(e.destination.as_deref(), Some("events.OrderCreated"));
        assert_eq!(
            e.headers.get("eventType").map(String::as_str),
            Some("OrderCreated")
        );
        assert_eq!(
            record(&e).headers,
            vec![
                ("eventType".to_owned(), "\"OrderCreated\"".to_owned()),
                ("raw".to_owned(), json_string(JSONB)),
            ]
        );
        assert_eq!(
            e.payload,
            r#"{"payload":"{\"items\": [{\"qty\": 2, \"sku\": \"A-1\"}], \"amount\": 42}","aggType":"Order"}"#
        );
        // NULL payload with envelope fields: the envelope, unless tombstones are asked for;
        // a NULL header placement is the header with the value `null`.
        let e = event(&t, None);
        assert_eq!(e.payload, r#"{"payload":null,"aggType":"Order"}"#);
        assert_eq!(record(&e).headers[1], ("raw".to_owned(), "null".to_owned()));
        assert!(!e.headers.contains_key("raw"));
        let t = DebeziumTable {
            tombstone_on_empty_payload: true,
            ..t
        };
        let e = event(&t, None);
        assert_eq!(e.payload, "null");
        assert!(record(&e).tombstone);
    }

    #[test]
    fn context_headers_come_with_the_topic_prefix() {
        let t = DebeziumTable {
            extended_headers_enabled: true,
            ..DebeziumTable::default()
        };
        let err = t.validate().unwrap_err().to_string();
        assert!(err.contains("topic.prefix"), "{err}");
        let t = DebeziumTable {
            topic_prefix: Some("dbserver1".into()),
            ..t
        };
        t.validate().unwrap();
        let context = record(&event(&t, Some("{}"))).context;
        let names: Vec<&str> = context.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "__debezium.context.connectorLogicalName",
                "__debezium.context.taskId",
                "__debezium.context.connectorName",
                "__debezium.context.runId"
            ]
        );
        assert_eq!(context[0].1, "\"dbserver1\"");
        assert_eq!(context[1].1, "\"0\"");
        assert_eq!(context[2].1, "\"postgresql\"");
        assert_eq!(context[3].1, format!("\"{}\"", run_id()));
    }

    #[test]
    fn regex_groups_and_non_matching_values() {
        let routed_by = |replacement: &str| DebeziumTable {
            route_topic_regex: "(?<kind>[a-z]+)-(\\d+)".into(),
            route_topic_replacement: replacement.into(),
            ..DebeziumTable::default()
        };
        for (replacement, value, topic) in [
            ("t.${kind}.$2", "abc-12", "t.abc.12"),
            // Whole-value match only (Java's `matches()`); else the value itself.
            ("t.${kind}.$2", "abc-12x", "abc-12x"),
            // Java's replacement syntax: `$2_x` is group 2 then `_x`, `\$` a dollar sign, and
            // `$21` group 2 then `1` when there is no group 21.
            ("t.$2_x.\\$.$21", "abc-12", "t.12_x.$.121"),
        ] {
            let layout = DebeziumLayout::of(&documented(), &routed_by(replacement), LIMIT).unwrap();
            assert_eq!(
                layout.topic(value).unwrap(),
                topic,
                "{replacement} on {value}"
            );
        }
        // `replaceFirst` replaces the first match `find()` sees, which can be shorter than the
        // whole value `matches()` accepted.
        let alternation = DebeziumTable {
            route_topic_regex: "a|ab".into(),
            route_topic_replacement: "X".into(),
            ..DebeziumTable::default()
        };
        let layout = DebeziumLayout::of(&documented(), &alternation, LIMIT).unwrap();
        assert_eq!(layout.topic("ab").unwrap(), "Xb");
        for bad in ["t.$3", "t.${nope}", "t.$x", "t.\\"] {
            let err = routed_by(bad).validate().unwrap_err().to_string();
            assert!(err.contains("route.topic.replacement"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_line_break_in_the_routed_by_value_is_refused() {
        let layout = layout(&DebeziumTable::default());
        for value in [
            "Order\n",
            "Or\rder",
            "Order\u{85}",
            "Order\u{2028}",
            "\u{1b}[2J",
        ] {
            let err = layout.topic(value).unwrap_err();
            assert!(err.contains("route.by.field"), "{value:?}: {err}");
        }
        let mut values = row(Some("{}"));
        values[1] = Some(b"Order\nadmin");
        let err = layout.event(&values, 1, Utc::now()).unwrap_err();
        assert!(err.contains("U+000A"), "{err}");
    }

    #[test]
    fn payloads_are_measured_before_they_are_encoded() {
        let small = DebeziumLayout::of(&documented(), &DebeziumTable::default(), 64).unwrap();
        // 40 control characters: 40 bytes of text, 242 as a JSON string.
        let text = "\u{1}".repeat(40);
        let err = small.event(&row(Some(&text)), 1, Utc::now()).unwrap_err();
        assert!(
            err.contains("242 bytes") && err.contains("max_payload_bytes = 64"),
            "{err}"
        );
        let err = small
            .event(&row(Some(&"x".repeat(65))), 1, Utc::now())
            .unwrap_err();
        assert!(err.contains("at least 65 bytes"), "{err}");
    }

    #[test]
    fn bad_options_and_rows_are_named() {
        let bad = |t: DebeziumTable| t.validate().unwrap_err().to_string();
        let err = bad(DebeziumTable {
            additional_placement: "x:partition,y:partition".into(),
            ..DebeziumTable::default()
        });
        assert!(err.contains("one `partition`"), "{err}");
        let err = bad(DebeziumTable {
            additional_placement: "x:somewhere".into(),
            ..DebeziumTable::default()
        });
        assert!(err.contains("unknown placement `somewhere`"), "{err}");
        let err = bad(DebeziumTable {
            additional_placement: "type:header:id".into(),
            ..DebeziumTable::default()
        });
        assert!(err.contains("header `id`"), "{err}");
        let err = bad(DebeziumTable {
            route_topic_regex: "(".into(),
            ..DebeziumTable::default()
        });
        assert!(err.contains("route.topic.regex"), "{err}");
        let err = DebeziumLayout::of(
            &documented(),
            &DebeziumTable {
                field_event_key: "aggregate_id".into(),
                ..DebeziumTable::default()
            },
            LIMIT,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`aggregate_id`") && err.contains("table.field.event.key"),
            "{err}"
        );
        let layout = layout(&DebeziumTable::default());
        let mut values = row(Some("{}"));
        values[0] = Some(b"42");
        let err = layout.event(&values, 1, Utc::now()).unwrap_err();
        assert!(err.contains("not a UUID"), "{err}");
        values[0] = Some(ID.as_bytes());
        values[2] = None;
        let err = layout.event(&values, 1, Utc::now()).unwrap_err();
        assert!(err.contains("key") && err.contains("NULL"), "{err}");
    }

    #[test]
    fn timestamps_and_typed_fields() {
        let rel = relation(&[
            ("id", 2950),
            ("aggregatetype", 25),
            ("aggregateid", 23),
            ("payload", 25),
            ("ts", TIMESTAMP_TYPE),
            ("n", 23),
            ("ok", BOOL_TYPE),
            ("f", FLOAT8_TYPE),
            ("g", FLOAT4_TYPE),
        ]);
        let t = DebeziumTable {
            field_event_timestamp: Some("ts".into()),
            additional_placement:
                "n:envelope,ok:envelope:flag,n:partition,f:header,g:header,n:header".into(),
            ..DebeziumTable::default()
        };
        let layout = DebeziumLayout::of(&rel, &t, LIMIT).unwrap();
        let values: Vec<Option<&[u8]>> = vec![
            Some(ID.as_bytes()),
            Some(b"Order"),
            Some(b"42"),
            Some(b"plain text"),
            Some(b"2024-05-01 10:20:30.123456"),
            Some(b"7"),
            Some(b"t"),
            Some(b"1e+20"),
            Some(b"0.1"),
        ];
        let e = layout.event(&values, 1, Utc::now()).unwrap();
        assert_eq!(
            e.occurred_at.to_rfc3339(),
            "2024-05-01T10:20:30.123456+00:00"
        );
        // No type column: the routed-by value is the event type.
        assert_eq!(e.event_type, "Order");
        assert_eq!(e.payload, r#"{"payload":"plain text","n":7,"flag":true}"#);
        assert_eq!(
            e.headers.get(header::PARTITION).map(String::as_str),
            Some("7")
        );
        let r = record(&e);
        // An integer key column is a JSON number; microseconds cut to milliseconds.
        assert_eq!(r.key, "42");
        assert_eq!(r.timestamp_ms, Some(1_714_558_830_123));
        assert_eq!(
            r.headers,
            vec![
                ("f".to_owned(), "1.0E20".to_owned()),
                ("g".to_owned(), "0.1".to_owned()),
                ("n".to_owned(), "7".to_owned()),
            ]
        );
        // Before 1970, Java's division goes towards zero.
        let mut early = values.clone();
        early[4] = Some(b"1969-12-31 23:59:59.9985");
        assert_eq!(
            record(&layout.event(&early, 1, Utc::now()).unwrap()).timestamp_ms,
            Some(-1)
        );
        let mut values = values;
        values[5] = Some(b"-1");
        let err = layout.event(&values, 1, Utc::now()).unwrap_err();
        assert!(err.contains("not a partition number"), "{err}");
    }

    #[test]
    fn doubles_and_floats_print_as_java_does() {
        for (x, java) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (42.5, "42.5"),
            (100.0, "100.0"),
            (0.001, "0.001"),
            (0.0001, "1.0E-4"),
            (1e7, "1.0E7"),
            (12345678.5, "1.23456785E7"),
            (f64::INFINITY, "\"Infinity\""),
        ] {
            assert_eq!(java_double(x), java, "{x}");
        }
        assert_eq!(
            typed_json(FLOAT4_TYPE, Some("3.4028235e+38")),
            "3.4028235E38"
        );
        assert_eq!(typed_json(FLOAT4_TYPE, Some("1.5")), "1.5");
        assert_eq!(typed_json(FLOAT8_TYPE, Some("NaN")), "\"NaN\"");
        assert_eq!(typed_json(21, Some("-3")), "-3");
        assert_eq!(typed_json(1043, None), "null");
    }
}
