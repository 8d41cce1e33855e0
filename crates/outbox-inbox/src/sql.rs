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
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_types::EventId;
use sqlx::{ColumnIndex, Database, Decode, Encode, Pool, Row, Transaction, Type};

use crate::consumer::{Delivery, InboxHandler, ParkedMessage};
use crate::names::{check_handler, check_identifier};
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

/// Write for `$inbox` (an inbox of database `$db`, called `$name` in the docs, in module
/// `$module`, holding its [`Names`] in `inner`, implementing [`Dialect`]) every inherent method
/// whose logic is the same in each database — `Default`, `SCHEMA_VERSION` from `$migrations`,
/// the table names, `claim`, `contains`, `purge`, `park`, `parked`, `stats`, `list_parked`,
/// `parked_record`, `process` and the private `apply_migrations` its `migrate` calls — with
/// their documentation and examples (over `sqlx::$pool` and `sqlx::$executor`), implement
/// [`SqlInbox`] by calling them, and name the database's [`SqlEffect`] and [`SqlHandler`]
/// (`$effect`, `$handler`). `$begin` opens the claim's transaction on `$pool_var`; `claim` turns
/// the claim statement `$query` (bound to event id and handler) run on `$claim_executor` into
/// whether the claim is fresh. The `tables` literals are how the docs spell the quoted inbox
/// and parked tables, and what `new()` makes of them; `clock` is whose clock a purge reads;
/// `example` is how the docs' examples begin a claim's transaction, insert an event id into an
/// `invoices` table and turn an event id into what that insert binds.
macro_rules! sql_inbox {
    (
        inbox: $inbox:ident,
        db: $db:ty,
        name: $name:literal,
        module: $module:literal,
        pool: $pool:ident,
        executor: $executor:ident,
        migrations: $migrations:ident,
        tables: ($qualified_doc:literal = $qualified_new:literal, $parked_doc:literal = $parked_new:literal),
        clock: $clock:literal,
        begin: |$pool_var:ident| $begin:expr,
        claim: |$query:ident, $claim_executor:ident| $fresh:expr,
        example: (begin: $begin_doc:literal, insert: $insert_doc:literal, event_id: $event_id_doc:literal),
        effect: $effect:ident,
        handler: $handler:ident $(,)?
    ) => {
        impl Default for $inbox {
            fn default() -> Self {
                Self::new()
            }
        }

        impl $inbox {
            /// The schema version this build migrates to: what `migrate` reports as `current`.
            pub const SCHEMA_VERSION: i64 = $migrations[$migrations.len() - 1].version;

            /// The inbox table name.
            ///
            /// ```
            #[doc = concat!("assert_eq!(outbox_inbox::", $module, "::", stringify!($inbox), "::new().table(), \"outbox_inbox\");")]
            /// ```
            pub fn table(&self) -> &str {
                &self.inner.table
            }

            #[doc = concat!($qualified_doc, ", ready to use in SQL.")]
            ///
            /// ```
            #[doc = concat!("assert_eq!(outbox_inbox::", $module, "::", stringify!($inbox), "::new().qualified_table(), ", stringify!($qualified_new), ");")]
            /// ```
            pub fn qualified_table(&self) -> &str {
                &self.inner.qualified
            }

            #[doc = concat!($parked_doc, ", where poison messages go.")]
            ///
            /// ```
            #[doc = concat!("assert_eq!(outbox_inbox::", $module, "::", stringify!($inbox), "::new().parked_table(), ", stringify!($parked_new), ");")]
            /// ```
            pub fn parked_table(&self) -> &str {
                &self.inner.parked
            }

            /// Record `(event_id, handler)` through `executor` — `&mut *tx` of the transaction that
            /// will also run the effect. [`InboxClaim::Fresh`](crate::InboxClaim::Fresh): run the
            /// effect and commit. [`InboxClaim::Duplicate`](crate::InboxClaim::Duplicate): the
            /// handler already processed this event; skip the effect. Call it first in the
            /// transaction; a concurrent claim of the same key waits here until this transaction
            /// ends.
            ///
            /// ```no_run
            #[doc = concat!("use outbox_inbox::{InboxClaim, ", $module, "::", stringify!($inbox), "};")]
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ", id: outbox_types::EventId) -> Result<(), Box<dyn std::error::Error>> {")]
            #[doc = concat!("let mut tx = ", $begin_doc, ".await?;")]
            #[doc = concat!("if ", stringify!($inbox), "::new().claim(&mut *tx, id, \"billing\").await? == InboxClaim::Fresh {")]
            #[doc = concat!("    sqlx::query(\"", $insert_doc, "\").bind(id.", $event_id_doc, ").execute(&mut *tx).await?;")]
            ///     tx.commit().await?;
            /// }
            /// # Ok(()) }
            /// ```
            pub async fn claim<'e, E: sqlx::$executor<'e>>(
                &self,
                $claim_executor: E,
                event_id: outbox_types::EventId,
                handler: &str,
            ) -> Result<$crate::InboxClaim, $crate::Error> {
                $crate::names::check_handler(handler)?;
                let $query = sqlx::query(sqlx::AssertSqlSafe(self.inner.sql.claim.as_str()))
                    .bind(<Self as $crate::sql::Dialect>::event_id(event_id))
                    .bind(handler);
                let fresh: bool = $fresh;
                Ok(if fresh {
                    $crate::InboxClaim::Fresh
                } else {
                    $crate::InboxClaim::Duplicate
                })
            }

            /// Whether `handler` has processed `event_id` (a committed row exists).
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ", id: outbox_types::EventId) -> Result<(), outbox_inbox::Error> {")]
            #[doc = concat!("let seen = outbox_inbox::", $module, "::", stringify!($inbox), "::new().contains(&pool, id, \"billing\").await?;")]
            /// # Ok(()) }
            /// ```
            pub async fn contains<'e, E: sqlx::$executor<'e>>(
                &self,
                executor: E,
                event_id: outbox_types::EventId,
                handler: &str,
            ) -> Result<bool, $crate::Error> {
                let found: Option<i32> =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(self.inner.sql.contains.as_str()))
                        .bind(<Self as $crate::sql::Dialect>::event_id(event_id))
                        .bind(handler)
                        .fetch_optional(executor)
                        .await?;
                Ok(found.is_some())
            }

            #[doc = concat!("Delete inbox rows processed more than `older_than` ago (by the ", $clock, " clock), `batch`")]
            /// rows per statement, until none is left; returns how many were deleted. See the crate docs
            /// for the trade-off: a duplicate older than the window is no longer detected.
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ") -> Result<(), outbox_inbox::Error> {")]
            /// let week = std::time::Duration::from_secs(7 * 24 * 3600);
            #[doc = concat!("let deleted = outbox_inbox::", $module, "::", stringify!($inbox), "::new().purge(&pool, week, 1000).await?;")]
            /// # Ok(()) }
            /// ```
            pub async fn purge(
                &self,
                pool: &sqlx::$pool,
                older_than: std::time::Duration,
                batch: u32,
            ) -> Result<u64, $crate::Error> {
                let age = <Self as $crate::sql::Dialect>::age(older_than);
                $crate::sql::purge_in_batches(batch, |batch| async move {
                    let done = sqlx::query(sqlx::AssertSqlSafe(self.inner.sql.purge.as_str()))
                        .bind(age)
                        .bind(<Self as $crate::sql::Dialect>::batch(batch))
                        .execute(pool)
                        .await?;
                    Ok(done.rows_affected())
                })
                .await
            }

            /// Write a poison message to the parked table for `handler`.
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ") -> Result<(), outbox_inbox::Error> {")]
            /// let msg = outbox_inbox::ParkedMessage::new(None, "orders", b"?".to_vec(), 1, "no event id");
            #[doc = concat!("outbox_inbox::", $module, "::", stringify!($inbox), "::new().park(&pool, \"billing\", &msg).await?;")]
            /// # Ok(()) }
            /// ```
            pub async fn park<'e, E: sqlx::$executor<'e>>(
                &self,
                executor: E,
                handler: &str,
                message: &$crate::ParkedMessage,
            ) -> Result<(), $crate::Error> {
                let headers = serde_json::to_string(&message.headers)
                    .map_err(|e| $crate::Error::BadMessage(e.to_string()))?;
                let query = sqlx::query(sqlx::AssertSqlSafe(self.inner.sql.park.as_str()))
                    .bind(message.event_id.map(<Self as $crate::sql::Dialect>::event_id))
                    .bind(handler)
                    .bind(&message.source)
                    .bind(<Self as $crate::sql::Dialect>::attempts(message.attempts))
                    .bind(&message.error)
                    .bind(&message.payload)
                    .bind(headers);
                <Self as $crate::sql::Dialect>::bind_now(query)
                    .execute(executor)
                    .await?;
                Ok(())
            }

            /// The parked messages of `handler`, oldest first (at most `limit`).
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ") -> Result<(), outbox_inbox::Error> {")]
            #[doc = concat!("for p in outbox_inbox::", $module, "::", stringify!($inbox), "::new().parked(&pool, \"billing\", 100).await? {")]
            ///     println!("{:?}: {}", p.event_id, p.error);
            /// }
            /// # Ok(()) }
            /// ```
            pub async fn parked(
                &self,
                pool: &sqlx::$pool,
                handler: &str,
                limit: u32,
            ) -> Result<Vec<$crate::ParkedMessage>, $crate::Error> {
                let rows = sqlx::query(sqlx::AssertSqlSafe(self.inner.sql.parked.as_str()))
                    .bind(handler)
                    .bind(<Self as $crate::sql::Dialect>::limit(limit))
                    .fetch_all(pool)
                    .await?;
                rows.iter().map($crate::sql::parked_message).collect()
            }

            /// Rows, age and rows past `retention` per handler, parked messages per handler, and the
            /// schema version: what `outbox inbox status` prints. Counts every row (a scan of the
            /// table): an operator's question, not one for a hot path.
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ") -> Result<(), outbox_inbox::Error> {")]
            /// let week = std::time::Duration::from_secs(7 * 24 * 3600);
            #[doc = concat!("let stats = outbox_inbox::", $module, "::", stringify!($inbox), "::new().stats(&pool, week).await?;")]
            /// println!("{} rows, {} parked", stats.rows(), stats.parked_total());
            /// # Ok(()) }
            /// ```
            pub async fn stats(
                &self,
                pool: &sqlx::$pool,
                retention: std::time::Duration,
            ) -> Result<$crate::InboxStats, $crate::Error> {
                let sql = &self.inner.sql;
                let age = <Self as $crate::sql::Dialect>::age(retention);
                let schema_version: Option<i64> =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.schema_version.as_str()))
                        .fetch_one(pool)
                        .await?;
                let handler_rows = sqlx::query(sqlx::AssertSqlSafe(sql.handler_stats.as_str()))
                    .bind(age)
                    .fetch_all(pool)
                    .await?;
                let parked_rows = sqlx::query(sqlx::AssertSqlSafe(sql.parked_stats.as_str()))
                    .fetch_all(pool)
                    .await?;
                $crate::sql::stats(schema_version, &handler_rows, &parked_rows)
            }

            /// Parked messages of every handler (or one), oldest first, with their row ids.
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ") -> Result<(), outbox_inbox::Error> {")]
            /// let q = outbox_inbox::ParkedQuery::new().handler("billing").limit(20);
            #[doc = concat!("for r in outbox_inbox::", $module, "::", stringify!($inbox), "::new().list_parked(&pool, &q).await? {")]
            ///     println!("{} {} {}", r.id, r.handler, r.message.error);
            /// }
            /// # Ok(()) }
            /// ```
            pub async fn list_parked(
                &self,
                pool: &sqlx::$pool,
                query: &$crate::ParkedQuery,
            ) -> Result<Vec<$crate::ParkedRecord>, $crate::Error> {
                let select = sqlx::query(sqlx::AssertSqlSafe(self.inner.sql.list_parked.as_str()));
                let rows = <Self as $crate::sql::Dialect>::bind_handler_filter(
                    select,
                    query.handler.as_deref(),
                )
                .bind(query.after.unwrap_or(0))
                .bind(query.page())
                .fetch_all(pool)
                .await?;
                rows.iter().map($crate::sql::parked_record).collect()
            }

            /// The parked message with row id `id`, if there is one.
            ///
            /// ```no_run
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ") -> Result<(), outbox_inbox::Error> {")]
            #[doc = concat!("if let Some(r) = outbox_inbox::", $module, "::", stringify!($inbox), "::new().parked_record(&pool, 7).await? {")]
            ///     println!("{}", String::from_utf8_lossy(&r.message.payload));
            /// }
            /// # Ok(()) }
            /// ```
            pub async fn parked_record(
                &self,
                pool: &sqlx::$pool,
                id: i64,
            ) -> Result<Option<$crate::ParkedRecord>, $crate::Error> {
                let row = sqlx::query(sqlx::AssertSqlSafe(self.inner.sql.parked_record.as_str()))
                    .bind(id)
                    .fetch_optional(pool)
                    .await?;
                row.as_ref().map($crate::sql::parked_record).transpose()
            }

            /// Claim and run `effect` in one new transaction, then commit. A duplicate returns
            /// [`Processed::Duplicate`](crate::Processed::Duplicate) without calling `effect`; an
            /// error (the effect's or the database's) rolls back, so nothing is recorded and a
            /// redelivery runs the effect again.
            ///
            /// ```no_run
            #[doc = concat!("use outbox_inbox::{Processed, ", $module, "::", stringify!($inbox), "};")]
            #[doc = concat!("# async fn demo(pool: sqlx::", stringify!($pool), ", id: outbox_types::EventId) -> Result<(), outbox_inbox::Error> {")]
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

            /// On `conn`, with the database's lock held: create the migrations table if missing
            /// (`create_table`, this database's re-runnable DDL), then apply each migration not
            /// yet recorded (names substituted; one statement at a time where
            /// [`Dialect::SCRIPT_PER_STATEMENT`](crate::sql::Dialect::SCRIPT_PER_STATEMENT)) and
            /// record it.
            async fn apply_migrations(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                create_table: String,
            ) -> Result<$crate::MigrationReport, $crate::Error> {
                sqlx::raw_sql(sqlx::AssertSqlSafe(create_table))
                    .execute(&mut *conn)
                    .await?;
                let n = &self.inner;
                let rows = sqlx::query(sqlx::AssertSqlSafe(n.substitute($crate::sql::APPLIED_VERSIONS)))
                    .fetch_all(&mut *conn)
                    .await?;
                let before = $crate::sql::applied_versions(&rows)?;
                let mut applied = Vec::new();
                for m in $crate::pending($migrations, &before)? {
                    let sql = n.substitute(m.sql);
                    if <Self as $crate::sql::Dialect>::SCRIPT_PER_STATEMENT {
                        for statement in outbox_types::sql_script::statements(&sql) {
                            sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                                .execute(&mut *conn)
                                .await?;
                        }
                    } else {
                        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *conn).await?;
                    }
                    let record = sqlx::query(sqlx::AssertSqlSafe(n.sql.record_migration.as_str()))
                        .bind(m.version)
                        .bind(m.description)
                        .bind(m.checksum());
                    <Self as $crate::sql::Dialect>::bind_now(record)
                        .execute(&mut *conn)
                        .await?;
                    applied.push(m.version);
                }
                Ok($crate::MigrationReport {
                    applied,
                    current: outbox_types::migration::latest_version($migrations),
                })
            }
        }

        impl $crate::sql::SqlInbox for $inbox {
            type Db = $db;

            async fn begin(
                &self,
                $pool_var: &sqlx::Pool<$db>,
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

        #[doc = concat!("The effect a [`", stringify!($handler), "`] runs inside the inbox transaction.")]
        pub trait $effect: $crate::sql::SqlEffect<$db> {}

        impl<F: $crate::sql::SqlEffect<$db>> $effect for F {}

        #[doc = concat!("An [`InboxHandler`](crate::InboxHandler) over ", $name, ": claims, runs `effect`, commits; parks")]
        /// into `<table>_parked`. Give it to a broker adapter.
        ///
        /// ```no_run
        #[doc = concat!("use outbox_inbox::", $module, "::{", stringify!($handler), ", ", stringify!($inbox), "};")]
        #[doc = concat!("# fn demo(pool: sqlx::", stringify!($pool), ") -> Result<(), outbox_inbox::Error> {")]
        #[doc = concat!("let handler = ", stringify!($handler), "::new(pool, ", stringify!($inbox), "::new(), \"billing\", |tx, delivery| Box::pin(async move {")]
        #[doc = concat!("    sqlx::query(\"", $insert_doc, "\")")]
        #[doc = concat!("        .bind(delivery.event_id.", $event_id_doc, ")")]
        ///         .execute(&mut **tx).await?;
        ///     Ok(())
        /// }))?;
        /// # Ok(()) }
        /// ```
        pub type $handler<F> = $crate::sql::SqlHandler<$inbox, F>;
    };
}
pub(crate) use sql_inbox;

