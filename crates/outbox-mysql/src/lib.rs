//! # outbox-mysql
//!
//! The MySQL 8 / MariaDB 10.6+ home of the outbox: embedded migrations,
//! [`MySqlOutbox::enqueue`] into the caller's own transaction, and [`MySqlStore`], the [`Store`](outbox_types::Store)
//! a relay claims from. It keeps the same contract as the PostgreSQL and SQLite stores and passes
//! the same conformance suite (`outbox-store-tests`).
//!
//! ```no_run
//! use outbox_types::NewEvent;
//! use outbox_mysql::{MySqlOutbox, MySqlStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MySqlStore::connect("mysql://app:secret@db/shop", MySqlOutbox::new()).await?;
//! store.outbox().migrate(store.pool()).await?; // table `outbox_events`
//!
//! let mut tx = store.pool().begin().await?;
//! sqlx::query("INSERT INTO orders (id, amount) VALUES (?, ?)")
//!     .bind(42_i64).bind(1999_i64)
//!     .execute(&mut *tx).await?;
//! let event = NewEvent::new("order", "42", "OrderCreated", &serde_json::json!({"amount": 1999}))?;
//! store.outbox().enqueue(&mut *tx, &event).await?;
//! tx.commit().await?; // the order and its event exist together, or neither does
//! # Ok(()) }
//! ```
//!
//! Requirements: InnoDB, and MySQL 8.0.17+ or MariaDB 10.6+ — for `FOR UPDATE SKIP LOCKED`,
//! `JSON_TABLE` and a binary no-pad utf8mb4 collation. Galera clusters are not supported
//! (named locks and row locks are local to one node there). Only the store's own statements are
//! tested here against MariaDB 10.11; the SQL keeps to what MySQL 8 documents as well.
//!
//! ## Writers
//!
//! [`MySqlOutbox::enqueue`] and [`MySqlOutbox::enqueue_batch`] run on the connection they are
//! given (`&mut *tx`, `&mut tx`, `&pool` or `&mut conn`) and never commit, roll back or begin
//! anything: inside the caller's transaction the events commit or vanish with the business
//! change; through a pool each statement autocommits.
//!
//! They take an [`EnqueueTarget`] (anything that converts into one: a connection, a transaction,
//! a pool connection or a pool) rather than an `Executor`, unlike the PostgreSQL store, because of
//! the idempotency key. MySQL has no `RETURNING`, so the id of the event that already holds a key
//! cannot come back from the `INSERT`; it takes a second statement on the **same** connection, and
//! an `Executor` can run only one. (A generic `impl sqlx::Acquire` would do that too, but futures
//! holding one trip over a rustc limitation — "implementation of `Acquire` is not general
//! enough" — as soon as they must be `Send`, as in a web handler or `tokio::spawn`.) Call sites
//! read the same: `outbox.enqueue(&mut *tx, &event)`.
//!
//! - **Single event**: one `INSERT … ON DUPLICATE KEY UPDATE seq = LAST_INSERT_ID(seq + 2^62) - 2^62`.
//!   It inserts, or leaves the existing row exactly as it was and reports that row's `seq`
//!   (offset by 2^62, so the client can tell the two apart; `LAST_INSERT_ID(expr)` is the
//!   documented way to learn the row an upsert hit, and works because `seq` is the
//!   `AUTO_INCREMENT` column). A new event therefore costs one statement; only a duplicate costs
//!   a second, `SELECT id … WHERE seq = ? FOR UPDATE`. That read is a *locking* read on purpose:
//!   in a `REPEATABLE READ` transaction a plain read uses the snapshot taken at the transaction's
//!   first read, which may predate the commit of the row the key collided with.
//! - **Batch**: one `INSERT … SELECT … FROM JSON_TABLE(?)` in array order (the events travel as
//!   one JSON array), whose upsert leaves every duplicate untouched, then one locking read of the
//!   rows holding the batch's ids, and — only when some key was a duplicate — one of the rows
//!   holding those keys. An event was written by this call when the row with its id has a `seq`
//!   at or after the first one the `INSERT` generated. (The one case this cannot tell apart: the
//!   *same* event id enqueued by two transactions at the same moment under
//!   `innodb_autoinc_lock_mode = 2`, where both may report `created: true` for the one row.)
//!   A batch larger than a few MiB is split into several such rounds, in order.
//! - A key repeated inside one batch counts once: the first event wins, the later ones report its
//!   id with `created: false`.
//! - The id is unique too. PostgreSQL rejects an event whose id is already taken; MySQL's upsert
//!   fires on *any* unique key, so this store checks afterwards and returns
//!   [`StoreError::Database`] when an event was not written because another event (with another
//!   or no idempotency key) has its id. Enqueueing the very same event (same id and key) again is
//!   the ordinary duplicate case.
//!
//! Header names under the prefix reserved for the relay's own message headers (`outbox-…`,
//! except `outbox-partition`) are refused before anything is sent ([`StoreError::Encode`]); the
//! table's triggers refuse them too, for writers that insert by hand (see "Rows are checked
//! when written" below).
//!
//! Field lengths are checked before anything is sent ([`StoreError::Invalid`]), so a server in
//! non-strict SQL mode can never silently truncate an aggregate id or an idempotency key:
//! `aggregate_type` up to [`MAX_AGGREGATE_TYPE_CHARS`] characters, `aggregate_id`, `event_type`
//! and the idempotency key up to [`MAX_KEY_CHARS`], the destination up to
//! [`MAX_DESTINATION_CHARS`]; `occurred_at` within DATETIME's years 1000–9999. Payloads and
//! headers are `LONGTEXT`, bounded in practice by the server's `max_allowed_packet`.
//!
//! ## Rows are checked when written
//!
//! Writers in other languages insert into the table by hand (or call the enqueue procedure), so
//! the table itself refuses what the relay could only dead-letter later (migration 4; the
//! writers' contract is `docs/table-contract.md`):
//!
//! - `id` defaults to `UUID()`, so a writer may leave it out. That is a version 1 UUID (MySQL's
//!   and MariaDB's only built-in kind), a valid event id though not time-ordered like the v7
//!   ids this library and the procedure write; ordering never depends on it (`seq` does).
//! - A `BEFORE INSERT` trigger checks `headers`: a JSON object whose values are all strings,
//!   with no name under the prefix `outbox-` other than `outbox-partition`. A bad row fails the
//!   writer's statement with SQLSTATE `45000` and a message naming the header. A trigger,
//!   because a CHECK constraint cannot loop over a JSON object's members. Inserts only: rows
//!   written before the trigger existed are claimed, dead-lettered and requeued as before, so
//!   there is nothing to validate on upgrade; and a `BEFORE UPDATE` trigger (any, even an
//!   empty one, on MariaDB 10.11) makes the server report no insert id for an upsert that hit
//!   a duplicate key, which is how [`MySqlOutbox::enqueue`] finds the event an idempotency key
//!   belongs to (see "Writers" above).
//!
//! ## Claims
//!
//! A claim is one short transaction, serialized across relays by a named lock:
//!
//! 1. `GET_LOCK('outbox:claim:…')`, a session-level lock held only around the claim;
//! 2. a plain read of the first `limit` due and unblocked events in seq order (the ordering rule
//!    of [`Store`](outbox_types::Store));
//! 3. `START TRANSACTION`; `SELECT … FOR UPDATE SKIP LOCKED` of those candidates that are still
//!    due, which locks them and rereads their latest committed version;
//! 4. the store drops every candidate that could not be locked or is no longer due **and every
//!    later candidate of the same aggregate**, then marks the rest `in_flight` with a fresh lease
//!    token in one `UPDATE`, `COMMIT`, and `RELEASE_LOCK()`.
//!
//! Step 4 is what keeps per-aggregate order airtight where `SKIP LOCKED` alone would not: a due
//! event whose row someone else has locked at that moment (a writer whose duplicate enqueue hit
//! it, a stalled relay's late retry) is skipped, and its successors must then wait too rather
//! than go first. It also makes the claim correct without the lock, so the lock is an efficiency
//! measure (each claim sees the previous one's result instead of tripping over its locked rows)
//! and not a single point of failure: a claim waits at most [`CLAIM_LOCK_WAIT_SECONDS`] for it,
//! then logs a warning and claims unserialized, so a lock holder whose connection hangs cannot
//! stall every relay.
//!
//! `GET_LOCK()` locks belong to the session and survive `COMMIT`: the lock is released explicitly
//! on every path, and a claim that fails half-way, or whose future is dropped, closes its
//! connection instead of returning it to the pool (the server then rolls back and releases).
//!
//! ## Indexes
//!
//! Without partial indexes, `(status, seq)` serves "open rows in seq order" (the pending range
//! and the in-flight range are scanned separately, each in order, each stopping after `limit`
//! rows) and `(aggregate_type, aggregate_id, status, seq)` serves the blocker probe without
//! reading the aggregate's delivered rows. A claim's cost thus depends on the open rows it has to
//! look at, never on how many delivered rows retention keeps.
//!
//! ## Time
//!
//! Every timestamp is `DATETIME(6)` in UTC, and "now" is always the database's
//! `UTC_TIMESTAMP(6)`: lease expiries, retry due times and purge cut-offs written by one relay
//! host are compared on one clock by every other, whatever the hosts' skew or the sessions' time
//! zones. Durations travel as microseconds, capped at [`MAX_INTERVAL`] so a `Duration::MAX` lease
//! cannot overflow `DATETIME`. `enqueued_at` is the time of the enqueue statement (MySQL has no
//! transaction-start clock).
//!
//! ## Batches and identifiers
//!
//! Ack, retry, bury, release, requeue and discard take their whole batch in one statement: a JSON
//! array unpacked with `JSON_TABLE`, so per-event retry delays and errors travel together and one
//! prepared statement serves every batch size. Event ids and lease tokens are stored as
//! `CHAR(36)` hyphenated UUID text (ASCII, binary collation): readable in a SQL console and in
//! logs as is, at 20 bytes more per row than `BINARY(16)`.

