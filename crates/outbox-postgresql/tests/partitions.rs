//! Partition rotation in the partitioned layout: partitions are created ahead, and a partition
//! is dropped only when its range and every delivery in it are past retention — never while it
//! holds an event that is pending, in flight or dead.

mod common;

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use outbox_postgresql::{
    KeepReason, KeptPartition, PartitionInterval, Partitioning, PgOutbox, PgStore,
};
use outbox_store_tests::{claim_up_to, seqs_except, seqs_of};
use outbox_testkit::numbered;
use outbox_types::{BuryEvent, DeadFilter, EventId, Store};

fn partitioning() -> Partitioning {
    Partitioning {
        interval: PartitionInterval::Daily,
        ahead: 1,
        retention: Duration::from_secs(24 * 3600),
        lock_timeout: Duration::from_secs(5),
    }
}

fn name(day: DateTime<Utc>) -> String {
    format!("events_p{}", day.format("%Y%m%d"))
}

/// Put events at a given `enqueued_at` (their rows move to that partition) and keep the keys
/// table in step, as an enqueue at that time would have.
async fn set_enqueued_at(store: &PgStore, ids: &[EventId], at: DateTime<Utc>) {
    let ids: Vec<uuid::Uuid> = ids.iter().map(|id| *id.as_uuid()).collect();
    for table in [
        store.outbox().qualified_table().to_owned(),
        store.outbox().keys_table(),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET enqueued_at = $2 WHERE id = ANY($1)"
        )))
        .bind(&ids)
        .bind(at)
        .execute(store.pool())
        .await
        .unwrap();
    }
}

async fn set_delivered_at(store: &PgStore, ids: &[EventId], at: DateTime<Utc>) {
    let ids: Vec<uuid::Uuid> = ids.iter().map(|id| *id.as_uuid()).collect();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET delivered_at = $2 WHERE id = ANY($1) AND status = 'delivered'",
        store.outbox().qualified_table()
    )))
    .bind(&ids)
    .bind(at)
    .execute(store.pool())
    .await
    .unwrap();
}

async fn partition_of(store: &PgStore, id: EventId) -> String {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT c.relname::text FROM {} e JOIN pg_class c ON c.oid = e.tableoid WHERE e.id = $1",
        store.outbox().qualified_table()
    )))
    .bind(id.as_uuid())
    .fetch_one(store.pool())
    .await
    .unwrap()
}

async fn partitions(store: &PgStore) -> Vec<String> {
    let mut names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i
         JOIN pg_class c ON c.oid = i.inhrelid
         JOIN pg_class p ON p.oid = i.inhparent
         JOIN pg_namespace n ON n.oid = p.relnamespace
         WHERE n.nspname = $1 AND p.relname = 'events'",
    )
    .bind(store.outbox().schema())
    .fetch_all(store.pool())
    .await
    .unwrap();
    names.sort();
    names
}

async fn enqueue_keyed(store: &PgStore, key: &str) -> (EventId, bool) {
    let done = store
        .outbox()
        .enqueue(store.pool(), &numbered("late", 0).with_idempotency_key(key))
        .await
        .unwrap();
    (done.id, done.created)
}

