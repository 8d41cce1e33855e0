//! The replication slot's lifecycle: checking the server, creating the publication and the slot,
//! noticing when a slot this outbox used has disappeared or been invalidated, the leadership
//! lock that keeps one streamer per slot, and the status figures.
//!
//! A missing slot means two different things: the first start (create it), or a slot that was
//! lost (dropped by hand, not carried over by a failover or restore). Only the second loses
//! events, so it must not be papered over by silently creating a new slot. WAL mode keeps a small
//! bookkeeping table next to the outbox (`<schema>.<table>_wal_slots`) with one row per slot it
//! created; a missing slot that has a row there is reported as [`WalError::SlotLost`].
//!
//! The same row holds the slot's **table watermark** (`table_seq`): every outbox row committed
//! before the slot's confirmed position has a `seq` at or below it. So when a session starts,
//! an undelivered row above it is one the stream is about to send again (it committed after
//! the confirmed position), and the stream delivers it; only the rows at or below it that are
//! still undelivered are the table's (they predate the slot, or a predecessor handed them to the
//! table). It is set when the slot is created (the highest `seq` then: a row above it was not
//! visible yet, so it commits after the slot's start) and raised by the streaming relay before
//! it confirms a position past table rows it decoded ([`raise_table_watermark`]).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};

use crate::config::{Source, WalConfig};
use crate::error::{WalError, map_sqlx};
use crate::lsn::Lsn;

/// A slot as `pg_replication_slots` describes it.
#[derive(Clone, Debug)]
pub(crate) struct SlotInfo {
    pub plugin: Option<String>,
    pub database: Option<String>,
    pub confirmed_flush: Option<Lsn>,
    pub wal_status: Option<String>,
    /// A session streams from it now.
    pub active: bool,
}

pub(crate) fn marker_table(config: &WalConfig) -> String {
    format!("\"{}\".\"{}_wal_slots\"", config.schema, config.table)
}

pub(crate) fn outbox_table(config: &WalConfig) -> String {
    format!("\"{}\".\"{}\"", config.schema, config.table)
}

/// The stream table, quoted and qualified.
pub(crate) fn stream_table(config: &WalConfig) -> String {
    format!("\"{}\".\"{}\"", config.schema, config.stream_table())
}

/// The name of the stream table's header trigger: `<stream table>_header_rules`, cut to
/// PostgreSQL's 63-byte identifier limit (names are ASCII, checked by the configuration), so
/// the catalog holds exactly the name the statement that creates it looks for.
pub(crate) fn stream_header_trigger(config: &WalConfig) -> String {
    let mut name = format!("{}_header_rules", config.stream_table());
    name.truncate(63);
    name
}

