//! `CALL <table>_enqueue(...)`, the enqueue procedure for writers in any language, against a
//! real MySQL / MariaDB: the rows it writes are the rows the library writes (and the relay
//! claims), it commits and rolls back with the caller's transaction, it refuses what the
//! library refuses with SQLSTATE 22023 naming the argument, and an idempotency key repeated
//! returns the first event's id.

mod common;

use outbox_mysql::MySqlStore;
use outbox_store_tests::claim_up_to;
use outbox_types::{NewEvent, Store};
use sqlx::{Acquire, Connection, MySqlConnection, Row};

/// `CALL` with every argument given (NULL = the default); the id it returns.
async fn call(
    conn: &mut MySqlConnection,
    store: &MySqlStore,
    args: [Option<&str>; 9],
) -> Result<String, sqlx::Error> {
    let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
        "CALL `{}_enqueue`(?, ?, ?, ?, ?, ?, ?, ?, ?)",
        store.outbox().table()
    )));
    for arg in args {
        query = query.bind(arg);
    }
    let row = query.fetch_one(&mut *conn).await?;
    row.try_get::<String, _>("id")
}

fn event(aggregate_id: &str, event_type: &str, payload: &str) -> [Option<&'static str>; 9] {
    // Leaked: a handful of short strings per test, so the argument arrays stay simple.
    let leak = |s: &str| -> &'static str { Box::leak(s.to_owned().into_boxed_str()) };
    [
        Some("order"),
        Some(leak(aggregate_id)),
        Some(leak(event_type)),
        Some(leak(payload)),
        None,
        None,
        None,
        None,
        None,
    ]
}

async fn claim_all(store: &MySqlStore) -> Vec<outbox_types::Event> {
    store.claim(&claim_up_to(100)).await.unwrap().events
}

async fn rejected(store: &MySqlStore, args: [Option<&str>; 9]) -> String {
    let mut conn = store.pool().acquire().await.unwrap();
    let error = call(&mut conn, store, args).await.unwrap_err();
    let db = error.as_database_error().expect("a database error");
    assert_eq!(db.code().as_deref(), Some("22023"), "{db}");
    db.message().to_owned()
}

