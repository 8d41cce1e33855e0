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
    let valid = !name.is_empty()
        && name.len() <= 48
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{what} `{name}` is not a plain identifier: use lowercase letters, digits and `_`, starting with a letter or `_`, at most 48 characters"
        )))
    }
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
