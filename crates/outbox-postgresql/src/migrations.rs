//! Embedded, versioned migrations for the outbox schema.
//!
//! Why not `sqlx::migrate!`: its bookkeeping table is always `_sqlx_migrations` in the current
//! schema, which the application's own sqlx migrations already use, and its SQL is fixed at
//! compile time while our table name is configurable. So the outbox keeps its own short list of
//! versioned SQL templates and its own bookkeeping table next to the outbox table
//! (`<schema>.<table>_migrations`). Applying them is idempotent (applied versions are skipped),
//! serialized (a transaction-scoped advisory lock, so two relays starting together do not race),
//! atomic (one transaction; PostgreSQL DDL is transactional) and verified (a checksum per
//! version; an edited or unknown newer migration is an error, not a silent skip).

use outbox_types::StoreError;
use outbox_types::migration::{MigrationReport, Schema, pending};
use sqlx::PgPool;

use crate::PgOutbox;
use crate::error::map_sqlx;

/// One schema change. `{schema}`, `{table}` and `{t}` (the quoted qualified table name) are
/// replaced before it runs.
pub(crate) use outbox_types::migration::Migration;

/// A new version 7 UUID (RFC 9562: 48 bits of Unix milliseconds, then random bits with the
/// version set to 7; the variant stays RFC 4122's), as one SQL expression. PostgreSQL 15 has no
/// `uuidv7()` (it came in 18), so the enqueue function and the `id` column defaults build it from
/// `gen_random_uuid()` and `clock_timestamp()`; this is the one place it is written. A macro,
/// not a const: `concat!` builds the migrations' `&'static str`.
macro_rules! uuid_v7_sql {
    () => {
        r#"encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
        placing substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid"#
    };
}

/// The rules a stored event's `headers` follow, as a predicate over the `headers` column: a
/// JSON object whose every value is a string, with no name under the prefix `outbox-` other
/// than `outbox-partition` (see `outbox_types::RESERVED_HEADER_PREFIX`). One `jsonpath` pass
/// over the members.
macro_rules! header_rules_sql {
    () => {
        r#"jsonb_typeof(NEW.headers) = 'object' AND NOT jsonb_path_exists(NEW.headers, 'strict $.keyvalue() ? (@.value.type() != "string" || (@.key starts with "outbox-" && @.key != "outbox-partition"))')"#
    };
}

/// The trigger function that checks a row's headers as it is written (migration 6 of the plain
/// layout, 5 of the partitioned one; also the stream table's, `outbox_wal::stream_table_ddl`).
///
/// Why a trigger and not a CHECK constraint: PostgreSQL prepares a table's check constraints
/// again for every statement that writes it (it reads their stored expression and plans it),
/// and for this expression that cost a writer's single-row INSERT 6 to 17 µs, 3 to 8 % of a
/// small business transaction; the trigger runs a plan PL/pgSQL caches for the session, 0 to
/// 5.5 µs (numbers in the crate docs). A trigger also checks inserts only (and updates that set
/// `headers`, which the relay never does), so rows written before it existed are claimed,
/// retried and dead-lettered as before and there is nothing to validate on upgrade; and its
/// message names the header.
///
/// The fast path is one `jsonpath` pass; only a row that fails it looks for which header is at
/// fault. SQLSTATE 23514 (check_violation), like the constraint it stands for.
macro_rules! check_headers_function {
    () => {
        concat!(
            r#"CREATE FUNCTION "{schema}"."{table}_check_headers"() RETURNS trigger
LANGUAGE plpgsql
AS $fn$
DECLARE
    f_bad TEXT;
BEGIN
    IF "#,
            header_rules_sql!(),
            r#" THEN
        RETURN NEW;
    END IF;
    IF jsonb_typeof(NEW.headers) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'outbox: headers must be a JSON object of strings, e.g. {"trace-id": "abc"}'
            USING ERRCODE = '23514', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'headers';
    END IF;
    SELECT h.key INTO f_bad FROM jsonb_each(NEW.headers) h
    WHERE jsonb_typeof(h.value) <> 'string' ORDER BY h.key LIMIT 1;
    IF f_bad IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: header "%" is not a string; header values are strings (e.g. "3", not 3)', f_bad
            USING ERRCODE = '23514', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'headers';
    END IF;
    SELECT h.key INTO f_bad FROM jsonb_each(NEW.headers) h
    WHERE h.key LIKE 'outbox-%' AND h.key <> 'outbox-partition' ORDER BY h.key LIMIT 1;
    RAISE EXCEPTION 'outbox: header "%" uses the prefix outbox-, which is reserved for the relay''s own message headers (only outbox-partition may be stored)', f_bad
        USING ERRCODE = '23514', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'headers';
END;
$fn$;
COMMENT ON FUNCTION "{schema}"."{table}_check_headers"() IS
    'outbox: refuses a row whose headers are not a JSON object of string values, or that has a name starting with outbox- (reserved for the relay; outbox-partition allowed). See docs/table-contract.md in the outbox repository.';
"#
        )
    };
}

/// The enqueue function's opening comment, the same in every version.
macro_rules! enqueue_function_doc {
    () => {
        r#"
-- Any language writes an event with one call inside its own transaction, in the same layout
-- and with the same rules as the Rust library's enqueue:
--   SELECT "{schema}"."{table}_enqueue"('order', '42', 'OrderPlaced', '{"total": 10}');
--   SELECT "{schema}"."{table}_enqueue"('order', '42', 'OrderPaid', '{}',
--              headers => '{"trace-id": "abc"}', idempotency_key => 'pay-42');
-- It returns the event's id: a new UUID (version 7, time-ordered) unless `id` is given, or, for
-- an idempotency key already in the table, the id of the event that has it (nothing written).
-- It never commits: the event commits or rolls back with the caller's transaction.
"#
    };
}

