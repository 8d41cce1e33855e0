//! `outbox config import-debezium FILE`: a Debezium configuration for the PostgreSQL connector
//! with the Outbox Event Router turned into an `outbox.toml`.
//!
//! Two inputs are read, told apart by their first character:
//!
//! - a **Debezium Server** `application.properties` (`debezium.source.*` for the connector,
//!   `debezium.transforms.*` for the router, `debezium.sink.type` and `debezium.sink.<type>.*`
//!   for Kafka, RabbitMQ, NATS JetStream, Redis or HTTP);
//! - a **Kafka Connect** connector configuration in JSON (`{"name": …, "config": {…}}` or the
//!   bare `config` object); the Kafka bootstrap servers are not in it and come from
//!   `--kafka-brokers`.
//!
//! The result uses WAL mode with the `debezium` source, the router's options carried over under
//! their own names, and the destination with `format = "debezium"`, so producers and consumers
//! stay as they are. Every option that is not carried over is named with the reason, at the top
//! of the file and on standard error: nothing is dropped silently.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{Context, bail};
use outbox_types::redact::{escape_control, is_secret_key, redact_in_text};
use outbox_types::routing::percent_encode;

/// What the command line adds to the file.
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Kafka bootstrap servers (a Kafka Connect configuration does not hold them).
    pub kafka_brokers: Option<String>,
    /// Take over the connector's slot and publication instead of creating new ones.
    pub reuse_slot: bool,
    /// The outbox table, when `table.include.list` names several tables.
    pub table: Option<String>,
}

/// The generated file and what was not carried over (also written into the file).
#[derive(Clone, Debug)]
pub struct Imported {
    pub toml: String,
    pub notes: Vec<String>,
}

/// The router options the `debezium` source reads, under Debezium's names.
const ROUTER_OPTIONS: [&str; 12] = [
    "table.field.event.id",
    "table.field.event.key",
    "table.field.event.type",
    "table.field.event.payload",
    "table.field.event.timestamp",
    "table.fields.additional.placement",
    "route.by.field",
    "route.topic.regex",
    "route.topic.replacement",
    "route.tombstone.on.empty.payload",
    "table.expand.json.payload",
    "table.op.invalid.behavior",
];
const BOOLEAN_OPTIONS: [&str; 2] = [
    "route.tombstone.on.empty.payload",
    "table.expand.json.payload",
];

/// Connector options that have no counterpart because the relay does not need them, and why.
const NOT_NEEDED: [(&str, &str); 8] = [
    (
        "database.server.name",
        "the router replaces the topic; the relay has no connector topics",
    ),
    (
        "snapshot.mode",
        "the relay takes no snapshot: it starts at the slot's position, and rows already in the outbox table are not delivered again",
    ),
    (
        "schema.include.list",
        "the relay reads the one outbox table of `[wal.debezium] table`",
    ),
    (
        "tasks.max",
        "one relay streams a slot; run a second one as a standby",
    ),
    (
        "publication.autocreate.mode",
        "the relay creates its publication over the outbox table only (inserts), or reuses yours",
    ),
    (
        "tombstones.on.delete",
        "deletes of outbox rows are never messages",
    ),
    ("name", "not needed"),
    (
        "offset.storage",
        "the slot's confirmed position is the relay's offset",
    ),
];

/// Parsed input: connector options, the router's options, and the sink.
#[derive(Debug, Default)]
struct Input {
    server: bool,
    source: BTreeMap<String, String>,
    router: BTreeMap<String, String>,
    sink_type: Option<String>,
    sink: BTreeMap<String, String>,
    /// Converter / format settings (`debezium.format.*`, `*.converter*`).
    format: BTreeMap<String, String>,
    ignored: Vec<String>,
    /// A `connector.class` that is not the PostgreSQL connector.
    wrong_connector: Option<String>,
    /// Transforms other than the router, by name and type.
    other_transforms: Vec<(String, String)>,
    /// Options of sinks other than the one in use.
    other_sinks: Vec<String>,
}

