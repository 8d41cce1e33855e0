//! `PgStore::with_delete_on_ack`: an acked event's row is deleted instead of marked delivered,
//! and everything else about the lease (fencing, order, retries) is unchanged.

mod common;

use std::time::Duration;

use outbox_postgresql::PgStore;
use outbox_testkit::numbered;
use outbox_types::{ClaimRequest, DeadLetterPolicy, RetryEvent, Store};

fn request(owner: &str, lease: Duration) -> ClaimRequest {
    ClaimRequest::new(owner, 100, lease, DeadLetterPolicy::Block)
}

async fn rows(store: &PgStore) -> Vec<(String, String)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT aggregate_id || '/' || (payload->>'n'), status FROM {} ORDER BY seq",
        store.outbox().qualified_table()
    )))
    .fetch_all(store.pool())
    .await
    .unwrap()
}

async fn check_delete_on_ack(store: PgStore) {
    let store = store.with_delete_on_ack(true);
    common::enqueue_committed(
        &store,
        &[numbered("a", 1), numbered("a", 2), numbered("b", 1)],
    )
    .await;

    // The first claim takes all three; acking a/1 and b/1 deletes their rows, and a/2 (not
    // published: say its wave never came) is released untouched.
    let claim = store
        .claim(&request("r1", Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(claim.events.len(), 3);
    let seqs = outbox_store_tests::seqs_of(&claim.events);
    assert_eq!(
        store.ack(&claim.lease, &[seqs[0], seqs[2]]).await.unwrap(),
        2
    );
    assert_eq!(store.release(&claim.lease, &[seqs[1]]).await.unwrap(), 1);
    assert_eq!(rows(&store).await, vec![("a/2".into(), "pending".into())]);

    // a/2 is claimable now that a/1 is gone. An expired lease is re-claimed; the stale owner's
    // ack is fenced and deletes nothing, the new owner's retry keeps the row.
    let stale = store
        .claim(&request("r1", Duration::from_millis(1)))
        .await
        .unwrap();
    assert_eq!(stale.events.len(), 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let fresh = store
        .claim(&request("r2", Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(fresh.events.len(), 1);
    let seq = fresh.events[0].seq;
    assert_eq!(store.ack(&stale.lease, &[seq]).await.unwrap(), 0);
    assert_eq!(rows(&store).await, vec![("a/2".into(), "in_flight".into())]);
    let retry = RetryEvent {
        counts_attempt: true,
        seq,
        delay: Duration::ZERO,
        error: "try again".into(),
    };
    assert_eq!(store.retry(&fresh.lease, &[retry]).await.unwrap(), 1);
    assert_eq!(rows(&store).await, vec![("a/2".into(), "pending".into())]);

    let last = store
        .claim(&request("r2", Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(store.ack(&last.lease, &[seq]).await.unwrap(), 1);
    assert!(rows(&store).await.is_empty());
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.delivered), (0, 0));
    if store.outbox().partitioning().is_some() {
        // The ids' entries in the keys table went with the rows.
        assert_eq!(common::keys_rows(&store).await, 0);
    }
}

common::both_layouts! {
    check_delete_on_ack:
        ack_deletes_the_rows_and_stale_acks_stay_fenced,
        ack_deletes_the_rows_in_the_partitioned_layout;
}
