//! The [`Store`](outbox_types::Store) implementation: each operation delegates to the module of
//! its concern (a trait impl cannot be split across files); the delegations are the same in every
//! store, so `outbox_types::impl_store_by_concern!` writes them.

use crate::PgStore;
use crate::{admin, claim, retention, settle};

outbox_types::impl_store_by_concern!(PgStore, "postgres");