/// Turn `text` (Debezium Server properties or Kafka Connect JSON) into an `outbox.toml`.
pub fn import(text: &str, options: &ImportOptions) -> anyhow::Result<Imported> {
    let input = if text.trim_start().starts_with('{') {
        connect_json(text)?
    } else {
        server_properties(text)
    };
    if let Some(class) = &input.wrong_connector {
        bail!(
            "`connector.class` is `{class}`: only Debezium's PostgreSQL connector (io.debezium.connector.postgresql.PostgresConnector) can be imported; the relay reads PostgreSQL's WAL"
        );
    }
    let mut notes = Vec::new();
    let database_url = database_url(&input.source, &mut notes)?;
    let table = outbox_table(&input.source, options)?;
    let (slot, publication) = slot_names(&input.source, options, &mut notes)?;
    let router = router_options(&input.router, options, &mut notes)?;
    let context_headers = context_headers(&input.source, &mut notes)?;
    let destination = destination(&input, options, &mut notes)?;
    check_format(&input, &mut notes);
    for key in input.source.keys() {
        let not_needed = NOT_NEEDED
            .iter()
            .find(|(k, _)| key == k || key.starts_with(&format!("{k}.")));
        if let Some((_, why)) = not_needed {
            notes.push(format!("`{key}` is not used: {why}"));
        } else if key == "topic.prefix" || key == "extended.headers.enabled" {
            // Written into [wal.debezium] below.
        } else if !USED_SOURCE.contains(&key.as_str()) {
            notes.push(format!(
                "`{key}` is not used: the relay has no such setting"
            ));
        }
    }
    for key in &input.ignored {
        notes.push(format!(
            "`{key}` is not used: not a setting of the connector, the router or the sink"
        ));
    }
    for (name, kind) in &input.other_transforms {
        notes.push(format!(
            "transform `{name}` ({kind}) is not carried over: the relay applies the Outbox Event Router's options only; its topic, key and value come from [wal.debezium]"
        ));
    }
    for key in &input.other_sinks {
        notes.push(format!(
            "`{key}` is not used: it belongs to a sink other than `debezium.sink.type`"
        ));
    }

    // Every note may quote the input: masked and escaped once more, whatever it holds.
    let notes: Vec<String> = notes.iter().map(|n| printable("", n)).collect();
    let q = toml_str;
    let mut out = String::new();
    out.push_str("# Generated by `outbox config import-debezium` from a ");
    out.push_str(if input.server {
        "Debezium Server configuration.\n"
    } else {
        "Kafka Connect connector configuration.\n"
    });
    out.push_str("# Check it with `outbox config check --config FILE`; docs/from-debezium.md has the cut-over steps.\n");
    if !notes.is_empty() {
        out.push_str("#\n# Not carried over:\n");
        for note in &notes {
            // One comment line per note, whatever the input held (`notes` are printable
            // already: see `printable`).
            let _ = writeln!(out, "#   - {note}");
        }
    }
    out.push_str("\nmode = \"wal\"\n\n[database]\n");
    let _ = writeln!(out, "url = {}", q(&database_url));
    out.push_str("# The relay's own table (in this schema; `outbox migrate` creates it, before the first\n# `outbox relay`): where events that fail wait for their retry, and dead events stay for\n# `outbox dead list` (Debezium has neither).\nschema = \"outbox\"\n\n[wal]\n");
    let _ = writeln!(out, "slot = {}", q(&slot));
    let _ = writeln!(out, "publication = {}", q(&publication));
    if options.reuse_slot {
        out.push_str("# The connector's slot: stop the connector first (a slot has one reader).\ncreate_slot = false\n");
    }
    out.push_str("sources = [\"debezium\"]\n\n[wal.debezium]\n");
    let _ = writeln!(out, "table = {}", q(&table));
    for (key, value) in &router {
        if BOOLEAN_OPTIONS.contains(&key.as_str()) {
            let _ = writeln!(out, "{} = {value}", q(key));
        } else {
            let _ = writeln!(out, "{} = {}", q(key), q(value));
        }
    }
    match &context_headers {
        Some(prefix) => {
            out.push_str("# The connector's four __debezium.context.* headers (Debezium's default), named after it.\n\"extended.headers.enabled\" = true\n");
            let _ = writeln!(out, "\"topic.prefix\" = {}", q(prefix));
        }
        None => out.push_str("\"extended.headers.enabled\" = false\n"),
    }
    out.push('\n');
    out.push_str(&destination);
    Ok(Imported { toml: out, notes })
}

/// `${NAME}` / `${NAME:default}` expressions in `text` with the default masked where the
/// expression or the option `key` it is the value of names a credential (`${DB_PASSWORD:pw}`
/// → `${DB_PASSWORD:***}`), URLs' passwords masked, and control characters escaped: what the
/// command may print of an input value.
pub fn printable(key: &str, text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[start..]);
            rest = "";
            break;
        };
        let inner = &after[..end];
        match inner.split_once(':') {
            Some((name, _)) if is_secret_key(key) || is_secret_key(name) => {
                let _ = write!(out, "${{{name}:***}}");
            }
            _ => {
                let _ = write!(out, "${{{inner}}}");
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    escape_control(&redact_in_text(&out)).into_owned()
}

/// Whether the connector sends the `__debezium.context.*` headers (`extended.headers.enabled`,
/// default `true`), and under which `topic.prefix`: `None` when it does not, or when the
/// configuration has no prefix to name them with (noted).
fn context_headers(
    source: &BTreeMap<String, String>,
    notes: &mut Vec<String>,
) -> anyhow::Result<Option<String>> {
    let enabled = match source.get("extended.headers.enabled").map(String::as_str) {
        None | Some("true") => true,
        Some("false") => false,
        Some(other) => bail!(
            "`extended.headers.enabled` is `{}`: write `true` or `false`",
            printable("extended.headers.enabled", other)
        ),
    };
    if !enabled {
        return Ok(None);
    }
    let prefix = source
        .get("topic.prefix")
        .or_else(|| source.get("database.server.name"))
        .filter(|p| !p.trim().is_empty() && !p.contains("${"));
    if prefix.is_none() {
        notes.push("the connector's `__debezium.context.*` headers: the configuration has no literal `topic.prefix` to name them with, so the relay sends none (`\"extended.headers.enabled\" = false`); set `\"topic.prefix\"` and `\"extended.headers.enabled\" = true` in [wal.debezium] to send them".to_owned());
    }
    Ok(prefix.cloned())
}

/// Connector options the import reads.
const USED_SOURCE: [&str; 11] = [
    "connector.class",
    "database.hostname",
    "database.port",
    "database.user",
    "database.password",
    "database.dbname",
    "database.sslmode",
    "slot.name",
    "publication.name",
    "plugin.name",
    "table.include.list",
];

fn server_properties(text: &str) -> Input {
    let mut input = Input {
        server: true,
        ..Input::default()
    };
    let mut transforms: Vec<String> = Vec::new();
    let mut per_transform = Transforms::new();
    for (key, value) in properties(text) {
        if let Some(k) = key.strip_prefix("debezium.source.") {
            input.source.insert(k.to_owned(), value);
        } else if key == "debezium.transforms" {
            transforms = list(&value);
        } else if let Some(rest) = key.strip_prefix("debezium.transforms.") {
            transform_option(&mut per_transform, rest, value);
        } else if key == "debezium.sink.type" {
            input.sink_type = Some(value);
        } else if let Some(rest) = key.strip_prefix("debezium.sink.") {
            input.sink.insert(rest.to_owned(), value);
        } else if let Some(rest) = key.strip_prefix("debezium.format.") {
            input.format.insert(rest.to_owned(), value);
        } else if !key.starts_with("quarkus.") {
            input.ignored.push(key);
        }
    }
    let class = input
        .source
        .get("connector.class")
        .cloned()
        .unwrap_or_default();
    if !class.is_empty() && !class.contains("PostgresConnector") {
        input.wrong_connector = Some(class);
    }
    // The sink's own options, without the `<type>.` prefix.
    if let Some(kind) = &input.sink_type {
        let prefix = format!("{kind}.");
        let (own, other): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut input.sink)
            .into_iter()
            .partition(|(k, _)| k.starts_with(&prefix));
        input.other_sinks = other
            .into_keys()
            .map(|k| format!("debezium.sink.{k}"))
            .collect();
        input.sink = own
            .into_iter()
            .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|k| (k.to_owned(), v)))
            .collect();
    }
    (input.router, input.other_transforms) = pick_router(&transforms, per_transform);
    input
}

