//! The SQLite inbox on a fresh database file per test (WAL, several connections). The contract
//! every database shares is in `conformance/`; here: its backend and how the claim statement is
//! run.

#![cfg(feature = "sqlite")]

mod common;
mod conformance;

use conformance::{Backend, ClaimRoutine, Fixture, run_sql, table_names};
use outbox_inbox::BoxFuture;
use outbox_inbox::sqlite::SqliteInbox;
use sqlx::{SqliteConnection, SqlitePool};

struct Lite;

impl Backend for Lite {
    type Inbox = SqliteInbox;
    const EFFECTS_DEFINITION: &'static str = "(event_id TEXT NOT NULL, handler TEXT NOT NULL)";
    const SCHEMA_VERSION: i64 = 1;

    async fn pool() -> SqlitePool {
        common::sqlite_pool(12).await
    }

    table_names!(SqliteInbox, "\"");

    run_sql!(SqliteConnection);

    /// SQLite's times are the host's microseconds: moved back from the row's own.
    fn hours_ago(hours: u32) -> String {
        format!("processed_at - {hours} * 3600 * 1000000")
    }
}

conformance::conformance_tests!(Lite);

impl ClaimRoutine for Lite {
    fn claim_sql(inbox: &SqliteInbox) -> String {
        inbox.claim_statement().to_owned()
    }

    /// One row changed, or none.
    fn call_claim(
        conn: &mut SqliteConnection,
        sql: String,
        id: Option<String>,
        handler: String,
    ) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(handler)
                .execute(conn)
                .await?;
            Ok(conformance::fresh(
                i64::try_from(done.rows_affected()).unwrap(),
            ))
        })
    }
}

/// The documented claim statement, run as a consumer in another language runs it (in a
/// `BEGIN IMMEDIATE` transaction, as the inbox's own): see the shared scenario; and
/// `processed_at` is SQLite's clock in microseconds, within a minute of the host's.
#[tokio::test]
async fn the_claim_statement_is_plain_sql_any_consumer_can_run() {
    let Fixture { pool, inbox, .. } =
        conformance::the_claim_routine_is_plain_sql_any_consumer_can_call::<Lite>().await;
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
