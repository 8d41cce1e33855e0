//! The PostgreSQL inbox against the machine's PostgreSQL (`OUTBOX_TEST_DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`); every test uses its own schema. The contract
//! every database shares is in `conformance/`; here: its backend and how the claim function is
//! called.

#![cfg(feature = "postgres")]

mod conformance;

use outbox_testkit::unique;

use conformance::{Backend, ClaimRoutine, RefusedCall, run_sql};
use outbox_inbox::postgres::PgInbox;
use outbox_inbox::{BoxFuture, Error, EventId};
use sqlx::{PgConnection, PgPool};

struct Pg;

impl Backend for Pg {
    type Inbox = PgInbox;
    const EFFECTS_DEFINITION: &'static str = "(event_id UUID NOT NULL, handler TEXT NOT NULL)";
    const SCHEMA_VERSION: i64 = 3;

    async fn pool() -> PgPool {
        conformance::connect(
            "OUTBOX_TEST_DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/test",
            "PostgreSQL must be running on 127.0.0.1:5432",
        )
        .await
    }

    fn inbox(table: &str) -> Result<PgInbox, Error> {
        PgInbox::with_names(&unique("inbox_s"), table)
    }

    fn beside(inbox: &PgInbox, suffix: &str) -> String {
        format!("\"{}\".\"{}{suffix}\"", inbox.schema(), inbox.table())
    }

    run_sql!(PgConnection);

    fn hours_ago(hours: u32) -> String {
        format!("now() - interval '{hours} hours'")
    }

    fn drop_claim_routine(inbox: &PgInbox) -> String {
        format!("DROP FUNCTION {}(UUID, TEXT)", inbox.claim_function())
    }
}

conformance::conformance_tests!(Pg; a_version_1_inbox_is_upgraded_and_says_so_until_then);

impl ClaimRoutine for Pg {
    fn claim_sql(inbox: &PgInbox) -> String {
        format!("SELECT {}($1, $2)", inbox.claim_function())
    }

    /// The event id bound as a UUID, the function's parameter type.
    fn call_claim(
        conn: &mut PgConnection,
        sql: String,
        id: Option<String>,
        handler: String,
    ) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        let id = id.map(|id| uuid::Uuid::parse_str(&id).unwrap());
        Box::pin(async move {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(handler)
                .fetch_one(conn)
                .await
        })
    }

    /// A null event id (22004), an empty and a too-long handler (22023).
    fn refused_calls() -> Vec<RefusedCall> {
        let id = || Some(EventId::new().to_string());
        let handler = "1 to 191 characters";
        vec![
            (None, "billing".to_owned(), "22004", "event_id is null"),
            (id(), String::new(), "22023", handler),
            (id(), "x".repeat(192), "22023", handler),
        ]
    }
}

conformance::conformance_tests!(@as Pg;
    the_claim_function_is_plain_sql_any_consumer_can_call =
        the_claim_routine_is_plain_sql_any_consumer_can_call,
    a_racing_claim_function_call_waits_for_the_first_transaction =
        a_racing_claim_routine_call_waits_for_the_first_transaction,
    the_claim_function_refuses_a_null_event_id_and_a_bad_handler =
        the_claim_routine_refuses_bad_arguments,
);

impl conformance::SharedInbox for Pg {
    /// A login role with `USAGE` on the schema and `INSERT` on the inbox (the claim function is
    /// `PUBLIC`'s to call); the test server trusts local logins.
    async fn consumer(inbox: &PgInbox, name: &str) -> PgPool {
        let admin = Pg::pool().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE ROLE {name} LOGIN;
             GRANT USAGE ON SCHEMA \"{schema}\" TO {name};
             GRANT INSERT ON {table} TO {name};",
            schema = inbox.schema(),
            table = inbox.qualified_table()
        )))
        .execute(&admin)
        .await
        .unwrap();
        let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
            .replacen("postgres@", &format!("{name}@"), 1);
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap()
    }

    fn drop_consumer(name: &str) -> String {
        format!("DROP OWNED BY {name}; DROP ROLE {name}")
    }

    fn downgrade_to_version_2(inbox: &PgInbox) -> String {
        let table = inbox.table();
        format!(
            "DROP TRIGGER \"{table}_claimed_by\" ON {t};
             DROP FUNCTION {claimed_by}();
             DROP FUNCTION {claimed_before}(UUID, TEXT);
             ALTER TABLE {t} DROP CONSTRAINT \"{table}_pkey\", DROP COLUMN claimed_by,
                 ADD PRIMARY KEY (event_id, handler);
             DELETE FROM {m} WHERE version = 3",
            t = inbox.qualified_table(),
            claimed_by = Pg::beside(inbox, "_claimed_by"),
            claimed_before = Pg::beside(inbox, "_claimed_before"),
            m = Pg::migrations_table(inbox)
        )
    }
}

conformance::conformance_tests!(@as Pg;
    a_role_cannot_claim_an_event_for_another_roles_handler =
        a_consumer_cannot_claim_an_event_for_another_consumers_handler,
    claims_from_before_the_upgrade_count_for_every_role =
        claims_from_before_the_upgrade_count_for_every_consumer,
);

/// Every function the inbox migrations install (the claim function, the claim rows' trigger
/// function and its helper), read from the catalog, pins `search_path`: none runs with the
/// caller's, so none can be made to call a function someone planted in a schema on it.
#[tokio::test]
async fn every_installed_function_pins_search_path() {
    let fx = conformance::setup::<Pg>().await;
    let functions: Vec<(String, Option<Vec<String>>)> = sqlx::query_as(
        "SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p
         WHERE p.pronamespace = $1::regnamespace ORDER BY 1",
    )
    .bind(format!("\"{}\"", fx.inbox.schema()))
    .fetch_all(&fx.pool)
    .await
    .unwrap();
    assert_eq!(functions.len(), 3, "{functions:?}");
    for (function, config) in &functions {
        assert!(
            config
                .iter()
                .flatten()
                .any(|c| c == "search_path=pg_catalog, pg_temp"),
            "{function} does not pin search_path: {config:?}"
        );
    }
}
