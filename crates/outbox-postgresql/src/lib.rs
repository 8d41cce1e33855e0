//! # outbox-postgresql
//!
//! The PostgreSQL home of the outbox: embedded migrations, [`PgOutbox::enqueue`] into the
//! caller's own transaction, and [`PgStore`], the [`Store`] a relay claims from.
//!
//! ```no_run
//! use outbox_types::NewEvent;
//! use outbox_postgresql::PgOutbox;
//!
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = PgOutbox::new(); // table "outbox"."events"
//! outbox.migrate(&pool).await?;
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
//!     .bind(42_i64).bind(1999_i64)
//!     .execute(&mut *tx).await?;
//! let event = NewEvent::new("order", "42", "OrderCreated", &serde_json::json!({"amount": 1999}))?;
//! outbox.enqueue(&mut *tx, &event).await?;
//! tx.commit().await?; // the order and its event exist together, or neither does
//! # Ok(()) }
//! ```
//!
//! Claims are serialized across relays with a transaction-scoped advisory lock taken just before
//! the claim statement (see `outbox_types::Store` for why that is what keeps per-aggregate order
//! with several relays). The lock is held for the duration of one short `UPDATE … RETURNING`;
//! publishing, acking and retrying run without it. Inside that statement the rows are locked with
//! `FOR UPDATE SKIP LOCKED`, and an event skipped because someone else holds its row holds back
//! the rest of its aggregate for that claim (see the comment on the claim SQL for why).
//!
//! ## What the table checks when a row is written
//!
//! Writers in other languages insert into the table directly (or call the enqueue function), so
//! the table itself refuses what the relay could only dead-letter later (migration 6 of the plain
//! layout, 5 of the partitioned one; the contract for writers is `docs/table-contract.md`):
//!
//! - `id` defaults to a new time-ordered UUID v7 (built from `gen_random_uuid()` and
//!   `clock_timestamp()`: PostgreSQL 15 has no `uuidv7()`). In the partitioned layout the
//!   default is on the `_keys` table, whose row a writer inserts first and whose id the event
//!   takes; the event table has none, so an event cannot get an id its keys row lacks.
//! - The trigger `<table>_header_rules` (function `<table>_check_headers`): `headers` is a JSON
//!   object of string values with no name under the prefix `outbox-` (reserved for the relay's
//!   own message headers) other than `outbox-partition`. A writer's `INSERT` (or an `UPDATE`
//!   that sets `headers`) that breaks it fails with SQLSTATE `23514` and a message naming the
//!   header, inside its own transaction; [`PgOutbox::enqueue`] refuses the same names before
//!   sending anything.
//!
//! A trigger, not a CHECK constraint, because of what each costs a writer. PostgreSQL prepares a
//! table's check constraints anew for every statement that writes it (it reads the stored
//! expression and plans it), and this one (a `jsonpath` over the members, and, to leave the
//! relay's updates of old rows alone, a condition on the row's state) added 6 to 12 µs to a
//! single-row `INSERT` with empty headers and 15 to 17 µs with two, against 0 to 1 µs and 4.5 to
//! 5.5 µs for the trigger, whose plan PL/pgSQL caches for the session (20,000 `INSERT`s in a
//! loop, medians of six and of eight interleaved runs, PostgreSQL 15 on the 2-core development
//! machine; a writer's small transaction costs the server about 200 to 250 µs of CPU,
//! `outbox-bench writer-cost`). The trigger also sees only new rows, so an outbox that holds
//! rows written before it upgrades without a validation scan, and the relay settles those rows
//! as before.
//!
//! ## Privileges
//!
//! A writer's role needs `INSERT` on the table and `EXECUTE` on the enqueue functions, never a
//! right to read or change rows (docs/table-contract.md, "Privileges", has the statements).
//! [`PgOutbox::enqueue`] writes an event without an idempotency key with a plain `INSERT`, and
//! goes through the function `<table>_enqueue_batch` for one with a key (and for every event in
//! the partitioned layout): the function runs as its owner (`SECURITY DEFINER`) and inserts with
//! `ON CONFLICT DO NOTHING`, then reads the event holding a taken key without locking it, so the
//! relay can claim that event while the writer's transaction is open. (An upsert run with the
//! writer's rights needs `SELECT` and `UPDATE` on the table, enough to lock and rewrite other
//! services' events.) Every function the migrations install pins `search_path = pg_catalog,
//! pg_temp` and names what it calls with its schema (migration 7 of the plain layout, 6 of the
//! partitioned one; `tests/privileges.rs` lists them from the catalog).
//!
//! ## Autovacuum
//!
//! The outbox is a queue table: every event is inserted, updated at least twice (claim, ack;
//! once more per retry) and, after retention, deleted — three or more dead row versions each,
//! and none of those updates can be HOT because `status` is part of the partial indexes'
//! predicates. PostgreSQL's defaults vacuum a table once 20% of it is dead; for an outbox that
//! keeps a week of delivered events that is millions of dead versions, most of them in the
//! small `_open`, `_blockers` and `_heads` indexes every claim walks, so claims slow down exactly when
//! the backlog grows. Migration 2 therefore sets, on the outbox table only:
//!
//! | setting | value | why |
//! |---|---|---|
//! | `autovacuum_vacuum_scale_factor` | 0.01 | vacuum after 1% of the table is dead, not 20% |
//! | `autovacuum_vacuum_threshold` | 1000 | … plus 1000 rows, so a small outbox is not vacuumed constantly |
//! | `autovacuum_analyze_scale_factor` | 0.02 | the status mix shifts fast; the planner's choice of partial index depends on it |
//! | `autovacuum_analyze_threshold` | 1000 | as above |
//! | `autovacuum_vacuum_cost_delay` | 1 (ms) | half the default pause, so the worker keeps up with the churn |
//!
//! Setting them takes only a `SHARE UPDATE EXCLUSIVE` lock (reads and writes go on). Busier
//! outboxes can lower the scale factor further (`ALTER TABLE outbox.events SET
//! (autovacuum_vacuum_scale_factor = 0.002)`) or raise `autovacuum_vacuum_cost_limit`; and keep
//! long-running transactions away from the database, since vacuum cannot remove row versions a
//! still-open snapshot may see. Past a few million events a day, the partitioned layout avoids
//! the question: its retention deletes nothing.
//!
//! ## Partitioned mode
//!
//! [`PgOutbox::partitioned`] keeps the events in a table range-partitioned by `enqueued_at`
//! (daily by default, see [`Partitioning`]). Retention then drops whole partitions instead of
//! deleting rows: no `DELETE`, no dead versions, no vacuum debt. [`PgOutbox::maintain_partitions`]
//! creates the partitions writers will need ([`Partitioning::ahead`]) and drops those whose range
//! and every delivery are past [`Partitioning::retention`]; a partition holding any pending,
//! in-flight or dead event is never dropped, whatever its age. Call it on a schedule (every few
//! minutes to hourly, from one process or several: runs are serialized) and once before writers
//! start. A default partition catches events no dated partition covers, so a late maintenance
//! run never fails a writer.
//!
//! What differs from the plain layout:
//!
//! - PostgreSQL requires a partitioned table's unique constraints to include the partition key,
//!   so the event `id` and the idempotency key are kept unique across partitions by a small,
//!   unpartitioned `<table>_keys` table (id, key, enqueued_at). The enqueue (the batch function)
//!   writes it first and the event only if that created a row, in one call inside the caller's
//!   transaction, with the same results as the plain layout. Its rows go with their events
//!   (same statement for purge and discard; by `enqueued_at` range right after a partition is
//!   dropped).
//! - `seq` comes from a sequence, and the primary key is `(seq, enqueued_at)`.
//! - Creating or dropping a partition takes an `ACCESS EXCLUSIVE` lock on the outbox table for
//!   a few milliseconds, waited for at most [`Partitioning::lock_timeout`].
//! - `purge_delivered` still works (and is how rows that landed in the default partition are
//!   cleaned), but is not needed for dated partitions.
//! - The WAL relay (`outbox-wal`) is not supported on the partitioned layout.
//!
//! Every [`Store`] operation behaves the same: the conformance suite runs against both layouts.
//!
//! ### Moving an existing outbox to the partitioned layout
//!
//! A table cannot be turned into a partitioned one in place, so the move goes through a second
//! outbox table, without losing or reordering events:
//!
//! 1. Create it next to the old one: `PgOutbox::partitioned("outbox", "events_p", …)`,
//!    `migrate`, `maintain_partitions`.
//! 2. Deploy the writers with the new outbox. Events enqueued from then on go to the new table.
//! 3. Drain the old table: run the relay against it with `stop_when_idle` (`outbox relay
//!    --drain`) until no event is pending or in flight, and only then start the relay on the
//!    new table — an aggregate's old events are then all delivered before its new ones.
//!    (Dead events of the old table stay there; requeue or discard them first if they matter.)
//! 4. After the retention period, drop the old table and its `_migrations` and `_paused`
//!    tables.
//!
//! Idempotency keys are only checked within one table: during step 2, a writer retrying an
//! enqueue that first reached the old table is not recognised as a duplicate by the new one;
//! consumers deduplicate on the event id anyway (at-least-once delivery).

mod admin;
mod claim;
mod connect;
mod decode;
mod enqueue;
mod error;
mod migrations;
mod names;
mod outbox;
mod partition;
mod retention;
mod settle;
mod sql;
mod store;

pub use connect::PgStore;
pub use error::map_sqlx as classify_sqlx_error;
pub use outbox::PgOutbox;
/// What [`PgOutbox::migrate`] did (shared by every store:
/// [`outbox_types::migration::MigrationReport`]).
pub use outbox_types::migration::MigrationReport;
pub use partition::{KeepReason, KeptPartition, PartitionInterval, PartitionReport, Partitioning};

/// The result of an enqueue (shared by every store: [`outbox_types::sql_store::Enqueued`]).
pub use outbox_types::sql_store::Enqueued;

/// `scheme://user:secret@host/db?password=…` with both masked: the one redactor of
/// [`outbox_types::redact`], re-exported where callers have always found it.
pub use outbox_types::redact::redact_url;
