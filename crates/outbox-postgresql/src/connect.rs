//! [`PgStore`]: the outbox as a relay sees it, over an existing pool or a new one made by
//! [`PgStore::connect`] with settings suited to a relay.

use crate::PgOutbox;
use crate::sql::Sql;
use outbox_types::StoreError;
use sqlx::PgPool;

/// The outbox as a relay sees it: a pool and an outbox location.
#[derive(Clone, Debug)]
pub struct PgStore {
    pub(crate) pool: PgPool,
    pub(crate) outbox: PgOutbox,
    pub(crate) delete_on_ack: bool,
}

impl PgStore {
    /// A store over an existing pool.
    pub fn new(pool: PgPool, outbox: PgOutbox) -> Self {
        PgStore {
            pool,
            outbox,
            delete_on_ack: false,
        }
    }

    /// Delete each event when it is acked instead of marking it `delivered` (the relay's
    /// `retention.delivered = "0s"`). Nothing delivered is kept, so `outbox replay` has nothing
    /// to replay and `outbox status` counts no delivered events; in exchange the ack writes one
    /// small WAL record per event instead of a new row version with its index entries, and
    /// retention has nothing left to delete. Retried, dead and in-flight events are unaffected.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let store = outbox_postgresql::PgStore::new(pool, outbox_postgresql::PgOutbox::new())
    ///     .with_delete_on_ack(true);
    /// # }
    /// ```
    pub fn with_delete_on_ack(mut self, delete: bool) -> Self {
        self.delete_on_ack = delete;
        self
    }

    /// Connect with settings suited to a relay (small pool, short acquire timeout so a database
    /// outage surfaces as a retryable error instead of a hang). The URL is not echoed in errors
    /// with its password.
    pub async fn connect(url: &str, outbox: PgOutbox) -> Result<Self, StoreError> {
        let pool = outbox_types::connect_relay_pool!(sqlx::Postgres, "PostgreSQL", url)?;
        Ok(PgStore::new(pool, outbox))
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The outbox location.
    pub fn outbox(&self) -> &PgOutbox {
        &self.outbox
    }

    pub(crate) fn sql(&self) -> &Sql {
        &self.outbox.inner.sql
    }
}
