//! Where the outbox lives: a schema and a table name, checked once and quoted everywhere.

use outbox_types::StoreError;
use outbox_types::sql_store::MAX_IDENTIFIER_LEN;

pub(crate) use outbox_types::sql_store::fnv1a;

/// Check that `name` is a plain SQL identifier (`[a-z_][a-z0-9_]*`, at most 48 bytes so derived
/// index names stay under PostgreSQL's 63-byte limit). Names are interpolated into SQL, so
/// nothing else is accepted.
pub(crate) fn check_identifier(what: &str, name: &str) -> Result<(), StoreError> {
    outbox_types::sql_store::check_identifier(what, name, MAX_IDENTIFIER_LEN)
}
