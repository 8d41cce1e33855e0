//! The MySQL/MariaDB inbox against the machine's server (`OUTBOX_TEST_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`); every test uses its own tables. The contract every
//! database shares is in `conformance/`; here: its backend and the claim procedure.

#![cfg(feature = "mysql")]

mod conformance;

use outbox_testkit::unique;
use std::time::Duration;

use conformance::{Backend, Fixture, run_sql, setup};
use outbox_inbox::EventId;
use outbox_inbox::mysql::MySqlInbox;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySqlConnection, MySqlPool};

struct My;

impl Backend for My {
    type Inbox = MySqlInbox;
    const EFFECTS_DEFINITION: &'static str =
        "(event_id CHAR(36) NOT NULL, handler VARCHAR(50) NOT NULL) ENGINE = InnoDB";
    const SCHEMA_VERSION: i64 = 2;
    const COUNT: &'static str = "CAST(count(*) AS SIGNED)";

    async fn open() -> (MySqlPool, MySqlInbox) {
        let url = std::env::var("OUTBOX_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let pool = MySqlPoolOptions::new()
            .max_connections(12)
            .connect(&url)
            .await
            .expect("MySQL/MariaDB must be running on 127.0.0.1:3306");
        let inbox = MySqlInbox::with_table(&unique("inbox_t")).unwrap();
        (pool, inbox)
    }

    fn effects_table(inbox: &MySqlInbox) -> String {
        format!("`{}_effects`", inbox.table())
    }

    run_sql!(MySqlConnection);

    fn backdate(inbox: &MySqlInbox, id: EventId, hours: u32) -> String {
        format!(
            "UPDATE {} SET processed_at = NOW(6) - INTERVAL {hours} HOUR WHERE event_id = '{id}'",
            inbox.qualified_table()
        )
    }

    fn migrations_table(inbox: &MySqlInbox) -> String {
        format!("`{}_migrations`", inbox.table())
    }

    fn refuses_bad_table_name() -> bool {
        MySqlInbox::with_table("Bad-Name").is_err()
    }

    fn downgrade_to_version_1(inbox: &MySqlInbox) -> String {
        format!(
            "DROP PROCEDURE {}; DELETE FROM {} WHERE version = 2",
            inbox.claim_procedure(),
            Self::migrations_table(inbox)
        )
    }
}

conformance::conformance_tests!(My);
conformance::conformance_tests!(@tests My; a_version_1_inbox_is_upgraded_and_says_so_until_then);

/// The claim procedure as a consumer in another language calls it: plain SQL in its own
/// transaction, one row `fresh` back. 1 once; 0 for a committed duplicate; 1 again after a
/// rollback (the rolled-back claim left nothing behind). Upper-case ids are the same event.
#[tokio::test]
async fn the_claim_procedure_is_plain_sql_any_consumer_can_call() {
    let Fixture { pool, inbox, .. } = setup::<My>().await;
    let sql = format!("CALL {}(?, ?)", inbox.claim_procedure());
    let id = EventId::new();
    let claim = async |tx: &mut sqlx::MySqlConnection, id: String| -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
            .bind(id)
            .bind("billing")
            .fetch_one(tx)
            .await
            .unwrap()
    };
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(claim(&mut tx, id.to_string()).await, 1);
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        claim(&mut tx, id.to_string()).await,
        1,
        "a rolled-back claim must not count"
    );
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(claim(&mut tx, id.to_string().to_uppercase()).await, 0);
    tx.commit().await.unwrap();
    assert!(inbox.contains(&pool, id, "billing").await.unwrap());
}

/// Two consumers racing on one event through the procedure: the second call blocks until the
/// first transaction ends, then answers 0 (it committed).
#[tokio::test]
async fn a_racing_claim_procedure_call_waits_for_the_first_transaction() {
    let Fixture { pool, inbox, .. } = setup::<My>().await;
    let sql = format!("CALL {}(?, 'billing')", inbox.claim_procedure());
    let id = EventId::new().to_string();
    let mut first = pool.begin().await.unwrap();
    let fresh: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
        .bind(&id)
        .fetch_one(&mut *first)
        .await
        .unwrap();
    assert_eq!(fresh, 1);
    let second = {
        let (pool, sql, id) = (pool.clone(), sql.clone(), id.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let fresh: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
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
    assert_eq!(second.await.unwrap(), 0);
}

#[tokio::test]
async fn the_claim_procedure_refuses_a_bad_event_id_and_a_bad_handler() {
    let Fixture { pool, inbox, .. } = setup::<My>().await;
    let sql = format!("CALL {}(?, ?)", inbox.claim_procedure());
    for (id, handler, says) in [
        (None, "billing".to_owned(), "event_id must be the UUID"),
        (
            Some("not-a-uuid".to_owned()),
            "billing".to_owned(),
            "event_id must be the UUID",
        ),
        (
            Some(EventId::new().to_string()),
            String::new(),
            "1 to 191 characters",
        ),
        (
            Some(EventId::new().to_string()),
            "x".repeat(192),
            "1 to 191 characters",
        ),
    ] {
        let err = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .bind(id)
            .bind(handler)
            .execute(&pool)
            .await
            .unwrap_err();
        let db = err.as_database_error().unwrap();
        assert_eq!(db.code().as_deref(), Some("22023"), "{err}");
        assert!(db.message().contains(says), "{err}");
    }
}