/// The enqueue function's signature and its checks of the arguments, up to (not including) the
/// checks added by later versions.
macro_rules! enqueue_function_checks {
    () => {
        r#"FUNCTION "{schema}"."{table}_enqueue"(
    aggregate_type  TEXT,
    aggregate_id    TEXT,
    event_type      TEXT,
    payload         JSON,
    headers         JSONB       DEFAULT '{}',
    destination     TEXT        DEFAULT NULL,
    idempotency_key TEXT        DEFAULT NULL,
    occurred_at     TIMESTAMPTZ DEFAULT now(),
    id              UUID        DEFAULT NULL
) RETURNS UUID
LANGUAGE plpgsql
AS $fn$
-- Parameters are always written qualified ({table}_enqueue.name): a bare name is the column.
#variable_conflict use_column
DECLARE
    f_id       UUID;
    f_created  BOOLEAN;
    f_enqueued TIMESTAMPTZ;
    f_bad      TEXT;
BEGIN
    IF coalesce({table}_enqueue.aggregate_type, '') = '' THEN
        RAISE EXCEPTION 'outbox: aggregate_type must not be empty' USING ERRCODE = '22023';
    END IF;
    IF coalesce({table}_enqueue.aggregate_id, '') = '' THEN
        RAISE EXCEPTION 'outbox: aggregate_id must not be empty' USING ERRCODE = '22023';
    END IF;
    IF coalesce({table}_enqueue.event_type, '') = '' THEN
        RAISE EXCEPTION 'outbox: event_type must not be empty' USING ERRCODE = '22023';
    END IF;
    IF {table}_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox: payload must not be NULL (write ''null'' for a JSON null)' USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(coalesce({table}_enqueue.headers, '{}')) <> 'object' THEN
        RAISE EXCEPTION 'outbox: headers must be a JSON object of strings, e.g. {"trace-id": "abc"}' USING ERRCODE = '22023';
    END IF;
    SELECT h.key INTO f_bad FROM jsonb_each(coalesce({table}_enqueue.headers, '{}')) h
    WHERE jsonb_typeof(h.value) <> 'string' LIMIT 1;
    IF f_bad IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: header "%" is not a string; header values are strings (e.g. "3", not 3)', f_bad
            USING ERRCODE = '22023';
    END IF;
"#
    };
}

/// The enqueue function's new id.
macro_rules! enqueue_function_id {
    () => {
        concat!(
            r#"    -- A version 7 UUID: 48 bits of Unix milliseconds, then a random one's bits with the
    -- version set to 7 (the variant stays RFC 4122's).
    f_id := coalesce({table}_enqueue.id, "#,
            uuid_v7_sql!(),
            ");"
        )
    };
}

/// The start of the enqueue function as migration 5 (plain) and 4 (partitioned) created it,
/// the same in both layouts (each migration adds the layout's inserts).
macro_rules! enqueue_function_head {
    () => {
        concat!(
            enqueue_function_doc!(),
            "CREATE ",
            enqueue_function_checks!(),
            enqueue_function_id!()
        )
    };
}

/// The start of the enqueue function from migration 6 (plain) and 5 (partitioned) on: replaced
/// in place (`CREATE OR REPLACE` keeps its owner and the grants writers hold), and refusing a
/// header name under the reserved prefix itself, with the header's name in the message, as it
/// does a header that is not a string (the table's check would refuse the row anyway, but
/// naming only its constraint).
macro_rules! enqueue_function_head_v2 {
    () => {
        concat!(
            enqueue_function_doc!(),
            "CREATE OR REPLACE ",
            enqueue_function_checks!(),
            r#"    SELECT h.key INTO f_bad FROM jsonb_each(coalesce({table}_enqueue.headers, '{}')) h
    WHERE h.key LIKE 'outbox-%' AND h.key <> 'outbox-partition' LIMIT 1;
    IF f_bad IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: header "%" uses the prefix outbox-, which is reserved for the relay''s own message headers (only outbox-partition may be stored)', f_bad
            USING ERRCODE = '22023';
    END IF;
"#,
            enqueue_function_id!()
        )
    };
}

/// The events table's columns from `payload` to `dead_at`, the same in both layouts (version 1 of
/// each): the partitioned table is the plain one's columns, partitioned.
macro_rules! event_columns {
    () => {
        r#"    payload          JSON        NOT NULL,
    destination      TEXT,
    headers          JSONB       NOT NULL DEFAULT '{}',
    idempotency_key  TEXT,
    occurred_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    enqueued_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    status           TEXT        NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'in_flight', 'delivered', 'dead')),
    attempts         INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error       TEXT,
    lease_owner      TEXT,
    lease_token      UUID,
    lease_expires_at TIMESTAMPTZ,
    delivered_at     TIMESTAMPTZ,
    dead_at          TIMESTAMPTZ,
"#
    };
}

/// The plain layout's end of the enqueue function: the insert and the result.
macro_rules! plain_enqueue_tail {
    () => {
        r#"
    INSERT INTO {t} AS o (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                          idempotency_key, occurred_at)
    VALUES (f_id, {table}_enqueue.aggregate_type, {table}_enqueue.aggregate_id, {table}_enqueue.event_type,
            {table}_enqueue.payload, {table}_enqueue.destination, coalesce({table}_enqueue.headers, '{}'),
            {table}_enqueue.idempotency_key, coalesce({table}_enqueue.occurred_at, now()))
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
    DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key
    RETURNING o.id INTO f_id;
    RETURN f_id;
END;
$fn$;
"#
    };
}

/// The partitioned layout's end of the enqueue function: the keys row, then the event.
macro_rules! partitioned_enqueue_tail {
    () => {
        r#"
    -- The keys table first: its primary key and unique index make id and key unique across
    -- partitions; the event takes its enqueued_at, so both agree on the partition.
    INSERT INTO "{schema}"."{table}_keys" AS k (id, idempotency_key)
    VALUES (f_id, {table}_enqueue.idempotency_key)
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
    DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key
    RETURNING k.id, k.enqueued_at, (k.xmax = 0) INTO f_id, f_enqueued, f_created;
    IF f_created THEN
        INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                         idempotency_key, occurred_at, enqueued_at)
        VALUES (f_id, {table}_enqueue.aggregate_type, {table}_enqueue.aggregate_id, {table}_enqueue.event_type,
                {table}_enqueue.payload, {table}_enqueue.destination, coalesce({table}_enqueue.headers, '{}'),
                {table}_enqueue.idempotency_key, coalesce({table}_enqueue.occurred_at, now()), f_enqueued);
    END IF;
    RETURN f_id;
END;
$fn$;
"#
    };
}

