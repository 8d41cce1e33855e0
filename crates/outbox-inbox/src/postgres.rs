//! The inbox in PostgreSQL.
//!
//! Tables live in a schema of your choice (default `public`): `<table>` (the inbox, primary key
//! `(event_id, handler)`), `<table>_parked` (poison messages), `<table>_migrations`
//! (bookkeeping of the embedded migrations, separate from the application's own) and the
//! function `<table>_claim(event_id uuid, handler text) returns boolean`. The claim is that
//! function — `INSERT … ON CONFLICT DO NOTHING` inside — for Rust and every other language alike,
//! so there is one definition of its semantics; a concurrent claim of the same key waits on the
//! unique index until the first transaction ends, then sees the row (duplicate) or not (fresh).

use std::sync::Arc;
use std::time::Duration;

use outbox_types::EventId;
use outbox_types::migration::latest_version;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgExecutor, PgPool, Postgres, Row};

use crate::consumer::ParkedMessage;
use crate::names::{check_handler, check_identifier};
use crate::sql::{self, InboxRow, SqlEffect, SqlHandler};
use crate::{
    DEFAULT_TABLE, Error, InboxClaim, InboxStats, Migration, MigrationReport, ParkedQuery,
    ParkedRecord, pending,
};
use outbox_types::sql_store::fnv1a;

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "inbox and parked tables",
        sql: r#"
CREATE TABLE {t} (
    event_id     UUID        NOT NULL,
    handler      TEXT        NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, handler)
);
-- Retention deletes the oldest rows in batches.
CREATE INDEX {table}_processed_at ON {t} (processed_at);

CREATE TABLE {p} (
    id        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id  UUID,
    handler   TEXT        NOT NULL,
    source    TEXT        NOT NULL,
    attempts  INTEGER     NOT NULL,
    error     TEXT        NOT NULL,
    payload   BYTEA       NOT NULL,
    headers   JSONB       NOT NULL DEFAULT '{}',
    parked_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX {table}_parked_event_id ON {p} (event_id);
"#,
    },
    Migration {
        version: 2,
        description: "claim function for consumers in any language",
        sql: r#"
-- The claim as a function any consumer calls inside its own transaction, before its effect:
-- true = first time (apply the effect, then commit), false = already processed (skip, ack).
-- The Rust claim calls it too, so there is one definition of the semantics. A concurrent call
-- for the same key waits on the unique index until the first transaction ends, then returns
-- false (it committed) or true (it rolled back). Not SECURITY DEFINER: the caller needs
-- INSERT on the inbox table, as with a plain insert.
CREATE OR REPLACE FUNCTION {f}(event_id UUID, handler TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql VOLATILE
AS $claim$
BEGIN
    IF $1 IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004',
            MESSAGE = '{f}: event_id is null',
            HINT = 'pass the message''s outbox-event-id header; a message without one cannot be deduplicated: park it';
    END IF;
    IF $2 IS NULL OR char_length($2) NOT BETWEEN 1 AND 191 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('{f}: handler must be 1 to 191 characters, got %s', coalesce(char_length($2)::text, 'null')),
            HINT = 'name the consuming handler, e.g. ''billing''';
    END IF;
    INSERT INTO {t} (event_id, handler) VALUES ($1, $2) ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$claim$;
COMMENT ON FUNCTION {f}(UUID, TEXT) IS
    'outbox inbox claim: call it first in the transaction of the effect; true = apply the effect and commit, false = already processed: skip and ack. Contract: docs/inbox.md of the outbox project.';
"#,
    },
];

/// Where the PostgreSQL inbox lives, and the SQL to use it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct PgInbox {
    inner: Arc<Names>,
}

#[derive(Debug)]
struct Names {
    schema: String,
    table: String,
    qualified: String,
    parked: String,
    migrations: String,
    claim_function: String,
    claim: String,
    purge: String,
    park: String,
}

impl Default for PgInbox {
    fn default() -> Self {
        Self::new()
    }
}

impl PgInbox {
    /// The schema version this build migrates to: what `migrate` reports as `current`.
    pub const SCHEMA_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

