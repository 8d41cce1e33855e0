//! The Rust library's enqueue with a writer account that holds only the grants of
//! docs/table-contract.md ("Privileges"): `INSERT` on the outbox table and `EXECUTE` on the
//! enqueue procedures. Single events and batches, with and without idempotency keys, a key
//! repeated inside a batch and across calls, an id another event has, all through the library;
//! and the same account cannot read, lock or change a row. The library's enqueue used to write
//! with its own upsert and locking reads, which needed `SELECT` and `UPDATE` on the table.

mod common;

use outbox_mysql::{MySqlOutbox, MySqlStore};
use outbox_store_tests::claim_up_to;
use outbox_types::{EventId, NewEvent, Store, StoreError};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Acquire, MySqlPool};

/// A writer account with `INSERT` on `store`'s table and `EXECUTE` on its enqueue procedures,
/// nothing else, and a pool connected as it.
async fn writer(store: &MySqlStore) -> (String, MySqlPool) {
    let table = store.outbox().table().to_owned();
    let database: String = sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let user = outbox_testkit::unique("ob_lw");
    for grant in [
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'writer-pw'"),
        format!("GRANT EXECUTE ON PROCEDURE `{database}`.`{table}_enqueue` TO '{user}'@'%'"),
        format!("GRANT EXECUTE ON PROCEDURE `{database}`.`{table}_enqueue_batch` TO '{user}'@'%'"),
        format!("GRANT INSERT ON `{database}`.`{table}` TO '{user}'@'%'"),
    ] {
        common::execute(store.pool(), grant).await;
    }
    let url = common::database_url().replacen("root@", &format!("{user}:writer-pw@"), 1);
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    (user, pool)
}

fn event(aggregate_id: &str, key: Option<&str>) -> NewEvent {
    let e = NewEvent::new(
        "order",
        aggregate_id,
        "Placed",
        &serde_json::json!({"n": 1}),
    )
    .unwrap();
    match key {
        Some(key) => e.with_idempotency_key(key),
        None => e,
    }
}

async fn seq_of(store: &MySqlStore, id: EventId) -> i64 {
    store.get(id).await.unwrap().unwrap().event.seq
}

#[tokio::test]
async fn the_library_enqueues_with_insert_and_execute_only() {
    let store = common::fresh_store().await;
    let outbox: &MySqlOutbox = store.outbox();
    let table = outbox.table().to_owned();
    // Another service's event, written with full rights.
    let other = event("other", Some("other-1"));
    outbox.enqueue(store.pool(), &other).await.unwrap();
    let (user, pool) = writer(&store).await;

    // Single events, through the pool (autocommit).
    let plain = event("1", None);
    let done = outbox.enqueue(&pool, &plain).await.unwrap();
    assert!(done.created && done.id == plain.id());
    let keyed = event("2", Some("k-1"));
    let done = outbox.enqueue(&pool, &keyed).await.unwrap();
    assert!(done.created && done.id == keyed.id());
    let again = event("2", Some("k-1"));
    let done = outbox.enqueue(&pool, &again).await.unwrap();
    assert!(!done.created, "a key already there: nothing written");
    assert_eq!(done.id, keyed.id(), "the first event's id");
    let done = outbox.enqueue(&pool, &keyed).await.unwrap();
    assert!(
        !done.created && done.id == keyed.id(),
        "the same event again"
    );
    let theirs = event("3", Some("other-1"));
    let done = outbox.enqueue(&pool, &theirs).await.unwrap();
    assert!(!done.created);
    assert_eq!(done.id, other.id(), "documented: the holder's id");

    // A batch, inside the writer's transaction: a key repeated inside it and keys from earlier
    // calls.
    let batch = [
        event("4", None),
        event("4", Some("k-2")),
        event("5", Some("k-2")),
        event("5", Some("k-1")),
        event("6", Some("other-1")),
        event("6", None),
    ];
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let done = outbox.enqueue_batch(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    let got: Vec<(EventId, bool)> = done.iter().map(|d| (d.id, d.created)).collect();
    assert_eq!(
        got,
        [
            (batch[0].id(), true),
            (batch[1].id(), true),
            (batch[1].id(), false),
            (keyed.id(), false),
            (other.id(), false),
            (batch[5].id(), true),
        ]
    );
    let seqs = [
        seq_of(&store, batch[0].id()).await,
        seq_of(&store, batch[1].id()).await,
        seq_of(&store, batch[5].id()).await,
    ];
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "array order: {seqs:?}"
    );
    // The same batch again: every event is there already.
    let done = outbox.enqueue_batch(&pool, &batch[1..3]).await.unwrap();
    assert!(done.iter().all(|d| !d.created && d.id == batch[1].id()));

    // An id another event has is an error, singly and in a batch.
    let clash = event("7", None).with_id(other.id());
    let error = outbox.enqueue(&pool, &clash).await.unwrap_err();
    assert!(
        matches!(&error, StoreError::Database(m) if m.contains("already has this id")),
        "{error}"
    );
    let error = outbox
        .enqueue_batch(&pool, &[event("8", None), clash.clone()])
        .await
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::Database(m) if m.contains("already has this id")),
        "{error}"
    );

    // The account can read, lock, change and delete nothing.
    for sql in [
        format!("SELECT id, payload FROM `{table}`"),
        format!("SELECT seq FROM `{table}` WHERE idempotency_key = 'other-1' FOR UPDATE"),
        format!("UPDATE `{table}` SET payload = '{{}}', destination = 'evil'"),
        format!("DELETE FROM `{table}`"),
    ] {
        assert_eq!(
            common::sqlstate_of(&pool, &sql).await.as_deref(),
            Some("42000"),
            "{sql}"
        );
    }
    drop(conn);
    pool.close().await;
    let record = store.get(other.id()).await.unwrap().unwrap();
    assert_eq!(record.event.destination, None);
    // other, plain, keyed, three of the batch, and the first event of the failed batch.
    let claimed = store.claim(&claim_up_to(100)).await.unwrap().events;
    assert_eq!(claimed.len(), 7, "{claimed:?}");
    common::execute(store.pool(), format!("DROP USER '{user}'@'%'")).await;
}

