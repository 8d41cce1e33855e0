//! Checked names: table names are interpolated into SQL, handler names are key columns.

use crate::Error;

/// The longest handler name: MySQL's `VARCHAR(191)` keeps the primary key under InnoDB's index
/// size limit with `utf8mb4`; the same limit applies everywhere so a handler moves between
/// databases unchanged.
pub const MAX_HANDLER_LEN: usize = 191;

/// Check that `name` is a plain SQL identifier (`[a-z_][a-z0-9_]*`, at most 48 bytes so derived
/// names such as `<table>_migrations` stay under every database's identifier limit).
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub(crate) fn check_identifier(what: &str, name: &str) -> Result<(), Error> {
    // The stores' check, with the same rule and words; its error carries the message as is.
    outbox_types::sql_store::check_identifier(what, name, 48).map_err(|e| match e {
        outbox_types::StoreError::Invalid(message) => Error::Invalid(message),
        other => Error::Invalid(other.to_string()),
    })
}

/// Check a handler name: not empty, at most [`MAX_HANDLER_LEN`] characters.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub(crate) fn check_handler(handler: &str) -> Result<(), Error> {
    if handler.is_empty() || handler.chars().count() > MAX_HANDLER_LEN {
        Err(Error::Invalid(format!(
            "handler name must be 1 to {MAX_HANDLER_LEN} characters, got {} characters",
            handler.chars().count()
        )))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_table_name_is_checked_with_the_same_words() {
        assert!(super::check_identifier("table", "outbox_inbox").is_ok());
        let error = super::check_identifier("table", "Bad-Name").unwrap_err();
        assert!(matches!(error, crate::Error::Invalid(_)));
        assert_eq!(
            error.to_string(),
            crate::Error::Invalid(
                "table `Bad-Name` is not a plain identifier: use lowercase letters, digits and `_`, starting with a letter or `_`, at most 48 characters".to_owned()
            )
            .to_string()
        );
        assert!(super::check_identifier("table", &"a".repeat(49)).is_err());
    }
}
