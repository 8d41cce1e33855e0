//! The MySQL-specific edges: byte-exact payloads, exact idempotency keys, duplicates against
//! rows of other transactions, locked rows in a claim, the claim lock, and error mapping.

mod common;

use std::time::Duration;

use outbox_mysql::{CLAIM_LOCK_WAIT_SECONDS, MySqlStore};
use outbox_store_tests::{claim_up_to, claims_nothing};
use outbox_testkit::numbered;
use outbox_types::{ClaimRequest, EventState, NewEvent, Store, StoreError};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Connection, Executor, MySqlConnection};

/// The aggregate ids of claimed events, in claim order.
fn aggregate_ids(events: &[outbox_types::Event]) -> Vec<&str> {
    events.iter().map(|e| e.aggregate_id.as_str()).collect()
}

/// Enqueue `events` in one batch through the pool; each one must be new.
async fn enqueue_new(store: &MySqlStore, events: &[NewEvent]) {
    let done = store
        .outbox()
        .enqueue_batch(store.pool(), events)
        .await
        .unwrap();
    assert!(done.iter().all(|e| e.created), "{done:?}");
}

/// The one `BIGINT` the statement `sql` selects, read on `conn`.
async fn select_i64(conn: &mut MySqlConnection, sql: String) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(conn)
        .await
        .unwrap()
}

async fn connect() -> MySqlConnection {
    MySqlConnection::connect(&common::database_url())
        .await
        .unwrap()
}

const ODD_PAYLOADS: &[&str] = &[
    r#"{ "b" : 2,   "a" : 1 }"#,
    "{\n\t\"text\": \"tab\\there, newline\\nthere\",\r\n \"x\": [1, 2.50, 1e3, -0]\n}",
    r#"{"é":"\u00e9 é 😀 \"quoted\" back\\slash \/ \u0000 \ud83d\ude00"}"#,
    r#"[{"nested":{"deeper":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}]"#,
    r#""just a string""#,
    "12345678901234567890123456789012345678901234567890",
    "null",
    "  {}  ",
];

#[tokio::test]
async fn payloads_and_headers_are_kept_byte_for_byte() {
    let store = common::fresh_store().await;
    let single: Vec<NewEvent> = ODD_PAYLOADS
        .iter()
        .map(|p| {
            NewEvent::from_json("agg", "single", "Odd", *p)
                .unwrap()
                .with_header("tenant", "ácmé \"x\"")
                .with_destination("topic/é")
        })
        .collect();
    for e in &single {
        store.outbox().enqueue(store.pool(), e).await.unwrap();
    }
    let batch: Vec<NewEvent> = ODD_PAYLOADS
        .iter()
        .map(|p| NewEvent::from_json("agg", "batch", "Odd", *p).unwrap())
        .collect();
    store
        .outbox()
        .enqueue_batch(store.pool(), &batch)
        .await
        .unwrap();
    let claim = store.claim(&claim_up_to(1000)).await.unwrap();
    assert_eq!(claim.events.len(), 2 * ODD_PAYLOADS.len());
    for (got, want) in claim.events.iter().zip(single.iter().chain(&batch)) {
        assert_eq!(got.id, want.id());
        assert_eq!(got.payload, want.payload(), "payload kept byte for byte");
        assert_eq!(&got.headers, want.headers());
        assert_eq!(got.destination.as_deref(), want.destination());
        assert_eq!(
            got.occurred_at.timestamp_micros(),
            want.occurred_at().timestamp_micros()
        );
    }
}

#[tokio::test]
async fn idempotency_keys_compare_exactly() {
    let store = common::fresh_store().await;
    // A case-insensitive or PAD SPACE collation would make some of these one key.
    let keys = ["k", "K", "k ", "é", "e", "É"];
    let events: Vec<NewEvent> = keys
        .iter()
        .map(|k| numbered("a", 0).with_idempotency_key(*k))
        .collect();
    enqueue_new(&store, &events).await;
    for e in &events {
        let again = store
            .outbox()
            .enqueue(
                store.pool(),
                &numbered("a", 1).with_idempotency_key(e.idempotency_key().unwrap()),
            )
            .await
            .unwrap();
        assert_eq!((again.id, again.created), (e.id(), false));
    }
    assert_eq!(store.stats().await.unwrap().pending, keys.len() as u64);
}

