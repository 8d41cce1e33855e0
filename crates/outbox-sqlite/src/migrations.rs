//! Embedded, versioned migrations for the outbox schema.
//!
//! Why not `sqlx::migrate!`: its bookkeeping table is always `_sqlx_migrations`, which the
//! application's own sqlx migrations already use in the same database file, and its SQL is fixed
//! at compile time while our table name is configurable. So the outbox keeps its own short list of
//! versioned SQL templates and its own bookkeeping table next to the outbox table
//! (`<table>_migrations`), exactly like the PostgreSQL store.
//!
//! Applying them is
//! - **serialized and atomic**: everything runs in one `BEGIN IMMEDIATE` transaction. SQLite DDL
//!   is transactional, and `IMMEDIATE` takes the write lock up front, so two relays starting
//!   together queue on the busy timeout instead of both reading "version 0" and racing (a deferred
//!   transaction that reads first and writes later could not even wait: SQLite refuses to upgrade
//!   a read transaction to a write one while another writer is active);
//! - **idempotent**: applied versions are skipped;
//! - **verified**: a checksum per version; an edited or an unknown newer migration is an error,
//!   not a silent skip.

use outbox_types::StoreError;
use outbox_types::migration::{
    MigrationReport, Schema, latest_version, pending, sqlite_bookkeeping_ddl,
};
use sqlx::SqlitePool;

use crate::SqliteOutbox;
use crate::error::map_sqlx;

/// One schema change. `{table}` (the bare name) and `{t}` (the quoted name) are replaced before
/// it runs.
pub(crate) use outbox_types::migration::Migration;

/// The header rules of migration 4's triggers, one body for both: `headers` is a JSON object
/// whose values are all strings, with no name under the prefix `outbox-` other than
/// `outbox-partition` (`outbox_types::is_reserved_header`). One `RAISE` per rule, in order, so
/// `json_each` only ever reads an object. The messages are string literals: SQLite before 3.47
/// accepts nothing else in `RAISE`, and a schema it cannot parse would lock such a writer out of
/// the whole database file. A macro, not a const: `concat!` builds the migration's text.
macro_rules! header_check_body {
    () => {
        r#"    SELECT RAISE(ABORT, 'outbox: headers must be a JSON object of strings, e.g. {"trace-id": "abc"}')
    WHERE NEW.headers IS NULL OR json_valid(NEW.headers) = 0 OR json_type(NEW.headers) <> 'object';
    SELECT RAISE(ABORT, 'outbox: header values must be JSON strings ("3", not 3)')
    WHERE EXISTS (SELECT 1 FROM json_each(NEW.headers) WHERE type <> 'text');
    SELECT RAISE(ABORT, 'outbox: header names starting with outbox- are reserved for the relay (only outbox-partition is allowed)')
    WHERE EXISTS (SELECT 1 FROM json_each(NEW.headers)
                  WHERE substr(key, 1, 7) = 'outbox-' AND key <> 'outbox-partition');
"#
    };
}

/// The outbox schema, oldest first. Never edit a released entry: add a new one.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "outbox events table, claim and ordering indexes",
        sql: r#"
-- Lifecycle (see outbox_core::EventState): pending -> in_flight -> delivered | dead.
-- A pending row with attempts > 0 is one waiting for a retry.
--
-- Times are INTEGER microseconds since the Unix epoch, written by the store from the host clock
-- (the same clock SQLite's own date functions read). Integers compare exactly, index well and
-- cannot be misparsed the way SQLite's text dates can.
--
-- STRICT: a column declared INTEGER holds integers and a TEXT column text, so a foreign writer
-- cannot slip a float timestamp or a blob payload past the store's decoder.
--
-- AUTOINCREMENT: a seq is never handed out twice, even after the newest rows were purged or
-- discarded; seq is the enqueue order, the ack key and the paging cursor of list_dead.
CREATE TABLE {t} (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    -- The event's UUID, lowercase hyphenated text.
    id               TEXT    NOT NULL,
    aggregate_type   TEXT    NOT NULL,
    aggregate_id     TEXT    NOT NULL,
    event_type       TEXT    NOT NULL,
    -- The JSON text the writer produced, byte for byte (validated before it gets here).
    payload          TEXT    NOT NULL,
    destination      TEXT,
    -- A JSON object of strings.
    headers          TEXT    NOT NULL DEFAULT '{}',
    idempotency_key  TEXT,
    occurred_at      INTEGER NOT NULL,
    enqueued_at      INTEGER NOT NULL,
    status           TEXT    NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'in_flight', 'delivered', 'dead')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  INTEGER NOT NULL,
    last_error       TEXT,
    lease_owner      TEXT,
    -- The fencing token of the claim holding the row, lowercase hyphenated UUID text.
    lease_token      TEXT,
    lease_expires_at INTEGER,
    delivered_at     INTEGER,
    dead_at          INTEGER,
    CONSTRAINT "{table}_id_key" UNIQUE (id)
) STRICT;

