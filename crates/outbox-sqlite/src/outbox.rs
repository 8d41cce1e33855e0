//! [`SqliteOutbox`]: where the outbox table lives and the statements rendered for it once.
//! Writers hold one to enqueue; the store holds one to claim.

use crate::migrations::{self, MigrationReport};
use crate::names::check_table_name;
use crate::sql::Sql;
use outbox_types::StoreError;
use sqlx::SqlitePool;
use std::sync::Arc;

/// The default outbox table.
pub const DEFAULT_TABLE: &str = "outbox_events";

/// Where the outbox table lives, and the SQL to use it. Cheap to clone.
///
/// The table name is configurable so the outbox never collides with the application's own
/// tables; the default is [`DEFAULT_TABLE`]. Migrations are recorded in `<table>_migrations`.
#[derive(Clone, Debug)]
pub struct SqliteOutbox {
    pub(crate) inner: Arc<Names>,
}

#[derive(Debug)]
pub(crate) struct Names {
    pub(crate) table: String,
    pub(crate) quoted: String,
    pub(crate) sql: Sql,
}

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
}
