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

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_types::routing::{escape_non_bmp, header, json_string};
use outbox_types::{Event, EventId, Headers};
use regex::Regex;
use serde::{Deserialize, Serialize};
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
    /// comma-separated. A header carries the column's text; an envelope placement wraps the
    /// payload as `{"payload": …, "alias": value}`; a partition placement (an integer column, at
    /// most one) picks the Kafka partition with `format = "debezium"` instead of the key's hash
    /// (events of one key then keep their order only if they name one partition).
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
    /// A NULL payload becomes a message without a body, a Kafka tombstone
    /// (`route.tombstone.on.empty.payload`, default `false`; without envelope placements a NULL
    /// payload has no body either way, as with Debezium's JSON converter).
    #[serde(rename = "route.tombstone.on.empty.payload")]
    pub tombstone_on_empty_payload: bool,
    /// Put the payload on the message as JSON rather than as a string holding its text
    /// (`table.expand.json.payload`, default `false`). Expanded payloads are compact, keep the
    /// key order, and drop top-level `null` fields, as Debezium's do.
    #[serde(rename = "table.expand.json.payload")]
    pub expand_json_payload: bool,
    /// What an update of a row does (`table.op.invalid.behavior`): `warn` (default), `error`
    /// or `fatal`. Only seen when the publication publishes updates (a reused Debezium
    /// publication does; the one the relay creates publishes inserts only).
    #[serde(rename = "table.op.invalid.behavior")]
    pub op_invalid_behavior: InvalidOp,
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

/// Column types Debezium's JSON converter writes as JSON numbers: `int2`, `int4`, `int8`,
/// `float4`, `float8`. (`numeric` is a base64 decimal with its default
/// `decimal.handling.mode`, and timestamps are epoch numbers with its default
/// `time.precision.mode`: both are sent as PostgreSQL's text here, see docs/from-debezium.md.)
const NUMBER_TYPES: [u32; 5] = [20, 21, 23, 700, 701];
const BOOL_TYPE: u32 = 16;
const TIMESTAMP_TYPE: u32 = 1114;

/// Where each mapped column sits in the table's relation, and the compiled options.
#[derive(Clone, Debug)]
pub(crate) struct DebeziumLayout {
    id: usize,
    key: usize,
    event_type: Option<usize>,
    payload: usize,
    timestamp: Option<(usize, bool)>,
    route_by: usize,
    regex: Regex,
    replacement: String,
    /// `(index, type oid, placement, alias)`.
    additional: Vec<(usize, u32, Placement, String)>,
    tombstone_on_empty_payload: bool,
    expand_json_payload: bool,
}

impl DebeziumLayout {
    /// The position of the payload column (`table.field.event.payload`): what the record
    /// limits check apart from the others (the `limits` module).
    pub fn payload_index(&self) -> usize {
        self.payload
    }

    /// Map the columns the options name; the error names a missing column and its option.
    pub fn of(relation: &Relation, table: &DebeziumTable) -> Result<Self, WalError> {
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
        Ok(DebeziumLayout {
            id: need(&table.field_event_id, "table.field.event.id")?,
            key: need(&table.field_event_key, "table.field.event.key")?,
            event_type: index.get(table.field_event_type.as_str()).copied(),
            payload,
            timestamp,
            route_by: need(&table.route_by_field, "route.by.field")?,
            replacement: table.replacement(&regex)?,
            regex,
            additional,
            tombstone_on_empty_payload: table.tombstone_on_empty_payload,
            expand_json_payload: table.expand_json_payload,
        })
    }

