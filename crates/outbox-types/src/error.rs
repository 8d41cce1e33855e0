//! Errors shared by every crate that speaks the core vocabulary.

use thiserror::Error;

/// An event could not be built: its payload is not JSON the outbox can store.
///
/// Returned by [`NewEvent::new`](crate::NewEvent::new) before anything touches the database, so a
/// bad payload never leaves a half-written transaction behind.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// `serde_json` refused the value (a map with non-string keys, a failing `Serialize` impl…).
    #[error("event payload cannot be serialized to JSON: {0}")]
    Serialize(#[from] serde_json::Error),
    /// A raw payload given as text is not a JSON document.
    #[error("event payload is not valid JSON: {0}")]
    InvalidJson(serde_json::Error),
    /// A required field is empty.
    #[error("event field `{0}` must not be empty")]
    Empty(&'static str),
    /// A `traceparent` that is not W3C trace context.
    #[error(
        "`{0}` is not a W3C traceparent (expected 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>)"
    )]
    InvalidTraceparent(String),
    /// A header name under the prefix reserved for the relay's own message headers
    /// ([`RESERVED_HEADER_PREFIX`](crate::RESERVED_HEADER_PREFIX)). Refused here because the
    /// outbox table refuses it too (a trigger at insert), so the error comes from the library with
    /// the header's name rather than from the database.
    #[error(
        "header `{0}` uses the prefix `outbox-`, which is reserved for the relay's own message headers (only `outbox-partition` may be stored): rename the header"
    )]
    ReservedHeader(String),
}

/// A store operation failed.
///
/// Delivery failures are not store errors: they are data, recorded through
/// [`Store::retry`](crate::Store::retry) and [`Store::bury`](crate::Store::bury).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database could not be reached or the connection broke. Retrying later may succeed.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The database answered with an error (constraint, syntax, missing table…).
    #[error("database error: {0}")]
    Database(String),
    /// The outbox schema is missing or older than this build expects.
    #[error("outbox schema is not ready: {0} (run `outbox migrate` or call `migrate()` first)")]
    NotMigrated(String),
    /// An event stored in the database could not be decoded (hand-edited row, foreign writer).
    #[error("stored event {seq} is malformed: {reason}")]
    Corrupt {
        /// The primary key of the row.
        seq: i64,
        /// What is wrong with it.
        reason: String,
    },
    /// A caller-side mistake, such as an invalid identifier for the outbox table.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// An event could not be encoded.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The source cannot go on and the relay must stop (a WAL source whose replication slot
    /// was lost, say); the message says what happened and what to do.
    #[error("{0}")]
    Stopped(String),
    /// This store does not implement the operation (a store written against an older version of
    /// the [`Store`](crate::Store) trait).
    #[error("the `{store}` store does not support `{operation}`")]
    Unsupported {
        /// Which store.
        store: &'static str,
        /// Which operation.
        operation: &'static str,
    },
}

impl StoreError {
    /// Whether retrying the same call later may succeed (connection loss, failover, timeouts).
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}
