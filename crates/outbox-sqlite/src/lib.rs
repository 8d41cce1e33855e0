//! # outbox-sqlite
//!
//! The SQLite home of the outbox: embedded migrations, [`SqliteOutbox::enqueue`] into the
//! caller's own transaction, and [`SqliteStore`], the [`Store`] a relay claims from. It keeps the
//! same contract as the PostgreSQL store and passes the same conformance suite
//! (`outbox-store-tests`).
//!
//! ```no_run
//! use outbox_types::NewEvent;
//! use outbox_sqlite::{SqliteOutbox, SqliteStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("app.db", SqliteOutbox::new()).await?; // table "outbox_events"
//! store.outbox().migrate(store.pool()).await?;
//!
//! // BEGIN IMMEDIATE: the writer takes the write lock up front (see "Writers" below).
//! let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await?;
//! sqlx::query("INSERT INTO orders (id, amount) VALUES (?1, ?2)")
//!     .bind(42_i64).bind(1999_i64)
//!     .execute(&mut *tx).await?;
//! let event = NewEvent::new("order", "42", "OrderCreated", &serde_json::json!({"amount": 1999}))?;
//! store.outbox().enqueue(&mut *tx, &event).await?;
//! tx.commit().await?; // the order and its event exist together, or neither does
//! # Ok(()) }
//! ```
//!
//! ## Several relays on one file
//!
//! SQLite has one writer at a time per database file, and that is the serialization the
//! [`Store`] contract asks for: every relay-side write (claim, ack, retry, bury, release and the
//! admin operations) is **one autocommit statement**. A claim is a single
//! `UPDATE … WHERE seq IN (SELECT … ORDER BY seq LIMIT ?) RETURNING …`, so it sees every earlier
//! claim's result and no other writer can slip in between its read and its write.
//!
//! A single write statement also *starts* as a write: SQLite takes the write lock before the
//! statement reads anything, and waiting for that lock is covered by the busy timeout. The trap
//! this avoids is the deferred transaction that reads first and writes later: when another
//! connection wrote in between, SQLite cannot upgrade the read transaction and fails at once with
//! `SQLITE_BUSY`, which the busy timeout does **not** retry. The store never does that; the only
//! multi-statement transaction it runs (migrations) uses `BEGIN IMMEDIATE`.
//!
//! Inside one process the writes also queue on an async mutex held by the [`SqliteStore`] (and
//! its clones), so many relay tasks wait their turn in FIFO order instead of polling SQLite's
//! busy handler. Other processes (other pools) are held off by SQLite's own lock and the busy
//! timeout that [`SqliteStore::connect`] sets.
//!
//! ## Writers
//!
//! [`SqliteOutbox::enqueue`] and [`SqliteOutbox::enqueue_batch`] run one statement each on the
//! executor they are given and never commit. Open the business transaction with
//! `pool.begin_with("BEGIN IMMEDIATE")` when it reads before it writes, for the reason above; a
//! transaction whose first statement is a write is safe with a plain `begin()`.
//!
//! ## What the table checks when a row is written
//!
//! Writers in other languages insert into the table by hand, so the table itself refuses what
//! the relay could only dead-letter later (migration 4; the writers' contract is
//! `docs/table-contract.md`). Triggers check `headers` on insert (and when an `UPDATE` sets it):
//! a JSON object whose values are all strings, with no name under the prefix `outbox-` (the
//! relay's own message headers) other than `outbox-partition`; a bad row fails the writer's
//! statement with `SQLITE_CONSTRAINT` and a message naming the rule. [`SqliteOutbox::enqueue`]
//! refuses the same names before sending anything. Triggers, because a CHECK constraint cannot
//! read `json_each`; they never look at rows already there, so an outbox upgrades whatever it
//! holds and the relay settles old rows as before.
//!
//! Unlike PostgreSQL and MySQL, `id` has **no default** here: SQLite cannot add one to an
//! existing column, and the rebuild that would (copying every retained row under the write
//! lock) stalls writers for something each of them has in one call. A writer gives the id
//! (lowercase hyphenated UUID text, v7 preferred); without one the insert trigger says so.
//!
//! ## Time
//!
//! Timestamps are `INTEGER` microseconds since the Unix epoch and "now" is read from the host
//! clock in Rust and bound into each statement. SQLite has no clock of its own (its date functions
//! read the same host clock), every process sharing a file runs on that one host (SQLite over a
//! network file system is not safe anyway), and binding the value gives microseconds (SQLite's
//! `'now'` has milliseconds) and exact integer arithmetic. Lease expiries, retry due times and
//! purge cut-offs are computed from that "now" in Rust, so no overflowing SQL arithmetic can turn
//! a timestamp into a float. "Now" is read when the statement is issued; if the statement then
//! waits for another process's write lock, it runs with a slightly earlier "now", which only
//! errs on the safe side (fewer events look due or expired, leases end a little early).
//! `enqueued_at` is the time of the enqueue call (PostgreSQL records its transaction's start).
//!
//! ## Batches
//!
//! SQLite has no array binds, so a batch travels as one JSON array bound to one parameter and
//! unpacked with `json_each`: one statement per batch (ack, retry, bury, release, requeue,
//! discard, enqueue_batch), with no limit on the batch size from SQLite's host-parameter cap.

mod error;
mod migrations;
mod names;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_types::route::{RouteTable, SqlDialect};
use outbox_types::{
    AggregateKey, BuryEvent, Claim, ClaimRequest, ClaimSort, DeadFilter, DeadLetterPolicy,
    DestinationStats, Event, EventId, EventRecord, Lease, LeaseHolder, NewEvent, OutboxStats,
    PausedDestination, Reading, ReplayFilter, ReplayStep, RetryEvent, Store, StoreError,
};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row, SqliteExecutor, SqlitePool};
use tokio::sync::Mutex;
use uuid::Uuid;

pub use migrations::MigrationReport;

use error::{is_busy, map_sqlx};
use names::check_table_name;
use outbox_types::migration::{Schema, check_current};
use outbox_types::sql_store::{
    check_destination, count, decode_headers, id_list, json_text, micros, parse_event_id,
    parse_state,
};

/// The default outbox table.
pub const DEFAULT_TABLE: &str = "outbox_events";

/// How long a statement waits for another connection's write lock before it fails with a
/// transient [`StoreError::Unavailable`]; set by [`SqliteStore::connect`].
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The result of an enqueue (shared by every store: [`outbox_types::sql_store::Enqueued`]).
pub use outbox_types::sql_store::Enqueued;

/// Where the outbox table lives, and the SQL to use it. Cheap to clone.
///
/// The table name is configurable so the outbox never collides with the application's own
/// tables; the default is [`DEFAULT_TABLE`]. Migrations are recorded in `<table>_migrations`.
#[derive(Clone, Debug)]
pub struct SqliteOutbox {
    inner: Arc<Names>,
}

