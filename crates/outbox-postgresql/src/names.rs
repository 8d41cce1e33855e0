//! Where the outbox lives: a schema and a table name, checked once and quoted everywhere.

use outbox_types::StoreError;

/// Check that `name` is a plain SQL identifier (`[a-z_][a-z0-9_]*`, at most 48 bytes so derived
/// index names stay under PostgreSQL's 63-byte limit). Names are interpolated into SQL, so
/// nothing else is accepted.
pub(crate) fn check_identifier(what: &str, name: &str) -> Result<(), StoreError> {
    let valid = !name.is_empty()
        && name.len() <= 48
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "{what} `{name}` is not a plain identifier: use lowercase letters, digits and `_`, starting with a letter or `_`, at most 48 characters"
        )))
    }
}

/// A 64-bit FNV-1a hash: stable across builds and platforms, used for advisory lock keys and
/// migration checksums.
pub(crate) fn fnv1a(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}
