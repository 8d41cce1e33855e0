//! Where the outbox lives: a table name, checked once and quoted everywhere.

use outbox_types::StoreError;
use outbox_types::sql_store::check_identifier;

/// The longest table name accepted: `<table>_migrations` then stays within MySQL's 64-character
/// identifier limit, and the rule is the one the PostgreSQL and SQLite stores use, so one
/// configuration works for every store.
pub(crate) const MAX_TABLE_LEN: usize = 48;

/// Check that `name` is a plain SQL identifier (`[a-z_][a-z0-9_]*`, at most
/// [`MAX_TABLE_LEN`] bytes). Names are interpolated into SQL (between backticks, and inside the
/// string literal naming the claim lock), so nothing else is accepted. Lowercase only, so the
/// name means the same table whatever the server's `lower_case_table_names`.
pub(crate) fn check_table_name(name: &str) -> Result<(), StoreError> {
    check_identifier("table", name, MAX_TABLE_LEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass_and_everything_else_is_refused() {
        outbox_testkit::check_table_name_rule(
            check_table_name,
            &["x`; DROP TABLE y; --", "x'y", "db.events"],
        );
    }
}
