//! The inbox contract, written once and run against every SQL database: each database's test
//! file implements [`Backend`] and invokes `conformance_tests!(ItsBackend)`, which expands to
//! one `#[tokio::test]` per property below. What only one database has (a claim function or
//! procedure, SQLite's clock) is tested in that database's file.
//!
//! Why: the three inboxes promise the same thing — a claim is first-wins across concurrent
//! consumers, an effect commits with its inbox row or not at all, purge deletes only old rows,
//! parked messages and statistics read back as written — so the same tests hold each of them
//! to it, and a database added later passes the same suite.

#![allow(dead_code)]

mod roles;
mod routine;

#[allow(unused_imports)]
pub use roles::*;
pub use routine::*;

use std::future::Future;
use std::time::{Duration, Instant};

use outbox_inbox::sql::{SqlHandler, SqlInbox};
use outbox_inbox::{
    BoxError, BoxFuture, Delivery, Error, EventId, InboxClaim, InboxHandler, ParkedMessage,
    ParkedQuery, Processed,
};
use sqlx::{Database, Pool, Transaction};
use tokio::task::JoinHandle;

/// The database of a backend.
pub type Db<B> = <<B as Backend>::Inbox as SqlInbox>::Db;
/// A connection of a backend's database.
pub type Conn<B> = <Db<B> as Database>::Connection;

/// How the suite gets at one database: a connection, two ways to run SQL, and the SQL that
/// differs.
pub trait Backend: Sized + Send + Sync + 'static {
    /// The inbox under test.
    type Inbox: SqlInbox;
    /// The schema version a fresh `migrate` reaches (it applies versions 1 to this).
    const SCHEMA_VERSION: i64;
    /// `count(*)` as a signed 64-bit integer.
    const COUNT: &'static str = "count(*)";

    /// What follows `CREATE TABLE <effects>`: the columns `event_id` (the UUID) and `handler`.
    const EFFECTS_DEFINITION: &'static str;

    /// A pool on the database.
    fn pool() -> impl Future<Output = Pool<Db<Self>>> + Send;

    /// An unmigrated inbox in the table `table` (PostgreSQL: in a new schema of its own), or
    /// the constructor's refusal of the name.
    fn inbox(table: &str) -> Result<Self::Inbox, Error>;

    /// The quoted name of the table `<table><suffix>` next to `inbox` (in its schema); the
    /// suffix `""` names the inbox table itself.
    fn beside(inbox: &Self::Inbox, suffix: &str) -> String;

    /// The quoted name of the effects table next to `inbox`.
    fn effects_table(inbox: &Self::Inbox) -> String {
        Self::beside(inbox, "_effects")
    }

    /// Run `sql` on `conn`. (Written per database, by [`run_sql!`], because sqlx's executor
    /// bound cannot be stated once for every database.)
    fn execute(conn: &mut Conn<Self>, sql: String) -> BoxFuture<'_, Result<(), sqlx::Error>>;

    /// Run `sql`, which returns one integer, on `conn`.
    fn fetch_i64(conn: &mut Conn<Self>, sql: String) -> BoxFuture<'_, i64>;

    /// SQL for a `processed_at` `hours` before now.
    fn hours_ago(hours: u32) -> String;

    /// SQL setting `id`'s `processed_at` to `hours` before now.
    fn backdate(inbox: &Self::Inbox, id: EventId, hours: u32) -> String {
        format!(
            "UPDATE {} SET processed_at = {} WHERE event_id = '{id}'",
            Self::beside(inbox, ""),
            Self::hours_ago(hours)
        )
    }

    /// The quoted migrations (bookkeeping) table.
    fn migrations_table(inbox: &Self::Inbox) -> String {
        Self::beside(inbox, "_migrations")
    }

    /// SQL dropping the claim routine (function or procedure) that schema version 2 adds.
    /// Only for databases whose schema has a version 2, which run
    /// [`a_version_1_inbox_is_upgraded_and_says_so_until_then`].
    fn drop_claim_routine(inbox: &Self::Inbox) -> String {
        let _ = inbox;
        unreachable!("this database's inbox schema has one version")
    }

    /// SQL that takes a migrated inbox back to schema version 1: drops the claim routine and
    /// its bookkeeping row.
    fn downgrade_to_version_1(inbox: &Self::Inbox) -> String {
        format!(
            "{}; DELETE FROM {} WHERE version = 2",
            Self::drop_claim_routine(inbox),
            Self::migrations_table(inbox)
        )
    }
}

