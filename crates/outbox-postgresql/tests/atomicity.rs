//! The outbox's first promise, against a real PostgreSQL: an event exists exactly when the
//! business transaction that enqueued it committed.

mod common;

use common::PgWriter;
use outbox_postgresql::{PgOutbox, PgStore};
use outbox_testkit::concurrent::race;
use outbox_types::Store;

outbox_store_tests::writer_tests!(PgWriter::default();
    committed_transaction_keeps_order_and_event_together,
    rolled_back_transaction_leaves_neither,
    a_writer_that_dies_before_commit_leaves_nothing => a_writer_killed_before_commit_leaves_nothing,
    enqueue_through_the_pool_autocommits_like_any_statement,
);

#[tokio::test]
async fn migrate_is_idempotent_and_safe_to_race() {
    let pool = common::pool(10).await;
    let outbox = PgOutbox::with_names(&common::unique_schema(), "my_events").unwrap();
    let reports = race(4, |_| {
        let (outbox, pool) = (outbox.clone(), pool.clone());
        async move { outbox.migrate(&pool).await.unwrap() }
    })
    .await;
    let applied: Vec<_> = reports.into_iter().flat_map(|r| r.applied).collect();
    assert_eq!(
        applied,
        vec![1, 2, 3, 4, 5, 6, 7],
        "exactly one racer applied each version"
    );
    let again = outbox.migrate(&pool).await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (7, 7));
    // The bookkeeping table sits next to the outbox, not in the application's `_sqlx_migrations`.
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{}.my_events_migrations", outbox.schema()))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(exists.is_some());
}

#[tokio::test]
async fn invalid_names_are_refused_before_any_sql() {
    let err = PgOutbox::with_names("Outbox", "events")
        .unwrap_err()
        .to_string();
    assert!(err.contains("schema `Outbox`"), "{err}");
    assert!(PgOutbox::with_names("ok", "bad-name").is_err());
}

#[tokio::test]
async fn a_store_on_an_unmigrated_schema_says_to_migrate() {
    let pool = common::pool(2).await;
    let outbox = PgOutbox::with_names(&common::unique_schema(), "events").unwrap();
    let store = outbox_postgresql::PgStore::new(pool, outbox);
    let err = store.check().await.unwrap_err().to_string();
    assert!(err.contains("outbox migrate"), "{err}");
    let err = store.stats().await.unwrap_err();
    assert!(
        matches!(err, outbox_types::StoreError::NotMigrated(_)),
        "{err}"
    );
}

/// An outbox migrated by an earlier release (version 3: blockers marked by `attempts` alone, no
/// enqueue function) upgrades in place, with an event in it: the blockers index is rebuilt
/// with the new mark, and the functions and the header trigger appear.
#[tokio::test]
async fn an_outbox_of_the_previous_release_upgrades_in_place() {
    let pool = common::pool(4).await;
    let schema = common::unique_schema();
    let outbox = PgOutbox::with_names(&schema, "events").unwrap();
    outbox.migrate(&pool).await.unwrap();
    // Back to what version 3 left: its index predicate, no functions, no id default or header
    // trigger, no bookkeeping of 4 to 6.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"DROP FUNCTION "{schema}".events_enqueue;
           DROP FUNCTION "{schema}".events_enqueue_batch;
           DROP TRIGGER events_header_rules ON "{schema}".events;
           DROP FUNCTION "{schema}".events_check_headers;
           ALTER TABLE "{schema}".events ALTER COLUMN id DROP DEFAULT;
           DROP INDEX "{schema}".events_blockers;
           CREATE INDEX events_blockers ON "{schema}".events (aggregate_type, aggregate_id, seq)
               WHERE status IN ('in_flight', 'dead') OR (status = 'pending' AND attempts > 0);
           DELETE FROM "{schema}".events_migrations WHERE version > 3;"#
    )))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (3, 7));
    let store = PgStore::new(pool.clone(), outbox.clone());
    outbox
        .enqueue(&pool, &outbox_testkit::numbered("a", 1))
        .await
        .unwrap();
    // An event with a key goes through the batch function of migration 7: until then the
    // library says what to do.
    let err = outbox
        .enqueue(
            &pool,
            &outbox_testkit::numbered("a", 2).with_idempotency_key("k"),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, outbox_types::StoreError::NotMigrated(m) if m.contains("outbox migrate")),
        "{err}"
    );
    let report = outbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied, vec![4, 5, 6, 7]);
    let predicate: String = sqlx::query_scalar(
        "SELECT pg_get_expr(i.indpred, i.indrelid) FROM pg_index i
         JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND c.relname = 'events_blockers'",
    )
    .bind(&schema)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(predicate.contains("last_error IS NOT NULL"), "{predicate}");
    let id: uuid::Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        r#"SELECT "{schema}".events_enqueue('a', '1', 'Numbered', '{{}}')"#
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(id.get_version_num(), 7);
    assert_eq!(store.stats().await.unwrap().pending, 2);
}
