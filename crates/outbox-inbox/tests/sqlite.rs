//! The SQLite inbox on a fresh database file per test (WAL, several connections).

#![cfg(feature = "sqlite")]

use outbox_testkit::unique;
use std::time::{Duration, Instant};

use outbox_inbox::sqlite::{SqliteHandler, SqliteInbox};
use outbox_inbox::{Delivery, Error, EventId, InboxClaim, InboxHandler, ParkedMessage, Processed};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

async fn setup() -> (SqlitePool, SqliteInbox, String) {
    let dir = tempfile::tempdir().unwrap().keep();
    let options = SqliteConnectOptions::new()
        .filename(dir.join("inbox.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new()
        .max_connections(12)
        .connect_with(options)
        .await
        .unwrap();
    let table = unique("inbox_t");
    let inbox = SqliteInbox::with_table(&table).unwrap();
    let report = inbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied, vec![1]);
    let effects = format!("\"{table}_effects\"");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {effects} (event_id TEXT NOT NULL, handler TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    (pool, inbox, effects)
}

async fn effect_count(pool: &SqlitePool, effects: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {effects}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn apply(
    inbox: &SqliteInbox,
    pool: &SqlitePool,
    effects: &str,
    id: EventId,
) -> Result<Processed<()>, Error> {
    let sql = format!("INSERT INTO {effects} (event_id, handler) VALUES (?1, 'billing')");
    inbox
        .process(pool, id, "billing", move |tx| {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(id.to_string())
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        })
        .await
}

#[tokio::test]
async fn migrate_is_idempotent() {
    let (pool, inbox, _) = setup().await;
    let again = inbox.migrate(&pool).await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(again.current, 1);
}

#[tokio::test]
async fn process_twice_applies_once() {
    let (pool, inbox, effects) = setup().await;
    let id = EventId::new();
    assert_eq!(
        apply(&inbox, &pool, &effects, id).await.unwrap(),
        Processed::Applied(())
    );
    assert_eq!(
        apply(&inbox, &pool, &effects, id).await.unwrap(),
        Processed::Duplicate
    );
    assert_eq!(effect_count(&pool, &effects).await, 1);
    assert!(inbox.contains(&pool, id, "billing").await.unwrap());
    // Another handler is another key.
    assert!(!inbox.contains(&pool, id, "shipping").await.unwrap());
}

#[tokio::test]
async fn failed_effect_records_nothing_and_retry_applies() {
    let (pool, inbox, effects) = setup().await;
    let id = EventId::new();
    let sql = format!("INSERT INTO {effects} (event_id, handler) VALUES (?1, 'billing')");
    let failed: Result<Processed<()>, Error> = inbox
        .process(&pool, id, "billing", move |tx| {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(id.to_string())
                    .execute(&mut **tx)
                    .await?;
                Err(Error::BadMessage("the effect failed after writing".into()))
            })
        })
        .await;
    assert!(failed.is_err());
    assert!(!inbox.contains(&pool, id, "billing").await.unwrap());
    assert_eq!(effect_count(&pool, &effects).await, 0);
    assert_eq!(
        apply(&inbox, &pool, &effects, id).await.unwrap(),
        Processed::Applied(())
    );
    assert_eq!(effect_count(&pool, &effects).await, 1);
}

#[tokio::test]
async fn concurrent_duplicate_waits_then_skips() {
    let (pool, inbox, effects) = setup().await;
    let id = EventId::new();
    // First consumer claims and holds its transaction open.
    let mut first = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(
        inbox.claim(&mut *first, id, "billing").await.unwrap(),
        InboxClaim::Fresh
    );
    let second = {
        let (pool, inbox, effects) = (pool.clone(), inbox.clone(), effects.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let r = apply(&inbox, &pool, &effects, id).await.unwrap();
            (r, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!second.is_finished(), "the second claim must wait");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {effects} (event_id, handler) VALUES (?1, 'billing')"
    )))
    .bind(id.to_string())
    .execute(&mut *first)
    .await
    .unwrap();
    first.commit().await.unwrap();
    let (r, waited) = second.await.unwrap();
    assert_eq!(r, Processed::Duplicate);
    assert!(waited >= Duration::from_millis(300));
    assert_eq!(effect_count(&pool, &effects).await, 1);
}