mod error;
mod migrations;
mod names;
mod session;
mod sql;
mod store;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use outbox_types::{EventId, NewEvent, StoreError};
use sqlx::mysql::MySqlQueryResult;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, MySqlConnection, MySqlPool, Row, Transaction};

pub use migrations::MigrationReport;
pub use store::{CLAIM_LOCK_WAIT_SECONDS, MySqlStore, redact_url};

use error::map_sqlx;
use names::check_table_name;
use sql::{DUPLICATE_FLAG, Sql};

/// The default outbox table.
pub const DEFAULT_TABLE: &str = "outbox_events";

/// The longest `aggregate_type`, in characters.
pub const MAX_AGGREGATE_TYPE_CHARS: usize = 100;

/// The longest `aggregate_id`, `event_type` and idempotency key, in characters.
pub const MAX_KEY_CHARS: usize = 255;

/// The longest explicit destination, in characters.
pub const MAX_DESTINATION_CHARS: usize = 1024;

/// The longest lease, retry delay or purge age the store passes to the database (100 years);
/// longer durations are cut to it.
pub const MAX_INTERVAL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How many bytes of events one batch `INSERT` carries at most; larger batches are split into
/// several statements, in order, on the same connection (well under the 16 MiB default
/// `max_allowed_packet` of MariaDB; MySQL 8's is 64 MiB).
const BATCH_BYTES: usize = 4 << 20;

