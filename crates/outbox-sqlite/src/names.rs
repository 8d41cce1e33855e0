//! Where the outbox lives: a table name, checked once and quoted everywhere.

use outbox_types::StoreError;

/// Check that `name` is a plain SQL identifier (`[a-z_][a-z0-9_]*`, at most 48 bytes, the same
/// rule as the PostgreSQL store so one configuration works for both) that SQLite lets us create.
/// Names are interpolated into SQL, so nothing else is accepted.
pub(crate) fn check_table_name(name: &str) -> Result<(), StoreError> {
    let plain = !name.is_empty()
        && name.len() <= 48
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !plain {
        return Err(StoreError::Invalid(format!(
            "table `{name}` is not a plain identifier: use lowercase letters, digits and `_`, starting with a letter or `_`, at most 48 characters"
        )));
    }
    // SQLite reserves every name starting with `sqlite_` for its own tables.
    if name.starts_with("sqlite_") {
        return Err(StoreError::Invalid(format!(
            "table `{name}` starts with `sqlite_`, a prefix SQLite reserves for its internal tables"
        )));
    }
    Ok(())
}

/// A 64-bit FNV-1a hash: stable across builds and platforms, used for migration checksums.
pub(crate) fn fnv1a(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass_and_everything_else_is_refused() {
        assert!(check_table_name("outbox_events").is_ok());
        assert!(check_table_name("_x1").is_ok());
        for bad in [
            "",
            "Events",
            "1events",
            "bad-name",
            "x\"; DROP TABLE y; --",
            "sqlite_events",
            &"a".repeat(49),
        ] {
            assert!(
                matches!(check_table_name(bad), Err(StoreError::Invalid(_))),
                "{bad:?}"
            );
        }
    }
}