/// The migration that builds the `_heads` index, the same in both layouts but for its version
/// (3 plain, 2 partitioned) and the layout's `$note`, a comment line before the statement.
macro_rules! heads_index_migration {
    ($version:literal, $note:literal) => {
        Migration {
            version: $version,
            description: "open rows by aggregate, for claims behind held aggregates",
            sql: concat!(
                r#"
-- Open rows by aggregate, in seq order. A claim that finds the front of the queue held back (one
-- relay holds the head of every aggregate, or a few aggregates wait behind a retry or a dead
-- event with long queues behind them) walks the aggregates through this index, one probe each,
-- instead of probing every held row in seq order (see the claim statement). Each enqueue adds
-- one entry. Building it reads the table once, under a lock that holds writers back meanwhile.
-- Its rows are `_open`'s, but the predicate is written so that the planner cannot use `_open`
-- in its place (see the claim statement).
"#,
                $note,
                r#"CREATE INDEX {table}_heads ON {t} (aggregate_type, aggregate_id, seq)
    WHERE status NOT IN ('delivered', 'dead');
"#
            ),
        }
    };
}

/// The migration that rebuilds the blockers index with the `last_error` mark (4 plain, 3
/// partitioned), the same in both layouts but for its version, the layout's `$comment`, and
/// `$create`, the statement that builds the new index under a temporary name (the plain
/// layout's accepts one an operator built ahead); then the old index goes and the new one takes
/// its name.
macro_rules! blockers_migration {
    ($version:literal, $comment:literal, $create:literal) => {
        Migration {
            version: $version,
            description: "blockers marked by last_error: an outage costs no attempt",
            sql: concat!(
                $comment,
                $create,
                r#" {table}_blockers_next ON {t} (aggregate_type, aggregate_id, seq)
    WHERE status IN ('in_flight', 'dead')
       OR (status = 'pending' AND (attempts > 0 OR last_error IS NOT NULL));
DROP INDEX "{schema}".{table}_blockers;
ALTER INDEX "{schema}".{table}_blockers_next RENAME TO {table}_blockers;
"#
            ),
        }
    };
}

/// The migration that creates the enqueue function (5 plain, 4 partitioned), ending with the
/// layout's inserts: `$tail` names `plain_enqueue_tail` or `partitioned_enqueue_tail`.
macro_rules! enqueue_function_migration {
    ($version:literal, $tail:ident) => {
        Migration {
            version: $version,
            description: "enqueue function for writers in any language",
            sql: concat!(enqueue_function_head!(), $tail!()),
        }
    };
}

/// The end of the migration that checks rows when they are written (6 plain, 5 partitioned), the
/// same in both layouts but for the inserts (`$tail`): the header trigger on the events table
/// (which fires on every partition), then the enqueue function's second version.
macro_rules! header_trigger_and_enqueue_v2 {
    ($tail:ident) => {
        concat!(
            check_headers_function!(),
            r#"CREATE TRIGGER {table}_header_rules BEFORE INSERT OR UPDATE OF headers ON {t}
    FOR EACH ROW EXECUTE FUNCTION "{schema}"."{table}_check_headers"();
"#,
            enqueue_function_head_v2!(),
            $tail!()
        )
    };
}