#[tokio::test]
async fn concurrent_duplicate_after_rollback_applies() {
    let (pool, inbox, effects) = setup().await;
    let id = EventId::new();
    let mut first = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(
        inbox.claim(&mut *first, id, "billing").await.unwrap(),
        InboxClaim::Fresh
    );
    let second = {
        let (pool, inbox, effects) = (pool.clone(), inbox.clone(), effects.clone());
        tokio::spawn(async move { apply(&inbox, &pool, &effects, id).await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.rollback().await.unwrap();
    assert_eq!(second.await.unwrap(), Processed::Applied(()));
    assert_eq!(effect_count(&pool, &effects).await, 1);
}

#[tokio::test]
async fn many_concurrent_deliveries_apply_once() {
    let (pool, inbox, effects) = setup().await;
    let id = EventId::new();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (pool, inbox, effects) = (pool.clone(), inbox.clone(), effects.clone());
        tasks.push(tokio::spawn(async move {
            apply(&inbox, &pool, &effects, id).await.unwrap()
        }));
    }
    let mut applied = 0;
    for t in tasks {
        if t.await.unwrap().is_applied() {
            applied += 1;
        }
    }
    assert_eq!(applied, 1);
    assert_eq!(effect_count(&pool, &effects).await, 1);
}

#[tokio::test]
async fn purge_removes_old_rows_and_keeps_recent_ones() {
    let (pool, inbox, effects) = setup().await;
    let ids: Vec<EventId> = (0..5).map(|_| EventId::new()).collect();
    for id in &ids {
        assert!(
            apply(&inbox, &pool, &effects, *id)
                .await
                .unwrap()
                .is_applied()
        );
    }
    // Age three of them by two days.
    for id in &ids[..3] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET processed_at = processed_at - 2 * 86400 * 1000000 WHERE event_id = ?1",
            inbox.qualified_table()
        )))
        .bind(id.to_string())
        .execute(&pool)
        .await
        .unwrap();
    }
    let deleted = inbox
        .purge(&pool, Duration::from_secs(24 * 3600), 2)
        .await
        .unwrap();
    assert_eq!(deleted, 3);
    for id in &ids[..3] {
        assert!(!inbox.contains(&pool, *id, "billing").await.unwrap());
    }
    for id in &ids[3..] {
        assert!(inbox.contains(&pool, *id, "billing").await.unwrap());
    }
    // The trade-off: a purged event is no longer detected as a duplicate.
    assert!(
        apply(&inbox, &pool, &effects, ids[0])
            .await
            .unwrap()
            .is_applied()
    );
}

#[tokio::test]
async fn handler_applies_once_and_parks() {
    let (pool, inbox, effects) = setup().await;
    let sql = format!("INSERT INTO {effects} (event_id, handler) VALUES (?1, 'billing')");
    let handler = SqliteHandler::new(pool.clone(), inbox.clone(), "billing", move |tx, d| {
        let sql = sql.clone();
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(d.event_id.to_string())
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    })
    .unwrap();
    let d = Delivery::new(EventId::new(), b"{}".to_vec(), "orders");
    assert!(handler.handle(&d).await.unwrap().is_applied());
    assert_eq!(handler.handle(&d).await.unwrap(), Processed::Duplicate);
    assert_eq!(effect_count(&pool, &effects).await, 1);

    let p = ParkedMessage::new(Some(d.event_id), "orders", b"{}".to_vec(), 3, "boom");
    handler.park(&p).await.unwrap();
    let parked = inbox.parked(&pool, "billing", 10).await.unwrap();
    assert_eq!(parked, vec![p]);
}

#[tokio::test]
async fn bad_names_are_rejected() {
    assert!(SqliteInbox::with_table("Bad-Name").is_err());
    let (pool, inbox, _) = setup().await;
    let mut tx = pool.begin().await.unwrap();
    let long = "x".repeat(outbox_inbox::MAX_HANDLER_LEN + 1);
    let err = inbox
        .claim(&mut *tx, EventId::new(), &long)
        .await
        .unwrap_err();
    assert!(!err.is_transient());
}

