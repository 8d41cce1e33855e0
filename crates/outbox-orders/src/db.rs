//! Which database a service runs on, picked from its URL, and the services' own embedded
//! migrations.
//!
//! Why an enum and not sqlx's `Any` driver: the outbox and the inbox have one type per database
//! (`PgOutbox` / `SqliteOutbox`, `PgInbox` / `SqliteInbox`) whose `enqueue` and `claim` take
//! that database's executor, so the business write and the event share a real transaction. A
//! two-armed enum keeps that typing; each arm's SQL is written for its database.
//!
//! Why our own tiny migrator and not `sqlx::migrate!`: each service keeps its bookkeeping in a
//! table named after it (`orders_migrations`, `delivery_migrations`, …), next to the outbox's
//! and the inbox's own, so nothing clashes when a service shares a database or schema with
//! another; and the SQL differs per database, which one list with two texts per step states
//! plainly.

use std::str::FromStr;
use std::time::Duration;

use sqlx::pool::PoolOptions;
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, PgPool, Pool, Row, SqlitePool};

use crate::Error;

/// A connection pool to one of the supported databases.
#[derive(Clone, Debug)]
pub enum Db {
    /// PostgreSQL; the service's tables live in the connection's `search_path` schema.
    Postgres(PgPool),
    /// SQLite (a file in WAL mode with a busy timeout).
    Sqlite(SqlitePool),
}

impl Db {
    /// Connect to `url`: `postgres://…` / `postgresql://…`, or `sqlite://path` / `sqlite:path`.
    /// On PostgreSQL, `schema` (created if missing) becomes the connections' `search_path`, so
    /// the service's unqualified table names land there; on SQLite it is ignored.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), outbox_orders::Error> {
    /// let db = outbox_orders::Db::connect("sqlite://orders.db", None, 4).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(
        url: &str,
        schema: Option<&str>,
        max_connections: u32,
    ) -> Result<Db, Error> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let mut options = PgConnectOptions::from_str(url).map_err(|e| {
                Error::Invalid(format!(
                    "invalid PostgreSQL URL `{}`: {e}",
                    outbox_postgresql::redact_url(url)
                ))
            })?;
            if let Some(schema) = schema {
                check_identifier("schema", schema)?;
                let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect_with(&options)
                    .await
                    .map_err(Error::Database)?;
                sqlx::query(AssertSqlSafe(format!(
                    "CREATE SCHEMA IF NOT EXISTS \"{schema}\""
                )))
                .execute(&mut conn)
                .await
                .map_err(Error::Database)?;
                let _ = sqlx::Connection::close(conn).await;
                options = options.options([("search_path", schema)]);
            }
            Ok(Db::Postgres(pool(options, max_connections).await?))
        } else if url.starts_with("sqlite:") {
            let options = outbox_sqlite::SqliteStore::connect_options(url)?;
            Ok(Db::Sqlite(pool(options, max_connections).await?))
        } else {
            Err(Error::Invalid(format!(
                "unsupported database URL `{}`: use postgres://… or sqlite://path",
                outbox_postgresql::redact_url(url)
            )))
        }
    }

    /// Close the pool (waits for connections in use to come back).
    pub async fn close(&self) {
        match self {
            Db::Postgres(pool) => pool.close().await,
            Db::Sqlite(pool) => pool.close().await,
        }
    }
}

/// A pool of at most `max_connections` (at least 1) on `options`, waiting up to 10 s for a
/// connection: the same for either database.
async fn pool<DB: sqlx::Database>(
    options: <DB::Connection as sqlx::Connection>::Options,
    max_connections: u32,
) -> Result<Pool<DB>, Error> {
    PoolOptions::<DB>::new()
        .max_connections(max_connections.max(1))
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(Error::Database)
}

/// A plain lowercase identifier (`[a-z_][a-z0-9_]*`, at most 63 bytes), safe to quote into SQL.
pub(crate) fn check_identifier(what: &str, name: &str) -> Result<(), Error> {
    let mut chars = name.chars();
    let ok = name.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{what} `{name}` is not a plain identifier ([a-z_][a-z0-9_]*, at most 63 characters)"
        )))
    }
}