/// A new version 7 UUID as [`uuid_v7_sql!`] builds it, every function named with its schema
/// (the SQL-syntax forms `overlay`, `substring` and `extract` name `pg_catalog`'s by
/// themselves): for the functions of migration 7 (plain) and 6 (partitioned) on, which pin
/// `search_path` and qualify what they call.
macro_rules! uuid_v7_sql_qualified {
    () => {
        r#"pg_catalog.encode(pg_catalog.set_bit(pg_catalog.set_bit(overlay(pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
        placing substring(pg_catalog.int8send(pg_catalog.floor(extract(epoch FROM pg_catalog.clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid"#
    };
}

/// What every function the migrations install from migration 7 (plain) and 6 (partitioned) on
/// declares: it looks names up in `pg_catalog` only (then `pg_temp`, where PostgreSQL never
/// looks a function up), whatever the caller's `search_path`.
macro_rules! pinned_search_path {
    () => {
        "SET search_path = pg_catalog, pg_temp"
    };
}

/// The header trigger's function again (migration 7 plain, 6 partitioned): the rules of
/// [`check_headers_function!`], with `search_path` pinned and every function named with its
/// schema. `CREATE OR REPLACE` keeps the function's identity, so the trigger on the outbox
/// table (and WAL mode's on the stream table) runs the new body at once.
macro_rules! check_headers_function_pinned {
    () => {
        concat!(
            r#"CREATE OR REPLACE FUNCTION "{schema}"."{table}_check_headers"() RETURNS trigger
LANGUAGE plpgsql
"#,
            pinned_search_path!(),
            r#"
AS $fn$
DECLARE
    f_bad TEXT;
BEGIN
    IF pg_catalog.jsonb_typeof(NEW.headers) = 'object' AND NOT pg_catalog.jsonb_path_exists(NEW.headers, 'strict $.keyvalue() ? (@.value.type() != "string" || (@.key starts with "outbox-" && @.key != "outbox-partition"))'::jsonpath) THEN
        RETURN NEW;
    END IF;
    IF pg_catalog.jsonb_typeof(NEW.headers) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'outbox: headers must be a JSON object of strings, e.g. {"trace-id": "abc"}'
            USING ERRCODE = '23514', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'headers';
    END IF;
    SELECT h.key INTO f_bad FROM pg_catalog.jsonb_each(NEW.headers) h
    WHERE pg_catalog.jsonb_typeof(h.value) <> 'string' ORDER BY h.key LIMIT 1;
    IF f_bad IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: header "%" is not a string; header values are strings (e.g. "3", not 3)', f_bad
            USING ERRCODE = '23514', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'headers';
    END IF;
    SELECT h.key INTO f_bad FROM pg_catalog.jsonb_each(NEW.headers) h
    WHERE h.key LIKE 'outbox-%' AND h.key <> 'outbox-partition' ORDER BY h.key LIMIT 1;
    RAISE EXCEPTION 'outbox: header "%" uses the prefix outbox-, which is reserved for the relay''s own message headers (only outbox-partition may be stored)', f_bad
        USING ERRCODE = '23514', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'headers';
END;
$fn$;
"#
        )
    };
}

/// The enqueue function's third version (migration 7 plain, 6 partitioned), up to the layout's
/// insert: the same signature, checks and results, now `SECURITY DEFINER` with a pinned
/// `search_path`, every function named with its schema. `CREATE OR REPLACE` keeps its owner,
/// its comment and the grants writers hold.
macro_rules! enqueue_function_v3_head {
    () => {
        concat!(
            r#"CREATE OR REPLACE FUNCTION "{schema}"."{table}_enqueue"(
    aggregate_type  TEXT,
    aggregate_id    TEXT,
    event_type      TEXT,
    payload         JSON,
    headers         JSONB       DEFAULT '{}',
    destination     TEXT        DEFAULT NULL,
    idempotency_key TEXT        DEFAULT NULL,
    occurred_at     TIMESTAMPTZ DEFAULT now(),
    id              UUID        DEFAULT NULL
) RETURNS UUID
LANGUAGE plpgsql
SECURITY DEFINER
"#,
            pinned_search_path!(),
            r#"
AS $fn$
-- Parameters are always written qualified ({table}_enqueue.name): a bare name is the column.
#variable_conflict use_column
DECLARE
    f_id       UUID;
    f_existing UUID;
    f_enqueued TIMESTAMPTZ;
    f_bad      TEXT;
BEGIN
    IF coalesce({table}_enqueue.aggregate_type, '') = '' THEN
        RAISE EXCEPTION 'outbox: aggregate_type must not be empty' USING ERRCODE = '22023';
    END IF;
    IF coalesce({table}_enqueue.aggregate_id, '') = '' THEN
        RAISE EXCEPTION 'outbox: aggregate_id must not be empty' USING ERRCODE = '22023';
    END IF;
    IF coalesce({table}_enqueue.event_type, '') = '' THEN
        RAISE EXCEPTION 'outbox: event_type must not be empty' USING ERRCODE = '22023';
    END IF;
    IF {table}_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox: payload must not be NULL (write ''null'' for a JSON null)' USING ERRCODE = '22023';
    END IF;
    IF pg_catalog.jsonb_typeof(coalesce({table}_enqueue.headers, '{}')) <> 'object' THEN
        RAISE EXCEPTION 'outbox: headers must be a JSON object of strings, e.g. {"trace-id": "abc"}' USING ERRCODE = '22023';
    END IF;
    SELECT h.key INTO f_bad FROM pg_catalog.jsonb_each(coalesce({table}_enqueue.headers, '{}')) h
    WHERE pg_catalog.jsonb_typeof(h.value) <> 'string' LIMIT 1;
    IF f_bad IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: header "%" is not a string; header values are strings (e.g. "3", not 3)', f_bad
            USING ERRCODE = '22023';
    END IF;
    SELECT h.key INTO f_bad FROM pg_catalog.jsonb_each(coalesce({table}_enqueue.headers, '{}')) h
    WHERE h.key LIKE 'outbox-%' AND h.key <> 'outbox-partition' LIMIT 1;
    IF f_bad IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: header "%" uses the prefix outbox-, which is reserved for the relay''s own message headers (only outbox-partition may be stored)', f_bad
            USING ERRCODE = '22023';
    END IF;
    -- A version 7 UUID: 48 bits of Unix milliseconds, then a random one's bits with the
    -- version set to 7 (the variant stays RFC 4122's).
    f_id := coalesce({table}_enqueue.id, "#,
            uuid_v7_sql_qualified!(),
            r#");
    -- A key already taken is no conflict to wait on or to lock: DO NOTHING, then the event
    -- holding it is read (on a new snapshot, under READ COMMITTED; under REPEATABLE READ a key
    -- committed after the snapshot fails the insert with SQLSTATE 40001 instead). A writer
    -- learns that event's id, as before, and holds no lock on it. A row deleted in between
    -- (purged, discarded) frees its key: the insert is tried again.
    FOR f_try IN 1..3 LOOP
"#
        )
    };
}

/// The plain layout's end of the enqueue function's third version.
macro_rules! plain_enqueue_v3_tail {
    () => {
        r#"        INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                         idempotency_key, occurred_at)
        VALUES (f_id, {table}_enqueue.aggregate_type, {table}_enqueue.aggregate_id, {table}_enqueue.event_type,
                {table}_enqueue.payload, {table}_enqueue.destination, coalesce({table}_enqueue.headers, '{}'),
                {table}_enqueue.idempotency_key, coalesce({table}_enqueue.occurred_at, now()))
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING;
        IF FOUND THEN
            RETURN f_id;
        END IF;
        SELECT e.id INTO f_existing FROM {t} e WHERE e.idempotency_key = {table}_enqueue.idempotency_key;
        IF f_existing IS NOT NULL THEN
            RETURN f_existing;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'outbox: the event holding idempotency key "%" was deleted while this event was enqueued, three times; try again', {table}_enqueue.idempotency_key
        USING ERRCODE = '40001';
END;
$fn$;
"#
    };
}

/// The partitioned layout's end of the enqueue function's third version: the keys row, then the
/// event.
macro_rules! partitioned_enqueue_v3_tail {
    () => {
        r#"        -- The keys table first: its primary key and unique index make id and key unique
        -- across partitions; the event takes its enqueued_at, so both agree on the partition.
        INSERT INTO "{schema}"."{table}_keys" AS k (id, idempotency_key)
        VALUES (f_id, {table}_enqueue.idempotency_key)
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING k.enqueued_at INTO f_enqueued;
        IF FOUND THEN
            INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                             idempotency_key, occurred_at, enqueued_at)
            VALUES (f_id, {table}_enqueue.aggregate_type, {table}_enqueue.aggregate_id, {table}_enqueue.event_type,
                    {table}_enqueue.payload, {table}_enqueue.destination, coalesce({table}_enqueue.headers, '{}'),
                    {table}_enqueue.idempotency_key, coalesce({table}_enqueue.occurred_at, now()), f_enqueued);
            RETURN f_id;
        END IF;
        SELECT k.id INTO f_existing FROM "{schema}"."{table}_keys" k
        WHERE k.idempotency_key = {table}_enqueue.idempotency_key;
        IF f_existing IS NOT NULL THEN
            RETURN f_existing;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'outbox: the event holding idempotency key "%" was deleted while this event was enqueued, three times; try again', {table}_enqueue.idempotency_key
        USING ERRCODE = '40001';
END;
$fn$;
"#
    };
}

/// The batch enqueue function (migration 7 plain, 6 partitioned) up to the layout's inserts:
/// what the Rust library's enqueue calls for events with an idempotency key (and, in the
/// partitioned layout, for every event), so that a writer needs EXECUTE on it and no right on
/// the table's rows. The events as arrays, inserted in array order; one row back per event
/// with a key: the id of the event holding that key and whether this call wrote it.
macro_rules! enqueue_batch_function_head {
    () => {
        concat!(
            r#"CREATE OR REPLACE FUNCTION "{schema}"."{table}_enqueue_batch"(
    ids              UUID[],
    aggregate_types  TEXT[],
    aggregate_ids    TEXT[],
    event_types      TEXT[],
    payloads         TEXT[],
    destinations     TEXT[],
    headers          TEXT[],
    idempotency_keys TEXT[],
    occurred_ats     TIMESTAMPTZ[]
) RETURNS TABLE (id UUID, idempotency_key TEXT, created BOOLEAN)
LANGUAGE plpgsql
SECURITY DEFINER
"#,
            pinned_search_path!(),
            r#"
AS $fn$
-- Parameters are always written qualified ({table}_enqueue_batch.name): a bare name is the
-- column.
#variable_conflict use_column
DECLARE
    f_created UUID[];
BEGIN
    -- Keys already taken are left alone (DO NOTHING: no lock on another writer's event); the
    -- events holding the batch's keys are read afterwards, on a new snapshot.
    WITH u AS MATERIALIZED (
        SELECT * FROM ROWS FROM (
            pg_catalog.unnest({table}_enqueue_batch.ids),
            pg_catalog.unnest({table}_enqueue_batch.aggregate_types),
            pg_catalog.unnest({table}_enqueue_batch.aggregate_ids),
            pg_catalog.unnest({table}_enqueue_batch.event_types),
            pg_catalog.unnest({table}_enqueue_batch.payloads),
            pg_catalog.unnest({table}_enqueue_batch.destinations),
            pg_catalog.unnest({table}_enqueue_batch.headers),
            pg_catalog.unnest({table}_enqueue_batch.idempotency_keys),
            pg_catalog.unnest({table}_enqueue_batch.occurred_ats)
        ) WITH ORDINALITY AS u(id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                               idempotency_key, occurred_at, ord)
    ),
"#
        )
    };
}

/// The plain layout's inserts of the batch enqueue function.
macro_rules! plain_enqueue_batch_tail {
    () => {
        r#"    written AS (
        INSERT INTO {t} AS o (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                              idempotency_key, occurred_at)
        SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination,
               u.headers::jsonb, u.idempotency_key, u.occurred_at
        FROM u ORDER BY u.ord
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING o.id
    )
    SELECT pg_catalog.array_agg(w.id) INTO f_created FROM written w;
    RETURN QUERY
    SELECT e.id, e.idempotency_key, e.id = ANY (coalesce(f_created, '{}'))
    FROM {t} e
    WHERE e.idempotency_key = ANY ({table}_enqueue_batch.idempotency_keys);
END;
$fn$;
"#
    };
}

/// The partitioned layout's inserts of the batch enqueue function: the keys rows, then the
/// events whose keys row was written, each with its keys row's `enqueued_at`.
macro_rules! partitioned_enqueue_batch_tail {
    () => {
        r#"    kept AS (
        INSERT INTO "{schema}"."{table}_keys" AS k (id, idempotency_key)
        SELECT u.id, u.idempotency_key FROM u ORDER BY u.ord
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING k.id, k.enqueued_at
    ),
    written AS (
        INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                         idempotency_key, occurred_at, enqueued_at)
        SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination,
               u.headers::jsonb, u.idempotency_key, u.occurred_at, kept.enqueued_at
        FROM u JOIN kept ON kept.id = u.id
        ORDER BY u.ord
        RETURNING 1
    )
    SELECT pg_catalog.array_agg(kept.id) INTO f_created FROM kept;
    RETURN QUERY
    SELECT k.id, k.idempotency_key, k.id = ANY (coalesce(f_created, '{}'))
    FROM "{schema}"."{table}_keys" k
    WHERE k.idempotency_key = ANY ({table}_enqueue_batch.idempotency_keys);
END;
$fn$;
"#
    };
}

/// The migration that leaves writers needing INSERT and EXECUTE only (7 plain, 6 partitioned):
/// the header trigger's function and the enqueue function again with a pinned `search_path`,
/// the enqueue function and the new batch function running as their owner, and EXECUTE on
/// both taken from PUBLIC and given to the roles that can insert into the outbox table now.
/// `$enqueue_tail` and `$batch_tail` name the layout's inserts.
macro_rules! least_privilege_migration {
    ($version:literal, $enqueue_tail:ident, $batch_tail:ident) => {
        Migration {
            version: $version,
            description: "least privilege: routines run as their owner with a pinned search_path; writers need INSERT and EXECUTE only",
            sql: concat!(
                r#"
-- Writers need INSERT on the outbox table (for a plain INSERT) and EXECUTE on the enqueue
-- functions, nothing more. The enqueue function used to run with the caller's rights, and its
-- duplicate-key upsert (ON CONFLICT ... DO UPDATE ... RETURNING) made every writer hold
-- SELECT (id, idempotency_key) and UPDATE (idempotency_key) on the table: enough to lock other
-- services' pending events (SELECT ... FOR UPDATE) and to rewrite their idempotency keys. Now:
--
-- - `{table}_enqueue`, and `{table}_enqueue_batch` (new: the Rust library's enqueue of events
--   with an idempotency key, and of every event in the partitioned layout), are SECURITY
--   DEFINER: they run as their owner, the role that runs these migrations. They insert with
--   ON CONFLICT DO NOTHING and then read the event holding a key that was taken, without
--   locking it: a caller learns that event's id, as before, and can neither lock nor change a
--   row.
-- - Every function the migrations install pins its search_path to pg_catalog (then pg_temp,
--   where PostgreSQL never looks a function up) and names what it calls with its schema, so
--   neither the caller's search_path nor a function someone created in `public` (such as a
--   `jsonb_path_exists(jsonb, text)`, which the header trigger's unqualified call preferred to
--   the built-in one) runs in their place, with the rights of whoever writes the row, the
--   relay's role included.
-- - EXECUTE on the two enqueue functions is taken from PUBLIC (a SECURITY DEFINER function any
--   role may call would let every role with USAGE on the schema write events) and given to
--   each role that holds INSERT on the outbox table now, so writers that could enqueue before
--   still can. Give it to new writers yourself (docs/table-contract.md, "Privileges").
--
-- Creating or replacing a function is a catalog change: no row is read or written, and
-- writers wait only for the migration's transaction.
"#,
                check_headers_function_pinned!(),
                "\n",
                enqueue_function_v3_head!(),
                $enqueue_tail!(),
                "\n",
                enqueue_batch_function_head!(),
                $batch_tail!(),
                r#"COMMENT ON FUNCTION "{schema}"."{table}_enqueue_batch"(UUID[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TIMESTAMPTZ[]) IS
    'outbox: the Rust library''s enqueue of a batch (events as arrays, written in array order): one row per event with an idempotency key, its event''s id and whether this call wrote it. Runs as its owner; callers need EXECUTE only.';

REVOKE ALL ON FUNCTION "{schema}"."{table}_enqueue"(TEXT, TEXT, TEXT, JSON, JSONB, TEXT, TEXT, TIMESTAMPTZ, UUID) FROM PUBLIC;
REVOKE ALL ON FUNCTION "{schema}"."{table}_enqueue_batch"(UUID[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TIMESTAMPTZ[]) FROM PUBLIC;
DO $grant$
DECLARE
    f_grantee TEXT;
BEGIN
    FOR f_grantee IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE pg_catalog.quote_ident(r.rolname) END
        FROM pg_catalog.pg_class c
        CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
        LEFT JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE c.oid = '{t}'::pg_catalog.regclass
          AND a.privilege_type = 'INSERT'
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT EXECUTE ON FUNCTION "{schema}"."{table}_enqueue"(TEXT, TEXT, TEXT, JSON, JSONB, TEXT, TEXT, TIMESTAMPTZ, UUID), '
            '"{schema}"."{table}_enqueue_batch"(UUID[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TIMESTAMPTZ[]) TO %s',
            f_grantee);
    END LOOP;
END
$grant$;
"#
            ),
        }
    };
}