-- A second enqueue with the same key finds the first row.
CREATE UNIQUE INDEX "{table}_idempotency_key" ON {t} (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Claim scans only undelivered rows, in enqueue order: its cost does not grow with the number
-- of delivered rows kept for retention. The claim repeats this predicate word for word, which is
-- what SQLite's planner needs to use a partial index.
CREATE INDEX "{table}_open" ON {t} (seq)
    WHERE status IN ('pending', 'in_flight');

-- Rows that can hold back later events of their aggregate: in flight, dead, or waiting for a
-- retry. Small by construction, so the per-aggregate order check is a short index probe.
CREATE INDEX "{table}_blockers" ON {t} (aggregate_type, aggregate_id, seq)
    WHERE status IN ('in_flight', 'dead') OR (status = 'pending' AND attempts > 0);
"#,
    },
    Migration {
        version: 2,
        description: "claimed_at, paused destinations, dead-row index",
        sql: r#"
-- When the row was last claimed (microseconds, like every time here): `outbox status` shows
-- which relay holds claims since when. It stays set after the row leaves in_flight; only
-- in_flight rows read it. Adding a nullable column rewrites no row.
ALTER TABLE {t} ADD COLUMN claimed_at INTEGER;

-- Destinations an operator paused (`outbox pause`). Relays read it every poll and claim around
-- the paused destinations' events; the events themselves are not touched.
CREATE TABLE "{table}_paused" (
    destination TEXT    PRIMARY KEY,
    paused_at   INTEGER NOT NULL,
    paused_by   TEXT    NOT NULL
) STRICT;

-- Dead rows in seq order: list_dead, the per-destination dead counts and dead-letter retention
-- read only these. Queries repeat the predicate word for word, as SQLite's planner needs.
CREATE INDEX "{table}_dead" ON {t} (seq) WHERE status = 'dead';
"#,
    },
    Migration {
        version: 3,
        description: "blockers marked by last_error: an outage costs no attempt",
        sql: r#"
-- An outage (the destination unavailable) costs a waiting event no attempt, so `attempts` alone
-- no longer tells whether a pending row has failed and waits for its retry: its `last_error`
-- does (every retry writes it). The blockers are rebuilt with that mark; the claim repeats the
-- predicate word for word, as SQLite's planner needs.
DROP INDEX "{table}_blockers";
CREATE INDEX "{table}_blockers" ON {t} (aggregate_type, aggregate_id, seq)
    WHERE status IN ('in_flight', 'dead') OR (status = 'pending' AND (attempts > 0 OR last_error IS NOT NULL));
"#,
    },
    Migration {
        version: 4,
        description: "rows checked when written: header triggers, a missing id named",
        sql: concat!(
            r#"
-- Rows are checked when they are written, not only when the relay claims them.
--
-- Headers: a JSON object whose values are all strings, with no name under the prefix outbox-
-- (the relay's own message headers; outbox-partition, which the relay stores itself, excepted).
-- Such a row used to insert and was dead-lettered when claimed; now the writer's INSERT fails
-- (SQLITE_CONSTRAINT) with a message naming the rule. Triggers, because a CHECK constraint
-- cannot read json_each. On UPDATE only when `headers` is set: the relay never sets it, so rows
-- written before the triggers existed are claimed, dead-lettered and requeued as before, and
-- nothing needs validating. Writers need SQLite's JSON functions (built in since 3.38).
--
-- `id` keeps no default here: SQLite cannot add one to an existing column, and rebuilding the
-- table for it (copy every retained row under the write lock, then recreate its indexes and
-- its AUTOINCREMENT counter) would stall writers on a large outbox for a convenience a writer
-- has in one call in any language. A missing id is named instead of failing as a bare
-- NOT NULL constraint.
CREATE TRIGGER "{table}_check_insert" BEFORE INSERT ON {t}
BEGIN
    SELECT RAISE(ABORT, 'outbox: id is required: give each event a UUID as lowercase hyphenated text (SQLite has no default for it)')
    WHERE NEW.id IS NULL;
"#,
            header_check_body!(),
            r#"END;

CREATE TRIGGER "{table}_check_headers_update" BEFORE UPDATE OF headers ON {t}
BEGIN
"#,
            header_check_body!(),
            r#"END;
"#
        ),
    },
];