#[derive(Debug)]
struct Names {
    table: String,
    quoted: String,
    sql: Sql,
}

/// Statements rendered once per outbox (they embed the table name).
#[derive(Debug)]
struct Sql {
    enqueue: String,
    enqueue_batch: String,
    claim: String,
    ack: String,
    retry: String,
    bury: String,
    release: String,
    get: String,
    list_dead: String,
    requeue_dead_ids: String,
    requeue_dead_all: String,
    discard_dead_ids: String,
    discard_dead_all: String,
    purge: String,
    stats: String,
    leases: String,
    pause: String,
    resume: String,
    paused: String,
    purge_dead: String,
}

/// What a claim returns: the event's columns, with the payload left out (NULL) when it is above
/// the claim's `?8` bytes, and its size.
const CLAIMED_COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, \
     CASE WHEN length(CAST(payload AS BLOB)) > ?8 THEN NULL ELSE payload END AS payload, \
     length(CAST(payload AS BLOB)) AS payload_bytes, \
     destination, headers, idempotency_key, occurred_at, enqueued_at, attempts";

const RECORD_COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, payload, \
     destination, headers, idempotency_key, occurred_at, enqueued_at, attempts, \
     status, next_attempt_at, last_error, lease_owner, lease_expires_at, delivered_at, dead_at";

impl Default for SqliteOutbox {
    fn default() -> Self {
        Self::new()
    }
}

impl SqliteOutbox {
    /// The outbox in table [`DEFAULT_TABLE`] (`outbox_events`).
    pub fn new() -> Self {
        Self::with_table(DEFAULT_TABLE).unwrap_or_else(|_| unreachable!("the default is valid"))
    }

    /// The outbox in table `table`: a plain lowercase identifier (`[a-z_][a-z0-9_]*`, at most 48
    /// characters, not starting with `sqlite_`). Anything else is refused before any SQL runs.
    ///
    /// ```
    /// assert!(outbox_sqlite::SqliteOutbox::with_table("billing_outbox").is_ok());
    /// let err = outbox_sqlite::SqliteOutbox::with_table("x; drop table y").unwrap_err();
    /// assert!(err.to_string().contains("not a plain identifier"));
    /// ```
    pub fn with_table(table: &str) -> Result<Self, StoreError> {
        check_table_name(table)?;
        let quoted = format!("\"{table}\"");
        let sql = Sql::render(&quoted, &format!("\"{table}_paused\""));
        Ok(SqliteOutbox {
            inner: Arc::new(Names {
                table: table.to_owned(),
                quoted,
                sql,
            }),
        })
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// `"table"`, ready to use in SQL.
    pub fn quoted_table(&self) -> &str {
        &self.inner.quoted
    }

    pub(crate) fn migrations_table(&self) -> String {
        format!("\"{}_migrations\"", self.inner.table)
    }

    pub(crate) fn render(&self, template: &str) -> String {
        template
            .replace("{t}", &self.inner.quoted)
            .replace("{table}", &self.inner.table)
    }

    /// Create or upgrade the outbox schema. Idempotent, safe to call from several processes at
    /// once (they queue on SQLite's write lock), and atomic.
    pub async fn migrate(&self, pool: &SqlitePool) -> Result<MigrationReport, StoreError> {
        migrations::run(self, pool).await
    }

    /// The DDL [`SqliteOutbox::migrate`] applies to a database without this outbox, with the
    /// bookkeeping rows that record it applied, as one SQL script (`outbox schema print`).
    pub fn schema_script(&self) -> String {
        migrations::script(self)
    }

    /// The schema version in the database (`0` if never migrated) and the newest this build
    /// knows.
    pub async fn schema_version(&self, pool: &SqlitePool) -> Result<(i64, i64), StoreError> {
        Ok((
            migrations::current_version(self, pool).await?,
            migrations::latest_version(),
        ))
    }

    /// Add `event` to the outbox through `executor` — normally `&mut *tx` of the caller's own
    /// transaction, so the event commits or rolls back with the business change. One statement;
    /// never commits by itself.
    ///
    /// With an idempotency key that is already in the table, nothing is written and the existing
    /// event's id comes back with `created: false`. A header name the table refuses (under the
    /// reserved prefix `outbox-`) is [`StoreError::Encode`] before anything is sent.
    pub async fn enqueue<'e, E: SqliteExecutor<'e>>(
        &self,
        executor: E,
        event: &NewEvent,
    ) -> Result<Enqueued, StoreError> {
        event.check_headers()?;
        let row = sqlx::query(AssertSqlSafe(self.inner.sql.enqueue.as_str()))
            .bind(event.id().to_string())
            .bind(event.aggregate_type())
            .bind(event.aggregate_id())
            .bind(event.event_type())
            .bind(event.payload())
            .bind(event.destination())
            .bind(event.headers_json())
            .bind(event.idempotency_key())
            .bind(clamp_micros(event.occurred_at().timestamp_micros()))
            .bind(now_micros())
            .fetch_optional(executor)
            .await
            .map_err(map_sqlx)?;
        match row {
            Some(row) => {
                let id = decode_id(&row, "id", 0)?;
                Ok(Enqueued {
                    id,
                    created: id == event.id(),
                })
            }
            // The key is taken by a row with this very id: the same event enqueued again.
            None => Ok(Enqueued {
                id: event.id(),
                created: false,
            }),
        }
    }

    /// Add several events in one statement, in order. Same rules as [`SqliteOutbox::enqueue`]; a
    /// key repeated inside the batch counts once (the first event wins).
    pub async fn enqueue_batch<'e, E: SqliteExecutor<'e>>(
        &self,
        executor: E,
        events: &[NewEvent],
    ) -> Result<Vec<Enqueued>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        // First occurrence of each key is written; later ones resolve to it.
        let mut first_with_key: HashMap<&str, usize> = HashMap::new();
        let mut to_write = Vec::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            event.check_headers()?;
            match event.idempotency_key() {
                Some(key) if first_with_key.contains_key(key) => {}
                Some(key) => {
                    first_with_key.insert(key, i);
                    to_write.push(batch_row(event));
                }
                None => to_write.push(batch_row(event)),
            }
        }
        let rows_json = serde_json::Value::Array(to_write).to_string();
        let rows = sqlx::query(AssertSqlSafe(self.inner.sql.enqueue_batch.as_str()))
            .bind(rows_json)
            .bind(now_micros())
            .fetch_all(executor)
            .await
            .map_err(map_sqlx)?;
        // Rows come back for inserted events and for keys that matched another event; a key
        // with no row matched an event with the same id (the same event enqueued again).
        let mut by_key: HashMap<String, EventId> = HashMap::new();
        for row in &rows {
            let key: Option<String> = row.try_get("idempotency_key").map_err(map_sqlx)?;
            if let Some(key) = key {
                by_key.insert(key, decode_id(row, "id", 0)?);
            }
        }
        Ok(events
            .iter()
            .enumerate()
            .map(|(i, e)| match e.idempotency_key() {
                None => Enqueued {
                    id: e.id(),
                    created: true,
                },
                Some(key) => {
                    let first = first_with_key.get(key).copied().unwrap_or(i);
                    let written = events.get(first).map(NewEvent::id).unwrap_or(e.id());
                    let id = by_key.get(key).copied().unwrap_or(written);
                    Enqueued {
                        id,
                        created: i == first && by_key.get(key) == Some(&written),
                    }
                }
            })
            .collect())
    }
}