/// The stream table's definition (`CREATE TABLE IF NOT EXISTS`, for schema migrations that
/// create it ahead of the relay): the event columns of the outbox table and a primary key, so
/// that an insert costs what a hand-written outbox table's does (measured with
/// `outbox-bench writer-cost`), and a BRIN index for purging by age, which costs an insert
/// next to nothing. Rows are never updated; `id` defaults to a version 4 UUID for writers that
/// leave it out (the library writes version 7).
///
/// `headers` is checked as the outbox table's are, by the same trigger function
/// (`<table>_check_headers`, which the outbox's migrations create: migrate first): a JSON
/// object of string values, no name under the reserved prefix `outbox-` other than
/// `outbox-partition`. A writer's insert that breaks it fails with SQLSTATE 23514 naming the
/// header, instead of the row being dead-lettered when the relay reads it. A trigger for the
/// reason the outbox table has one: a CHECK constraint would cost every insert several times
/// as much (see the `outbox-postgresql` crate docs). A stream table created before the check
/// gets the trigger from the statement at the end; it checks new rows only, and the relay
/// dead-letters old ones it cannot read, as before.
pub fn stream_table_ddl(config: &WalConfig) -> String {
    let t = stream_table(config);
    let name = config.stream_table();
    let trigger = stream_header_trigger(config);
    let function = format!("\"{}\".\"{}_check_headers\"", config.schema, config.table);
    format!(
        "CREATE TABLE IF NOT EXISTS {t} (
             id              UUID        NOT NULL DEFAULT gen_random_uuid() PRIMARY KEY,
             aggregate_type  TEXT        NOT NULL CHECK (aggregate_type <> ''),
             aggregate_id    TEXT        NOT NULL CHECK (aggregate_id <> ''),
             event_type      TEXT        NOT NULL CHECK (event_type <> ''),
             payload         JSON        NOT NULL,
             destination     TEXT,
             headers         JSONB       NOT NULL DEFAULT '{{}}' CHECK (jsonb_typeof(headers) = 'object'),
             occurred_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
             enqueued_at     TIMESTAMPTZ NOT NULL DEFAULT now()
         );
         CREATE INDEX IF NOT EXISTS \"{name}_enqueued_at\" ON {t} USING brin (enqueued_at);
         DO $outbox$ BEGIN
             IF to_regprocedure('{function}()') IS NULL THEN
                 RAISE EXCEPTION 'outbox: function {function}() is missing: run `outbox migrate` for the outbox table first (it checks the stream table''s headers too)';
             END IF;
             IF NOT EXISTS (SELECT 1 FROM pg_trigger
                            WHERE tgrelid = '{t}'::regclass AND tgname = '{trigger}') THEN
                 CREATE TRIGGER \"{trigger}\" BEFORE INSERT OR UPDATE OF headers ON {t}
                     FOR EACH ROW EXECUTE FUNCTION {function}();
             END IF;
         END $outbox$;"
    )
}

/// Create the stream table when it is captured and missing (and its header trigger when a
/// stream table from before the trigger lacks it).
pub(crate) async fn ensure_stream_table(pool: &PgPool, config: &WalConfig) -> Result<(), WalError> {
    if !config.captures(Source::StreamTable) {
        return Ok(());
    }
    sqlx::raw_sql(AssertSqlSafe(stream_table_ddl(config)))
        .execute(pool)
        .await
        .map_err(map_sqlx)?;
    Ok(())
}

