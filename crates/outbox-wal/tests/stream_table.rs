//! The stream table source (`sources = ["stream_table"]`): insert-only rows delivered from the
//! WAL with nothing written back, on the throwaway logical cluster of `scripts/pg-logical.sh`.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use outbox_testkit::{RecordingSink, check_first_delivery_order, numbered};
use outbox_types::EventId;
use outbox_wal::Source;

/// Rows of the stream table written by the library and by plain SQL (also inserted and deleted
/// in one transaction, Debezium's pattern) are delivered in order; rolled-back ones never;
/// nothing is written back for them; an outage hands the waiting ones to the outbox table and
/// they follow in order when the destination is back; a restart delivers nothing again; a row
/// the relay cannot read is dead-lettered and the stream moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_table_rows_are_delivered_in_order_with_nothing_written_back() {
    let fx = Fixture::new(&[Source::StreamTable]).await;
    let stream = format!("\"{}\".\"events_stream\"", fx.config.schema);
    let sink = Arc::new(SwitchSink::new(RecordingSink::new()));
    let relay = start(fx.config.clone(), sink.clone()).ready().await;

    // The library's writer, four aggregates in one transaction.
    let events: Vec<_> = (0..20)
        .map(|n| numbered(&format!("s{}", n % 4), n / 4))
        .collect();
    fx.enqueue_streamed(&events).await;
    // Plain SQL: an insert that leaves `id` to its default, and an insert deleted again in the
    // same transaction.
    let mut sql_ids: Vec<uuid::Uuid> = Vec::new();
    {
        let mut tx = fx.pool.begin().await.unwrap();
        let id: uuid::Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {stream} (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'q', 'OrderPlaced', '{{\"n\": 1}}') RETURNING id"
        )))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        sql_ids.push(id);
        let id: uuid::Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {stream} (aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ('order', 'q', 'OrderPaid', '{{\"n\": 2}}', '{{\"trace-id\": \"abc\"}}') RETURNING id"
        )))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        sql_ids.push(id);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM {stream} WHERE id = $1"
        )))
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    // Rolled back: never delivered.
    let rolled_back = numbered("rb", 0);
    {
        let mut tx = fx.pool.begin().await.unwrap();
        outbox_wal::enqueue_streamed(&mut *tx, &fx.outbox, &rolled_back)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
    }

    let mut expected: HashSet<EventId> = ids(&events);
    expected.extend(sql_ids.iter().map(|id| EventId::from_uuid(*id)));
    wait_for("22 committed events", Duration::from_secs(20), || {
        sink.inner.distinct_delivered().len() >= expected.len()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.inner.distinct_delivered(), expected);
    let delivered = sink.inner.delivered();
    assert!(check_first_delivery_order(&delivered).is_empty());
    let paid = delivered
        .iter()
        .find(|e| e.event_type == "OrderPaid")
        .expect("the row deleted in its own transaction is delivered");
    assert_eq!(paid.payload, "{\"n\": 2}");
    assert_eq!(
        paid.headers.get("trace-id").map(String::as_str),
        Some("abc")
    );
    let placed = delivered
        .iter()
        .position(|e| e.event_type == "OrderPlaced")
        .unwrap();
    let paid_at = delivered
        .iter()
        .position(|e| e.event_type == "OrderPaid")
        .unwrap();
    assert!(placed < paid_at, "commit order within the aggregate");
    // Nothing written back: the outbox table holds nothing, the stream table its rows as
    // written (one deleted by its writer).
    assert_eq!(fx.status_counts().await, (0, 0, 0));
    let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {stream}"
    )))
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!(rows, 21);

    // An outage: the waiting events go to the outbox table as rows, and come out in order
    // once the destination is back.
    sink.down.store(true, Ordering::SeqCst);
    let during: Vec<_> = (0..10).map(|n| numbered("f", n)).collect();
    fx.enqueue_streamed(&during).await;
    sink.wait_calls_while_down(
        "the outage's events in the table",
        Duration::from_secs(20),
        0,
    )
    .await;
    let mut open = 0;
    for _ in 0..100 {
        open = fx.status_counts().await.0;
        if open == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(open, 10, "every waiting event is a row of the outbox table");
    sink.down.store(false, Ordering::SeqCst);
    expected.extend(ids(&during));
    wait_for("the outage's events", Duration::from_secs(30), || {
        sink.inner.distinct_delivered().len() >= expected.len()
    })
    .await;
    assert!(check_first_delivery_order(&sink.inner.delivered()).is_empty());
    let first = relay.stop().await;
    assert_eq!(first.dead, 0, "{first:?}");

    // A restart delivers nothing again: the slot's position is the record.
    let before = sink.inner.delivered().len();
    let relay = start(fx.config.clone(), sink.clone()).ready().await;
    // A row whose header is not a string is no event: the table's trigger refuses it now, but
    // a stream table from before that trigger may hold one. Such a row is dead, and the stream
    // moves on to the next row.
    fx.exec(format!(
        "DROP TRIGGER events_stream_header_rules ON {stream}"
    ))
    .await;
    fx.exec(format!(
        "INSERT INTO {stream} (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('order', 'bad', 'OrderPlaced', '{{}}', '{{\"retry\": 3}}')"
    ))
    .await;
    let after_bad = numbered("after", 0);
    fx.enqueue_streamed(std::slice::from_ref(&after_bad)).await;
    wait_for("the row after the bad one", Duration::from_secs(20), || {
        sink.inner.distinct_delivered().contains(&after_bad.id())
    })
    .await;
    assert_eq!(
        sink.inner.delivered().len(),
        before + 1,
        "only the new event after a restart"
    );
    let report = relay.stop().await;
    assert_eq!(report.duplicates, 0, "{report:?}");
    let (open, _, dead) = fx.status_counts().await;
    assert_eq!((open, dead), (0, 1));
    let error: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT last_error FROM {} WHERE status = 'dead'",
        fx.outbox.qualified_table()
    )))
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert!(
        error.contains("events_stream") && error.contains("headers"),
        "{error}"
    );

    // The stream table has no idempotency key: such an event is refused with the way out.
    let keyed = numbered("k", 0).with_idempotency_key("k-0");
    let mut tx = fx.pool.begin().await.unwrap();
    let refused = outbox_wal::enqueue_streamed(&mut *tx, &fx.outbox, &keyed)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("PgOutbox::enqueue"),
        "{refused}"
    );
    drop(tx);

    // Purging by age, a few rows per statement: rows younger than the age stay.
    let purged = outbox_wal::purge_stream_table(&fx.config, &fx.pool, Duration::from_secs(3600), 5)
        .await
        .unwrap();
    assert_eq!(purged, 0, "nothing is an hour old");
    let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {stream}"
    )))
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert!(rows > 5, "{rows}");
    let purged = outbox_wal::purge_stream_table(&fx.config, &fx.pool, Duration::ZERO, 5)
        .await
        .unwrap();
    assert_eq!(purged as i64, rows, "every row, in batches of 5");
    fx.cleanup().await;
}

