//! Per-aggregate order when rows are locked by someone else at claim time.
//!
//! The claim uses `FOR UPDATE SKIP LOCKED`. A pending event whose row another transaction holds
//! at that moment (a stalled relay's late retry or release of an expired lease, an operator's
//! `SELECT … FOR UPDATE`) is skipped; the claim must then also leave the later events of that
//! aggregate alone instead of handing them out first. A writer's enqueue never holds another
//! event's row: a duplicate idempotency key is read, not locked.

mod common;

use std::time::Duration;

use outbox_postgresql::PgStore;
use outbox_store_tests::claim_as;
use outbox_testkit::numbered;
use outbox_types::{ClaimRequest, DeadLetterPolicy, Event, Store};

/// The labels of what `owner` claims now, under a lease of a minute.
async fn claimed(store: &PgStore, owner: &str) -> Vec<String> {
    labels(&store.claim(&claim_as(owner, 100)).await.unwrap().events)
}

/// What `owner` claims while a/1's row is locked, then after `unlock` (the commit or rollback
/// of the locking transaction, run only between the two claims): b/1 alone (`why`), then a/1
/// and a/2 in order.
async fn a_waits_until_unlocked(
    store: &PgStore,
    owner: &str,
    unlock: impl Future<Output = Result<(), sqlx::Error>>,
    why: &str,
) {
    assert_eq!(claimed(store, owner).await, vec!["b/1"], "{why}");
    unlock.await.unwrap();
    assert_eq!(claimed(store, owner).await, vec!["a/1", "a/2"]);
}

fn labels(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            let v: serde_json::Value = serde_json::from_str(&e.payload).unwrap();
            format!("{}/{}", e.aggregate_id, v["n"])
        })
        .collect()
}

/// A writer whose enqueue hits an existing event's idempotency key (a retry of its business
/// transaction, or another service naming that key) learns the event's id without locking its
/// row: with its transaction still open, the claim takes that event and its aggregate at once.
/// (The upsert of earlier versions locked the row until the writer's transaction ended, so a
/// writer could hold any event whose key it knew.)
async fn a_duplicate_key_enqueue_holds_no_lock_on_the_existing_event(store: PgStore) {
    let a1 = numbered("a", 1).with_idempotency_key("a-1");
    common::enqueue_committed(&store, &[a1.clone(), numbered("a", 2), numbered("b", 1)]).await;

    let mut writer = store.pool().begin().await.unwrap();
    let again = store
        .outbox()
        .enqueue(&mut *writer, &numbered("a", 1).with_idempotency_key("a-1"))
        .await
        .unwrap();
    assert_eq!((again.id, again.created), (a1.id(), false));
    assert_eq!(
        claimed(&store, "relay").await,
        vec!["a/1", "a/2", "b/1"],
        "nothing waits for the writer's transaction"
    );
    writer.commit().await.unwrap();
}

common::both_layouts! {
    a_duplicate_key_enqueue_holds_no_lock_on_the_existing_event:
        a_duplicate_key_enqueue_locks_nothing,
        a_duplicate_key_enqueue_locks_nothing_in_the_partitioned_layout;
}

#[tokio::test]
async fn a_locked_earlier_event_holds_back_its_aggregate_stalled_relay_write() {
    let store = common::fresh_store().await;
    common::enqueue_committed(
        &store,
        &[numbered("a", 1), numbered("b", 1), numbered("a", 2)],
    )
    .await;

    // Relay 1 claims a/1 alone, then stalls past its lease.
    let stalled = store
        .claim(&ClaimRequest::new(
            "stalled",
            1,
            Duration::from_millis(100),
            DeadLetterPolicy::Block,
        ))
        .await
        .unwrap();
    assert_eq!(labels(&stalled.events), vec!["a/1"]);
    tokio::time::sleep(Duration::from_millis(250)).await;

    // Its late write (here: a row lock, as its retry UPDATE holds while it runs) is under way
    // when relay 2 claims.
    let mut late = store.pool().begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT seq FROM {} WHERE seq = $1 FOR UPDATE",
        store.outbox().qualified_table()
    )))
    .bind(stalled.events[0].seq)
    .fetch_one(&mut *late)
    .await
    .unwrap();

    a_waits_until_unlocked(
        &store,
        "relay-2",
        late.rollback(),
        "a/2 must not overtake the expired, locked a/1",
    )
    .await;
}