/// Define `$inbox`, the inbox of database `$name` (in module `$module`) whose tables need no
/// schema (MySQL, SQLite): the struct holding its [`Names`], `new()` (the table
/// `outbox_inbox`) and `with_table`, which checks the name and writes it in SQL as `$quote`
/// makes of `$table_name`, with the inbox's `$statements`. `$whereabouts` ends the
/// constructors' first doc line: where the table lives.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
macro_rules! table_inbox {
    (
        inbox: $inbox:ident,
        name: $name:literal,
        module: $module:literal,
        whereabouts: $whereabouts:literal,
        statements: $statements:ident,
        quote: |$table_name:ident| $quote:expr $(,)?
    ) => {
        #[doc = concat!("Where the ", $name, " inbox lives, and the SQL to use it. Cheap to clone.")]
        #[derive(Clone, Debug)]
        pub struct $inbox {
            inner: std::sync::Arc<$crate::sql::Names>,
        }

        impl $inbox {
            #[doc = concat!("The inbox in table `outbox_inbox`", $whereabouts, ".")]
            ///
            /// ```
            #[doc = concat!("assert_eq!(outbox_inbox::", $module, "::", stringify!($inbox), "::new().table(), \"outbox_inbox\");")]
            /// ```
            pub fn new() -> Self {
                Self::with_table($crate::DEFAULT_TABLE)
                    .unwrap_or_else(|_| unreachable!("default names are valid"))
            }

            #[doc = concat!("The inbox in `table` (a plain lowercase identifier)", $whereabouts, ".")]
            ///
            /// ```
            #[doc = concat!("use outbox_inbox::", $module, "::", stringify!($inbox), ";")]
            #[doc = concat!("assert!(", stringify!($inbox), "::with_table(\"billing_inbox\").is_ok());")]
            #[doc = concat!("assert!(", stringify!($inbox), "::with_table(\"inbox; drop table x\").is_err());")]
            /// ```
            pub fn with_table(table: &str) -> Result<Self, $crate::Error> {
                let quote = |$table_name: &str| $quote;
                Ok($inbox {
                    inner: $crate::sql::Names::checked(table, quote, &$statements)?,
                })
            }
        }
    };
}
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) use table_inbox;

