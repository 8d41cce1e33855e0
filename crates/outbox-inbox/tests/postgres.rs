//! The PostgreSQL inbox against the machine's PostgreSQL (`OUTBOX_TEST_DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`); every test uses its own schema. The contract
//! every database shares is in `conformance/`; here: its backend and the claim function.

#![cfg(feature = "postgres")]

mod conformance;

use outbox_testkit::unique;
use std::time::Duration;

use conformance::{Backend, Fixture, setup};
use outbox_inbox::postgres::{PgHandler, PgInbox};
use outbox_inbox::{BoxFuture, EventId, InboxHandler};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};

struct Pg;

impl Backend for Pg {
    type Inbox = PgInbox;
    const SCHEMA_VERSION: i64 = 2;

    async fn open() -> (PgPool, PgInbox, String) {
        let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .connect(&url)
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432");
        let schema = unique("inbox_t");
        let inbox = PgInbox::with_names(&schema, "inbox").unwrap();
        // The effects table lives in the inbox's schema (migrate then finds the schema there).
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS \"{schema}\"; \
             CREATE TABLE \"{schema}\".effects (event_id UUID NOT NULL, handler TEXT NOT NULL)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        (pool, inbox, format!("\"{schema}\".effects"))
    }

    fn insert_effect<'c>(
        conn: &'c mut PgConnection,
        effects: &'c str,
        id: EventId,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {effects} (event_id, handler) VALUES ($1, 'billing')"
            )))
            .bind(id.as_uuid())
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

    async fn backdate(fx: &Fixture<Self>, id: EventId, hours: u32) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET processed_at = now() - interval '{hours} hours' WHERE event_id = $1",
            fx.inbox.qualified_table()
        )))
        .bind(id.as_uuid())
        .execute(&fx.pool)
        .await
        .unwrap();
    }

    async fn edit_first_migration(fx: &Fixture<Self>) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE \"{}\".\"{}_migrations\" SET checksum = 'edited' WHERE version = 1",
            fx.inbox.schema(),
            fx.inbox.table()
        )))
        .execute(&fx.pool)
        .await
        .unwrap();
    }

    fn handler(fx: &Fixture<Self>) -> impl InboxHandler {
        let effects = fx.effects.clone();
        PgHandler::new(
            fx.pool.clone(),
            fx.inbox.clone(),
            "billing",
            move |tx, d| {
                let effects = effects.clone();
                Box::pin(async move {
                    Pg::insert_effect(&mut **tx, &effects, d.event_id).await?;
                    Ok(())
                })
            },
        )
        .unwrap()
    }

    fn refuses_bad_table_name() -> bool {
        PgInbox::with_names("ok", "Bad-Name").is_err()
    }
}

conformance::conformance_tests!(Pg);

/// An inbox created before the claim function (schema version 1) gets it from the next
/// migrate; until then the Rust claim says what to run.
#[tokio::test]
async fn a_version_1_inbox_is_upgraded_and_says_so_until_then() {
    let fx = setup::<Pg>().await;
    let downgrade = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP FUNCTION {}(UUID, TEXT); DELETE FROM \"{}\".\"{}_migrations\" WHERE version = 2",
        fx.inbox.claim_function(),
        fx.inbox.schema(),
        fx.inbox.table()
    )))
    .execute(&fx.pool);
    conformance::a_version_1_inbox_is_upgraded_and_says_so_until_then(&fx, async {
        downgrade.await.unwrap();
    })
    .await;
}

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
