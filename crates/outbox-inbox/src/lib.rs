//! # outbox-inbox
//!
//! The consumer side of the outbox. The relay delivers every event **at least once**; this crate
//! turns that into **exactly-once effects** by recording `(event_id, handler)` in an inbox table
//! in the consumer's own database, in the same transaction as the handler's effect, and by
//! acking the broker only after that transaction committed.
//!
//! - [`postgres::PgInbox`], [`mysql::MySqlInbox`] and [`sqlite::SqliteInbox`] (features
//!   `postgres`, `mysql`, `sqlite`, all on by default) own the inbox table (default name
//!   [`DEFAULT_TABLE`], configurable), ship its embedded versioned migrations, and offer
//!   [`claim`](postgres::PgInbox::claim), [`process`](postgres::PgInbox::process) and
//!   [`purge`](postgres::PgInbox::purge).
//! - [`sql::SqlInbox`] is what the three have in common, as a trait: code written once over it
//!   (the crate's conformance tests are) runs on any of them.
//! - The broker adapters (features `nats`, `rabbitmq`, `redis`, `kafka`; off by default) read
//!   the event id from the `outbox-event-id` header (the Redis stream field `id`), run an
//!   [`InboxHandler`], ack (commit the offset) after its commit and park poison messages.
//!
//! ## Two ways to process a message
//!
//! **`claim`, inside your own transaction** — the primitive. Begin a transaction, claim the
//! event first, run the effect only when the claim is [`InboxClaim::Fresh`], commit:
//!
//! ```no_run
//! use outbox_inbox::{InboxClaim, postgres::PgInbox};
//! # async fn demo(pool: sqlx::PgPool, event_id: outbox_types::EventId) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = PgInbox::new();
//! let mut tx = pool.begin().await?;
//! match inbox.claim(&mut *tx, event_id, "billing").await? {
//!     InboxClaim::Fresh => {
//!         sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 1")
//!             .execute(&mut *tx).await?;
//!         tx.commit().await?; // inbox row and effect together
//!     }
//!     InboxClaim::Duplicate => {} // already applied: dropping `tx` rolls back (nothing was written)
//! }
//! # Ok(()) }
//! ```
//!
//! **`process`, a closure given the transaction** — the convenience. It begins, claims, runs the
//! closure, and commits; a duplicate returns [`Processed::Duplicate`] without calling the closure,
//! an error rolls everything back:
//!
//! ```no_run
//! use outbox_inbox::{Processed, postgres::PgInbox};
//! # async fn demo(pool: sqlx::PgPool, event_id: outbox_types::EventId) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = PgInbox::new();
//! let outcome = inbox
//!     .process(&pool, event_id, "billing", |tx| Box::pin(async move {
//!         sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 1")
//!             .execute(&mut **tx).await?;
//!         Ok::<_, outbox_inbox::Error>(42)
//!     }))
//!     .await?;
//! assert!(matches!(outcome, Processed::Applied(42) | Processed::Duplicate));
//! # Ok(()) }
//! ```
//!
//! Why both, and why this shape: in sqlx 0.9 a [`sqlx::Transaction`] is an owned value that
//! derefs to the connection (`&mut *tx` is an executor) and rolls back when dropped. `claim`
//! takes any executor, so it composes with the caller's existing transaction, with `async fn`
//! effects and with borrowed data — no boxing, no lifetimes to satisfy. `process` has the same
//! shape as sqlx's own `Connection::transaction`: an `FnOnce(&mut Transaction) -> BoxFuture`
//! closure, because that is the only way to lend a transaction to a closure's future in stable
//! Rust; its one limit is that what the future captures must be moved in (owned). Its error type
//! is yours (`E: From<outbox_inbox::Error>`), so `anyhow`, `Box<dyn Error>` or a domain enum all
//! work, and the effect's error comes back unchanged.
//!
//! ## Why the claim is a plain insert
//!
//! The claim is `INSERT … ON CONFLICT DO NOTHING` (PostgreSQL, SQLite) or `INSERT IGNORE`
//! (MySQL) of the key `(event_id, handler)`, checking the rows affected: 1 is fresh, 0 is a
//! duplicate. Two consumers that receive the same event at the same time both insert; the second
//! waits on the first one's uncommitted key (a unique-index wait in PostgreSQL and InnoDB, the
//! write lock in SQLite) and then sees either a duplicate (the first committed) or a fresh claim
//! (the first rolled back, so its effect is gone too). No `SELECT` first, so there is no window
//! between "not seen yet" and "mark seen". Claim first, before the effect: the effect then runs
//! while this consumer holds the key, and a concurrent duplicate waits instead of running it too.
//!
//! ## A shared inbox
//!
//! Handlers may share one inbox table under different database users. On PostgreSQL and MySQL
//! a claim row also records the user that wrote it (`claimed_by`, set by a trigger whatever the
//! writer puts there) and the key is `(event_id, handler, claimed_by)`, so a user with `INSERT`
//! on the inbox cannot claim an event for another user's handler: its row is its own. A handler
//! is deduplicated per user; claims written before that (schema version 3) count for every user.
//! `docs/inbox.md` ("Privileges: a shared inbox") lists the grants a consumer needs.
//!
//! ## One claim for every language
//!
//! Consumers written in other languages use the same tables and the same claim: the migrations
//! create a claim routine, `<table>_claim(event_id, handler)` — a function returning a boolean
//! on PostgreSQL ([`PgInbox::claim_function`](postgres::PgInbox::claim_function)), a procedure
//! returning one row `fresh` on MySQL ([`MySqlInbox::claim_procedure`](mysql::MySqlInbox::claim_procedure))
//! — with the insert above inside, and on SQLite the statement is documented
//! ([`SqliteInbox::claim_statement`](sqlite::SqliteInbox::claim_statement)). `claim` runs that
//! same SQL, so there is one definition of the semantics. The contract for consumers in any
//! language (tables, the claim per database, ack-after-commit per broker, parking, retention) is
//! `docs/inbox.md` of the repository; `outbox inbox migrate|status|purge|parked` operates an
//! inbox without Rust.
//!
//! ## Retention
//!
//! The inbox grows by one row per event and handler. [`purge`](postgres::PgInbox::purge)
//! deletes rows processed longer ago than a window, in batches (short transactions, no long
//! locks), using an index on `processed_at`. **The trade-off:** a duplicate that arrives after
//! its row was purged is no longer detected and its effect runs again. Choose a window well
//! above the longest redelivery delay the system can produce — the relay's retry backoff and
//! dead-letter replays, broker redelivery, consumer downtime — e.g. days to weeks, not minutes.
//! Events replayed deliberately from the outbox's dead-letter state after the window are the
//! typical case to think about.
//!
//! ## Poison messages
//!
//! A message whose handler keeps failing would otherwise be redelivered forever. The adapters
//! count attempts ([`AdapterOptions::max_attempts`]) using the broker's own redelivery counter
//! where there is one (JetStream's `delivered`, Redis' `XPENDING` delivery count, RabbitMQ's
//! `x-delivery-count` on quorum queues; for classic RabbitMQ queues an in-process counter; for
//! Kafka, which never redelivers a single message, an in-place retry loop) and,
//! after the last attempt, write the message with its last error to `<table>_parked` and ack it.
//! A message without a readable `outbox-event-id` cannot be deduplicated and is parked at once;
//! so is one whose effect returns a non-transient [`Error`] (e.g. [`Error::BadMessage`] from
//! [`Delivery::json`]: retrying cannot fix a malformed payload). See [`Error::from_effect`].
//! Parked messages are yours to inspect and replay (re-publish them; the inbox still dedups).

