//! Opening the outbox named by a database URL.

use std::sync::Arc;

#[cfg(feature = "mysql")]
use outbox_mysql::{MySqlOutbox, MySqlStore};
use outbox_postgresql::{PartitionInterval, Partitioning, PgOutbox, PgStore};
#[cfg(feature = "sqlite")]
use outbox_sqlite::{SqliteOutbox, SqliteStore};
use outbox_types::redact::redact_url;
use outbox_types::{Store, StoreError};

#[cfg(feature = "mysql")]
use crate::config::mysql_driver_url;
use crate::config::{Config, ConfigError, Database, Layout, PartitionEvery, database_of};

/// A store of whichever kind the URL names.
pub enum AnyStore {
    /// `postgres://…`
    Postgres(PgStore),
    /// `sqlite://…` or `sqlite:…`
    #[cfg(feature = "sqlite")]
    Sqlite(SqliteStore),
    /// `mysql://…` or `mariadb://…`
    #[cfg(feature = "mysql")]
    MySql(MySqlStore),
}

/// The PostgreSQL outbox `[database]` names (schema, table, layout), without connecting.
pub fn pg_outbox(full: &Config) -> Result<PgOutbox, ConfigError> {
    let config = &full.database;
    let table = config.table.as_deref().unwrap_or("events");
    match config.layout {
        Layout::Plain => PgOutbox::with_names(&config.schema, table),
        Layout::Partitioned => PgOutbox::partitioned(
            &config.schema,
            table,
            Partitioning {
                interval: match config.partitions.interval {
                    PartitionEvery::Daily => PartitionInterval::Daily,
                    PartitionEvery::Hourly => PartitionInterval::Hourly,
                },
                ahead: config.partitions.ahead,
                retention: full.retention.delivered,
                lock_timeout: config.partitions.lock_timeout,
            },
        ),
    }
    .map_err(|e| ConfigError(format!("invalid `database`: {e}")))
}

/// The SQLite outbox `[database]` names, without connecting.
#[cfg(feature = "sqlite")]
pub fn sqlite_outbox(full: &Config) -> Result<SqliteOutbox, ConfigError> {
    named_table(full, SqliteOutbox::with_table, SqliteOutbox::new)
}

/// The MySQL or MariaDB outbox `[database]` names, without connecting.
#[cfg(feature = "mysql")]
pub fn mysql_outbox(full: &Config) -> Result<MySqlOutbox, ConfigError> {
    named_table(full, MySqlOutbox::with_table, MySqlOutbox::new)
}

/// The outbox on the table `[database] table` names (`with_table`), else on the default table
/// (`default`): SQLite's and MySQL's outboxes, alike but for their types.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
fn named_table<O>(
    full: &Config,
    with_table: fn(&str) -> Result<O, StoreError>,
    default: fn() -> O,
) -> Result<O, ConfigError> {
    match full.database.table.as_deref() {
        Some(table) => with_table(table),
        None => Ok(default()),
    }
    .map_err(|e| ConfigError(format!("invalid `database.table`: {e}")))
}

/// Check the `[database]` settings that name the outbox (database, layout, schema and table)
/// as [`AnyStore::open`] uses them, without connecting: the one validator of `outbox config
/// check`, `migrate`, the relay and every other outbox command, so a name one accepts the
/// others never refuse. Returns the database the URL names.
pub fn check_outbox(full: &Config) -> Result<Database, ConfigError> {
    let config = &full.database;
    let database = database_of("database.url", config.url.trim())?;
    if config.layout == Layout::Partitioned && database != Database::Postgres {
        return Err(ConfigError(
            "`database.layout = \"partitioned\"` is a PostgreSQL layout; use `plain` with other databases".into(),
        ));
    }
    #[allow(unreachable_patterns)] // reachable in a build without some database
    match database {
        Database::Postgres => pg_outbox(full).map(drop),
        #[cfg(feature = "sqlite")]
        Database::Sqlite => sqlite_outbox(full).map(drop),
        #[cfg(feature = "mysql")]
        Database::MySql => mysql_outbox(full).map(drop),
        // Not reached: `database_of` refused a database this build lacks.
        other => Err(ConfigError(format!("{other:?} is not in this build"))),
    }?;
    Ok(database)
}

