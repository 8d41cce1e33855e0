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

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_types::EventId;
use outbox_types::migration::latest_version;
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row, Sqlite, SqliteExecutor, SqlitePool};

use crate::consumer::ParkedMessage;
use crate::names::{check_handler, check_identifier};
use crate::sql::{self, InboxRow, SqlEffect, SqlHandler};
use crate::{
    DEFAULT_TABLE, Error, InboxClaim, InboxStats, Migration, MigrationReport, ParkedQuery,
    ParkedRecord, pending,
};

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

/// Where the SQLite inbox lives, and the SQL to use it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SqliteInbox {
    inner: Arc<Names>,
}

#[derive(Debug)]
struct Names {
    table: String,
    qualified: String,
    parked: String,
    migrations: String,
    claim: String,
    purge: String,
    park: String,
}

impl Default for SqliteInbox {
    fn default() -> Self {
        Self::new()
    }
}

impl SqliteInbox {
    /// The schema version this build migrates to: what `migrate` reports as `current`.
    pub const SCHEMA_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

    /// The inbox in table `outbox_inbox`.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::sqlite::SqliteInbox::new().table(), "outbox_inbox");
    /// ```
    pub fn new() -> Self {
        Self::with_table(DEFAULT_TABLE).unwrap_or_else(|_| unreachable!("default names are valid"))
    }

    /// The inbox in `table` (a plain lowercase identifier).
    ///
    /// ```
    /// use outbox_inbox::sqlite::SqliteInbox;
    /// assert!(SqliteInbox::with_table("billing_inbox").is_ok());
    /// assert!(SqliteInbox::with_table("inbox; drop table x").is_err());
    /// ```
    pub fn with_table(table: &str) -> Result<Self, Error> {
        check_identifier("table", table)?;
        let qualified = format!("\"{table}\"");
        let parked = format!("\"{table}_parked\"");
        let migrations = format!("\"{table}_migrations\"");
        Ok(SqliteInbox {
            inner: Arc::new(Names {
                table: table.to_owned(),
                claim: format!(
                    "INSERT INTO {qualified} (event_id, handler, processed_at) \
                     VALUES (?1, ?2, {NOW_MICROS}) ON CONFLICT DO NOTHING"
                ),
                purge: format!(
                    "DELETE FROM {qualified} WHERE rowid IN (SELECT rowid FROM {qualified} \
                     WHERE processed_at < ?1 ORDER BY processed_at LIMIT ?2)"
                ),
                park: format!(
                    "INSERT INTO {parked} (event_id, handler, source, attempts, error, payload, headers, parked_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
                ),
                qualified,
                parked,
                migrations,
            }),
        })
    }

    /// The inbox table name.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::sqlite::SqliteInbox::new().table(), "outbox_inbox");
    /// ```
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// `"table"`, ready to use in SQL.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::sqlite::SqliteInbox::new().qualified_table(), r#""outbox_inbox""#);
    /// ```
    pub fn qualified_table(&self) -> &str {
        &self.inner.qualified
    }