/// The outbox schema, oldest first. Never edit a released entry: add a new one.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "outbox events table, claim and ordering indexes",
        sql: concat!(
            r#"
-- Lifecycle (see outbox_core::EventState): pending -> in_flight -> delivered | dead.
-- The seeds' new / sent / error are pending / delivered / dead; a pending row with attempts > 0
-- is one waiting for a retry.
CREATE TABLE {t} (
    seq              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id               UUID        NOT NULL,
    aggregate_type   TEXT        NOT NULL,
    aggregate_id     TEXT        NOT NULL,
    event_type       TEXT        NOT NULL,
    -- json, not jsonb: the bytes the writer produced are the bytes a sink publishes.
"#,
            event_columns!(),
            r#"    CONSTRAINT {table}_id_key UNIQUE (id)
);

-- A second enqueue with the same key finds the first row.
CREATE UNIQUE INDEX {table}_idempotency_key ON {t} (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Claim scans only undelivered rows, in enqueue order: its cost does not grow with the number
-- of delivered rows kept for retention.
CREATE INDEX {table}_open ON {t} (seq)
    WHERE status IN ('pending', 'in_flight');

-- Rows that can hold back later events of their aggregate: in flight, dead, or waiting for a
-- retry. Small by construction, so the per-aggregate order check is a short index probe.
CREATE INDEX {table}_blockers ON {t} (aggregate_type, aggregate_id, seq)
    WHERE status IN ('in_flight', 'dead') OR (status = 'pending' AND attempts > 0);
"#
        ),
    },
    Migration {
        version: 2,
        description: "claimed_at, paused destinations, dead-row index, autovacuum settings",
        sql: r#"
-- When the row was last claimed: `outbox status` shows which relay holds claims since when.
-- Nullable without a default, so adding it rewrites nothing (a catalog change only). It stays
-- set after the row leaves in_flight (the last claim's time); only in_flight rows read it.
ALTER TABLE {t} ADD COLUMN claimed_at TIMESTAMPTZ;

-- Destinations an operator paused (`outbox pause`). Relays read it every poll and claim around
-- the paused destinations' events; the events themselves are not touched.
CREATE TABLE "{schema}"."{table}_paused" (
    destination TEXT        PRIMARY KEY,
    paused_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    paused_by   TEXT        NOT NULL
);

-- Dead rows in seq order: list_dead, the per-destination dead counts and dead-letter retention
-- read only these, however many delivered rows retention keeps. (Building it reads the table
-- once, under a lock that holds writers back for that time.)
CREATE INDEX {table}_dead ON {t} (seq) WHERE status = 'dead';

-- Autovacuum for a queue table. Every event leaves three or more dead row versions behind
-- (claim, ack, each retry, and the purge's delete), and none of those updates can be HOT:
-- `status` appears in the partial indexes' predicates. With the defaults (vacuum once 20% of
-- the table is dead) a table keeping a week of delivered events for retention collects
-- millions of dead versions between two vacuums, and the small `_open` and `_blockers` indexes
-- every claim reads fill with dead entries: claims slow down exactly when the backlog grows.
-- Vacuum instead after 1000 + 1% dead rows, analyze after 1000 + 2% changed rows (the status
-- mix shifts quickly and the planner's choice of partial index depends on it), and let the
-- worker run with half the default cost delay so it keeps up. Setting these takes a SHARE
-- UPDATE EXCLUSIVE lock: reads and writes go on. Tune further with `ALTER TABLE … SET`;
-- see the crate docs.
ALTER TABLE {t} SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_analyze_threshold = 1000,
    autovacuum_vacuum_cost_delay = 1
);
"#,
    },
    heads_index_migration!(3, ""),
    blockers_migration!(
        4,
        r#"
-- An outage (the destination unavailable) costs a waiting event no attempt, so `attempts` alone
-- no longer tells whether a pending row has failed and waits for its retry: its `last_error`
-- does (every retry writes it). The blockers are rebuilt with that mark: the new index first
-- (it reads the table once, under a lock that holds writers back but lets claims read), then the
-- old one goes (an exclusive lock held only from the drop to the commit). With many delivered
-- rows retained, build it ahead without holding writers back:
--   CREATE INDEX CONCURRENTLY {table}_blockers_next ON ... (this predicate);
-- the migration then finds it and only swaps the names.
"#,
        "CREATE INDEX IF NOT EXISTS"
    ),
    enqueue_function_migration!(5, plain_enqueue_tail),
    Migration {
        version: 6,
        description: "rows checked when written: id default, header trigger, enqueue refuses reserved headers",
        sql: concat!(
            r#"
-- `id` defaults to a new version 7 UUID, time-ordered, built as the enqueue function builds it
-- (PostgreSQL 15 has no uuidv7()), so a writer in any language may leave it out and still get
-- ids that index well. Setting a default is a catalog change: no row is rewritten.
ALTER TABLE {t} ALTER COLUMN id SET DEFAULT "#,
            uuid_v7_sql!(),
            r#";

-- Headers are checked when a row is written, not only when it is delivered: a JSON object whose
-- values are all strings, with no name under the prefix outbox- (the relay's own message
-- headers; outbox-partition, which the WAL relay stores itself, excepted). Such a row used to
-- insert and was dead-lettered when the relay claimed it; now the writer's INSERT fails with
-- SQLSTATE 23514 and a message naming the header, inside the writer's own transaction.
-- A trigger rather than a CHECK constraint: it costs a writer a fifth of what the constraint
-- would (PostgreSQL prepares check constraints again for every statement), it looks at inserts
-- and at updates that set `headers` only (the relay never does), so rows written before it are
-- settled by the relay as before and nothing needs validating, and it names the header.
-- Creating it reads no row; the table's lock is held only for the catalog change.
"#,
            header_trigger_and_enqueue_v2!(plain_enqueue_tail)
        ),
    },
    least_privilege_migration!(7, plain_enqueue_v3_tail, plain_enqueue_batch_tail),
];

