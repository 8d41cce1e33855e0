//! What the three SQL inboxes share: the [`SqlInbox`] trait that PostgreSQL, MySQL and SQLite
//! implement, the ready-made [`SqlHandler`] (`PgHandler`, `MySqlHandler`, `SqliteHandler`), and
//! the inbox logic written once on top of their SQL.
//!
//! Why: the databases differ in their statements, not in what an inbox does — begin, claim
//! first, run the effect, commit; delete old rows in batches until a short batch; turn parked
//! and statistics rows into the same records. That order and those loops live here once, so a
//! fix reaches every database, and each database's file keeps only its SQL. The trait also lets
//! code be written once over any of the three: the crate's conformance tests are, and so can an
//! application that supports several databases.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_types::EventId;
use sqlx::{ColumnIndex, Database, Decode, Pool, Row, Transaction, Type};

use crate::consumer::{Delivery, InboxHandler, ParkedMessage};
use crate::names::check_handler;
use crate::{
    BoxError, BoxFuture, Error, HandlerStats, InboxClaim, InboxStats, MigrationReport, ParkedCount,
    ParkedQuery, ParkedRecord, Processed,
};

/// An inbox in one SQL database: [`PgInbox`](crate::postgres::PgInbox),
/// [`MySqlInbox`](crate::mysql::MySqlInbox) and [`SqliteInbox`](crate::sqlite::SqliteInbox).
/// Each method does what the inherent method of the same name documents; the inherent ones
/// take any executor where these take the pool or a connection.
///
/// ```no_run
/// use outbox_inbox::{Error, EventId, Processed, sql::SqlInbox};
/// # async fn demo<I: SqlInbox>(inbox: I, pool: sqlx::Pool<I::Db>, id: EventId) -> Result<(), Error> {
/// let done = inbox
///     .process(&pool, id, "billing", |_tx| Box::pin(async move { Ok::<_, Error>(()) }))
///     .await?;
/// println!("applied: {}", done.is_applied());
/// # Ok(()) }
/// ```
pub trait SqlInbox: Clone + Send + Sync + 'static {
    /// The database.
    type Db: Database;

    /// Begin the transaction a claim and its effect run in (SQLite: `BEGIN IMMEDIATE`, so a
    /// concurrent claim waits for the write lock instead of failing).
    fn begin(
        &self,
        pool: &Pool<Self::Db>,
    ) -> impl Future<Output = Result<Transaction<'static, Self::Db>, Error>> + Send;

    /// Create or upgrade the inbox tables.
    fn migrate(
        &self,
        pool: &Pool<Self::Db>,
    ) -> impl Future<Output = Result<MigrationReport, Error>> + Send;

    /// Record `(event_id, handler)` on `conn`, the connection of the effect's transaction.
    fn claim(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        event_id: EventId,
        handler: &str,
    ) -> impl Future<Output = Result<InboxClaim, Error>> + Send;

    /// Whether `handler` has processed `event_id`.
    fn contains(
        &self,
        pool: &Pool<Self::Db>,
        event_id: EventId,
        handler: &str,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Delete rows processed more than `older_than` ago, `batch` per statement.
    fn purge(
        &self,
        pool: &Pool<Self::Db>,
        older_than: Duration,
        batch: u32,
    ) -> impl Future<Output = Result<u64, Error>> + Send;

    /// Write a poison message to the parked table for `handler`.
    fn park(
        &self,
        pool: &Pool<Self::Db>,
        handler: &str,
        message: &ParkedMessage,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// The parked messages of `handler`, oldest first.
    fn parked(
        &self,
        pool: &Pool<Self::Db>,
        handler: &str,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<ParkedMessage>, Error>> + Send;

    /// Rows, ages and parked messages per handler, and the schema version.
    fn stats(
        &self,
        pool: &Pool<Self::Db>,
        retention: Duration,
    ) -> impl Future<Output = Result<InboxStats, Error>> + Send;

    /// Parked messages of every handler (or one), with their row ids.
    fn list_parked(
        &self,
        pool: &Pool<Self::Db>,
        query: &ParkedQuery,
    ) -> impl Future<Output = Result<Vec<ParkedRecord>, Error>> + Send;

    /// The parked message with row id `id`.
    fn parked_record(
        &self,
        pool: &Pool<Self::Db>,
        id: i64,
    ) -> impl Future<Output = Result<Option<ParkedRecord>, Error>> + Send;

    /// Claim and run `effect` in one new transaction, then commit; a duplicate does not call
    /// `effect`, an error rolls everything back.
    fn process<T, E, F>(
        &self,
        pool: &Pool<Self::Db>,
        event_id: EventId,
        handler: &str,
        effect: F,
    ) -> impl Future<Output = Result<Processed<T>, E>> + Send
    where
        F: for<'c> FnOnce(&'c mut Transaction<'static, Self::Db>) -> BoxFuture<'c, Result<T, E>>
            + Send,
        E: From<Error> + Send,
        T: Send,
    {
        process(self, pool, event_id, handler, effect)
    }
}

/// Implement [`SqlInbox`] for `$inbox` by calling its inherent methods, and write its inherent
/// `process` (the same for every database, documented with an example in module `$module` over
/// `sqlx::$pool_ty`); `$begin` opens the claim's transaction on `$pool`.
macro_rules! sql_inbox {
    ($inbox:ident, $db:ty, $module:literal, $pool_ty:literal, |$pool:ident| $begin:expr) => {
        impl $inbox {
            /// Claim and run `effect` in one new transaction, then commit. A duplicate returns
            /// [`Processed::Duplicate`](crate::Processed::Duplicate) without calling `effect`; an
            /// error (the effect's or the database's) rolls back, so nothing is recorded and a
            /// redelivery runs the effect again.
            ///
            /// ```no_run
            #[doc = concat!("use outbox_inbox::{Processed, ", $module, "::", stringify!($inbox), "};")]
            #[doc = concat!("# async fn demo(pool: sqlx::", $pool_ty, ", id: outbox_types::EventId) -> Result<(), outbox_inbox::Error> {")]
            #[doc = concat!("let done = ", stringify!($inbox), "::new()")]
            ///     .process(&pool, id, "billing", |tx| Box::pin(async move {
            ///         sqlx::query("UPDATE accounts SET balance = balance + 1").execute(&mut **tx).await?;
            ///         Ok::<_, outbox_inbox::Error>(())
            ///     }))
            ///     .await?;
            /// println!("applied: {}", done.is_applied());
            /// # Ok(()) }
            /// ```
            pub async fn process<T, E, F>(
                &self,
                pool: &sqlx::Pool<$db>,
                event_id: outbox_types::EventId,
                handler: &str,
                effect: F,
            ) -> Result<$crate::Processed<T>, E>
            where
                F: for<'c> FnOnce(
                        &'c mut sqlx::Transaction<'static, $db>,
                    ) -> $crate::BoxFuture<'c, Result<T, E>>
                    + Send,
                E: From<$crate::Error>,
            {
                $crate::sql::process(self, pool, event_id, handler, effect).await
            }
        }

        impl $crate::sql::SqlInbox for $inbox {
            type Db = $db;

            async fn begin(
                &self,
                $pool: &sqlx::Pool<$db>,
            ) -> Result<sqlx::Transaction<'static, $db>, $crate::Error> {
                Ok($begin.await?)
            }

            async fn migrate(
                &self,
                pool: &sqlx::Pool<$db>,
            ) -> Result<$crate::MigrationReport, $crate::Error> {
                <$inbox>::migrate(self, pool).await
            }

            async fn claim(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                event_id: outbox_types::EventId,
                handler: &str,
            ) -> Result<$crate::InboxClaim, $crate::Error> {
                <$inbox>::claim(self, conn, event_id, handler).await
            }

            async fn contains(
                &self,
                pool: &sqlx::Pool<$db>,
                event_id: outbox_types::EventId,
                handler: &str,
            ) -> Result<bool, $crate::Error> {
                <$inbox>::contains(self, pool, event_id, handler).await
            }

            async fn purge(
                &self,
                pool: &sqlx::Pool<$db>,
                older_than: std::time::Duration,
                batch: u32,
            ) -> Result<u64, $crate::Error> {
                <$inbox>::purge(self, pool, older_than, batch).await
            }

            async fn park(
                &self,
                pool: &sqlx::Pool<$db>,
                handler: &str,
                message: &$crate::ParkedMessage,
            ) -> Result<(), $crate::Error> {
                <$inbox>::park(self, pool, handler, message).await
            }

            async fn parked(
                &self,
                pool: &sqlx::Pool<$db>,
                handler: &str,
                limit: u32,
            ) -> Result<Vec<$crate::ParkedMessage>, $crate::Error> {
                <$inbox>::parked(self, pool, handler, limit).await
            }

            async fn stats(
                &self,
                pool: &sqlx::Pool<$db>,
                retention: std::time::Duration,
            ) -> Result<$crate::InboxStats, $crate::Error> {
                <$inbox>::stats(self, pool, retention).await
            }

            async fn list_parked(
                &self,
                pool: &sqlx::Pool<$db>,
                query: &$crate::ParkedQuery,
            ) -> Result<Vec<$crate::ParkedRecord>, $crate::Error> {
                <$inbox>::list_parked(self, pool, query).await
            }

            async fn parked_record(
                &self,
                pool: &sqlx::Pool<$db>,
                id: i64,
            ) -> Result<Option<$crate::ParkedRecord>, $crate::Error> {
                <$inbox>::parked_record(self, pool, id).await
            }
        }
    };
}
pub(crate) use sql_inbox;