/// A query whose parameters are still to be bound.
pub(crate) type Query<DB> = sqlx::query::Query<'static, DB, <DB as Database>::Arguments>;

/// What one database does differently inside the methods [`sql_inbox!`] writes once: the
/// types it binds event ids, ages, counts and attempts as, and the parameters it binds where
/// the others have a column default or a placeholder used twice.
pub(crate) trait Dialect {
    /// The database.
    type Db: Database;
    /// Whether a migration runs one statement at a time (MySQL: its scripts hold the client's
    /// `DELIMITER` lines) instead of as one script.
    const SCRIPT_PER_STATEMENT: bool = false;

    /// An event id as bound: a UUID (PostgreSQL) or its lowercase text.
    type EventId;
    /// `id` as bound.
    fn event_id(id: EventId) -> Self::EventId;

    /// The "older than" of purge and stats as bound.
    type Age;
    /// `older_than` as bound: microseconds the statement subtracts from the database's clock,
    /// or (SQLite) the cut-off itself, by the host's clock, taken now.
    fn age(older_than: Duration) -> Self::Age;

    /// A purge batch as bound (every database's type holds any `u32`).
    type Batch: From<u32>;
    /// `batch` as bound.
    fn batch(batch: u32) -> Self::Batch {
        Self::Batch::from(batch)
    }