/// The result of an enqueue (shared by every store: [`outbox_types::sql_store::Enqueued`]).
pub use outbox_types::sql_store::Enqueued;

/// What an enqueue runs on. Built implicitly from `&mut MySqlConnection` (so `&mut *tx`),
/// `&mut Transaction`, `&mut PoolConnection` or `&MySqlPool`.
///
/// On a connection (or a transaction), every statement of the enqueue runs there: inside the
/// caller's transaction if one is open. On a pool, the enqueue takes one connection for its
/// statements, each of which autocommits.
#[derive(Debug)]
pub enum EnqueueTarget<'a> {
    /// A connection, usually inside the caller's transaction.
    Connection(&'a mut MySqlConnection),
    /// A pool: autocommit.
    Pool(&'a MySqlPool),
}

impl<'a> From<&'a mut MySqlConnection> for EnqueueTarget<'a> {
    fn from(conn: &'a mut MySqlConnection) -> Self {
        EnqueueTarget::Connection(conn)
    }
}

impl<'a, 'c> From<&'a mut Transaction<'c, MySql>> for EnqueueTarget<'a> {
    fn from(tx: &'a mut Transaction<'c, MySql>) -> Self {
        EnqueueTarget::Connection(tx)
    }
}

impl<'a> From<&'a mut PoolConnection<MySql>> for EnqueueTarget<'a> {
    fn from(conn: &'a mut PoolConnection<MySql>) -> Self {
        EnqueueTarget::Connection(conn)
    }
}

