//! Migrations, table names, and the SQLite-specific edges of enqueue and error mapping.

mod common;

use std::time::Duration;

use common::TempStore;
use outbox_sqlite::{SqliteOutbox, SqliteStore};
use outbox_store_tests::{claim_up_to, claims_nothing};
use outbox_testkit::concurrent::race;
use outbox_types::{ClaimRequest, NewEvent, Store, StoreError};
use sqlx::sqlite::SqlitePoolOptions;

async fn tables(store: &SqliteStore) -> Vec<String> {
    sqlx::query_scalar("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn migrate_twice_is_a_no_op() {
    let (_dir, path) = TempStore::dir();
    let store = common::open(&path, SqliteOutbox::new()).await;
    assert_eq!(
        store.outbox().schema_version(store.pool()).await.unwrap(),
        (0, 4)
    );
    let first = store.outbox().migrate(store.pool()).await.unwrap();
    assert_eq!(first.applied, vec![1, 2, 3, 4]);
    assert_eq!(first.current, 4);
    let id = store
        .outbox()
        .enqueue(store.pool(), &outbox_testkit::numbered("a", 1))
        .await
        .unwrap()
        .id;
    let again = store.outbox().migrate(store.pool()).await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(again.current, 4);
    assert_eq!(
        store.outbox().schema_version(store.pool()).await.unwrap(),
        (4, 4)
    );
    assert!(
        store.get(id).await.unwrap().is_some(),
        "data survives a re-run"
    );
    store.check().await.unwrap();
    // Bookkeeping sits next to the outbox, not in the application's `_sqlx_migrations`.
    let names = tables(&store).await;
    assert!(names.contains(&"outbox_events".to_owned()), "{names:?}");
    assert!(
        names.contains(&"outbox_events_migrations".to_owned()),
        "{names:?}"
    );
    assert!(!names.contains(&"_sqlx_migrations".to_owned()));
}

#[tokio::test]
async fn migrations_racing_from_several_pools_apply_once() {
    let (_dir, path) = TempStore::dir();
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(common::open(&path, SqliteOutbox::new()).await);
    }
    // Two racers on each pool.
    let reports = race(6, |i| {
        let store = stores[i / 2].clone();
        async move { store.outbox().migrate(store.pool()).await.unwrap() }
    })
    .await;
    let applied: Vec<_> = reports.into_iter().flat_map(|r| r.applied).collect();
    assert_eq!(
        applied,
        vec![1, 2, 3, 4],
        "exactly one racer applied each version"
    );
}

#[tokio::test]
async fn a_custom_table_name_is_used_everywhere() {
    let outbox = SqliteOutbox::with_table("billing_events").unwrap();
    assert_eq!(outbox.table(), "billing_events");
    assert_eq!(outbox.quoted_table(), "\"billing_events\"");
    let store = TempStore::with_outbox(outbox).await;
    // A second, default outbox in the same file is independent.
    let default = SqliteStore::new(store.pool().clone(), SqliteOutbox::new());
    default.outbox().migrate(default.pool()).await.unwrap();

    let names = tables(&store).await;
    for want in [
        "billing_events",
        "billing_events_migrations",
        "outbox_events",
        "outbox_events_migrations",
    ] {
        assert!(names.contains(&want.to_owned()), "{want} in {names:?}");
    }
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_schema WHERE type = 'index' AND tbl_name = 'billing_events' ORDER BY name",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    for want in [
        "billing_events_blockers",
        "billing_events_idempotency_key",
        "billing_events_open",
    ] {
        assert!(indexes.contains(&want.to_owned()), "{want} in {indexes:?}");
    }

    let ids = common::enqueue_committed(&store, &[outbox_testkit::numbered("a", 1)]).await;
    assert_eq!(default.stats().await.unwrap().pending, 0);
    let claim = store.claim(&claim_up_to(100)).await.unwrap();
    assert_eq!(claim.events[0].id, ids[0].0);
    assert_eq!(
        store
            .ack(&claim.lease, &[claim.events[0].seq])
            .await
            .unwrap(),
        1
    );
    assert_eq!(store.stats().await.unwrap().delivered, 1);
    assert!(claims_nothing(&default).await);
}

