//! Shared by the MySQL integration tests: a connection to the test database and a fresh,
//! migrated outbox in its own table for every test.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_mysql::{MySqlOutbox, MySqlStore};
use outbox_store_tests::{Harness, KillableWriter, Writer};
use outbox_types::{EventId, NewEvent};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Connection, Executor, MySql, MySqlConnection, MySqlPool};
use tokio::sync::OnceCell;

/// `OUTBOX_TEST_MYSQL_URL`, or the machine's local MariaDB `test` database.
pub fn database_url() -> String {
    std::env::var("OUTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A table name no other test (or test process) uses: `ob_t_<pid>_<n>_<nanos>`, well under the
/// 48-character limit.
pub fn unique_table() -> String {
    outbox_testkit::unique("ob_t")
}

pub async fn pool(max: u32) -> MySqlPool {
    sweep_old_tables().await;
    MySqlPoolOptions::new()
        .max_connections(max)
        .connect(&database_url())
        .await
        .expect("MariaDB/MySQL must be running on 127.0.0.1:3306 with a `test` database")
}

/// Test tables from earlier runs (older than an hour), dropped once per test process so the
/// `test` database does not fill up with them.
async fn sweep_old_tables() {
    static SWEPT: OnceCell<()> = OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let Ok(pool) = MySqlPoolOptions::new()
                .max_connections(1)
                .connect(&database_url())
                .await
            else {
                return;
            };
            // Old test tables, then the enqueue procedures their tables left behind (each
            // migrated test table has two, dropped with the table).
            for (kind, names) in [
                (
                    "TABLE",
                    "SELECT TABLE_NAME FROM information_schema.TABLES
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'ob\\_t\\_%'
                       AND CREATE_TIME < NOW() - INTERVAL 1 HOUR",
                ),
                (
                    "PROCEDURE",
                    "SELECT r.ROUTINE_NAME FROM information_schema.ROUTINES AS r
                     WHERE r.ROUTINE_SCHEMA = DATABASE()
                       AND (r.ROUTINE_NAME LIKE 'ob\\_t\\_%\\_enqueue'
                            OR r.ROUTINE_NAME LIKE 'ob\\_t\\_%\\_enqueue\\_batch')
                       AND NOT EXISTS (SELECT 1 FROM information_schema.TABLES AS t
                                       WHERE t.TABLE_SCHEMA = DATABASE()
                                         AND r.ROUTINE_NAME IN (CONCAT(t.TABLE_NAME, '_enqueue'),
                                                                CONCAT(t.TABLE_NAME, '_enqueue_batch')))",
                ),
            ] {
                let old: Vec<String> = sqlx::query_scalar(names)
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_default();
                for name in old {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP {kind} IF EXISTS `{name}`"
                    )))
                    .execute(&pool)
                    .await;
                }
            }
            pool.close().await;
        })
        .await;
}

/// A fresh migrated outbox and a store over it.
pub async fn fresh_store() -> MySqlStore {
    let (pool, outbox) = unmigrated_outbox(10).await;
    outbox.migrate(&pool).await.unwrap();
    MySqlStore::new(pool, outbox)
}

/// A pool of `max` connections and an outbox on a table no other test uses, not migrated yet.
pub async fn unmigrated_outbox(max: u32) -> (MySqlPool, MySqlOutbox) {
    (
        pool(max).await,
        MySqlOutbox::with_table(&unique_table()).unwrap(),
    )
}

/// Run `sql`, a statement the test writes by hand, on `pool`; it must succeed.
pub async fn execute(pool: &MySqlPool, sql: String) {
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .unwrap();
}

/// The SQLSTATE of `sql`, a statement the test writes by hand, run on `executor` (whose account
/// it runs as); `None` when it succeeds.
pub async fn sqlstate_of<'e, E>(executor: E, sql: &str) -> Option<String>
where
    E: Executor<'e, Database = MySql>,
{
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(executor)
        .await
        .err()
        .map(|e| outbox_store_tests::sqlstate(&e))
}

pub struct MySqlHarness;

#[async_trait]
impl Harness for MySqlHarness {
    type Store = MySqlStore;

    async fn fresh(&self) -> Arc<MySqlStore> {
        Arc::new(fresh_store().await)
    }

    async fn enqueue(&self, store: &MySqlStore, events: &[NewEvent]) -> Vec<(EventId, bool)> {
        outbox_store_tests::enqueue_committed(&MySqlWriter, store, events).await
    }

    async fn backdate(&self, store: &MySqlStore, ids: &[EventId], by: Duration) {
        let ids: Vec<String> = ids.iter().map(EventId::to_string).collect();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET occurred_at = occurred_at - INTERVAL ? MICROSECOND,
                 enqueued_at = enqueued_at - INTERVAL ? MICROSECOND,
                 claimed_at = claimed_at - INTERVAL ? MICROSECOND,
                 delivered_at = delivered_at - INTERVAL ? MICROSECOND,
                 dead_at = dead_at - INTERVAL ? MICROSECOND
             WHERE JSON_CONTAINS(?, JSON_QUOTE(id))",
            store.outbox().quoted_table()
        )))
        .bind(by.as_micros() as i64)
        .bind(by.as_micros() as i64)
        .bind(by.as_micros() as i64)
        .bind(by.as_micros() as i64)
        .bind(by.as_micros() as i64)
        .bind(serde_json::to_string(&ids).unwrap())
        .execute(store.pool())
        .await
        .unwrap();
    }
}

/// The writer scenarios of `outbox-store-tests` against MySQL / MariaDB: transactions on the
/// store's pool, the business table `<outbox table>_orders` beside the outbox.
pub struct MySqlWriter;

impl Writer for MySqlWriter {
    type Store = MySqlStore;

    async fn fresh(&self) -> MySqlStore {
        fresh_store().await
    }

    async fn observer(&self, store: &MySqlStore) -> MySqlStore {
        store.clone()
    }

    async fn business_table(&self, store: &MySqlStore) -> String {
        let table = format!("`{}_orders`", store.outbox().table());
        store
            .pool()
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE {table} (id BIGINT PRIMARY KEY, amount BIGINT NOT NULL) ENGINE = InnoDB"
            )))
            .await
            .unwrap();
        table
    }

    fn outbox_table(&self, store: &MySqlStore) -> String {
        store.outbox().quoted_table().to_owned()
    }

    outbox_store_tests::sqlx_writer!(MySql);
}

impl KillableWriter for MySqlWriter {
    type Session = u64;

    async fn connect_writer(&self) -> (MySqlConnection, u64) {
        let mut writer = MySqlConnection::connect(&database_url()).await.unwrap();
        let connection_id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut writer)
            .await
            .unwrap();
        (writer, connection_id)
    }

    async fn begin_by_hand(&self, conn: &mut MySqlConnection) {
        conn.execute("START TRANSACTION").await.unwrap();
    }

    async fn commit_by_hand(&self, conn: &mut MySqlConnection) -> bool {
        conn.execute("COMMIT").await.is_ok()
    }

    async fn kill(&self, store: &MySqlStore, connection_id: u64) {
        sqlx::query(sqlx::AssertSqlSafe(format!("KILL {connection_id}")))
            .execute(store.pool())
            .await
            .unwrap();
    }
}