/// Begin, claim, run `effect`, commit: `process` of every inbox.
pub(crate) async fn process<I, T, E, F>(
    inbox: &I,
    pool: &Pool<I::Db>,
    event_id: EventId,
    handler: &str,
    effect: F,
) -> Result<Processed<T>, E>
where
    I: SqlInbox,
    F: for<'c> FnOnce(&'c mut Transaction<'static, I::Db>) -> BoxFuture<'c, Result<T, E>> + Send,
    E: From<Error>,
{
    let mut tx = inbox.begin(pool).await?;
    if SqlInbox::claim(inbox, &mut *tx, event_id, handler).await? == InboxClaim::Duplicate {
        return Ok(Processed::Duplicate);
    }
    let value = effect(&mut tx).await?;
    tx.commit().await.map_err(Error::from)?;
    Ok(Processed::Applied(value))
}

/// The effect a [`SqlHandler`] runs inside the inbox transaction of database `DB`
/// (`PgEffect`, `MySqlEffect` and `SqliteEffect` name it for each database).
pub trait SqlEffect<DB: Database>:
    for<'c> Fn(
        &'c mut Transaction<'static, DB>,
        &'c Delivery,
    ) -> BoxFuture<'c, Result<(), BoxError>>
    + Send
    + Sync
{
}