/// One schema change, in both dialects.
pub(crate) struct Migration {
    pub version: i64,
    pub description: &'static str,
    pub postgres: &'static str,
    pub sqlite: &'static str,
}

/// Apply the `migrations` not yet recorded in `<name>_migrations`, in one transaction that is
/// serialized against other processes migrating the same service (an advisory lock on
/// PostgreSQL, `BEGIN IMMEDIATE` on SQLite). Idempotent; returns the versions applied.
pub(crate) async fn migrate(
    db: &Db,
    name: &str,
    migrations: &[Migration],
) -> Result<Vec<i64>, Error> {
    check_identifier("migration set", name)?;
    let book = format!("\"{name}_migrations\"");
    match db {
        Db::Postgres(pool) => {
            let mut tx = pool.begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.' || $1))")
                .bind(name)
                .execute(&mut *tx)
                .await?;
            apply_pending(tx, &book, &POSTGRES, migrations).await
        }
        Db::Sqlite(pool) => {
            let tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            apply_pending(tx, &book, &SQLITE, migrations).await
        }
    }
}

/// What [`apply_pending`] writes differently per database: the bookkeeping table's column
/// types, the placeholders of its insert, and which of a [`Migration`]'s scripts to run.
struct Bookkeeping {
    /// The `version` column's type (the primary key).
    version_type: &'static str,
    /// The `applied_at` column's type, with its default of now.
    applied_at_type: &'static str,
    /// The insert's two placeholders, version and description.
    placeholders: &'static str,
    /// The script of a [`Migration`] this database runs.
    script: fn(&Migration) -> &'static str,
}

const POSTGRES: Bookkeeping = Bookkeeping {
    version_type: "BIGINT PRIMARY KEY",
    applied_at_type: "TIMESTAMPTZ NOT NULL DEFAULT now()",
    placeholders: "($1, $2)",
    script: |m| m.postgres,
};

const SQLITE: Bookkeeping = Bookkeeping {
    version_type: "INTEGER PRIMARY KEY",
    applied_at_type: "TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))",
    placeholders: "(?1, ?2)",
    script: |m| m.sqlite,
};

/// The body of [`migrate`] both databases share, in the caller's serialized transaction `tx`:
/// create the bookkeeping table `book`, then run each migration not recorded there and record
/// it, and commit. The column types, the placeholders and the scripts are `dialect`'s.
async fn apply_pending<DB>(
    mut tx: sqlx::Transaction<'static, DB>,
    book: &str,
    dialect: &Bookkeeping,
    migrations: &[Migration],
) -> Result<Vec<i64>, Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    i64: for<'q> sqlx::Encode<'q, DB> + for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    &'static str: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    Error: From<sqlx::Error>,
{
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {book} (
             version     {},
             description TEXT NOT NULL,
             applied_at  {})",
        dialect.version_type, dialect.applied_at_type
    )))
    .execute(&mut *tx)
    .await?;
    let done: Vec<i64> = sqlx::query(AssertSqlSafe(format!("SELECT version FROM {book}")))
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| r.try_get(0))
        .collect::<Result<_, _>>()?;
    let mut applied = Vec::new();
    for m in migrations.iter().filter(|m| !done.contains(&m.version)) {
        sqlx::raw_sql(AssertSqlSafe((dialect.script)(m)))
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {book} (version, description) VALUES {}",
            dialect.placeholders
        )))
        .bind(m.version)
        .bind(m.description)
        .execute(&mut *tx)
        .await?;
        applied.push(m.version);
    }
    tx.commit().await?;
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers() {
        assert!(check_identifier("schema", "outbox_t_orders_1").is_ok());
        assert!(check_identifier("schema", "Orders").is_err());
        assert!(check_identifier("schema", "a\"; drop").is_err());
        assert!(check_identifier("schema", "").is_err());
    }

    #[tokio::test]
    async fn unknown_url_scheme_is_refused() {
        let err = Db::connect("mysql://root@localhost/x", None, 1)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("unsupported database URL"),
            "{err}"
        );
    }
}