mod admin;
mod error;
mod names;

pub mod consumer;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql;
#[cfg(feature = "sqlite")]
pub mod sqlite;

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;

use std::future::Future;
use std::pin::Pin;

pub use admin::{HandlerStats, InboxStats, ParkedCount, ParkedQuery, ParkedRecord};
#[allow(deprecated)]
pub use consumer::Outcome;
pub use consumer::{AdapterOptions, Delivery, HandlerOutcome, InboxHandler, ParkedMessage};
pub use error::{BoxError, Error};
pub use names::MAX_HANDLER_LEN;
pub use outbox_types::EventId;

/// The default inbox table name. Parked messages go to `<table>_parked`, migration bookkeeping
/// to `<table>_migrations`.
pub const DEFAULT_TABLE: &str = "outbox_inbox";

/// A boxed, sendable future borrowing for `'a`: what effect closures return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The result of claiming an event for a handler. Named `InboxClaim`, not `Claim`, because
/// `outbox_types::Claim` is the relay's claimed batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "run the effect only for `InboxClaim::Fresh`"]
pub enum InboxClaim {
    /// The key was new: the inbox row is written in this transaction; run the effect, commit.
    Fresh,
    /// The handler already processed this event (a committed row exists); skip the effect.
    Duplicate,
}