pub(crate) fn fnv1a(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The advisory lock key that makes one instance the streamer of `slot`.
pub(crate) fn leader_key(config: &WalConfig) -> i64 {
    fnv1a(&format!("outbox-wal:leader:{}", config.slot)) as i64
}

/// Check that the server can do logical replication for this role; the error says what to
/// change.
pub(crate) async fn check_server(pool: &PgPool) -> Result<(), WalError> {
    let row = sqlx::query(
        "SELECT current_setting('wal_level') AS wal_level,
                current_setting('max_replication_slots')::int AS slots,
                current_setting('max_wal_senders')::int AS senders,
                (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user) AS can_replicate,
                current_user::text AS role",
    )
    .fetch_one(pool)
    .await
    .map_err(map_sqlx)?;
    let wal_level: String = row.try_get("wal_level").map_err(map_sqlx)?;
    let slots: i32 = row.try_get("slots").map_err(map_sqlx)?;
    let senders: i32 = row.try_get("senders").map_err(map_sqlx)?;
    let can: Option<bool> = row.try_get("can_replicate").map_err(map_sqlx)?;
    let role: String = row.try_get("role").map_err(map_sqlx)?;
    if wal_level != "logical" {
        return Err(WalError::ServerSetup(format!(
            "wal_level is `{wal_level}`; WAL mode needs `logical`: run `ALTER SYSTEM SET wal_level = logical` (or set it in postgresql.conf) and restart PostgreSQL"
        )));
    }
    if slots < 1 {
        return Err(WalError::ServerSetup(
            "max_replication_slots is 0; set it to at least 1 (e.g. 10) and restart PostgreSQL"
                .into(),
        ));
    }
    if senders < 1 {
        return Err(WalError::ServerSetup(
            "max_wal_senders is 0; set it to at least 1 (e.g. 10) and restart PostgreSQL".into(),
        ));
    }
    if can != Some(true) {
        return Err(WalError::ServerSetup(format!(
            "role `{role}` may not use replication; run `ALTER ROLE \"{role}\" REPLICATION` (and allow it a `host replication` line in pg_hba.conf)"
        )));
    }
    Ok(())
}

/// Who may write logical messages, and so events into the message source: the overloads of
/// `pg_logical_emit_message` and their `EXECUTE` privilege. PostgreSQL grants it to PUBLIC by
/// default, which lets every role that can log in — with no privilege on any table — emit a
/// message with the outbox prefix. See the crate docs, "Capture sources".
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MessageSourceAccess {
    /// Whether this configuration captures the message source (`sources` has `messages`).
    pub enabled: bool,
    /// Overloads every role may execute (PUBLIC holds EXECUTE), e.g.
    /// `pg_logical_emit_message(boolean,text,text)`. Must be empty for the relay to start with
    /// the message source on.
    pub public_overloads: Vec<String>,
    /// Roles granted EXECUTE on some overload, superusers (who always may) left out.
    pub granted_to: Vec<String>,
    /// The role the relay connects as.
    pub relay_role: String,
    /// Whether that role may execute the `bytea` overload, which heartbeats use.
    pub relay_can_emit: bool,
    /// The statements to run (as a superuser, in this database) to allow only chosen roles:
    /// a `REVOKE … FROM PUBLIC` per open overload, a `GRANT` to the writers and the relay.
    /// Empty when there is nothing to do.
    pub fix: Vec<String>,
}

/// The overload writers ([`enqueue_message`](crate::enqueue_message)) and heartbeats call.
pub(crate) const EMIT_BYTEA: &str = "pg_logical_emit_message(boolean,text,bytea)";

impl MessageSourceAccess {
    /// Whether any role may write events into the message source.
    pub fn open_to_public(&self) -> bool {
        !self.public_overloads.is_empty()
    }

    /// The refusal the relay gives when the message source is on and open: what the risk is and
    /// the statements that close it.
    pub(crate) fn refusal(&self, database: &str) -> String {
        format!(
            "the message source is on (`sources` includes `messages`), but every role may call pg_logical_emit_message (EXECUTE is granted to PUBLIC on {}), so any role that can log in, without any other privilege, could publish events to every destination. Run as a superuser in database `{database}`: {} — or take `messages` out of `[wal] sources` if writers only insert into the outbox table",
            self.public_overloads.join(", "),
            self.fix.join(" ")
        )
    }
}

/// Read who may execute `pg_logical_emit_message`, and build the statements that allow only the
/// writers and the relay.
pub(crate) async fn message_source_access(
    pool: &PgPool,
    config: &WalConfig,
) -> Result<MessageSourceAccess, WalError> {
    // Every overload this server has (PostgreSQL 17 added one with a `flush` argument), not a
    // hard-coded list. proacl NULL means the default ACL, which grants EXECUTE to PUBLIC.
    let rows = sqlx::query(
        "SELECT p.oid::regprocedure::text AS signature,
                has_function_privilege('public', p.oid, 'EXECUTE') AS public_can,
                has_function_privilege(current_user, p.oid, 'EXECUTE') AS relay_can,
                coalesce((SELECT array_agg(DISTINCT r.rolname::text)
                          FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                          JOIN pg_roles r ON r.oid = a.grantee
                          WHERE a.privilege_type = 'EXECUTE' AND NOT r.rolsuper), '{}') AS grantees,
                current_user::text AS relay_role,
                (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS relay_super
         FROM pg_proc p
         WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let mut access = MessageSourceAccess {
        enabled: config.captures(Source::Messages),
        ..MessageSourceAccess::default()
    };
    let mut relay_super = false;
    let mut granted = std::collections::BTreeSet::new();
    for row in &rows {
        let signature: String = row.try_get("signature").map_err(map_sqlx)?;
        let public_can: bool = row.try_get("public_can").map_err(map_sqlx)?;
        let relay_can: bool = row.try_get("relay_can").map_err(map_sqlx)?;
        let grantees: Vec<String> = row.try_get("grantees").map_err(map_sqlx)?;
        access.relay_role = row.try_get("relay_role").map_err(map_sqlx)?;
        relay_super = row
            .try_get::<Option<bool>, _>("relay_super")
            .map_err(map_sqlx)?
            .unwrap_or(false);
        if public_can {
            access.public_overloads.push(signature.clone());
        }
        if signature == EMIT_BYTEA {
            access.relay_can_emit = relay_can;
        }
        granted.extend(grantees);
    }
    access.granted_to = granted.into_iter().collect();
    for overload in &access.public_overloads {
        access.fix.push(format!(
            "REVOKE EXECUTE ON FUNCTION {overload} FROM PUBLIC;"
        ));
    }
    // Writers need the overload enqueue_message calls; so does the relay, for heartbeats,
    // unless it is a superuser.
    let relay_needs_grant = !relay_super && (!access.relay_can_emit || access.open_to_public());
    if access.open_to_public() || relay_needs_grant {
        let mut to = Vec::new();
        if access.open_to_public() {
            to.push("<writer roles>".to_owned());
        }
        if relay_needs_grant {
            to.push(quote_role(&access.relay_role));
        }
        access.fix.push(format!(
            "GRANT EXECUTE ON FUNCTION {EMIT_BYTEA} TO {};",
            to.join(", ")
        ));
    }
    Ok(access)
}

/// A role name as SQL: bare when it is a plain lowercase identifier, quoted otherwise.
pub(crate) fn quote_role(role: &str) -> String {
    let plain = role.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && role
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        role.to_owned()
    } else {
        format!("\"{}\"", role.replace('"', "\"\""))
    }
}

pub(crate) async fn slot_info(pool: &PgPool, slot: &str) -> Result<Option<SlotInfo>, WalError> {
    let row = sqlx::query(
        "SELECT plugin::text, database::text, confirmed_flush_lsn::text AS confirmed, wal_status, active
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?;
    let Some(row) = row else { return Ok(None) };
    let confirmed: Option<String> = row.try_get("confirmed").map_err(map_sqlx)?;
    Ok(Some(SlotInfo {
        plugin: row.try_get("plugin").map_err(map_sqlx)?,
        database: row.try_get("database").map_err(map_sqlx)?,
        confirmed_flush: confirmed
            .as_deref()
            .map(Lsn::parse)
            .transpose()
            .map_err(WalError::Decode)?,
        wal_status: row.try_get("wal_status").map_err(map_sqlx)?,
        active: row.try_get("active").map_err(map_sqlx)?,
    }))
}

async fn ensure_marker_table(pool: &PgPool, config: &WalConfig) -> Result<(), WalError> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS \"{}\";
         CREATE TABLE IF NOT EXISTS {t} (
             slot_name   TEXT PRIMARY KEY,
             created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
             created_lsn TEXT NOT NULL
         );
         ALTER TABLE {t} ADD COLUMN IF NOT EXISTS table_seq BIGINT",
        config.schema,
        t = marker_table(config)
    )))
    .execute(pool)
    .await
    .map_err(map_sqlx)?;
    Ok(())
}

