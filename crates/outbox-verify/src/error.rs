//! The crate's one error type.
//!
//! Why one enum: every failure of the harness itself (as opposed to a violation found by the
//! checker, which is data in the report) ends the run, and the binary only needs to print it.

/// A failure of the harness (not of the system under test).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A database statement of the harness failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The outbox library failed (migrations).
    #[error("outbox store: {0}")]
    Store(#[from] outbox_types::StoreError),
    /// The inbox library failed (migrations).
    #[error("inbox: {0}")]
    Inbox(#[from] outbox_inbox::Error),
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What the harness was doing.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A helper process (initdb, pg_ctl, nats-server, the outbox binary) failed.
    #[error("{0}")]
    Process(String),
    /// A broker client failed.
    #[error("broker: {0}")]
    Broker(String),
    /// Bad options.
    #[error("invalid options: {0}")]
    Invalid(String),
    /// Something did not happen in time.
    #[error("timed out: {0}")]
    Timeout(String),
}

impl Error {
    /// Wrap an I/O error with what was being done.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::Io { what, source }
    }
}