    /// `"table_parked"`, where poison messages go.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::sqlite::SqliteInbox::new().parked_table(), r#""outbox_inbox_parked""#);
    /// ```
    pub fn parked_table(&self) -> &str {
        &self.inner.parked
    }

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
        &self.inner.claim
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
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {m} (
                 version     INTEGER PRIMARY KEY,
                 description TEXT    NOT NULL,
                 checksum    TEXT    NOT NULL,
                 applied_at  INTEGER NOT NULL
             ) STRICT;",
            m = n.migrations
        )))
        .execute(&mut *tx)
        .await?;
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT version, checksum FROM {} ORDER BY version",
            n.migrations
        )))
        .fetch_all(&mut *tx)
        .await?;
        let before = sql::applied_versions(&rows)?;
        let mut applied = Vec::new();
        for m in pending(MIGRATIONS, &before)? {
            let sql = m
                .sql
                .replace("{t}", &n.qualified)
                .replace("{p}", &n.parked)
                .replace("{table}", &n.table);
            sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await?;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {} (version, description, checksum, applied_at) VALUES (?1, ?2, ?3, ?4)",
                n.migrations
            )))
            .bind(m.version)
            .bind(m.description)
            .bind(m.checksum())
            .bind(now_micros())
            .execute(&mut *tx)
            .await?;
            applied.push(m.version);
        }
        tx.commit().await?;
        Ok(MigrationReport {
            applied,
            current: latest_version(MIGRATIONS),
        })
    }

    /// Record `(event_id, handler)` through `executor` — `&mut *tx` of the transaction that
    /// will also run the effect. [`InboxClaim::Fresh`]: run the effect and commit.
    /// [`InboxClaim::Duplicate`]: the handler already processed this event; skip the effect. Call
    /// it first in the transaction; a concurrent claim of the same key waits here until this
    /// transaction ends.
    ///
    /// ```no_run
    /// use outbox_inbox::{InboxClaim, sqlite::SqliteInbox};
    /// # async fn demo(pool: sqlx::SqlitePool, id: outbox_types::EventId) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    /// if SqliteInbox::new().claim(&mut *tx, id, "billing").await? == InboxClaim::Fresh {
    ///     sqlx::query("INSERT INTO invoices (event_id) VALUES (?1)").bind(id.to_string()).execute(&mut *tx).await?;
    ///     tx.commit().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn claim<'e, E: SqliteExecutor<'e>>(
        &self,
        executor: E,
        event_id: EventId,
        handler: &str,
    ) -> Result<InboxClaim, Error> {
        check_handler(handler)?;
        let done = sqlx::query(AssertSqlSafe(self.inner.claim.as_str()))
            .bind(event_id.to_string())
            .bind(handler)
            .execute(executor)
            .await?;
        Ok(if done.rows_affected() == 1 {
            InboxClaim::Fresh
        } else {
            InboxClaim::Duplicate
        })
    }

    /// Whether `handler` has processed `event_id` (a committed row exists).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool, id: outbox_types::EventId) -> Result<(), outbox_inbox::Error> {
    /// let seen = outbox_inbox::sqlite::SqliteInbox::new().contains(&pool, id, "billing").await?;
    /// # Ok(()) }
    /// ```
    pub async fn contains<'e, E: SqliteExecutor<'e>>(
        &self,
        executor: E,
        event_id: EventId,
        handler: &str,
    ) -> Result<bool, Error> {
        let found: Option<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT 1 FROM {} WHERE event_id = ?1 AND handler = ?2",
            self.inner.qualified
        )))
        .bind(event_id.to_string())
        .bind(handler)
        .fetch_optional(executor)
        .await?;
        Ok(found.is_some())
    }

    /// Delete inbox rows processed more than `older_than` ago (by the host clock), `batch`
    /// rows per statement, until none is left; returns how many were deleted. See the crate docs
    /// for the trade-off: a duplicate older than the window is no longer detected.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), outbox_inbox::Error> {
    /// let week = std::time::Duration::from_secs(7 * 24 * 3600);
    /// let deleted = outbox_inbox::sqlite::SqliteInbox::new().purge(&pool, week, 1000).await?;
    /// # Ok(()) }
    /// ```
    pub async fn purge(
        &self,
        pool: &SqlitePool,
        older_than: Duration,
        batch: u32,
    ) -> Result<u64, Error> {
        let micros = i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX);
        let cutoff = now_micros().saturating_sub(micros);
        sql::purge_in_batches(batch, |batch| async move {
            let done = sqlx::query(AssertSqlSafe(self.inner.purge.as_str()))
                .bind(cutoff)
                .bind(i64::from(batch))
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        })
        .await
    }

    /// Write a poison message to the parked table for `handler`.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), outbox_inbox::Error> {
    /// let msg = outbox_inbox::ParkedMessage::new(None, "orders", b"?".to_vec(), 1, "no event id");
    /// outbox_inbox::sqlite::SqliteInbox::new().park(&pool, "billing", &msg).await?;
    /// # Ok(()) }
    /// ```
    pub async fn park<'e, E: SqliteExecutor<'e>>(
        &self,
        executor: E,
        handler: &str,
        message: &ParkedMessage,
    ) -> Result<(), Error> {
        let headers = serde_json::to_string(&message.headers)
            .map_err(|e| Error::BadMessage(e.to_string()))?;
        sqlx::query(AssertSqlSafe(self.inner.park.as_str()))
            .bind(message.event_id.map(|e| e.to_string()))
            .bind(handler)
            .bind(&message.source)
            .bind(i32::try_from(message.attempts).unwrap_or(i32::MAX))
            .bind(&message.error)
            .bind(&message.payload)
            .bind(headers)
            .bind(now_micros())
            .execute(executor)
            .await?;
        Ok(())
    }

    /// The parked messages of `handler`, oldest first (at most `limit`).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), outbox_inbox::Error> {
    /// for p in outbox_inbox::sqlite::SqliteInbox::new().parked(&pool, "billing", 100).await? {
    ///     println!("{:?}: {}", p.event_id, p.error);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn parked(
        &self,
        pool: &SqlitePool,
        handler: &str,
        limit: u32,
    ) -> Result<Vec<ParkedMessage>, Error> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_id, source, payload, headers, attempts, error FROM {} \
             WHERE handler = ?1 ORDER BY id LIMIT ?2",
            self.inner.parked
        )))
        .bind(handler)
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?;
        rows.iter().map(sql::parked_message).collect()
    }

    /// Rows, age and rows past `retention` per handler, parked messages per handler, and the
    /// schema version: what `outbox inbox status` prints. Counts every row (a scan of the
    /// table): an operator's question, not one for a hot path.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), outbox_inbox::Error> {
    /// let week = std::time::Duration::from_secs(7 * 24 * 3600);
    /// let stats = outbox_inbox::sqlite::SqliteInbox::new().stats(&pool, week).await?;
    /// println!("{} rows, {} parked", stats.rows(), stats.parked_total());
    /// # Ok(()) }
    /// ```
    pub async fn stats(&self, pool: &SqlitePool, retention: Duration) -> Result<InboxStats, Error> {
        let n = &self.inner;
        let micros = i64::try_from(retention.as_micros()).unwrap_or(i64::MAX);
        let cutoff = now_micros().saturating_sub(micros);
        let schema_version: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT MAX(version) FROM {}",
            n.migrations
        )))
        .fetch_one(pool)
        .await?;
        let handler_rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT handler, COUNT(*), COALESCE(SUM(processed_at < ?1), 0), MIN(processed_at), MAX(processed_at) \
             FROM {} GROUP BY handler ORDER BY handler",
            n.qualified
        )))
        .bind(cutoff)
        .fetch_all(pool)
        .await?;
        let parked_rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT handler, COUNT(*), MIN(parked_at) FROM {} GROUP BY handler ORDER BY handler",
            n.parked
        )))
        .fetch_all(pool)
        .await?;
        sql::stats(schema_version, &handler_rows, &parked_rows)
    }

    /// Parked messages of every handler (or one), oldest first, with their row ids.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), outbox_inbox::Error> {
    /// let q = outbox_inbox::ParkedQuery::new().handler("billing").limit(20);
    /// for r in outbox_inbox::sqlite::SqliteInbox::new().list_parked(&pool, &q).await? {
    ///     println!("{} {} {}", r.id, r.handler, r.message.error);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn list_parked(
        &self,
        pool: &SqlitePool,
        query: &ParkedQuery,
    ) -> Result<Vec<ParkedRecord>, Error> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_id, source, payload, headers, attempts, error, id, handler, parked_at FROM {} \
             WHERE (?1 IS NULL OR handler = ?1) AND id > ?2 ORDER BY id LIMIT ?3",
            self.inner.parked
        )))
        .bind(query.handler.as_deref())
        .bind(query.after.unwrap_or(0))
        .bind(query.page())
        .fetch_all(pool)
        .await?;
        rows.iter().map(sql::parked_record).collect()
    }

    /// The parked message with row id `id`, if there is one.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), outbox_inbox::Error> {
    /// if let Some(r) = outbox_inbox::sqlite::SqliteInbox::new().parked_record(&pool, 7).await? {
    ///     println!("{}", String::from_utf8_lossy(&r.message.payload));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn parked_record(
        &self,
        pool: &SqlitePool,
        id: i64,
    ) -> Result<Option<ParkedRecord>, Error> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_id, source, payload, headers, attempts, error, id, handler, parked_at FROM {} WHERE id = ?1",
            self.inner.parked
        )))
        .bind(id)
        .fetch_optional(pool)
        .await?;
        row.as_ref().map(sql::parked_record).transpose()
    }
}