impl<'a> From<&'a MySqlPool> for EnqueueTarget<'a> {
    fn from(pool: &'a MySqlPool) -> Self {
        EnqueueTarget::Pool(pool)
    }
}

/// Where the outbox table lives, and the SQL to use it. Cheap to clone.
///
/// The table name is configurable so the outbox never collides with the application's own
/// tables; the default is [`DEFAULT_TABLE`]. It lives in the connection's current database.
/// Migrations are recorded in `<table>_migrations`.
#[derive(Clone, Debug)]
pub struct MySqlOutbox {
    inner: Arc<Names>,
}

#[derive(Debug)]
struct Names {
    table: String,
    quoted: String,
    sql: Sql,
}

impl Default for MySqlOutbox {
    fn default() -> Self {
        Self::new()
    }
}

impl MySqlOutbox {
    /// The outbox in table [`DEFAULT_TABLE`] (`outbox_events`).
    pub fn new() -> Self {
        Self::with_table(DEFAULT_TABLE).unwrap_or_else(|_| unreachable!("the default is valid"))
    }

    /// The outbox in table `table`: a plain lowercase identifier (`[a-z_][a-z0-9_]*`, at most 48
    /// characters). Anything else is refused before any SQL runs.
    ///
    /// ```
    /// assert!(outbox_mysql::MySqlOutbox::with_table("billing_outbox").is_ok());
    /// let err = outbox_mysql::MySqlOutbox::with_table("x`; drop table y").unwrap_err();
    /// assert!(err.to_string().contains("not a plain identifier"));
    /// ```
    pub fn with_table(table: &str) -> Result<Self, StoreError> {
        check_table_name(table)?;
        let quoted = format!("`{table}`");
        let sql = Sql::render(&quoted, table);
        Ok(MySqlOutbox {
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

    /// `` `table` ``, ready to use in SQL.
    pub fn quoted_table(&self) -> &str {
        &self.inner.quoted
    }

    pub(crate) fn migrations_table(&self) -> String {
        format!("`{}_migrations`", self.inner.table)
    }

    pub(crate) fn render(&self, template: &str) -> String {
        template
            .replace("{t}", &self.inner.quoted)
            .replace("{table}", &self.inner.table)
    }

    pub(crate) fn sql(&self) -> &Sql {
        &self.inner.sql
    }

    /// Create or upgrade the outbox schema. Idempotent, and safe to call from several processes
    /// at once (they queue on a named lock). MySQL DDL is not transactional; see the
    /// `migrations` module docs for how a migration interrupted half-way recovers.
    pub async fn migrate(&self, pool: &MySqlPool) -> Result<MigrationReport, StoreError> {
        migrations::run(self, pool).await
    }

    /// The DDL [`MySqlOutbox::migrate`] applies to a database without this outbox, with the
    /// bookkeeping rows that record it applied, as one SQL script (`outbox schema print`), for
    /// MariaDB (`mariadb = true`) or MySQL: the binary collation the columns use differs.
    pub fn schema_script(&self, mariadb: bool) -> String {
        migrations::script(self, mariadb)
    }

    /// The schema version in the database (`0` if never migrated) and the newest this build
    /// knows.
    pub async fn schema_version(&self, pool: &MySqlPool) -> Result<(i64, i64), StoreError> {
        Ok((
            migrations::current_version(self, pool).await?,
            migrations::latest_version(),
        ))
    }

    /// Add `event` to the outbox through `target` — normally `&mut *tx` of the caller's own
    /// transaction, so the event commits or rolls back with the business change. Never commits
    /// by itself. One statement for a new event, two for a duplicate (see the crate docs).
    ///
    /// With an idempotency key that is already in the table, nothing is written and the existing
    /// event's id comes back with `created: false`.
    pub fn enqueue<'a>(
        &'a self,
        target: impl Into<EnqueueTarget<'a>>,
        event: &'a NewEvent,
    ) -> impl Future<Output = Result<Enqueued, StoreError>> + Send + 'a {
        let target = target.into();
        async move {
            validate(event)?;
            let mut pooled;
            let conn = match target {
                EnqueueTarget::Connection(conn) => conn,
                EnqueueTarget::Pool(pool) => {
                    pooled = pool.acquire().await.map_err(map_sqlx)?;
                    &mut *pooled
                }
            };
            // Through a pool, each statement autocommits: the row a duplicate key pointed at may
            // be deleted (discarded, purged) before it is read back, and then the event can
            // simply be written. Inside a transaction the upsert keeps that row locked, so this
            // never loops.
            for _ in 0..3 {
                if let Some(done) = self.enqueue_once(conn, event).await? {
                    return Ok(done);
                }
            }
            Err(StoreError::Unavailable(format!(
                "event {}: the event holding its idempotency key kept disappearing while it was enqueued; try again",
                event.id()
            )))
        }
    }

    /// One attempt; `None` when the duplicate row vanished before it could be read.
    async fn enqueue_once(
        &self,
        conn: &mut MySqlConnection,
        event: &NewEvent,
    ) -> Result<Option<Enqueued>, StoreError> {
        let id = event.id().to_string();
        let done: MySqlQueryResult = sqlx::query(AssertSqlSafe(self.sql().enqueue.as_str()))
            .bind(&id)
            .bind(event.aggregate_type())
            .bind(event.aggregate_id())
            .bind(event.event_type())
            .bind(event.payload())
            .bind(event.destination())
            .bind(event.headers_json())
            .bind(event.idempotency_key())
            .bind(event.occurred_at())
            .execute(&mut *conn)
            .await
            .map_err(map_sqlx)?;
        let last = done.last_insert_id();
        if last < DUPLICATE_FLAG {
            return Ok(Some(Enqueued {
                id: event.id(),
                created: true,
            }));
        }
        let seq = i64::try_from(last - DUPLICATE_FLAG).unwrap_or(i64::MAX);
        let row = sqlx::query(AssertSqlSafe(self.sql().duplicate_row.as_str()))
            .bind(seq)
            .fetch_optional(&mut *conn)
            .await
            .map_err(map_sqlx)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let existing = decode_id(&row, "id", seq)?;
        let key: Option<String> = row.try_get("idempotency_key").map_err(map_sqlx)?;
        match event.idempotency_key() {
            Some(mine) if key.as_deref() == Some(mine) => Ok(Some(Enqueued {
                id: existing,
                created: false,
            })),
            _ => Err(id_taken(event.id(), seq)),
        }
    }

    /// Add several events, in order, in as few statements as possible (see the crate docs). Same
    /// rules as [`MySqlOutbox::enqueue`]; a key repeated inside the batch counts once (the first
    /// event wins).
    pub fn enqueue_batch<'a>(
        &'a self,
        target: impl Into<EnqueueTarget<'a>>,
        events: &'a [NewEvent],
    ) -> impl Future<Output = Result<Vec<Enqueued>, StoreError>> + Send + 'a {
        let target = target.into();
        async move {
            if events.is_empty() {
                return Ok(Vec::new());
            }
            // First occurrence of each key is written; later ones resolve to it.
            let mut first_with_key: HashMap<&str, usize> = HashMap::new();
            let mut to_write: Vec<&NewEvent> = Vec::with_capacity(events.len());
            let mut ids: HashSet<EventId> = HashSet::with_capacity(events.len());
            for (i, event) in events.iter().enumerate() {
                validate(event)?;
                if let Some(key) = event.idempotency_key() {
                    if first_with_key.contains_key(key) {
                        continue;
                    }
                    first_with_key.insert(key, i);
                }
                if !ids.insert(event.id()) {
                    return Err(StoreError::Invalid(format!(
                        "event id {} appears twice in one batch",
                        event.id()
                    )));
                }
                to_write.push(event);
            }
            let mut pooled;
            let conn = match target {
                EnqueueTarget::Connection(conn) => conn,
                EnqueueTarget::Pool(pool) => {
                    pooled = pool.acquire().await.map_err(map_sqlx)?;
                    &mut *pooled
                }
            };
            let mut written: HashMap<EventId, Enqueued> = HashMap::with_capacity(to_write.len());
            for chunk in chunks(&to_write) {
                self.write_chunk(conn, chunk, &mut written).await?;
            }
            events
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let first = match e.idempotency_key() {
                        Some(key) => first_with_key.get(key).copied().unwrap_or(i),
                        None => i,
                    };
                    let owner = events.get(first).map(NewEvent::id).unwrap_or(e.id());
                    let done = written.get(&owner).copied().ok_or_else(|| {
                        StoreError::Database(format!(
                            "event {owner} was not resolved after enqueue"
                        ))
                    })?;
                    Ok(Enqueued {
                        id: done.id,
                        created: done.created && i == first,
                    })
                })
                .collect()
        }
    }

    /// Insert one chunk (one statement) and find out, per event, what happened.
    async fn write_chunk(
        &self,
        conn: &mut MySqlConnection,
        chunk: &[&NewEvent],
        written: &mut HashMap<EventId, Enqueued>,
    ) -> Result<(), StoreError> {
        let rows: Vec<serde_json::Value> = chunk.iter().map(|e| batch_row(e)).collect();
        let done = sqlx::query(AssertSqlSafe(self.sql().enqueue_batch.as_str()))
            .bind(serde_json::Value::Array(rows).to_string())
            .execute(&mut *conn)
            .await
            .map_err(map_sqlx)?;
        // The first seq this statement generated (0 when it inserted nothing): every row it
        // inserted has a seq at least this large, every row that existed before a smaller one.
        let first_new = i64::try_from(done.last_insert_id())
            .ok()
            .filter(|seq| *seq > 0);

        let ids: Vec<String> = chunk.iter().map(|e| e.id().to_string()).collect();
        let by_id: HashMap<String, Resolved> = self
            .resolve(conn, &self.sql().resolve_ids, &ids)
            .await?
            .into_iter()
            .map(|r| (r.id.clone(), r))
            .collect();
        let mut duplicate_keys = Vec::new();
        for (event, id) in chunk.iter().zip(&ids) {
            let key = event.idempotency_key();
            match by_id.get(id) {
                Some(row) if row.key.as_deref() == key => {
                    let new = first_new.is_some_and(|first| row.seq >= first);
                    if !new && key.is_none() {
                        // Not written by this statement, and not an idempotent repeat either.
                        return Err(id_taken(event.id(), row.seq));
                    }
                    // Without `new`: the very same event (id and key) enqueued again.
                    written.insert(
                        event.id(),
                        Enqueued {
                            id: event.id(),
                            created: new,
                        },
                    );
                }
                Some(row) => return Err(id_taken(event.id(), row.seq)),
                None => match key {
                    Some(key) => duplicate_keys.push((event.id(), key)),
                    None => {
                        return Err(StoreError::Database(format!(
                            "event {} was not written and no event holds its id any more; enqueue it again",
                            event.id()
                        )));
                    }
                },
            }
        }
        if duplicate_keys.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = duplicate_keys
            .iter()
            .map(|(_, k)| (*k).to_owned())
            .collect();
        let by_key: HashMap<String, Resolved> = self
            .resolve(conn, &self.sql().resolve_keys, &keys)
            .await?
            .into_iter()
            .filter_map(|r| Some((r.key.clone()?, r)))
            .collect();
        for (id, key) in duplicate_keys {
            let row = by_key.get(key).ok_or_else(|| {
                    StoreError::Unavailable(format!(
                        "event {id}: the event holding idempotency key `{key}` was deleted while this batch was enqueued; try again"
                    ))
                })?;
            let existing = outbox_types::sql_store::parse_event_id(row.seq, "id", &row.id)?;
            written.insert(
                id,
                Enqueued {
                    id: existing,
                    created: false,
                },
            );
        }
        Ok(())
    }

    /// Rows whose id (or key, depending on `statement`) is in `values`.
    async fn resolve(
        &self,
        conn: &mut MySqlConnection,
        statement: &str,
        values: &[String],
    ) -> Result<Vec<Resolved>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(statement))
            .bind(json_text(values)?)
            .fetch_all(&mut *conn)
            .await
            .map_err(map_sqlx)?;
        rows.iter()
            .map(|row| {
                Ok(Resolved {
                    seq: row.try_get("seq").map_err(map_sqlx)?,
                    id: row.try_get("id").map_err(map_sqlx)?,
                    key: row.try_get("idempotency_key").map_err(map_sqlx)?,
                })
            })
            .collect()
    }
}