/// One event of a batch as a JSON object for `json_each`. The payload and headers travel as JSON
/// strings holding their exact text, so the stored bytes are the writer's bytes.
fn batch_row(e: &NewEvent) -> serde_json::Value {
    serde_json::json!({
        "id": e.id().to_string(),
        "aggregate_type": e.aggregate_type(),
        "aggregate_id": e.aggregate_id(),
        "event_type": e.event_type(),
        "payload": e.payload(),
        "destination": e.destination(),
        "headers": e.headers_json(),
        "idempotency_key": e.idempotency_key(),
        "occurred_at": clamp_micros(e.occurred_at().timestamp_micros()),
    })
}

impl Sql {
    /// `t` is the quoted outbox table, `p` the quoted paused-destinations table.
    fn render(t: &str, p: &str) -> Self {
        // The upsert only touches the existing row when its id differs from ours: then the row
        // comes back and its id (not ours) says "not created". When the key belongs to a row with
        // our own id (the same event enqueued twice) no row comes back, which says the same.
        // SQLite has no `xmax` to tell an insert from an update inside RETURNING.
        const UPSERT: &str = "ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
                 DO UPDATE SET idempotency_key = excluded.idempotency_key WHERE id <> excluded.id";
        Sql {
            // ?1 id … ?9 occurred_at, ?10 now.
            enqueue: format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                                  idempotency_key, occurred_at, enqueued_at, next_attempt_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10)
                 {UPSERT}
                 RETURNING id"
            ),
            // ?1 JSON array of events (see batch_row), ?2 now. `WHERE true` is required by
            // SQLite's grammar for INSERT … SELECT with an upsert clause.
            enqueue_batch: format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                                  idempotency_key, occurred_at, enqueued_at, next_attempt_at)
                 SELECT j.value ->> 'id', j.value ->> 'aggregate_type', j.value ->> 'aggregate_id',
                        j.value ->> 'event_type', j.value ->> 'payload', j.value ->> 'destination',
                        j.value ->> 'headers', j.value ->> 'idempotency_key', j.value ->> 'occurred_at',
                        ?2, ?2
                 FROM json_each(?1) AS j
                 WHERE true
                 ORDER BY j.key
                 {UPSERT}
                 RETURNING id, idempotency_key"
            ),
            claim: claim_sql(t, None),
            // ?1 JSON array of seqs, ?2 token, ?3 now.
            ack: format!(
                "UPDATE {t} SET status = 'delivered', delivered_at = ?3,
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq IN (SELECT value FROM json_each(?1)) AND lease_token = ?2 AND status = 'in_flight'"
            ),
            // ?1 JSON array of {seq, due, error, cost}, ?2 token.
            retry: format!(
                "UPDATE {t} AS o SET status = 'pending', attempts = o.attempts + (r.value ->> 'cost'),
                     next_attempt_at = r.value ->> 'due', last_error = r.value ->> 'error',
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM json_each(?1) AS r
                 WHERE o.seq = r.value ->> 'seq' AND o.lease_token = ?2 AND o.status = 'in_flight'"
            ),
            // ?1 JSON array of {seq, error}, ?2 token, ?3 now.
            bury: format!(
                "UPDATE {t} AS o SET status = 'dead', attempts = o.attempts + 1, dead_at = ?3,
                     last_error = r.value ->> 'error',
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM json_each(?1) AS r
                 WHERE o.seq = r.value ->> 'seq' AND o.lease_token = ?2 AND o.status = 'in_flight'"
            ),
            // ?1 JSON array of seqs, ?2 token.
            release: format!(
                "UPDATE {t} SET status = 'pending', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq IN (SELECT value FROM json_each(?1)) AND lease_token = ?2 AND status = 'in_flight'"
            ),
            get: format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE id = ?1"),
            list_dead: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} WHERE status = 'dead' AND seq > ?1 ORDER BY seq LIMIT ?2"
            ),
            // ?1 JSON array of ids, ?2 now.
            requeue_dead_ids: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = ?2, dead_at = NULL, last_error = NULL
                 WHERE status = 'dead' AND id IN (SELECT value FROM json_each(?1))"
            ),
            requeue_dead_all: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = ?1, dead_at = NULL, last_error = NULL
                 WHERE status = 'dead'"
            ),
            discard_dead_ids: format!(
                "DELETE FROM {t} WHERE status = 'dead' AND id IN (SELECT value FROM json_each(?1))"
            ),
            discard_dead_all: format!("DELETE FROM {t} WHERE status = 'dead'"),
            // ?1 cut-off, ?2 limit.
            purge: format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t}
                     WHERE status = 'delivered' AND delivered_at < ?1
                     ORDER BY seq LIMIT ?2)"
            ),
            // ?1 cut-off, ?2 limit. Through the `_dead` partial index.
            purge_dead: format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t}
                     WHERE status = 'dead' AND dead_at < ?1
                     ORDER BY seq LIMIT ?2)"
            ),
            // ?1 now. The first condition is the `_open` index's predicate, repeated so the
            // planner reads in-flight rows through it.
            leases: format!(
                "SELECT COALESCE(lease_owner, '') AS owner, count(*) AS events,
                        min(claimed_at) AS claimed_since, max(lease_expires_at) AS expires_at,
                        count(*) FILTER (WHERE lease_expires_at <= ?1) AS expired
                 FROM {t}
                 WHERE status IN ('pending', 'in_flight') AND status = 'in_flight'
                 GROUP BY 1 ORDER BY 1"
            ),
            // ?1 destination, ?2 now, ?3 by.
            pause: format!(
                "INSERT INTO {p} (destination, paused_at, paused_by) VALUES (?1, ?2, ?3)
                 ON CONFLICT (destination) DO NOTHING"
            ),
            resume: format!("DELETE FROM {p} WHERE destination = ?1"),
            paused: format!(
                "SELECT destination, paused_at, paused_by FROM {p} ORDER BY destination"
            ),
            stats: format!(
                "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                        count(*) FILTER (WHERE status = 'pending' AND (attempts > 0 OR last_error IS NOT NULL)) AS retrying,
                        count(*) FILTER (WHERE status = 'in_flight') AS in_flight,
                        count(*) FILTER (WHERE status = 'delivered') AS delivered,
                        count(*) FILTER (WHERE status = 'dead') AS dead,
                        (SELECT o.enqueued_at FROM {t} AS o
                         WHERE o.status IN ('pending', 'in_flight') ORDER BY o.seq LIMIT 1) AS oldest
                 FROM {t}"
            ),
        }
    }
}

