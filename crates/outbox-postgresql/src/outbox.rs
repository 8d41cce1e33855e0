//! [`PgOutbox`]: where the outbox table lives (schema, table, layout) and the statements
//! rendered for it once. Writers hold one to enqueue; the store holds one to claim.

use crate::migrations;
use crate::names::{check_identifier, fnv1a};
use crate::partition::{self, PartitionReport, Partitioning};
use crate::sql::Sql;
use chrono::{DateTime, Utc};
use outbox_types::StoreError;
use outbox_types::migration::MigrationReport;
use sqlx::PgPool;
use std::sync::Arc;

/// Where the outbox table lives, and the SQL to use it. Cheap to clone.
///
/// The names are configurable so the outbox never collides with the application's own tables or
/// migrations; the default is the table `events` in its own schema `outbox`.
#[derive(Clone, Debug)]
pub struct PgOutbox {
    pub(crate) inner: Arc<Names>,
}

#[derive(Debug)]
pub(crate) struct Names {
    pub(crate) schema: String,
    pub(crate) table: String,
    pub(crate) qualified: String,
    pub(crate) sql: Sql,
    /// `Some` for the partitioned layout (see [`Partitioning`]).
    pub(crate) partitioning: Option<Partitioning>,
}

impl Default for PgOutbox {
    fn default() -> Self {
        Self::new()
    }
}

impl PgOutbox {
    /// The outbox in table `outbox.events`.
    pub fn new() -> Self {
        Self::with_names("outbox", "events")
            .unwrap_or_else(|_| unreachable!("default names are valid"))
    }

    /// The outbox in table `schema.table`. Both must be plain lowercase identifiers.
    ///
    /// ```
    /// assert!(outbox_postgresql::PgOutbox::with_names("billing_outbox", "events").is_ok());
    /// assert!(outbox_postgresql::PgOutbox::with_names("x; drop table y", "events").is_err());
    /// ```
    pub fn with_names(schema: &str, table: &str) -> Result<Self, StoreError> {
        Self::build(schema, table, None)
    }

    /// The outbox in table `schema.table`, range-partitioned by `enqueued_at` (see the crate
    /// docs, "Partitioned mode"). Retention then drops whole partitions
    /// ([`PgOutbox::maintain_partitions`]) instead of deleting rows.
    ///
    /// ```
    /// use outbox_postgresql::{PgOutbox, Partitioning};
    /// let outbox = PgOutbox::partitioned("outbox", "events", Partitioning::default()).unwrap();
    /// assert!(outbox.partitioning().is_some());
    /// ```
    pub fn partitioned(
        schema: &str,
        table: &str,
        partitioning: Partitioning,
    ) -> Result<Self, StoreError> {
        Self::build(schema, table, Some(partitioning))
    }

    fn build(
        schema: &str,
        table: &str,
        partitioning: Option<Partitioning>,
    ) -> Result<Self, StoreError> {
        check_identifier("schema", schema)?;
        check_identifier("table", table)?;
        let qualified = format!("\"{schema}\".\"{table}\"");
        let paused = format!("\"{schema}\".\"{table}_paused\"");
        let keys = format!("\"{schema}\".\"{table}_keys\"");
        let enqueue_batch = format!("\"{schema}\".\"{table}_enqueue_batch\"");
        let sql = Sql::render(
            &qualified,
            &paused,
            partitioning.as_ref().map(|_| keys.as_str()),
            &enqueue_batch,
        );
        Ok(PgOutbox {
            inner: Arc::new(Names {
                schema: schema.to_owned(),
                table: table.to_owned(),
                qualified,
                sql,
                partitioning,
            }),
        })
    }

    /// The partitioning settings, for an outbox in the partitioned layout.
    pub fn partitioning(&self) -> Option<&Partitioning> {
        self.inner.partitioning.as_ref()
    }

    /// `"schema"."table_keys"`: the partitioned layout's table of ids and idempotency keys, which
    /// a hand-written insert goes through (docs/table-contract.md). The plain layout has none.
    pub fn keys_table(&self) -> String {
        format!("\"{}\".\"{}_keys\"", self.inner.schema, self.inner.table)
    }

    /// Create the partitions due soon and drop the ones whose events are all delivered and past
    /// retention (see [`Partitioning`]). Call it regularly (every few minutes to every hour) and
    /// at start-up; `now` is the current time. An error for an outbox that is not partitioned.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use outbox_postgresql::{PgOutbox, Partitioning};
    /// let outbox = PgOutbox::partitioned("outbox", "events", Partitioning::default())?;
    /// outbox.migrate(&pool).await?;
    /// let report = outbox.maintain_partitions(&pool, chrono::Utc::now()).await?;
    /// println!("created {:?}, dropped {:?}", report.created, report.dropped);
    /// # Ok(()) }
    /// ```
    pub async fn maintain_partitions(
        &self,
        pool: &PgPool,
        now: DateTime<Utc>,
    ) -> Result<PartitionReport, StoreError> {
        partition::maintain(self, pool, now).await
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// `"schema"."table"`, ready to use in SQL.
    pub fn qualified_table(&self) -> &str {
        &self.inner.qualified
    }

    pub(crate) fn migrations_table(&self) -> String {
        format!(
            "\"{}\".\"{}_migrations\"",
            self.inner.schema, self.inner.table
        )
    }

    pub(crate) fn render(&self, template: &str) -> String {
        template
            .replace("{t}", &self.inner.qualified)
            .replace("{table}", &self.inner.table)
            .replace("{schema}", &self.inner.schema)
    }

    /// A stable advisory lock key for `purpose` on this outbox.
    pub(crate) fn lock_key(&self, purpose: &str) -> i64 {
        fnv1a(&format!("outbox:{purpose}:{}", self.inner.qualified)) as i64
    }

    /// Create or upgrade the outbox schema. Idempotent, safe to call from several processes at
    /// once, and atomic.
    pub async fn migrate(&self, pool: &PgPool) -> Result<MigrationReport, StoreError> {
        migrations::run(self, pool).await
    }

    /// The DDL [`PgOutbox::migrate`] applies to a database without this outbox, with the
    /// bookkeeping rows that record it applied, as one SQL script: for review, and for teams
    /// that apply schema changes with their own migration tool (`outbox schema print`).
    pub fn schema_script(&self) -> String {
        migrations::script(self)
    }

    /// The schema version in the database (`0` if never migrated) and the newest this build
    /// knows.
    pub async fn schema_version(&self, pool: &PgPool) -> Result<(i64, i64), StoreError> {
        Ok((
            migrations::current_version(self, pool).await?,
            migrations::latest_version(self),
        ))
    }
}