#[tokio::test]
async fn edited_migration_is_refused() {
    let (pool, inbox, _) = setup().await;
    let bookkeeping = format!("\"{}_migrations\"", inbox.table());
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET checksum = 'edited' WHERE version = 1",
        bookkeeping
    )))
    .execute(&pool)
    .await
    .unwrap();
    let err = inbox.migrate(&pool).await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated(_)), "{err}");
    assert!(!err.is_transient());
}

/// The documented claim statement, run as a consumer in another language runs it: one row
/// changed once; none for a committed duplicate; one again after a rollback.
#[tokio::test]
async fn the_claim_statement_is_plain_sql_any_consumer_can_run() {
    let (pool, inbox, _) = setup().await;
    let sql = inbox.claim_statement().to_owned();
    let id = EventId::new();
    let claim = async |tx: &mut sqlx::SqliteConnection| -> u64 {
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .bind(id.to_string())
            .bind("billing")
            .execute(tx)
            .await
            .unwrap()
            .rows_affected()
    };
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(claim(&mut tx).await, 1);
    tx.rollback().await.unwrap();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(
        claim(&mut tx).await,
        1,
        "a rolled-back claim must not count"
    );
    tx.commit().await.unwrap();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(claim(&mut tx).await, 0);
    tx.commit().await.unwrap();
    assert!(inbox.contains(&pool, id, "billing").await.unwrap());
    // processed_at is SQLite's clock in microseconds: within a minute of the host's.
    let at: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT processed_at FROM {}",
        inbox.qualified_table()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    let now = chrono::Utc::now().timestamp_micros();
    assert!(
        (now - at).abs() < 60_000_000,
        "processed_at {at}, now {now}"
    );
}

#[tokio::test]
async fn stats_and_parked_records_describe_the_inbox() {
    let (pool, inbox, effects) = setup().await;
    let empty = inbox.stats(&pool, Duration::from_secs(3600)).await.unwrap();
    assert_eq!(
        (empty.schema_version, empty.rows(), empty.parked_total()),
        (1, 0, 0)
    );
    let ids: Vec<EventId> = (0..3).map(|_| EventId::new()).collect();
    for id in &ids {
        assert!(
            apply(&inbox, &pool, &effects, *id)
                .await
                .unwrap()
                .is_applied()
        );
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET processed_at = processed_at - 7200000000 WHERE event_id = ?1",
        inbox.qualified_table()
    )))
    .bind(ids[0].to_string())
    .execute(&pool)
    .await
    .unwrap();
    for n in 0..3 {
        let p = ParkedMessage::new(None, "orders", vec![n], 1, format!("boom {n}"));
        inbox
            .park(&pool, if n == 2 { "delivery" } else { "billing" }, &p)
            .await
            .unwrap();
    }
    let stats = inbox.stats(&pool, Duration::from_secs(3600)).await.unwrap();
    assert_eq!(stats.handlers.len(), 1);
    let billing = &stats.handlers[0];
    assert_eq!(
        (
            billing.handler.as_str(),
            billing.rows,
            billing.past_retention
        ),
        ("billing", 3, 1)
    );
    assert!(billing.oldest < billing.newest);
    assert_eq!(stats.parked_total(), 3);
    assert_eq!(
        stats
            .parked
            .iter()
            .map(|p| (p.handler.as_str(), p.messages))
            .collect::<Vec<_>>(),
        [("billing", 2), ("delivery", 1)]
    );

    let all = inbox
        .list_parked(&pool, &outbox_inbox::ParkedQuery::new())
        .await
        .unwrap();
    assert_eq!(all.len(), 3);
    let page = outbox_inbox::ParkedQuery::new()
        .handler("billing")
        .after(all[0].id)
        .limit(5);
    let rest = inbox.list_parked(&pool, &page).await.unwrap();
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].message.error, "boom 1");
    let one = inbox
        .parked_record(&pool, all[2].id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (one.handler.as_str(), one.message.payload.clone()),
        ("delivery", vec![2])
    );
    assert!(inbox.parked_record(&pool, -1).await.unwrap().is_none());
}
