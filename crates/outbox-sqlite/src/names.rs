//! Where the outbox lives: a table name, checked once and quoted everywhere.

use outbox_types::StoreError;
use outbox_types::sql_store::{MAX_IDENTIFIER_LEN, check_identifier};

/// Check that `name` is a plain SQL identifier (`[a-z_][a-z0-9_]*`, at most 48 bytes, the same
/// rule as the PostgreSQL store so one configuration works for both) that SQLite lets us create.
/// Names are interpolated into SQL, so nothing else is accepted.
pub(crate) fn check_table_name(name: &str) -> Result<(), StoreError> {
    check_identifier("table", name, MAX_IDENTIFIER_LEN)?;
    // SQLite reserves every name starting with `sqlite_` for its own tables.
    if name.starts_with("sqlite_") {
        return Err(StoreError::Invalid(format!(
            "table `{name}` starts with `sqlite_`, a prefix SQLite reserves for its internal tables"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass_and_everything_else_is_refused() {
        outbox_testkit::check_table_name_rule(
            check_table_name,
            &["x\"; DROP TABLE y; --", "sqlite_events"],
        );
    }
}
