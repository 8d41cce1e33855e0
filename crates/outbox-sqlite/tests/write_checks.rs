//! Rows are checked when they are written, not only when the relay claims them (migration 4):
//! headers that are not a JSON object of strings, or that use the reserved `outbox-` prefix,
//! fail the writer's insert with a message naming the rule; a missing `id` (SQLite keeps no
//! default for it, see the crate docs) is named; an outbox that already holds such rows
//! upgrades, and the relay still settles them.

mod common;

use common::{SqliteWriter, TempStore};
use outbox_sqlite::{SqliteOutbox, SqliteStore};
use outbox_store_tests::{outbox_rows, state_of, write_checks_claim};
use outbox_types::{DeadFilter, EventState, Store};
use sqlx::AssertSqlSafe;

/// A hand-written insert as the table contract describes it; `id` NULL leaves it out.
async fn insert<'e>(
    executor: impl sqlx::SqliteExecutor<'e>,
    store: &SqliteStore,
    id: Option<&str>,
    headers: &str,
) -> Result<(), sqlx::Error> {
    let now = chrono::Utc::now().timestamp_micros();
    let (columns, value) = match id {
        Some(_) => ("id, ", "?4, "),
        None => ("", ""),
    };
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{}\" ({columns}aggregate_type, aggregate_id, event_type, payload, headers,
                             occurred_at, enqueued_at, next_attempt_at)
         VALUES ({value}'order', '42', 'OrderPlaced', '{{\"total\": 10}}', ?1, ?2, ?2, ?3)",
        store.outbox().table()
    )))
    .bind(headers)
    .bind(now)
    .bind(now)
    .bind(id)
    .execute(executor)
    .await
    .map(|_| ())
}

fn id() -> String {
    uuid::Uuid::now_v7().to_string()
}

#[tokio::test]
async fn bad_headers_fail_the_writers_insert_naming_the_rule() {
    let store = TempStore::new().await;
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    for (headers, says) in [
        (
            r#"{"a": "1", "retry": 3}"#,
            "header values must be JSON strings",
        ),
        (
            r#"{"nested": {"x": "1"}}"#,
            "header values must be JSON strings",
        ),
        (r#"{"n": null}"#, "header values must be JSON strings"),
        (r#"["x"]"#, "headers must be a JSON object"),
        (r#""x""#, "headers must be a JSON object"),
        ("nope", "headers must be a JSON object"),
        (
            r#"{"ok": "1", "outbox-event-id": "forged"}"#,
            "header names starting with outbox- are reserved",
        ),
    ] {
        let err = insert(&mut *tx, &store, Some(&id()), headers)
            .await
            .unwrap_err();
        let db = err.as_database_error().expect("a database error");
        assert!(db.message().contains(says), "{headers}: {err}");
        assert_eq!(
            db.code().as_deref(),
            Some("1811"),
            "SQLITE_CONSTRAINT_TRIGGER: {err}"
        );
    }
    tx.rollback().await.unwrap();
    assert_eq!(outbox_rows(&SqliteWriter, &store).await, 0);

    // A missing id is named, not a bare NOT NULL failure.
    let err = insert(store.pool(), &store, None, "{}").await.unwrap_err();
    outbox_testkit::assert_mentions(&err, "outbox: id is required");

    // Accepted: the one reserved name the relay stores itself, and names that only look alike.
    let given = id();
    insert(
        store.pool(),
        &store,
        Some(&given),
        r#"{"outbox-partition": "3", "Outbox-Tenant": "acme", "outboxer": "x"}"#,
    )
    .await
    .unwrap();
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!(claim.events.len(), 1, "{claim:?}");
    assert_eq!(claim.events[0].id.to_string(), given);
    assert_eq!(claim.events[0].headers["outbox-partition"], "3");
    store
        .ack(&claim.lease, &[claim.events[0].seq])
        .await
        .unwrap();

    // Setting headers by UPDATE is checked the same way.
    let err = sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}\" SET headers = '{{\"retry\": 3}}' WHERE id = ?1",
        store.outbox().table()
    )))
    .bind(&given)
    .execute(store.pool())
    .await
    .unwrap_err();
    outbox_testkit::assert_mentions(&err, "header values must be JSON strings");
}

outbox_store_tests::writer_tests!(SqliteWriter;
    the_library_refuses_a_reserved_header_before_the_database_does,
);

/// An outbox of the previous release (version 3) with rows the triggers refuse upgrades: the
/// triggers never look at rows already there, and the relay's updates never set `headers`, so
/// it claims, dead-letters and requeues them as before.
#[tokio::test]
async fn an_outbox_with_bad_rows_upgrades_and_the_relay_still_settles_them() {
    let store = TempStore::with_outbox(SqliteOutbox::with_table("old_events").unwrap()).await;
    sqlx::raw_sql(
        "DROP TRIGGER old_events_check_insert;
         DROP TRIGGER old_events_check_headers_update;
         DELETE FROM old_events_migrations WHERE version >= 4;",
    )
    .execute(store.pool())
    .await
    .unwrap();
    assert_eq!(
        store.outbox().schema_version(store.pool()).await.unwrap(),
        (3, 4)
    );
    let (number, reserved) = (id(), id());
    insert(store.pool(), &store, Some(&number), r#"{"retry": 3}"#)
        .await
        .unwrap();
    insert(
        store.pool(),
        &store,
        Some(&reserved),
        r#"{"outbox-tenant": "acme"}"#,
    )
    .await
    .unwrap();

    let report = store.outbox().migrate(store.pool()).await.unwrap();
    assert_eq!(report.applied, vec![4]);
    let err = insert(store.pool(), &store, Some(&id()), r#"{"retry": 3}"#)
        .await
        .unwrap_err();
    outbox_testkit::assert_mentions(&err, "header values must be JSON strings");

    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!((claim.events.len(), claim.buried), (1, 1), "{claim:?}");
    store
        .ack(&claim.lease, &[claim.events[0].seq])
        .await
        .unwrap();
    assert_eq!(
        state_of(&store, number.parse().unwrap()).await,
        EventState::Dead
    );
    assert_eq!(
        state_of(&store, reserved.parse().unwrap()).await,
        EventState::Delivered
    );
    let requeued = store
        .requeue_dead(&DeadFilter::Ids(vec![number.parse().unwrap()]))
        .await
        .unwrap();
    assert_eq!(requeued, 1);
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!(claim.buried, 1, "dead-lettered again: {claim:?}");
}
