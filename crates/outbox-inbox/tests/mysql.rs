//! The MySQL/MariaDB inbox against the machine's server (`OUTBOX_TEST_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`); every test uses its own tables. The contract every
//! database shares is in `conformance/`; here: its backend and how the claim procedure is called.

#![cfg(feature = "mysql")]

mod conformance;

use conformance::{Backend, ClaimRoutine, RefusedCall, run_sql, table_names};
use outbox_inbox::mysql::MySqlInbox;
use outbox_inbox::{BoxFuture, EventId};
use sqlx::{MySqlConnection, MySqlPool};

struct My;

impl Backend for My {
    type Inbox = MySqlInbox;
    const EFFECTS_DEFINITION: &'static str =
        "(event_id CHAR(36) NOT NULL, handler VARCHAR(50) NOT NULL) ENGINE = InnoDB";
    const SCHEMA_VERSION: i64 = 3;
    const COUNT: &'static str = "CAST(count(*) AS SIGNED)";

    async fn pool() -> MySqlPool {
        conformance::connect(
            "OUTBOX_TEST_MYSQL_URL",
            "mysql://root@127.0.0.1:3306/test",
            "MySQL/MariaDB must be running on 127.0.0.1:3306",
        )
        .await
    }

    table_names!(MySqlInbox, "`");

    run_sql!(MySqlConnection);

    fn hours_ago(hours: u32) -> String {
        format!("NOW(6) - INTERVAL {hours} HOUR")
    }

    fn drop_claim_routine(inbox: &MySqlInbox) -> String {
        format!("DROP PROCEDURE {}", inbox.claim_procedure())
    }
}

conformance::conformance_tests!(My; a_version_1_inbox_is_upgraded_and_says_so_until_then);

impl ClaimRoutine for My {
    fn claim_sql(inbox: &MySqlInbox) -> String {
        format!("CALL {}(?, ?)", inbox.claim_procedure())
    }

    /// One row `fresh` back, 1 or 0.
    fn call_claim(
        conn: &mut MySqlConnection,
        sql: String,
        id: Option<String>,
        handler: String,
    ) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let fresh = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(handler)
                .fetch_one(conn)
                .await?;
            Ok(conformance::fresh(fresh))
        })
    }

    /// Upper-case ids are the same event.
    fn respell(id: EventId) -> String {
        id.to_string().to_uppercase()
    }

    /// A null and a malformed event id, an empty and a too-long handler: all 22023.
    fn refused_calls() -> Vec<RefusedCall> {
        let id = || Some(EventId::new().to_string());
        let (uuid, handler) = ("event_id must be the UUID", "1 to 191 characters");
        vec![
            (None, "billing".to_owned(), "22023", uuid),
            (
                Some("not-a-uuid".to_owned()),
                "billing".to_owned(),
                "22023",
                uuid,
            ),
            (id(), String::new(), "22023", handler),
            (id(), "x".repeat(192), "22023", handler),
        ]
    }
}

conformance::conformance_tests!(@as My;
    the_claim_procedure_is_plain_sql_any_consumer_can_call =
        the_claim_routine_is_plain_sql_any_consumer_can_call,
    a_racing_claim_procedure_call_waits_for_the_first_transaction =
        a_racing_claim_routine_call_waits_for_the_first_transaction,
    the_claim_procedure_refuses_a_bad_event_id_and_a_bad_handler =
        the_claim_routine_refuses_bad_arguments,
);

impl conformance::SharedInbox for My {
    /// A user with `INSERT` on the inbox and `EXECUTE` on the claim procedure.
    async fn consumer(inbox: &MySqlInbox, name: &str) -> MySqlPool {
        let admin = My::pool().await;
        for grant in [
            format!("CREATE USER '{name}'@'%' IDENTIFIED BY 'consumer-pw'"),
            format!(
                "GRANT INSERT ON {} TO '{name}'@'%'",
                inbox.qualified_table()
            ),
            format!(
                "GRANT EXECUTE ON PROCEDURE {} TO '{name}'@'%'",
                inbox.claim_procedure()
            ),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(grant))
                .execute(&admin)
                .await
                .unwrap();
        }
        let url = std::env::var("OUTBOX_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
            .replacen("root@", &format!("{name}:consumer-pw@"), 1);
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap()
    }

    fn drop_consumer(name: &str) -> String {
        format!("DROP USER '{name}'@'%'")
    }

    fn downgrade_to_version_2(inbox: &MySqlInbox) -> String {
        format!(
            "DROP TRIGGER {claimed_by};
             ALTER TABLE {t} DROP PRIMARY KEY, DROP COLUMN claimed_by, ADD PRIMARY KEY (event_id, handler);
             DELETE FROM {m} WHERE version = 3",
            claimed_by = My::beside(inbox, "_claimed_by"),
            t = inbox.qualified_table(),
            m = My::migrations_table(inbox)
        )
    }
}

conformance::conformance_tests!(@as My;
    a_user_cannot_claim_an_event_for_another_users_handler =
        a_consumer_cannot_claim_an_event_for_another_consumers_handler,
    claims_from_before_the_upgrade_count_for_every_user =
        claims_from_before_the_upgrade_count_for_every_consumer,
);