/// The entries of a Java `.properties` file, as `java.util.Properties.load` reads them: `#` and
/// `!` comments, `=`, `:` or white space between key and value, a line continued by an odd
/// number of trailing backslashes, and the escapes `\t`, `\n`, `\r`, `\f`, `\uXXXX`
/// (any other escaped character stands for itself: `\:`, `\=`, `\\`, `\$`).
fn properties(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut logical = String::new();
    let mut continuing = false;
    let mut lines = text.lines().peekable();
    while let Some(raw) = lines.next() {
        let line = raw.trim_start_matches([' ', '\t', '\u{c}']);
        if !continuing && (line.is_empty() || line.starts_with('#') || line.starts_with('!')) {
            continue;
        }
        let trailing = line.len() - line.trim_end_matches('\\').len();
        continuing = trailing % 2 == 1;
        if continuing {
            logical.push_str(&line[..line.len() - 1]);
            if lines.peek().is_some() {
                continue;
            }
        } else {
            logical.push_str(line);
        }
        continuing = false;
        let entry = std::mem::take(&mut logical);
        // The key ends at the first unescaped separator.
        let mut end = entry.len();
        let mut escaped = false;
        for (i, c) in entry.char_indices() {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if matches!(c, '=' | ':' | ' ' | '\t' | '\u{c}') {
                end = i;
                break;
            }
        }
        let key = unescape(&entry[..end]);
        let mut rest = entry[end..].trim_start_matches([' ', '\t', '\u{c}']);
        if let Some(r) = rest.strip_prefix(['=', ':']) {
            rest = r.trim_start_matches([' ', '\t', '\u{c}']);
        }
        out.push((key, unescape(rest)));
    }
    out
}

fn unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('f') => out.push('\u{c}'),
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                match u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                    Some(decoded) => out.push(decoded),
                    None => {
                        out.push_str("\\u");
                        out.push_str(&hex);
                    }
                }
            }
            Some(other) => out.push(other),
            None => {}
        }
    }
    out
}

