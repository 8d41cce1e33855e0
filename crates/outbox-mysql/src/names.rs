//! Where the outbox lives: a table name, checked once and quoted everywhere.

use outbox_types::StoreError;

/// The longest table name accepted: `<table>_migrations` then stays within MySQL's 64-character
/// identifier limit, and the rule is the one the PostgreSQL and SQLite stores use, so one
/// configuration works for every store.
pub(crate) const MAX_TABLE_LEN: usize = 48;

/// Check that `name` is a plain SQL identifier (`[a-z_][a-z0-9_]*`, at most
/// [`MAX_TABLE_LEN`] bytes). Names are interpolated into SQL (between backticks, and inside the
/// string literal naming the claim lock), so nothing else is accepted. Lowercase only, so the
/// name means the same table whatever the server's `lower_case_table_names`.
pub(crate) fn check_table_name(name: &str) -> Result<(), StoreError> {
    let plain = !name.is_empty()
        && name.len() <= MAX_TABLE_LEN
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "table `{name}` is not a plain identifier: use lowercase letters, digits and `_`, starting with a letter or `_`, at most {MAX_TABLE_LEN} characters"
        )))
    }
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
        assert!(check_table_name(&"a".repeat(48)).is_ok());
        for bad in [
            "",
            "Events",
            "1events",
            "bad-name",
            "x`; DROP TABLE y; --",
            "x'y",
            "db.events",
            &"a".repeat(49),
        ] {
            assert!(
                matches!(check_table_name(bad), Err(StoreError::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn fnv1a_is_stable() {
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