    /// A `parked` limit as bound (every database's type holds any `u32`).
    type Limit: From<u32>;
    /// `limit` as bound.
    fn limit(limit: u32) -> Self::Limit {
        Self::Limit::from(limit)
    }

    /// A parked message's attempts as bound.
    type Attempts;
    /// `attempts` as bound.
    fn attempts(attempts: u32) -> Self::Attempts;

    /// Bind what follows the other parameters of `park` and of recording a migration: nothing
    /// where `parked_at` and `applied_at` default to the database's clock; (SQLite) the host's
    /// time in microseconds.
    fn bind_now(query: Query<Self::Db>) -> Query<Self::Db> {
        query
    }

    /// Bind `list_parked`'s handler filter: once, or (MySQL, whose `?` are positional) once
    /// for each of its two uses.
    fn bind_handler_filter(query: Query<Self::Db>, handler: Option<&str>) -> Query<Self::Db>
    where
        for<'a> Option<&'a str>: Encode<'a, Self::Db> + Type<Self::Db>,
    {
        query.bind(handler)
    }
}

/// `SELECT` of the applied migrations' versions and checksums, in every database.
pub(crate) const APPLIED_VERSIONS: &str = "SELECT version, checksum FROM {m} ORDER BY version";

/// The statements of an inbox, `S` = `&'static str` for a database's templates (with `{t}` the
/// inbox table, `{p}` the parked table, `{m}` the migrations table and `{f}` the claim routine,
/// all quoted) and `String` for one inbox's, its names substituted.
#[derive(Debug, Default)]
pub(crate) struct Statements<S> {
    /// The claim (PostgreSQL: the claim function's call; MySQL: the procedure's; SQLite: the
    /// insert itself).
    pub(crate) claim: S,
    /// Whether `($1, $2)` = (event id, handler) has a row.
    pub(crate) contains: S,
    /// Delete at most `$2` rows processed before the age `$1`.
    pub(crate) purge: S,
    /// Insert a parked message.
    pub(crate) park: S,
    /// The parked messages of handler `$1`, at most `$2`: columns 0 to 5 of [`parked_message`].
    pub(crate) parked: S,
    /// The latest applied migration.
    pub(crate) schema_version: S,
    /// The per-handler statistics of [`stats`], `$1` the age.
    pub(crate) handler_stats: S,
    /// The per-handler parked counts of [`stats`].
    pub(crate) parked_stats: S,
    /// A page of parked records: the handler filter, then after id, then limit.
    pub(crate) list_parked: S,
    /// The parked record with id `$1`.
    pub(crate) parked_record: S,
    /// Record an applied migration: version, description, checksum.
    pub(crate) record_migration: S,
}

