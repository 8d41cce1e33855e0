//! The one error type of the crate, with transient failures told apart.
//!
//! Why one enum: the adapters decide between "retry later" (nak / leave pending) and "this will
//! never work" (park now) from [`Error::is_transient`] alone, whichever database or broker the
//! error came from.

/// A boxed error, what effects return when they are run by the broker adapters.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in the inbox and its adapters.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The consumer's database failed (connection, lock wait, constraint, …).
    #[error("inbox database error: {0}")]
    Database(#[source] sqlx::Error),
    /// A bad table name, handler name or option; fix the configuration.
    #[error("invalid inbox configuration: {0}")]
    Invalid(String),
    /// The inbox tables are missing or at a version this build does not know.
    #[error("inbox schema not migrated: {0}")]
    NotMigrated(String),
    /// A message that can never be processed (no or malformed `outbox-event-id`).
    #[error("bad message: {0}")]
    BadMessage(String),
    /// The handler's effect failed; the transaction was rolled back and nothing was recorded.
    #[error("handler failed: {0}")]
    Handler(#[source] BoxError),
    /// The broker failed (connection lost, ack not confirmed, …).
    #[error("broker error: {0}")]
    Broker(String),
}

impl Error {
    /// Whether trying again later may succeed: connection trouble, lock timeouts, deadlocks,
    /// serialization failures, a busy SQLite file, broker errors, and handler failures (the
    /// effect may depend on something that comes back). Configuration errors, a missing schema
    /// and malformed messages are not transient.
    ///
    /// ```
    /// use outbox_inbox::Error;
    /// assert!(!Error::Invalid("bad table".into()).is_transient());
    /// assert!(Error::Broker("connection reset".into()).is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Database(e) => sqlx_is_transient(e),
            Error::Handler(_) | Error::Broker(_) => true,
            Error::Invalid(_) | Error::NotMigrated(_) | Error::BadMessage(_) => false,
        }
    }
}

impl Error {
    /// The error an effect returned, as the adapters' handlers report it: an
    /// [`Error`] the effect returned itself (e.g. [`Error::BadMessage`] from
    /// [`Delivery::json`](crate::Delivery::json)) is kept as it is, so a non-transient one parks
    /// the message at once; anything else becomes [`Error::Handler`] (transient: retried until
    /// the attempts run out).
    ///
    /// ```
    /// use outbox_inbox::{BoxError, Error};
    /// let bad: BoxError = Box::new(Error::BadMessage("not JSON".into()));
    /// assert!(!Error::from_effect(bad).is_transient());
    /// let other: BoxError = "downstream timeout".into();
    /// assert!(Error::from_effect(other).is_transient());
    /// ```
    pub fn from_effect(error: BoxError) -> Self {
        match error.downcast::<Error>() {
            Ok(inner) => *inner,
            Err(other) => Error::Handler(other),
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(error: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &error {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let message = db.message();
            // PostgreSQL undefined table / schema / function (the claim function of migration
            // 2), MySQL 1146 no such table and 1305 no such procedure, SQLite "no such table".
            if code == "42P01"
                || code == "3F000"
                || code == "42883"
                || code == "42S02"
                || (message.starts_with("PROCEDURE") && message.ends_with("does not exist"))
                || message.starts_with("no such table")
            {
                return Error::NotMigrated(format!(
                    "{message}; create or upgrade the inbox with `outbox inbox migrate` (or the inbox's `migrate`)"
                ));
            }
        }
        Error::Database(error)
    }
}

fn sqlx_is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            // PostgreSQL: 08 connection exception, 40001 serialization, 40P01 deadlock,
            // 55P03 lock not available, 57P0x shutdown, 53300 too many connections.
            // MySQL: SQLSTATE 40001 (deadlock 1213), HY000 with lock wait timeout 1205 is
            // reported as code "HY000", so the message decides.
            // SQLite: BUSY (5) and LOCKED (6) in the low byte of the extended code.
            let sqlite_busy = code
                .parse::<i64>()
                .map(|c| matches!(c & 0xff, 5 | 6 | 10 | 13))
                .unwrap_or(false);
            code.starts_with("08")
                || matches!(
                    code.as_str(),
                    "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03" | "53300"
                )
                || db.message().contains("Lock wait timeout")
                || db.message().contains("Deadlock found")
                || sqlite_busy
        }
        _ => false,
    }
}