#[tokio::test]
async fn the_procedure_writes_what_the_relay_delivers_and_only_when_committed() {
    let store = common::fresh_store().await;
    let mut conn = store.pool().acquire().await.unwrap();

    let mut tx = conn.begin().await.unwrap();
    call(
        &mut tx,
        &store,
        event("7", "OrderPlaced", r#"{"total": 10}"#),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();

    let mut tx = conn.begin().await.unwrap();
    let first = call(
        &mut tx,
        &store,
        event("42", "OrderPlaced", r#"{"total":  10}"#),
    )
    .await
    .unwrap();
    let mut with_all = event("42", "OrderPaid", "[1, 2]");
    with_all[4] = Some(r#"{"trace-id": "abc", "tenant": "t1"}"#);
    with_all[5] = Some("billing");
    with_all[6] = Some("pay-42");
    with_all[7] = Some("2026-01-02 03:04:05.678901");
    with_all[8] = Some("0190F0E5-9B3A-7C3D-8E4F-123456789ABC");
    let second = call(&mut tx, &store, with_all).await.unwrap();
    tx.commit().await.unwrap();

    let uuid = uuid::Uuid::parse_str(&first).unwrap();
    assert_eq!(uuid.get_version_num(), 7, "a new id is a version 7 UUID");
    assert_eq!(first, uuid.to_string(), "lowercase, hyphenated");
    assert_eq!(second, "0190f0e5-9b3a-7c3d-8e4f-123456789abc");

    let claimed = claim_all(&store).await;
    assert_eq!(claimed.len(), 2, "the rolled-back event is not there");
    let (a, b) = (&claimed[0], &claimed[1]);
    assert_eq!(a.id.to_string(), first);
    assert_eq!(
        (
            a.aggregate_type.as_str(),
            a.aggregate_id.as_str(),
            a.event_type.as_str()
        ),
        ("order", "42", "OrderPlaced")
    );
    assert_eq!(a.payload, r#"{"total":  10}"#, "the payload's bytes, kept");
    assert!(a.headers.is_empty() && a.destination.is_none() && a.idempotency_key.is_none());
    let age = chrono::Utc::now() - a.occurred_at;
    assert!(
        age.num_seconds().abs() < 60,
        "occurred_at defaults to now (UTC): {age}"
    );
    assert_eq!(b.id.to_string(), second);
    assert_eq!(b.payload, "[1, 2]");
    assert_eq!(b.headers.get("trace-id").map(String::as_str), Some("abc"));
    assert_eq!(b.headers.get("tenant").map(String::as_str), Some("t1"));
    assert_eq!(b.destination.as_deref(), Some("billing"));
    assert_eq!(b.idempotency_key.as_deref(), Some("pay-42"));
    assert_eq!(
        b.occurred_at.to_rfc3339(),
        "2026-01-02T03:04:05.678901+00:00"
    );
    assert!(a.seq < b.seq, "enqueue order is seq order");
}

#[tokio::test]
async fn a_repeated_idempotency_key_returns_the_first_events_id_and_writes_nothing() {
    let store = common::fresh_store().await;
    let mut conn = store.pool().acquire().await.unwrap();
    let mut paid = event("42", "OrderPaid", "{}");
    paid[6] = Some("pay-42");
    let first = call(&mut conn, &store, paid).await.unwrap();
    let again = call(&mut conn, &store, paid).await.unwrap();
    assert_eq!(first, again);
    // Keys compare byte for byte, as the library's do.
    let mut other = paid;
    other[6] = Some("PAY-42");
    let third = call(&mut conn, &store, other).await.unwrap();
    assert_ne!(third, first);
    // The library sees the procedure's key, and the procedure the library's.
    let library = NewEvent::new("order", "42", "OrderPaid", &serde_json::json!({}))
        .unwrap()
        .with_idempotency_key("pay-42");
    let done = store
        .outbox()
        .enqueue(store.pool(), &library)
        .await
        .unwrap();
    assert!(!done.created);
    assert_eq!(done.id.to_string(), first);
    assert_eq!(claim_all(&store).await.len(), 2);

    // An id already taken, with no matching key, is an error, not a silent duplicate.
    let mut taken = event("43", "OrderPaid", "{}");
    taken[8] = Some(Box::leak(first.clone().into_boxed_str()));
    let error = call(&mut conn, &store, taken).await.unwrap_err();
    let db = error.as_database_error().unwrap();
    assert_eq!(db.code().as_deref(), Some("23000"), "{db}");
    assert!(db.message().contains("already in the outbox"), "{db}");
}

#[tokio::test]
async fn bad_arguments_fail_the_call_naming_the_argument() {
    let store = common::fresh_store().await;
    for (index, value, says) in [
        (0, Some(""), "aggregate_type must not be empty"),
        (1, None, "aggregate_id must not be empty"),
        (2, Some(""), "event_type must not be empty"),
        (3, None, "payload must be JSON"),
        (3, Some("{not json"), "payload must be JSON"),
        (4, Some("[1]"), "headers must be a JSON object"),
        (4, Some("nope"), "headers must be a JSON object"),
        (
            4,
            Some(r#"{"a": "1", "retry": 3}"#),
            r#"header "retry" is not a string"#,
        ),
        (
            4,
            Some(r#"{"nested": {"x": "1"}}"#),
            r#"header "nested" is not a string"#,
        ),
        (8, Some("not-a-uuid"), "id must be a UUID"),
    ] {
        let mut args = event("1", "Checked", "{}");
        args[index] = value;
        let message = rejected(&store, args).await;
        assert!(message.contains(says), "{index}: {message}");
    }
    assert!(claim_all(&store).await.is_empty(), "nothing was written");
    // Headers that are fine: empty, and strings only.
    let mut conn = store.pool().acquire().await.unwrap();
    let mut ok = event("1", "Checked", "null");
    ok[4] = Some("{}");
    call(&mut conn, &store, ok).await.unwrap();
    assert_eq!(claim_all(&store).await.len(), 1);
}

/// A writer account with EXECUTE on the procedure and INSERT on the table (the grants of
/// docs/table-contract.md, "Privileges") enqueues through the procedure, with its idempotency
/// key working as documented, and with a plain INSERT; it cannot read, lock, change or delete
/// any row. Before, the procedure ran with the caller's rights and needed SELECT and UPDATE on
/// the table, which let a writer change another service's pending payload and destination.
#[tokio::test]
async fn a_writer_with_execute_and_insert_only_enqueues_and_cannot_touch_other_rows() {
    let store = common::fresh_store().await;
    let table = store.outbox().table().to_owned();
    let database: String = sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let user = outbox_testkit::unique("ob_w");
    for grant in [
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'writer-pw'"),
        format!("GRANT EXECUTE ON PROCEDURE `{database}`.`{table}_enqueue` TO '{user}'@'%'"),
        format!("GRANT INSERT ON `{database}`.`{table}` TO '{user}'@'%'"),
    ] {
        common::execute(store.pool(), grant).await;
    }
    let other = NewEvent::new("other", "1", "Placed", &serde_json::json!({}))
        .unwrap()
        .with_idempotency_key("other-1");
    store.outbox().enqueue(store.pool(), &other).await.unwrap();

    let url = common::database_url().replacen("root@", &format!("{user}:writer-pw@"), 1);
    let mut writer = MySqlConnection::connect(&url).await.unwrap();
    let mut mine = event("1", "Placed", "{}");
    mine[6] = Some("mine-1");
    let first = call(&mut writer, &store, mine).await.unwrap();
    let again = call(&mut writer, &store, mine).await.unwrap();
    assert_eq!(first, again, "a key already there: the first event's id");
    let mut theirs = event("2", "Placed", "{}");
    theirs[6] = Some("other-1");
    let found = call(&mut writer, &store, theirs).await.unwrap();
    assert_eq!(found, other.id().to_string(), "documented: the holder's id");
    let plain = format!(
        "INSERT INTO `{table}` (aggregate_type, aggregate_id, event_type, payload, headers,
                                occurred_at, enqueued_at, next_attempt_at)
         VALUES ('order', '3', 'Placed', '{{}}', '{{}}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
    );
    assert_eq!(common::sqlstate_of(&mut writer, &plain).await, None);
    let taken = format!(
        "INSERT INTO `{table}` (aggregate_type, aggregate_id, event_type, payload, headers,
                                idempotency_key, occurred_at, enqueued_at, next_attempt_at)
         VALUES ('order', '4', 'Placed', '{{}}', '{{}}', 'other-1', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
    );
    assert_eq!(
        common::sqlstate_of(&mut writer, &taken).await.as_deref(),
        Some("23000")
    );
    for sql in [
        format!("SELECT id, payload FROM `{table}`"),
        format!("SELECT seq FROM `{table}` WHERE idempotency_key = 'other-1' FOR UPDATE"),
        format!("UPDATE `{table}` SET payload = '{{}}', destination = 'evil'"),
        format!(
            "UPDATE `{table}` SET idempotency_key = 'stolen' WHERE idempotency_key = 'other-1'"
        ),
        format!("DELETE FROM `{table}`"),
        format!("{taken} ON DUPLICATE KEY UPDATE seq = seq"),
    ] {
        assert_eq!(
            common::sqlstate_of(&mut writer, &sql).await.as_deref(),
            Some("42000"),
            "{sql}"
        );
    }
    writer.close().await.unwrap();
    let record = store.get(other.id()).await.unwrap().unwrap();
    assert_eq!(record.event.idempotency_key.as_deref(), Some("other-1"));
    assert_eq!(record.event.destination, None);
    assert_eq!(
        claim_all(&store).await.len(),
        3,
        "other, mine and the plain one"
    );
    common::execute(store.pool(), format!("DROP USER '{user}'@'%'")).await;
}

/// A call whose idempotency key another event holds learns that event's id without locking its
/// row: with the caller's transaction still open, a claim takes the event and its aggregate.
/// (The upsert the procedure used before locked the row until the caller's transaction ended.)
#[tokio::test]
async fn a_duplicate_key_call_holds_no_lock_on_the_existing_event() {
    let store = common::fresh_store().await;
    let a1 = NewEvent::new("order", "a", "Placed", &1)
        .unwrap()
        .with_idempotency_key("a-1");
    let a2 = NewEvent::new("order", "a", "Placed", &2).unwrap();
    let b1 = NewEvent::new("order", "b", "Placed", &1).unwrap();
    store
        .outbox()
        .enqueue_batch(store.pool(), &[a1.clone(), a2, b1])
        .await
        .unwrap();
    let mut conn = store.pool().acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let mut again = event("a", "Placed", "1");
    again[6] = Some("a-1");
    assert_eq!(
        call(&mut tx, &store, again).await.unwrap(),
        a1.id().to_string()
    );
    assert_eq!(
        claim_all(&store).await.len(),
        3,
        "nothing waits for the caller's transaction"
    );
    tx.commit().await.unwrap();
}