pub(crate) async fn run(
    outbox: &SqliteOutbox,
    pool: &SqlitePool,
) -> Result<MigrationReport, StoreError> {
    let bookkeeping = outbox.migrations_table();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.map_err(map_sqlx)?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sqlite_bookkeeping_ddl(&bookkeeping)))
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?;

    let applied_before: Vec<(i64, String)> =
        outbox_types::applied_migrations!(&mut *tx, bookkeeping, map_sqlx)?;

    let mut applied = Vec::new();
    for m in pending(Schema::OUTBOX, MIGRATIONS, &applied_before)? {
        let insert = format!(
            "INSERT INTO {bookkeeping} (version, description, checksum, applied_at) VALUES (?1, ?2, ?3, ?4)"
        );
        outbox_types::apply_migration!(
            tx,
            outbox.render(m.sql),
            insert,
            m,
            map_sqlx,
            crate::now_micros()
        )?;
        applied.push(m.version);
    }
    tx.commit().await.map_err(map_sqlx)?;
    Ok(outbox_types::migration_report!(
        applied,
        MIGRATIONS,
        table = outbox.table()
    ))
}

/// The schema version the database is at, `0` when the outbox was never migrated there.
pub(crate) async fn current_version(
    outbox: &SqliteOutbox,
    pool: &SqlitePool,
) -> Result<i64, StoreError> {
    let exists =
        sqlx::query_scalar("SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = ?1")
            .bind(format!("{}_migrations", outbox.table()));
    outbox_types::recorded_version!(pool, exists, outbox.migrations_table(), map_sqlx)
}

/// Everything [`run`] applies to a database without this outbox, as one SQL script: the
/// bookkeeping table, each migration as rendered for `outbox`, and the row that records it
/// (with the checksum `run` checks), in one transaction. Applied by another tool, it leaves a
/// database that `run` finds current and the relay accepts.
pub(crate) fn script(outbox: &SqliteOutbox) -> String {
    let bookkeeping = outbox.migrations_table();
    let mut out = format!(
        "-- The outbox {} on SQLite, schema version {}: the DDL `outbox migrate` applies to a\n\
         -- database without it, and the bookkeeping rows that record it applied.\n\
         -- Apply it whole and unedited (`outbox migrate` checks each migration's checksum).\n\
         BEGIN IMMEDIATE;\n\n{}\n",
        outbox.quoted_table(),
        latest_version(MIGRATIONS),
        sqlite_bookkeeping_ddl(&bookkeeping)
    );
    for m in MIGRATIONS {
        out.push_str(&format!(
            "\n-- Migration {}: {}\n{}\nINSERT INTO {bookkeeping} (version, description, checksum, applied_at)\n    VALUES ({}, '{}', '{}', CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER));\n",
            m.version,
            m.description,
            outbox.render(m.sql).trim(),
            m.version,
            m.description.replace('\'', "''"),
            m.checksum()
        ));
    }
    out.push_str("\nCOMMIT;\n");
    out
}

#[cfg(test)]
mod released {
    use super::*;

    outbox_types::released_migrations_test! {
        MIGRATIONS => [
            (1, "cd8d1fbc5520703d"),
            (2, "257f4451e150a7e6"),
            (3, "ee0cfa0b5d09ce96"),
            (4, "ba618018511559ce"),
        ],
    }
}
