//! Embedded, versioned migrations for the outbox schema.
//!
//! Why not `sqlx::migrate!`: its bookkeeping table is always `_sqlx_migrations` in the current
//! database, which the application's own sqlx migrations already use, and its SQL is fixed at
//! compile time while our table name is configurable. So the outbox keeps its own short list of
//! versioned SQL templates and its own bookkeeping table next to the outbox table
//! (`<table>_migrations`), like the PostgreSQL and SQLite stores.
//!
//! What differs on MySQL is that **DDL is not transactional**: every `CREATE`/`ALTER` commits on
//! its own, so a migration cannot be rolled back half-way the way PostgreSQL's are. Instead:
//!
//! - **serialized**: a named lock (`GET_LOCK()`, held by the migrating session across the implicit
//!   commits DDL makes) queues concurrent migrators — two relays starting together, or a relay and
//!   `outbox migrate`. The second one then reads the bookkeeping table the first one wrote and has
//!   nothing left to do.
//! - **recoverable**: every migration is written so that running it again after a crash is
//!   harmless (`CREATE TABLE IF NOT EXISTS`, with all the indexes inside that one atomic
//!   statement; a later migration that alters the table must likewise check whether its change is
//!   already there). A version is recorded only after its DDL succeeded, so a crash in between
//!   simply re-runs the migration next time.
//! - **checked**: after a migration ran, the table must have its columns and use InnoDB, so a
//!   table of the same name that belongs to someone else is an error rather than a silent
//!   "already migrated".
//! - **verified**: a checksum per version; an edited or an unknown newer migration is an error,
//!   not a silent skip.
//!
//! Text columns use the server's binary *no-pad* collation for utf8mb4 (`utf8mb4_nopad_bin` on
//! MariaDB, `utf8mb4_0900_bin` on MySQL 8.0.17+): aggregate ids and idempotency keys compare byte
//! for byte, `"K"` differs from `"k"` and `"k"` from `"k "`. The default collations are
//! case-insensitive, and even `utf8mb4_bin` ignores trailing spaces, which would make two
//! different idempotency keys one. The template names the collation `{bin}`; the checksum is taken
//! over the template, so it is the same on either server.

use outbox_types::StoreError;
use outbox_types::migration::{
    Migration as Entry, MigrationReport, Schema, Versioned, checksum, latest_version, pending,
};
use sqlx::{AssertSqlSafe, MySqlConnection, MySqlPool};

use crate::MySqlOutbox;
use crate::error::map_sqlx;
use crate::session::Session;

/// How long `migrate` waits for another process's migration to finish.
const MIGRATE_LOCK_WAIT_SECONDS: u32 = 60;

/// One schema change. `{t}` (the backquoted table name), `{table}` (the bare name) and `{bin}`
/// (the binary no-pad utf8mb4 collation) are replaced before it runs.
pub(crate) struct Migration {
    /// The version, the description and the SQL template.
    pub entry: Entry,
    /// Columns the table must have once this migration ran.
    pub columns: &'static [&'static str],
    /// Columns this migration adds, as `(name, definition)`: each `ALTER TABLE … ADD COLUMN`
    /// runs only when the column is missing, so a migration interrupted after adding it runs
    /// again cleanly (MySQL 8 has no `ADD COLUMN IF NOT EXISTS`; MariaDB does). They run before
    /// `sql`.
    pub add_columns: &'static [(&'static str, &'static str)],
}

/// The header rules of the outbox table's insert trigger (migration 4): `headers`
/// is a JSON object whose values are all strings, with no name under the prefix `outbox-`
/// except `outbox-partition` (`outbox_types::is_reserved_header`). A CHECK constraint cannot
/// loop over an object's members in MySQL or MariaDB, so a trigger does: the names come from
/// `JSON_KEYS`, the values from `$.*` in the same order (as in the enqueue procedure). Name
/// comparisons are binary (`outbox-` is reserved in lower case, as written). SQLSTATE 45000
/// with a message that names the header (cut to 40 characters: MESSAGE_TEXT holds 128). A
/// macro, not a const: `concat!` builds the migration's `&'static str`.
macro_rules! header_check_body {
    () => {
        r#"        IF NEW.headers IS NULL OR NOT JSON_VALID(NEW.headers) OR JSON_TYPE(NEW.headers) <> 'OBJECT' THEN
            SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'outbox: headers must be a JSON object of strings, e.g. {"trace-id": "abc"}';
        END IF;
        SET v_keys = JSON_KEYS(NEW.headers);
        SET v_values = JSON_EXTRACT(NEW.headers, '$.*');
        SET v_n = COALESCE(JSON_LENGTH(v_keys), 0);
        WHILE v_i < v_n DO
            SET v_key = JSON_UNQUOTE(JSON_EXTRACT(v_keys, CONCAT('$[', v_i, ']')));
            IF JSON_TYPE(JSON_EXTRACT(v_values, CONCAT('$[', v_i, ']'))) <> 'STRING' THEN
                SET v_message = CONCAT('outbox: header "', LEFT(v_key, 40),
                    '" is not a string; header values are strings ("3", not 3)');
                SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = v_message;
            END IF;
            IF CAST(LEFT(v_key, 7) AS BINARY) = CAST('outbox-' AS BINARY)
                AND CAST(v_key AS BINARY) <> CAST('outbox-partition' AS BINARY) THEN
                SET v_message = CONCAT('outbox: header "', LEFT(v_key, 40),
                    '" uses the reserved prefix outbox- (only outbox-partition is allowed)');
                SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = v_message;
            END IF;
            SET v_i = v_i + 1;
        END WHILE;
"#
    };
}

/// The variables [`header_check_body`] uses.
macro_rules! header_check_declarations {
    () => {
        r#"    DECLARE v_keys    LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_values  LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_key     LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_n       INT DEFAULT 0;
    DECLARE v_i       INT DEFAULT 0;
    DECLARE v_message VARCHAR(128) CHARACTER SET utf8mb4;
"#
    };
}

/// The outbox schema, oldest first. Never edit a released entry: add a new one.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        entry: Entry {
            version: 1,
            description: "outbox events table, claim and ordering indexes",
            sql: r#"