/// Turning the stream table on for an outbox whose publication already exists is one setting:
/// the relay creates the table and adds it to the publication, and both sources stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_table_joins_an_existing_publication() {
    let fx = Fixture::new(&[Source::Table]).await;
    let mut config = fx.config.clone();
    config.sources = vec![Source::Table, Source::StreamTable];
    let sink = Arc::new(RecordingSink::new());
    let relay = start(config, sink.clone()).ready().await;
    let row = numbered("both", 0);
    let streamed = numbered("both", 1);
    fx.enqueue_table(std::slice::from_ref(&row)).await;
    fx.enqueue_streamed(std::slice::from_ref(&streamed)).await;
    wait_for("both events", Duration::from_secs(20), || {
        sink.distinct_delivered().len() >= 2
    })
    .await;
    assert_eq!(sink.distinct_delivered(), ids(&[row, streamed]));
    relay.stop().await;
    fx.cleanup().await;
}

/// The stream table checks `headers` as the outbox table does (the same trigger function): a
/// writer's insert with a value that is not a string, or a name under the reserved prefix
/// `outbox-`, fails naming the header. A stream table from before the trigger still holds such
/// rows and the relay goes on with them: an unreadable one is dead-lettered as an empty-headed
/// row; a readable one that waits for its destination goes to the outbox table without the
/// reserved name (which no sink sends), so that table's own trigger takes it. The relay's start
/// gives an old stream table the trigger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_table_checks_headers_and_a_table_from_before_the_check_still_flows() {
    let fx = Fixture::new(&[Source::StreamTable]).await;
    let stream = format!("\"{}\".\"events_stream\"", fx.config.schema);
    let insert = |headers: &'static str, aggregate: &'static str| {
        let (pool, stream) = (fx.pool.clone(), stream.clone());
        async move {
            sqlx::query_scalar::<_, uuid::Uuid>(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {stream} (aggregate_type, aggregate_id, event_type, payload, headers)
                 VALUES ('order', '{aggregate}', 'OrderPlaced', '{{}}', $1::jsonb) RETURNING id"
            )))
            .bind(headers)
            .fetch_one(&pool)
            .await
        }
    };
    let has_trigger = || {
        let pool = fx.pool.clone();
        let stream = stream.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_trigger
                 WHERE tgrelid = to_regclass($1) AND tgname = 'events_stream_header_rules'",
            )
            .bind(stream)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        }
    };
    assert!(has_trigger().await);
    for (headers, says) in [
        (r#"{"retry": 3}"#, r#"header "retry" is not a string"#),
        (
            r#"{"outbox-x": "v"}"#,
            r#"header "outbox-x" uses the prefix outbox-"#,
        ),
        ("[1]", "headers must be a JSON object"),
    ] {
        let err = insert(headers, "refused").await.unwrap_err();
        let db = err.as_database_error().unwrap();
        assert_eq!(db.code().as_deref(), Some("23514"), "{headers}: {err}");
        assert!(err.to_string().contains(says), "{headers}: {err}");
    }
    let streamed_bad = numbered("lib", 0).with_header("outbox-x", "v");
    let mut tx = fx.pool.begin().await.unwrap();
    let err = outbox_wal::enqueue_streamed(&mut *tx, &fx.outbox, &streamed_bad)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("`outbox-x`"), "{err}");
    drop(tx);

    // As a stream table created before the trigger, holding rows it refuses.
    fx.exec(format!(
        "DROP TRIGGER events_stream_header_rules ON {stream}"
    ))
    .await;
    let reserved = insert(
        r#"{"outbox-x": "v", "outbox-partition": "2", "tenant": "acme"}"#,
        "reserved",
    )
    .await
    .unwrap();
    insert(r#"{"retry": 3}"#, "unreadable").await.unwrap();
    // The relay's start gives the table its trigger back; the rows already there flow.
    let sink = Arc::new(SwitchSink::new(RecordingSink::new()));
    sink.down.store(true, Ordering::SeqCst);
    let relay = start(fx.config.clone(), sink.clone()).ready().await;
    assert!(has_trigger().await);
    let err = insert(r#"{"retry": 3}"#, "new").await.unwrap_err();
    assert!(
        err.to_string().contains("is not a string"),
        "new rows are checked: {err}"
    );
    sink.wait_calls_while_down("both rows in the outbox table", Duration::from_secs(20), 0)
        .await;
    let table = fx.outbox.qualified_table().to_owned();
    let mut rows: Vec<(String, String, serde_json::Value)> = Vec::new();
    for _ in 0..100 {
        rows = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT aggregate_id, status, headers::json FROM {table}
             ORDER BY aggregate_id = 'reserved' DESC"
        )))
        .fetch_all(&fx.pool)
        .await
        .unwrap();
        if rows.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(rows.len(), 2, "{rows:?}");
    let (agg, status, headers) = &rows[0];
    assert_eq!(agg, "reserved");
    // The destination is down: the row waits, pending between attempts and in flight during
    // one (the retries come due within milliseconds, so either can be read here).
    assert!(
        status == "pending" || status == "in_flight",
        "waits for its destination: {rows:?}"
    );
    assert_eq!(
        headers,
        &serde_json::json!({"outbox-partition": "2", "tenant": "acme"}),
        "the reserved name is dropped, outbox-partition kept"
    );
    // The unreadable row, under its LSN.
    let (_, status, headers) = &rows[1];
    assert_eq!(status, "dead", "{rows:?}");
    assert_eq!(
        headers,
        &serde_json::json!({}),
        "the unreadable headers stay behind"
    );
    sink.down.store(false, Ordering::SeqCst);
    wait_for("the waiting event", Duration::from_secs(30), || {
        sink.inner
            .distinct_delivered()
            .contains(&EventId::from_uuid(reserved))
    })
    .await;
    let delivered = sink.inner.delivered();
    let event = delivered
        .iter()
        .find(|e| *e.id.as_uuid() == reserved)
        .unwrap();
    assert_eq!(
        event.headers.get("tenant").map(String::as_str),
        Some("acme")
    );
    assert!(!event.headers.contains_key("outbox-x"));
    relay.stop().await;
    fx.cleanup().await;
}