/// One inbox's quoted names and statements.
#[derive(Debug)]
pub(crate) struct Names {
    /// The inbox table name, unquoted.
    pub(crate) table: String,
    /// The inbox table, quoted (`{t}`).
    pub(crate) qualified: String,
    /// The parked table, quoted (`{p}`).
    pub(crate) parked: String,
    /// The migrations table, quoted (`{m}`).
    pub(crate) migrations: String,
    /// The claim routine, quoted (`{f}`; SQLite has none and never names it).
    pub(crate) routine: String,
    /// The trigger (and, on PostgreSQL, its function) that records who wrote a claim row,
    /// quoted (`{claimed_by}`; PostgreSQL and MySQL).
    pub(crate) claimed_by: String,
    /// PostgreSQL's function telling whether a claim was written before claims recorded who
    /// wrote them, quoted (`{claimed_before}`).
    pub(crate) claimed_before: String,
    /// The statements, names substituted.
    pub(crate) sql: Statements<String>,
}

impl Names {
    /// The names of the inbox `table`, `<table>_parked`, `<table>_migrations` and
    /// `<table>_claim` as `quote` writes a name in SQL, and `templates` with them substituted.
    pub(crate) fn new(
        table: &str,
        quote: impl Fn(&str) -> String,
        templates: &Statements<&'static str>,
    ) -> Names {
        let mut names = Names {
            table: table.to_owned(),
            qualified: quote(table),
            parked: quote(&format!("{table}_parked")),
            migrations: quote(&format!("{table}_migrations")),
            routine: quote(&format!("{table}_claim")),
            claimed_by: quote(&format!("{table}_claimed_by")),
            claimed_before: quote(&format!("{table}_claimed_before")),
            sql: Statements::default(),
        };
        let s = |template: &str| names.substitute(template);
        let sql = Statements {
            claim: s(templates.claim),
            contains: s(templates.contains),
            purge: s(templates.purge),
            park: s(templates.park),
            parked: s(templates.parked),
            schema_version: s(templates.schema_version),
            handler_stats: s(templates.handler_stats),
            parked_stats: s(templates.parked_stats),
            list_parked: s(templates.list_parked),
            parked_record: s(templates.parked_record),
            record_migration: s(templates.record_migration),
        };
        names.sql = sql;
        names
    }

    /// [`Names::new`] of `table`, checked first to be a plain identifier (it goes into SQL),
    /// shared: what each inbox's constructor keeps.
    pub(crate) fn checked(
        table: &str,
        quote: impl Fn(&str) -> String,
        templates: &Statements<&'static str>,
    ) -> Result<Arc<Names>, Error> {
        check_identifier("table", table)?;
        Ok(Arc::new(Names::new(table, quote, templates)))
    }

    /// `sql` (a statement template or a migration's script) with the names put in: `{t}`,
    /// `{p}`, `{m}`, `{f}`, `{claimed_by}`, `{claimed_before}` as quoted, `{table}` as is.
    pub(crate) fn substitute(&self, sql: &str) -> String {
        sql.replace("{t}", &self.qualified)
            .replace("{p}", &self.parked)
            .replace("{m}", &self.migrations)
            .replace("{f}", &self.routine)
            .replace("{claimed_by}", &self.claimed_by)
            .replace("{claimed_before}", &self.claimed_before)
            .replace("{table}", &self.table)
    }
}

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