    /// Turn an inserted row into an event as the Outbox Event Router shapes it; `seq` is its
    /// position in the WAL, `committed` its commit time. The error names the column.
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
        let key = required(self.key, "key (`table.field.event.key`)")?;
        let routed_by = required(self.route_by, "routed-by (`route.by.field`)")?;
        let event_type = match self.event_type {
            Some(i) => text(i, "type (`table.field.event.type`)")?,
            None => None,
        }
        .unwrap_or(routed_by);
        let occurred_at = match self.timestamp {
            Some((i, naive)) => match text(i, "timestamp (`table.field.event.timestamp`)")? {
                Some(t) if naive => parse_timestamp(t)?,
                Some(t) => parse_timestamptz(t).map_err(|e| {
                    format!("the timestamp column (`table.field.event.timestamp`): {e}")
                })?,
                None => committed,
            },
            None => committed,
        };
        let payload = text(self.payload, "payload (`table.field.event.payload`)")?;
        let mut value = match payload {
            None => "null".to_owned(),
            Some(p) if self.expand_json_payload => expand(p).unwrap_or_else(|| json_string(p)),
            Some(p) => json_string(p),
        };
        let mut headers = Headers::new();
        let mut envelope = Vec::new();
        for (i, type_oid, placement, alias) in &self.additional {
            let v = text(*i, "additional placement")?;
            match placement {
                Placement::Header => {
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
        let tombstone =
            payload.is_none() && (self.tombstone_on_empty_payload || envelope.is_empty());
        if !envelope.is_empty() && !tombstone {
            let mut out = String::with_capacity(value.len() + 32 * envelope.len());
            out.push_str("{\"payload\":");
            out.push_str(&value);
            for (alias, v) in envelope {
                out.push(',');
                out.push_str(&json_string(alias));
                out.push(':');
                out.push_str(&v);
            }
            out.push('}');
            value = out;
        }
        Ok(Event {
            seq,
            id: EventId::from_uuid(id),
            aggregate_type: routed_by.to_owned(),
            aggregate_id: key.to_owned(),
            event_type: event_type.to_owned(),
            payload: value,
            destination: Some(self.topic(routed_by)),
            headers,
            idempotency_key: None,
            occurred_at,
            enqueued_at: committed,
            attempts: 0,
        })
    }

    /// The topic for a routed-by value: the replacement when the regex matches the whole value,
    /// else the value itself.
    fn topic(&self, routed_by: &str) -> String {
        match self.regex.captures(routed_by) {
            Some(caps) => {
                let mut out = String::new();
                caps.expand(&self.replacement, &mut out);
                out
            }
            None => routed_by.to_owned(),
        }
    }
}

/// A column's text as the JSON value Debezium's envelope holds: integers, floats and booleans
/// as JSON numbers and booleans, everything else (also `json`/`jsonb`, which Debezium sends as
/// a string) as a string; NULL as `null`.
fn typed_json(type_oid: u32, text: Option<&str>) -> String {
    match text {
        None => "null".to_owned(),
        Some(t)
            if NUMBER_TYPES.contains(&type_oid) && t.parse::<f64>().is_ok_and(f64::is_finite) =>
        {
            t.to_owned()
        }
        Some(t) if type_oid == BOOL_TYPE => (if t == "t" { "true" } else { "false" }).to_owned(),
        Some(t) => json_string(t),
    }
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

/// JSON text expanded as Debezium's `table.expand.json.payload` does: compact, key order kept,
/// top-level `null` fields dropped, numbers as doubles print (`42.50` → `42.5`). `None` when
/// the text is not JSON (Debezium then sends it as a string).
pub(crate) fn expand(text: &str) -> Option<String> {
    let value: Json = serde_json::from_str(text).ok()?;
    let value = match value {
        Json::Object(fields) => Json::Object(
            fields
                .into_iter()
                .filter(|(_, v)| !matches!(v, Json::Null))
                .collect(),
        ),
        other => other,
    };
    let mut out = String::with_capacity(text.len());
    value.write(&mut out);
    Some(escape_non_bmp(&out).into_owned())
}

/// A number as Jackson writes the value it parsed: integers as they are, fractions as Java's
/// `Double.toString` — plain between 10⁻³ and 10⁷ (`42.5`, `42.0`), else in scientific
/// notation (`1.0E-4`, `1.23456785E7`), with the shortest digits that read back the same.
fn java_number(n: &serde_json::Number, out: &mut String) {
    let Some(x) = n.as_f64().filter(|_| n.is_f64()) else {
        out.push_str(&n.to_string());
        return;
    };
    let magnitude = x.abs();
    if x == 0.0 || (1e-3..1e7).contains(&magnitude) {
        out.push_str(&n.to_string());
        return;
    }
    let sci = format!("{x:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    out.push_str(mantissa);
    if !mantissa.contains('.') {
        out.push_str(".0");
    }
    out.push('E');
    out.push_str(exponent);
}

/// A JSON value that keeps its objects' key order (serde_json's `Value` sorts them here).
enum Json {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    fn write(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => java_number(n, out),
            Json::String(s) => out.push_str(&json_string(s)),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    item.write(out);
                }
                out.push(']');
            }
            Json::Object(fields) => {
                out.push('{');
                for (i, (k, v)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&json_string(k));
                    out.push(':');
                    v.write(out);
                }
                out.push('}');
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Json;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_unit<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
                Ok(Json::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
                Ok(Json::Number(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
                Ok(Json::Number(n.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Json, E> {
                serde_json::Number::from_f64(n)
                    .map(Json::Number)
                    .ok_or_else(|| E::custom("a number that is not finite"))
            }
            fn visit_str<E>(self, s: &str) -> Result<Json, E> {
                Ok(Json::String(s.to_owned()))
            }
            fn visit_string<E>(self, s: String) -> Result<Json, E> {
                Ok(Json::String(s))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Json::Array(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
                let mut fields = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Json>()? {
                    fields.push((k, v));
                }
                Ok(Json::Object(fields))
            }
        }
        d.deserialize_any(V)
    }
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

    fn row(payload: Option<&str>) -> Vec<Option<&[u8]>> {
        vec![
            Some(ID.as_bytes()),
            Some(b"Order"),
            Some(b"order-1"),
            Some(b"OrderCreated"),
            payload.map(str::as_bytes),
        ]
    }

    fn event(table: &DebeziumTable, payload: Option<&str>) -> Event {
        DebeziumLayout::of(&documented(), table)
            .unwrap()
            .event(&row(payload), 7, Utc::now())
            .unwrap()
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
        assert!(e.headers.is_empty());
    }

    #[test]
    fn expanded_payload_is_compact_ordered_and_drops_top_level_nulls() {
        let t = DebeziumTable {
            expand_json_payload: true,
            ..DebeziumTable::default()
        };
        let e = event(&t, Some(JSONB));
        assert_eq!(
            e.payload,
            r#"{"items":[{"qty":2,"sku":"A-1"}],"amount":42}"#
        );
        assert_eq!(
            expand(r#"{"b": 42.50, "a": null, "c": {"z": null}, "s": "😀"}"#).unwrap(),
            r#"{"b":42.5,"c":{"z":null},"s":"\uD83D\uDE00"}"#
        );
        // Not JSON: sent as a string, as Debezium does.
        assert_eq!(expand("not json"), None);
        // Doubles as Java prints them.
        assert_eq!(
            expand(r#"[0.0001, 12345678.5, 1e21, -0.5, 2.0, 7]"#).unwrap(),
            "[1.0E-4,1.23456785E7,1.0E21,-0.5,2.0,7]"
        );
    }

    #[test]
    fn placements_routing_and_tombstones() {
        let t = DebeziumTable {
            additional_placement: "type:header:eventType,aggregatetype:envelope:aggType".into(),
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
            e.payload,
            r#"{"payload":"{\"items\": [{\"qty\": 2, \"sku\": \"A-1\"}], \"amount\": 42}","aggType":"Order"}"#
        );
        // NULL payload with envelope fields: the envelope, unless tombstones are asked for.
        assert_eq!(
            event(&t, None).payload,
            r#"{"payload":null,"aggType":"Order"}"#
        );
        let t = DebeziumTable {
            tombstone_on_empty_payload: true,
            ..t
        };
        assert_eq!(event(&t, None).payload, "null");
        assert_eq!(event(&DebeziumTable::default(), None).payload, "null");
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
            let layout = DebeziumLayout::of(&documented(), &routed_by(replacement)).unwrap();
            assert_eq!(layout.topic(value), topic, "{replacement} on {value}");
        }
        for bad in ["t.$3", "t.${nope}", "t.$x", "t.\\"] {
            let err = routed_by(bad).validate().unwrap_err().to_string();
            assert!(err.contains("route.topic.replacement"), "{bad}: {err}");
        }
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
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`aggregate_id`") && err.contains("table.field.event.key"),
            "{err}"
        );
        let layout = DebeziumLayout::of(&documented(), &DebeziumTable::default()).unwrap();
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
    fn timestamps_and_typed_envelope_fields() {
        let rel = relation(&[
            ("id", 2950),
            ("aggregatetype", 25),
            ("aggregateid", 25),
            ("payload", 25),
            ("ts", TIMESTAMP_TYPE),
            ("n", 23),
            ("ok", BOOL_TYPE),
        ]);
        let t = DebeziumTable {
            field_event_timestamp: Some("ts".into()),
            additional_placement: "n:envelope,ok:envelope:flag,n:partition".into(),
            ..DebeziumTable::default()
        };
        let layout = DebeziumLayout::of(&rel, &t).unwrap();
        let values: Vec<Option<&[u8]>> = vec![
            Some(ID.as_bytes()),
            Some(b"Order"),
            Some(b"o-1"),
            Some(b"plain text"),
            Some(b"2024-05-01 10:20:30.123"),
            Some(b"7"),
            Some(b"t"),
        ];
        let e = layout.event(&values, 1, Utc::now()).unwrap();
        assert_eq!(e.occurred_at.to_rfc3339(), "2024-05-01T10:20:30.123+00:00");
        // No type column: the routed-by value is the event type.
        assert_eq!(e.event_type, "Order");
        assert_eq!(e.payload, r#"{"payload":"plain text","n":7,"flag":true}"#);
        assert_eq!(
            e.headers.get(header::PARTITION).map(String::as_str),
            Some("7")
        );
        let mut values = values;
        values[5] = Some(b"-1");
        let err = layout.event(&values, 1, Utc::now()).unwrap_err();
        assert!(err.contains("not a partition number"), "{err}");
    }
}