/// The partitioned layout (see [`crate::Partitioning`]), oldest first. A separate list: the
/// tables differ from the plain layout's from the first version on. Never edit a released entry.
pub(crate) const PARTITIONED_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "partitioned outbox: events range-partitioned by enqueued_at, keys table, paused destinations",
        sql: concat!(
            r#"
-- Lifecycle and columns as in the plain layout (pending -> in_flight -> delivered | dead).
--
-- Range-partitioned by enqueued_at, so retention drops whole partitions: no DELETE of delivered
-- rows, no dead versions for vacuum to clean, no index bloat from them. A partitioned table's
-- unique constraints must contain the partition key, so:
-- - seq comes from a sequence (identity columns on partitioned tables need PostgreSQL 17), and
--   the primary key is (seq, enqueued_at); seq alone is still unique, since only the sequence
--   writes it;
-- - the id and the idempotency key are kept unique across partitions by the small,
--   unpartitioned `_keys` table, written by the same enqueue statement.
CREATE SEQUENCE "{schema}"."{table}_seq";

CREATE TABLE {t} (
    seq              BIGINT      NOT NULL DEFAULT nextval('"{schema}"."{table}_seq"'),
    id               UUID        NOT NULL,
    aggregate_type   TEXT        NOT NULL,
    aggregate_id     TEXT        NOT NULL,
    event_type       TEXT        NOT NULL,
"#,
            event_columns!(),
            r#"    claimed_at       TIMESTAMPTZ,
    PRIMARY KEY (seq, enqueued_at)
) PARTITION BY RANGE (enqueued_at);

ALTER SEQUENCE "{schema}"."{table}_seq" OWNED BY {t}.seq;

-- Catches rows no dated partition covers (maintenance fell behind): a writer never fails for
-- want of a partition. Rotation never drops it; purge_delivered cleans it row by row.
CREATE TABLE "{schema}"."{table}_default" PARTITION OF {t} DEFAULT;

-- get() by id (uniqueness is the keys table's job).
CREATE INDEX {table}_id ON {t} (id);

-- The same partial indexes as the plain layout, created on every partition.
CREATE INDEX {table}_open ON {t} (seq)
    WHERE status IN ('pending', 'in_flight');
CREATE INDEX {table}_blockers ON {t} (aggregate_type, aggregate_id, seq)
    WHERE status IN ('in_flight', 'dead') OR (status = 'pending' AND attempts > 0);
CREATE INDEX {table}_dead ON {t} (seq) WHERE status = 'dead';

-- One row per event: its id and idempotency key, and the enqueued_at that says which
-- partition it lives in. Rows go when their event is deleted (same statement) or, for a
-- dropped partition, by enqueued_at range right after the drop.
CREATE TABLE "{schema}"."{table}_keys" (
    id              UUID        PRIMARY KEY,
    idempotency_key TEXT,
    enqueued_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX {table}_keys_idempotency_key ON "{schema}"."{table}_keys" (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX {table}_keys_enqueued_at ON "{schema}"."{table}_keys" (enqueued_at);

CREATE TABLE "{schema}"."{table}_paused" (
    destination TEXT        PRIMARY KEY,
    paused_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    paused_by   TEXT        NOT NULL
);
"#
        ),
    },
    heads_index_migration!(2, "-- Created on every partition.\n"),
    blockers_migration!(
        3,
        r#"
-- An outage (the destination unavailable) costs a waiting event no attempt, so `attempts` alone
-- no longer tells whether a pending row has failed and waits for its retry: its `last_error`
-- does (every retry writes it). The blockers are rebuilt with that mark. Building reads the
-- table once, under a lock that holds writers back meanwhile.
-- Created (first) and dropped on every partition.
"#,
        "CREATE INDEX"
    ),
    enqueue_function_migration!(4, partitioned_enqueue_tail),
    Migration {
        version: 5,
        description: "rows checked when written: keys id default, header trigger, enqueue refuses reserved headers",
        sql: concat!(
            r#"
-- The keys table's `id` defaults to a new version 7 UUID, built as the enqueue function builds
-- it. The event table's `id` gets no default on purpose: an event's id must be the one of its
-- keys row (that row is what keeps ids unique across partitions), so a writer that writes the
-- two by hand inserts the keys row first, leaving out `id`, and gives the event the id and
-- `enqueued_at` it returns (docs/table-contract.md); an event row without an id still fails,
-- instead of getting one no keys row has.
ALTER TABLE "{schema}"."{table}_keys" ALTER COLUMN id SET DEFAULT "#,
            uuid_v7_sql!(),
            r#";

-- Headers are checked when a row is written, exactly as in the plain layout (migration 6
-- there): a JSON object of string values without a name under the reserved prefix outbox-
-- (outbox-partition excepted), by a trigger on inserts and on updates that set `headers`.
-- Created on the partitioned table, it fires on every partition, present and future.
"#,
            header_trigger_and_enqueue_v2!(partitioned_enqueue_tail)
        ),
    },
    least_privilege_migration!(
        6,
        partitioned_enqueue_v3_tail,
        partitioned_enqueue_batch_tail
    ),
];

/// The migrations of `outbox`'s layout.
pub(crate) fn migrations_for(outbox: &PgOutbox) -> &'static [Migration] {
    if outbox.partitioning().is_some() {
        PARTITIONED_MIGRATIONS
    } else {
        MIGRATIONS
    }
}