/// The route expressions a claim with destinations on hold compares against the paused names:
/// the table's `CASE` over the candidate (`e`) and over the blocker probe's row (`b`), both
/// numbered from `?8` so they share their values.
struct HoldSql {
    route_e: String,
    route_b: String,
}

/// A route fragment's `?` placeholders as `?first`, `?first+1`, …: numbered, the fragment can
/// sit anywhere in a statement that also uses numbered parameters (a bare `?` takes the number
/// after the largest one used *before it in the text*, which would collide), and can appear
/// twice with the same values. Route values are always bound, so every `?` is a placeholder.
fn number_placeholders(sql: &str, first: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = first;
    for c in sql.chars() {
        if c == '?' {
            out.push_str(&format!("?{n}"));
            n += 1;
        } else {
            out.push(c);
        }
    }
    out
}

/// The claim statement. ?1 limit, ?2 owner, ?3 token, ?4 lease expiry, ?5 now, ?6 dead blocks
/// (0/1); with a hold, ?7 the paused names (a JSON array) and ?8… the route table's values.
///
/// A row is due when pending and its time has come, or in flight under an expired lease (its
/// relay died). It is held back by any earlier row of its aggregate that is in flight under a
/// live lease, waiting for a retry, or dead when dead blocks — unless that row's destination is
/// on hold (a paused destination's events hold back nobody). The outer scan repeats the
/// predicate of the `_open` partial index and the blocker probe that of the `_blockers` one, so
/// SQLite's planner uses both (checked by a test with EXPLAIN QUERY PLAN). One statement:
/// SQLite runs it under its single write lock, so concurrent claims are serialized and never
/// overlap. SQLite has no row locks, so the PostgreSQL claim's hole (SKIP LOCKED passing over an
/// earlier event another transaction holds, handing out its aggregate's next one) cannot open
/// here: a writer holding any row holds the whole database, and the claim waits for its commit
/// (busy timeout) and then sees every row as it is.
fn claim_sql(t: &str, hold: Option<&HoldSql>) -> String {
    let (hold_e, hold_b) = match hold {
        Some(h) => (
            format!(
                "AND COALESCE({}, '') NOT IN (SELECT value FROM json_each(?9))",
                h.route_e
            ),
            format!(
                "AND COALESCE({}, '') NOT IN (SELECT value FROM json_each(?9))",
                h.route_b
            ),
        ),
        None => (String::new(), String::new()),
    };
    format!(
        "UPDATE {t}
         SET status = 'in_flight', lease_owner = ?2, lease_token = ?3, lease_expires_at = ?4,
             claimed_at = ?5
         WHERE seq IN (
           -- The byte budget (?7 per batch, ?8 per event; see `ClaimRequest`): the due rows in
           -- seq order while the payloads before them add up to less than ?7, the first always.
           -- What it leaves out comes after everything it keeps. A payload above ?8 counts as
           -- nothing: it comes back without its payload and is buried.
           SELECT c.seq FROM (
             SELECT c.seq, c.b, sum(c.b) OVER (ORDER BY c.seq ROWS UNBOUNDED PRECEDING) AS running
             FROM (
             SELECT e.seq,
                    CASE WHEN length(CAST(e.payload AS BLOB)) > ?8 THEN 0
                         ELSE length(CAST(e.payload AS BLOB)) END AS b
             FROM {t} AS e
             WHERE e.status IN ('pending', 'in_flight')
               AND CASE WHEN e.status = 'pending' THEN e.next_attempt_at <= ?5
                        ELSE e.lease_expires_at <= ?5 END
               {hold_e}
               AND NOT EXISTS (
                   SELECT 1 FROM {t} AS b
                   WHERE b.aggregate_type = e.aggregate_type
                     AND b.aggregate_id = e.aggregate_id
                     AND b.seq < e.seq
                     AND (b.status IN ('in_flight', 'dead') OR (b.status = 'pending' AND (b.attempts > 0 OR b.last_error IS NOT NULL)))
                     AND CASE b.status
                             WHEN 'in_flight' THEN b.lease_expires_at > ?5
                             WHEN 'dead' THEN ?6
                             ELSE b.next_attempt_at > ?5 END
                     {hold_b})
             ORDER BY e.seq
             LIMIT ?1) AS c
           ) AS c
           WHERE c.running - c.b < ?7)
         RETURNING {CLAIMED_COLUMNS}"
    )
}

/// Backlog per destination: the route `CASE` (numbered from ?1) grouped over the undelivered
/// rows (the `_open` partial index) and the dead ones (the `_dead` index). Delivered rows, the
/// bulk of a table kept for retention, are never read.
fn destination_stats_sql(t: &str, route: &str) -> String {
    format!(
        "SELECT x.route AS route,
                count(*) FILTER (WHERE x.status = 'pending') AS pending,
                count(*) FILTER (WHERE x.status = 'pending' AND x.failed) AS retrying,
                count(*) FILTER (WHERE x.status = 'in_flight') AS in_flight,
                count(*) FILTER (WHERE x.status = 'dead') AS dead,
                min(x.enqueued_at) FILTER (WHERE x.status IN ('pending', 'in_flight')) AS oldest,
                -- The newest waiting row's error: the greatest zero-padded seq, cut off again.
                substr(max(CASE WHEN x.status IN ('pending', 'in_flight') AND x.last_error IS NOT NULL
                                THEN printf('%020d', x.seq) || x.last_error END), 21) AS last_error
         FROM (
             SELECT COALESCE({route}, '') AS route, e.seq, e.status, e.enqueued_at, e.last_error,
                    (e.attempts > 0 OR e.last_error IS NOT NULL) AS failed
             FROM {t} AS e WHERE e.status IN ('pending', 'in_flight')
             UNION ALL
             SELECT COALESCE({route}, '') AS route, e.seq, e.status, e.enqueued_at, NULL, 0
             FROM {t} AS e WHERE e.status = 'dead'
         ) AS x
         GROUP BY x.route"
    )
}

