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
mod settle;
mod sql;
mod store;
mod time;

pub use connect::{BUSY_TIMEOUT, SqliteStore};
pub use outbox::{DEFAULT_TABLE, SqliteOutbox};
/// What [`SqliteOutbox::migrate`] did (shared by every store:
/// [`outbox_types::migration::MigrationReport`]).
pub use outbox_types::migration::MigrationReport;

/// The result of an enqueue (shared by every store: [`outbox_types::sql_store::Enqueued`]).
pub use outbox_types::sql_store::Enqueued;

pub(crate) use time::now_micros;