/// A batch whose idempotency key another event holds learns that event's id without locking its
/// row: with the writer's transaction still open, a claim takes the event. (The library's own
/// upsert and locking reads used to hold it until the writer's transaction ended.)
#[tokio::test]
async fn a_duplicate_key_in_a_batch_holds_no_lock_on_the_existing_event() {
    let store = common::fresh_store().await;
    let first = event("a", Some("a-1"));
    store.outbox().enqueue(store.pool(), &first).await.unwrap();
    let mut conn = store.pool().acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let done = store
        .outbox()
        .enqueue_batch(&mut tx, &[event("a", Some("a-1")), event("b", None)])
        .await
        .unwrap();
    assert_eq!((done[0].id, done[0].created), (first.id(), false));
    let claimed = store.claim(&claim_up_to(100)).await.unwrap().events;
    assert_eq!(
        claimed.iter().map(|e| e.id).collect::<Vec<_>>(),
        [first.id()],
        "nothing waits for the writer's transaction"
    );
    tx.commit().await.unwrap();
}

/// An outbox migrated before the batch procedure existed (version 5): the library says to
/// migrate instead of failing with the server's "does not exist".
#[tokio::test]
async fn an_outbox_without_the_batch_procedure_asks_for_a_migration() {
    let store = common::fresh_store().await;
    common::execute(
        store.pool(),
        format!("DROP PROCEDURE `{}_enqueue_batch`", store.outbox().table()),
    )
    .await;
    let error = store
        .outbox()
        .enqueue(store.pool(), &event("1", None))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::NotMigrated(m) if m.contains("run `outbox migrate`")),
        "{error}"
    );
    let error = store
        .outbox()
        .enqueue_batch(store.pool(), &[event("1", None)])
        .await
        .unwrap_err();
    assert!(matches!(&error, StoreError::NotMigrated(_)), "{error}");
}

/// Hostile calls of the batch procedure by a writer with INSERT and EXECUTE only, which skips
/// the library's checks: every malformed, incomplete, oversized or forged event fails the call
/// with a SQLSTATE, since the procedure runs with its owner's rights and so must check what the
/// library would. Each call is made, as documented, inside the writer's transaction, which the
/// failure makes it roll back: the procedure never commits by itself, so the valid event before
/// the bad one in the array is gone too. (Outside a transaction MySQL commits each statement of
/// a procedure, and the events before a failing one would stay written.)
#[tokio::test]
async fn a_writer_calling_the_batch_procedure_directly_with_bad_events_writes_nothing() {
    let store = common::fresh_store().await;
    let table = store.outbox().table().to_owned();
    let (_user, pool) = writer(&store).await;
    let good = r#"{"aggregate_type": "order", "aggregate_id": "1", "event_type": "Placed", "payload": "{}"}"#;
    let long = "x".repeat(300);
    let cases: [(&str, String, &str); 9] = [
        ("not an array", r#"{"aggregate_type": "order"}"#.to_owned(), "22023"),
        ("not JSON", "[{".to_owned(), "22023"),
        ("NULL", "NULL".to_owned(), "22023"),
        (
            "no payload",
            r#"[{"aggregate_type": "order", "aggregate_id": "2", "event_type": "Placed"}]"#
                .to_owned(),
            "22023",
        ),
        (
            "empty aggregate_id",
            r#"[{"aggregate_type": "order", "aggregate_id": "", "event_type": "Placed", "payload": "{}"}]"#.to_owned(),
            "22023",
        ),
        (
            "an id that is no UUID",
            r#"[{"id": "1; DROP TABLE x", "aggregate_type": "order", "aggregate_id": "3", "event_type": "Placed", "payload": "{}"}]"#.to_owned(),
            "22023",
        ),
        (
            "an aggregate_id over the column's 255 characters",
            format!(r#"[{{"aggregate_type": "order", "aggregate_id": "{long}", "event_type": "Placed", "payload": "{{}}"}}]"#),
            "22001",
        ),
        (
            "a reserved header",
            r#"[{"aggregate_type": "order", "aggregate_id": "4", "event_type": "Placed", "payload": "{}", "headers": "{\"outbox-event-id\": \"forged\"}"}]"#.to_owned(),
            "45000",
        ),
        (
            "headers that are no object",
            r#"[{"aggregate_type": "order", "aggregate_id": "5", "event_type": "Placed", "payload": "{}", "headers": "[1]"}]"#.to_owned(),
            "45000",
        ),
    ];
    for (what, events, expected) in cases {
        // A valid event first: the failing call must not leave it behind either.
        let events = match events.strip_prefix('[') {
            Some(rest) => format!("[{good}, {rest}"),
            None => events,
        };
        let arg = if events == "NULL" {
            events
        } else {
            format!("'{}'", events.replace('\\', "\\\\").replace('\'', "''"))
        };
        let sql = format!("CALL `{table}_enqueue_batch`({arg})");
        let mut tx = pool.begin().await.unwrap();
        assert_eq!(
            common::sqlstate_of(&mut *tx, &sql).await.as_deref(),
            Some(expected),
            "{what}: {sql}"
        );
        tx.rollback().await.unwrap();
    }
    let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{table}`"
    )))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(rows, 0, "a failed call wrote events");
}