/// One replay step, one statement (so the page and the update are one atomic write). ?1 after
/// seq, ?2 from, ?3 to, ?4 event type or NULL, ?5 limit, ?6 now; with a destination, ?7 its name
/// and ?8… the route table's values. The page walks the primary key from ?1: delivered rows have
/// no index of their own, which keeps acks cheap.
fn replay_sql(t: &str, route: Option<&str>) -> String {
    let destination = route
        .map(|r| format!("AND COALESCE({r}, '') = ?7"))
        .unwrap_or_default();
    format!(
        "UPDATE {t}
         SET status = 'pending', attempts = 0, next_attempt_at = ?6, delivered_at = NULL,
             dead_at = NULL, last_error = NULL,
             lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
         WHERE seq IN (
             SELECT e.seq FROM {t} AS e
             WHERE e.status = 'delivered' AND e.seq > ?1
               AND e.enqueued_at >= ?2 AND e.enqueued_at < ?3
               AND (?4 IS NULL OR e.event_type = ?4)
               {destination}
             ORDER BY e.seq
             LIMIT ?5)
         RETURNING seq"
    )
}

/// The outbox as a relay sees it: a pool and an outbox location.
///
/// Clones share the pool and the in-process write queue (see the crate docs).
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    outbox: SqliteOutbox,
    writes: Arc<Mutex<()>>,
}

impl SqliteStore {
    /// A store over an existing pool. For several relay processes on one file the pool's
    /// connections should have a busy timeout (see [`SqliteStore::connect_options`]).
    pub fn new(pool: SqlitePool, outbox: SqliteOutbox) -> Self {
        SqliteStore {
            pool,
            outbox,
            writes: Arc::new(Mutex::new(())),
        }
    }

    /// The connection settings [`SqliteStore::connect`] uses for `target` (a file path, or a
    /// `sqlite:` URL such as `sqlite://data/outbox.db`):
    ///
    /// - the file is created if missing;
    /// - `journal_mode=WAL`: readers (status, admin) never block the writer and the writer never
    ///   blocks them; it is a property of the file, so every process sees it;
    /// - `synchronous=NORMAL`: in WAL mode a commit survives an application crash, and a power
    ///   loss can only drop the *latest* commits whole — a business row and its event are in one
    ///   commit, so they are lost or kept together and the outbox promise holds; a lost ack
    ///   means a redelivery, which at-least-once delivery allows;
    /// - a [`BUSY_TIMEOUT`]: a statement waits that long for another process's write lock
    ///   before failing with a transient error;
    /// - `foreign_keys=ON`, for the application's own tables sharing the file.
    pub fn connect_options(target: &str) -> Result<SqliteConnectOptions, StoreError> {
        let options = if target.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(target)
                .map_err(|e| StoreError::Invalid(format!("invalid SQLite URL `{target}`: {e}")))?
        } else if target.trim().is_empty() {
            return Err(StoreError::Invalid(
                "empty SQLite database path: give a file path or a sqlite:// URL".to_owned(),
            ));
        } else {
            SqliteConnectOptions::new().filename(target)
        };
        Ok(options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true))
    }

    /// Open (creating it if missing) the database file `target` — a path or a `sqlite:` URL —
    /// with the settings of [`SqliteStore::connect_options`] and a small pool: SQLite has a
    /// single writer, so more connections only add parallel readers (status, admin commands).
    pub async fn connect(target: &str, outbox: SqliteOutbox) -> Result<Self, StoreError> {
        let options = Self::connect_options(target)?;
        let cannot_open = |e: sqlx::Error| match map_sqlx(e) {
            StoreError::Unavailable(m) | StoreError::Database(m) => {
                StoreError::Unavailable(format!("cannot open SQLite database `{target}`: {m}"))
            }
            other => other,
        };
        // One direct connection first, retried while the file is busy: switching a new file to
        // WAL needs an exclusive lock that SQLite's busy timeout does not wait for, so relays
        // opening a fresh file together would otherwise fail at random. Once one of them has
        // switched it (WAL is a property of the file), the setting is a no-op for everyone.
        let started = std::time::Instant::now();
        let mut pause = Duration::from_millis(5);
        loop {
            match <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&options).await {
                Ok(probe) => {
                    let _ = sqlx::Connection::close(probe).await;
                    break;
                }
                Err(e) if is_busy(&e) && started.elapsed() < BUSY_TIMEOUT => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err(e) => return Err(cannot_open(e)),
            }
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .map_err(cannot_open)?;
        Ok(SqliteStore::new(pool, outbox))
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The outbox location.
    pub fn outbox(&self) -> &SqliteOutbox {
        &self.outbox
    }

    fn sql(&self) -> &Sql {
        &self.outbox.inner.sql
    }
}

/// The latest instant any stored time may be (the end of year 9999): an unbounded lease or
/// delay saturates here instead of overflowing, and every stored time stays decodable.
const MAX_MICROS: i64 = 253_402_300_799_999_999;

pub(crate) fn now_micros() -> i64 {
    clamp_micros(Utc::now().timestamp_micros())
}

fn clamp_micros(us: i64) -> i64 {
    us.min(MAX_MICROS)
}

/// `now + d`, saturated to [`MAX_MICROS`].
fn after(now: i64, d: Duration) -> i64 {
    clamp_micros(now.saturating_add(micros(d)))
}

fn to_time(seq: i64, column: &str, us: i64) -> Result<DateTime<Utc>, StoreError> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| StoreError::Corrupt {
        seq,
        reason: format!("{column} {us} is not a time in microseconds since the epoch"),
    })
}

fn get_time(row: &SqliteRow, seq: i64, column: &str) -> Result<DateTime<Utc>, StoreError> {
    let us: i64 = row.try_get(column).map_err(map_sqlx)?;
    to_time(seq, column, us)
}

fn get_opt_time(
    row: &SqliteRow,
    seq: i64,
    column: &str,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    let us: Option<i64> = row.try_get(column).map_err(map_sqlx)?;
    us.map(|us| to_time(seq, column, us)).transpose()
}

fn decode_id(row: &SqliteRow, column: &str, seq: i64) -> Result<EventId, StoreError> {
    let text: String = row.try_get(column).map_err(map_sqlx)?;
    parse_event_id(seq, column, &text)
}

fn decode_event(row: &SqliteRow) -> Result<Event, StoreError> {
    decode_event_as(row, Reading::Delivery)
}