impl<DB: Database, F> SqlEffect<DB> for F where
    F: for<'c> Fn(
            &'c mut Transaction<'static, DB>,
            &'c Delivery,
        ) -> BoxFuture<'c, Result<(), BoxError>>
        + Send
        + Sync
{
}

/// An [`InboxHandler`] over an SQL inbox: claims, runs `effect`, commits; parks into
/// `<table>_parked`. Give it to a broker adapter. Each database names it:
/// [`PgHandler`](crate::postgres::PgHandler), [`MySqlHandler`](crate::mysql::MySqlHandler),
/// [`SqliteHandler`](crate::sqlite::SqliteHandler).
pub struct SqlHandler<I: SqlInbox, F> {
    pool: Pool<I::Db>,
    inbox: I,
    handler: String,
    effect: F,
}

impl<I: SqlInbox, F: SqlEffect<I::Db>> SqlHandler<I, F> {
    /// A handler named `handler` (the second half of the inbox key) running `effect`.
    ///
    /// ```no_run
    /// use outbox_inbox::postgres::{PgHandler, PgInbox};
    /// # fn demo(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
    /// let handler = PgHandler::new(pool, PgInbox::new(), "billing", |tx, delivery| Box::pin(async move {
    ///     sqlx::query("INSERT INTO invoices (event_id) VALUES ($1)")
    ///         .bind(delivery.event_id.as_uuid())
    ///         .execute(&mut **tx).await?;
    ///     Ok(())
    /// }))?;
    /// # Ok(()) }
    /// ```
    pub fn new(
        pool: Pool<I::Db>,
        inbox: I,
        handler: impl Into<String>,
        effect: F,
    ) -> Result<Self, Error> {
        let handler = handler.into();
        check_handler(&handler)?;
        Ok(SqlHandler {
            pool,
            inbox,
            handler,
            effect,
        })
    }
}

#[async_trait]
impl<I: SqlInbox, F: SqlEffect<I::Db>> InboxHandler for SqlHandler<I, F> {
    /// Claim the delivery and run the effect in one committed transaction.
    async fn handle(&self, delivery: &Delivery) -> Result<Processed<()>, Error> {
        let mut tx = self.inbox.begin(&self.pool).await?;
        if self
            .inbox
            .claim(&mut *tx, delivery.event_id, &self.handler)
            .await?
            == InboxClaim::Duplicate
        {
            return Ok(Processed::Duplicate);
        }
        (self.effect)(&mut tx, delivery)
            .await
            .map_err(Error::from_effect)?;
        tx.commit().await?;
        Ok(Processed::Applied(()))
    }

