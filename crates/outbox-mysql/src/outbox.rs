//! [`MySqlOutbox`]: where the outbox table lives and the statements rendered for it once.
//! Writers hold one to enqueue; the store holds one to claim.

use crate::migrations;
use crate::names::check_table_name;
use crate::sql::Sql;
use outbox_types::StoreError;
use outbox_types::migration::MigrationReport;
use sqlx::MySqlPool;

/// The default outbox table.
pub const DEFAULT_TABLE: &str = "outbox_events";

outbox_types::impl_table_outbox! {
    /// Where the outbox table lives, and the SQL to use it. Cheap to clone.
    ///
    /// The table name is configurable so the outbox never collides with the application's own
    /// tables; the default is [`DEFAULT_TABLE`]. It lives in the connection's current database.
    /// Migrations are recorded in `<table>_migrations`.
    pub struct MySqlOutbox;
    default: DEFAULT_TABLE,
    quote: '`',
    check: check_table_name,
    sql: Sql = Sql::render,
    /// The outbox in table `table`: a plain lowercase identifier (`[a-z_][a-z0-9_]*`, at most 48
    /// characters). Anything else is refused before any SQL runs.
    ///
    /// ```
    /// assert!(outbox_mysql::MySqlOutbox::with_table("billing_outbox").is_ok());
    /// let err = outbox_mysql::MySqlOutbox::with_table("x`; drop table y").unwrap_err();
    /// assert!(err.to_string().contains("not a plain identifier"));
    /// ```
    fn with_table;
}

impl MySqlOutbox {
    /// Create or upgrade the outbox schema. Idempotent, and safe to call from several processes
    /// at once (they queue on a named lock). MySQL DDL is not transactional; see the
    /// `migrations` module docs for how a migration interrupted half-way recovers.
    pub async fn migrate(&self, pool: &MySqlPool) -> Result<MigrationReport, StoreError> {
        migrations::run(self, pool).await
    }

    /// The DDL [`MySqlOutbox::migrate`] applies to a database without this outbox, with the
    /// bookkeeping rows that record it applied, as one SQL script (`outbox schema print`), for
    /// MariaDB (`mariadb = true`) or MySQL: the binary collation the columns use differs.
    pub fn schema_script(&self, mariadb: bool) -> String {
        migrations::script(self, mariadb)
    }

    /// The schema version in the database (`0` if never migrated) and the newest this build
    /// knows.
    pub async fn schema_version(&self, pool: &MySqlPool) -> Result<(i64, i64), StoreError> {
        Ok((
            migrations::current_version(self, pool).await?,
            outbox_types::migration::latest_version(migrations::MIGRATIONS),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_embeds_the_quoted_table() {
        let outbox = MySqlOutbox::with_table("my_events").unwrap();
        assert!(outbox.sql().ack.contains("`my_events` AS e"));
        assert_eq!(outbox.migrations_table(), "`my_events_migrations`");
        assert!(outbox.sql().claim_lock.contains("'my_events'"));
    }
}