-- Lifecycle (see outbox_core::EventState): pending -> in_flight -> delivered | dead.
-- A pending row with attempts > 0 is one waiting for a retry.
--
-- Times are DATETIME(6) in UTC, written and compared with UTC_TIMESTAMP(6): the database's
-- clock, whatever the session time zone (DATETIME, unlike TIMESTAMP, is never converted).
--
-- One statement on purpose: MySQL DDL is not transactional, and a single CREATE TABLE with its
-- indexes either happens whole or not at all, and is harmless to run again.
CREATE TABLE IF NOT EXISTS {t} (
    -- Enqueue order, the ack key and the paging cursor of list_dead. InnoDB keeps the counter
    -- across restarts (MySQL 8, MariaDB 10.2.4+), so a seq is never handed out twice.
    seq              BIGINT        NOT NULL AUTO_INCREMENT,
    -- The event's UUID, lowercase hyphenated: readable in a SQL console, time-ordered (v7).
    id               CHAR(36)      CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    aggregate_type   VARCHAR(100)  CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    aggregate_id     VARCHAR(255)  CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    event_type       VARCHAR(255)  CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    -- The JSON text the writer produced, byte for byte (validated before it gets here). Not the
    -- JSON type: MySQL stores JSON in a binary form and hands back a re-serialized document
    -- (keys reordered, whitespace changed).
    payload          LONGTEXT      CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    destination      VARCHAR(1024) CHARACTER SET utf8mb4 COLLATE {bin} NULL,
    -- A JSON object of strings.
    headers          LONGTEXT      CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    -- Unique, and NULL for most events: a UNIQUE index accepts any number of NULLs, which is
    -- what PostgreSQL's partial unique index gives.
    idempotency_key  VARCHAR(255)  CHARACTER SET utf8mb4 COLLATE {bin} NULL,
    occurred_at      DATETIME(6)   NOT NULL,
    enqueued_at      DATETIME(6)   NOT NULL,
    status           VARCHAR(16)   CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'pending',
    attempts         INT           NOT NULL DEFAULT 0,
    next_attempt_at  DATETIME(6)   NOT NULL,
    last_error       TEXT          CHARACTER SET utf8mb4 COLLATE {bin} NULL,
    lease_owner      VARCHAR(255)  CHARACTER SET utf8mb4 COLLATE {bin} NULL,
    -- The fencing token of the claim holding the row.
    lease_token      CHAR(36)      CHARACTER SET ascii COLLATE ascii_bin NULL,
    lease_expires_at DATETIME(6)   NULL,
    delivered_at     DATETIME(6)   NULL,
    dead_at          DATETIME(6)   NULL,
    PRIMARY KEY (seq),
    UNIQUE KEY id_key (id),
    -- A second enqueue with the same key finds the first row.
    UNIQUE KEY idempotency_key (idempotency_key),
    -- MySQL has no partial indexes. Rows of one status in seq order: a claim scans the pending
    -- (and the in-flight) range from its start and stops after `limit` rows, so delivered rows
    -- kept for retention are never read; list_dead, stats and purge use the other ranges.
    KEY open_seq (status, seq),
    -- The per-aggregate blocker probe: earlier rows of one aggregate, by status, so the probe
    -- reads the aggregate's in-flight, dead and pending rows and skips its delivered ones.
    KEY blockers (aggregate_type, aggregate_id, status, seq),
    CONSTRAINT {table}_status CHECK (status IN ('pending', 'in_flight', 'delivered', 'dead'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {bin} ROW_FORMAT = DYNAMIC
"#,
        },
        columns: &[
            "seq",
            "id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
            "destination",
            "headers",
            "idempotency_key",
            "occurred_at",
            "enqueued_at",
            "status",
            "attempts",
            "next_attempt_at",
            "last_error",
            "lease_owner",
            "lease_token",
            "lease_expires_at",
            "delivered_at",
            "dead_at",
        ],
        add_columns: &[],
    },
    Migration {
        entry: Entry {
            version: 2,
            description: "claimed_at, paused destinations",
            sql: r#"
-- Destinations an operator paused (`outbox pause`). Relays read it every poll and claim around
-- the paused destinations' events; the events themselves are not touched. Names compare byte
-- for byte, like every routed field.
CREATE TABLE IF NOT EXISTS `{table}_paused` (
    destination VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    paused_at   DATETIME(6)  NOT NULL,
    paused_by   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    PRIMARY KEY (destination)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {bin}
"#,
        },
        columns: &["claimed_at"],
        // When the row was last claimed: `outbox status` shows which relay holds claims since
        // when. It stays set after the row leaves in_flight; only in_flight rows read it. A
        // nullable column added last is an instant change on MySQL 8.0.12+ and MariaDB 10.3+.
        // Dead rows need no index of their own here: `open_seq (status, seq)` already serves
        // every query over them.
        add_columns: &[("claimed_at", "DATETIME(6) NULL")],
    },
    Migration {
        entry: Entry {
            version: 3,
            description: "enqueue procedure for writers in any language",
            sql: r#"
-- Any language writes an event with one call inside its own transaction, with the same rules as
-- the Rust library's enqueue:
--   CALL `{table}_enqueue`('order', '42', 'OrderPlaced', '{"total": 10}',
--                          NULL, NULL, NULL, NULL, NULL);
-- The arguments, all given (MySQL procedures have no defaults; NULL takes the default):
-- aggregate_type, aggregate_id, event_type, payload (JSON text, stored byte for byte), headers
-- (a JSON object of strings; NULL: {}), destination (NULL: the relay's routes decide),
-- idempotency_key (NULL: none), occurred_at (DATETIME(6) in UTC; NULL: now), id (a UUID;
-- NULL: a new version 7 one). It returns one row with one column, `id`: the event's id, or,
-- for an idempotency key already in the table, the id of the event that has it (nothing
-- written). A bad argument raises SQLSTATE 22023 with a message naming it, so the writer's
-- transaction fails instead of the event being dead-lettered later. It never commits.
-- A procedure, not a function: creating a function that writes needs
-- log_bin_trust_function_creators on servers with a binary log. SQL SECURITY INVOKER: the
-- caller needs INSERT and SELECT on the outbox table (and EXECUTE), as with a plain INSERT.
-- Drop + create keeps the migration re-runnable on MySQL 8 and MariaDB alike.
DROP PROCEDURE IF EXISTS `{table}_enqueue`;
DELIMITER //
CREATE PROCEDURE `{table}_enqueue`(
    IN p_aggregate_type  VARCHAR(100)  CHARACTER SET utf8mb4,
    IN p_aggregate_id    VARCHAR(255)  CHARACTER SET utf8mb4,
    IN p_event_type      VARCHAR(255)  CHARACTER SET utf8mb4,
    IN p_payload         LONGTEXT      CHARACTER SET utf8mb4,
    IN p_headers         LONGTEXT      CHARACTER SET utf8mb4,
    IN p_destination     VARCHAR(1024) CHARACTER SET utf8mb4,
    IN p_idempotency_key VARCHAR(255)  CHARACTER SET utf8mb4,
    IN p_occurred_at     DATETIME(6),
    IN p_id              VARCHAR(36)   CHARACTER SET ascii
)
    MODIFIES SQL DATA
    SQL SECURITY INVOKER
    COMMENT 'outbox enqueue: call it inside the transaction that changes the business rows; returns the event id'
BEGIN
    DECLARE v_id      CHAR(36) CHARACTER SET ascii;
    DECLARE v_hex     CHAR(32) CHARACTER SET ascii;
    DECLARE v_headers LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_values  LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_i       INT DEFAULT 0;
    DECLARE v_seq     BIGINT;
    DECLARE v_row_id  CHAR(36) CHARACTER SET ascii;
    DECLARE v_row_key VARCHAR(255) CHARACTER SET utf8mb4;
    DECLARE v_message VARCHAR(128) CHARACTER SET utf8mb4;
    IF COALESCE(p_aggregate_type, '') = '' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: aggregate_type must not be empty';
    END IF;
    IF COALESCE(p_aggregate_id, '') = '' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: aggregate_id must not be empty';
    END IF;
    IF COALESCE(p_event_type, '') = '' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: event_type must not be empty';
    END IF;
    IF p_payload IS NULL OR NOT JSON_VALID(p_payload) THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: payload must be JSON text (write ''null'' for a JSON null)';
    END IF;
    SET v_headers = COALESCE(p_headers, '{}');
    IF NOT JSON_VALID(v_headers) OR JSON_TYPE(v_headers) <> 'OBJECT' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: headers must be a JSON object of strings, e.g. {"trace-id": "abc"}';
    END IF;
    -- Every member's value, in the order JSON_KEYS lists the names (NULL for {}).
    SET v_values = JSON_EXTRACT(v_headers, '$.*');
    WHILE v_values IS NOT NULL AND v_i < JSON_LENGTH(v_values) DO
        IF JSON_TYPE(JSON_EXTRACT(v_values, CONCAT('$[', v_i, ']'))) <> 'STRING' THEN
            SET v_message = CONCAT('outbox: header "',
                LEFT(JSON_UNQUOTE(JSON_EXTRACT(JSON_KEYS(v_headers), CONCAT('$[', v_i, ']'))), 40),
                '" is not a string; header values are strings ("3", not 3)');
            SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_message;
        END IF;
        SET v_i = v_i + 1;
    END WHILE;
    IF p_id IS NULL THEN
        -- A version 7 UUID: 48 bits of Unix milliseconds (UTC, so no time zone or DST can
        -- shift it), 74 random bits, the version 7 and RFC 4122's variant.
        SET v_hex = LOWER(CONCAT(
            LPAD(HEX(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000), 12, '0'),
            HEX(RANDOM_BYTES(10))));
        SET v_hex = CONCAT(LEFT(v_hex, 12), '7', SUBSTRING(v_hex, 14, 3),
            SUBSTRING('89ab', (CONV(SUBSTRING(v_hex, 17, 1), 16, 10) & 3) + 1, 1),
            SUBSTRING(v_hex, 18));
        SET v_id = CONCAT_WS('-', LEFT(v_hex, 8), SUBSTRING(v_hex, 9, 4), SUBSTRING(v_hex, 13, 4),
            SUBSTRING(v_hex, 17, 4), SUBSTRING(v_hex, 21));
    ELSEIF LOWER(p_id) REGEXP '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
        SET v_id = LOWER(p_id);
    ELSE
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: id must be a UUID (8-4-4-4-12 hex digits), or NULL for a new one';
    END IF;
    -- As the library's enqueue: a duplicate id or key is not an error of the INSERT; it leaves
    -- the conflicting row's seq, flagged with 2^62, in LAST_INSERT_ID(). A concurrent writer of
    -- the same key waits for the first one's transaction, then sees its row or none.
    INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                     idempotency_key, occurred_at, enqueued_at, next_attempt_at)
    VALUES (v_id, p_aggregate_type, p_aggregate_id, p_event_type, p_payload, p_destination,
            v_headers, p_idempotency_key, COALESCE(p_occurred_at, UTC_TIMESTAMP(6)),
            UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))
    ON DUPLICATE KEY UPDATE seq = LAST_INSERT_ID(seq + 4611686018427387904) - 4611686018427387904;
    IF LAST_INSERT_ID() < 4611686018427387904 THEN
        SELECT v_id AS id;
    ELSE
        SET v_seq = LAST_INSERT_ID() - 4611686018427387904;
        SELECT e.id, e.idempotency_key INTO v_row_id, v_row_key FROM {t} AS e
        WHERE e.seq = v_seq FOR UPDATE;
        IF p_idempotency_key IS NOT NULL
            AND CAST(v_row_key AS BINARY) = CAST(p_idempotency_key AS BINARY) THEN
            SELECT v_row_id AS id;
        ELSE
            SET v_message = CONCAT('outbox: event id ', v_id, ' is already in the outbox (seq ', v_seq, '); give each event a new id');
            SIGNAL SQLSTATE '23000' SET MESSAGE_TEXT = v_message;
        END IF;
    END IF;
END //
DELIMITER ;
"#,
        },
        columns: &[],
        add_columns: &[],
    },
    Migration {
        entry: Entry {
            version: 4,
            description: "rows checked when written: id default, header trigger",
            sql: concat!(
                r#"
-- Rows are checked when they are written, not only when the relay claims them.
--
-- `id` defaults to UUID(): a writer in any language may leave it out. MySQL's and MariaDB's
-- UUID() is a version 1 UUID (time and node based, lowercase hyphenated, as this column stores
-- ids), not the time-ordered version 7 the library and the enqueue procedure write; any version
-- is a valid event id. An expression default needs MySQL 8.0.13+ or MariaDB 10.2+; setting it
-- changes the table's definition only. (Under binlog_format = STATEMENT, MySQL logs an insert
-- that relies on it as unsafe: use ROW or MIXED, the defaults.) Re-runnable.
ALTER TABLE {t} ALTER COLUMN id SET DEFAULT (UUID());

-- Headers: a JSON object whose values are all strings, with no name under the prefix outbox-
-- (the relay's own message headers; outbox-partition, which the relay stores itself, excepted).
-- Such a row used to insert and was dead-lettered when claimed; now the writer's INSERT fails
-- with SQLSTATE 45000 and a message naming the header, and the transaction can roll back.
-- A trigger, because a CHECK constraint cannot loop over a JSON object's members here. On
-- INSERT only: the relay never changes `headers`, rows written before the trigger existed are
-- claimed, dead-lettered and requeued as before (nothing to validate), and any BEFORE UPDATE
-- trigger makes the server report no insert id for an upsert that hit a duplicate key, which
-- is how the library's enqueue finds the row an idempotency key points to. Creating a trigger
-- needs the TRIGGER privilege; on a server with binary logging, also SUPER (or
-- log_bin_trust_function_creators = 1), MySQL's rule for stored programs. Drop + create keeps
-- the migration re-runnable.
DROP TRIGGER IF EXISTS `{table}_headers_insert`;
DELIMITER //
CREATE TRIGGER `{table}_headers_insert` BEFORE INSERT ON {t} FOR EACH ROW
BEGIN
"#,
                header_check_declarations!(),
                header_check_body!(),
                r#"END //
DELIMITER ;
"#
            ),
        },
        columns: &[],
        add_columns: &[],
    },
    Migration {
        entry: Entry {
            version: 5,
            description: "least privilege: the enqueue procedure runs as its definer and locks no other event",
            sql: r#"
-- Writers need EXECUTE on the enqueue procedure (and INSERT on the table for a plain INSERT),
-- nothing more. The procedure used to run with the caller's rights, and its duplicate-key
-- upsert (ON DUPLICATE KEY UPDATE) and locking read (SELECT ... FOR UPDATE) made every writer
-- hold INSERT, SELECT and UPDATE on the table (MariaDB checks UPDATE on every inserted
-- column): enough to read any event, hold another service's pending events, and change their
-- payload and destination. Now it is SQL SECURITY DEFINER: it runs with the rights of the
-- account that runs this migration (keep that account: a procedure whose definer is dropped
-- cannot run). A duplicate is no upsert either: the plain INSERT fails on the unique key
-- (which leaves the existing event's row unlocked), and the event holding the key is read
-- without a lock on its row, so the relay can claim it while the writer's transaction is
-- open. A writer learns that event's id, as before, and can read, lock or change nothing.
--
-- MySQL and MariaDB have no search_path: names in a routine resolve in the routine's own
-- database whatever the caller's current one, and a stored function cannot take a built-in
-- function's name, so there is nothing to pin here.
--
-- MariaDB replaces the procedure in place (CREATE OR REPLACE keeps the EXECUTE grants writers
-- hold). MySQL 8 has no CREATE OR REPLACE PROCEDURE: it is dropped and created, and EXECUTE
-- granted on the procedure itself goes with it (EXECUTE granted on the database stays): grant
-- it again after this migration (docs/table-contract.md, "Privileges").
{drop_enqueue_procedure_on_mysql}
DELIMITER //
{create_or_replace} PROCEDURE `{table}_enqueue`(
    IN p_aggregate_type  VARCHAR(100)  CHARACTER SET utf8mb4,
    IN p_aggregate_id    VARCHAR(255)  CHARACTER SET utf8mb4,
    IN p_event_type      VARCHAR(255)  CHARACTER SET utf8mb4,
    IN p_payload         LONGTEXT      CHARACTER SET utf8mb4,
    IN p_headers         LONGTEXT      CHARACTER SET utf8mb4,
    IN p_destination     VARCHAR(1024) CHARACTER SET utf8mb4,
    IN p_idempotency_key VARCHAR(255)  CHARACTER SET utf8mb4,
    IN p_occurred_at     DATETIME(6),
    IN p_id              VARCHAR(36)   CHARACTER SET ascii
)
    MODIFIES SQL DATA
    SQL SECURITY DEFINER
    COMMENT 'outbox enqueue: call it inside the transaction that changes the business rows; returns the event id'
BEGIN
    DECLARE v_id        CHAR(36) CHARACTER SET ascii;
    DECLARE v_hex       CHAR(32) CHARACTER SET ascii;
    DECLARE v_headers   LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_values    LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_i         INT DEFAULT 0;
    DECLARE v_seq       BIGINT;
    DECLARE v_row_id    CHAR(36) CHARACTER SET ascii;
    DECLARE v_message   VARCHAR(128) CHARACTER SET utf8mb4;
    DECLARE v_duplicate BOOLEAN DEFAULT FALSE;
    -- ER_DUP_ENTRY: the id or the idempotency key is taken (sorted out below).
    DECLARE CONTINUE HANDLER FOR 1062 SET v_duplicate = TRUE;
    IF COALESCE(p_aggregate_type, '') = '' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: aggregate_type must not be empty';
    END IF;
    IF COALESCE(p_aggregate_id, '') = '' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: aggregate_id must not be empty';
    END IF;
    IF COALESCE(p_event_type, '') = '' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: event_type must not be empty';
    END IF;
    IF p_payload IS NULL OR NOT JSON_VALID(p_payload) THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: payload must be JSON text (write ''null'' for a JSON null)';
    END IF;
    SET v_headers = COALESCE(p_headers, '{}');
    IF NOT JSON_VALID(v_headers) OR JSON_TYPE(v_headers) <> 'OBJECT' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: headers must be a JSON object of strings, e.g. {"trace-id": "abc"}';
    END IF;
    -- Every member's value, in the order JSON_KEYS lists the names (NULL for {}).
    SET v_values = JSON_EXTRACT(v_headers, '$.*');
    WHILE v_values IS NOT NULL AND v_i < JSON_LENGTH(v_values) DO
        IF JSON_TYPE(JSON_EXTRACT(v_values, CONCAT('$[', v_i, ']'))) <> 'STRING' THEN
            SET v_message = CONCAT('outbox: header "',
                LEFT(JSON_UNQUOTE(JSON_EXTRACT(JSON_KEYS(v_headers), CONCAT('$[', v_i, ']'))), 40),
                '" is not a string; header values are strings ("3", not 3)');
            SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_message;
        END IF;
        SET v_i = v_i + 1;
    END WHILE;
    IF p_id IS NULL THEN
        -- A version 7 UUID: 48 bits of Unix milliseconds (UTC, so no time zone or DST can
        -- shift it), 74 random bits, the version 7 and RFC 4122's variant.
        SET v_hex = LOWER(CONCAT(
            LPAD(HEX(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000), 12, '0'),
            HEX(RANDOM_BYTES(10))));
        SET v_hex = CONCAT(LEFT(v_hex, 12), '7', SUBSTRING(v_hex, 14, 3),
            SUBSTRING('89ab', (CONV(SUBSTRING(v_hex, 17, 1), 16, 10) & 3) + 1, 1),
            SUBSTRING(v_hex, 18));
        SET v_id = CONCAT_WS('-', LEFT(v_hex, 8), SUBSTRING(v_hex, 9, 4), SUBSTRING(v_hex, 13, 4),
            SUBSTRING(v_hex, 17, 4), SUBSTRING(v_hex, 21));
    ELSEIF LOWER(p_id) REGEXP '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
        SET v_id = LOWER(p_id);
    ELSE
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: id must be a UUID (8-4-4-4-12 hex digits), or NULL for a new one';
    END IF;
    -- A concurrent writer of the same key waits here for the first one's transaction, then
    -- finds its row or none.
    INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                     idempotency_key, occurred_at, enqueued_at, next_attempt_at)
    VALUES (v_id, p_aggregate_type, p_aggregate_id, p_event_type, p_payload, p_destination,
            v_headers, p_idempotency_key, COALESCE(p_occurred_at, UTC_TIMESTAMP(6)),
            UTC_TIMESTAMP(6), UTC_TIMESTAMP(6));
    IF NOT v_duplicate THEN
        SELECT v_id AS id;
    ELSE
        -- Which event holds the key, as last committed: a shared lock on the key's index entry
        -- only (the failed insert holds one already), never on the event's row.
        IF p_idempotency_key IS NOT NULL THEN
            SELECT e.seq INTO v_seq FROM {t} AS e FORCE INDEX (idempotency_key)
            WHERE e.idempotency_key = p_idempotency_key LOCK IN SHARE MODE;
        END IF;
        IF v_seq IS NULL THEN
            SET v_message = CONCAT('outbox: event id ', v_id, ' is already in the outbox; give each event a new id');
            SIGNAL SQLSTATE '23000' SET MESSAGE_TEXT = v_message;
        END IF;
        -- A plain read: under REPEATABLE READ a row committed after this transaction's first
        -- read is not visible to it.
        SELECT e.id INTO v_row_id FROM {t} AS e WHERE e.seq = v_seq;
        IF v_row_id IS NULL THEN
            SIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = 'outbox: the event holding this idempotency key was written after this transaction began reading; retry the transaction';
        END IF;
        SELECT v_row_id AS id;
    END IF;
END //
DELIMITER ;
"#,
        },
        columns: &[],
        add_columns: &[],
    },
    Migration {
        entry: Entry {
            version: 6,
            description: "least privilege: the library enqueues through a batch procedure that runs as its definer",
            sql: r#"
-- The Rust library's enqueue, as a procedure that runs as its definer like `{table}_enqueue`
-- (migration 5): writers that enqueue through the library need EXECUTE on it and nothing on
-- the table. Before, the library wrote with its own statements, an upsert (ON DUPLICATE KEY
-- UPDATE) and locking reads (SELECT ... FOR UPDATE) of the rows holding its ids and keys, so
-- its writers needed INSERT, SELECT and UPDATE on the table: enough to read any event, hold
-- another service's pending events and rewrite them.
--
--   CALL `{table}_enqueue_batch`('[{"aggregate_type": "order", "aggregate_id": "42",
--       "event_type": "OrderPlaced", "payload": "{\\"total\\": 10}"}]');
--
-- One JSON array of event objects, written in array order (their seqs increase in that order).
-- Each object has aggregate_type, aggregate_id, event_type, payload (a JSON string holding the
-- payload's JSON text, stored byte for byte) and, optionally, headers (a string holding a JSON
-- object of strings; absent: {}), destination, idempotency_key, occurred_at
-- ('YYYY-MM-DD hh:mm:ss.ffffff' in UTC; absent: now) and id (a UUID; absent: a new version 7
-- one). It returns one row per event, in array order: `ord` (its position, from 1), `id` (the
-- event's id, or for an idempotency key another event already holds, that event's id: nothing
-- was written), `created` (1 when this call wrote the event) and `taken_by_seq` (not NULL when
-- the event was not written because another event, with another idempotency key or none, has
-- its id: an error for the caller; enqueueing the same event, id and key, again is not). A bad
-- event (a field missing or empty, an id that is no UUID) raises SQLSTATE 22023 naming its
-- position; the header trigger checks the headers. It never commits.
--
-- Each event is a plain INSERT; one that fails on a unique key (a taken id or idempotency key)
-- is sorted out as in `{table}_enqueue`: shared locks on the id's and the key's index entries
-- only, never on another event's row, and the holder's id by a plain read. Under REPEATABLE
-- READ, a holder committed after the caller's transaction began reading is not visible to that
-- read: SQLSTATE 40001, retry the transaction. A holder deleted in between is retried (three
-- times, then 40001). Only such events are collected into the result as the loop goes; the
-- other rows come from the input itself.
--
-- MariaDB creates the procedure in place (CREATE OR REPLACE keeps EXECUTE grants when the
-- migration runs again); MySQL 8 drops and creates it.
{drop_enqueue_batch_procedure_on_mysql}
DELIMITER //
{create_or_replace} PROCEDURE `{table}_enqueue_batch`(
    IN p_events LONGTEXT CHARACTER SET utf8mb4
)
    MODIFIES SQL DATA
    SQL SECURITY DEFINER
    COMMENT 'outbox enqueue of a JSON array of events: call it inside the transaction that changes the business rows'
BEGIN
    DECLARE v_done           BOOLEAN DEFAULT FALSE;
    DECLARE v_ord            INT;
    DECLARE v_given_id       LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_aggregate_type LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_aggregate_id   LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_event_type     LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_payload        LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_headers        LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_destination    LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_key            LONGTEXT CHARACTER SET utf8mb4 COLLATE {bin};
    DECLARE v_occurred_at    LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_id             CHAR(36) CHARACTER SET ascii COLLATE ascii_bin;
    DECLARE v_hex            CHAR(32) CHARACTER SET ascii;
    DECLARE v_duplicate      BOOLEAN;
    DECLARE v_attempts       INT;
    DECLARE v_id_seq         BIGINT;
    DECLARE v_key_seq        BIGINT;
    DECLARE v_row_id         CHAR(36) CHARACTER SET ascii;
    DECLARE v_outcomes       LONGTEXT CHARACTER SET utf8mb4 DEFAULT '';
    DECLARE v_message        VARCHAR(128) CHARACTER SET utf8mb4;
    DECLARE c_events CURSOR FOR
        SELECT j.ord, j.id, j.aggregate_type, j.aggregate_id, j.event_type, j.payload,
               j.headers, j.destination, j.idempotency_key, j.occurred_at
        FROM JSON_TABLE(p_events, '$[*]' COLUMNS (
            ord             FOR ORDINALITY,
            id              LONGTEXT CHARACTER SET utf8mb4 PATH '$.id',
            aggregate_type  LONGTEXT CHARACTER SET utf8mb4 PATH '$.aggregate_type',
            aggregate_id    LONGTEXT CHARACTER SET utf8mb4 PATH '$.aggregate_id',
            event_type      LONGTEXT CHARACTER SET utf8mb4 PATH '$.event_type',
            payload         LONGTEXT CHARACTER SET utf8mb4 PATH '$.payload',
            headers         LONGTEXT CHARACTER SET utf8mb4 PATH '$.headers',
            destination     LONGTEXT CHARACTER SET utf8mb4 PATH '$.destination',
            idempotency_key LONGTEXT CHARACTER SET utf8mb4 PATH '$.idempotency_key',
            occurred_at     LONGTEXT CHARACTER SET utf8mb4 PATH '$.occurred_at'
        )) AS j
        ORDER BY j.ord;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_done = TRUE;
    IF p_events IS NULL OR NOT JSON_VALID(p_events) OR JSON_TYPE(p_events) <> 'ARRAY' THEN
        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'outbox: the events must be a JSON array of event objects';
    END IF;
    OPEN c_events;
    next_event: LOOP
        FETCH c_events INTO v_ord, v_given_id, v_aggregate_type, v_aggregate_id, v_event_type,
            v_payload, v_headers, v_destination, v_key, v_occurred_at;
        IF v_done THEN
            LEAVE next_event;
        END IF;
        IF COALESCE(v_aggregate_type, '') = '' THEN
            SET v_message = CONCAT('outbox: event ', v_ord, ': aggregate_type must not be empty');
            SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_message;
        END IF;
        IF COALESCE(v_aggregate_id, '') = '' THEN
            SET v_message = CONCAT('outbox: event ', v_ord, ': aggregate_id must not be empty');
            SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_message;
        END IF;
        IF COALESCE(v_event_type, '') = '' THEN
            SET v_message = CONCAT('outbox: event ', v_ord, ': event_type must not be empty');
            SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_message;
        END IF;
        -- Not parsed here: MariaDB's JSON functions refuse documents nested deeper than 32
        -- levels, which are valid JSON (the library has checked its payloads; the relay
        -- dead-letters a payload that is not JSON).
        IF v_payload IS NULL THEN
            SET v_message = CONCAT('outbox: event ', v_ord, ': payload must be a string of JSON text');
            SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_message;
        END IF;
        IF v_given_id IS NULL THEN
            -- A version 7 UUID, as in `{table}_enqueue`.
            SET v_hex = LOWER(CONCAT(
                LPAD(HEX(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000), 12, '0'),
                HEX(RANDOM_BYTES(10))));
            SET v_hex = CONCAT(LEFT(v_hex, 12), '7', SUBSTRING(v_hex, 14, 3),
                SUBSTRING('89ab', (CONV(SUBSTRING(v_hex, 17, 1), 16, 10) & 3) + 1, 1),
                SUBSTRING(v_hex, 18));
            SET v_id = CONCAT_WS('-', LEFT(v_hex, 8), SUBSTRING(v_hex, 9, 4), SUBSTRING(v_hex, 13, 4),
                SUBSTRING(v_hex, 17, 4), SUBSTRING(v_hex, 21));
        ELSEIF LOWER(v_given_id) REGEXP '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
            SET v_id = LOWER(v_given_id);
        ELSE
            SET v_message = CONCAT('outbox: event ', v_ord, ': id must be a UUID (8-4-4-4-12 hex digits), or absent for a new one');
            SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_message;
        END IF;
        SET v_attempts = 0;
        try_insert: LOOP
            SET v_attempts = v_attempts + 1;
            SET v_duplicate = FALSE;
            BEGIN
                -- ER_DUP_ENTRY: the id or the idempotency key is taken (sorted out below).
                DECLARE CONTINUE HANDLER FOR 1062 SET v_duplicate = TRUE;
                INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination,
                                 headers, idempotency_key, occurred_at, enqueued_at, next_attempt_at)
                VALUES (v_id, v_aggregate_type, v_aggregate_id, v_event_type, v_payload, v_destination,
                        COALESCE(v_headers, '{}'), v_key, COALESCE(v_occurred_at, UTC_TIMESTAMP(6)),
                        UTC_TIMESTAMP(6), UTC_TIMESTAMP(6));
            END;
            IF NOT v_duplicate THEN
                IF v_given_id IS NULL THEN
                    SET v_outcomes = CONCAT(v_outcomes, ',', JSON_OBJECT('ord', v_ord, 'id', v_id, 'created', 1));
                END IF;
                LEAVE try_insert;
            END IF;
            -- Which events hold the id and the key, as last committed: shared locks on their
            -- index entries only (covering reads of the unique indexes), never on a row.
            SET v_id_seq = NULL;
            SET v_key_seq = NULL;
            BEGIN
                DECLARE CONTINUE HANDLER FOR NOT FOUND BEGIN END;
                SELECT e.seq INTO v_id_seq FROM {t} AS e FORCE INDEX (id_key)
                WHERE e.id = v_id LOCK IN SHARE MODE;
                IF v_key IS NOT NULL THEN
                    SELECT e.seq INTO v_key_seq FROM {t} AS e FORCE INDEX (idempotency_key)
                    WHERE e.idempotency_key = v_key LOCK IN SHARE MODE;
                END IF;
            END;
            IF v_id_seq IS NOT NULL THEN
                -- The same event (id and key) again is a duplicate; another event's id is not.
                SET v_outcomes = CONCAT(v_outcomes, ',', IF(v_id_seq = v_key_seq,
                    JSON_OBJECT('ord', v_ord, 'id', v_id, 'created', 0),
                    JSON_OBJECT('ord', v_ord, 'id', v_id, 'created', 0, 'taken_by_seq', v_id_seq)));
                LEAVE try_insert;
            END IF;
            IF v_key_seq IS NOT NULL THEN
                -- A plain read: under REPEATABLE READ a row committed after this transaction's
                -- first read is not visible to it.
                SET v_row_id = NULL;
                BEGIN
                    DECLARE CONTINUE HANDLER FOR NOT FOUND BEGIN END;
                    SELECT e.id INTO v_row_id FROM {t} AS e WHERE e.seq = v_key_seq;
                END;
                IF v_row_id IS NULL THEN
                    SIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = 'outbox: the event holding this idempotency key was written after this transaction began reading; retry the transaction';
                END IF;
                SET v_outcomes = CONCAT(v_outcomes, ',', JSON_OBJECT('ord', v_ord, 'id', v_row_id, 'created', 0));
                LEAVE try_insert;
            END IF;
            -- The event that held the id or the key is gone (deleted after the failed insert,
            -- outside a transaction): write this one after all.
            IF v_attempts >= 3 THEN
                SET v_message = CONCAT('outbox: event ', v_ord, ': the event holding its id or idempotency key kept disappearing; try again');
                SIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = v_message;
            END IF;
        END LOOP try_insert;
    END LOOP next_event;
    CLOSE c_events;
    SELECT CAST(j.ord AS SIGNED) AS ord, COALESCE(o.id, LOWER(j.id)) AS id,
           CAST(COALESCE(o.created, 1) AS SIGNED) AS created, o.taken_by_seq
    FROM JSON_TABLE(p_events, '$[*]' COLUMNS (
        ord FOR ORDINALITY,
        id  VARCHAR(36) CHARACTER SET ascii PATH '$.id'
    )) AS j
    LEFT JOIN JSON_TABLE(CONCAT('[', SUBSTRING(v_outcomes, 2), ']'), '$[*]' COLUMNS (
        ord          INT PATH '$.ord',
        id           CHAR(36) CHARACTER SET ascii PATH '$.id',
        created      INT PATH '$.created',
        taken_by_seq BIGINT PATH '$.taken_by_seq'
    )) AS o ON o.ord = j.ord
    ORDER BY j.ord;
END //
DELIMITER ;
"#,
        },
        columns: &[],
        add_columns: &[],
    },
];