fn connect_json(text: &str) -> anyhow::Result<Input> {
    let value: serde_json::Value =
        serde_json::from_str(text).context("the file starts with `{` but is not valid JSON")?;
    let config = value.get("config").unwrap_or(&value);
    let object = config.as_object().context(
        "a Kafka Connect connector configuration is a JSON object (with a `config` object)",
    )?;
    let mut input = Input::default();
    let mut transforms = Vec::new();
    let mut per_transform = Transforms::new();
    for (key, value) in object {
        let value = match value {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if key == "transforms" {
            transforms = list(&value);
        } else if let Some(rest) = key.strip_prefix("transforms.") {
            transform_option(&mut per_transform, rest, value);
        } else if key.contains("converter") {
            input.format.insert(key.clone(), value);
        } else {
            input.source.insert(key.clone(), value);
        }
    }
    let class = input
        .source
        .get("connector.class")
        .cloned()
        .unwrap_or_default();
    if !class.contains("PostgresConnector") {
        bail!(
            "`connector.class` is `{class}`: only Debezium's PostgreSQL connector (io.debezium.connector.postgresql.PostgresConnector) can be imported; the relay reads PostgreSQL's WAL"
        );
    }
    (input.router, input.other_transforms) = pick_router(&transforms, per_transform);
    input.sink_type = Some("kafka".to_owned());
    Ok(input)
}

/// Options by transform: `rest` is `<transform>.<option>`.
type Transforms = BTreeMap<String, BTreeMap<String, String>>;

fn transform_option(per_transform: &mut Transforms, rest: &str, value: String) {
    if let Some((name, option)) = rest.split_once('.') {
        per_transform
            .entry(name.to_owned())
            .or_default()
            .insert(option.to_owned(), value);
    }
}

/// The options of the transform that is the Outbox Event Router (empty when there is none),
/// and the other transforms of the chain (name, type).
fn pick_router(
    transforms: &[String],
    mut per_transform: Transforms,
) -> (BTreeMap<String, String>, Vec<(String, String)>) {
    let mut router = BTreeMap::new();
    let mut others = Vec::new();
    for name in transforms {
        let options = per_transform.remove(name).unwrap_or_default();
        let kind = options.get("type").cloned().unwrap_or_default();
        if router.is_empty() && kind.contains("outbox.EventRouter") {
            router = options;
        } else {
            others.push((name.clone(), kind));
        }
    }
    (router, others)
}

fn list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A TOML string literal.
fn toml_str(text: &str) -> String {
    toml::Value::from(text).to_string()
}

/// `${NAME}` or `${NAME:default}` (Debezium Server's environment expressions): `NAME`.
fn env_expression(value: &str) -> Option<&str> {
    let inner = value.strip_prefix("${")?.strip_suffix('}')?;
    let name = inner.split(':').next()?;
    (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .then_some(name)
}

fn database_url(
    source: &BTreeMap<String, String>,
    notes: &mut Vec<String>,
) -> anyhow::Result<String> {
    for (key, value) in source {
        if key.starts_with("database.") && key != "database.password" && value.contains("${") {
            notes.push(format!(
                "`{key}` is the expression `{}`, which the relay does not evaluate: write the value into [database] url",
                printable(key, value)
            ));
        }
    }
    let get = |k: &str| source.get(k).map(String::as_str).filter(|v| !v.is_empty());
    let host = get("database.hostname").context(
        "`database.hostname` is missing: the connector configuration names the database server",
    )?;
    let dbname = get("database.dbname")
        .context("`database.dbname` is missing: the connector configuration names the database")?;
    let port = get("database.port").unwrap_or("5432");
    let mut url = String::from("postgres://");
    if let Some(user) = get("database.user") {
        url.push_str(&percent_encode(user));
        match get("database.password") {
            Some(password) if password.contains("${") => notes.push(format!(
                "`database.password` is the expression `{}`, which the relay does not evaluate: give the URL with its password in the environment instead, `OUTBOX_DATABASE__URL=postgres://{}:PASSWORD@{host}:{port}/{dbname}`",
                printable("database.password", password),
                percent_encode(user)
            )),
            Some(password) => {
                url.push(':');
                url.push_str(&percent_encode(password));
                notes.push("`database.password` is written into [database] url as it was in the file; better keep it out of the file: `OUTBOX_DATABASE__URL` in the environment overrides `url`".to_owned());
            }
            None => {}
        }
        url.push('@');
    }
    let _ = write!(url, "{host}:{port}/{}", percent_encode(dbname));
    if let Some(mode) = get("database.sslmode") {
        let _ = write!(url, "?sslmode={}", percent_encode(mode));
    }
    Ok(url)
}

fn outbox_table(
    source: &BTreeMap<String, String>,
    options: &ImportOptions,
) -> anyhow::Result<String> {
    if let Some(t) = &options.table {
        return Ok(t.clone());
    }
    let tables = list(
        source
            .get("table.include.list")
            .map(String::as_str)
            .unwrap_or(""),
    );
    // The entries are regular expressions; the outbox table is usually written plainly, with
    // its dot maybe escaped.
    let tables: Vec<String> = tables.iter().map(|t| t.replace("\\.", ".")).collect();
    match tables.as_slice() {
        [] => Ok("public.outbox".to_owned()),
        [one] => Ok(one.clone()),
        many => {
            let outboxes: Vec<&String> = many.iter().filter(|t| t.ends_with("outbox")).collect();
            match outboxes.as_slice() {
                [one] => Ok((*one).clone()),
                _ => bail!(
                    "`table.include.list` names several tables ({}): say which is the outbox table with `--table schema.table`",
                    many.join(", ")
                ),
            }
        }
    }
}

fn slot_names(
    source: &BTreeMap<String, String>,
    options: &ImportOptions,
    notes: &mut Vec<String>,
) -> anyhow::Result<(String, String)> {
    let slot = source
        .get("slot.name")
        .cloned()
        .unwrap_or_else(|| "debezium".to_owned());
    if !options.reuse_slot {
        // Slot names are shared by all databases of a server, and the connector's is unique
        // among them: the relay's is named after it, so a second database gets a second slot.
        let own = format!("outbox_{slot}");
        if own.len() > 63
            || !own
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            bail!(
                "`slot.name` `{}` cannot name the relay's own slot (`outbox_` + it must be at most 63 lower-case letters, digits and `_`): pass `--reuse-slot` to take over the connector's slot, or give the connector a shorter `slot.name`",
                printable("slot.name", &slot)
            );
        }
        notes.push(format!(
            "the connector's slot and publication: the relay gets its own (`{own}`, named after `slot.name`), so both can run side by side until the cut-over; consumers deduplicate on the `id` header (pass `--reuse-slot` to take over the connector's slot instead)"
        ));
        return Ok((own.clone(), own));
    }
    let publication = source
        .get("publication.name")
        .cloned()
        .unwrap_or_else(|| "dbz_publication".to_owned());
    match source.get("plugin.name").map(String::as_str) {
        Some("pgoutput") => {}
        other => notes.push(format!(
            "`plugin.name` is {}: the relay reads only `pgoutput` slots and refuses slot `{slot}` otherwise (check `SELECT plugin FROM pg_replication_slots WHERE slot_name = '{slot}'`); without one, drop `--reuse-slot`",
            other.map_or("not set (Debezium's default is `decoderbufs`)".to_owned(), |p| format!("`{p}`"))
        )),
    }
    Ok((slot, publication))
}

fn router_options(
    router: &BTreeMap<String, String>,
    options: &ImportOptions,
    notes: &mut Vec<String>,
) -> anyhow::Result<BTreeMap<String, String>> {
    if router.is_empty() {
        bail!(
            "no Outbox Event Router transform found (`transforms` naming one whose `type` is io.debezium.transforms.outbox.EventRouter): the relay replaces the connector plus that router"
        );
    }
    let mut out = BTreeMap::new();
    for (key, value) in router {
        if key == "type" {
            continue;
        }
        if ROUTER_OPTIONS.contains(&key.as_str()) {
            if BOOLEAN_OPTIONS.contains(&key.as_str()) && value != "true" && value != "false" {
                bail!(
                    "router option `{key}` is `{}`: write `true` or `false`",
                    printable(key, value)
                );
            }
            if key == "table.op.invalid.behavior" && !options.reuse_slot {
                notes.push("`table.op.invalid.behavior` is carried over, but never fires: the relay's own publication publishes inserts only, so it sees no update (with `--reuse-slot` and Debezium's publication it does)".to_owned());
            }
            out.insert(key.clone(), value.clone());
        } else {
            notes.push(format!(
                "router option `{key}` is not supported: {}",
                router_reason(key)
            ));
        }
    }
    Ok(out)
}

fn router_reason(key: &str) -> &'static str {
    match key {
        "table.field.event.schema.version" => {
            "schemas are a converter feature; the relay sends JSON without a schema"
        }
        "table.json.payload.null.behavior" => {
            "a NULL payload is `null` (a tombstone on Kafka with `route.tombstone.on.empty.payload`)"
        }
        "table.fields.additional.error.on.missing" => {
            "a missing column is always an error, named at start"
        }
        k if k.starts_with("tracing.") => {
            "tracing headers come from the outbox table's columns as `header` placements"
        }
        _ => "the relay has no such option",
    }
}

