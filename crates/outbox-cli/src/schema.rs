//! `outbox schema print`: the DDL `outbox migrate` applies, as a script to review or to hand to
//! the team's own migration tool (Flyway, Liquibase, Alembic, psql).
//!
//! The script carries the bookkeeping rows with the checksums `outbox migrate` checks, so a
//! database it was applied to is one `outbox migrate` finds current ("schema is current") and
//! the relay accepts; no other switch is needed for an externally managed schema. A later
//! release's script has the new migrations at its end, after the ones already applied: apply
//! the new ones (their `-- Migration N` sections) with the same tool. In WAL mode with the stream
//! table among `[wal] sources`, its definition follows the migrations.

use clap::{Args, ValueEnum};
use serde_json::json;

use crate::DbArgs;
use crate::config::{ConfigError, Database, Layout};
#[cfg(feature = "mysql")]
use crate::store::mysql_outbox;
use crate::store::pg_outbox;
#[cfg(feature = "sqlite")]
use crate::store::sqlite_outbox;

/// Which database's DDL to print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dialect {
    /// PostgreSQL.
    Postgres,
    /// MySQL 8.0.17+.
    Mysql,
    /// MariaDB 10.6+ (another binary collation than MySQL's).
    Mariadb,
    /// SQLite.
    Sqlite,
}

/// The outbox layout on PostgreSQL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LayoutFlag {
    /// One table.
    Plain,
    /// Range-partitioned by enqueue time.
    Partitioned,
}

#[derive(Args)]
pub(crate) struct PrintArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The database kind; by default the one `database.url` names (a mysql:// URL prints
    /// MySQL's DDL: say `--dialect mariadb` for MariaDB).
    #[arg(long, value_enum)]
    pub dialect: Option<Dialect>,
    /// PostgreSQL layout (default: `database.layout`, else plain).
    #[arg(long, value_enum)]
    pub layout: Option<LayoutFlag>,
}

/// The dialect a database URL names: its database, MariaDB told from MySQL by the scheme.
fn dialect_of(url: &str) -> Option<Dialect> {
    Some(match Database::of(url)? {
        Database::Postgres => Dialect::Postgres,
        Database::MySql if url.trim().starts_with("mariadb://") => Dialect::Mariadb,
        Database::MySql => Dialect::Mysql,
        Database::Sqlite => Dialect::Sqlite,
    })
}

/// A URL of `dialect`, only so the configuration loads when none is given: nothing connects.
fn placeholder_url(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Postgres => "postgres://localhost/outbox",
        Dialect::Mysql => "mysql://localhost/outbox",
        Dialect::Mariadb => "mariadb://localhost/outbox",
        Dialect::Sqlite => "sqlite::memory:",
    }
}

/// The script for what the flags, the config file and the environment name.
pub(crate) fn script(args: &PrintArgs) -> Result<String, ConfigError> {
    let mut extra = Vec::new();
    if let Some(layout) = args.layout {
        extra.push((
            "database.layout",
            Some(json!(match layout {
                LayoutFlag::Plain => "plain",
                LayoutFlag::Partitioned => "partitioned",
            })),
        ));
    }
    // With --dialect and no URL anywhere, a placeholder lets the configuration load.
    let configured = args.db.load(extra.clone());
    let config = match (configured, args.dialect) {
        (Ok(config), _) => config,
        (Err(_), Some(dialect)) if args.db.database_url.is_none() => {
            extra.push(("database.url", Some(json!(placeholder_url(dialect)))));
            args.db.load(extra)?
        }
        (Err(error), None) => {
            return Err(ConfigError(format!(
                "{error} (or pass --dialect postgres|mysql|mariadb|sqlite to print without one)"
            )));
        }
        (Err(error), Some(_)) => return Err(error),
    };
    let dialect = match args.dialect.or_else(|| dialect_of(&config.database.url)) {
        Some(dialect) => dialect,
        None => {
            return Err(ConfigError(
                "no database kind: pass --dialect postgres|mysql|mariadb|sqlite, or set `database.url`".into(),
            ));
        }
    };
    if dialect != Dialect::Postgres && config.database.layout == Layout::Partitioned {
        return Err(ConfigError(
            "the partitioned layout is PostgreSQL's: use --layout plain (or `database.layout = \"plain\"`) with other databases".into(),
        ));
    }
    let database = match dialect {
        Dialect::Postgres => Database::Postgres,
        Dialect::Mysql | Dialect::Mariadb => Database::MySql,
        Dialect::Sqlite => Database::Sqlite,
    };
    database.built().map_err(|e| ConfigError(e.to_string()))?;
    #[allow(unreachable_patterns)] // reachable in a build without some database
    Ok(match dialect {
        Dialect::Postgres => {
            let mut script = pg_outbox(&config)?.schema_script();
            if config.mode == crate::config::Mode::Wal
                && config
                    .wal
                    .sources
                    .contains(&outbox_wal::Source::StreamTable)
            {
                script.push_str("\n-- The stream table of WAL mode (`[wal] sources` has \"stream_table\"). Not a migration:\n-- the relay and `outbox wal prepare` create it when it is missing, and add it to the publication.\n");
                script.push_str(&outbox_wal::stream_table_ddl(&config.wal_config()?));
                script.push('\n');
            }
            script
        }
        #[cfg(feature = "sqlite")]
        Dialect::Sqlite => sqlite_outbox(&config)?.schema_script(),
        #[cfg(feature = "mysql")]
        Dialect::Mysql => mysql_outbox(&config)?.schema_script(false),
        #[cfg(feature = "mysql")]
        Dialect::Mariadb => mysql_outbox(&config)?.schema_script(true),
        // Not reached: `built()` above refused a database this build lacks.
        other => return Err(ConfigError(format!("{other:?} is not in this build"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dialect_comes_from_the_url() {
        assert_eq!(dialect_of("postgresql://u@h/db"), Some(Dialect::Postgres));
        assert_eq!(dialect_of("mariadb://u@h/db"), Some(Dialect::Mariadb));
        assert_eq!(dialect_of("mysql://u@h/db"), Some(Dialect::Mysql));
        assert_eq!(dialect_of("sqlite://x.db"), Some(Dialect::Sqlite));
        assert_eq!(dialect_of("oracle://x"), None);
    }
}