    /// The inbox in `public.outbox_inbox`.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::postgres::PgInbox::new().table(), "outbox_inbox");
    /// ```
    pub fn new() -> Self {
        Self::with_names("public", DEFAULT_TABLE)
            .unwrap_or_else(|_| unreachable!("default names are valid"))
    }

    /// The inbox in `schema.table`; both must be plain lowercase identifiers.
    ///
    /// ```
    /// use outbox_inbox::postgres::PgInbox;
    /// assert!(PgInbox::with_names("billing", "inbox").is_ok());
    /// assert!(PgInbox::with_names("billing", "inbox; drop table x").is_err());
    /// ```
    pub fn with_names(schema: &str, table: &str) -> Result<Self, Error> {
        check_identifier("schema", schema)?;
        check_identifier("table", table)?;
        let qualified = format!("\"{schema}\".\"{table}\"");
        let parked = format!("\"{schema}\".\"{table}_parked\"");
        let migrations = format!("\"{schema}\".\"{table}_migrations\"");
        let claim_function = format!("\"{schema}\".\"{table}_claim\"");
        Ok(PgInbox {
            inner: Arc::new(Names {
                schema: schema.to_owned(),
                table: table.to_owned(),
                claim: format!("SELECT {claim_function}($1, $2)"),
                claim_function,
                purge: format!(
                    "DELETE FROM {qualified} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {qualified} \
                     WHERE processed_at < now() - $1 * interval '1 microsecond' \
                     ORDER BY processed_at LIMIT $2))"
                ),
                park: format!(
                    "INSERT INTO {parked} (event_id, handler, source, attempts, error, payload, headers) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)"
                ),
                qualified,
                parked,
                migrations,
            }),
        })
    }

    /// The schema name.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::postgres::PgInbox::new().schema(), "public");
    /// ```
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// The inbox table name.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::postgres::PgInbox::new().table(), "outbox_inbox");
    /// ```
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// `"schema"."table"`, ready to use in SQL.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::postgres::PgInbox::new().qualified_table(), r#""public"."outbox_inbox""#);
    /// ```
    pub fn qualified_table(&self) -> &str {
        &self.inner.qualified
    }

    /// `"schema"."table_parked"`, where poison messages go.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::postgres::PgInbox::new().parked_table(), r#""public"."outbox_inbox_parked""#);
    /// ```
    pub fn parked_table(&self) -> &str {
        &self.inner.parked
    }

    /// `"schema"."table_claim"`: the SQL function any consumer calls inside its own transaction,
    /// `SELECT "public"."outbox_inbox_claim"($1, $2)` with the event id (UUID) and the handler
    /// name; `true` = first time, apply the effect; `false` = already processed (see
    /// `docs/inbox.md`). [`claim`](Self::claim) calls it too.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::postgres::PgInbox::new().claim_function(), r#""public"."outbox_inbox_claim""#);
    /// ```
    pub fn claim_function(&self) -> &str {
        &self.inner.claim_function
    }

