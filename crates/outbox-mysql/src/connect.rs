//! [`MySqlStore`]: the outbox as a relay sees it, over an existing pool or a new one made by
//! [`MySqlStore::connect`] with settings suited to a relay.

use crate::MySqlOutbox;
use crate::sql::Sql;
use outbox_types::StoreError;
use sqlx::MySqlPool;

/// The outbox as a relay sees it: a pool and an outbox location.
#[derive(Clone, Debug)]
pub struct MySqlStore {
    pub(crate) pool: MySqlPool,
    pub(crate) outbox: MySqlOutbox,
}

impl MySqlStore {
    /// A store over an existing pool.
    pub fn new(pool: MySqlPool, outbox: MySqlOutbox) -> Self {
        MySqlStore { pool, outbox }
    }

    /// Connect with settings suited to a relay (small pool, short acquire timeout so a database
    /// outage surfaces as a retryable error instead of a hang). The URL is not echoed in errors
    /// with its password.
    pub async fn connect(url: &str, outbox: MySqlOutbox) -> Result<Self, StoreError> {
        let pool = outbox_types::connect_relay_pool!(sqlx::MySql, "MySQL", url)?;
        Ok(MySqlStore { pool, outbox })
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The outbox location.
    pub fn outbox(&self) -> &MySqlOutbox {
        &self.outbox
    }

    pub(crate) fn sql(&self) -> &Sql {
        self.outbox.sql()
    }
}
