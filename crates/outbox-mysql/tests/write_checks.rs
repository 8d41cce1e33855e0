//! Rows are checked when they are written, not only when the relay claims them (migration 4),
//! against a real MariaDB / MySQL: a writer that inserts by hand may leave out `id` (`UUID()`),
//! and headers that are not a JSON object of strings, or that use the reserved `outbox-` prefix,
//! fail the writer's statement with a message naming the header; an outbox that already holds
//! such rows upgrades, and the relay still settles them.

mod common;

use common::MySqlWriter;
use outbox_mysql::{MySqlOutbox, MySqlStore};
use outbox_store_tests::{outbox_rows, sqlstate, state_of, write_checks_claim};
use outbox_types::{DeadFilter, EventId, EventState, NewEvent, Store};
use sqlx::AssertSqlSafe;

/// A hand-written insert as the table contract describes it, `id` left out. The id that
/// `UUID()` gave is read back by the row's seq.
async fn insert(
    conn: &mut sqlx::MySqlConnection,
    outbox: &MySqlOutbox,
    headers: &str,
) -> Result<String, sqlx::Error> {
    let done = sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers,
                         occurred_at, enqueued_at, next_attempt_at)
         VALUES ('order', '42', 'OrderPlaced', '{{\"total\": 10}}', ?,
                 UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
        outbox.quoted_table()
    )))
    .bind(headers)
    .execute(&mut *conn)
    .await?;
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM {} WHERE seq = ?",
        outbox.quoted_table()
    )))
    .bind(done.last_insert_id())
    .fetch_one(&mut *conn)
    .await
}

#[tokio::test]
async fn an_insert_without_id_gets_a_uuid() {
    let store = common::fresh_store().await;
    let mut conn = store.pool().acquire().await.unwrap();
    let id = insert(&mut conn, store.outbox(), "{}").await.unwrap();
    let uuid = uuid::Uuid::parse_str(&id).unwrap();
    // MySQL's and MariaDB's UUID() is version 1, lowercase hyphenated as the column keeps ids.
    assert_eq!(uuid.get_version_num(), 1, "{id}");
    assert_eq!(id, uuid.to_string(), "lowercase hyphenated");
    let other = insert(&mut conn, store.outbox(), "{}").await.unwrap();
    assert_ne!(id, other);
    let record = store.get(EventId::from_uuid(uuid)).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Pending);
}