    /// Create or upgrade the inbox tables. Idempotent, atomic (PostgreSQL DDL is
    /// transactional) and serialized across processes by a transaction-scoped advisory lock.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// let report = outbox_inbox::postgres::PgInbox::new().migrate(&pool).await?;
    /// assert_eq!(report.current, 2);
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self, pool: &PgPool) -> Result<MigrationReport, Error> {
        let n = &self.inner;
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(fnv1a(&format!("outbox-inbox:migrate:{}", n.qualified)) as i64)
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
             CREATE TABLE IF NOT EXISTS {m} (
                 version     BIGINT PRIMARY KEY,
                 description TEXT NOT NULL,
                 checksum    TEXT NOT NULL,
                 applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
             );",
            schema = n.schema,
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
                .replace("{f}", &n.claim_function)
                .replace("{table}", &n.table);
            sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await?;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {} (version, description, checksum) VALUES ($1, $2, $3)",
                n.migrations
            )))
            .bind(m.version)
            .bind(m.description)
            .bind(m.checksum())
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
    /// use outbox_inbox::{InboxClaim, postgres::PgInbox};
    /// # async fn demo(pool: sqlx::PgPool, id: outbox_types::EventId) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// if PgInbox::new().claim(&mut *tx, id, "billing").await? == InboxClaim::Fresh {
    ///     sqlx::query("INSERT INTO invoices (event_id) VALUES ($1)").bind(id.as_uuid()).execute(&mut *tx).await?;
    ///     tx.commit().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn claim<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        event_id: EventId,
        handler: &str,
    ) -> Result<InboxClaim, Error> {
        check_handler(handler)?;
        let fresh: bool = sqlx::query_scalar(AssertSqlSafe(self.inner.claim.as_str()))
            .bind(event_id.as_uuid())
            .bind(handler)
            .fetch_one(executor)
            .await?;
        Ok(if fresh {
            InboxClaim::Fresh
        } else {
            InboxClaim::Duplicate
        })
    }

    /// Whether `handler` has processed `event_id` (a committed row exists).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool, id: outbox_types::EventId) -> Result<(), outbox_inbox::Error> {
    /// let seen = outbox_inbox::postgres::PgInbox::new().contains(&pool, id, "billing").await?;
    /// # Ok(()) }
    /// ```
    pub async fn contains<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        event_id: EventId,
        handler: &str,
    ) -> Result<bool, Error> {
        let found: Option<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT 1 FROM {} WHERE event_id = $1 AND handler = $2",
            self.inner.qualified
        )))
        .bind(event_id.as_uuid())
        .bind(handler)
        .fetch_optional(executor)
        .await?;
        Ok(found.is_some())
    }

    /// Delete inbox rows processed more than `older_than` ago (by the database clock), `batch`
    /// rows per statement, until none is left; returns how many were deleted. See the crate docs
    /// for the trade-off: a duplicate older than the window is no longer detected.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// let week = std::time::Duration::from_secs(7 * 24 * 3600);
    /// let deleted = outbox_inbox::postgres::PgInbox::new().purge(&pool, week, 1000).await?;
    /// # Ok(()) }
    /// ```
    pub async fn purge(
        &self,
        pool: &PgPool,
        older_than: Duration,
        batch: u32,
    ) -> Result<u64, Error> {
        let micros = i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX);
        sql::purge_in_batches(batch, |batch| async move {
            let done = sqlx::query(AssertSqlSafe(self.inner.purge.as_str()))
                .bind(micros)
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
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// let msg = outbox_inbox::ParkedMessage::new(None, "orders", b"?".to_vec(), 1, "no event id");
    /// outbox_inbox::postgres::PgInbox::new().park(&pool, "billing", &msg).await?;
    /// # Ok(()) }
    /// ```
    pub async fn park<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        handler: &str,
        message: &ParkedMessage,
    ) -> Result<(), Error> {
        let headers = serde_json::to_string(&message.headers)
            .map_err(|e| Error::BadMessage(e.to_string()))?;
        sqlx::query(AssertSqlSafe(self.inner.park.as_str()))
            .bind(message.event_id.map(|e| *e.as_uuid()))
            .bind(handler)
            .bind(&message.source)
            .bind(i32::try_from(message.attempts).unwrap_or(i32::MAX))
            .bind(&message.error)
            .bind(&message.payload)
            .bind(headers)
            .execute(executor)
            .await?;
        Ok(())
    }

    /// The parked messages of `handler`, oldest first (at most `limit`).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// for p in outbox_inbox::postgres::PgInbox::new().parked(&pool, "billing", 100).await? {
    ///     println!("{:?}: {}", p.event_id, p.error);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn parked(
        &self,
        pool: &PgPool,
        handler: &str,
        limit: u32,
    ) -> Result<Vec<ParkedMessage>, Error> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_id, source, payload, headers::text, attempts, error FROM {} \
             WHERE handler = $1 ORDER BY id LIMIT $2",
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
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// let week = std::time::Duration::from_secs(7 * 24 * 3600);
    /// let stats = outbox_inbox::postgres::PgInbox::new().stats(&pool, week).await?;
    /// println!("{} rows, {} parked", stats.rows(), stats.parked_total());
    /// # Ok(()) }
    /// ```
    pub async fn stats(&self, pool: &PgPool, retention: Duration) -> Result<InboxStats, Error> {
        let n = &self.inner;
        let micros = i64::try_from(retention.as_micros()).unwrap_or(i64::MAX);
        let schema_version: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT max(version) FROM {}",
            n.migrations
        )))
        .fetch_one(pool)
        .await?;
        let handler_rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT handler, count(*), count(*) FILTER (WHERE processed_at < now() - $1 * interval '1 microsecond'), \
             min(processed_at), max(processed_at) FROM {} GROUP BY handler ORDER BY handler",
            n.qualified
        )))
        .bind(micros)
        .fetch_all(pool)
        .await?;
        let parked_rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT handler, count(*), min(parked_at) FROM {} GROUP BY handler ORDER BY handler",
            n.parked
        )))
        .fetch_all(pool)
        .await?;
        sql::stats(schema_version, &handler_rows, &parked_rows)
    }

    /// Parked messages of every handler (or one), oldest first, with their row ids.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// let q = outbox_inbox::ParkedQuery::new().handler("billing").limit(20);
    /// for r in outbox_inbox::postgres::PgInbox::new().list_parked(&pool, &q).await? {
    ///     println!("{} {} {}", r.id, r.handler, r.message.error);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn list_parked(
        &self,
        pool: &PgPool,
        query: &ParkedQuery,
    ) -> Result<Vec<ParkedRecord>, Error> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_id, source, payload, headers::text, attempts, error, id, handler, parked_at \
             FROM {} WHERE ($1::text IS NULL OR handler = $1) AND id > $2 ORDER BY id LIMIT $3",
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
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// if let Some(r) = outbox_inbox::postgres::PgInbox::new().parked_record(&pool, 7).await? {
    ///     println!("{}", String::from_utf8_lossy(&r.message.payload));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn parked_record(
        &self,
        pool: &PgPool,
        id: i64,
    ) -> Result<Option<ParkedRecord>, Error> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_id, source, payload, headers::text, attempts, error, id, handler, parked_at \
             FROM {} WHERE id = $1",
            self.inner.parked
        )))
        .bind(id)
        .fetch_optional(pool)
        .await?;
        row.as_ref().map(sql::parked_record).transpose()
    }
}