async fn marker_exists(pool: &PgPool, config: &WalConfig) -> Result<bool, WalError> {
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(marker_table(config))
        .fetch_one(pool)
        .await
        .map_err(map_sqlx)?;
    if exists.is_none() {
        return Ok(false);
    }
    let found: Option<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE slot_name = $1",
        marker_table(config)
    )))
    .bind(&config.slot)
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?;
    Ok(found.is_some())
}

/// Create the publication if it is missing; check an existing one publishes what we need.
pub(crate) async fn ensure_publication(pool: &PgPool, config: &WalConfig) -> Result<(), WalError> {
    ensure_stream_table(pool, config).await?;
    // (schema, name, quoted) of every table whose inserts are events.
    let mut tables: Vec<(String, String, String)> = Vec::new();
    if config.captures(Source::Table) {
        tables.push((
            config.schema.clone(),
            config.table.clone(),
            outbox_table(config),
        ));
    }
    if config.captures(Source::StreamTable) {
        tables.push((
            config.schema.clone(),
            config.stream_table(),
            stream_table(config),
        ));
    }
    if config.captures(Source::Debezium) {
        crate::debezium::check_table(pool, &config.debezium).await?;
        let (schema, name) = config.debezium.schema_and_name();
        tables.push((schema, name, config.debezium.quoted()));
    }
    let existing = sqlx::query("SELECT pubinsert FROM pg_publication WHERE pubname = $1")
        .bind(&config.publication)
        .fetch_optional(pool)
        .await
        .map_err(map_sqlx)?;
    match existing {
        None => {
            let sql = if !tables.is_empty() {
                format!(
                    "CREATE PUBLICATION \"{}\" FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
                    config.publication,
                    tables
                        .iter()
                        .map(|(_, _, quoted)| quoted.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                // Messages need no table, but START_REPLICATION needs a publication.
                format!(
                    "CREATE PUBLICATION \"{}\" WITH (publish = 'insert')",
                    config.publication
                )
            };
            match sqlx::query(AssertSqlSafe(sql)).execute(pool).await {
                Ok(_) => {}
                // Created concurrently by someone else: fine, checked below on the next start.
                Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42710") => {}
                Err(e) => return Err(map_sqlx(e)),
            }
            tracing::info!(publication = %config.publication, "Publication created.");
        }
        Some(row) => {
            let inserts: bool = row.try_get("pubinsert").map_err(map_sqlx)?;
            for (schema, name, quoted) in &tables {
                let has_table: Option<i32> = sqlx::query_scalar(
                    "SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                )
                .bind(&config.publication)
                .bind(schema)
                .bind(name)
                .fetch_optional(pool)
                .await
                .map_err(map_sqlx)?;
                if inserts && has_table.is_none() && *name == config.stream_table() {
                    // The stream table is ours: added to an existing publication, so turning
                    // the source on is one setting (inserts after this commit are captured).
                    let sql = format!(
                        "ALTER PUBLICATION \"{}\" ADD TABLE {quoted}",
                        config.publication
                    );
                    match sqlx::query(AssertSqlSafe(sql)).execute(pool).await {
                        Ok(_) => {}
                        // Added concurrently by another relay starting: fine.
                        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42710") => {
                        }
                        Err(e) => return Err(map_sqlx(e)),
                    }
                    tracing::info!(publication = %config.publication, table = %quoted, "Stream table added to the publication.");
                    continue;
                }
                if !inserts || has_table.is_none() {
                    return Err(WalError::Config(format!(
                        "publication `{}` exists but does not publish inserts into {quoted}: run `ALTER PUBLICATION \"{}\" ADD TABLE {quoted}` and `ALTER PUBLICATION \"{}\" SET (publish = 'insert')`, or configure another publication name",
                        config.publication, config.publication, config.publication
                    )));
                }
            }
            warn_about_other_tables(pool, config, &tables).await?;
        }
    }
    Ok(())
}

/// An existing publication that publishes more than the sources read (`FOR ALL TABLES`, a
/// table added by hand, the stream table after its source was turned off): the server then
/// decodes and sends those tables' changes too, and the relay reads past them. Not refused
/// (a Debezium publication reused on a cut-over publishes every table), but said, with the
/// statement that narrows it.
async fn warn_about_other_tables(
    pool: &PgPool,
    config: &WalConfig,
    tables: &[(String, String, String)],
) -> Result<(), WalError> {
    let all_tables: bool =
        sqlx::query_scalar("SELECT puballtables FROM pg_publication WHERE pubname = $1")
            .bind(&config.publication)
            .fetch_optional(pool)
            .await
            .map_err(map_sqlx)?
            .unwrap_or(false);
    let published: Vec<(String, String)> = sqlx::query_as(
        "SELECT schemaname::text, tablename::text FROM pg_publication_tables WHERE pubname = $1",
    )
    .bind(&config.publication)
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let others: Vec<String> = published
        .iter()
        .filter(|(schema, name)| !tables.iter().any(|(s, n, _)| s == schema && n == name))
        .map(|(schema, name)| format!("\"{schema}\".\"{name}\""))
        .collect();
    if all_tables {
        tracing::warn!(
            publication = %config.publication,
            "The publication is FOR ALL TABLES: the server sends the relay every table's changes, which it reads past. Give the relay a publication of its own (a name the relay creates), or narrow this one."
        );
    } else if !others.is_empty() {
        tracing::warn!(
            publication = %config.publication,
            tables = %others.join(", "),
            "The publication also publishes tables no source reads: the server sends the relay their changes, which it reads past. Run `ALTER PUBLICATION \"{}\" DROP TABLE {}` unless another consumer needs them.",
            config.publication,
            others.join(", ")
        );
    }
    Ok(())
}

/// Make sure the slot exists and is usable; returns its confirmed position.
pub(crate) async fn ensure_slot(pool: &PgPool, config: &WalConfig) -> Result<Lsn, WalError> {
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pool)
        .await
        .map_err(map_sqlx)?;
    match slot_info(pool, &config.slot).await? {
        Some(info) => {
            if info.plugin.as_deref() != Some("pgoutput") {
                return Err(WalError::Config(format!(
                    "replication slot `{}` exists but is not a logical pgoutput slot (its plugin is {}); set `[wal] slot` to another name",
                    config.slot,
                    info.plugin
                        .as_deref()
                        .map_or("unknown".to_owned(), |p| format!("`{p}`"))
                )));
            }
            if info.database.as_deref() != Some(database.as_str()) {
                return Err(WalError::Config(format!(
                    "replication slot `{}` belongs to {}, not to `{database}` (slot names are shared by every database of the server, and each database needs its own slot): set `[wal] slot` to another name",
                    config.slot,
                    info.database
                        .as_deref()
                        .map_or("no database".to_owned(), |d| format!("database `{d}`"))
                )));
            }
            if info.wal_status.as_deref() == Some("lost") {
                return Err(WalError::SlotInvalidated {
                    slot: config.slot.clone(),
                });
            }
            ensure_publication(pool, config).await?;
            Ok(info.confirmed_flush.unwrap_or(Lsn::ZERO))
        }
        None => {
            if marker_exists(pool, config).await? {
                return Err(WalError::SlotLost {
                    slot: config.slot.clone(),
                    detail: format!(
                        "{} records that WAL mode created it, pg_replication_slots has no such slot",
                        marker_table(config)
                    ),
                });
            }
            if !config.create_slot {
                return Err(WalError::Config(format!(
                    "replication slot `{}` does not exist and `create_slot` is off; create it with SELECT pg_create_logical_replication_slot('{}', 'pgoutput') or turn `create_slot` on",
                    config.slot, config.slot
                )));
            }
            create_slot(pool, config).await
        }
    }
}

/// Create the publication, then the slot (in that order: a slot must never decode changes from
/// before its publication existed), then record it.
pub(crate) async fn create_slot(pool: &PgPool, config: &WalConfig) -> Result<Lsn, WalError> {
    ensure_publication(pool, config).await?;
    ensure_marker_table(pool, config).await?;
    let lsn: String = sqlx::query_scalar(
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
    )
    .bind(&config.slot)
    .fetch_one(pool)
    .await
    .map_err(map_sqlx)?;
    // The watermark is read after the slot exists: a row above it was not committed then, so
    // the slot sends it.
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (slot_name, created_lsn, table_seq)
         VALUES ($1, $2, (SELECT coalesce(max(seq), 0)::bigint FROM {}))
         ON CONFLICT (slot_name) DO UPDATE
             SET created_at = now(), created_lsn = EXCLUDED.created_lsn, table_seq = EXCLUDED.table_seq",
        marker_table(config),
        outbox_table(config)
    )))
    .bind(&config.slot)
    .bind(&lsn)
    .execute(pool)
    .await
    .map_err(map_sqlx)?;
    tracing::info!(slot = %config.slot, %lsn, "Replication slot created.");
    Lsn::parse(&lsn).map_err(WalError::Decode)
}

