//! The `<schema>.<table>_enqueue` function that writers in other languages call: it writes what
//! the Rust library's enqueue writes, in both layouts, with the same rules.

mod common;

use outbox_postgresql::{Partitioning, PgStore};
use outbox_types::{EventState, Store};

fn function(store: &PgStore) -> String {
    // qualified_table() is "schema"."events": the function sits beside it.
    let table = store.outbox().qualified_table();
    format!("{}_enqueue\"", table.trim_end_matches('"'))
}

async fn call(store: &PgStore, args: &str) -> Result<uuid::Uuid, sqlx::Error> {
    let sql = format!("SELECT {}({args})", function(store));
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(store.pool())
        .await
}

async fn writes_what_the_library_writes(store: PgStore) {
    // Inside a transaction with a business row, committed; and one rolled back.
    let mut tx = store.pool().begin().await.unwrap();
    let sql = format!(
        "SELECT {}('order', '42', 'OrderPlaced', '{{\"total\": 10}}', headers => '{{\"trace-id\": \"abc\"}}', destination => 'kafka')",
        function(&store)
    );
    let placed: uuid::Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let _: uuid::Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(placed.get_version_num(), 7, "a time-ordered id: {placed}");

    // An idempotency key already there gives back the first event's id and writes nothing.
    let paid = call(
        &store,
        "'order', '42', 'OrderPaid', '{}', idempotency_key => 'pay-42'",
    )
    .await
    .unwrap();
    let again = call(
        &store,
        "'order', '42', 'OrderPaid', '{}', idempotency_key => 'pay-42'",
    )
    .await
    .unwrap();
    assert_eq!(paid, again);
    // A given id is kept.
    let given = uuid::Uuid::now_v7();
    let got = call(
        &store,
        &format!("'order', '43', 'OrderPlaced', 'null', id => '{given}'"),
    )
    .await
    .unwrap();
    assert_eq!(got, given);

    let stats = store.stats().await.unwrap();
    assert_eq!(
        stats.pending, 3,
        "the rolled-back and the duplicate are absent: {stats:?}"
    );
    let claim = store
        .claim(&outbox_store_tests::claim_up_to(10))
        .await
        .unwrap();
    let ids: Vec<uuid::Uuid> = claim.events.iter().map(|e| *e.id.as_uuid()).collect();
    assert_eq!(ids, [placed, paid, given], "in commit order");
    let first = &claim.events[0];
    assert_eq!(first.aggregate_type, "order");
    assert_eq!(first.event_type, "OrderPlaced");
    assert_eq!(first.destination.as_deref(), Some("kafka"));
    assert_eq!(
        first.headers.get("trace-id").map(String::as_str),
        Some("abc")
    );
    assert_eq!(first.payload, "{\"total\": 10}", "the writer's bytes");
    let record = store.get(claim.events[1].id).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::InFlight);
    assert_eq!(record.event.idempotency_key.as_deref(), Some("pay-42"));
    if store.outbox().partitioning().is_some() {
        assert_eq!(common::keys_rows(&store).await, 3, "one keys row per event");
    }
}

common::both_layouts! {
    writes_what_the_library_writes:
        the_function_writes_what_the_library_writes,
        the_function_writes_what_the_library_writes_in_the_partitioned_layout;
}

#[tokio::test]
async fn the_function_refuses_what_the_library_refuses_with_a_reason() {
    refuses_with_a_reason(common::fresh_store().await).await;
    refuses_with_a_reason(common::fresh_partitioned_store(Partitioning::default()).await).await;
}

async fn refuses_with_a_reason(store: PgStore) {
    for (args, needle) in [
        ("'', '1', 'T', '{}'", "aggregate_type must not be empty"),
        ("'a', '', 'T', '{}'", "aggregate_id must not be empty"),
        ("'a', '1', '', '{}'", "event_type must not be empty"),
        ("'a', '1', 'T', NULL", "payload must not be NULL"),
        (
            "'a', '1', 'T', '{}', headers => '[1]'",
            "headers must be a JSON object",
        ),
        (
            "'a', '1', 'T', '{}', headers => '{\"retry\": 3}'",
            "header \"retry\" is not a string",
        ),
        (
            "'a', '1', 'T', 'not json'",
            "invalid input syntax for type json",
        ),
    ] {
        let err = call(&store, args).await.unwrap_err().to_string();
        assert!(err.contains(needle), "{args}: {err}");
    }
    assert_eq!(store.stats().await.unwrap().pending, 0, "nothing written");
}
