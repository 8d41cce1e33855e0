//! Admin commands against a real SQLite outbox: dead list/show/retry/discard and cleanup.

mod common;

use common::{outbox, text};

use std::time::Duration;

use outbox_sqlite::{SqliteOutbox, SqliteStore};
use outbox_types::{BuryEvent, ClaimRequest, DeadLetterPolicy, NewEvent, Store};

#[tokio::test]
async fn dead_events_can_be_listed_shown_requeued_and_discarded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admin.db");
    let url = format!("sqlite://{}", path.display());
    let store = SqliteStore::connect(&url, SqliteOutbox::new())
        .await
        .unwrap();
    store.outbox().migrate(store.pool()).await.unwrap();
    let events: Vec<NewEvent> = (0..4)
        .map(|i| {
            NewEvent::new(
                "order",
                format!("{i}"),
                "OrderCreated",
                &serde_json::json!({"i": i}),
            )
            .unwrap()
        })
        .collect();
    enqueue_committed!(store, &events);
    let claim = store
        .claim(&ClaimRequest::new(
            "t",
            4,
            Duration::from_secs(60),
            DeadLetterPolicy::Block,
        ))
        .await
        .unwrap();
    let buries: Vec<BuryEvent> = claim.events[..2]
        .iter()
        .map(|e| BuryEvent {
            seq: e.seq,
            error: "rejected by test: 400 Bad Request".into(),
        })
        .collect();
    store.bury(&claim.lease, &buries).await.unwrap();
    store
        .ack(&claim.lease, &[claim.events[2].seq])
        .await
        .unwrap();
    store
        .release(&claim.lease, &[claim.events[3].seq])
        .await
        .unwrap();

    let o = outbox(&["dead", "list", "--database-url", &url, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let listed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2);
    let o = outbox(&["dead", "list", "--database-url", &url]);
    common::assert_contains(&text(&o), "400 Bad Request");

    let first = events[0].id().to_string();
    let o = outbox(&["dead", "show", "--database-url", &url, &first]);
    assert!(o.status.success(), "{}", text(&o));
    common::assert_contains(&text(&o), "state            dead");
    common::assert_contains(&text(&o), r#""i":0"#);

    let o = outbox(&[
        "dead",
        "requeue",
        "--database-url",
        &url,
        &first,
        &events[3].id().to_string(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    common::assert_contains(&text(&o), "requeued 1 dead event(s)");
    common::assert_contains(&text(&o), "1 of the given ids were not dead events");

    // The old spelling still works, with a warning naming the new one.
    let o = outbox(&["dead", "discard", "--database-url", &url, "--all", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    common::assert_contains(
        &text(&o),
        "`outbox dead discard` is deprecated: use `outbox dead purge`",
    );
    let done: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (&done["purged"], &done["discarded"]),
        (&1.into(), &1.into())
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.dead, stats.pending, stats.delivered),
        (0, 2, 1),
        "{stats:?}"
    );

    let o = outbox(&["dead", "requeue", "--database-url", &url, "not-a-uuid"]);
    common::exits_2_saying(&o, "`not-a-uuid` is not an event id");
    let o = outbox(&["dead", "retry", "--database-url", &url]);
    common::exits_2_saying(
        &o,
        "`outbox dead retry` is deprecated: use `outbox dead requeue`",
    );
    let o = outbox(&["dead", "show", "--database-url", &url, &uuid_like()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    common::assert_contains(&text(&o), "no event with id");

    tokio::time::sleep(Duration::from_millis(20)).await;
    let o = outbox(&[
        "purge",
        "--database-url",
        &url,
        "--older-than",
        "1ms",
        "--json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let done: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(done["deleted"], 1, "only the delivered event goes");
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.delivered, stats.pending), (0, 2), "{stats:?}");
}

fn uuid_like() -> String {
    outbox_types::EventId::new().to_string()
}
