//! Shared by the PostgreSQL integration tests: a connection to the test database and a fresh,
//! migrated outbox in its own schema for every test.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_postgresql::{Partitioning, PgOutbox, PgStore};
use outbox_store_tests::{Harness, KillableWriter, Writer};
use outbox_types::{EventId, NewEvent};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgConnection, PgPool, Postgres, Row};

/// `OUTBOX_TEST_DATABASE_URL`, or the machine's local PostgreSQL `test` database.
pub fn database_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A schema name no other test (or test process) uses.
pub fn unique_schema() -> String {
    outbox_testkit::unique("outbox_t")
}

pub async fn pool(max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .connect(&database_url())
        .await
        .expect("PostgreSQL must be running on 127.0.0.1:5432 (scripts/services.sh starts it)")
}

/// A fresh migrated outbox and a store over it.
pub async fn fresh_store() -> PgStore {
    let pool = pool(10).await;
    let outbox = PgOutbox::with_names(&unique_schema(), "events").unwrap();
    outbox.migrate(&pool).await.unwrap();
    PgStore::new(pool, outbox)
}

/// A fresh migrated outbox in the partitioned layout, with its current partitions created.
pub async fn fresh_partitioned_store(partitioning: Partitioning) -> PgStore {
    let pool = pool(10).await;
    let outbox = PgOutbox::partitioned(&unique_schema(), "events", partitioning).unwrap();
    outbox.migrate(&pool).await.unwrap();
    outbox
        .maintain_partitions(&pool, chrono::Utc::now())
        .await
        .unwrap();
    PgStore::new(pool, outbox)
}

/// Two tests of one scenario, an `async fn(PgStore)`: `$plain` runs it on a fresh outbox in the
/// plain layout, `$partitioned` on one in the partitioned layout (default partitioning, current
/// partitions created). What only one layout has, the scenario checks by
/// `store.outbox().partitioning()`.
#[allow(unused_macros)]
macro_rules! both_layouts {
    ($($scenario:ident: $plain:ident, $partitioned:ident;)+) => {$(
        #[tokio::test]
        async fn $plain() {
            $scenario($crate::common::fresh_store().await).await;
        }

        #[tokio::test]
        async fn $partitioned() {
            $scenario(
                $crate::common::fresh_partitioned_store(::outbox_postgresql::Partitioning::default())
                    .await,
            )
            .await;
        }
    )+};
}
#[allow(unused_imports)]
pub(crate) use both_layouts;

/// Enqueue `events` in one committed transaction, the way a writer would; `(id, created)` per
/// event.
pub async fn enqueue_committed(store: &PgStore, events: &[NewEvent]) -> Vec<(EventId, bool)> {
    outbox_store_tests::enqueue_committed(&PgWriter::default(), store, events).await
}

pub struct PgHarness;

/// The same contract against the partitioned layout.
pub struct PgPartitionedHarness;

#[async_trait]
impl Harness for PgPartitionedHarness {
    type Store = PgStore;

    async fn fresh(&self) -> Arc<PgStore> {
        Arc::new(fresh_partitioned_store(Partitioning::default()).await)
    }

    async fn enqueue(&self, store: &PgStore, events: &[NewEvent]) -> Vec<(EventId, bool)> {
        PgHarness.enqueue(store, events).await
    }

    async fn backdate(&self, store: &PgStore, ids: &[EventId], by: Duration) {
        // Moving enqueued_at moves the rows to the partition of their new time (or the default
        // one); the keys rows follow, as an enqueue at that time would have written them.
        PgHarness.backdate(store, ids, by).await;
        let update = format!(
            "UPDATE {} SET enqueued_at = enqueued_at - $2 * interval '1 millisecond'
             WHERE id = ANY($1)",
            store.outbox().keys_table()
        );
        move_back(store, update, ids, by).await;
    }
}

#[async_trait]
impl Harness for PgHarness {
    type Store = PgStore;

    async fn fresh(&self) -> Arc<PgStore> {
        Arc::new(fresh_store().await)
    }

    async fn enqueue(&self, store: &PgStore, events: &[NewEvent]) -> Vec<(EventId, bool)> {
        enqueue_committed(store, events).await
    }

    async fn backdate(&self, store: &PgStore, ids: &[EventId], by: Duration) {
        let update = format!(
            "UPDATE {} SET occurred_at = occurred_at - $2 * interval '1 millisecond',
                 enqueued_at = enqueued_at - $2 * interval '1 millisecond',
                 claimed_at = claimed_at - $2 * interval '1 millisecond',
                 delivered_at = delivered_at - $2 * interval '1 millisecond',
                 dead_at = dead_at - $2 * interval '1 millisecond'
             WHERE id = ANY($1)",
            store.outbox().qualified_table()
        );
        move_back(store, update, ids, by).await;
    }
}

/// Run `update`, whose `$1` is the events' ids and `$2` a number of milliseconds, for `ids`
/// moved back `by`.
async fn move_back(store: &PgStore, update: String, ids: &[EventId], by: Duration) {
    let ids: Vec<uuid::Uuid> = ids.iter().map(|id| *id.as_uuid()).collect();
    sqlx::query(sqlx::AssertSqlSafe(update))
        .bind(&ids)
        .bind(by.as_millis() as i64)
        .execute(store.pool())
        .await
        .unwrap();
}

/// The writer scenarios of `outbox-store-tests` against PostgreSQL: transactions on the store's
/// pool, the business table `orders` in the outbox's schema. `partitioned` picks the layout.
#[derive(Clone, Copy, Default)]
pub struct PgWriter {
    pub partitioned: bool,
}

impl PgWriter {
    /// Both layouts, for a scenario that runs over each.
    pub fn both() -> [PgWriter; 2] {
        [
            PgWriter { partitioned: false },
            PgWriter { partitioned: true },
        ]
    }
}

impl Writer for PgWriter {
    type Store = PgStore;

    async fn fresh(&self) -> PgStore {
        if self.partitioned {
            fresh_partitioned_store(Partitioning::default()).await
        } else {
            fresh_store().await
        }
    }

    async fn observer(&self, store: &PgStore) -> PgStore {
        store.clone()
    }

    async fn business_table(&self, store: &PgStore) -> String {
        let table = format!("\"{}\".orders", store.outbox().schema());
        store
            .pool()
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE {table} (id BIGINT PRIMARY KEY, amount BIGINT NOT NULL)"
            )))
            .await
            .unwrap();
        table
    }

    fn outbox_table(&self, store: &PgStore) -> String {
        store.outbox().qualified_table().to_owned()
    }

    outbox_store_tests::sqlx_writer!(Postgres);
}

impl KillableWriter for PgWriter {
    type Session = i32;

    async fn connect_writer(&self) -> (PgConnection, i32) {
        let mut writer = PgConnection::connect(&database_url()).await.unwrap();
        let pid: i32 = writer
            .fetch_one("SELECT pg_backend_pid()")
            .await
            .unwrap()
            .get(0);
        (writer, pid)
    }

    async fn begin_by_hand(&self, conn: &mut PgConnection) {
        conn.execute("BEGIN").await.unwrap();
    }

    async fn commit_by_hand(&self, conn: &mut PgConnection) -> bool {
        conn.execute("COMMIT").await.is_ok()
    }

    async fn kill(&self, store: &PgStore, pid: i32) {
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert!(killed);
    }
}

/// How many rows the partitioned layout's keys table holds: one per event still stored.
pub async fn keys_rows(store: &PgStore) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        store.outbox().keys_table()
    )))
    .fetch_one(store.pool())
    .await
    .unwrap()
}