#[tokio::test]
async fn bad_headers_fail_the_writers_statement_naming_the_header() {
    let store = common::fresh_store().await;
    let mut tx = store.pool().begin().await.unwrap();
    for (headers, says) in [
        (
            r#"{"a": "1", "retry": 3}"#,
            r#"header "retry" is not a string"#,
        ),
        (
            r#"{"nested": {"x": "1"}}"#,
            r#"header "nested" is not a string"#,
        ),
        (r#"{"n": null}"#, r#"header "n" is not a string"#),
        (r#"["x"]"#, "headers must be a JSON object"),
        (r#""x""#, "headers must be a JSON object"),
        ("nope", "headers must be a JSON object"),
        (
            r#"{"ok": "1", "outbox-event-id": "forged"}"#,
            r#"header "outbox-event-id" uses the reserved prefix outbox-"#,
        ),
        (
            r#"{"outbox-": "x"}"#,
            r#"header "outbox-" uses the reserved prefix"#,
        ),
    ] {
        let err = insert(&mut tx, store.outbox(), headers).await.unwrap_err();
        assert_eq!(sqlstate(&err), "45000", "{headers}: {err}");
        assert!(err.to_string().contains(says), "{headers}: {err}");
    }
    // The failed statements left nothing behind; the writer's transaction decides the rest.
    tx.rollback().await.unwrap();
    assert_eq!(outbox_rows(&MySqlWriter, &store).await, 0);

    // Accepted: the one reserved name the relay stores itself, names that only look alike,
    // strings of any content.
    let mut conn = store.pool().acquire().await.unwrap();
    let id = insert(
        &mut conn,
        store.outbox(),
        r#"{"outbox-partition": "3", "Outbox-Tenant": "acme", "outboxer": "x", "q": "a \"quoted\" 3"}"#,
    )
    .await
    .unwrap();
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!(claim.events.len(), 1, "{claim:?}");
    let event = &claim.events[0];
    assert_eq!(event.id.to_string(), id);
    assert_eq!(event.headers["outbox-partition"], "3");
    assert_eq!(event.headers["Outbox-Tenant"], "acme");
    store.ack(&claim.lease, &[event.seq]).await.unwrap();
}

/// The enqueue procedure's INSERT goes through the same trigger: a reserved name fails the
/// call with the trigger's message.
#[tokio::test]
async fn the_enqueue_procedure_refuses_a_reserved_header_through_the_trigger() {
    let store = common::fresh_store().await;
    let err = sqlx::query(AssertSqlSafe(format!(
        "CALL `{}_enqueue`('a', '1', 'T', '{{}}', '{{\"outbox-event-id\": \"forged\"}}', NULL, NULL, NULL, NULL)",
        store.outbox().table()
    )))
    .fetch_one(store.pool())
    .await
    .unwrap_err();
    assert_eq!(sqlstate(&err), "45000", "{err}");
    outbox_testkit::assert_mentions(&err, r#"header "outbox-event-id" uses the reserved prefix"#);
    assert_eq!(outbox_rows(&MySqlWriter, &store).await, 0);
}

outbox_store_tests::writer_tests!(MySqlWriter;
    the_library_refuses_a_reserved_header_before_the_database_does,
);

/// An outbox of the previous release (version 3) with rows the trigger refuses upgrades: the
/// trigger never looks at rows already there, and the relay's updates (claim, dead-letter,
/// requeue) go on; an operator corrects such a row's headers by hand (updates are not checked)
/// and requeues it.
#[tokio::test]
async fn an_outbox_with_bad_rows_upgrades_and_the_relay_still_settles_them() {
    let (pool, outbox) = common::unmigrated_outbox(4).await;
    outbox.migrate(&pool).await.unwrap();
    let t = outbox.quoted_table();
    let table = outbox.table().to_owned();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TRIGGER `{table}_headers_insert`;
         ALTER TABLE {t} ALTER COLUMN id DROP DEFAULT;
         DELETE FROM `{table}_migrations` WHERE version >= 4"
    )))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (3, 6));
    let store = MySqlStore::new(pool.clone(), outbox.clone());
    let number = NewEvent::new("old", "1", "Old", &1).unwrap();
    let reserved = NewEvent::new("old", "2", "Old", &2).unwrap();
    for (e, headers) in [
        (&number, r#"{"retry": 3}"#),
        (&reserved, r#"{"outbox-tenant": "acme"}"#),
    ] {
        outbox.enqueue(&pool, e).await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t} SET headers = ? WHERE id = ?"
        )))
        .bind(headers)
        .bind(e.id().to_string())
        .execute(&pool)
        .await
        .unwrap();
    }

    let report = outbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied, vec![4, 5, 6]);
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (6, 6));
    // New rows are checked at once.
    let mut conn = pool.acquire().await.unwrap();
    let err = insert(&mut conn, &outbox, r#"{"retry": 3}"#)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "45000", "{err}");
    // The old rows: the unreadable one dead-lettered at claim, the reserved name delivered.
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!(claim.events.len(), 1, "{claim:?}");
    assert_eq!(claim.buried, 1, "{claim:?}");
    store
        .ack(&claim.lease, &[claim.events[0].seq])
        .await
        .unwrap();
    assert_eq!(state_of(&store, number.id()).await, EventState::Dead);
    assert_eq!(state_of(&store, reserved.id()).await, EventState::Delivered);
    // Requeueing it leaves its headers alone, so it passes; it is dead-lettered again.
    let requeued = store
        .requeue_dead(&DeadFilter::Ids(vec![number.id()]))
        .await
        .unwrap();
    assert_eq!(requeued, 1);
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!(claim.buried, 1, "{claim:?}");
    // Corrected by hand and requeued, it is delivered.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {t} SET headers = ? WHERE id = ?"
    )))
    .bind(r#"{"retry": "4"}"#)
    .bind(number.id().to_string())
    .execute(&pool)
    .await
    .unwrap();
    store
        .requeue_dead(&DeadFilter::Ids(vec![number.id()]))
        .await
        .unwrap();
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!(claim.events.len(), 1, "{claim:?}");
    assert_eq!(claim.events[0].headers["retry"], "4");
}