#[tokio::test]
async fn invalid_table_names_are_refused_with_a_clear_message() {
    let err = SqliteOutbox::with_table("Outbox").unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)));
    let msg = err.to_string();
    assert!(msg.contains("table `Outbox`"), "{msg}");
    assert!(msg.contains("lowercase letters, digits and `_`"), "{msg}");
    for bad in ["", "bad-name", "events\"; DROP TABLE orders; --", "9lives"] {
        assert!(SqliteOutbox::with_table(bad).is_err(), "{bad:?}");
    }
    let msg = SqliteOutbox::with_table("sqlite_outbox")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("reserves"), "{msg}");
}

#[tokio::test]
async fn a_store_on_an_unmigrated_file_says_to_migrate() {
    let (_dir, path) = TempStore::dir();
    let store = common::open(&path, SqliteOutbox::new()).await;
    let err = store.check().await.unwrap_err();
    assert!(matches!(err, StoreError::NotMigrated(_)), "{err}");
    outbox_testkit::assert_mentions(&err, "outbox migrate");
    for err in [
        store.stats().await.unwrap_err(),
        store.claim(&claim_up_to(100)).await.unwrap_err(),
        store
            .outbox()
            .enqueue(store.pool(), &outbox_testkit::numbered("a", 1))
            .await
            .unwrap_err(),
    ] {
        assert!(matches!(err, StoreError::NotMigrated(_)), "{err}");
        assert!(!err.is_transient());
    }
}

#[tokio::test]
async fn connect_creates_the_file_in_wal_mode() {
    let (_dir, path) = TempStore::dir();
    assert!(!path.exists());
    let url = format!("sqlite://{}", path.display());
    let store = SqliteStore::connect(&url, SqliteOutbox::new())
        .await
        .unwrap();
    assert!(path.exists());
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(sync, 1, "NORMAL");
    let busy: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(busy, 5000);
    let fk: i64 = sqlx::query_scalar("PRAGMA foreign_keys")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(fk, 1);
}

#[tokio::test]
async fn an_unreachable_file_is_a_transient_error() {
    let err = SqliteStore::connect("/nonexistent-dir/for/sure/outbox.db", SqliteOutbox::new())
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
    outbox_testkit::assert_mentions(&err, "/nonexistent-dir");
    assert!(matches!(
        SqliteStore::connect("", SqliteOutbox::new()).await,
        Err(StoreError::Invalid(_))
    ));
}

#[tokio::test]
async fn a_write_lock_held_past_the_busy_timeout_is_transient() {
    let store = TempStore::new().await;
    common::enqueue_committed(&store, &[outbox_testkit::numbered("a", 1)]).await;
    // Another "process" with a short busy timeout.
    let options = SqliteStore::connect_options(store.path.to_str().unwrap())
        .unwrap()
        .busy_timeout(Duration::from_millis(200));
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    let impatient = SqliteStore::new(pool, store.outbox().clone());
    let tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let err = impatient.claim(&claim_up_to(100)).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Unavailable(_)) && err.is_transient(),
        "{err}"
    );
    // Readers are not blocked by the writer (WAL).
    assert_eq!(impatient.stats().await.unwrap().pending, 1);
    tx.rollback().await.unwrap();
    assert_eq!(
        impatient
            .claim(&claim_up_to(100))
            .await
            .unwrap()
            .events
            .len(),
        1
    );
}