/// The old name of [`InboxClaim`].
#[deprecated(note = "renamed to InboxClaim")]
pub type Claim = InboxClaim;

/// The result of [`process`](postgres::PgInbox::process).
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "a duplicate did not run the effect"]
pub enum Processed<T> {
    /// The effect ran and committed together with the inbox row; its value.
    Applied(T),
    /// The event was already processed by this handler; the effect did not run.
    Duplicate,
}

impl<T> Processed<T> {
    /// Whether the effect ran.
    ///
    /// ```
    /// assert!(outbox_inbox::Processed::Applied(()).is_applied());
    /// assert!(!outbox_inbox::Processed::<()>::Duplicate.is_applied());
    /// ```
    pub fn is_applied(&self) -> bool {
        matches!(self, Processed::Applied(_))
    }
}

pub use outbox_types::migration::MigrationReport;

/// One schema change. `{t}` (the quoted inbox table), `{p}` (the quoted parked table) and
/// `{table}` (the bare name, for index names) are replaced before it runs; the checksum recorded
/// in `<table>_migrations` is [`outbox_types::migration::checksum`] of the template, as it
/// always was.
#[allow(dead_code)]
pub(crate) type Migration = outbox_types::migration::Migration;

/// The migrations of `known` not yet in `applied` (the `(version, checksum)` rows of
/// `<table>_migrations`), oldest first; a version this build does not know, or an edited one,
/// is [`Error::NotMigrated`].
#[allow(dead_code)]
pub(crate) fn pending<'m>(
    known: &'m [Migration],
    applied: &[(i64, String)],
) -> Result<Vec<&'m Migration>, Error> {
    outbox_types::migration::pending(outbox_types::migration::Schema::INBOX, known, applied)
        .map_err(|e| Error::NotMigrated(e.to_string()))
}

#[cfg(test)]
mod tests {
    /// A database whose `<table>_migrations` holds `recorded`, the `(version, checksum)` rows
    /// earlier releases wrote, is current: nothing to apply, nothing refused.
    pub(crate) fn assert_current(known: &[crate::Migration], recorded: &[(i64, &str)]) {
        let recorded: Vec<(i64, String)> = recorded
            .iter()
            .map(|(v, c)| (*v, (*c).to_owned()))
            .collect();
        assert!(crate::pending(known, &recorded).unwrap().is_empty());
        assert_eq!(
            outbox_types::migration::latest_version(known),
            recorded.len() as i64
        );
    }

    /// The names before `InboxClaim` and `HandlerOutcome` still compile, as aliases.
    #[test]
    #[allow(deprecated)]
    fn the_old_names_still_work() {
        let claim: crate::Claim = crate::InboxClaim::Fresh;
        assert_eq!(claim, crate::Claim::Fresh);
        assert!(matches!(
            crate::Outcome::Duplicate,
            crate::HandlerOutcome::Duplicate
        ));
        assert!(crate::consumer::Outcome::Parked.is_acked());
    }
}