sql::sql_inbox!(PgInbox, Postgres, "postgres", "PgPool", |pool| pool.begin());

impl InboxRow for PgRow {
    fn event_id(&self, index: usize) -> Result<Option<EventId>, Error> {
        Ok(self
            .try_get::<Option<uuid::Uuid>, _>(index)?
            .map(EventId::from_uuid))
    }

    fn time(&self, index: usize) -> Result<Option<chrono::DateTime<chrono::Utc>>, Error> {
        Ok(self.try_get(index)?)
    }
}

/// The effect a [`PgHandler`] runs inside the inbox transaction.
pub trait PgEffect: SqlEffect<Postgres> {}

impl<F: SqlEffect<Postgres>> PgEffect for F {}

/// An [`InboxHandler`](crate::InboxHandler) over PostgreSQL: claims, runs `effect`, commits; parks
/// into `<table>_parked`. Give it to a broker adapter.
///
/// ```no_run
/// use outbox_inbox::postgres::{PgHandler, PgInbox};
/// # fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
/// let handler = PgHandler::new(pool, PgInbox::new(), "billing", |tx, delivery| Box::pin(async move {
///     sqlx::query("INSERT INTO invoices (event_id) VALUES ($1)")
///         .bind(delivery.event_id.as_uuid())
///         .execute(&mut **tx).await?;
///     Ok(())
/// }))?;
/// # Ok(()) }
/// ```
pub type PgHandler<F> = SqlHandler<PgInbox, F>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksums recorded by earlier releases still read as current.
    #[test]
    fn a_database_migrated_by_earlier_releases_is_current() {
        crate::tests::assert_current(
            MIGRATIONS,
            &[(1, "565c31f1a5e8b62c"), (2, "8de3191b24ffdf2c")],
        );
    }
}
