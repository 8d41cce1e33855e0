//! Turning driver errors into the core's [`StoreError`], with transient failures told apart.
//!
//! SQLite has no server to lose, so "unavailable" here means the file is busy or unreachable:
//! another connection holds the write lock longer than the busy timeout (`SQLITE_BUSY`), a
//! shared-cache table lock (`SQLITE_LOCKED`), an I/O error, a full disk, or a file that cannot be
//! opened (a missing directory, an unmounted volume). All of those may succeed later, so the relay
//! backs off and retries instead of giving up.

use outbox_types::StoreError;

/// Primary result codes (the low byte of SQLite's extended codes). See
/// <https://www.sqlite.org/rescode.html>.
const SQLITE_BUSY: i64 = 5;
const SQLITE_LOCKED: i64 = 6;
const SQLITE_IOERR: i64 = 10;
const SQLITE_FULL: i64 = 13;
const SQLITE_CANTOPEN: i64 = 14;
const SQLITE_PROTOCOL: i64 = 15;

/// Whether `error` is SQLite's `SQLITE_BUSY` or `SQLITE_LOCKED` (any extended variant).
pub(crate) fn is_busy(error: &sqlx::Error) -> bool {
    matches!(primary_code(error), Some(SQLITE_BUSY | SQLITE_LOCKED))
}

/// The primary SQLite result code of a database error. sqlx reports SQLite's extended result
/// code as a decimal string; the primary code is its low byte.
fn primary_code(error: &sqlx::Error) -> Option<i64> {
    match error {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i64>().ok())
            .map(|code| code & 0xff),
        _ => None,
    }
}

/// Classify a sqlx error: a busy or unreachable file is [`StoreError::Unavailable`], a missing
/// outbox table is [`StoreError::NotMigrated`], the rest is [`StoreError::Database`].
pub(crate) fn map_sqlx(error: sqlx::Error) -> StoreError {
    match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(error.to_string()),
        sqlx::Error::Database(db) => {
            if matches!(
                primary_code(&error).unwrap_or_default(),
                SQLITE_BUSY
                    | SQLITE_LOCKED
                    | SQLITE_IOERR
                    | SQLITE_FULL
                    | SQLITE_CANTOPEN
                    | SQLITE_PROTOCOL
            ) {
                StoreError::Unavailable(error.to_string())
            } else if db.message().starts_with("no such table") {
                StoreError::NotMigrated(db.message().to_owned())
            } else {
                StoreError::Database(error.to_string())
            }
        }
        _ => StoreError::Database(error.to_string()),
    }
}