#[tokio::test]
async fn the_same_event_enqueued_twice_is_a_duplicate_and_a_reused_id_is_an_error() {
    let store = common::fresh_store().await;
    let keyed = numbered("a", 1).with_idempotency_key("once");
    let first = store.outbox().enqueue(store.pool(), &keyed).await.unwrap();
    assert!(first.created);
    let again = store.outbox().enqueue(store.pool(), &keyed).await.unwrap();
    assert_eq!((again.id, again.created), (keyed.id(), false));
    let in_batch = store
        .outbox()
        .enqueue_batch(store.pool(), &[numbered("b", 1), keyed.clone()])
        .await
        .unwrap();
    assert!(in_batch[0].created);
    assert_eq!((in_batch[1].id, in_batch[1].created), (keyed.id(), false));

    // Another event under an id that is taken: refused, like PostgreSQL's unique violation, and
    // the caller's transaction stays usable.
    let plain = numbered("c", 1);
    store.outbox().enqueue(store.pool(), &plain).await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let reuse = numbered("c", 2).with_id(plain.id());
    let err = store.outbox().enqueue(&mut *tx, &reuse).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Database(m) if m.contains("already has this id")),
        "{err}"
    );
    let err = store
        .outbox()
        .enqueue_batch(&mut *tx, &[numbered("d", 1), reuse.clone()])
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Database(m) if m.contains("already has this id")),
        "{err}"
    );
    let keyed_reuse = numbered("c", 3)
        .with_id(plain.id())
        .with_idempotency_key("fresh");
    assert!(
        store
            .outbox()
            .enqueue(&mut *tx, &keyed_reuse)
            .await
            .is_err()
    );
    let e1 = numbered("e", 1);
    let dup_in_batch = store
        .outbox()
        .enqueue_batch(&mut *tx, &[e1.clone(), numbered("e", 2).with_id(e1.id())])
        .await
        .unwrap_err();
    assert!(
        matches!(dup_in_batch, StoreError::Invalid(_)),
        "{dup_in_batch}"
    );
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn a_duplicate_of_a_row_committed_after_the_snapshot_asks_for_a_retry() {
    // REPEATABLE READ: the writer's snapshot is taken by its first read, before the other
    // transaction commits the key. The enqueue procedure reads the event holding the key without
    // locking its row, and that read cannot see it: a transient error (SQLSTATE 40001, as
    // PostgreSQL's serialization failures), and the retried transaction finds it. Under READ
    // COMMITTED every read sees it at once.
    let store = common::fresh_store().await;
    let mut writer = connect().await;
    writer
        .execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    let sql = format!("SELECT COUNT(*) FROM {}", store.outbox().quoted_table());
    writer.execute("START TRANSACTION").await.unwrap();
    select_i64(&mut writer, sql.clone()).await;
    let single_first = numbered("a", 1).with_idempotency_key("late-1");
    let batch_first = numbered("a", 2).with_idempotency_key("late-2");
    store
        .outbox()
        .enqueue_batch(store.pool(), &[single_first.clone(), batch_first.clone()])
        .await
        .unwrap();

    let single = numbered("b", 1).with_idempotency_key("late-1");
    let err = store
        .outbox()
        .enqueue(&mut writer, &single)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Unavailable(m) if m.contains("retry the transaction")),
        "{err}"
    );
    let batch = [
        numbered("b", 2).with_idempotency_key("late-2"),
        numbered("b", 3),
    ];
    let err = store
        .outbox()
        .enqueue_batch(&mut writer, &batch)
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
    writer.execute("ROLLBACK").await.unwrap();

    // The retry.
    writer.execute("START TRANSACTION").await.unwrap();
    select_i64(&mut writer, sql.clone()).await;
    let done = store.outbox().enqueue(&mut writer, &single).await.unwrap();
    assert_eq!((done.id, done.created), (single_first.id(), false));
    writer.execute("COMMIT").await.unwrap();

    writer
        .execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .await
        .unwrap();
    writer.execute("START TRANSACTION").await.unwrap();
    select_i64(&mut writer, sql).await;
    let later = numbered("a", 3).with_idempotency_key("late-3");
    store.outbox().enqueue(store.pool(), &later).await.unwrap();
    let done = store
        .outbox()
        .enqueue_batch(
            &mut writer,
            &[
                batch[0].clone(),
                batch[1].clone(),
                numbered("b", 4).with_idempotency_key("late-3"),
            ],
        )
        .await
        .unwrap();
    assert_eq!((done[0].id, done[0].created), (batch_first.id(), false));
    assert!(done[1].created);
    assert_eq!((done[2].id, done[2].created), (later.id(), false));
    writer.execute("COMMIT").await.unwrap();
    assert_eq!(store.stats().await.unwrap().pending, 4);
}

