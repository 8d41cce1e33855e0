//! Shared by the SQLite integration tests: a fresh database file in its own temporary directory
//! for every test, removed when the test's store is dropped.

#![allow(dead_code)]

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_sqlite::{SqliteOutbox, SqliteStore};
use outbox_store_tests::{Harness, Writer};
use outbox_types::{EventId, NewEvent};
use sqlx::Sqlite;
use tempfile::TempDir;

/// A store over a file in a temporary directory that lives exactly as long as the store.
pub struct TempStore {
    pub store: SqliteStore,
    pub path: PathBuf,
    // Dropped last (by the last store on the file): the pool's connections may still be
    // closing, which Unix allows.
    _dir: Arc<TempDir>,
}

impl Deref for TempStore {
    type Target = SqliteStore;
    fn deref(&self) -> &SqliteStore {
        &self.store
    }
}

impl TempStore {
    /// A new empty directory and the path of a database file in it (not created yet).
    pub fn dir() -> (TempDir, PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("outbox-sqlite-test-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("outbox.db");
        (dir, path)
    }

    /// A fresh file with the default outbox, migrated.
    pub async fn new() -> Self {
        Self::with_outbox(SqliteOutbox::new()).await
    }

    /// A fresh file with `outbox`, migrated.
    pub async fn with_outbox(outbox: SqliteOutbox) -> Self {
        let (dir, path) = Self::dir();
        let store = open(&path, outbox.clone()).await;
        outbox.migrate(store.pool()).await.unwrap();
        TempStore {
            store,
            path,
            _dir: Arc::new(dir),
        }
    }

    /// Another store (another pool: what a second process would have) on the same file.
    pub async fn reopen(&self) -> SqliteStore {
        open(&self.path, self.store.outbox().clone()).await
    }
}

pub async fn open(path: &Path, outbox: SqliteOutbox) -> SqliteStore {
    SqliteStore::connect(path.to_str().unwrap(), outbox)
        .await
        .unwrap()
}

outbox_types::forward_store!(TempStore => store);

/// This test binary run again as a child process for the ignored test `test` alone, with the
/// environment variable `env` set to the database file at `path` and stdout piped (the child
/// reports through it). Killed when dropped.
pub fn spawn_child(test: &str, env: &str, path: &Path) -> tokio::process::Child {
    tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(env, path)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Enqueue `events` in one committed transaction, the way a writer would.
pub async fn enqueue_committed(store: &SqliteStore, events: &[NewEvent]) -> Vec<(EventId, bool)> {
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let done = store
        .outbox()
        .enqueue_batch(&mut *tx, events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    done.into_iter().map(|e| (e.id, e.created)).collect()
}

pub struct SqliteHarness;

#[async_trait]
impl Harness for SqliteHarness {
    type Store = TempStore;

    async fn fresh(&self) -> Arc<TempStore> {
        Arc::new(TempStore::new().await)
    }

    async fn enqueue(&self, store: &TempStore, events: &[NewEvent]) -> Vec<(EventId, bool)> {
        enqueue_committed(store, events).await
    }

    async fn backdate(&self, store: &TempStore, ids: &[EventId], by: Duration) {
        let ids: Vec<String> = ids.iter().map(EventId::to_string).collect();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET occurred_at = occurred_at - ?2, enqueued_at = enqueued_at - ?2,
                 claimed_at = claimed_at - ?2, delivered_at = delivered_at - ?2,
                 dead_at = dead_at - ?2
             WHERE id IN (SELECT value FROM json_each(?1))",
            store.outbox().quoted_table()
        )))
        .bind(serde_json::to_string(&ids).unwrap())
        .bind(by.as_micros() as i64)
        .execute(store.pool())
        .await
        .unwrap();
    }

    fn defers(&self) -> bool {
        false
    }
}

/// The writer scenarios of `outbox-store-tests` against a SQLite file: `BEGIN IMMEDIATE`
/// transactions on the store's pool, the business table `orders` in the same file, and the
/// other connection another pool on the file (what a second process would have).
pub struct SqliteWriter;

impl Writer for SqliteWriter {
    type Store = TempStore;

    async fn fresh(&self) -> TempStore {
        TempStore::new().await
    }

    async fn observer(&self, store: &TempStore) -> TempStore {
        TempStore {
            store: store.reopen().await,
            path: store.path.clone(),
            _dir: store._dir.clone(),
        }
    }

    async fn business_table(&self, store: &TempStore) -> String {
        sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)")
            .execute(store.pool())
            .await
            .unwrap();
        "orders".to_owned()
    }

    fn outbox_table(&self, store: &TempStore) -> String {
        store.outbox().quoted_table().to_owned()
    }

    outbox_store_tests::sqlx_writer!(Sqlite, begin = "BEGIN IMMEDIATE");
}