/// A migration's template as this server runs it: `{bin}`, the binary collation, and how the
/// enqueue procedures are replaced (`{create_or_replace}`, `{drop_enqueue_procedure_on_mysql}`,
/// `{drop_enqueue_batch_procedure_on_mysql}`): in place on MariaDB (which keeps the grants on
/// them), dropped and created on MySQL 8 (which has no `CREATE OR REPLACE PROCEDURE`).
/// `collation` tells the servers apart.
fn for_server(outbox: &MySqlOutbox, template: &str, collation: &str) -> String {
    let (drop, drop_batch, create) = if collation == BINARY_COLLATIONS[0] {
        ("", "", "CREATE OR REPLACE")
    } else {
        (
            "DROP PROCEDURE IF EXISTS `{table}_enqueue`;",
            "DROP PROCEDURE IF EXISTS `{table}_enqueue_batch`;",
            "CREATE",
        )
    };
    outbox
        .render(
            &template
                .replace("{drop_enqueue_procedure_on_mysql}", drop)
                .replace("{drop_enqueue_batch_procedure_on_mysql}", drop_batch)
                .replace("{create_or_replace}", create),
        )
        .replace("{bin}", collation)
}

/// The binary no-pad utf8mb4 collations, in order of preference: MariaDB's, then MySQL's.
const BINARY_COLLATIONS: [&str; 2] = ["utf8mb4_nopad_bin", "utf8mb4_0900_bin"];