#[tokio::test]
async fn a_waiting_claim_gets_in_once_the_writer_commits() {
    let store = TempStore::new().await;
    common::enqueue_committed(&store, &[outbox_testkit::numbered("a", 1)]).await;
    let other = store.reopen().await;
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    store
        .outbox()
        .enqueue(&mut *tx, &outbox_testkit::numbered("a", 2))
        .await
        .unwrap();
    let waiting = tokio::spawn(async move { other.claim(&claim_up_to(100)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the claim waits for the write lock");
    tx.commit().await.unwrap();
    let claim = waiting.await.unwrap().unwrap();
    assert_eq!(
        claim.events.len(),
        2,
        "the claim ran after the commit and saw it"
    );
}

#[tokio::test]
async fn payloads_headers_and_times_round_trip_exactly() {
    let store = TempStore::new().await;
    let payload = "{ \"text\" : \"é✓ \\u0000 \\\"q\\\" \\n\",\n\t\"n\": [1 ,2.50, -0, 1e3] }";
    let occurred = chrono::DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap();
    let make = |agg: &str| {
        NewEvent::from_json("order", agg, "OrderCreated", payload)
            .unwrap()
            .with_destination("orders.v1")
            .with_header("tenant", "acmé")
            .with_header("quote", "\"x\"")
            .with_occurred_at(occurred)
    };
    let single = make("1");
    let batched = make("2");
    store.outbox().enqueue(store.pool(), &single).await.unwrap();
    common::enqueue_committed(&store, std::slice::from_ref(&batched)).await;
    for event in [&single, &batched] {
        let record = store.get(event.id()).await.unwrap().unwrap();
        assert_eq!(record.event.payload, payload, "payload kept byte for byte");
        assert_eq!(&record.event.headers, event.headers());
        assert_eq!(record.event.destination.as_deref(), Some("orders.v1"));
        assert_eq!(record.event.occurred_at, occurred);
        assert!(record.event.idempotency_key.is_none());
        let age = chrono::Utc::now() - record.event.enqueued_at;
        assert!(age >= chrono::TimeDelta::zero() && age < chrono::TimeDelta::seconds(10));
    }
}

#[tokio::test]
async fn the_same_event_enqueued_twice_is_not_created_twice() {
    let store = TempStore::new().await;
    let event = outbox_testkit::numbered("a", 1).with_idempotency_key("k");
    let first = store.outbox().enqueue(store.pool(), &event).await.unwrap();
    assert!(first.created);
    let again = store.outbox().enqueue(store.pool(), &event).await.unwrap();
    assert_eq!((again.id, again.created), (event.id(), false));
    let batch = common::enqueue_committed(
        &store,
        &[
            event.clone(),
            outbox_testkit::numbered("a", 2).with_idempotency_key("k"),
        ],
    )
    .await;
    assert_eq!(batch, vec![(event.id(), false), (event.id(), false)]);
    assert_eq!(store.stats().await.unwrap().pending, 1);
    // Without a key, the same id twice is a constraint error, as in PostgreSQL.
    let keyless = outbox_testkit::numbered("b", 1);
    store
        .outbox()
        .enqueue(store.pool(), &keyless)
        .await
        .unwrap();
    let err = store
        .outbox()
        .enqueue(store.pool(), &keyless)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Database(_)), "{err}");
}

#[tokio::test]
async fn a_key_freed_by_discard_can_be_used_again() {
    let store = TempStore::new().await;
    let first = outbox_testkit::numbered("a", 1).with_idempotency_key("k");
    common::enqueue_committed(&store, std::slice::from_ref(&first)).await;
    let claim = store.claim(&claim_up_to(100)).await.unwrap();
    store
        .bury(
            &claim.lease,
            &[outbox_types::BuryEvent {
                seq: claim.events[0].seq,
                error: "no".into(),
            }],
        )
        .await
        .unwrap();
    store
        .discard_dead(&outbox_types::DeadFilter::All)
        .await
        .unwrap();
    let second = outbox_testkit::numbered("a", 2).with_idempotency_key("k");
    let done = common::enqueue_committed(&store, std::slice::from_ref(&second)).await;
    assert_eq!(done, vec![(second.id(), true)]);
    // seq is never reused, even for the newest row deleted.
    let claim2 = store.claim(&claim_up_to(100)).await.unwrap();
    assert!(claim2.events[0].seq > claim.events[0].seq);
}

#[tokio::test]
async fn huge_leases_and_delays_saturate_instead_of_failing() {
    let store = TempStore::new().await;
    let ids = common::enqueue_committed(&store, &[outbox_testkit::numbered("a", 1)]).await;
    let claim = store
        .claim(&ClaimRequest {
            lease: Duration::MAX,
            ..claim_up_to(100)
        })
        .await
        .unwrap();
    let record = store.get(ids[0].0).await.unwrap().unwrap();
    assert!(record.lease_expires_at.unwrap().timestamp() > 200_000_000_000);
    store
        .retry(
            &claim.lease,
            &[outbox_types::RetryEvent {
                counts_attempt: true,
                seq: claim.events[0].seq,
                delay: Duration::MAX,
                error: "later".into(),
            }],
        )
        .await
        .unwrap();
    let record = store.get(ids[0].0).await.unwrap().unwrap();
    assert!(record.next_attempt_at.timestamp() > 200_000_000_000);
    assert!(claims_nothing(&store).await);
}
