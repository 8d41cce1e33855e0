//! What can go wrong in WAL mode, told apart so a caller knows whether to wait, reconfigure the
//! server, or run [`recover`](crate::recover).
//!
//! Delivery failures are not errors here either: like the polling relay, a failed publish is data
//! for the retry and dead-letter path. These errors are about the database, the replication slot
//! and configuration.

use outbox_types::StoreError;
use thiserror::Error;

/// A WAL-mode operation failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum WalError {
    /// The configuration cannot work; the message says which setting and how to fix it.
    #[error("WAL mode configuration error: {0}")]
    Config(String),
    /// The server is not set up for logical replication (`wal_level`, slots, senders, or the
    /// role's `REPLICATION` attribute); the message says what to change.
    #[error("PostgreSQL is not ready for WAL mode: {0}")]
    ServerSetup(String),
    /// The replication slot this outbox streamed from is gone (dropped by hand, or the cluster
    /// was restored/failed over without it). Events written only to the WAL since the last
    /// confirmed position may be lost; table rows are not: run [`recover`](crate::recover).
    #[error(
        "replication slot `{slot}` is missing although this outbox streamed from it before ({detail}); run `outbox wal recover` (or `outbox_wal::recover` from Rust) to recreate it and re-scan undelivered outbox rows"
    )]
    SlotLost {
        /// The slot name.
        slot: String,
        /// What was found.
        detail: String,
    },
    /// The slot exists but PostgreSQL invalidated it (it fell behind `max_slot_wal_keep_size`
    /// and the WAL it needed was removed).
    #[error(
        "replication slot `{slot}` was invalidated by PostgreSQL (wal_status = lost: it retained more WAL than max_slot_wal_keep_size allows); run `outbox wal recover` (or `outbox_wal::recover` from Rust) to recreate it and re-scan undelivered outbox rows"
    )]
    SlotInvalidated {
        /// The slot name.
        slot: String,
    },
    /// The database could not be reached or the connection broke. Retrying later may succeed.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The database answered with an error.
    #[error("database error: {0}")]
    Database(String),
    /// The replication stream failed (connection lost, server error).
    #[error("replication stream error: {0}")]
    Replication(String),
    /// Another instance holds the slot and did not let go within the takeover timeout.
    #[error("replication slot `{slot}` is still in use by another session after {waited_ms} ms")]
    SlotBusy {
        /// The slot name.
        slot: String,
        /// How long this instance waited.
        waited_ms: u64,
    },
    /// The stream carried something this build cannot decode.
    #[error("cannot decode the replication stream: {0}")]
    Decode(String),
    /// An outbox store operation failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An event could not be encoded.
    #[error(transparent)]
    Encode(#[from] outbox_types::EncodeError),
}

impl WalError {
    /// Whether retrying later may succeed without anyone changing anything (connection loss,
    /// server restart, a slot still held by a dying predecessor).
    pub fn is_transient(&self) -> bool {
        match self {
            WalError::Unavailable(_) | WalError::Replication(_) | WalError::SlotBusy { .. } => true,
            WalError::Store(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// Classify a sqlx error by `outbox-postgresql`'s rule (one rule for both modes): connection
/// trouble is transient, a missing outbox table is "not migrated", the rest a database error.
pub(crate) fn map_sqlx(error: sqlx::Error) -> WalError {
    match outbox_postgresql::classify_sqlx_error(error) {
        StoreError::Unavailable(message) => WalError::Unavailable(message),
        StoreError::Database(message) => WalError::Database(message),
        other => WalError::Store(other),
    }
}

/// Classify an error of the replication client.
pub(crate) fn map_wire(error: pgwire_replication::PgWireError) -> WalError {
    use pgwire_replication::PgWireError as E;
    match &error {
        E::Server(msg) if msg.contains("is active for PID") => WalError::SlotBusy {
            slot: String::new(),
            waited_ms: 0,
        },
        E::Server(msg) if msg.contains("does not exist") && msg.contains("replication slot") => {
            WalError::SlotLost {
                slot: String::new(),
                detail: msg.clone(),
            }
        }
        E::Server(msg)
            if msg.contains("can no longer get changes") || msg.contains("invalidated") =>
        {
            WalError::SlotInvalidated {
                slot: String::new(),
            }
        }
        E::Server(msg) if msg.contains("pg_hba.conf") => WalError::ServerSetup(format!(
            "{msg}: allow replication connections for this role in pg_hba.conf (a line `host replication <role> <address> <method>`) and reload PostgreSQL"
        )),
        E::Server(msg)
            if msg.contains("must be superuser or replication role")
                || msg.contains("permission denied to start WAL sender") =>
        {
            WalError::ServerSetup(format!(
                "{msg}: grant the role the REPLICATION attribute (ALTER ROLE <role> REPLICATION)"
            ))
        }
        E::Auth(msg) => WalError::Config(format!("authentication failed: {msg}")),
        // A refused or unverifiable certificate, a server without TLS under `require`: wrong
        // settings, not a network blip; retrying would only repeat it.
        E::Tls(msg) if crate::conn::is_tls_setup_error(msg) => {
            WalError::Config(format!("replication connection: TLS failed: {msg}"))
        }
        E::Server(msg) if msg.contains("57P01") || msg.contains("terminating connection") => {
            WalError::Replication(error.to_string())
        }
        E::Server(_) | E::Io(_) | E::Task(_) | E::Tls(_) => {
            WalError::Replication(error.to_string())
        }
        _ => WalError::Replication(error.to_string()),
    }
}