    async fn park(&self, message: &ParkedMessage) -> Result<(), Error> {
        self.inbox.park(&self.pool, &self.handler, message).await
    }
}

/// Run `delete_batch(batch)` (one purge statement deleting at most `batch` rows; `0` counts as
/// `1`) until it deletes fewer than `batch`; the total deleted. The loop is
/// [`outbox_types::batch::in_batches`], shared with the stores' purges.
pub(crate) async fn purge_in_batches<F, Fut>(batch: u32, delete_batch: F) -> Result<u64, Error>
where
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Result<u64, Error>>,
{
    outbox_types::batch::in_batches(batch, |_| {}, delete_batch).await
}

/// How one database stores the two columns whose types differ: event ids and times.
pub(crate) trait InboxRow: Row {
    /// A nullable event-id column; by default UUID text (MySQL, SQLite), a text that is no
    /// UUID reading as none.
    fn event_id(&self, index: usize) -> Result<Option<EventId>, Error>
    where
        usize: ColumnIndex<Self>,
        for<'r> String: Decode<'r, Self::Database> + Type<Self::Database>,
    {
        Ok(self
            .try_get::<Option<String>, _>(index)?
            .and_then(|s| uuid::Uuid::parse_str(&s).ok())
            .map(EventId::from_uuid))
    }

    /// A nullable time column.
    fn time(&self, index: usize) -> Result<Option<DateTime<Utc>>, Error>;
}

/// Columns 0 to 5 of a parked row: event_id, source, payload, headers (text), attempts, error.
pub(crate) fn parked_message<R>(row: &R) -> Result<ParkedMessage, Error>
where
    R: InboxRow,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
{
    let headers: String = row.try_get(3)?;
    let headers: BTreeMap<String, String> = serde_json::from_str(&headers).unwrap_or_default();
    let attempts: i32 = row.try_get(4)?;
    Ok(ParkedMessage {
        event_id: row.event_id(0)?,
        source: row.try_get(1)?,
        payload: row.try_get(2)?,
        headers,
        attempts: u32::try_from(attempts).unwrap_or(0),
        error: row.try_get(5)?,
    })
}

/// A parked row with id, handler and parked_at as columns 6 to 8.
pub(crate) fn parked_record<R>(row: &R) -> Result<ParkedRecord, Error>
where
    R: InboxRow,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(ParkedRecord {
        id: row.try_get(6)?,
        handler: row.try_get(7)?,
        parked_at: row.time(8)?.unwrap_or_default(),
        message: parked_message(row)?,
    })
}

/// The statistics from the schema version, the per-handler rows (handler, rows, rows past
/// retention, oldest, newest) and the per-handler parked rows (handler, messages, oldest).
pub(crate) fn stats<R>(
    schema_version: Option<i64>,
    handler_rows: &[R],
    parked_rows: &[R],
) -> Result<InboxStats, Error>
where
    R: InboxRow,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let count = |row: &R, index: usize| -> Result<u64, Error> {
        Ok(u64::try_from(row.try_get::<i64, _>(index)?).unwrap_or(0))
    };
    let mut handlers = Vec::with_capacity(handler_rows.len());
    for row in handler_rows {
        handlers.push(HandlerStats {
            handler: row.try_get(0)?,
            rows: count(row, 1)?,
            past_retention: count(row, 2)?,
            oldest: row.time(3)?,
            newest: row.time(4)?,
        });
    }
    let mut parked = Vec::with_capacity(parked_rows.len());
    for row in parked_rows {
        parked.push(ParkedCount {
            handler: row.try_get(0)?,
            messages: count(row, 1)?,
            oldest: row.time(2)?,
        });
    }
    Ok(InboxStats {
        schema_version: schema_version.unwrap_or(0),
        handlers,
        parked,
    })
}

/// The `(version, checksum)` rows of a migrations table.
pub(crate) fn applied_versions<R>(rows: &[R]) -> Result<Vec<(i64, String)>, Error>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    rows.iter()
        .map(|row| Ok((row.try_get::<i64, _>(0)?, row.try_get::<String, _>(1)?)))
        .collect()
}
