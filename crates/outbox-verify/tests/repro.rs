//! Deterministic reproductions of what the harness found, in the store alone. Each is
//! `#[ignore]`d while the bug is open; run with `cargo test -p outbox-verify --test repro --
//! --include-ignored`.

use std::time::Duration;

use outbox_postgresql::{PgOutbox, PgStore};
use outbox_sink_tests::{database_url, enqueue_committed};
use outbox_types::{Claim, ClaimRequest, DeadLetterPolicy, NewEvent, Store};
use sqlx::AssertSqlSafe;

/// `relay` claims up to 10 events for `lease`; the two relays below differ only in those.
async fn claim(store: &PgStore, relay: &str, lease: Duration) -> Claim {
    let request = ClaimRequest::new(relay, 10, lease, DeadLetterPolicy::Block);
    store.claim(&request).await.unwrap()
}

/// The long profile (seed 2026) saw 5 per-aggregate order violations on NATS: event #N retried,
/// #N+1 delivered before it. The mechanism: relay A's write-back for #N (a retry) runs after its
/// lease expired (the database was restarting, so the write was late) and holds #N's row lock
/// for the statement; relay B's claim then skips #N (`FOR UPDATE SKIP LOCKED`) but does not
/// count it as a blocker (an expired in-flight row never blocks), so it claims #N+1 alone and
/// publishes it first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_never_takes_a_later_event_while_an_earlier_one_is_skipped() {
    let schema = format!("outbox_t_repro_{}", std::process::id());
    let store = PgStore::connect(
        &database_url(),
        PgOutbox::with_names(&schema, "events").unwrap(),
    )
    .await
    .unwrap();
    store.outbox().migrate(store.pool()).await.unwrap();
    let first = NewEvent::new("order", "1", "A", &1).unwrap();
    let second = NewEvent::new("order", "1", "B", &2).unwrap();
    enqueue_committed(&store, &[first.clone(), second.clone()]).await;

    // Relay A claims both with a lease that runs out at once.
    let claim_a = claim(&store, "relay-a", Duration::from_millis(1)).await;
    assert_eq!(claim_a.events.len(), 2);
    tokio::time::sleep(Duration::from_millis(20)).await;

    // A's late write-back of the first event is in progress: its row is locked.
    let mut writer = store.pool().begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE id = $1 FOR UPDATE",
        store.outbox().qualified_table()
    )))
    .bind(first.id().as_uuid())
    .execute(&mut *writer)
    .await
    .unwrap();

    // Relay B claims meanwhile.
    let claim_b = claim(&store, "relay-b", Duration::from_secs(30)).await;
    writer.rollback().await.unwrap();
    let ids: Vec<_> = claim_b.events.iter().map(|e| e.id).collect();
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(store.pool())
        .await;
    assert!(
        !ids.contains(&second.id()) || ids.contains(&first.id()),
        "B claimed the second event of the aggregate without the first: it will publish it first"
    );
}
