//! [`SqliteStore`]: the outbox as a relay sees it, over an existing pool or a new one made by
//! [`SqliteStore::connect`] (WAL journal, busy timeout), with the in-process turn that keeps
//! this process's writers from queueing on SQLite's file lock.

use crate::SqliteOutbox;
use crate::error::{is_busy, map_sqlx};
use crate::sql::Sql;
use outbox_types::StoreError;
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// How long a statement waits for another connection's write lock before it fails with a
/// transient [`StoreError::Unavailable`]; set by [`SqliteStore::connect`].
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The outbox as a relay sees it: a pool and an outbox location.
///
/// Clones share the pool and the in-process write queue (see the crate docs).
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pub(crate) pool: SqlitePool,
    pub(crate) outbox: SqliteOutbox,
    pub(crate) writes: Arc<Mutex<()>>,
}

impl SqliteStore {
    /// A store over an existing pool. For several relay processes on one file the pool's
    /// connections should have a busy timeout (see [`SqliteStore::connect_options`]).
    pub fn new(pool: SqlitePool, outbox: SqliteOutbox) -> Self {
        SqliteStore {
            pool,
            outbox,
            writes: Arc::new(Mutex::new(())),
        }
    }

    /// The connection settings [`SqliteStore::connect`] uses for `target` (a file path, or a
    /// `sqlite:` URL such as `sqlite://data/outbox.db`):
    ///
    /// - the file is created if missing;
    /// - `journal_mode=WAL`: readers (status, admin) never block the writer and the writer never
    ///   blocks them; it is a property of the file, so every process sees it;
    /// - `synchronous=NORMAL`: in WAL mode a commit survives an application crash, and a power
    ///   loss can only drop the *latest* commits whole — a business row and its event are in one
    ///   commit, so they are lost or kept together and the outbox promise holds; a lost ack
    ///   means a redelivery, which at-least-once delivery allows;
    /// - a [`BUSY_TIMEOUT`]: a statement waits that long for another process's write lock
    ///   before failing with a transient error;
    /// - `foreign_keys=ON`, for the application's own tables sharing the file.
    pub fn connect_options(target: &str) -> Result<SqliteConnectOptions, StoreError> {
        let options = if target.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(target)
                .map_err(|e| StoreError::Invalid(format!("invalid SQLite URL `{target}`: {e}")))?
        } else if target.trim().is_empty() {
            return Err(StoreError::Invalid(
                "empty SQLite database path: give a file path or a sqlite:// URL".to_owned(),
            ));
        } else {
            SqliteConnectOptions::new().filename(target)
        };
        Ok(options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true))
    }

    /// Open (creating it if missing) the database file `target` — a path or a `sqlite:` URL —
    /// with the settings of [`SqliteStore::connect_options`] and a small pool: SQLite has a
    /// single writer, so more connections only add parallel readers (status, admin commands).
    pub async fn connect(target: &str, outbox: SqliteOutbox) -> Result<Self, StoreError> {
        let options = Self::connect_options(target)?;
        let cannot_open = |e: sqlx::Error| match map_sqlx(e) {
            StoreError::Unavailable(m) | StoreError::Database(m) => {
                StoreError::Unavailable(format!("cannot open SQLite database `{target}`: {m}"))
            }
            other => other,
        };
        // One direct connection first, retried while the file is busy: switching a new file to
        // WAL needs an exclusive lock that SQLite's busy timeout does not wait for, so relays
        // opening a fresh file together would otherwise fail at random. Once one of them has
        // switched it (WAL is a property of the file), the setting is a no-op for everyone.
        let started = std::time::Instant::now();
        let mut pause = Duration::from_millis(5);
        loop {
            match <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&options).await {
                Ok(probe) => {
                    let _ = sqlx::Connection::close(probe).await;
                    break;
                }
                Err(e) if is_busy(&e) && started.elapsed() < BUSY_TIMEOUT => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err(e) => return Err(cannot_open(e)),
            }
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .map_err(cannot_open)?;
        Ok(SqliteStore::new(pool, outbox))
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The outbox location.
    pub fn outbox(&self) -> &SqliteOutbox {
        &self.outbox
    }

    pub(crate) fn sql(&self) -> &Sql {
        self.outbox.sql()
    }

    /// This process's turn to write (see the crate docs): held while a write statement runs.
    pub(crate) async fn write_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.writes.lock().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_options_accept_paths_and_urls_only() {
        assert!(SqliteStore::connect_options("data/outbox.db").is_ok());
        assert!(SqliteStore::connect_options("sqlite://data/outbox.db").is_ok());
        assert!(matches!(
            SqliteStore::connect_options("  "),
            Err(StoreError::Invalid(_))
        ));
    }
}
