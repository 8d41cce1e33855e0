//! Shared by the broker adapter tests: a fresh SQLite inbox and handlers that count effects
//! (and the SQLite pool, by the SQLite inbox tests).

#![allow(dead_code)]

pub use outbox_testkit::unique;
use std::time::{Duration, Instant};

use outbox_inbox::sqlite::{SqliteHandler, SqliteInbox};
use outbox_inbox::{BoxFuture, EventId};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

pub struct Fixture {
    pub pool: SqlitePool,
    pub inbox: SqliteInbox,
}

/// A pool on a new database file (WAL, 10 s busy timeout).
pub async fn sqlite_pool(max_connections: u32) -> SqlitePool {
    let dir = tempfile::tempdir().unwrap().keep();
    let options = SqliteConnectOptions::new()
        .filename(dir.join("inbox.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    SqlitePoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .unwrap()
}

pub async fn fixture() -> Fixture {
    let pool = sqlite_pool(4).await;
    let inbox = SqliteInbox::with_table("inbox").unwrap();
    inbox.migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE effects (event_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    Fixture { pool, inbox }
}

type Effect = for<'c> fn(
    &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>>;

/// The effect every handler here applies: a row in `effects`.
async fn insert_effect(
    tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &outbox_inbox::Delivery,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (event_id) VALUES (?1)")
        .bind(d.event_id.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn record<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    Box::pin(async move { Ok(insert_effect(tx, d).await?) })
}

fn record_then_fail<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    Box::pin(async move {
        insert_effect(tx, d).await?;
        Err("downstream rejected the event".into())
    })
}

/// Fails on the first delivery, succeeds on later ones.
fn fail_first<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    Box::pin(async move {
        insert_effect(tx, d).await?;
        if d.attempt == 1 {
            return Err("first delivery fails".into());
        }
        Ok(())
    })
}

/// Needs a JSON payload: anything else is a non-transient `BadMessage`.
fn needs_json<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    Box::pin(async move {
        let _: serde_json::Value = d.json()?;
        Ok(insert_effect(tx, d).await?)
    })
}

impl Fixture {
    /// The handler `billing` running `effect`.
    fn handler_with(&self, effect: Effect) -> SqliteHandler<Effect> {
        SqliteHandler::new(self.pool.clone(), self.inbox.clone(), "billing", effect).unwrap()
    }

    /// A handler whose effect fails on the first delivery only.
    pub fn flaky_handler(&self) -> SqliteHandler<Effect> {
        self.handler_with(fail_first)
    }

    /// A handler whose effect parses the payload as JSON.
    pub fn json_handler(&self) -> SqliteHandler<Effect> {
        self.handler_with(needs_json)
    }

    /// A handler whose effect inserts into `effects`.
    pub fn handler(&self) -> SqliteHandler<Effect> {
        self.handler_with(record)
    }

    /// A handler whose effect writes and then always fails.
    pub fn failing_handler(&self) -> SqliteHandler<Effect> {
        self.handler_with(record_then_fail)
    }

    pub async fn effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn parked(&self) -> Vec<outbox_inbox::ParkedMessage> {
        self.inbox.parked(&self.pool, "billing", 100).await.unwrap()
    }

    /// Wait up to `timeout` for a parked message.
    pub async fn wait_parked(&self, timeout: Duration) -> bool {
        eventually(timeout, || async { !self.parked().await.is_empty() }).await
    }

    /// What the always-failing handler leaves behind after `attempts` deliveries of event `id`
    /// with body `payload`: one parked message saying why, and no effect (each was rolled back).
    pub async fn assert_parked_after_failures(&self, id: EventId, attempts: u32, payload: &[u8]) {
        let parked = self.parked().await;
        assert_eq!(parked.len(), 1);
        assert_eq!(parked[0].event_id, Some(id));
        assert_eq!(parked[0].attempts, attempts);
        assert!(parked[0].error.contains("downstream rejected"));
        assert_eq!(parked[0].payload, payload);
        assert_eq!(self.effects().await, 0, "failed effects were rolled back");
    }
}

/// Poll `check` until it is true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < timeout {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}
