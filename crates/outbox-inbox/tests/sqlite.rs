//! The SQLite inbox on a fresh database file per test (WAL, several connections). The contract
//! every database shares is in `conformance/`; here: its backend and the claim statement.

#![cfg(feature = "sqlite")]

mod conformance;

use outbox_testkit::unique;
use std::time::Duration;

use conformance::{Backend, Fixture, setup};
use outbox_inbox::sqlite::{SqliteHandler, SqliteInbox};
use outbox_inbox::{BoxFuture, EventId, InboxHandler};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{SqliteConnection, SqlitePool};

struct Lite;

impl Backend for Lite {
    type Inbox = SqliteInbox;
    const SCHEMA_VERSION: i64 = 1;

    async fn open() -> (SqlitePool, SqliteInbox, String) {
        let dir = tempfile::tempdir().unwrap().keep();
        let options = SqliteConnectOptions::new()
            .filename(dir.join("inbox.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(12)
            .connect_with(options)
            .await
            .unwrap();
        let table = unique("inbox_t");
        let inbox = SqliteInbox::with_table(&table).unwrap();
        let effects = format!("\"{table}_effects\"");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {effects} (event_id TEXT NOT NULL, handler TEXT NOT NULL)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        (pool, inbox, effects)
    }

    fn insert_effect<'c>(
        conn: &'c mut SqliteConnection,
        effects: &'c str,
        id: EventId,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {effects} (event_id, handler) VALUES (?1, 'billing')"
            )))
            .bind(id.to_string())
            .execute(conn)
            .await?;
            Ok(())
        })
    }

    async fn effect_count(fx: &Fixture<Self>) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {}",
            fx.effects
        )))
        .fetch_one(&fx.pool)
        .await
        .unwrap()
    }

    /// SQLite's times are the host's microseconds: moved back from the row's own.
    async fn backdate(fx: &Fixture<Self>, id: EventId, hours: u32) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET processed_at = processed_at - {hours} * 3600 * 1000000 WHERE event_id = ?1",
            fx.inbox.qualified_table()
        )))
        .bind(id.to_string())
        .execute(&fx.pool)
        .await
        .unwrap();
    }

    async fn edit_first_migration(fx: &Fixture<Self>) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE \"{}_migrations\" SET checksum = 'edited' WHERE version = 1",
            fx.inbox.table()
        )))
        .execute(&fx.pool)
        .await
        .unwrap();
    }

    fn handler(fx: &Fixture<Self>) -> impl InboxHandler {
        let effects = fx.effects.clone();
        SqliteHandler::new(
            fx.pool.clone(),
            fx.inbox.clone(),
            "billing",
            move |tx, d| {
                let effects = effects.clone();
                Box::pin(async move {
                    Lite::insert_effect(&mut **tx, &effects, d.event_id).await?;
                    Ok(())
                })
            },
        )
        .unwrap()
    }

    fn refuses_bad_table_name() -> bool {
        SqliteInbox::with_table("Bad-Name").is_err()
    }
}

conformance::conformance_tests!(Lite);

/// The documented claim statement, run as a consumer in another language runs it: one row
/// changed once; none for a committed duplicate; one again after a rollback.
#[tokio::test]
async fn the_claim_statement_is_plain_sql_any_consumer_can_run() {
    let Fixture { pool, inbox, .. } = setup::<Lite>().await;
    let sql = inbox.claim_statement().to_owned();
    let id = EventId::new();
    let claim = async |tx: &mut sqlx::SqliteConnection| -> u64 {
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .bind(id.to_string())
            .bind("billing")
            .execute(tx)
            .await
            .unwrap()
            .rows_affected()
    };
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(claim(&mut tx).await, 1);
    tx.rollback().await.unwrap();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(
        claim(&mut tx).await,
        1,
        "a rolled-back claim must not count"
    );
    tx.commit().await.unwrap();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(claim(&mut tx).await, 0);
    tx.commit().await.unwrap();
    assert!(inbox.contains(&pool, id, "billing").await.unwrap());
    // processed_at is SQLite's clock in microseconds: within a minute of the host's.
    let at: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT processed_at FROM {}",
        inbox.qualified_table()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    let now = chrono::Utc::now().timestamp_micros();
    assert!(
        (now - at).abs() < 60_000_000,
        "processed_at {at}, now {now}"
    );
}