/// The slot's table watermark (see the module docs), once its row has the column: `None` when
/// the slot has no row here (created by hand, or by Debezium) or the row predates the column.
/// Adds the column to a bookkeeping table from before it.
pub(crate) async fn table_watermark(
    pool: &PgPool,
    config: &WalConfig,
) -> Result<Option<i64>, WalError> {
    if !marker_exists(pool, config).await? {
        return Ok(None);
    }
    sqlx::query(AssertSqlSafe(format!(
        "ALTER TABLE {} ADD COLUMN IF NOT EXISTS table_seq BIGINT",
        marker_table(config)
    )))
    .execute(pool)
    .await
    .map_err(map_sqlx)?;
    let seq: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT table_seq FROM {} WHERE slot_name = $1",
        marker_table(config)
    )))
    .bind(&config.slot)
    .fetch_optional(pool)
    .await
    .map_err(map_sqlx)?
    .flatten();
    Ok(seq)
}

/// Raise the slot's table watermark to at least `seq` (it never goes down). Returns whether
/// the slot has a row to hold it.
pub(crate) async fn raise_table_watermark(
    pool: &PgPool,
    config: &WalConfig,
    seq: i64,
) -> Result<bool, WalError> {
    let updated = sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET table_seq = greatest(coalesce(table_seq, 0), $2) WHERE slot_name = $1",
        marker_table(config)
    )))
    .bind(&config.slot)
    .bind(seq)
    .execute(pool)
    .await
    .map_err(map_sqlx)?;
    Ok(updated.rows_affected() > 0)
}

