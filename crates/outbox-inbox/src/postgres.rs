//! The inbox in PostgreSQL.
//!
//! Tables live in a schema of your choice (default `public`): `<table>` (the inbox, primary key
//! `(event_id, handler, claimed_by)`, the last set to `current_user` by the trigger
//! `<table>_claimed_by`), `<table>_parked` (poison messages), `<table>_migrations`
//! (bookkeeping of the embedded migrations, separate from the application's own) and the
//! function `<table>_claim(event_id uuid, handler text) returns boolean`. The claim is that
//! function — `INSERT … ON CONFLICT DO NOTHING` inside — for Rust and every other language alike,
//! so there is one definition of its semantics; a concurrent claim of the same key waits on the
//! unique index until the first transaction ends, then sees the row (duplicate) or not (fresh).

use std::sync::Arc;
use std::time::Duration;

use outbox_types::EventId;
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Postgres, Row};

use crate::names::check_identifier;
use crate::sql::{self, InboxRow};
use crate::{DEFAULT_TABLE, Error, Migration, MigrationReport};
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
    Migration {
        version: 3,
        description: "claims keyed by the role that wrote them; functions pin search_path",
        sql: r#"
-- Handlers share an inbox table, and any role with INSERT on it could write another handler's
-- row (event_id, 'billing') first: billing's claim then answered "already processed" and its
-- effect never ran. Now each claim row records the role that wrote it, `claimed_by`, set by a
-- trigger to current_user whatever the writer puts there, and the key is (event_id, handler,
-- claimed_by): a row another role writes under your handler's name is a row of its own, and
-- your claim is fresh. A handler is deduplicated per database role: run each handler under one
-- role (docs/inbox.md, "Privileges").
--
-- Rows written before this migration have no writer: they get claimed_by '' and count for
-- every role (the trigger files a new claim of such an event and handler under '', which then
-- conflicts), so nothing processed before the upgrade is processed again; they go with
-- retention like any row. Rebuilding the primary key reads the table once under a lock that
-- holds consumers back meanwhile.
ALTER TABLE {t} ADD COLUMN claimed_by TEXT NOT NULL DEFAULT '';
ALTER TABLE {t} DROP CONSTRAINT "{table}_pkey", ADD PRIMARY KEY (event_id, handler, claimed_by);

-- Whether `handler` claimed `event_id` before claims recorded their writer. It runs as its
-- owner, so the trigger (which runs as the consumer) can ask without the consumer holding
-- SELECT on the inbox; it answers nothing about rows written since.
CREATE OR REPLACE FUNCTION {claimed_before}(event_id UUID, handler TEXT) RETURNS BOOLEAN
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $before$
    SELECT EXISTS (
        SELECT 1 FROM {t} i
        WHERE i.event_id = $1 AND i.handler = $2 AND i.claimed_by = ''
    )
$before$;

CREATE OR REPLACE FUNCTION {claimed_by}() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $by$
BEGIN
    IF {claimed_before}(NEW.event_id, NEW.handler) THEN
        NEW.claimed_by := '';
    ELSE
        NEW.claimed_by := current_user;
    END IF;
    RETURN NEW;
END
$by$;
DROP TRIGGER IF EXISTS "{table}_claimed_by" ON {t};
CREATE TRIGGER "{table}_claimed_by" BEFORE INSERT ON {t}
    FOR EACH ROW EXECUTE FUNCTION {claimed_by}();

-- The claim function again, with its search_path pinned (a function it calls can no longer be
-- one a consumer, or anyone with CREATE on a schema in the caller's search_path, planted).
CREATE OR REPLACE FUNCTION {f}(event_id UUID, handler TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $claim$
BEGIN
    IF $1 IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004',
            MESSAGE = '{f}: event_id is null',
            HINT = 'pass the message''s outbox-event-id header; a message without one cannot be deduplicated: park it';
    END IF;
    IF $2 IS NULL OR pg_catalog.char_length($2) NOT BETWEEN 1 AND 191 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('{f}: handler must be 1 to 191 characters, got %s', coalesce(pg_catalog.char_length($2)::text, 'null')),
            HINT = 'name the consuming handler, e.g. ''billing''';
    END IF;
    INSERT INTO {t} (event_id, handler) VALUES ($1, $2) ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$claim$;
"#,
    },
];

/// The inbox's statements in PostgreSQL (`$n` parameters; ages are microseconds before `now()`).
const SQL: sql::Statements<&str> = sql::Statements {
    claim: "SELECT {f}($1, $2)",
    contains: "SELECT 1 FROM {t} WHERE event_id = $1 AND handler = $2 AND claimed_by IN (current_user, '')",
    purge: "DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} \
            WHERE processed_at < now() - $1 * interval '1 microsecond' \
            ORDER BY processed_at LIMIT $2))",
    park: "INSERT INTO {p} (event_id, handler, source, attempts, error, payload, headers) \
           VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)",
    parked: "SELECT event_id, source, payload, headers::text, attempts, error FROM {p} \
             WHERE handler = $1 ORDER BY id LIMIT $2",
    schema_version: "SELECT max(version) FROM {m}",
    handler_stats: "SELECT handler, count(*), count(*) FILTER (WHERE processed_at < now() - $1 * interval '1 microsecond'), \
                    min(processed_at), max(processed_at) FROM {t} GROUP BY handler ORDER BY handler",
    parked_stats: "SELECT handler, count(*), min(parked_at) FROM {p} GROUP BY handler ORDER BY handler",
    list_parked: "SELECT event_id, source, payload, headers::text, attempts, error, id, handler, parked_at \
                  FROM {p} WHERE ($1::text IS NULL OR handler = $1) AND id > $2 ORDER BY id LIMIT $3",
    parked_record: "SELECT event_id, source, payload, headers::text, attempts, error, id, handler, parked_at \
                    FROM {p} WHERE id = $1",
    record_migration: "INSERT INTO {m} (version, description, checksum) VALUES ($1, $2, $3)",
};

/// Where the PostgreSQL inbox lives, and the SQL to use it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct PgInbox {
    schema: Arc<str>,
    inner: Arc<sql::Names>,
}

