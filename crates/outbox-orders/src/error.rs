//! The crate's one error type. The HTTP layer has its own ([`crate::http::ApiError`]), which
//! wraps this one and decides what a client may see.

/// Everything that can go wrong in the Order system's library code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A service's own database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The outbox (enqueue, migrations, relay store) failed.
    #[error("outbox error: {0}")]
    Outbox(#[from] outbox_types::StoreError),
    /// The inbox (claim, migrations) failed.
    #[error("inbox error: {0}")]
    Inbox(#[from] outbox_inbox::Error),
    /// A bad URL, name or option.
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// The broker failed (connect, stream or consumer set-up).
    #[error("broker error: {0}")]
    Broker(String),
    /// An HTTP request of the load generator failed (no answer at all).
    #[error("HTTP error: {0}")]
    Http(String),
    /// Setting up or running something local failed (a listener, a temp directory, a task).
    #[error("{0}")]
    Io(String),
    /// The demo's final check found effects that are missing, doubled or unexpected.
    #[error("the final check found {0} violation(s); see the summary above")]
    Violations(usize),
}

impl Error {
    /// Whether trying again later may succeed (the database or broker was unreachable or busy).
    ///
    /// ```
    /// assert!(!outbox_orders::Error::Invalid("bad url".into()).is_transient());
    /// assert!(outbox_orders::Error::Broker("connection refused".into()).is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Database(e) => matches!(
                e,
                sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
            ),
            Error::Outbox(e) => e.is_transient(),
            Error::Inbox(e) => e.is_transient(),
            Error::Broker(_) | Error::Http(_) | Error::Io(_) => true,
            Error::Invalid(_) | Error::Violations(_) => false,
        }
    }
}