/// The `[destinations.*]` table for the sink.
fn destination(
    input: &Input,
    options: &ImportOptions,
    notes: &mut Vec<String>,
) -> anyhow::Result<String> {
    let q = toml_str;
    let sink = &input.sink;
    let get = |k: &str| sink.get(k).map(String::as_str).filter(|v| !v.is_empty());
    let mut used: Vec<&str> = Vec::new();
    let mut out = String::new();
    let kind = input.sink_type.as_deref().unwrap_or("");
    match kind {
        "kafka" => {
            let brokers = options
                .kafka_brokers
                .clone()
                .or_else(|| get("producer.bootstrap.servers").map(str::to_owned))
                .context("no Kafka bootstrap servers: pass `--kafka-brokers host:9092[,host2:9092]` (a Kafka Connect configuration does not hold them)")?;
            used.push("producer.bootstrap.servers");
            let brokers: Vec<String> = list(&brokers).iter().map(|b| q(b)).collect();
            let _ = write!(
                out,
                "[destinations.kafka]\ntype = \"kafka\"\nbrokers = [{}]\n",
                brokers.join(", ")
            );
            if let Some(c) = get("producer.compression.type") {
                used.push("producer.compression.type");
                let _ = writeln!(out, "compression = {}", q(c));
            }
        }
        "rabbitmq" => {
            let host = get("connection.host").unwrap_or("localhost");
            let port = get("connection.port").unwrap_or("5672");
            let vhost = get("connection.virtual.host").unwrap_or("/");
            used.extend([
                "connection.host",
                "connection.port",
                "connection.virtual.host",
            ]);
            let _ = write!(
                out,
                "[destinations.rabbitmq]\ntype = \"rabbitmq\"\nurl = {}\n",
                q(&format!("amqp://{host}:{port}/{}", percent_encode(vhost)))
            );
            out.push_str(&credentials(
                get("connection.username"),
                get("connection.password"),
                "debezium.sink.rabbitmq.connection.password",
                notes,
            ));
            used.extend(["connection.username", "connection.password"]);
            let _ = writeln!(out, "exchange = {}", q(get("exchange").unwrap_or("")));
            used.push("exchange");
            if let Some(key) = get("routingKey") {
                used.extend(["routingKey", "routingKeyFromTopicName"]);
                if get("routingKeyFromTopicName") != Some("true") {
                    notes.push(format!(
                        "RabbitMQ `routingKey = {key}`: every event's destination is its topic, which becomes the routing key; to send all to `{key}`, set `route.topic.replacement = \"{key}\"` in [wal.debezium]"
                    ));
                }
            }
        }
        "nats-jetstream" | "nats-streaming" => {
            let url = get("url").unwrap_or("nats://localhost:4222");
            used.push("url");
            let _ = write!(
                out,
                "[destinations.nats]\ntype = \"nats\"\nservers = [{}]\n",
                q(url)
            );
            if get("create-stream").is_some() {
                used.push("create-stream");
                notes.push("NATS `create-stream`: the relay does not create streams; create one whose subjects cover the topics".to_owned());
            }
        }
        "redis" => {
            let address = get("address").unwrap_or("localhost:6379");
            used.push("address");
            let _ = write!(
                out,
                "[destinations.redis]\ntype = \"redis\"\nurl = {}\n",
                q(&format!("redis://{address}"))
            );
            out.push_str(&credentials(
                get("user"),
                get("password"),
                "debezium.sink.redis.password",
                notes,
            ));
            used.extend(["user", "password"]);
        }
        "http" => {
            let url = get("url")
                .context("`debezium.sink.http.url` is missing: the HTTP sink needs its URL")?;
            used.push("url");
            let _ = write!(
                out,
                "[destinations.webhook]\ntype = \"webhook\"\nurl = {}\n",
                q(url)
            );
        }
        "" => bail!("no sink: a Debezium Server configuration names one with `debezium.sink.type`"),
        other => bail!(
            "sink `{other}` has no counterpart: the relay delivers to kafka, rabbitmq, nats-jetstream, redis and http (webhook) destinations"
        ),
    }
    out.push_str("format = \"debezium\"\n");
    for key in sink.keys() {
        if !used.contains(&key.as_str()) {
            notes.push(format!("sink option `{key}` is not used: the relay's {kind} destination has no such setting (see outbox.example.toml)"));
        }
    }
    Ok(out)
}

