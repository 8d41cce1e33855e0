//! The inbox in SQLite.
//!
//! Tables: `<table>` (the inbox, primary key `(event_id, handler)`, `event_id` as lowercase
//! UUID text, `processed_at` as INTEGER microseconds since the epoch like the outbox's SQLite
//! store), `<table>_parked` (poison messages) and `<table>_migrations` (bookkeeping).
//!
//! The claim is `INSERT … ON CONFLICT DO NOTHING`. SQLite has one writer at a time, so a
//! concurrent claim waits (busy timeout) for the first writer's transaction to end and then sees
//! its row or not. Open the transaction with `BEGIN IMMEDIATE` (as [`SqliteInbox::process`] and
//! [`SqliteHandler`] do) or make the claim its first statement: a deferred transaction that
//! reads first cannot later upgrade to a writer while another connection writes, and fails with
//! `SQLITE_BUSY` instead of waiting. SQLite has no stored procedures: consumers in other
//! languages run [`SqliteInbox::claim_statement`], the statement [`SqliteInbox::claim`] runs.
//! Processed-at times (SQLite's `now`) and the purge cut-off come from the host clock (SQLite
//! has no other).

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_types::EventId;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, Sqlite, SqlitePool};

use crate::sql::{self, InboxRow};
use crate::{Error, Migration, MigrationReport};

const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "inbox and parked tables",
    sql: r#"
CREATE TABLE {t} (
    event_id     TEXT    NOT NULL,
    handler      TEXT    NOT NULL,
    -- Microseconds since the Unix epoch.
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (event_id, handler)
) STRICT;
-- Retention deletes the oldest rows in batches.
CREATE INDEX "{table}_processed_at" ON {t} (processed_at);

CREATE TABLE {p} (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id  TEXT,
    handler   TEXT    NOT NULL,
    source    TEXT    NOT NULL,
    attempts  INTEGER NOT NULL,
    error     TEXT    NOT NULL,
    payload   BLOB    NOT NULL,
    -- A JSON object of strings.
    headers   TEXT    NOT NULL,
    parked_at INTEGER NOT NULL
) STRICT;
CREATE INDEX "{table}_parked_event_id" ON {p} (event_id);
"#,
}];

/// The inbox's statements in SQLite (`?n` parameters; times and ages are microseconds since the
/// epoch, the cut-off taken from the host clock). The claim writes `processed_at` by SQLite's
/// clock in microseconds: `unixepoch('subsec')` would need SQLite 3.42; `julianday` works in any
/// version a consumer's driver may bundle.
const SQL: sql::Statements<&str> = sql::Statements {
    claim: "INSERT INTO {t} (event_id, handler, processed_at) \
            VALUES (?1, ?2, CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)) ON CONFLICT DO NOTHING",
    contains: "SELECT 1 FROM {t} WHERE event_id = ?1 AND handler = ?2",
    purge: "DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} \
            WHERE processed_at < ?1 ORDER BY processed_at LIMIT ?2)",
    park: "INSERT INTO {p} (event_id, handler, source, attempts, error, payload, headers, parked_at) \
           VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    parked: "SELECT event_id, source, payload, headers, attempts, error FROM {p} \
             WHERE handler = ?1 ORDER BY id LIMIT ?2",
    schema_version: "SELECT MAX(version) FROM {m}",
    handler_stats: "SELECT handler, COUNT(*), COALESCE(SUM(processed_at < ?1), 0), MIN(processed_at), MAX(processed_at) \
                    FROM {t} GROUP BY handler ORDER BY handler",
    parked_stats: "SELECT handler, COUNT(*), MIN(parked_at) FROM {p} GROUP BY handler ORDER BY handler",
    list_parked: "SELECT event_id, source, payload, headers, attempts, error, id, handler, parked_at FROM {p} \
                  WHERE (?1 IS NULL OR handler = ?1) AND id > ?2 ORDER BY id LIMIT ?3",
    parked_record: "SELECT event_id, source, payload, headers, attempts, error, id, handler, parked_at FROM {p} WHERE id = ?1",
    record_migration: "INSERT INTO {m} (version, description, checksum, applied_at) VALUES (?1, ?2, ?3, ?4)",
};