impl AnyStore {
    /// Connect (without migrating). A malformed URL or an unreachable database is a
    /// [`ConfigError`] naming the URL.
    pub async fn open(full: &Config) -> Result<Self, ConfigError> {
        let url = full.database.url.trim();
        let database = check_outbox(full)?;
        #[allow(unreachable_patterns)] // reachable in a build without some database
        match database {
            Database::Postgres => {
                // `retention.delivered = "0s"` keeps nothing delivered: on PostgreSQL the ack
                // deletes the row; SQLite and MySQL mark it delivered and the next retention
                // run deletes it.
                let delete_on_ack = full.retention.enabled && full.retention.delivered.is_zero();
                let outbox = pg_outbox(full)?;
                let store = PgStore::connect(url, outbox)
                    .await
                    .map_err(|e| unreachable(url, e))?
                    .with_delete_on_ack(delete_on_ack);
                Ok(AnyStore::Postgres(store))
            }
            #[cfg(feature = "sqlite")]
            Database::Sqlite => {
                let outbox = sqlite_outbox(full)?;
                let store = SqliteStore::connect(url, outbox)
                    .await
                    .map_err(|e| unreachable(url, e))?;
                Ok(AnyStore::Sqlite(store))
            }
            #[cfg(feature = "mysql")]
            Database::MySql => {
                let outbox = mysql_outbox(full)?;
                let url = mysql_driver_url(url);
                let store = MySqlStore::connect(&url, outbox)
                    .await
                    .map_err(|e| unreachable(&url, e))?;
                Ok(AnyStore::MySql(store))
            }
            // Not reached: `built()` above refused a database this build lacks.
            other => Err(ConfigError(format!("{other:?} is not in this build"))),
        }
    }

    /// Create or upgrade the outbox schema; returns the versions applied. A partitioned outbox
    /// also gets its partitions for the coming days.
    pub async fn migrate(&self) -> Result<Vec<i64>, StoreError> {
        match self {
            AnyStore::Postgres(s) => {
                let applied = s.outbox().migrate(s.pool()).await?.applied;
                if s.outbox().partitioning().is_some() {
                    s.outbox()
                        .maintain_partitions(s.pool(), chrono::Utc::now())
                        .await?;
                }
                Ok(applied)
            }
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => Ok(s.outbox().migrate(s.pool()).await?.applied),
            #[cfg(feature = "mysql")]
            AnyStore::MySql(s) => Ok(s.outbox().migrate(s.pool()).await?.applied),
        }
    }

    /// The store as the relay and admin commands use it.
    pub fn dyn_store(&self) -> Arc<dyn Store> {
        match self {
            AnyStore::Postgres(s) => Arc::new(s.clone()),
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => Arc::new(s.clone()),
            #[cfg(feature = "mysql")]
            AnyStore::MySql(s) => Arc::new(s.clone()),
        }
    }

    /// The PostgreSQL store, when the outbox is in PostgreSQL.
    pub fn postgres(&self) -> Option<&PgStore> {
        #[allow(unreachable_patterns)] // reachable in a build with another database
        match self {
            AnyStore::Postgres(s) => Some(s),
            _ => None,
        }
    }

    /// The PostgreSQL store when its outbox is partitioned: retention then rotates partitions.
    pub fn partitioned(&self) -> Option<PgStore> {
        match self {
            AnyStore::Postgres(s) if s.outbox().partitioning().is_some() => Some(s.clone()),
            _ => None,
        }
    }

    /// Where the outbox is, for messages.
    pub fn describe(&self) -> String {
        match self {
            AnyStore::Postgres(s) => format!(
                "PostgreSQL {}table {}",
                if s.outbox().partitioning().is_some() {
                    "partitioned "
                } else {
                    ""
                },
                s.outbox().qualified_table()
            ),
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => format!("SQLite table {}", s.outbox().quoted_table()),
            #[cfg(feature = "mysql")]
            AnyStore::MySql(s) => format!("MySQL table {}", s.outbox().quoted_table()),
        }
    }
}

fn unreachable(url: &str, error: StoreError) -> ConfigError {
    ConfigError(format!(
        "cannot open database `{}`: {} — check `database.url` and that the server is running",
        redact_url(url),
        outbox_types::redact::redact_in_text(&error.to_string())
    ))
}
