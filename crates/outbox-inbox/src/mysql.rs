//! The inbox in MySQL 8 / MariaDB 10.6+ (InnoDB).
//!
//! Tables live in the connection's database: `<table>` (the inbox, primary key
//! `(event_id, handler, claimed_by)`, `event_id` as the UUID's 36-character lowercase text,
//! `claimed_by` the writing user set by the trigger `<table>_claimed_by`), `<table>_parked`
//! (poison messages), `<table>_migrations` (bookkeeping of the embedded migrations, separate from
//! the application's own) and the procedure `<table>_claim(event_id, handler)`, which every
//! consumer — Rust's [`MySqlInbox::claim`] and any other language — calls. Inside it the claim
//! is `INSERT IGNORE` checking `ROW_COUNT()` (not `ON DUPLICATE KEY UPDATE`: with
//! `CLIENT_FOUND_ROWS`, which sqlx sets, that reports 1 for a duplicate too). Event id and
//! handler name are checked before the insert, so `IGNORE` cannot hide a truncation. A concurrent claim of the same key waits on InnoDB's lock on the uncommitted key
//! until the first transaction ends, then sees the row (duplicate) or not (fresh).
//!
//! MySQL DDL is not transactional, so migrations are serialized with `GET_LOCK` on one
//! connection and every statement is written to be re-runnable (`IF NOT EXISTS`): a migration
//! interrupted half way is finished by the next `migrate`.

use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_types::EventId;
use sqlx::mysql::MySqlRow;
use sqlx::{MySql, MySqlPool, Row};

use crate::sql::{self, InboxRow};
use crate::{Error, Migration, MigrationReport};
use outbox_types::sql_store::fnv1a;

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "inbox and parked tables",
        sql: r#"