/// A row found after a batch insert.
struct Resolved {
    seq: i64,
    id: String,
    key: Option<String>,
}

fn id_taken(id: EventId, seq: i64) -> StoreError {
    StoreError::Database(format!(
        "event {id} was not written: another event (seq {seq}) already has this id"
    ))
}

/// Split `events` into chunks of at most [`BATCH_BYTES`] of text (and at least one event).
fn chunks<'a, 'e>(events: &'a [&'e NewEvent]) -> Vec<&'a [&'e NewEvent]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, e) in events.iter().enumerate() {
        let size = e.payload().len() + e.headers().len() * 32 + 256;
        if i > start && bytes + size > BATCH_BYTES {
            out.push(&events[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < events.len() {
        out.push(&events[start..]);
    }
    out
}

/// One event of a batch as a JSON object for `JSON_TABLE`. The payload and headers travel as JSON
/// strings holding their exact text, so the stored bytes are the writer's bytes; absent optional
/// fields are left out (a missing path is SQL `NULL`).
fn batch_row(e: &NewEvent) -> serde_json::Value {
    let mut row = serde_json::Map::with_capacity(9);
    row.insert("id".into(), e.id().to_string().into());
    row.insert("aggregate_type".into(), e.aggregate_type().into());
    row.insert("aggregate_id".into(), e.aggregate_id().into());
    row.insert("event_type".into(), e.event_type().into());
    row.insert("payload".into(), e.payload().into());
    if let Some(destination) = e.destination() {
        row.insert("destination".into(), destination.into());
    }
    row.insert("headers".into(), e.headers_json().into());
    if let Some(key) = e.idempotency_key() {
        row.insert("idempotency_key".into(), key.into());
    }
    row.insert(
        "occurred_at".into(),
        e.occurred_at()
            .format("%Y-%m-%d %H:%M:%S%.6f")
            .to_string()
            .into(),
    );
    serde_json::Value::Object(row)
}

/// Refuse what the table would truncate or reject, before anything is sent: a header name
/// under the reserved prefix (the table's triggers refuse it too), and fields too long.
fn validate(e: &NewEvent) -> Result<(), StoreError> {
    e.check_headers()?;
    let checks = [
        (
            "aggregate_type",
            Some(e.aggregate_type()),
            MAX_AGGREGATE_TYPE_CHARS,
        ),
        ("aggregate_id", Some(e.aggregate_id()), MAX_KEY_CHARS),
        ("event_type", Some(e.event_type()), MAX_KEY_CHARS),
        ("idempotency_key", e.idempotency_key(), MAX_KEY_CHARS),
        ("destination", e.destination(), MAX_DESTINATION_CHARS),
    ];
    for (field, value, max) in checks {
        if let Some(value) = value {
            let chars = value.chars().count();
            if chars > max {
                return Err(StoreError::Invalid(format!(
                    "event {}: {field} has {chars} characters; the MySQL outbox keeps at most {max}",
                    e.id()
                )));
            }
        }
    }
    let year = chrono::Datelike::year(&e.occurred_at());
    if !(1000..=9999).contains(&year) {
        return Err(StoreError::Invalid(format!(
            "event {}: occurred_at {} is outside the years 1000-9999 a MySQL DATETIME holds",
            e.id(),
            e.occurred_at()
        )));
    }
    Ok(())
}

/// A batch as JSON text for `JSON_TABLE`.
pub(crate) use outbox_types::sql_store::json_text;

/// The UUID in text column `column`.
pub(crate) fn decode_id(
    row: &sqlx::mysql::MySqlRow,
    column: &str,
    seq: i64,
) -> Result<EventId, StoreError> {
    let text: String = row.try_get(column).map_err(map_sqlx)?;
    outbox_types::sql_store::parse_event_id(seq, column, &text)
}

/// A duration as whole microseconds, capped at [`MAX_INTERVAL`].
pub(crate) fn micros(d: Duration) -> i64 {
    outbox_types::sql_store::micros(d.min(MAX_INTERVAL))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_embeds_the_quoted_table() {
        let outbox = MySqlOutbox::with_table("my_events").unwrap();
        assert!(outbox.sql().ack.contains("`my_events` AS e"));
        assert_eq!(outbox.migrations_table(), "`my_events_migrations`");
        assert!(outbox.sql().claim_lock.contains("'my_events'"));
    }

    #[test]
    fn long_fields_are_refused_before_any_sql() {
        let long = NewEvent::new("a", "x".repeat(256), "T", &1).unwrap();
        let err = validate(&long).unwrap_err();
        assert!(
            matches!(&err, StoreError::Invalid(m) if m.contains("aggregate_id has 256")),
            "{err}"
        );
        // Characters, not bytes: 255 multi-byte characters fit.
        let wide = NewEvent::new("a", "é".repeat(255), "T", &1).unwrap();
        assert!(validate(&wide).is_ok());
        let key = NewEvent::new("a", "1", "T", &1)
            .unwrap()
            .with_idempotency_key("k".repeat(300));
        assert!(validate(&key).is_err());
        let old = NewEvent::new("a", "1", "T", &1)
            .unwrap()
            .with_occurred_at(chrono::DateTime::from_timestamp(-40_000_000_000, 0).unwrap());
        assert!(validate(&old).is_err());
    }

    #[test]
    fn durations_are_capped() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::MAX), micros(MAX_INTERVAL));
    }

    #[test]
    fn batches_are_chunked_by_size_in_order() {
        let big = "x".repeat(1 << 20);
        let events: Vec<NewEvent> = (0..10)
            .map(|i| NewEvent::from_json("a", i.to_string(), "T", format!("\"{big}\"")).unwrap())
            .collect();
        let refs: Vec<&NewEvent> = events.iter().collect();
        let parts = chunks(&refs);
        assert!(parts.len() >= 3, "{}", parts.len());
        let flat: Vec<EventId> = parts
            .iter()
            .flat_map(|c| c.iter().map(|e| e.id()))
            .collect();
        assert_eq!(flat, events.iter().map(NewEvent::id).collect::<Vec<_>>());
        assert_eq!(chunks(&refs[..1]).len(), 1);
    }
}
