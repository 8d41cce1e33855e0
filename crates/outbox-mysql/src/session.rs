//! A pooled connection that may hold a named lock or an open transaction, and never goes back to
//! the pool still holding either.
//!
//! `GET_LOCK()` locks belong to the *session*, not to a transaction: a `COMMIT` or a `ROLLBACK`
//! does not release them, and a connection returned to the pool with the lock still held would
//! keep every other relay's claim waiting until that connection happened to be closed. The same
//! goes for a transaction left open by an error path. So every code path that takes the lock or
//! opens a transaction goes through a [`Session`], which
//!
//! - releases the lock and ends the transaction explicitly on the normal path and on errors
//!   ([`Session::abandon`]);
//! - and, when that is not possible — the future was dropped half-way (a cancelled task, a
//!   panic), or the explicit clean-up itself failed — closes the connection instead of returning
//!   it to the pool. Closing the session makes the server roll the transaction back and release
//!   its named locks.

use outbox_types::StoreError;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, MySqlConnection, MySqlPool};

use crate::error::map_sqlx;

/// See the module docs.
pub(crate) struct Session {
    conn: PoolConnection<MySql>,
    lock_held: bool,
    in_transaction: bool,
}

impl Session {
    /// Take a connection from the pool.
    pub(crate) async fn open(pool: &MySqlPool) -> Result<Self, StoreError> {
        let conn = pool.acquire().await.map_err(map_sqlx)?;
        Ok(Session {
            conn,
            lock_held: false,
            in_transaction: false,
        })
    }

    /// Take a connection from the pool and ask for a named lock on it ([`Session::get_lock`]):
    /// the session and whether the lock was granted within `wait_seconds`. When asking fails,
    /// the session is abandoned (`release_lock`) and the error returned.
    pub(crate) async fn open_with_lock(
        pool: &MySqlPool,
        get_lock: &str,
        release_lock: &str,
        wait_seconds: u32,
    ) -> Result<(Self, bool), StoreError> {
        let mut session = Session::open(pool).await?;
        match session.get_lock(get_lock, wait_seconds).await {
            Ok(granted) => Ok((session, granted)),
            Err(error) => {
                session.abandon(release_lock).await;
                Err(error)
            }
        }
    }

    /// The connection, for statements in between.
    pub(crate) fn conn(&mut self) -> &mut MySqlConnection {
        &mut self.conn
    }

    /// Run `get_lock` (a `SELECT GET_LOCK(name, ?)`) with `wait_seconds`. `Ok(true)` when the
    /// lock is now held by this session, `Ok(false)` when the wait timed out.
    pub(crate) async fn get_lock(
        &mut self,
        get_lock: &str,
        wait_seconds: u32,
    ) -> Result<bool, StoreError> {
        // Marked before the call: if the future is dropped while the server grants the lock,
        // the connection must not go back to the pool.
        self.lock_held = true;
        let got: Option<i64> = sqlx::query_scalar(AssertSqlSafe(get_lock))
            .bind(wait_seconds)
            .fetch_one(&mut *self.conn)
            .await
            .map_err(map_sqlx)?;
        // 1: granted; 0: timed out; NULL: an error (such as the session being killed).
        self.lock_held = got == Some(1);
        Ok(self.lock_held)
    }

    /// Run `release_lock` (a `DO RELEASE_LOCK(name)`) if the lock is held.
    pub(crate) async fn release_lock(&mut self, release_lock: &str) -> Result<(), StoreError> {
        if self.lock_held {
            self.run(release_lock).await?;
            self.lock_held = false;
        }
        Ok(())
    }

    /// `START TRANSACTION`.
    pub(crate) async fn begin(&mut self) -> Result<(), StoreError> {
        self.in_transaction = true;
        self.run("START TRANSACTION").await
    }

    /// `COMMIT`.
    pub(crate) async fn commit(&mut self) -> Result<(), StoreError> {
        self.run("COMMIT").await?;
        self.in_transaction = false;
        Ok(())
    }

    /// `ROLLBACK` if a transaction is open.
    pub(crate) async fn rollback(&mut self) -> Result<(), StoreError> {
        if self.in_transaction {
            self.run("ROLLBACK").await?;
            self.in_transaction = false;
        }
        Ok(())
    }

    /// Run `sql` (no arguments, no rows) on the session's connection.
    async fn run(&mut self, sql: &str) -> Result<(), StoreError> {
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut *self.conn)
            .await
            .map_err(map_sqlx)?;
        Ok(())
    }

    /// After an error: roll back and release the lock, best effort. Whatever could not be cleaned
    /// up makes the connection close on drop (see the module docs).
    pub(crate) async fn abandon(mut self, release_lock: &str) {
        if let Err(error) = self.rollback().await {
            tracing::debug!(%error, "Rollback after a failed outbox operation failed; closing the connection.");
        }
        if let Err(error) = self.release_lock(release_lock).await {
            tracing::debug!(%error, "Releasing the outbox lock failed; closing the connection.");
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.lock_held || self.in_transaction {
            // The server releases a session's named locks and rolls back its transaction when
            // the session ends.
            self.conn.close_on_drop();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    use sqlx::mysql::MySqlPoolOptions;

    use crate::MySqlOutbox;

    /// `OUTBOX_TEST_MYSQL_URL`, or the machine's local MariaDB `test` database.
    pub(crate) fn database_url() -> String {
        std::env::var("OUTBOX_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
    }

    /// A pool of up to `max` connections on [`database_url`].
    pub(crate) async fn test_pool(max: u32) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(max)
            .connect(&database_url())
            .await
            .expect("MariaDB/MySQL must be running on 127.0.0.1:3306 with a `test` database")
    }

    pub(crate) fn unique_table(tag: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        format!("ob_t_{}_{tag}_{}", std::process::id(), nanos % 100_000)
    }

    #[tokio::test]
    async fn a_session_dropped_while_holding_the_lock_gives_it_back() {
        let pool = test_pool(3).await;
        let outbox = MySqlOutbox::with_table(&unique_table("lock")).unwrap();
        let sql = outbox.sql();
        let is_free = format!(
            "SELECT IS_FREE_LOCK(CONCAT('outbox:claim:', MD5(CONCAT(DATABASE(), '.', '{}'))))",
            outbox.table()
        );
        let mut session = Session::open(&pool).await.unwrap();
        assert!(session.get_lock(&sql.claim_lock, 1).await.unwrap());
        session.begin().await.unwrap();
        let free: Option<i64> = sqlx::query_scalar(AssertSqlSafe(is_free.as_str()))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(free, Some(0));
        // As when the claiming future is dropped half-way: no explicit release.
        drop(session);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let free: Option<i64> = sqlx::query_scalar(AssertSqlSafe(is_free.as_str()))
                .fetch_one(&pool)
                .await
                .unwrap();
            if free == Some(1) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the lock was never released"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // And a cleanly finished session goes back to the pool holding nothing.
        let mut session = Session::open(&pool).await.unwrap();
        assert!(session.get_lock(&sql.claim_lock, 1).await.unwrap());
        session.release_lock(&sql.claim_unlock).await.unwrap();
        drop(session);
        let free: Option<i64> = sqlx::query_scalar(AssertSqlSafe(is_free.as_str()))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(free, Some(1));
    }
}