#[tokio::test]
async fn rotation_drops_only_partitions_fully_delivered_and_past_retention() {
    let pool = common::pool(5).await;
    let outbox = PgOutbox::partitioned(&common::unique_schema(), "events", partitioning()).unwrap();
    outbox.migrate(&pool).await.unwrap();
    let store = PgStore::new(pool.clone(), outbox.clone());
    let day = Utc::now()
        .date_naive()
        .and_hms_opt(0, 0, 0)
        .unwrap()
        .and_utc();
    let d = |days: i64, hours: i64| day + TimeDelta::days(days) + TimeDelta::hours(hours);

    // Partitions ahead: as if maintenance ran two days ago, then yesterday. (Run today, it
    // would drop the empty partition of two days ago: empty and past retention.)
    let report = outbox.maintain_partitions(&pool, d(-2, 1)).await.unwrap();
    assert_eq!(report.created, vec![name(d(-2, 0)), name(d(-1, 0))]);
    let report = outbox.maintain_partitions(&pool, d(-1, 1)).await.unwrap();
    assert_eq!(report.created, vec![name(d(0, 0))]);
    assert!(
        report.dropped.is_empty() && report.kept.is_empty(),
        "{report:?}"
    );

    // Three events in each of three partitions: A two days ago, B yesterday, C today.
    let mut events = Vec::new();
    for group in ["a", "b", "c"] {
        for n in 1..=3 {
            events.push(numbered(group, n).with_idempotency_key(format!("k-{group}{n}")));
        }
    }
    let ids: Vec<EventId> = common::enqueue_committed(&store, &events)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let (a, b, c) = (&ids[0..3], &ids[3..6], &ids[6..9]);
    set_enqueued_at(&store, a, d(-2, 1)).await;
    set_enqueued_at(&store, b, d(-1, 1)).await;
    set_enqueued_at(&store, c, d(0, 1)).await;
    for (group, day) in [(a, d(-2, 0)), (b, d(-1, 0)), (c, d(0, 0))] {
        for id in group {
            assert_eq!(partition_of(&store, *id).await, name(day));
        }
    }

    // Everything delivered half an hour after it was written, except b3, still pending.
    let claim = store.claim(&claim_up_to(100)).await.unwrap();
    assert_eq!(claim.events.len(), 9);
    let b3 = claim.events.iter().find(|e| e.id == b[2]).unwrap().seq;
    let delivered = seqs_except(&claim.events, b3);
    store.ack(&claim.lease, &delivered).await.unwrap();
    store.release(&claim.lease, &[b3]).await.unwrap();
    set_delivered_at(&store, a, d(-2, 2)).await;
    set_delivered_at(&store, b, d(-1, 2)).await;
    set_delivered_at(&store, c, d(0, 2)).await;

    // A day and an hour later: A's partition goes, B's stays for b3, today's is not due yet.
    let later = d(1, 1);
    let report = outbox.maintain_partitions(&pool, later).await.unwrap();
    assert_eq!(report.dropped, vec![name(d(-2, 0))], "{report:?}");
    assert_eq!(report.keys_removed, 3);
    assert_eq!(
        report.kept,
        vec![KeptPartition {
            name: name(d(-1, 0)),
            reason: KeepReason::Undelivered
        }]
    );
    assert_eq!(report.created, vec![name(d(1, 0)), name(d(2, 0))]);
    assert_eq!(
        partitions(&store).await,
        vec![
            "events_default".to_owned(),
            name(d(-1, 0)),
            name(d(0, 0)),
            name(d(1, 0)),
            name(d(2, 0)),
        ]
    );
    for id in a {
        assert!(store.get(*id).await.unwrap().is_none());
    }
    for id in b.iter().chain(c) {
        assert!(store.get(*id).await.unwrap().is_some());
    }
    // The dropped events' keys are free again; the kept ones' are not.
    assert!(enqueue_keyed(&store, "k-a1").await.1);
    assert_eq!(enqueue_keyed(&store, "k-b1").await, (b[0], false));

    // b3 dead: the partition stays.
    let claim = store.claim(&claim_up_to(100)).await.unwrap();
    let b3_event = claim.events.iter().find(|e| e.id == b[2]).unwrap();
    store
        .bury(
            &claim.lease,
            &[BuryEvent {
                seq: b3_event.seq,
                error: "poison".into(),
            }],
        )
        .await
        .unwrap();
    let others = seqs_except(&claim.events, b3_event.seq);
    store.ack(&claim.lease, &others).await.unwrap();
    let report = outbox.maintain_partitions(&pool, later).await.unwrap();
    assert!(report.dropped.is_empty(), "{report:?}");
    assert_eq!(report.kept[0].reason, KeepReason::Dead);

    // b3 requeued and delivered late (two hours into today): within retention an hour past the
    // next midnight, past it three hours after.
    assert_eq!(
        store
            .requeue_dead(&DeadFilter::Ids(vec![b[2]]))
            .await
            .unwrap(),
        1
    );
    let claim = store.claim(&claim_up_to(100)).await.unwrap();
    store
        .ack(&claim.lease, &seqs_of(&claim.events))
        .await
        .unwrap();
    set_delivered_at(&store, &b[2..], d(0, 2)).await;
    let report = outbox.maintain_partitions(&pool, later).await.unwrap();
    assert_eq!(
        report.kept,
        vec![KeptPartition {
            name: name(d(-1, 0)),
            reason: KeepReason::DeliveredWithinRetention
        }]
    );
    let report = outbox.maintain_partitions(&pool, d(1, 3)).await.unwrap();
    assert_eq!(report.dropped, vec![name(d(-1, 0))], "{report:?}");
    assert_eq!(report.keys_removed, 3);
    assert!(report.kept.is_empty(), "{report:?}");
    for id in c {
        assert!(
            store.get(*id).await.unwrap().is_some(),
            "today's events stay"
        );
    }
    // C, and the event re-enqueued with the freed key `k-a1`.
    assert_eq!(store.stats().await.unwrap().delivered, 3 + 1);
}

#[tokio::test]
async fn a_layout_mismatch_is_reported_and_plain_tables_have_no_partitions() {
    let pool = common::pool(2).await;
    let schema = common::unique_schema();
    let partitioned = PgOutbox::partitioned(&schema, "events", Partitioning::default()).unwrap();
    partitioned.migrate(&pool).await.unwrap();
    let plain = PgOutbox::with_names(&schema, "events").unwrap();
    let err = plain.migrate(&pool).await.unwrap_err();
    outbox_testkit::assert_mentions(&err, "PgOutbox::partitioned");

    let other = common::unique_schema();
    let plain = PgOutbox::with_names(&other, "events").unwrap();
    plain.migrate(&pool).await.unwrap();
    let err = plain
        .maintain_partitions(&pool, Utc::now())
        .await
        .unwrap_err();
    outbox_testkit::assert_mentions(&err, "not partitioned");
    let as_partitioned = PgOutbox::partitioned(&other, "events", Partitioning::default()).unwrap();
    let err = as_partitioned.migrate(&pool).await.unwrap_err();
    outbox_testkit::assert_mentions(&err, "plain table");
}

#[tokio::test]
async fn writers_never_fail_for_want_of_a_partition() {
    // Before any maintenance run, events land in the default partition; a partition whose
    // range the default one holds rows of cannot be created, and is reported, not forced.
    let pool = common::pool(2).await;
    let outbox = PgOutbox::partitioned(&common::unique_schema(), "events", partitioning()).unwrap();
    outbox.migrate(&pool).await.unwrap();
    let done = outbox.enqueue(&pool, &numbered("x", 1)).await.unwrap();
    let store = PgStore::new(pool.clone(), outbox.clone());
    assert_eq!(partition_of(&store, done.id).await, "events_default");
    let report = outbox.maintain_partitions(&pool, Utc::now()).await.unwrap();
    let today = format!("events_p{}", Utc::now().format("%Y%m%d"));
    assert!(report.blocked.contains(&today), "{report:?}");
    assert_eq!(report.created.len(), 1, "tomorrow's is created: {report:?}");
    assert_eq!(store.stats().await.unwrap().pending, 1);
}
