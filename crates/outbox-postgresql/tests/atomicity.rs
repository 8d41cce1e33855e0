//! The outbox's first promise, against a real PostgreSQL: an event exists exactly when the
//! business transaction that enqueued it committed.

mod common;

use outbox_testkit::order_created;

use outbox_postgresql::{PgOutbox, PgStore};
use outbox_types::Store;
use sqlx::{Connection, Executor, PgConnection, Row};

async fn business_table(store: &outbox_postgresql::PgStore) -> String {
    let table = format!("\"{}\".orders", store.outbox().schema());
    store
        .pool()
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (id BIGINT PRIMARY KEY, amount BIGINT NOT NULL)"
        )))
        .await
        .unwrap();
    table
}

async fn counts(store: &outbox_postgresql::PgStore, orders: &str) -> (i64, i64) {
    let o: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {orders}"
    )))
    .fetch_one(store.pool())
    .await
    .unwrap();
    let e: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        store.outbox().qualified_table()
    )))
    .fetch_one(store.pool())
    .await
    .unwrap();
    (o, e)
}

#[tokio::test]
async fn committed_transaction_keeps_order_and_event_together() {
    let store = common::fresh_store().await;
    let orders = business_table(&store).await;
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {orders} VALUES (1, 1999)"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    let done = store
        .outbox()
        .enqueue(&mut *tx, &order_created(1))
        .await
        .unwrap();
    assert!(done.created);
    assert_eq!(
        counts(&store, &orders).await,
        (0, 0),
        "enqueue never commits on its own"
    );
    tx.commit().await.unwrap();
    assert_eq!(counts(&store, &orders).await, (1, 1));
    let record = store.get(done.id).await.unwrap().unwrap();
    assert_eq!(record.event.event_type, "OrderCreated");
}

#[tokio::test]
async fn rolled_back_transaction_leaves_neither() {
    let store = common::fresh_store().await;
    let orders = business_table(&store).await;
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {orders} VALUES (2, 5)"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    store
        .outbox()
        .enqueue(&mut *tx, &order_created(2))
        .await
        .unwrap();
    store
        .outbox()
        .enqueue_batch(&mut *tx, &[order_created(3), order_created(4)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(counts(&store, &orders).await, (0, 0));
    assert_eq!(store.stats().await.unwrap().pending, 0);
}

#[tokio::test]
async fn a_writer_that_dies_before_commit_leaves_nothing() {
    let store = common::fresh_store().await;
    let orders = business_table(&store).await;
    let mut writer = PgConnection::connect(&common::database_url())
        .await
        .unwrap();
    let pid: i32 = writer
        .fetch_one("SELECT pg_backend_pid()")
        .await
        .unwrap()
        .get(0);
    writer.execute("BEGIN").await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {orders} VALUES (5, 5)"
    )))
    .execute(&mut writer)
    .await
    .unwrap();
    store
        .outbox()
        .enqueue(&mut writer, &order_created(5))
        .await
        .unwrap();
    // The writer's process dies mid-transaction.
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(killed);
    assert!(
        writer.execute("COMMIT").await.is_err(),
        "the commit cannot happen any more"
    );
    assert_eq!(counts(&store, &orders).await, (0, 0));
}

#[tokio::test]
async fn enqueue_through_the_pool_autocommits_like_any_statement() {
    let store = common::fresh_store().await;
    let done = store
        .outbox()
        .enqueue(store.pool(), &order_created(6))
        .await
        .unwrap();
    assert!(store.get(done.id).await.unwrap().is_some());
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_to_race() {
    let pool = common::pool(10).await;
    let outbox = PgOutbox::with_names(&common::unique_schema(), "my_events").unwrap();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let outbox = outbox.clone();
        let pool = pool.clone();
        tasks.push(tokio::spawn(
            async move { outbox.migrate(&pool).await.unwrap() },
        ));
    }
    let mut applied = Vec::new();
    for t in tasks {
        applied.extend(t.await.unwrap().applied);
    }
    assert_eq!(
        applied,
        vec![1, 2, 3, 4, 5, 6],
        "exactly one racer applied each version"
    );
    let again = outbox.migrate(&pool).await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (6, 6));
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
/// with the new mark, and the function and the header trigger appear.
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
    assert_eq!(outbox.schema_version(&pool).await.unwrap(), (3, 6));
    let store = PgStore::new(pool.clone(), outbox.clone());
    outbox
        .enqueue(&pool, &outbox_testkit::numbered("a", 1))
        .await
        .unwrap();
    let report = outbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied, vec![4, 5, 6]);
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
