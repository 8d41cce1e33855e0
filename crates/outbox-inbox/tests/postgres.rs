//! The PostgreSQL inbox against the machine's PostgreSQL (`OUTBOX_TEST_DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`); every test uses its own schema. The contract
//! every database shares is in `conformance/`; here: its backend and the claim function.

#![cfg(feature = "postgres")]

mod conformance;

use outbox_testkit::unique;
use std::time::Duration;

use conformance::{Backend, Fixture, run_sql, setup};
use outbox_inbox::EventId;
use outbox_inbox::postgres::PgInbox;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};

struct Pg;

impl Backend for Pg {
    type Inbox = PgInbox;
    const EFFECTS_DEFINITION: &'static str = "(event_id UUID NOT NULL, handler TEXT NOT NULL)";
    const SCHEMA_VERSION: i64 = 2;

    async fn open() -> (PgPool, PgInbox) {
        let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .connect(&url)
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432");
        let inbox = PgInbox::with_names(&unique("inbox_t"), "inbox").unwrap();
        (pool, inbox)
    }

    fn effects_table(inbox: &PgInbox) -> String {
        format!("\"{}\".effects", inbox.schema())
    }

    run_sql!(PgConnection);

    fn backdate(inbox: &PgInbox, id: EventId, hours: u32) -> String {
        format!(
            "UPDATE {} SET processed_at = now() - interval '{hours} hours' WHERE event_id = '{id}'",
            inbox.qualified_table()
        )
    }

    fn migrations_table(inbox: &PgInbox) -> String {
        format!("\"{}\".\"{}_migrations\"", inbox.schema(), inbox.table())
    }

    fn refuses_bad_table_name() -> bool {
        PgInbox::with_names("ok", "Bad-Name").is_err()
    }

    fn downgrade_to_version_1(inbox: &PgInbox) -> String {
        format!(
            "DROP FUNCTION {}(UUID, TEXT); DELETE FROM {} WHERE version = 2",
            inbox.claim_function(),
            Self::migrations_table(inbox)
        )
    }
}

conformance::conformance_tests!(Pg);
conformance::conformance_tests!(@tests Pg; a_version_1_inbox_is_upgraded_and_says_so_until_then);

/// The claim function as a consumer in another language calls it: plain SQL in its own
/// transaction. True once; false for a committed duplicate; true again after a rollback (the
/// rolled-back claim left nothing behind).
#[tokio::test]
async fn the_claim_function_is_plain_sql_any_consumer_can_call() {
    let Fixture { pool, inbox, .. } = setup::<Pg>().await;
    let sql = format!("SELECT {}($1, $2)", inbox.claim_function());
    let id = uuid::Uuid::now_v7();
    let claim = async |tx: &mut sqlx::PgConnection| -> bool {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
            .bind(id)
            .bind("billing")
            .fetch_one(tx)
            .await
            .unwrap()
    };
    let mut tx = pool.begin().await.unwrap();
    assert!(claim(&mut tx).await);
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert!(claim(&mut tx).await, "a rolled-back claim must not count");
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert!(
        !claim(&mut tx).await,
        "a committed claim makes the next one a duplicate"
    );
    tx.commit().await.unwrap();
    // The Rust claim sees the same row.
    assert!(
        inbox
            .contains(&pool, EventId::from_uuid(id), "billing")
            .await
            .unwrap()
    );
}

/// Two consumers in other languages racing on one event: the second call blocks until the
/// first transaction ends, then answers false (it committed).
#[tokio::test]
async fn a_racing_claim_function_call_waits_for_the_first_transaction() {
    let Fixture { pool, inbox, .. } = setup::<Pg>().await;
    let sql = format!("SELECT {}($1, 'billing')", inbox.claim_function());
    let id = uuid::Uuid::now_v7();
    let mut first = pool.begin().await.unwrap();
    let fresh: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
        .bind(id)
        .fetch_one(&mut *first)
        .await
        .unwrap();
    assert!(fresh);
    let second = {
        let (pool, sql) = (pool.clone(), sql.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let fresh: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            fresh
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "the racing call must wait");
    first.commit().await.unwrap();
    assert!(!second.await.unwrap());
}

#[tokio::test]
async fn the_claim_function_refuses_a_null_event_id_and_a_bad_handler() {
    let Fixture { pool, inbox, .. } = setup::<Pg>().await;
    let f = inbox.claim_function();
    let err = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {f}(NULL, 'billing')")))
        .execute(&pool)
        .await
        .unwrap_err();
    let db = err.as_database_error().unwrap();
    assert_eq!(db.code().as_deref(), Some("22004"), "{err}");
    assert!(db.message().contains("event_id is null"), "{err}");
    for handler in [String::new(), "x".repeat(192)] {
        let err = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {f}(gen_random_uuid(), $1)"
        )))
        .bind(&handler)
        .execute(&pool)
        .await
        .unwrap_err();
        let db = err.as_database_error().unwrap();
        assert_eq!(db.code().as_deref(), Some("22023"), "{err}");
        assert!(db.message().contains("1 to 191 characters"), "{err}");
    }
}