/// [`Backend::execute`] and [`Backend::fetch_i64`] for the connection type `$conn`.
macro_rules! run_sql {
    ($conn:ty) => {
        fn execute(
            conn: &mut $conn,
            sql: String,
        ) -> outbox_inbox::BoxFuture<'_, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(conn)
                    .await?;
                Ok(())
            })
        }

        fn fetch_i64(conn: &mut $conn, sql: String) -> outbox_inbox::BoxFuture<'_, i64> {
            Box::pin(async move {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(conn)
                    .await
                    .unwrap()
            })
        }
    };
}
pub(crate) use run_sql;

/// [`Backend::inbox`] and [`Backend::beside`] for `$inbox`, an inbox whose tables need no
/// schema (MySQL, SQLite): `with_table`, and a name quoted between two `$quote`s. (Unused by
/// PostgreSQL's tests, whose tables have a schema.)
#[allow(unused_macros)]
macro_rules! table_names {
    ($inbox:ty, $quote:literal) => {
        fn inbox(table: &str) -> Result<$inbox, outbox_inbox::Error> {
            <$inbox>::with_table(table)
        }

        fn beside(inbox: &$inbox, suffix: &str) -> String {
            format!(concat!($quote, "{}{}", $quote), inbox.table(), suffix)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use table_names;

/// A pool of 12 connections to the server at the URL in the environment variable `var`
/// (`default` without it); panics saying `running` when none answers.
pub async fn connect<DB: Database>(var: &str, default: &str, running: &str) -> Pool<DB> {
    let url = std::env::var(var).unwrap_or_else(|_| default.to_owned());
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(12)
        .connect(&url)
        .await
        .expect(running)
}

/// A migrated inbox of its own, the pool and the effects table.
pub struct Fixture<B: Backend> {
    pub pool: Pool<Db<B>>,
    pub inbox: B::Inbox,
    pub effects: String,
}

impl<B: Backend> Clone for Fixture<B> {
    fn clone(&self) -> Self {
        Fixture {
            pool: self.pool.clone(),
            inbox: self.inbox.clone(),
            effects: self.effects.clone(),
        }
    }
}

/// An inbox of its own (a unique table) on the pool, migrated (every version is applied), and
/// its effects table.
pub async fn setup<B: Backend>() -> Fixture<B> {
    let pool = B::pool().await;
    let inbox = B::inbox(&outbox_testkit::unique("inbox_t")).unwrap();
    let report = inbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied, (1..=B::SCHEMA_VERSION).collect::<Vec<_>>());
    let fx = Fixture {
        effects: B::effects_table(&inbox),
        pool,
        inbox,
    };
    let definition = B::EFFECTS_DEFINITION;
    execute(&fx, format!("CREATE TABLE {} {definition}", fx.effects)).await;
    fx
}

/// The effect the tests run: insert `(id, 'billing')` into `effects`.
fn insert_effect(effects: &str, id: EventId) -> String {
    format!("INSERT INTO {effects} (event_id, handler) VALUES ('{id}', 'billing')")
}

/// Run `sql` on the pool.
pub async fn execute<B: Backend>(fx: &Fixture<B>, sql: String) {
    let mut conn = fx.pool.acquire().await.unwrap();
    B::execute(&mut conn, sql).await.unwrap();
}

async fn effect_count<B: Backend>(fx: &Fixture<B>) -> i64 {
    let mut conn = fx.pool.acquire().await.unwrap();
    B::fetch_i64(
        &mut conn,
        format!("SELECT {} FROM {}", B::COUNT, fx.effects),
    )
    .await
}

/// The effect of the ready-made handler the tests use.
pub fn effect<B: Backend>(
    effects: &str,
) -> impl for<'c> Fn(
    &'c mut Transaction<'static, Db<B>>,
    &'c Delivery,
) -> BoxFuture<'c, Result<(), BoxError>>
+ Send
+ Sync
+ 'static {
    let effects = effects.to_owned();
    move |tx, d| {
        let sql = insert_effect(&effects, d.event_id);
        Box::pin(async move {
            B::execute(&mut **tx, sql).await?;
            Ok(())
        })
    }
}