#[tokio::test]
async fn concurrent_writers_of_one_key_agree_on_one_event() {
    let store = common::fresh_store().await;
    let mut first = connect().await;
    first.execute("START TRANSACTION").await.unwrap();
    let a = numbered("a", 1).with_idempotency_key("race");
    assert!(
        store
            .outbox()
            .enqueue(&mut first, &a)
            .await
            .unwrap()
            .created
    );
    // The second writer waits on the first one's uncommitted key…
    let second = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut tx = store.pool().begin().await.unwrap();
            let b = numbered("b", 1).with_idempotency_key("race");
            let done = store.outbox().enqueue(&mut *tx, &b).await.unwrap();
            tx.commit().await.unwrap();
            done
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second writer waits for the first"
    );
    // …and sees its event once it commits.
    first.execute("COMMIT").await.unwrap();
    let done = second.await.unwrap();
    assert_eq!((done.id, done.created), (a.id(), false));

    // If the first one rolls back instead, the second one writes its own event.
    let mut first = connect().await;
    first.execute("START TRANSACTION").await.unwrap();
    let c = numbered("c", 1).with_idempotency_key("race-2");
    store.outbox().enqueue(&mut first, &c).await.unwrap();
    let second = {
        let store = store.clone();
        tokio::spawn(async move {
            let d = numbered("d", 1).with_idempotency_key("race-2");
            let done = store.outbox().enqueue(store.pool(), &d).await.unwrap();
            (done, d.id())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.execute("ROLLBACK").await.unwrap();
    let (done, d) = second.await.unwrap();
    assert_eq!((done.id, done.created), (d, true));
}

#[tokio::test]
async fn a_locked_due_event_holds_back_its_aggregate_and_nothing_else() {
    // SKIP LOCKED alone would skip a/1 (locked by someone's transaction: an operator's
    // statement, a stalled relay's late retry) and hand out a/2 first.
    let store = common::fresh_store().await;
    let a1 = numbered("a", 1).with_idempotency_key("a-1");
    store
        .outbox()
        .enqueue_batch(
            store.pool(),
            &[a1.clone(), numbered("a", 2), numbered("b", 1)],
        )
        .await
        .unwrap();
    let mut writer = connect().await;
    writer.execute("START TRANSACTION").await.unwrap();
    let locked = format!(
        "SELECT seq FROM {} WHERE idempotency_key = 'a-1' FOR UPDATE",
        store.outbox().quoted_table()
    );
    select_i64(&mut writer, locked).await;

    let claim = store.claim(&claim_up_to(1000)).await.unwrap();
    let got = aggregate_ids(&claim.events);
    assert_eq!(got, vec!["b"], "a/1 is locked, so a/2 must wait too");
    writer.execute("COMMIT").await.unwrap();
    let claim = store.claim(&claim_up_to(1000)).await.unwrap();
    let got: Vec<(&str, u64)> = claim
        .events
        .iter()
        .map(|e| {
            let v: serde_json::Value = serde_json::from_str(&e.payload).unwrap();
            (e.aggregate_id.as_str(), v["n"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(got, vec![("a", 1), ("a", 2)]);
}

#[tokio::test]
async fn a_locked_expired_lease_holds_back_its_aggregate() {
    // The stalled-relay variant: a/1's lease expired, and the stalled relay's late retry holds
    // its row lock at the moment of the next claim. a/2 must not overtake it.
    let store = common::fresh_store().await;
    store
        .outbox()
        .enqueue_batch(
            store.pool(),
            &[numbered("a", 1), numbered("b", 1), numbered("a", 2)],
        )
        .await
        .unwrap();
    let stalled = store
        .claim(&ClaimRequest {
            lease: Duration::from_millis(100),
            ..claim_up_to(1)
        })
        .await
        .unwrap();
    assert_eq!(stalled.events.len(), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut late = connect().await;
    late.execute("START TRANSACTION").await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT seq FROM {} WHERE seq = ? FOR UPDATE",
        store.outbox().quoted_table()
    )))
    .bind(stalled.events[0].seq)
    .fetch_one(&mut late)
    .await
    .unwrap();

    let claim = store.claim(&claim_up_to(1000)).await.unwrap();
    let got = aggregate_ids(&claim.events);
    assert_eq!(got, vec!["b"], "a/1 is locked, so a/2 must wait too");
    late.execute("ROLLBACK").await.unwrap();
    let claim = store.claim(&claim_up_to(1000)).await.unwrap();
    let got = aggregate_ids(&claim.events);
    assert_eq!(got, vec!["a", "a"]);
}

#[tokio::test]
async fn claims_go_on_without_the_claim_lock_when_its_holder_hangs() {
    let store = common::fresh_store().await;
    store
        .outbox()
        .enqueue_batch(store.pool(), &[numbered("a", 1), numbered("b", 1)])
        .await
        .unwrap();
    // Another session takes the claim lock and never lets go (a relay whose connection hangs).
    let mut holder = connect().await;
    let sql = format!(
        "SELECT GET_LOCK(CONCAT('outbox:claim:', MD5(CONCAT(DATABASE(), '.', '{}'))), 0)",
        store.outbox().table()
    );
    let got = select_i64(&mut holder, sql).await;
    assert_eq!(got, 1);
    let started = std::time::Instant::now();
    let claim = store.claim(&claim_up_to(1000)).await.unwrap();
    assert_eq!(claim.events.len(), 2);
    assert!(started.elapsed() >= Duration::from_secs(u64::from(CLAIM_LOCK_WAIT_SECONDS)));
    assert!(claims_nothing(&store).await);
    holder.close().await.unwrap();
    // With the lock free again, claims take it and give it back.
    let started = std::time::Instant::now();
    store.claim(&claim_up_to(1000)).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    let free: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT IS_FREE_LOCK(CONCAT('outbox:claim:', MD5(CONCAT(DATABASE(), '.', '{}'))))",
        store.outbox().table()
    )))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(free, Some(1), "the claim released its lock");
}

#[tokio::test]
async fn a_lock_wait_timeout_is_transient() {
    let store = common::fresh_store().await;
    store
        .outbox()
        .enqueue(store.pool(), &numbered("a", 1))
        .await
        .unwrap();
    let claim = store.claim(&claim_up_to(1000)).await.unwrap();
    // Someone holds the row (an operator's open transaction)…
    let mut holder = connect().await;
    holder.execute("START TRANSACTION").await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT seq FROM {} FOR UPDATE",
        store.outbox().quoted_table()
    )))
    .fetch_all(&mut holder)
    .await
    .unwrap();
    // …and this store's sessions only wait a second for row locks.
    let impatient = MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION innodb_lock_wait_timeout = 1")
                    .await
                    .map(|_| ())
            })
        })
        .connect(&common::database_url())
        .await
        .unwrap();
    let impatient = MySqlStore::new(impatient, store.outbox().clone());
    let err = impatient
        .ack(&claim.lease, &[claim.events[0].seq])
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err:?}");
    holder.execute("ROLLBACK").await.unwrap();
    assert_eq!(
        impatient
            .ack(&claim.lease, &[claim.events[0].seq])
            .await
            .unwrap(),
        1
    );
}

