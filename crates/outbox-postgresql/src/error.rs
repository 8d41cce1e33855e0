//! Turning driver errors into the core's [`StoreError`], with transient failures told apart.

use outbox_types::StoreError;

/// Classify a sqlx error: connection-level trouble is [`StoreError::Unavailable`] (the relay
/// backs off and retries), a missing outbox table is [`StoreError::NotMigrated`], the rest is
/// [`StoreError::Database`]. Public as [`classify_sqlx_error`](crate::classify_sqlx_error), so
/// WAL mode's own queries are classified by the same rule.
pub fn map_sqlx(error: sqlx::Error) -> StoreError {
    match &error {
        outbox_types::sqlx_connection_trouble!() => StoreError::Unavailable(error.to_string()),
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            // 08: connection exception; 57P01-57P03: admin shutdown, crash shutdown, cannot
            // connect now; 53300: too many connections; 40001/40P01: serialization/deadlock.
            if code.starts_with("08")
                || matches!(
                    code.as_str(),
                    "57P01" | "57P02" | "57P03" | "53300" | "40001" | "40P01"
                )
            {
                StoreError::Unavailable(error.to_string())
            } else if code == "42P01" || code == "3F000" {
                StoreError::NotMigrated(db.message().to_owned())
            } else {
                StoreError::Database(error.to_string())
            }
        }
        _ => StoreError::Database(error.to_string()),
    }
}