/// Drop the slot (if it exists and no session uses it) and forget it.
pub(crate) async fn drop_slot_and_marker(
    pool: &PgPool,
    config: &WalConfig,
) -> Result<bool, WalError> {
    let dropped = if slot_info(pool, &config.slot).await?.is_some() {
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&config.slot)
            .execute(pool)
            .await
            .map_err(map_sqlx)?;
        true
    } else {
        false
    };
    if marker_exists(pool, config).await? {
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {} WHERE slot_name = $1",
            marker_table(config)
        )))
        .bind(&config.slot)
        .execute(pool)
        .await
        .map_err(map_sqlx)?;
    }
    Ok(dropped)
}

/// Try to become the streamer of the slot: a session-level advisory lock on `conn`, released by
/// PostgreSQL when the connection ends (also when the process dies).
pub(crate) async fn try_lead(
    conn: &mut PgConnection,
    config: &WalConfig,
) -> Result<bool, WalError> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(leader_key(config))
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)
}

/// The slot's figures, for `outbox status` and alerts.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WalStatus {
    /// The slot name.
    pub slot: String,
    /// Whether the slot exists.
    pub exists: bool,
    /// Whether a replication session is streaming from it now.
    pub active: bool,
    /// The server process of that session.
    pub active_pid: Option<i32>,
    /// `pg_replication_slots.wal_status`: `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// The server's current WAL write position.
    pub current_wal_lsn: Lsn,
    /// Up to where the relay confirmed delivery (the last acked LSN as the server knows it).
    pub confirmed_flush_lsn: Option<Lsn>,
    /// The oldest WAL the slot still needs.
    pub restart_lsn: Option<Lsn>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`: how far delivery is behind, in bytes.
    pub lag_bytes: Option<u64>,
    /// `pg_current_wal_lsn() - restart_lsn`: WAL kept on disk because of this slot.
    pub retained_wal_bytes: Option<u64>,
    /// Bytes left before `max_slot_wal_keep_size` invalidates the slot (`None` = unlimited).
    pub safe_wal_size: Option<i64>,
    /// What the streaming session last received, per `pg_stat_replication`.
    pub sent_lsn: Option<Lsn>,
    /// Transactions decoded through this slot since the statistics were reset.
    pub total_txns: Option<i64>,
    /// Bytes decoded through this slot since the statistics were reset.
    pub total_bytes: Option<i64>,
    /// Decoded bytes per second, when the status was sampled over an interval.
    pub decode_bytes_per_sec: Option<f64>,
    /// Decoded transactions per second, when the status was sampled over an interval.
    pub decode_txns_per_sec: Option<f64>,
    /// Whether the publication exists.
    pub publication_exists: bool,
    /// Who may write events into the message source (`pg_logical_emit_message`), and what to
    /// run when every role may.
    pub message_source: MessageSourceAccess,
    /// When the figures were read (database clock).
    pub observed_at: Option<DateTime<Utc>>,
}

fn lsn_col(row: &sqlx::postgres::PgRow, name: &str) -> Result<Option<Lsn>, WalError> {
    let text: Option<String> = row.try_get(name).map_err(map_sqlx)?;
    text.as_deref()
        .map(Lsn::parse)
        .transpose()
        .map_err(WalError::Decode)
}

pub(crate) async fn read_status(pool: &PgPool, config: &WalConfig) -> Result<WalStatus, WalError> {
    let row = sqlx::query(
        "SELECT pg_current_wal_lsn()::text AS current, now() AS observed_at,
                s.slot_name IS NOT NULL AS exists, coalesce(s.active, false) AS active, s.active_pid,
                s.wal_status, s.confirmed_flush_lsn::text AS confirmed, s.restart_lsn::text AS restart,
                (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint AS lag,
                (pg_current_wal_lsn() - s.restart_lsn)::bigint AS retained,
                s.safe_wal_size,
                r.sent_lsn::text AS sent,
                st.total_txns, st.total_bytes,
                EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $2) AS publication_exists
         FROM (SELECT 1) AS one
         LEFT JOIN pg_replication_slots s ON s.slot_name = $1
         LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
         LEFT JOIN pg_stat_replication_slots st ON st.slot_name = $1",
    )
    .bind(&config.slot)
    .bind(&config.publication)
    .fetch_one(pool)
    .await
    .map_err(map_sqlx)?;
    let current = lsn_col(&row, "current")?.unwrap_or(Lsn::ZERO);
    let lag: Option<i64> = row.try_get("lag").map_err(map_sqlx)?;
    let retained: Option<i64> = row.try_get("retained").map_err(map_sqlx)?;
    Ok(WalStatus {
        slot: config.slot.clone(),
        exists: row.try_get("exists").map_err(map_sqlx)?,
        active: row.try_get("active").map_err(map_sqlx)?,
        active_pid: row.try_get("active_pid").map_err(map_sqlx)?,
        wal_status: row.try_get("wal_status").map_err(map_sqlx)?,
        current_wal_lsn: current,
        confirmed_flush_lsn: lsn_col(&row, "confirmed")?,
        restart_lsn: lsn_col(&row, "restart")?,
        lag_bytes: lag.map(|v| v.max(0) as u64),
        retained_wal_bytes: retained.map(|v| v.max(0) as u64),
        safe_wal_size: row.try_get("safe_wal_size").map_err(map_sqlx)?,
        sent_lsn: lsn_col(&row, "sent")?,
        total_txns: row.try_get("total_txns").map_err(map_sqlx)?,
        total_bytes: row.try_get("total_bytes").map_err(map_sqlx)?,
        decode_bytes_per_sec: None,
        decode_txns_per_sec: None,
        publication_exists: row.try_get("publication_exists").map_err(map_sqlx)?,
        message_source: message_source_access(pool, config).await?,
        observed_at: Some(row.try_get("observed_at").map_err(map_sqlx)?),
    })
}
