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
//! a pool connection or a pool) rather than an `Executor`, unlike the PostgreSQL store: a batch
//! larger than a few MiB takes several calls, which must run on the **same** connection, and an
//! `Executor` can run only one statement. (A generic `impl sqlx::Acquire` would do that too, but
//! futures holding one trip over a rustc limitation — "implementation of `Acquire` is not
//! general enough" — as soon as they must be `Send`, as in a web handler or `tokio::spawn`.)
//! Call sites read the same: `outbox.enqueue(&mut *tx, &event)`.
//!
//! - **One procedure call**: both write through `CALL <table>_enqueue_batch(?)` (migration 6),
//!   one JSON array of events in, one row per event out. The procedure runs as its definer
//!   (`SQL SECURITY DEFINER`), so a writer needs `EXECUTE` on it and no privilege on the table:
//!   not `SELECT` or `UPDATE`, with which it could read every event and lock and rewrite other
//!   services' (`docs/table-contract.md`, "Privileges", has the grants). An outbox migrated
//!   before the procedure existed is
//!   [`StoreError::NotMigrated`](outbox_types::StoreError::NotMigrated): run `outbox migrate`.
//! - Inside, each event is a plain `INSERT`, in array order (so `seq`s follow it). One that
//!   fails on a unique key is sorted out with shared locks on the id's and the key's index
//!   entries only, never on the row of the event that holds them, so a relay can claim that
//!   event while the writer's transaction is open; its id comes from a plain read. In a
//!   `REPEATABLE READ` transaction whose snapshot predates the commit of that event, the read
//!   cannot see it: the procedure raises SQLSTATE 40001 and the enqueue returns
//!   [`StoreError::Unavailable`](outbox_types::StoreError::Unavailable): retry the transaction
//!   (as after PostgreSQL's serialization failures). Under `READ COMMITTED` every read sees it.
//! - A key already in the table: nothing is written, the event holding it is reported with
//!   `created: false`. A key repeated inside one batch counts once: the first event wins, the
//!   later ones report its id with `created: false`.
//! - The id is unique too: an event whose id another event (with another or no idempotency
//!   key) already has is not written, and the enqueue returns
//!   [`StoreError::Database`](outbox_types::StoreError::Database) naming that event's `seq`. Enqueueing the very same event (same id and key) again is the
//!   ordinary duplicate case.
//! - A batch is sent in calls of at most 4 MiB and 1000 events, in order, on one connection.
//!
//! Header names under the prefix reserved for the relay's own message headers (`outbox-…`,
//! except `outbox-partition`) are refused before anything is sent ([`StoreError::Encode`](outbox_types::StoreError::Encode)); the
//! table's triggers refuse them too, for writers that insert by hand (see "Rows are checked
//! when written" below).
//!
//! Field lengths are checked before anything is sent ([`StoreError::Invalid`](outbox_types::StoreError::Invalid)), so a server in
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
//!   there is nothing to validate on upgrade.
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
//! event whose row someone else has locked at that moment (an operator's statement, a stalled
//! relay's late retry) is skipped, and its successors must then wait too rather
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

mod admin;
mod claim;
mod connect;
mod decode;
mod enqueue;
mod error;
mod migrations;
mod names;
mod outbox;
mod retention;
mod session;
mod settle;
mod sql;
mod store;

pub use claim::CLAIM_LOCK_WAIT_SECONDS;
pub use connect::MySqlStore;
pub use enqueue::{EnqueueTarget, MAX_AGGREGATE_TYPE_CHARS, MAX_DESTINATION_CHARS, MAX_KEY_CHARS};
pub use outbox::{DEFAULT_TABLE, MySqlOutbox};
/// What [`MySqlOutbox::migrate`] did (shared by every store:
/// [`outbox_types::migration::MigrationReport`]).
pub use outbox_types::migration::MigrationReport;
pub use sql::MAX_INTERVAL;

/// The result of an enqueue (shared by every store: [`outbox_types::sql_store::Enqueued`]).
pub use outbox_types::sql_store::Enqueued;

/// `scheme://user:secret@host/db?password=…` with both masked: the one redactor of
/// [`outbox_types::redact`], re-exported where callers have always found it.
pub use outbox_types::redact::redact_url;
