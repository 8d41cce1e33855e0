//! [`SqliteOutbox`]: where the outbox table lives and the statements rendered for it once.
//! Writers hold one to enqueue; the store holds one to claim.

use crate::migrations;
use crate::names::check_table_name;
use crate::sql::Sql;
use outbox_types::StoreError;
use outbox_types::migration::MigrationReport;
use sqlx::SqlitePool;

/// The default outbox table.
pub const DEFAULT_TABLE: &str = "outbox_events";

outbox_types::impl_table_outbox! {
    /// Where the outbox table lives, and the SQL to use it. Cheap to clone.
    ///
    /// The table name is configurable so the outbox never collides with the application's own
    /// tables; the default is [`DEFAULT_TABLE`]. Migrations are recorded in `<table>_migrations`.
    pub struct SqliteOutbox;
    default: DEFAULT_TABLE,
    quote: '"',
    check: check_table_name,
    sql: Sql = render_sql,
    /// The outbox in table `table`: a plain lowercase identifier (`[a-z_][a-z0-9_]*`, at most 48
    /// characters, not starting with `sqlite_`). Anything else is refused before any SQL runs.
    ///
    /// ```
    /// assert!(outbox_sqlite::SqliteOutbox::with_table("billing_outbox").is_ok());
    /// let err = outbox_sqlite::SqliteOutbox::with_table("x; drop table y").unwrap_err();
    /// assert!(err.to_string().contains("not a plain identifier"));
    /// ```
    fn with_table;
}

/// The statements for the table `quoted` (its paused destinations in `"<table>_paused"`).
fn render_sql(quoted: &str, table: &str) -> Sql {
    Sql::render(quoted, &format!("\"{table}_paused\""))
}

impl SqliteOutbox {
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
            outbox_types::migration::latest_version(migrations::MIGRATIONS),
        ))
    }
}
