//! Turning driver errors into the core's [`StoreError`], with transient failures told apart.
//!
//! MySQL reports a numeric error code besides the SQLSTATE; the number is the precise one
//! (SQLSTATE `HY000` covers hundreds of unrelated errors), so the classification goes by number:
//!
//! - **transient** ([`StoreError::Unavailable`]: the relay backs off and tries again): the
//!   connection broke or could not be made, the server is shutting down or refuses connections,
//!   a deadlock (1213) or a lock wait timeout (1205) rolled the statement back, the statement was
//!   interrupted or killed, or the server is read-only (a failover in progress: the new primary
//!   will accept the write);
//! - **not migrated** ([`StoreError::NotMigrated`]): the outbox table does not exist (1146);
//! - everything else is [`StoreError::Database`].

use outbox_types::StoreError;
use sqlx::mysql::MySqlDatabaseError;

/// `ER_CON_COUNT_ERROR`: too many connections.
const TOO_MANY_CONNECTIONS: u16 = 1040;
/// `ER_SERVER_SHUTDOWN`.
const SERVER_SHUTDOWN: u16 = 1053;
/// `ER_LOCK_WAIT_TIMEOUT`: the statement (not the transaction) was rolled back.
const LOCK_WAIT_TIMEOUT: u16 = 1205;
/// `ER_LOCK_DEADLOCK`: the transaction was rolled back.
const DEADLOCK: u16 = 1213;
/// `ER_OPTION_PREVENTS_STATEMENT`: typically `--read-only` on a replica during failover.
const READ_ONLY: u16 = 1290;
/// `ER_QUERY_INTERRUPTED`.
const QUERY_INTERRUPTED: u16 = 1317;
/// `ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION`.
const READ_ONLY_TRANSACTION: u16 = 1792;
/// `ER_READ_ONLY_MODE`.
const READ_ONLY_MODE: u16 = 1836;
/// MariaDB `ER_CONNECTION_KILLED`.
const CONNECTION_KILLED: u16 = 1927;
/// MariaDB `ER_STATEMENT_TIMEOUT` (`max_statement_time`).
const MARIADB_STATEMENT_TIMEOUT: u16 = 1969;
/// MySQL `ER_QUERY_TIMEOUT` (`max_execution_time`).
const MYSQL_QUERY_TIMEOUT: u16 = 3024;
/// MySQL `ER_CLIENT_INTERACTION_TIMEOUT`: the server closed an idle session.
const CLIENT_INTERACTION_TIMEOUT: u16 = 4031;
/// `ER_NO_SUCH_TABLE`.
pub(crate) const NO_SUCH_TABLE: u16 = 1146;
/// `ER_SP_DOES_NOT_EXIST`: no such stored procedure.
pub(crate) const NO_SUCH_PROCEDURE: u16 = 1305;

/// The MySQL error number of `error`, when the server sent one.
pub(crate) fn error_number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// Classify a sqlx error: connection-level trouble, deadlocks and lock wait timeouts are
/// [`StoreError::Unavailable`], a missing outbox table is [`StoreError::NotMigrated`], the rest is
/// [`StoreError::Database`].
pub(crate) fn map_sqlx(error: sqlx::Error) -> StoreError {
    match &error {
        outbox_types::sqlx_connection_trouble!() => StoreError::Unavailable(error.to_string()),
        sqlx::Error::Database(db) => match error_number(&error) {
            Some(
                TOO_MANY_CONNECTIONS
                | SERVER_SHUTDOWN
                | LOCK_WAIT_TIMEOUT
                | DEADLOCK
                | READ_ONLY
                | QUERY_INTERRUPTED
                | READ_ONLY_TRANSACTION
                | READ_ONLY_MODE
                | CONNECTION_KILLED
                | MARIADB_STATEMENT_TIMEOUT
                | MYSQL_QUERY_TIMEOUT
                | CLIENT_INTERACTION_TIMEOUT,
            ) => StoreError::Unavailable(error.to_string()),
            Some(NO_SUCH_TABLE) => StoreError::NotMigrated(db.message().to_owned()),
            _ => StoreError::Database(error.to_string()),
        },
        _ => StoreError::Database(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_trouble_is_transient() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(map_sqlx(io).is_transient());
        assert!(map_sqlx(sqlx::Error::PoolTimedOut).is_transient());
        assert!(!map_sqlx(sqlx::Error::RowNotFound).is_transient());
    }
}