#[tokio::test]
async fn long_fields_are_refused_and_times_are_the_databases() {
    let store = common::fresh_store().await;
    let long = NewEvent::new("agg", "x".repeat(300), "T", &1).unwrap();
    let err = store
        .outbox()
        .enqueue(store.pool(), &long)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    let err = store
        .outbox()
        .enqueue_batch(store.pool(), &[numbered("a", 1), long])
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    assert_eq!(
        store.stats().await.unwrap().pending,
        0,
        "nothing was written"
    );

    let done = store
        .outbox()
        .enqueue(store.pool(), &numbered("a", 1))
        .await
        .unwrap();
    let db_now: chrono::NaiveDateTime = sqlx::query_scalar("SELECT UTC_TIMESTAMP(6)")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let record = store.get(done.id).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Pending);
    let skew = (db_now.and_utc() - record.event.enqueued_at).abs();
    assert!(skew < chrono::TimeDelta::seconds(5), "{skew:?}");
    // A lease of Duration::MAX is capped instead of overflowing DATETIME.
    let claim = store
        .claim(&ClaimRequest {
            lease: Duration::MAX,
            owner: "o".repeat(400),
            ..claim_up_to(1000)
        })
        .await
        .unwrap();
    assert_eq!(claim.events.len(), 1);
    let record = store.get(done.id).await.unwrap().unwrap();
    assert!(record.lease_expires_at.unwrap() > chrono::Utc::now() + chrono::TimeDelta::days(365));
    assert_eq!(record.lease_owner.unwrap().chars().count(), 255);
}

#[tokio::test]
async fn large_batches_are_split_and_keep_their_order() {
    let store = common::fresh_store().await;
    // ~9 MiB of payload: more than one statement's worth.
    let blob = "x".repeat(300 * 1024);
    let events: Vec<NewEvent> = (0..30)
        .map(|i| {
            NewEvent::from_json(
                "agg",
                "big",
                "Big",
                format!("{{\"i\":{i},\"b\":\"{blob}\"}}"),
            )
            .unwrap()
        })
        .chain((0..500).map(|i| numbered("small", i)))
        .collect();
    enqueue_new(&store, &events).await;
    let claim = store.claim(&claim_up_to(1000)).await.unwrap();
    let got: Vec<_> = claim.events.iter().map(|e| e.id).collect();
    let want: Vec<_> = events.iter().map(NewEvent::id).collect();
    assert_eq!(got, want);
}

#[tokio::test]
async fn connect_reports_an_unreachable_server_as_transient_without_the_password() {
    let err = MySqlStore::connect(
        "mysql://root:hunter2@127.0.0.1:1/test",
        outbox_mysql::MySqlOutbox::new(),
    )
    .await
    .unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
    let err = MySqlStore::connect("not a url", outbox_mysql::MySqlOutbox::new())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
}