/// A sink's `user` and password lines (`password_key` names the password's Debezium option in
/// notes).
fn credentials(
    user: Option<&str>,
    password: Option<&str>,
    password_key: &str,
    notes: &mut Vec<String>,
) -> String {
    let mut out = String::new();
    if let Some(user) = user {
        let _ = writeln!(out, "user = {}", toml_str(user));
    }
    if let Some(password) = password {
        out.push_str(&password_line(password, password_key, notes));
    }
    out
}

/// A sink's password setting: `password_env` for an environment expression (`${NAME}`), else
/// the password as written (with a note to move it out of the file).
fn password_line(password: &str, key: &str, notes: &mut Vec<String>) -> String {
    if let Some(var) = env_expression(password) {
        return format!("password_env = {}\n", toml_str(var));
    }
    if password.contains("${") {
        notes.push(format!(
            "`{key}` is the expression `{}`, which the relay does not evaluate: set `password_env` to the variable holding the password",
            printable(key, password)
        ));
        return String::new();
    }
    notes.push(format!(
        "`{key}` is written into the file as it was; better set `password_env` to a variable holding it"
    ));
    format!("password = {}\n", toml_str(password))
}

/// What the consumers read depends on the converters: `format = "debezium"` is Kafka
/// Connect's JSON converter without schemas.
fn check_format(input: &Input, notes: &mut Vec<String>) {
    if !input.server {
        match input.format.get("value.converter") {
            None => notes.push("no `value.converter` in the connector: the worker's decides what consumers read; `format = \"debezium\"` writes what `JsonConverter` with `schemas.enable=false` writes".to_owned()),
            Some(c) if c.ends_with("JsonConverter") && !input.format.contains_key("value.converter.schemas.enable") => notes.push("`value.converter.schemas.enable` is not set, and Kafka's default is `true` (a {schema, payload} envelope); `format = \"debezium\"` writes what `schemas.enable=false` writes".to_owned()),
            Some(_) => {}
        }
    }
    for (key, value) in &input.format {
        let fine = match key.as_str() {
            "value" | "key" | "header" => value == "json",
            k if k.ends_with("schemas.enable") => value == "false",
            k if k.ends_with("converter") => value.ends_with("JsonConverter"),
            _ => false,
        };
        if !fine {
            notes.push(format!(
                "`{key} = {value}`: `format = \"debezium\"` writes what the JSON converter writes with `schemas.enable=false`; consumers that read another format (Avro, Protobuf, a string converter, a schema envelope) need a change"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVER: &str = r#"
# Debezium Server
debezium.sink.type=kafka
debezium.sink.kafka.producer.bootstrap.servers=kafka-1:9092,kafka-2:9092
debezium.sink.kafka.producer.key.serializer=org.apache.kafka.common.serialization.StringSerializer
debezium.source.connector.class=io.debezium.connector.postgresql.PostgresConnector
debezium.source.offset.storage.file.filename=data/offsets.dat
debezium.source.database.hostname=db.internal
debezium.source.database.port=5432
debezium.source.database.user=dbz
debezium.source.database.password=s3cr@t
debezium.source.database.dbname=orders
debezium.source.topic.prefix=app
debezium.source.plugin.name=pgoutput
debezium.source.slot.name=orders_slot
debezium.source.table.include.list=public.outbox
debezium.transforms=outbox
debezium.transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
debezium.transforms.outbox.table.expand.json.payload=true
debezium.transforms.outbox.table.fields.additional.placement=type:header:eventType,shard:partition
debezium.transforms.outbox.route.topic.replacement=events.${routedByValue}
debezium.transforms.outbox.table.field.event.schema.version=version
debezium.format.value=json
quarkus.log.level=INFO
"#;

    /// `text` imported with `options`, and the relay configuration it wrote, parsed.
    fn imported_with(text: &str, options: &ImportOptions) -> (Imported, toml::Value) {
        let imported = import(text, options).unwrap();
        let parsed = toml::from_str(&imported.toml).unwrap();
        (imported, parsed)
    }

    /// Fail unless the imported config holds each `(path, value)` of `expected`: `path` the keys
    /// from the top table down.
    #[track_caller]
    fn assert_settings(parsed: &toml::Value, expected: &[(&[&str], toml::Value)]) {
        for (path, value) in expected {
            let got = path.iter().try_fold(parsed, |table, key| table.get(key));
            assert_eq!(got, Some(value), "{}", path.join(" → "));
        }
    }

    /// Fail unless the import's notes name each of `expected`.
    #[track_caller]
    fn assert_notes_name(imported: &Imported, expected: &[&str]) {
        let notes = imported.notes.join("\n");
        for expected in expected {
            assert!(
                notes.contains(expected),
                "{expected} missing from:\n{notes}"
            );
        }
    }

    #[test]
    fn a_debezium_server_configuration_becomes_a_relay_configuration() {
        let (imported, parsed) = imported_with(SERVER, &ImportOptions::default());
        let t = &imported.toml;
        assert_settings(
            &parsed,
            &[
                (&["mode"], "wal".into()),
                (
                    &["database", "url"],
                    "postgres://dbz:s3cr%40t@db.internal:5432/orders".into(),
                ),
                // Named after the connector's slot: a second database gets a second one.
                (&["wal", "slot"], "outbox_orders_slot".into()),
                (&["wal", "publication"], "outbox_orders_slot".into()),
                (&["wal", "debezium", "table"], "public.outbox".into()),
                (
                    &["wal", "debezium", "extended.headers.enabled"],
                    true.into(),
                ),
                (&["wal", "debezium", "topic.prefix"], "app".into()),
                (
                    &["wal", "debezium", "table.expand.json.payload"],
                    true.into(),
                ),
                (
                    &["wal", "debezium", "table.fields.additional.placement"],
                    "type:header:eventType,shard:partition".into(),
                ),
                (
                    &["wal", "debezium", "route.topic.replacement"],
                    "events.${routedByValue}".into(),
                ),
                (&["destinations", "kafka", "format"], "debezium".into()),
            ],
        );
        let k = &parsed["destinations"]["kafka"];
        assert_eq!(k["brokers"].as_array().map(Vec::len), Some(2));
        assert_notes_name(
            &imported,
            &[
                "table.field.event.schema.version",
                "producer.key.serializer",
                "offset.storage.file.filename",
            ],
        );
        let notes = imported.notes.join("\n");
        assert!(!notes.contains("quarkus"), "{notes}");
        assert!(!notes.contains("topic.prefix"), "{notes}");
        // `debezium.format.value=json` (and `header=json`) is what the relay writes.
        assert!(!notes.contains("format"), "{notes}");
        assert!(t.contains("# Not carried over:"), "{t}");
        assert!(t.contains("`outbox migrate` creates it"), "{t}");
        assert!(!t.contains("\\'"), "{t}");
    }

    /// What the command prints of the input: secret defaults of `${VAR:default}` masked,
    /// control characters escaped, in the notes, the file's comments and its errors; Debezium
    /// Server's `debezium.format.header=json` is no note; without `topic.prefix` the context
    /// headers are off and that is said; a slot name too long to derive one from is refused.
    #[test]
    fn printed_values_are_masked_and_escaped() {
        let text = SERVER
            .replace(
                "database.password=s3cr@t",
                "database.password=${PG_SECRET_PW:hunter2}",
            )
            .replace(
                "database.hostname=db.internal",
                "database.hostname=db.internal\ndebezium.source.database.sslrootcert=${CERT:/etc/x}",
            )
            .replace("debezium.source.topic.prefix=app\n", "")
            .replace("quarkus.log.level=INFO", "debezium.format.header=json\nweird\\u001b[2J=1")
            + "debezium.sink.kafka.producer.sasl.jaas.config=${JAAS:org.Login required password=\"pw-1\";}\n";
        let (imported, parsed) = imported_with(&text, &ImportOptions::default());
        let notes = imported.notes.join("\n");
        for secret in ["hunter2", "pw-1"] {
            assert!(!notes.contains(secret), "{notes}");
            assert!(!imported.toml.contains(secret), "{}", imported.toml);
        }
        assert!(notes.contains("${PG_SECRET_PW:***}"), "{notes}");
        assert!(notes.contains("${CERT:/etc/x}"), "{notes}");
        assert!(notes.contains("weird\\u{1b}[2J"), "{notes}");
        assert!(
            !imported
                .notes
                .iter()
                .any(|n| n.chars().any(char::is_control)),
            "{notes}"
        );
        assert!(!notes.contains("`header = json`"), "{notes}");
        assert!(notes.contains("no literal `topic.prefix`"), "{notes}");
        assert_eq!(
            parsed["wal"]["debezium"]["extended.headers.enabled"].as_bool(),
            Some(false)
        );
        let long = SERVER.replace(
            "slot.name=orders_slot",
            &format!("slot.name={}", "s".repeat(60)),
        );
        let err = import(&long, &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("--reuse-slot"), "{err}");
        let printed = printable("", "bad \u{1b}[31m `${DB_PASSWORD:x}`");
        assert_eq!(printed, "bad \\u{1b}[31m `${DB_PASSWORD:***}`");
    }

    #[test]
    fn a_kafka_connect_configuration_needs_the_brokers_and_can_reuse_the_slot() {
        let json = r#"{"name": "orders-outbox", "config": {
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "database.hostname": "db", "database.port": 5433, "database.user": "u",
            "database.dbname": "app", "slot.name": "dbz_orders",
            "table.include.list": "public.customers,public.outbox",
            "transforms": "unwrap,outbox",
            "transforms.unwrap.type": "io.debezium.transforms.ExtractNewRecordState",
            "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
            "transforms.outbox.route.tombstone.on.empty.payload": "true",
            "value.converter": "org.apache.kafka.connect.storage.StringConverter"}}"#;
        let err = import(json, &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("--kafka-brokers"), "{err}");
        let options = ImportOptions {
            kafka_brokers: Some("k:9092".into()),
            reuse_slot: true,
            table: None,
        };
        let (imported, parsed) = imported_with(json, &options);
        assert_settings(
            &parsed,
            &[
                (&["wal", "slot"], "dbz_orders".into()),
                (&["wal", "publication"], "dbz_publication".into()),
                (&["wal", "create_slot"], false.into()),
                (&["database", "url"], "postgres://u@db:5433/app".into()),
                (&["wal", "debezium", "table"], "public.outbox".into()),
                (
                    &["wal", "debezium", "route.tombstone.on.empty.payload"],
                    true.into(),
                ),
            ],
        );
        assert_notes_name(&imported, &["StringConverter", "decoderbufs"]);
    }

    #[test]
    fn properties_are_read_as_java_reads_them() {
        let text = "a.b = one \\\n    two\nc:x\\:y\\=z\nd \\u0041\\t\\\\\n! comment\n  # comment\ne=ends in a backslash\\\\\nf=\\${routedByValue}\ng=last\\";
        let got = properties(text);
        assert_eq!(
            got,
            vec![
                ("a.b".to_owned(), "one two".to_owned()),
                ("c".to_owned(), "x:y=z".to_owned()),
                ("d".to_owned(), "A\t\\".to_owned()),
                ("e".to_owned(), "ends in a backslash\\".to_owned()),
                ("f".to_owned(), "${routedByValue}".to_owned()),
                ("g".to_owned(), "last".to_owned()),
            ]
        );
    }

    #[test]
    fn expressions_and_other_parts_are_named_not_copied() {
        let text = SERVER
            .replace("database.password=s3cr@t", "database.password=${DB_PASSWORD}")
            .replace("debezium.transforms=outbox", "debezium.transforms=outbox,route\ndebezium.transforms.route.type=org.apache.kafka.connect.transforms.RegexRouter")
            + "debezium.sink.pubsub.project.id=x\ndebezium.transforms.outbox.table.field.event.timestamp=created_at\n";
        let (imported, parsed) = imported_with(&text, &ImportOptions::default());
        assert_settings(
            &parsed,
            &[(
                &["database", "url"],
                "postgres://dbz@db.internal:5432/orders".into(),
            )],
        );
        // The record's timestamp comes from the column through the Debezium shape itself.
        assert!(
            parsed["destinations"]["kafka"]
                .get("record_timestamp")
                .is_none()
        );
        assert_notes_name(
            &imported,
            &[
                "DB_PASSWORD",
                "RegexRouter",
                "debezium.sink.pubsub.project.id",
            ],
        );
        let rabbit = "debezium.sink.type=rabbitmq\ndebezium.sink.rabbitmq.connection.password=${RABBIT_PW:guest}\n".to_owned()
            + &SERVER.replace("debezium.sink.type=kafka", "");
        let (_, parsed) = imported_with(&rabbit, &ImportOptions::default());
        assert_eq!(
            parsed["destinations"]["rabbitmq"]["password_env"].as_str(),
            Some("RABBIT_PW")
        );
        // A note never breaks out of its comment line.
        let evil = SERVER.replace("quarkus.log.level=INFO", "evil\\nmode\\u003d\\\"poll\\\"=1");
        let (_, parsed) = imported_with(&evil, &ImportOptions::default());
        assert_eq!(parsed["mode"].as_str(), Some("wal"));
    }

    #[test]
    fn what_cannot_be_imported_is_named() {
        let err = |text: &str| {
            import(text, &ImportOptions::default())
                .unwrap_err()
                .to_string()
        };
        assert!(
            err(r#"{"connector.class": "io.debezium.connector.mysql.MySqlConnector"}"#)
                .contains("PostgreSQL connector")
        );
        let no_router = SERVER.replace("debezium.transforms=outbox", "debezium.transforms=");
        assert!(err(&no_router).contains("Outbox Event Router"));
        let pubsub = SERVER.replace("debezium.sink.type=kafka", "debezium.sink.type=pubsub");
        assert!(err(&pubsub).contains("`pubsub`"));
        let no_host = SERVER.replace("debezium.source.database.hostname=db.internal", "");
        assert!(err(&no_host).contains("database.hostname"));
        let mysql = SERVER.replace("postgresql.PostgresConnector", "mysql.MySqlConnector");
        assert!(err(&mysql).contains("PostgreSQL connector"));
    }
}
