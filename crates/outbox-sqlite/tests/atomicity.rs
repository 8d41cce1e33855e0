//! The outbox's first promise, against a real SQLite file: an event exists exactly when the
//! business transaction that enqueued it committed. Visibility is always checked through another
//! pool (what another process would see), never through the writer's own connection.

mod common;

use outbox_testkit::order_created;

use std::time::Duration;

use common::{SqliteWriter, TempStore};
use outbox_store_tests::{self as scenario, Writer};
use outbox_types::{NewEvent, Store};
use tokio::io::{AsyncBufReadExt, BufReader};

const CHILD_ENV: &str = "OUTBOX_SQLITE_CHILD_DB";

/// (orders, outbox events) as seen through `store`'s pool.
async fn counts(store: &TempStore) -> (i64, i64) {
    scenario::counts(&SqliteWriter, store, "orders").await
}

outbox_store_tests::writer_tests!(SqliteWriter;
    committed_transaction_keeps_order_and_event_together,
    rolled_back_transaction_leaves_neither,
    enqueue_through_the_pool_autocommits_like_any_statement,
);

#[tokio::test]
async fn a_transaction_dropped_without_commit_leaves_nothing() {
    let store = TempStore::new().await;
    SqliteWriter.business_table(&store).await;
    {
        let mut tx = SqliteWriter.begin(&store).await;
        SqliteWriter.insert_order(&mut tx, "orders", 7, 7).await;
        store
            .outbox()
            .enqueue_batch(&mut *tx, &[order_created(7), order_created(8)])
            .await
            .unwrap();
        // The writer's code returns early (an error, a panic unwinding): no commit.
    }
    store.pool().close().await;
    let reopened = SqliteWriter.observer(&store).await;
    assert_eq!(counts(&reopened).await, (0, 0));
    // The write lock went with the connection: the next writer gets in at once.
    let done = reopened
        .outbox()
        .enqueue(reopened.pool(), &order_created(9))
        .await
        .unwrap();
    assert!(reopened.get(done.id).await.unwrap().is_some());
}

/// Not a test on its own: the body of the child process of
/// `a_writer_process_killed_before_commit_leaves_nothing`.
#[tokio::test]
#[ignore = "run as a child process by a_writer_process_killed_before_commit_leaves_nothing"]
async fn child_writer_that_never_commits() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = common::open(path.as_ref(), outbox_sqlite::SqliteOutbox::new()).await;
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    // A tiny page cache makes SQLite spill uncommitted pages into the WAL file before any
    // commit, so the crash leaves real uncommitted frames behind for recovery to ignore.
    sqlx::query("PRAGMA cache_size = 8")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("INSERT INTO orders VALUES (5, 5)")
        .execute(&mut *tx)
        .await
        .unwrap();
    store
        .outbox()
        .enqueue(&mut *tx, &order_created(5))
        .await
        .unwrap();
    let many: Vec<NewEvent> = (100..2100).map(order_created).collect();
    store.outbox().enqueue_batch(&mut *tx, &many).await.unwrap();
    println!("CHILD-READY");
    tokio::time::sleep(Duration::from_secs(600)).await;
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn a_writer_process_killed_before_commit_leaves_nothing() {
    let store = TempStore::new().await;
    SqliteWriter.business_table(&store).await;
    let mut child = common::spawn_child("child_writer_that_never_commits", CHILD_ENV, &store.path);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("CHILD-READY") {
                return true;
            }
        }
        false
    })
    .await
    .unwrap();
    assert!(ready, "the child writer did not start");
    assert_eq!(
        counts(&store).await,
        (0, 0),
        "uncommitted writes are invisible"
    );
    let wal = std::fs::metadata(store.path.with_extension("db-wal"))
        .map(|m| m.len())
        .unwrap_or(0);
    assert!(
        wal > 64 * 1024,
        "the child spilled uncommitted pages: {wal} bytes of WAL"
    );
    // The writer's process dies mid-transaction.
    child.kill().await.unwrap();
    store.pool().close().await;

    let reopened = SqliteWriter.observer(&store).await;
    assert_eq!(
        counts(&reopened).await,
        (0, 0),
        "nothing survived the crash"
    );
    let integrity: String = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_one(reopened.pool())
        .await
        .unwrap();
    assert_eq!(integrity, "ok");
    // The dead writer's lock is gone: writes and claims go on.
    let done = reopened
        .outbox()
        .enqueue(reopened.pool(), &order_created(6))
        .await
        .unwrap();
    let claim = reopened.claim(&scenario::claim_up_to(10)).await.unwrap();
    assert_eq!(
        claim.events.iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![done.id]
    );
}

#[tokio::test]
async fn a_business_failure_after_enqueue_rolls_the_event_back() {
    let store = TempStore::new().await;
    SqliteWriter.business_table(&store).await;
    sqlx::query("INSERT INTO orders VALUES (1, 1)")
        .execute(store.pool())
        .await
        .unwrap();
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    store
        .outbox()
        .enqueue(&mut *tx, &order_created(1))
        .await
        .unwrap();
    // The business insert fails (duplicate key); the caller gives up the transaction.
    let failed = sqlx::query("INSERT INTO orders VALUES (1, 2)")
        .execute(&mut *tx)
        .await;
    assert!(failed.is_err());
    drop(tx);
    assert_eq!(counts(&SqliteWriter.observer(&store).await).await, (1, 0));
}