pub(crate) async fn run(
    outbox: &MySqlOutbox,
    pool: &MySqlPool,
) -> Result<MigrationReport, StoreError> {
    let sql = outbox.sql();
    let (mut session, locked) = Session::open_with_lock(
        pool,
        &sql.migrate_lock,
        &sql.migrate_unlock,
        MIGRATE_LOCK_WAIT_SECONDS,
    )
    .await?;
    if !locked {
        session.abandon(&sql.migrate_unlock).await;
        return Err(StoreError::Unavailable(format!(
            "another process has been migrating outbox table `{}` for more than {MIGRATE_LOCK_WAIT_SECONDS}s; try again later",
            outbox.table()
        )));
    }
    match apply(outbox, session.conn()).await {
        Ok(applied) => {
            session.release_lock(&sql.migrate_unlock).await?;
            Ok(outbox_types::migration_report!(
                applied,
                MIGRATIONS,
                table = outbox.table()
            ))
        }
        Err(error) => {
            session.abandon(&sql.migrate_unlock).await;
            Err(error)
        }
    }
}

/// Apply what is missing, under the migration lock.
async fn apply(outbox: &MySqlOutbox, conn: &mut MySqlConnection) -> Result<Vec<i64>, StoreError> {
    let bookkeeping = outbox.migrations_table();
    sqlx::raw_sql(AssertSqlSafe(bookkeeping_ddl(&bookkeeping)))
        .execute(&mut *conn)
        .await
        .map_err(map_sqlx)?;

    let applied_before: Vec<(i64, String)> =
        outbox_types::applied_migrations!(&mut *conn, bookkeeping, map_sqlx)?;
    let pending = pending(Schema::OUTBOX, MIGRATIONS, &applied_before)?;
    if pending.is_empty() {
        return Ok(Vec::new());
    }
    let collation = binary_collation(conn).await?;
    let mut applied = Vec::with_capacity(pending.len());
    for m in pending {
        for (column, definition) in m.add_columns {
            if !has_column(&columns(outbox, conn).await?, column) {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "ALTER TABLE {} ADD COLUMN {column} {definition}",
                    outbox.quoted_table()
                )))
                .execute(&mut *conn)
                .await
                .map_err(map_sqlx)?;
            }
        }
        let ddl = for_server(outbox, m.entry.sql, &collation);
        for statement in outbox_types::sql_script::statements(&ddl) {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *conn)
                .await
                .map_err(map_sqlx)?;
        }
        check_table(outbox, conn, m).await?;
        let insert = format!(
            "INSERT INTO {bookkeeping} (version, description, checksum, applied_at)
             VALUES (?, ?, ?, UTC_TIMESTAMP(6))"
        );
        outbox_types::record_migration!(&mut *conn, insert, m, map_sqlx)?;
        applied.push(m.entry.version);
    }
    Ok(applied)
}