/// `process` with the effect [`insert_effect`], as handler `billing`.
pub async fn apply<B: Backend>(fx: &Fixture<B>, id: EventId) -> Result<Processed<()>, Error> {
    let sql = insert_effect(&fx.effects, id);
    fx.inbox
        .process(&fx.pool, id, "billing", move |tx| {
            Box::pin(async move {
                B::execute(&mut **tx, sql).await?;
                Ok(())
            })
        })
        .await
}

/// Begin a transaction and claim `id` for `billing` in it: a first consumer, not committed yet.
async fn claim_and_hold<B: Backend>(fx: &Fixture<B>, id: EventId) -> Transaction<'static, Db<B>> {
    let mut first = fx.inbox.begin(&fx.pool).await.unwrap();
    assert_eq!(
        fx.inbox.claim(&mut *first, id, "billing").await.unwrap(),
        InboxClaim::Fresh
    );
    first
}

/// A second consumer applying `id` in the background; what it got and how long it took.
fn spawn_apply<B: Backend>(fx: &Fixture<B>, id: EventId) -> JoinHandle<(Processed<()>, Duration)> {
    let fx = fx.clone();
    tokio::spawn(async move {
        let started = Instant::now();
        let r = apply(&fx, id).await.unwrap();
        (r, started.elapsed())
    })
}

/// Expand to one test per property of the inbox contract for `$backend` (a type implementing
/// [`Backend`]), and for the properties only some databases have that follow it
/// (`$backend; a_version_1_inbox_is_upgraded_and_says_so_until_then`); `@tests $backend; names`
/// for those alone; `@as $backend; name = scenario`
/// for a test named `name` running the scenario `scenario` (the database's own word for its
/// claim routine in the name).
macro_rules! conformance_tests {
    ($backend:ty $(; $($extra:ident),* $(,)?)?) => {
        $crate::conformance::conformance_tests!(@tests $backend; $($($extra,)*)?
            migrate_is_idempotent,
            process_twice_applies_once,
            failed_effect_records_nothing_and_retry_applies,
            concurrent_duplicate_waits_then_skips,
            concurrent_duplicate_after_rollback_applies,
            many_concurrent_deliveries_apply_once,
            purge_removes_old_rows_and_keeps_recent_ones,
            handler_applies_once_and_parks,
            bad_names_are_rejected,
            edited_migration_is_refused,
            stats_and_parked_records_describe_the_inbox,
        );
    };
    (@tests $backend:ty; $($name:ident),* $(,)?) => {
        $crate::conformance::conformance_tests!(@as $backend; $($name = $name),*);
    };
    (@as $backend:ty; $($name:ident = $scenario:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                $crate::conformance::$scenario::<$backend>().await;
            }
        )*
    };
}
pub(crate) use conformance_tests;

pub async fn migrate_is_idempotent<B: Backend>() {
    let fx = setup::<B>().await;
    let again = fx.inbox.migrate(&fx.pool).await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(again.current, B::SCHEMA_VERSION);
}

pub async fn process_twice_applies_once<B: Backend>() {
    let fx = setup::<B>().await;
    let id = EventId::new();
    assert_eq!(apply(&fx, id).await.unwrap(), Processed::Applied(()));
    assert_eq!(apply(&fx, id).await.unwrap(), Processed::Duplicate);
    assert_eq!(effect_count(&fx).await, 1);
    assert!(fx.inbox.contains(&fx.pool, id, "billing").await.unwrap());
    // Another handler is another key.
    assert!(!fx.inbox.contains(&fx.pool, id, "shipping").await.unwrap());
}