/// The newest schema version this build knows for `outbox`'s layout.
pub(crate) fn latest_version(outbox: &PgOutbox) -> i64 {
    outbox_types::migration::latest_version(migrations_for(outbox))
}

pub(crate) async fn run(outbox: &PgOutbox, pool: &PgPool) -> Result<MigrationReport, StoreError> {
    let bookkeeping = outbox.migrations_table();
    let mut tx = pool.begin().await.map_err(map_sqlx)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(outbox.lock_key("migrate"))
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(bookkeeping_ddl(outbox)))
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?;

    let applied_before: Vec<(i64, String)> =
        outbox_types::applied_migrations!(&mut *tx, bookkeeping, map_sqlx)?;
    check_layout(outbox, &mut tx).await?;
    let migrations = migrations_for(outbox);

    let mut applied = Vec::new();
    for m in pending(Schema::OUTBOX, migrations, &applied_before)? {
        let insert = format!(
            "INSERT INTO {bookkeeping} (version, description, checksum) VALUES ($1, $2, $3)"
        );
        outbox_types::apply_migration!(tx, outbox.render(m.sql), insert, m, map_sqlx)?;
        applied.push(m.version);
    }
    tx.commit().await.map_err(map_sqlx)?;
    Ok(outbox_types::migration_report!(
        applied,
        migrations,
        schema = outbox.schema(),
        table = outbox.table()
    ))
}