impl PgInbox {
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
        let quote = |name: &str| format!("\"{schema}\".\"{name}\"");
        Ok(PgInbox {
            schema: schema.into(),
            inner: sql::Names::checked(table, quote, &SQL)?,
        })
    }

    /// The schema name.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::postgres::PgInbox::new().schema(), "public");
    /// ```
    pub fn schema(&self) -> &str {
        &self.schema
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
        &self.inner.routine
    }

    /// Create or upgrade the inbox tables. Idempotent, atomic (PostgreSQL DDL is
    /// transactional) and serialized across processes by a transaction-scoped advisory lock.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// let report = outbox_inbox::postgres::PgInbox::new().migrate(&pool).await?;
    /// assert_eq!(report.current, 3);
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self, pool: &PgPool) -> Result<MigrationReport, Error> {
        let n = &self.inner;
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(fnv1a(&format!("outbox-inbox:migrate:{}", n.qualified)) as i64)
            .execute(&mut *tx)
            .await?;
        let create_table =
            outbox_types::migration::postgres_bookkeeping_ddl(&self.schema, &n.migrations);
        let report = self.apply_migrations(&mut tx, create_table).await?;
        tx.commit().await?;
        Ok(report)
    }
}

sql::sql_inbox! {
    inbox: PgInbox,
    db: Postgres,
    name: "PostgreSQL",
    module: "postgres",
    pool: PgPool,
    executor: PgExecutor,
    migrations: MIGRATIONS,
    tables: (
        r#"`"schema"."table"`"# = r#""public"."outbox_inbox""#,
        r#"`"schema"."table_parked"`"# = r#""public"."outbox_inbox_parked""#
    ),
    clock: "database",
    begin: |pool| pool.begin(),
    // The function's boolean.
    claim: |query, executor| query.fetch_one(executor).await?.try_get::<bool, _>(0)?,
    example: (
        begin: "pool.begin()",
        insert: "INSERT INTO invoices (event_id) VALUES ($1)",
        event_id: "as_uuid()"
    ),
    effect: PgEffect,
    handler: PgHandler,
}

impl sql::Dialect for PgInbox {
    type Db = Postgres;
    type EventId = uuid::Uuid;
    type Age = i64;
    type Batch = i64;
    type Limit = i64;
    type Attempts = i32;

    fn event_id(id: EventId) -> uuid::Uuid {
        *id.as_uuid()
    }

    fn age(older_than: Duration) -> i64 {
        i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX)
    }

    fn attempts(attempts: u32) -> i32 {
        i32::try_from(attempts).unwrap_or(i32::MAX)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksums recorded by earlier releases still read as current.
    #[test]
    fn a_database_migrated_by_earlier_releases_is_current() {
        crate::tests::assert_current(
            MIGRATIONS,
            &[
                (1, "565c31f1a5e8b62c"),
                (2, "8de3191b24ffdf2c"),
                (3, "b0b7c89c5b1774a6"),
            ],
        );
    }
}