pub async fn failed_effect_records_nothing_and_retry_applies<B: Backend>() {
    let fx = setup::<B>().await;
    let id = EventId::new();
    let sql = insert_effect(&fx.effects, id);
    let failed: Result<Processed<()>, Error> = fx
        .inbox
        .process(&fx.pool, id, "billing", move |tx| {
            Box::pin(async move {
                B::execute(&mut **tx, sql).await?;
                Err(Error::BadMessage("the effect failed after writing".into()))
            })
        })
        .await;
    assert!(failed.is_err());
    assert!(!fx.inbox.contains(&fx.pool, id, "billing").await.unwrap());
    assert_eq!(effect_count(&fx).await, 0);
    assert_eq!(apply(&fx, id).await.unwrap(), Processed::Applied(()));
    assert_eq!(effect_count(&fx).await, 1);
}

pub async fn concurrent_duplicate_waits_then_skips<B: Backend>() {
    let fx = setup::<B>().await;
    let id = EventId::new();
    // First consumer claims and holds its transaction open.
    let mut first = claim_and_hold(&fx, id).await;
    let second = spawn_apply(&fx, id);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!second.is_finished(), "the second claim must wait");
    B::execute(&mut first, insert_effect(&fx.effects, id))
        .await
        .unwrap();
    first.commit().await.unwrap();
    let (r, waited) = second.await.unwrap();
    assert_eq!(r, Processed::Duplicate);
    assert!(waited >= Duration::from_millis(300));
    assert_eq!(effect_count(&fx).await, 1);
}

pub async fn concurrent_duplicate_after_rollback_applies<B: Backend>() {
    let fx = setup::<B>().await;
    let id = EventId::new();
    let first = claim_and_hold(&fx, id).await;
    let second = spawn_apply(&fx, id);
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.rollback().await.unwrap();
    assert_eq!(second.await.unwrap().0, Processed::Applied(()));
    assert_eq!(effect_count(&fx).await, 1);
}

pub async fn many_concurrent_deliveries_apply_once<B: Backend>() {
    let fx = setup::<B>().await;
    let id = EventId::new();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let fx = fx.clone();
        tasks.push(tokio::spawn(async move { apply(&fx, id).await.unwrap() }));
    }
    let mut applied = 0;
    for t in tasks {
        if t.await.unwrap().is_applied() {
            applied += 1;
        }
    }
    assert_eq!(applied, 1);
    assert_eq!(effect_count(&fx).await, 1);
}

pub async fn purge_removes_old_rows_and_keeps_recent_ones<B: Backend>() {
    let fx = setup::<B>().await;
    let ids: Vec<EventId> = (0..5).map(|_| EventId::new()).collect();
    for id in &ids {
        assert!(apply(&fx, *id).await.unwrap().is_applied());
    }
    // Age three of them by two days.
    for id in &ids[..3] {
        execute(&fx, B::backdate(&fx.inbox, *id, 48)).await;
    }
    let deleted = fx
        .inbox
        .purge(&fx.pool, Duration::from_secs(24 * 3600), 2)
        .await
        .unwrap();
    assert_eq!(deleted, 3);
    for id in &ids[..3] {
        assert!(!fx.inbox.contains(&fx.pool, *id, "billing").await.unwrap());
    }
    for id in &ids[3..] {
        assert!(fx.inbox.contains(&fx.pool, *id, "billing").await.unwrap());
    }
    // The trade-off: a purged event is no longer detected as a duplicate.
    assert!(apply(&fx, ids[0]).await.unwrap().is_applied());
}

pub async fn handler_applies_once_and_parks<B: Backend>() {
    let fx = setup::<B>().await;
    let handler = SqlHandler::new(
        fx.pool.clone(),
        fx.inbox.clone(),
        "billing",
        effect::<B>(&fx.effects),
    )
    .unwrap();
    let d = Delivery::new(EventId::new(), b"{}".to_vec(), "orders");
    assert!(handler.handle(&d).await.unwrap().is_applied());
    assert_eq!(handler.handle(&d).await.unwrap(), Processed::Duplicate);
    assert_eq!(effect_count(&fx).await, 1);

    let p = ParkedMessage::new(Some(d.event_id), "orders", b"{}".to_vec(), 3, "boom");
    handler.park(&p).await.unwrap();
    let parked = fx.inbox.parked(&fx.pool, "billing", 10).await.unwrap();
    assert_eq!(parked, vec![p]);
}

