//! The PostgreSQL inbox against the machine's PostgreSQL (`OUTBOX_TEST_DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`); every test uses its own schema.

#![cfg(feature = "postgres")]

use outbox_testkit::unique;
use std::time::{Duration, Instant};

use outbox_inbox::postgres::{PgHandler, PgInbox};
use outbox_inbox::{Delivery, Error, EventId, InboxClaim, InboxHandler, ParkedMessage, Processed};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

async fn setup() -> (PgPool, PgInbox, String) {
    let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = PgPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await
        .expect("PostgreSQL must be running on 127.0.0.1:5432");
    let schema = unique("inbox_t");
    let inbox = PgInbox::with_names(&schema, "inbox").unwrap();
    let report = inbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied, vec![1, 2]);
    let effects = format!("\"{schema}\".effects");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {effects} (event_id UUID NOT NULL, handler TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    (pool, inbox, effects)
}

async fn effect_count(pool: &PgPool, effects: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {effects}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn apply(
    inbox: &PgInbox,
    pool: &PgPool,
    effects: &str,
    id: EventId,
) -> Result<Processed<()>, Error> {
    let sql = format!("INSERT INTO {effects} (event_id, handler) VALUES ($1, 'billing')");
    inbox
        .process(pool, id, "billing", move |tx| {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(id.as_uuid())
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
    assert_eq!(again.current, 2);
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
    let sql = format!("INSERT INTO {effects} (event_id, handler) VALUES ($1, 'billing')");
    let failed: Result<Processed<()>, Error> = inbox
        .process(&pool, id, "billing", move |tx| {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(id.as_uuid())
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
    let mut first = pool.begin().await.unwrap();
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
        "INSERT INTO {effects} (event_id, handler) VALUES ($1, 'billing')"
    )))
    .bind(id.as_uuid())
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
    let mut first = pool.begin().await.unwrap();
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
            "UPDATE {} SET processed_at = now() - interval '2 days' WHERE event_id = $1",
            inbox.qualified_table()
        )))
        .bind(id.as_uuid())
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
    let sql = format!("INSERT INTO {effects} (event_id, handler) VALUES ($1, 'billing')");
    let handler = PgHandler::new(pool.clone(), inbox.clone(), "billing", move |tx, d| {
        let sql = sql.clone();
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(d.event_id.as_uuid())
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
    assert!(PgInbox::with_names("ok", "Bad-Name").is_err());
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
    let bookkeeping = format!("\"{}\".\"{}_migrations\"", inbox.schema(), inbox.table());
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

/// The claim function as a consumer in another language calls it: plain SQL in its own
/// transaction. True once; false for a committed duplicate; true again after a rollback (the
/// rolled-back claim left nothing behind).
#[tokio::test]
async fn the_claim_function_is_plain_sql_any_consumer_can_call() {
    let (pool, inbox, _) = setup().await;
    let sql = format!("SELECT {}($1, $2)", inbox.claim_function());
    let id = uuid::Uuid::now_v7();
    let claim = async |tx: &mut sqlx::PgConnection| -> bool {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
            .bind(id)
            .bind("billing")
            .fetch_one(tx)
            .await
            .unwrap()
    };
    let mut tx = pool.begin().await.unwrap();
    assert!(claim(&mut tx).await);
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert!(claim(&mut tx).await, "a rolled-back claim must not count");
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert!(
        !claim(&mut tx).await,
        "a committed claim makes the next one a duplicate"
    );
    tx.commit().await.unwrap();
    // The Rust claim sees the same row.
    assert!(
        inbox
            .contains(&pool, EventId::from_uuid(id), "billing")
            .await
            .unwrap()
    );
}

/// Two consumers in other languages racing on one event: the second call blocks until the
/// first transaction ends, then answers false (it committed).
#[tokio::test]
async fn a_racing_claim_function_call_waits_for_the_first_transaction() {
    let (pool, inbox, _) = setup().await;
    let sql = format!("SELECT {}($1, 'billing')", inbox.claim_function());
    let id = uuid::Uuid::now_v7();
    let mut first = pool.begin().await.unwrap();
    let fresh: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
        .bind(id)
        .fetch_one(&mut *first)
        .await
        .unwrap();
    assert!(fresh);
    let second = {
        let (pool, sql) = (pool.clone(), sql.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let fresh: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            fresh
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "the racing call must wait");
    first.commit().await.unwrap();
    assert!(!second.await.unwrap());
}

#[tokio::test]
async fn the_claim_function_refuses_a_null_event_id_and_a_bad_handler() {
    let (pool, inbox, _) = setup().await;
    let f = inbox.claim_function();
    let err = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {f}(NULL, 'billing')")))
        .execute(&pool)
        .await
        .unwrap_err();
    let db = err.as_database_error().unwrap();
    assert_eq!(db.code().as_deref(), Some("22004"), "{err}");
    assert!(db.message().contains("event_id is null"), "{err}");
    for handler in [String::new(), "x".repeat(192)] {
        let err = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {f}(gen_random_uuid(), $1)"
        )))
        .bind(&handler)
        .execute(&pool)
        .await
        .unwrap_err();
        let db = err.as_database_error().unwrap();
        assert_eq!(db.code().as_deref(), Some("22023"), "{err}");
        assert!(db.message().contains("1 to 191 characters"), "{err}");
    }
}

/// An inbox created before the claim function (schema version 1) gets it from the next
/// migrate; until then the Rust claim says what to run.
#[tokio::test]
async fn a_version_1_inbox_is_upgraded_and_says_so_until_then() {
    let (pool, inbox, _) = setup().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP FUNCTION {}(UUID, TEXT); DELETE FROM \"{}\".\"{}_migrations\" WHERE version = 2",
        inbox.claim_function(),
        inbox.schema(),
        inbox.table()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    let err = inbox
        .claim(&mut *tx, EventId::new(), "billing")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotMigrated(_)), "{err}");
    assert!(err.to_string().contains("outbox inbox migrate"), "{err}");
    drop(tx);
    let report = inbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied, vec![2]);
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        inbox
            .claim(&mut *tx, EventId::new(), "billing")
            .await
            .unwrap(),
        InboxClaim::Fresh
    );
}

#[tokio::test]
async fn stats_and_parked_records_describe_the_inbox() {
    let (pool, inbox, effects) = setup().await;
    let empty = inbox.stats(&pool, Duration::from_secs(3600)).await.unwrap();
    assert_eq!(
        (empty.schema_version, empty.rows(), empty.parked_total()),
        (2, 0, 0)
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
        "UPDATE {} SET processed_at = now() - interval '2 hours' WHERE event_id = $1",
        inbox.qualified_table()
    )))
    .bind(ids[0].as_uuid())
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