sql::table_inbox! {
    inbox: SqliteInbox,
    name: "SQLite",
    module: "sqlite",
    whereabouts: "",
    statements: SQL,
    quote: |name| format!("\"{name}\""),
}

impl SqliteInbox {
    /// The claim statement any consumer runs first in its own transaction (SQLite has no stored
    /// procedures): bind the event id (lowercase UUID text) as `?1` and the handler name as
    /// `?2`; one row changed (`changes()`, a driver's rowcount) = first time, apply the effect;
    /// none = already processed (see `docs/inbox.md`). [`claim`](Self::claim) runs exactly
    /// this statement. `processed_at` comes from SQLite's clock, in microseconds.
    ///
    /// ```
    /// let sql = outbox_inbox::sqlite::SqliteInbox::new().claim_statement().to_owned();
    /// assert!(sql.starts_with(r#"INSERT INTO "outbox_inbox" (event_id, handler, processed_at) VALUES (?1, ?2, "#));
    /// assert!(sql.ends_with("ON CONFLICT DO NOTHING"));
    /// ```
    pub fn claim_statement(&self) -> &str {
        &self.inner.sql.claim
    }

    /// Create or upgrade the inbox tables. Idempotent, atomic and serialized: everything runs
    /// in one `BEGIN IMMEDIATE` transaction (SQLite DDL is transactional, and `IMMEDIATE` takes
    /// the write lock first, so two processes migrating together queue instead of racing).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), outbox_inbox::Error> {
    /// let report = outbox_inbox::sqlite::SqliteInbox::new().migrate(&pool).await?;
    /// assert_eq!(report.current, 1);
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self, pool: &SqlitePool) -> Result<MigrationReport, Error> {
        let n = &self.inner;
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let create_table = outbox_types::migration::sqlite_bookkeeping_ddl(&n.migrations);
        let report = self.apply_migrations(&mut tx, create_table).await?;
        tx.commit().await?;
        Ok(report)
    }
}

sql::sql_inbox! {
    inbox: SqliteInbox,
    db: Sqlite,
    name: "SQLite",
    module: "sqlite",
    pool: SqlitePool,
    executor: SqliteExecutor,
    migrations: MIGRATIONS,
    tables: (
        r#"`"table"`"# = r#""outbox_inbox""#,
        r#"`"table_parked"`"# = r#""outbox_inbox_parked""#
    ),
    clock: "host",
    begin: |pool| pool.begin_with("BEGIN IMMEDIATE"),
    // The insert: one row changed = fresh.
    claim: |query, executor| query.execute(executor).await?.rows_affected() == 1,
    example: (
        begin: "pool.begin_with(\"BEGIN IMMEDIATE\")",
        insert: "INSERT INTO invoices (event_id) VALUES (?1)",
        event_id: "to_string()"
    ),
    effect: SqliteEffect,
    handler: SqliteHandler,
}

impl sql::Dialect for SqliteInbox {
    type Db = Sqlite;
    type EventId = String;
    type Age = i64;
    type Batch = i64;
    type Limit = i64;
    type Attempts = i32;

    fn event_id(id: EventId) -> String {
        id.to_string()
    }

    /// The cut-off: now by the host clock, less `older_than`.
    fn age(older_than: Duration) -> i64 {
        let micros = i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX);
        now_micros().saturating_sub(micros)
    }

    fn attempts(attempts: u32) -> i32 {
        i32::try_from(attempts).unwrap_or(i32::MAX)
    }

    /// `parked_at` and `applied_at`: the host's time (SQLite's columns have no default).
    fn bind_now(query: sql::Query<Sqlite>) -> sql::Query<Sqlite> {
        query.bind(now_micros())
    }
}

impl InboxRow for SqliteRow {
    /// An INTEGER microseconds column as a time.
    fn time(&self, index: usize) -> Result<Option<DateTime<Utc>>, Error> {
        Ok(self
            .try_get::<Option<i64>, _>(index)?
            .and_then(DateTime::from_timestamp_micros))
    }
}

/// Microseconds since the Unix epoch, from the host clock.
fn now_micros() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksums recorded by earlier releases still read as current.
    #[test]
    fn a_database_migrated_by_earlier_releases_is_current() {
        crate::tests::assert_current(MIGRATIONS, &[(1, "27bb5650701147f9")]);
    }
}