/// The schema and the table that record which migrations were applied (created when missing).
fn bookkeeping_ddl(outbox: &PgOutbox) -> String {
    outbox_types::migration::postgres_bookkeeping_ddl(outbox.schema(), &outbox.migrations_table())
}

/// Everything [`run`] applies to a database without this outbox, as one SQL script: the
/// bookkeeping table, each migration as it is rendered for `outbox`, and the row that records
/// it (with the checksum `run` checks), in one transaction. Applied by another tool (Flyway,
/// Liquibase, Alembic, psql), it leaves a database that `run` finds current and the relay
/// accepts.
pub(crate) fn script(outbox: &PgOutbox) -> String {
    let migrations = migrations_for(outbox);
    let mut out = format!(
        "-- The outbox {} on PostgreSQL, {} layout, schema version {}: the DDL `outbox migrate`\n\
         -- applies to a database without it, and the bookkeeping rows that record it applied.\n\
         -- Apply it whole and unedited (`outbox migrate` checks each migration's checksum).\n\
         BEGIN;\n\n{}\n",
        outbox.qualified_table(),
        if outbox.partitioning().is_some() {
            "partitioned"
        } else {
            "plain"
        },
        latest_version(outbox),
        bookkeeping_ddl(outbox)
    );
    for m in migrations {
        out.push_str(&format!(
            "\n-- Migration {}: {}\n{}\nINSERT INTO {} (version, description, checksum) VALUES ({}, {}, '{}');\n",
            m.version,
            m.description,
            outbox.render(m.sql).trim(),
            outbox.migrations_table(),
            m.version,
            sql_text(m.description),
            m.checksum()
        ));
    }
    if outbox.partitioning().is_some() {
        out.push_str(
            "\n-- The dated partitions are not in this script: the relay creates them ahead as it runs\n\
             -- (and `outbox migrate` does once); until then the default partition takes every row.\n",
        );
    }
    out.push_str("\nCOMMIT;\n");
    out
}

/// `text` as a SQL string literal.
fn sql_text(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// An outbox table that exists must have the layout `outbox` expects: a plain table for a plain
/// outbox, a partitioned one for a partitioned outbox (the migrations of one layout would
/// otherwise be checked against the other's, with a misleading "migration differs" error).
async fn check_layout(
    outbox: &PgOutbox,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
) -> Result<(), StoreError> {
    let kind: Option<String> = sqlx::query_scalar(
        "SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND c.relname = $2",
    )
    .bind(outbox.schema())
    .bind(outbox.table())
    .fetch_optional(&mut **tx)
    .await
    .map_err(map_sqlx)?;
    let partitioned = match kind.as_deref() {
        None => return Ok(()),
        Some("p") => true,
        Some(_) => false,
    };
    match (partitioned, outbox.partitioning().is_some()) {
        (true, false) => Err(StoreError::NotMigrated(format!(
            "outbox table {} is partitioned: open it with PgOutbox::partitioned (the outbox binary: database.layout = \"partitioned\")",
            outbox.qualified_table()
        ))),
        (false, true) => Err(StoreError::NotMigrated(format!(
            "outbox table {} is a plain table, not a partitioned one: open it with PgOutbox::with_names (the outbox binary: database.layout = \"plain\"), or see the outbox-postgresql crate docs for moving to the partitioned layout",
            outbox.qualified_table()
        ))),
        _ => Ok(()),
    }
}

/// The schema version the database is at, `0` when the outbox was never migrated there.
pub(crate) async fn current_version(outbox: &PgOutbox, pool: &PgPool) -> Result<i64, StoreError> {
    let exists =
        sqlx::query_scalar("SELECT count(to_regclass($1))").bind(outbox.migrations_table());
    outbox_types::recorded_version!(pool, exists, outbox.migrations_table(), map_sqlx)
}

#[cfg(test)]
mod released {
    use super::*;

    outbox_types::released_migrations_test! {
        MIGRATIONS => [
            (1, "0a8d25c6f810a039"),
            (2, "9ac7c6123d20c3f8"),
            (3, "ef6dc1f74bc4514d"),
            (4, "c0c7411a2a8cde39"),
            (5, "07918ce1dea4acaa"),
            (6, "ba60053e899f941e"),
        ],
        PARTITIONED_MIGRATIONS => [
            (1, "75d66952a4ec90d4"),
            (2, "4c76a5fbe27f773b"),
            (3, "df72cc71c6a52f1b"),
            (4, "77d2bee6eb2cee56"),
            (5, "026013792a49ea9d"),
        ],
    }
}