sql::sql_inbox!(SqliteInbox, Sqlite, "sqlite", "SqlitePool", |pool| pool
    .begin_with("BEGIN IMMEDIATE"));

impl InboxRow for SqliteRow {
    /// An INTEGER microseconds column as a time.
    fn time(&self, index: usize) -> Result<Option<DateTime<Utc>>, Error> {
        Ok(self
            .try_get::<Option<i64>, _>(index)?
            .and_then(DateTime::from_timestamp_micros))
    }
}

/// The effect a [`SqliteHandler`] runs inside the inbox transaction.
pub trait SqliteEffect: SqlEffect<Sqlite> {}

impl<F: SqlEffect<Sqlite>> SqliteEffect for F {}

/// An [`InboxHandler`](crate::InboxHandler) over SQLite: claims, runs `effect`, commits; parks
/// into `<table>_parked`. Give it to a broker adapter.
///
/// ```no_run
/// use outbox_inbox::sqlite::{SqliteHandler, SqliteInbox};
/// # fn demo(pool: sqlx::SqlitePool) -> Result<(), outbox_inbox::Error> {
/// let handler = SqliteHandler::new(pool, SqliteInbox::new(), "billing", |tx, delivery| Box::pin(async move {
///     sqlx::query("INSERT INTO invoices (event_id) VALUES (?1)")
///         .bind(delivery.event_id.to_string())
///         .execute(&mut **tx).await?;
///     Ok(())
/// }))?;
/// # Ok(()) }
/// ```
pub type SqliteHandler<F> = SqlHandler<SqliteInbox, F>;

/// Microseconds since the Unix epoch by SQLite's clock, as SQL: what the claim statement writes
/// as `processed_at` (`unixepoch('subsec')` would need SQLite 3.42; this works in any version a
/// consumer's driver may bundle).
const NOW_MICROS: &str = "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)";

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