CREATE TABLE IF NOT EXISTS {t} (
    event_id     CHAR(36)     CHARACTER SET ascii NOT NULL,
    handler      VARCHAR(191) NOT NULL,
    -- UTC: sqlx sets the session time zone to +00:00.
    processed_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (event_id, handler),
    -- Retention deletes the oldest rows in batches.
    KEY {table}_processed_at (processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS {p} (
    id        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id  CHAR(36)     CHARACTER SET ascii NULL,
    handler   VARCHAR(191) NOT NULL,
    source    TEXT         NOT NULL,
    attempts  INT          NOT NULL,
    error     TEXT         NOT NULL,
    payload   LONGBLOB     NOT NULL,
    -- A JSON object of strings.
    headers   LONGTEXT     NOT NULL,
    parked_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    KEY {table}_parked_event_id (event_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
"#,
    },
    Migration {
        version: 2,
        description: "claim procedure for consumers in any language",
        sql: r#"
-- The claim as a procedure any consumer calls inside its own transaction, before its effect:
-- `CALL <table>_claim(event_id, handler)` returns one row with one column, `fresh`: 1 = first
-- time (apply the effect, then commit), 0 = already processed (skip, ack). The Rust claim
-- calls it too, so there is one definition of the semantics. A concurrent call for the same
-- key waits on InnoDB's lock on the uncommitted key until the first transaction ends, then
-- returns 0 (it committed) or 1 (it rolled back). A procedure, not a function: creating a
-- function that writes needs log_bin_trust_function_creators on servers with a binary log.
-- SQL SECURITY INVOKER: the caller needs INSERT on the inbox table (and EXECUTE), as with a
-- plain insert. Drop + create keeps the migration re-runnable on MySQL 8 and MariaDB alike.
DROP PROCEDURE IF EXISTS {f};
DELIMITER //
CREATE PROCEDURE {f}(IN p_event_id VARCHAR(64), IN p_handler VARCHAR(1000))
    MODIFIES SQL DATA
    SQL SECURITY INVOKER
    COMMENT 'outbox inbox claim: call it first in the transaction of the effect; fresh = 1: apply the effect and commit, 0: already processed, skip and ack'
BEGIN
    IF p_event_id IS NULL
        OR LOWER(p_event_id) NOT REGEXP '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT =
            '{table}_claim: event_id must be the UUID of the outbox-event-id header; a message without one cannot be deduplicated: park it';
    END IF;
    IF p_handler IS NULL OR CHAR_LENGTH(p_handler) NOT BETWEEN 1 AND 191 THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT =
            '{table}_claim: handler must be 1 to 191 characters: name the consuming handler, e.g. billing';
    END IF;
    INSERT IGNORE INTO {t} (event_id, handler) VALUES (LOWER(p_event_id), p_handler);
    SELECT ROW_COUNT() = 1 AS fresh;
END //
DELIMITER ;
"#,
    },
    Migration {
        version: 3,
        description: "claims keyed by the account that wrote them",
        sql: r#"
-- Handlers share an inbox table, and any account with INSERT on it could write another
-- handler's row (event_id, 'billing') first: billing's claim then answered "already processed"
-- and its effect never ran. Now each claim row records the user that wrote it, `claimed_by`
-- (the user name of USER(), the login; the procedure's caller when it writes), set by a
-- trigger whatever the writer puts there, and the key is (event_id, handler, claimed_by): a row
-- another user writes under your handler's name is a row of its own, and your claim is fresh.
-- A handler is deduplicated per database user: run each handler under one user
-- (docs/inbox.md, "Privileges").
--
-- Rows written before this migration have no writer: they get claimed_by '' and count for every
-- user (the trigger files a new claim of such an event and handler under '', which then
-- conflicts), so nothing processed before the upgrade is processed again; they go with
-- retention like any row. The primary key is rebuilt once (InnoDB copies the table, holding
-- consumers back meanwhile), by a procedure of the migration's own so that a second run, after
-- an interruption, skips it.
DROP PROCEDURE IF EXISTS `{table}_add_claimed_by`;
DELIMITER //
CREATE PROCEDURE `{table}_add_claimed_by`()
BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.COLUMNS
                   WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{table}'
                     AND COLUMN_NAME = 'claimed_by') THEN
        ALTER TABLE {t}
            ADD COLUMN claimed_by VARCHAR(128) NOT NULL DEFAULT '',
            DROP PRIMARY KEY,
            ADD PRIMARY KEY (event_id, handler, claimed_by);
    END IF;
END //
DELIMITER ;
CALL `{table}_add_claimed_by`();
DROP PROCEDURE `{table}_add_claimed_by`;

-- A trigger runs as its definer, so it reads the pre-upgrade claims whatever the writer may
-- read; USER() is the session's own user whatever routine is running.
DROP TRIGGER IF EXISTS {claimed_by};
DELIMITER //
CREATE TRIGGER {claimed_by} BEFORE INSERT ON {t} FOR EACH ROW
BEGIN
    IF EXISTS (SELECT 1 FROM {t} AS i
               WHERE i.event_id = NEW.event_id AND i.handler = NEW.handler AND i.claimed_by = '') THEN
        SET NEW.claimed_by = '';
    ELSE
        SET NEW.claimed_by = SUBSTRING_INDEX(USER(), '@', 1);
    END IF;
END //
DELIMITER ;
"#,
    },
];

/// The inbox's statements in MySQL (`?` parameters; ages are microseconds before `NOW(6)`).
const SQL: sql::Statements<&str> = sql::Statements {
    claim: "CALL {f}(?, ?)",
    contains: "SELECT 1 FROM {t} WHERE event_id = ? AND handler = ? \
               AND claimed_by IN (SUBSTRING_INDEX(USER(), '@', 1), '')",
    purge: "DELETE FROM {t} WHERE processed_at < NOW(6) - INTERVAL ? MICROSECOND \
            ORDER BY processed_at LIMIT ?",
    park: "INSERT INTO {p} (event_id, handler, source, attempts, error, payload, headers) \
           VALUES (?, ?, ?, ?, ?, ?, ?)",
    parked: "SELECT event_id, source, payload, headers, attempts, error FROM {p} \
             WHERE handler = ? ORDER BY id LIMIT ?",
    schema_version: "SELECT CAST(MAX(version) AS SIGNED) FROM {m}",
    handler_stats: "SELECT handler, CAST(COUNT(*) AS SIGNED), \
                    CAST(COALESCE(SUM(processed_at < NOW(6) - INTERVAL ? MICROSECOND), 0) AS SIGNED), \
                    MIN(processed_at), MAX(processed_at) FROM {t} GROUP BY handler ORDER BY handler",
    parked_stats: "SELECT handler, CAST(COUNT(*) AS SIGNED), MIN(parked_at) FROM {p} GROUP BY handler ORDER BY handler",
    list_parked: "SELECT event_id, source, payload, headers, attempts, error, id, handler, parked_at FROM {p} \
                  WHERE (? IS NULL OR handler = ?) AND id > ? ORDER BY id LIMIT ?",
    parked_record: "SELECT event_id, source, payload, headers, attempts, error, id, handler, parked_at FROM {p} WHERE id = ?",
    record_migration: "INSERT INTO {m} (version, description, checksum) VALUES (?, ?, ?)",
};

sql::table_inbox! {
    inbox: MySqlInbox,
    name: "MySQL",
    module: "mysql",
    whereabouts: " of the connection's database",
    statements: SQL,
    quote: |name| format!("`{name}`"),
}

impl MySqlInbox {
    /// `` `table_claim` ``: the stored procedure any consumer calls inside its own transaction,
    /// ``CALL `outbox_inbox_claim`(?, ?)`` with the event id (UUID text) and the handler name; it
    /// returns one row, `fresh`: 1 = first time, apply the effect; 0 = already processed (see
    /// `docs/inbox.md`). [`claim`](Self::claim) calls it too.
    ///
    /// ```
    /// assert_eq!(outbox_inbox::mysql::MySqlInbox::new().claim_procedure(), "`outbox_inbox_claim`");
    /// ```
    pub fn claim_procedure(&self) -> &str {
        &self.inner.routine
    }

    /// Create or upgrade the inbox tables. Idempotent and serialized across processes with
    /// `GET_LOCK`; every statement is re-runnable, so an interrupted migration is completed by
    /// the next call (MySQL DDL commits implicitly and cannot be rolled back).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::MySqlPool) -> Result<(), outbox_inbox::Error> {
    /// let report = outbox_inbox::mysql::MySqlInbox::new().migrate(&pool).await?;
    /// assert_eq!(report.current, 3);
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self, pool: &MySqlPool) -> Result<MigrationReport, Error> {
        let mut conn = pool.acquire().await?;
        let lock = format!("outbox-inbox:{:016x}", fnv1a(&self.inner.table));
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await?;
        if got != Some(1) {
            return Err(Error::Database(sqlx::Error::PoolTimedOut));
        }
        let create_table = format!(
            "CREATE TABLE IF NOT EXISTS {m} (
                 version     BIGINT       NOT NULL PRIMARY KEY,
                 description VARCHAR(255) NOT NULL,
                 checksum    VARCHAR(32)  NOT NULL,
                 applied_at  DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
             ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
            m = self.inner.migrations
        );
        let result = self.apply_migrations(&mut conn, create_table).await;
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        let report = result?;
        released?;
        Ok(report)
    }
}

sql::sql_inbox! {
    inbox: MySqlInbox,
    db: MySql,
    name: "MySQL",
    module: "mysql",
    pool: MySqlPool,
    executor: MySqlExecutor,
    migrations: MIGRATIONS,
    tables: (
        "`` `table` ``" = "`outbox_inbox`",
        "`` `table_parked` ``" = "`outbox_inbox_parked`"
    ),
    clock: "database",
    begin: |pool| pool.begin(),
    // The procedure's one row: `fresh` = 1 or 0.
    claim: |query, executor| query.fetch_one(executor).await?.try_get::<i64, _>(0)? == 1,
    example: (
        begin: "pool.begin()",
        insert: "INSERT INTO invoices (event_id) VALUES (?)",
        event_id: "to_string()"
    ),
    effect: MySqlEffect,
    handler: MySqlHandler,
}

impl sql::Dialect for MySqlInbox {
    type Db = MySql;
    const SCRIPT_PER_STATEMENT: bool = true;
    type EventId = String;
    type Age = u64;
    type Batch = u64;
    type Limit = u32;
    type Attempts = u32;

    fn event_id(id: EventId) -> String {
        id.to_string()
    }

    fn age(older_than: Duration) -> u64 {
        u64::try_from(older_than.as_micros()).unwrap_or(u64::MAX)
    }

    fn attempts(attempts: u32) -> u32 {
        attempts
    }

    /// `(? IS NULL OR handler = ?)`: the handler twice.
    fn bind_handler_filter(query: sql::Query<MySql>, handler: Option<&str>) -> sql::Query<MySql> {
        query.bind(handler).bind(handler)
    }
}

impl InboxRow for MySqlRow {
    /// A DATETIME(6) column as UTC (sqlx sets the session time zone to +00:00).
    fn time(&self, index: usize) -> Result<Option<DateTime<Utc>>, Error> {
        Ok(self
            .try_get::<Option<NaiveDateTime>, _>(index)?
            .map(|t| t.and_utc()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_migration_splits_as_it_always_did() {
        let sql = MIGRATIONS[0].sql;
        let old: Vec<String> = sql
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n")
            .split(';')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        assert_eq!(outbox_types::sql_script::statements(sql), old);
    }

    /// The checksums recorded by earlier releases still read as current.
    #[test]
    fn a_database_migrated_by_earlier_releases_is_current() {
        crate::tests::assert_current(
            MIGRATIONS,
            &[
                (1, "70741bdf3f13599d"),
                (2, "9d7883dc22077ca3"),
                (3, "9d5734ed518e63e0"),
            ],
        );
    }
}