/// A text column; for display, bytes that are not UTF-8 are replaced rather than refused.
fn text_as(row: &SqliteRow, column: &str, reading: Reading) -> Result<String, StoreError> {
    match row.try_get::<String, _>(column) {
        Ok(text) => Ok(text),
        Err(_) if reading == Reading::Display => {
            let bytes: Vec<u8> = row.try_get_unchecked(column).map_err(map_sqlx)?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
        Err(e) => Err(StoreError::Corrupt {
            seq: row.try_get("seq").unwrap_or(0),
            reason: format!("column `{column}` cannot be read as text ({e})"),
        }),
    }
}

fn opt_text_as(
    row: &SqliteRow,
    column: &str,
    reading: Reading,
) -> Result<Option<String>, StoreError> {
    let present: Option<Vec<u8>> = row.try_get_unchecked(column).map_err(map_sqlx)?;
    match present {
        None => Ok(None),
        Some(_) => text_as(row, column, reading).map(Some),
    }
}

fn decode_event_as(row: &SqliteRow, reading: Reading) -> Result<Event, StoreError> {
    let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
    let headers = text_as(row, "headers", reading)?;
    let attempts: i64 = row.try_get("attempts").map_err(map_sqlx)?;
    let (id, headers) = match reading {
        Reading::Delivery => (decode_id(row, "id", seq)?, decode_headers(seq, &headers)?),
        Reading::Display => (
            decode_id(row, "id", seq).unwrap_or_else(|_| EventId::from_uuid(Uuid::nil())),
            outbox_types::headers_for_display(&headers),
        ),
    };
    Ok(Event {
        seq,
        id,
        aggregate_type: text_as(row, "aggregate_type", reading)?,
        aggregate_id: text_as(row, "aggregate_id", reading)?,
        event_type: text_as(row, "event_type", reading)?,
        payload: outbox_types::check_payload(seq, text_as(row, "payload", reading)?, reading)?,
        destination: opt_text_as(row, "destination", reading)?,
        headers,
        idempotency_key: opt_text_as(row, "idempotency_key", reading)?,
        occurred_at: get_time(row, seq, "occurred_at")?,
        enqueued_at: get_time(row, seq, "enqueued_at")?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

fn decode_record(row: &SqliteRow) -> Result<EventRecord, StoreError> {
    let event = decode_event_as(row, Reading::Display)?;
    let seq = event.seq;
    let status: String = row.try_get("status").map_err(map_sqlx)?;
    let state = parse_state(seq, &status)?;
    Ok(EventRecord {
        event,
        state,
        next_attempt_at: get_time(row, seq, "next_attempt_at")?,
        last_error: row.try_get("last_error").map_err(map_sqlx)?,
        lease_owner: row.try_get("lease_owner").map_err(map_sqlx)?,
        lease_expires_at: get_opt_time(row, seq, "lease_expires_at")?,
        delivered_at: get_opt_time(row, seq, "delivered_at")?,
        dead_at: get_opt_time(row, seq, "dead_at")?,
    })
}

/// Column `name` of `row`, a count.
fn count_of(row: &SqliteRow, name: &str) -> Result<u64, StoreError> {
    let n: i64 = row.try_get(name).map_err(map_sqlx)?;
    Ok(count(n))
}

#[async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = Uuid::now_v7();
        // Only the paused destinations: a deferred one (the relay's fair turn, see `Hold`) is
        // claimed as usual here. Skipping it would need, per candidate, a look at the earlier
        // open rows of its aggregate, and SQLite has no index over those (writers would pay
        // for one on every insert); an embedded outbox rarely has several busy destinations.
        let hold = request.hold.as_deref().filter(|h| !h.paused.is_empty());
        let (sql, held) = match hold {
            None => (std::borrow::Cow::Borrowed(&self.sql().claim), None),
            Some(hold) => {
                let route_e = hold.routes.sql_case(SqlDialect::Sqlite, Some("e"));
                let route_b = hold.routes.sql_case(SqlDialect::Sqlite, Some("b"));
                let sql = claim_sql(
                    self.outbox.quoted_table(),
                    Some(&HoldSql {
                        route_e: number_placeholders(&route_e.sql, 10),
                        route_b: number_placeholders(&route_b.sql, 10),
                    }),
                );
                let paused = json_text(&hold.paused)?;
                (std::borrow::Cow::Owned(sql), Some((paused, route_e.binds)))
            }
        };
        let rows = {
            let _turn = self.writes.lock().await;
            let now = now_micros();
            let mut query = sqlx::query(AssertSqlSafe(sql.as_str()))
                .bind(i64::from(request.limit))
                .bind(&request.owner)
                .bind(token.to_string())
                .bind(after(now, request.lease))
                .bind(now)
                .bind(request.dead_letter == DeadLetterPolicy::Block)
                .bind(i64::try_from(request.max_batch_bytes).unwrap_or(i64::MAX))
                .bind(i64::try_from(request.max_payload_bytes).unwrap_or(i64::MAX));
            if let Some((paused, binds)) = &held {
                query = query.bind(paused.as_str());
                for value in binds {
                    query = query.bind(value.as_str());
                }
            }
            query.fetch_all(&self.pool).await.map_err(map_sqlx)?
        };
        let mut sort = ClaimSort::new(request);
        for row in &rows {
            let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
            let size: Option<i64> = row.try_get("payload_bytes").map_err(map_sqlx)?;
            // Read as an operator would see it: the row may be buried for bytes that are not
            // UTF-8 in exactly these columns.
            let aggregate = || {
                Ok(AggregateKey {
                    aggregate_type: text_as(row, "aggregate_type", Reading::Display)?,
                    aggregate_id: text_as(row, "aggregate_id", Reading::Display)?,
                })
            };
            let size = u64::try_from(size.unwrap_or(0)).unwrap_or(0);
            if let Some(error) = sort.row(seq, aggregate, size, || decode_event(row))? {
                tracing::warn!(
                    seq,
                    error,
                    "Claimed a row that cannot be delivered; it is dead-lettered."
                );
            }
        }
        let lease = Lease {
            owner: request.owner.clone(),
            token,
        };
        sort.finish().into_claim(self, lease).await
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let seqs = json_text(seqs)?;
        let _turn = self.writes.lock().await;
        let done = sqlx::query(AssertSqlSafe(self.sql().ack.as_str()))
            .bind(seqs)
            .bind(lease.token.to_string())
            .bind(now_micros())
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError> {
        if events.is_empty() {
            return Ok(0);
        }
        let _turn = self.writes.lock().await;
        let now = now_micros();
        let batch: Vec<serde_json::Value> = events
            .iter()
            .map(|e| {
                serde_json::json!({
                    "seq": e.seq,
                    "due": after(now, e.delay),
                    "error": outbox_types::truncate_error(&e.error),
                    "cost": i32::from(e.counts_attempt),
                })
            })
            .collect();
        let done = sqlx::query(AssertSqlSafe(self.sql().retry.as_str()))
            .bind(json_text(&batch)?)
            .bind(lease.token.to_string())
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError> {
        if events.is_empty() {
            return Ok(0);
        }
        let batch: Vec<serde_json::Value> = events
            .iter()
            .map(|e| {
                serde_json::json!({
                    "seq": e.seq,
                    "error": outbox_types::truncate_error(&e.error),
                })
            })
            .collect();
        let batch = json_text(&batch)?;
        let _turn = self.writes.lock().await;
        let done = sqlx::query(AssertSqlSafe(self.sql().bury.as_str()))
            .bind(batch)
            .bind(lease.token.to_string())
            .bind(now_micros())
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let seqs = json_text(seqs)?;
        let _turn = self.writes.lock().await;
        let done = sqlx::query(AssertSqlSafe(self.sql().release.as_str()))
            .bind(seqs)
            .bind(lease.token.to_string())
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let observed_at = Utc::now();
        let row = sqlx::query(AssertSqlSafe(self.sql().stats.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        let oldest = get_opt_time(&row, 0, "oldest")?;
        Ok(OutboxStats {
            pending: count_of(&row, "pending")?,
            retrying: count_of(&row, "retrying")?,
            in_flight: count_of(&row, "in_flight")?,
            delivered: count_of(&row, "delivered")?,
            dead: count_of(&row, "dead")?,
            oldest_pending_enqueued_at: oldest,
            observed_at: Some(observed_at),
        })
    }

    async fn get(&self, id: EventId) -> Result<Option<EventRecord>, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql().get.as_str()))
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await
            .map_err(map_sqlx)?;
        row.as_ref().map(decode_record).transpose()
    }

    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: u32,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(self.sql().list_dead.as_str()))
            .bind(after_seq.unwrap_or(0))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(map_sqlx)?;
        rows.iter().map(decode_record).collect()
    }

    async fn requeue_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError> {
        let done = match filter {
            DeadFilter::All => {
                let _turn = self.writes.lock().await;
                sqlx::query(AssertSqlSafe(self.sql().requeue_dead_all.as_str()))
                    .bind(now_micros())
                    .execute(&self.pool)
                    .await
            }
            DeadFilter::Ids(ids) => {
                let ids = id_list(ids)?;
                let _turn = self.writes.lock().await;
                sqlx::query(AssertSqlSafe(self.sql().requeue_dead_ids.as_str()))
                    .bind(ids)
                    .bind(now_micros())
                    .execute(&self.pool)
                    .await
            }
        }
        .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn discard_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError> {
        let done = match filter {
            DeadFilter::All => {
                let _turn = self.writes.lock().await;
                sqlx::query(AssertSqlSafe(self.sql().discard_dead_all.as_str()))
                    .execute(&self.pool)
                    .await
            }
            DeadFilter::Ids(ids) => {
                let ids = id_list(ids)?;
                let _turn = self.writes.lock().await;
                sqlx::query(AssertSqlSafe(self.sql().discard_dead_ids.as_str()))
                    .bind(ids)
                    .execute(&self.pool)
                    .await
            }
        }
        .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn purge_delivered(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        let _turn = self.writes.lock().await;
        let cutoff = now_micros().saturating_sub(micros(older_than));
        let done = sqlx::query(AssertSqlSafe(self.sql().purge.as_str()))
            .bind(cutoff)
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn destination_stats(
        &self,
        routes: &RouteTable,
    ) -> Result<Vec<DestinationStats>, StoreError> {
        let route = routes.sql_case(SqlDialect::Sqlite, Some("e"));
        let sql = destination_stats_sql(
            self.outbox.quoted_table(),
            &number_placeholders(&route.sql, 1),
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for value in &route.binds {
            query = query.bind(value.as_str());
        }
        let rows = query.fetch_all(&self.pool).await.map_err(map_sqlx)?;
        let mut out = rows
            .iter()
            .map(|row| {
                let route: String = row.try_get("route").map_err(map_sqlx)?;
                Ok(DestinationStats {
                    destination: (!route.is_empty()).then_some(route),
                    pending: count_of(row, "pending")?,
                    retrying: count_of(row, "retrying")?,
                    in_flight: count_of(row, "in_flight")?,
                    dead: count_of(row, "dead")?,
                    oldest_pending_enqueued_at: get_opt_time(row, 0, "oldest")?,
                    last_error: row.try_get("last_error").map_err(map_sqlx)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        out.sort_by(|a, b| a.destination.cmp(&b.destination));
        Ok(out)
    }

    async fn leases(&self) -> Result<Vec<LeaseHolder>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(self.sql().leases.as_str()))
            .bind(now_micros())
            .fetch_all(&self.pool)
            .await
            .map_err(map_sqlx)?;
        rows.iter()
            .map(|row| {
                Ok(LeaseHolder {
                    owner: row.try_get("owner").map_err(map_sqlx)?,
                    events: count_of(row, "events")?,
                    claimed_since: get_opt_time(row, 0, "claimed_since")?,
                    expires_at: get_opt_time(row, 0, "expires_at")?,
                    expired: count_of(row, "expired")?,
                })
            })
            .collect()
    }

    async fn pause(&self, destination: &str, by: &str) -> Result<bool, StoreError> {
        check_destination(destination)?;
        let _turn = self.writes.lock().await;
        let done = sqlx::query(AssertSqlSafe(self.sql().pause.as_str()))
            .bind(destination)
            .bind(now_micros())
            .bind(by)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected() == 1)
    }

    async fn resume(&self, destination: &str) -> Result<bool, StoreError> {
        let _turn = self.writes.lock().await;
        let done = sqlx::query(AssertSqlSafe(self.sql().resume.as_str()))
            .bind(destination)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected() > 0)
    }

    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(self.sql().paused.as_str()))
            .fetch_all(&self.pool)
            .await
            .map_err(map_sqlx)?;
        rows.iter()
            .map(|row| {
                Ok(PausedDestination {
                    destination: row.try_get("destination").map_err(map_sqlx)?,
                    paused_at: get_time(row, 0, "paused_at")?,
                    paused_by: row.try_get("paused_by").map_err(map_sqlx)?,
                })
            })
            .collect()
    }

    async fn replay(
        &self,
        filter: &ReplayFilter,
        routes: &RouteTable,
        after_seq: Option<i64>,
        limit: u32,
    ) -> Result<ReplayStep, StoreError> {
        if limit == 0 {
            return Ok(ReplayStep::default());
        }
        let route = filter
            .destination
            .as_ref()
            .map(|_| routes.sql_case(SqlDialect::Sqlite, Some("e")));
        let sql = replay_sql(
            self.outbox.quoted_table(),
            route
                .as_ref()
                .map(|r| number_placeholders(&r.sql, 8))
                .as_deref(),
        );
        let _turn = self.writes.lock().await;
        let mut query = sqlx::query(AssertSqlSafe(sql))
            .bind(after_seq.unwrap_or(0))
            .bind(clamp_micros(filter.from.timestamp_micros()))
            .bind(clamp_micros(filter.to.timestamp_micros()))
            .bind(filter.event_type.as_deref())
            .bind(i64::from(limit))
            .bind(now_micros());
        if let (Some(destination), Some(route)) = (&filter.destination, &route) {
            query = query.bind(destination.as_str());
            for value in &route.binds {
                query = query.bind(value.as_str());
            }
        }
        let rows = query.fetch_all(&self.pool).await.map_err(map_sqlx)?;
        let mut last = None;
        for row in &rows {
            let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
            last = last.max(Some(seq));
        }
        Ok(ReplayStep {
            replayed: rows.len() as u64,
            next_after: last.filter(|_| rows.len() >= limit as usize),
        })
    }

    async fn purge_dead(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        let _turn = self.writes.lock().await;
        let cutoff = now_micros().saturating_sub(micros(older_than));
        let done = sqlx::query(AssertSqlSafe(self.sql().purge_dead.as_str()))
            .bind(cutoff)
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn check(&self) -> Result<(), StoreError> {
        let (current, latest) = self.outbox.schema_version(&self.pool).await?;
        let place = format!("table {}", self.outbox.quoted_table());
        check_current(Schema::OUTBOX, &place, current, latest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_saturate_instead_of_overflowing() {
        assert_eq!(after(0, Duration::MAX), MAX_MICROS);
        assert_eq!(after(10, Duration::from_micros(5)), 15);
        assert!(to_time(1, "x", MAX_MICROS).is_ok());
        assert!(matches!(
            to_time(1, "x", i64::MAX),
            Err(StoreError::Corrupt { seq: 1, .. })
        ));
    }

    #[test]
    fn connect_options_accept_paths_and_urls_only() {
        assert!(SqliteStore::connect_options("data/outbox.db").is_ok());
        assert!(SqliteStore::connect_options("sqlite://data/outbox.db").is_ok());
        assert!(matches!(
            SqliteStore::connect_options("  "),
            Err(StoreError::Invalid(_))
        ));
    }

    /// The query plan's detail lines for `sql`, with `params` NULL parameters bound.
    async fn plan(pool: &SqlitePool, sql: &str, params: usize) -> String {
        let explain = format!("EXPLAIN QUERY PLAN {sql}");
        let mut query = sqlx::query(AssertSqlSafe(explain.as_str()));
        for _ in 0..params {
            query = query.bind(None::<i64>);
        }
        let rows = query.fetch_all(pool).await.unwrap();
        rows.iter()
            .map(|r| r.try_get::<String, _>("detail").unwrap())
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[tokio::test]
    async fn statements_use_the_intended_indexes_even_after_analyze() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.db");
        let store = SqliteStore::connect(path.to_str().unwrap(), SqliteOutbox::new())
            .await
            .unwrap();
        store.outbox().migrate(store.pool()).await.unwrap();
        // Mostly delivered rows, as in a table kept for retention, then fresh statistics.
        let events: Vec<NewEvent> = (0..600)
            .map(|i| {
                NewEvent::new(
                    "agg",
                    format!("a{}", i % 50),
                    "E",
                    &serde_json::json!({"i": i}),
                )
                .unwrap()
            })
            .collect();
        store
            .outbox()
            .enqueue_batch(store.pool(), &events)
            .await
            .unwrap();
        let claim = store
            .claim(&ClaimRequest {
                owner: "plan".into(),
                limit: 550,
                lease: Duration::from_secs(60),
                dead_letter: DeadLetterPolicy::Block,
                hold: None,
                max_batch_bytes: u64::MAX,
                max_payload_bytes: u64::MAX,
                up_to_seq: None,
            })
            .await
            .unwrap();
        let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
        store.ack(&claim.lease, &seqs).await.unwrap();
        sqlx::query("ANALYZE").execute(store.pool()).await.unwrap();

        let sql = store.sql();
        let claim_plan = plan(store.pool(), &sql.claim, 8).await;
        assert!(
            claim_plan.contains("SCAN e USING INDEX outbox_events_open"),
            "{claim_plan}"
        );
        assert!(
            claim_plan.contains("SEARCH b USING INDEX outbox_events_blockers"),
            "{claim_plan}"
        );
        for (name, statement, params) in [
            ("ack", &sql.ack, 3),
            ("retry", &sql.retry, 2),
            ("bury", &sql.bury, 3),
            ("release", &sql.release, 2),
        ] {
            let p = plan(store.pool(), statement, params).await;
            assert!(p.contains("USING INTEGER PRIMARY KEY"), "{name}: {p}");
            assert!(
                !p.contains("SCAN o\n") && !p.contains("SCAN outbox_events"),
                "{name}: {p}"
            );
        }
        // The operator statements read undelivered and dead rows through the partial indexes,
        // never the delivered bulk; a claim with a destination on hold still does too.
        let routes = RouteTable::new(
            ["kafka", "hooks"],
            vec![
                outbox_types::route::RouteRule::to("hooks")
                    .event_type(outbox_types::route::Pattern::parse("Hook*")),
                outbox_types::route::RouteRule::to("kafka"),
            ],
        )
        .unwrap();
        let route_e = routes.sql_case(SqlDialect::Sqlite, Some("e"));
        let route_b = routes.sql_case(SqlDialect::Sqlite, Some("b"));
        let held = claim_sql(
            store.outbox().quoted_table(),
            Some(&HoldSql {
                route_e: number_placeholders(&route_e.sql, 10),
                route_b: number_placeholders(&route_b.sql, 10),
            }),
        );
        let held_plan = plan(store.pool(), &held, 9 + route_e.binds.len()).await;
        assert!(
            held_plan.contains("SCAN e USING INDEX outbox_events_open"),
            "{held_plan}"
        );
        assert!(
            held_plan.contains("SEARCH b USING INDEX outbox_events_blockers"),
            "{held_plan}"
        );
        let stats = destination_stats_sql(
            store.outbox().quoted_table(),
            &number_placeholders(&route_e.sql, 1),
        );
        let stats_plan = plan(store.pool(), &stats, route_e.binds.len()).await;
        assert!(
            stats_plan.contains("USING INDEX outbox_events_open")
                && stats_plan.contains("USING INDEX outbox_events_dead"),
            "{stats_plan}"
        );
        let leases = plan(store.pool(), &sql.leases, 1).await;
        assert!(
            leases.contains("USING INDEX outbox_events_open"),
            "{leases}"
        );
        let purge_dead = plan(store.pool(), &sql.purge_dead, 2).await;
        assert!(
            purge_dead.contains("USING INDEX outbox_events_dead"),
            "{purge_dead}"
        );

        let get = plan(store.pool(), &sql.get, 1).await;
        assert!(get.contains("SEARCH outbox_events USING INDEX"), "{get}");
        let enqueue = plan(store.pool(), &sql.enqueue, 10).await;
        assert!(!enqueue.contains("SCAN"), "{enqueue}");
    }

    #[test]
    fn sql_embeds_the_quoted_table() {
        let outbox = SqliteOutbox::with_table("my_events").unwrap();
        assert!(outbox.inner.sql.claim.contains("UPDATE \"my_events\""));
        assert!(outbox.inner.sql.pause.contains("\"my_events_paused\""));
        assert_eq!(
            number_placeholders("a = ? AND b IN (?, ?)", 8),
            "a = ?8 AND b IN (?9, ?10)"
        );
        assert_eq!(outbox.migrations_table(), "\"my_events_migrations\"");
    }
}