/// The binary no-pad utf8mb4 collation this server has (see the module docs).
/// The table that records which migrations were applied (created when missing).
fn bookkeeping_ddl(bookkeeping: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {bookkeeping} (
    version     BIGINT       NOT NULL PRIMARY KEY,
    description VARCHAR(255) NOT NULL,
    checksum    CHAR(16)     CHARACTER SET ascii NOT NULL,
    applied_at  DATETIME(6)  NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4"
    )
}

/// Everything [`run`] applies to a database without this outbox, as one SQL script: the
/// bookkeeping table, each migration (its added columns first) as rendered for `outbox` with
/// the binary collation of MariaDB or MySQL, and the row that records it (with the checksum
/// `run` checks). MySQL commits each DDL statement by itself, so unlike `run` the script is not
/// atomic: apply it to a database without the outbox, and again from the top if it stopped.
pub(crate) fn script(outbox: &MySqlOutbox, mariadb: bool) -> String {
    let bookkeeping = outbox.migrations_table();
    let collation = if mariadb {
        BINARY_COLLATIONS[0]
    } else {
        BINARY_COLLATIONS[1]
    };
    let mut out = format!(
        "-- The outbox {} on {}, schema version {}: the DDL `outbox migrate` applies to a\n\
         -- database without it, and the bookkeeping rows that record it applied.\n\
         -- Apply it whole and unedited (`outbox migrate` checks each migration's checksum).\n\n{};\n",
        outbox.quoted_table(),
        if mariadb { "MariaDB" } else { "MySQL" },
        latest_version(MIGRATIONS),
        bookkeeping_ddl(&bookkeeping)
    );
    for m in MIGRATIONS {
        out.push_str(&format!(
            "\n-- Migration {}: {}\n",
            m.entry.version, m.entry.description
        ));
        for (column, definition) in m.add_columns {
            out.push_str(&format!(
                "ALTER TABLE {} ADD COLUMN {column} {definition};\n",
                outbox.quoted_table()
            ));
        }
        let ddl = for_server(outbox, m.entry.sql, collation);
        let ddl = ddl.trim();
        if !ddl.is_empty() {
            out.push_str(ddl);
            out.push_str(if ddl.ends_with(';') { "\n" } else { ";\n" });
        }
        out.push_str(&format!(
            "INSERT INTO {bookkeeping} (version, description, checksum, applied_at)\n    VALUES ({}, '{}', '{}', UTC_TIMESTAMP(6));\n",
            m.entry.version,
            m.entry.description.replace('\\', "\\\\").replace('\'', "''"),
            m.checksum()
        ));
    }
    out
}

