//! The SQLite inbox on a fresh database file per test (WAL, several connections). The contract
//! every database shares is in `conformance/`; here: its backend and the claim statement.

#![cfg(feature = "sqlite")]

mod common;
mod conformance;

use common::unique;

use conformance::{Backend, Fixture, run_sql, setup};
use outbox_inbox::EventId;
use outbox_inbox::sqlite::SqliteInbox;
use sqlx::{SqliteConnection, SqlitePool};

struct Lite;

impl Backend for Lite {
    type Inbox = SqliteInbox;
    const EFFECTS_DEFINITION: &'static str = "(event_id TEXT NOT NULL, handler TEXT NOT NULL)";
    const SCHEMA_VERSION: i64 = 1;

    async fn open() -> (SqlitePool, SqliteInbox) {
        let pool = common::sqlite_pool(12).await;
        let inbox = SqliteInbox::with_table(&unique("inbox_t")).unwrap();
        (pool, inbox)
    }

    fn effects_table(inbox: &SqliteInbox) -> String {
        format!("\"{}_effects\"", inbox.table())
    }

    run_sql!(SqliteConnection);

    /// SQLite's times are the host's microseconds: moved back from the row's own.
    fn backdate(inbox: &SqliteInbox, id: EventId, hours: u32) -> String {
        format!(
            "UPDATE {} SET processed_at = processed_at - {hours} * 3600 * 1000000 WHERE event_id = '{id}'",
            inbox.qualified_table()
        )
    }

    fn migrations_table(inbox: &SqliteInbox) -> String {
        format!("\"{}_migrations\"", inbox.table())
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
