//! The outbox's first promise, against a real MySQL / MariaDB: an event exists exactly when the
//! business transaction that enqueued it committed. Plus migrations and table names.

mod common;

use outbox_testkit::concurrent::race;
use outbox_testkit::order_created;

use common::MySqlWriter;
use outbox_mysql::{MySqlOutbox, MySqlStore};
use outbox_store_tests::{self as scenario, Writer};
use outbox_types::{NewEvent, Store, StoreError};

outbox_store_tests::writer_tests!(MySqlWriter;
    committed_transaction_keeps_order_and_event_together,
    rolled_back_transaction_leaves_neither,
    a_writer_killed_before_commit_leaves_nothing,
    enqueue_through_the_pool_autocommits_like_any_statement,
);

#[tokio::test]
async fn a_committed_batch_appears_whole_and_only_at_commit() {
    let store = common::fresh_store().await;
    let orders = MySqlWriter.business_table(&store).await;
    let mut tx = store.pool().begin().await.unwrap();
    MySqlWriter.insert_order(&mut tx, &orders, 10, 1).await;
    let events: Vec<NewEvent> = (10..20).map(order_created).collect();
    // `&mut tx` works as well as `&mut *tx`.
    let done = store
        .outbox()
        .enqueue_batch(&mut tx, &events)
        .await
        .unwrap();
    assert!(done.iter().all(|e| e.created));
    assert_eq!(
        scenario::counts(&MySqlWriter, &store, &orders).await,
        (0, 0)
    );
    assert_eq!(store.stats().await.unwrap().pending, 0);
    tx.commit().await.unwrap();
    assert_eq!(
        scenario::counts(&MySqlWriter, &store, &orders).await,
        (1, 10)
    );
    let claimed = store.claim(&scenario::claim_up_to(100)).await.unwrap();
    let ids: Vec<_> = claimed.events.iter().map(|e| e.id).collect();
    let want: Vec<_> = events.iter().map(NewEvent::id).collect();
    assert_eq!(ids, want, "the batch is stored in its order");
}

#[tokio::test]
async fn dropping_the_transaction_rolls_the_event_back() {
    let store = common::fresh_store().await;
    {
        let mut tx = store.pool().begin().await.unwrap();
        store
            .outbox()
            .enqueue(&mut *tx, &order_created(7))
            .await
            .unwrap();
        // Dropped without commit, as when the handler returns early with an error.
    }
    let orders = MySqlWriter.business_table(&store).await;
    assert_eq!(
        scenario::counts(&MySqlWriter, &store, &orders).await,
        (0, 0)
    );
}

#[tokio::test]
async fn enqueue_futures_are_send() {
    // A web handler or `tokio::spawn` needs the future to be `Send`; a generic `Acquire`
    // parameter would not be, so this is a compile-time check as much as a test.
    let store = common::fresh_store().await;
    let task = tokio::spawn(async move {
        let mut tx = store.pool().begin().await.unwrap();
        let done = store
            .outbox()
            .enqueue(&mut *tx, &order_created(9))
            .await
            .unwrap();
        store
            .outbox()
            .enqueue_batch(&mut *tx, &[order_created(10)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        store.get(done.id).await.unwrap().is_some()
    });
    assert!(task.await.unwrap());
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_to_race() {
    let (pool, outbox) = common::unmigrated_outbox(10).await;
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (0, 6));
    let reports = race(6, |_| {
        let (outbox, pool) = (outbox.clone(), pool.clone());
        async move { outbox.migrate(&pool).await.unwrap() }
    })
    .await;
    let mut applied = Vec::new();
    for report in reports {
        assert_eq!(report.current, 6);
        applied.extend(report.applied);
    }
    assert_eq!(
        applied,
        vec![1, 2, 3, 4, 5, 6],
        "exactly one racer applied each version"
    );
    let store = MySqlStore::new(pool.clone(), outbox.clone());
    let id = store
        .outbox()
        .enqueue(&pool, &order_created(1))
        .await
        .unwrap()
        .id;
    let again = outbox.migrate(&pool).await.unwrap();
    assert!(again.applied.is_empty(), "migrating twice is a no-op");
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (6, 6));
    assert!(
        store.get(id).await.unwrap().is_some(),
        "data survives a re-run"
    );
    store.check().await.unwrap();
    // The bookkeeping table sits next to the outbox, not in the application's `_sqlx_migrations`.
    let exists: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(format!("{}_migrations", outbox.table()))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(exists, 1);
    // The migration lock is not left behind: claims and migrations go on.
    let lock_free: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT IS_FREE_LOCK(CONCAT('outbox:migrate:', MD5(CONCAT(DATABASE(), '.', '{}'))))",
        outbox.table()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(lock_free, Some(1));
}

#[tokio::test]
async fn a_migration_interrupted_after_its_ddl_completes_on_the_next_run() {
    // MySQL DDL is not transactional: simulate a crash between the DDL (CREATE TABLE; ADD
    // COLUMN and CREATE TABLE of version 2, the procedure of version 3, the default and triggers of
    // version 4, the procedure replaced by version 5, the batch procedure of version 6) and the
    // bookkeeping rows by deleting the rows.
    let (pool, outbox) = common::unmigrated_outbox(2).await;
    outbox.migrate(&pool).await.unwrap();
    common::execute(
        &pool,
        format!("DELETE FROM `{}_migrations`", outbox.table()),
    )
    .await;
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (0, 6));
    let report = outbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (6, 6));
}

#[tokio::test]
async fn a_foreign_table_with_the_outbox_name_is_not_taken_for_an_outbox() {
    let (pool, outbox) = common::unmigrated_outbox(2).await;
    common::execute(
        &pool,
        format!(
            "CREATE TABLE {} (id BIGINT PRIMARY KEY, name TEXT) ENGINE = InnoDB",
            outbox.quoted_table()
        ),
    )
    .await;
    let err = outbox.migrate(&pool).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Database(m) if m.contains("not an outbox table")),
        "{err}"
    );
    assert_eq!(outbox.schema_version(&pool).await.unwrap().0, 0);
}

#[tokio::test]
async fn invalid_table_names_are_refused_before_any_sql() {
    for bad in [
        "Outbox",
        "bad-name",
        "x`; DROP TABLE y; --",
        "db.events",
        "",
        &"a".repeat(49),
    ] {
        let err = MySqlOutbox::with_table(bad).unwrap_err();
        assert!(matches!(err, StoreError::Invalid(_)), "{bad:?}: {err}");
        assert!(
            err.to_string().contains("not a plain identifier"),
            "{bad:?}: {err}"
        );
    }
    assert_eq!(MySqlOutbox::new().table(), "outbox_events");
}

#[tokio::test]
async fn a_store_on_an_unmigrated_table_says_to_migrate() {
    let (pool, outbox) = common::unmigrated_outbox(2).await;
    let store = MySqlStore::new(pool, outbox);
    let err = store.check().await.unwrap_err();
    assert!(matches!(err, StoreError::NotMigrated(_)), "{err}");
    outbox_testkit::assert_mentions(&err, "outbox migrate");
    let err = store.stats().await.unwrap_err();
    assert!(matches!(err, StoreError::NotMigrated(_)), "{err}");
    let err = store
        .outbox()
        .enqueue(store.pool(), &order_created(1))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotMigrated(_)), "{err}");
}