async fn binary_collation(conn: &mut MySqlConnection) -> Result<String, StoreError> {
    let available: Vec<String> = sqlx::query_scalar(
        "SELECT COLLATION_NAME FROM information_schema.COLLATIONS
         WHERE COLLATION_NAME IN ('utf8mb4_nopad_bin', 'utf8mb4_0900_bin')",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    BINARY_COLLATIONS
        .iter()
        .find(|c| available.iter().any(|a| a.eq_ignore_ascii_case(c)))
        .map(|c| (*c).to_owned())
        .ok_or_else(|| {
            StoreError::Database(
                "the server has neither utf8mb4_nopad_bin (MariaDB) nor utf8mb4_0900_bin (MySQL 8.0.17+): the outbox needs MariaDB 10.6+ or MySQL 8.0.17+".to_owned(),
            )
        })
}

/// The columns of the outbox table (none while it does not exist).
async fn columns(
    outbox: &MySqlOutbox,
    conn: &mut MySqlConnection,
) -> Result<Vec<String>, StoreError> {
    sqlx::query_scalar(
        "SELECT COLUMN_NAME FROM information_schema.COLUMNS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(outbox.table())
    .fetch_all(&mut *conn)
    .await
    .map_err(map_sqlx)
}

/// Whether `columns` holds `column` (names compare as MySQL compares them: case aside).
fn has_column(columns: &[String], column: &str) -> bool {
    columns.iter().any(|have| have.eq_ignore_ascii_case(column))
}

/// After `m` ran: the table is InnoDB and has every column `m` promises.
async fn check_table(
    outbox: &MySqlOutbox,
    conn: &mut MySqlConnection,
    m: &Migration,
) -> Result<(), StoreError> {
    let engine: Option<String> = sqlx::query_scalar(
        "SELECT ENGINE FROM information_schema.TABLES
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(outbox.table())
    .fetch_optional(&mut *conn)
    .await
    .map_err(map_sqlx)?
    .flatten();
    let columns = columns(outbox, conn).await?;
    let missing: Vec<&str> = m
        .columns
        .iter()
        .copied()
        .filter(|c| !has_column(&columns, c))
        .collect();
    if !missing.is_empty() {
        return Err(StoreError::Database(format!(
            "table `{}` exists but is not an outbox table (no column {}): choose another table name",
            outbox.table(),
            missing.join(", ")
        )));
    }
    if !engine
        .as_deref()
        .is_some_and(|e| e.eq_ignore_ascii_case("InnoDB"))
    {
        return Err(StoreError::Database(format!(
            "outbox table `{}` uses the {} engine; the outbox needs InnoDB (row locks, SKIP LOCKED, transactions)",
            outbox.table(),
            engine.as_deref().unwrap_or("unknown")
        )));
    }
    Ok(())
}

/// The schema version the database is at, `0` when the outbox was never migrated there.
pub(crate) async fn current_version(
    outbox: &MySqlOutbox,
    pool: &MySqlPool,
) -> Result<i64, StoreError> {
    let exists = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(format!("{}_migrations", outbox.table()));
    outbox_types::recorded_version!(pool, exists, outbox.migrations_table(), map_sqlx)
}

impl Versioned for Migration {
    fn entry(&self) -> &Entry {
        &self.entry
    }

    /// Over the SQL template and, when there are any, the added columns (so version 1's
    /// checksum, recorded before `add_columns` existed, is unchanged).
    fn checksum(&self) -> String {
        let mut text = self.entry.sql.to_owned();
        for (column, definition) in self.add_columns {
            text.push_str(&format!("\n-- add column {column} {definition}"));
        }
        checksum(&text)
    }
}

#[cfg(test)]
mod released {
    use super::*;

    /// The migration runner sends one statement at a time; a routine's body stays whole, on
    /// either server.
    #[test]
    fn migrations_split_into_their_statements() {
        let outbox = MySqlOutbox::new();
        let rendered = |collation: &str| -> Vec<Vec<String>> {
            MIGRATIONS
                .iter()
                .map(|m| {
                    outbox_types::sql_script::statements(&for_server(
                        &outbox,
                        m.entry.sql,
                        collation,
                    ))
                })
                .collect()
        };
        let mariadb = rendered(BINARY_COLLATIONS[0]);
        let mysql = rendered(BINARY_COLLATIONS[1]);
        let counts = |all: &[Vec<String>]| all.iter().map(Vec::len).collect::<Vec<_>>();
        assert_eq!(counts(&mariadb), [1, 1, 2, 3, 1, 1]);
        assert_eq!(counts(&mysql), [1, 1, 2, 3, 2, 2]);
        let trigger = &mariadb[3][2];
        assert!(trigger.starts_with("CREATE TRIGGER") && trigger.ends_with("END"));
        let procedure = &mariadb[2][1];
        assert!(procedure.starts_with("CREATE PROCEDURE") && procedure.ends_with("END"));
        let replaced = &mariadb[4][0];
        assert!(replaced.starts_with("CREATE OR REPLACE PROCEDURE `outbox_events_enqueue`"));
        assert!(replaced.contains("SQL SECURITY DEFINER") && replaced.ends_with("END"));
        assert_eq!(
            mysql[4][0],
            "DROP PROCEDURE IF EXISTS `outbox_events_enqueue`"
        );
        assert!(mysql[4][1].starts_with("CREATE PROCEDURE `outbox_events_enqueue`"));
        let batch = &mariadb[5][0];
        assert!(batch.starts_with("CREATE OR REPLACE PROCEDURE `outbox_events_enqueue_batch`"));
        assert!(batch.contains("SQL SECURITY DEFINER") && batch.ends_with("END"));
        assert_eq!(
            mysql[5][0],
            "DROP PROCEDURE IF EXISTS `outbox_events_enqueue_batch`"
        );
        assert!(mysql[5][1].starts_with("CREATE PROCEDURE `outbox_events_enqueue_batch`"));
    }

    outbox_types::released_migrations_test! {
        MIGRATIONS => [
            (1, "38fadcaa21e52292"),
            (2, "843858d7b611842b"),
            (3, "9eb26b8ad9fed7f5"),
            (4, "7e424d3e0165c889"),
        ],
    }
}