pub async fn bad_names_are_rejected<B: Backend>() {
    assert!(B::inbox("Bad-Name").is_err());
    let fx = setup::<B>().await;
    let mut tx = fx.pool.begin().await.unwrap();
    let long = "x".repeat(outbox_inbox::MAX_HANDLER_LEN + 1);
    let err = fx
        .inbox
        .claim(&mut *tx, EventId::new(), &long)
        .await
        .unwrap_err();
    assert!(!err.is_transient());
}

pub async fn edited_migration_is_refused<B: Backend>() {
    let fx = setup::<B>().await;
    let migrations = B::migrations_table(&fx.inbox);
    execute(
        &fx,
        format!("UPDATE {migrations} SET checksum = 'edited' WHERE version = 1"),
    )
    .await;
    let err = fx.inbox.migrate(&fx.pool).await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated(_)), "{err}");
    assert!(!err.is_transient());
}

pub async fn stats_and_parked_records_describe_the_inbox<B: Backend>() {
    let fx = setup::<B>().await;
    let (inbox, pool) = (&fx.inbox, &fx.pool);
    let empty = inbox.stats(pool, Duration::from_secs(3600)).await.unwrap();
    assert_eq!(
        (empty.schema_version, empty.rows(), empty.parked_total()),
        (B::SCHEMA_VERSION, 0, 0)
    );
    let ids: Vec<EventId> = (0..3).map(|_| EventId::new()).collect();
    for id in &ids {
        assert!(apply(&fx, *id).await.unwrap().is_applied());
    }
    execute(&fx, B::backdate(&fx.inbox, ids[0], 2)).await;
    for n in 0..3 {
        let p = ParkedMessage::new(None, "orders", vec![n], 1, format!("boom {n}"));
        inbox
            .park(pool, if n == 2 { "delivery" } else { "billing" }, &p)
            .await
            .unwrap();
    }
    let stats = inbox.stats(pool, Duration::from_secs(3600)).await.unwrap();
    assert_eq!(stats.handlers.len(), 1);
    let billing = &stats.handlers[0];
    assert_eq!(
        (
            billing.handler.as_str(),
            billing.rows,
            billing.past_retention
        ),
        ("billing", 3, 1)
    );
    assert!(billing.oldest < billing.newest);
    assert_eq!(stats.parked_total(), 3);
    assert_eq!(
        stats
            .parked
            .iter()
            .map(|p| (p.handler.as_str(), p.messages))
            .collect::<Vec<_>>(),
        [("billing", 2), ("delivery", 1)]
    );

    let all = inbox.list_parked(pool, &ParkedQuery::new()).await.unwrap();
    assert_eq!(all.len(), 3);
    let page = ParkedQuery::new()
        .handler("billing")
        .after(all[0].id)
        .limit(5);
    let rest = inbox.list_parked(pool, &page).await.unwrap();
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].message.error, "boom 1");
    let one = inbox.parked_record(pool, all[2].id).await.unwrap().unwrap();
    assert_eq!(
        (one.handler.as_str(), one.message.payload.clone()),
        ("delivery", vec![2])
    );
    assert!(inbox.parked_record(pool, -1).await.unwrap().is_none());
}

/// PostgreSQL and MySQL: an inbox created before the claim routine (schema version 1) gets it
/// from the next migrate; until then the Rust claim says what to run.
pub async fn a_version_1_inbox_is_upgraded_and_says_so_until_then<B: Backend>() {
    let fx = setup::<B>().await;
    execute(&fx, B::downgrade_to_version_1(&fx.inbox)).await;
    let mut tx = fx.pool.begin().await.unwrap();
    let err = fx
        .inbox
        .claim(&mut *tx, EventId::new(), "billing")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotMigrated(_)), "{err}");
    assert!(err.to_string().contains("outbox inbox migrate"), "{err}");
    drop(tx);
    let report = fx.inbox.migrate(&fx.pool).await.unwrap();
    assert_eq!(report.applied, vec![2]);
    let mut tx = fx.pool.begin().await.unwrap();
    assert_eq!(
        fx.inbox
            .claim(&mut *tx, EventId::new(), "billing")
            .await
            .unwrap(),
        InboxClaim::Fresh
    );
}
