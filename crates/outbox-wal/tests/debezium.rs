//! The `debezium` source: a table created with Debezium's documented DDL and written by plain
//! SQL, read with the Outbox Event Router's options, on the throwaway logical cluster of
//! `scripts/pg-logical.sh`. What the events look like on a broker is tested with the sinks
//! (`format = "debezium"`) and end to end in `outbox-cli`'s tests.

mod common;

use std::time::Duration;

use common::*;
use outbox_types::routing::{PayloadFormat, Routing, Template};
use outbox_wal::{InvalidOp, Source};

const JSONB: &str = r#"{"amount": 42.50, "items": [{"sku": "A-1", "qty": 2}], "note": null}"#;

/// Rows inserted by plain SQL — one alone, one inserted and deleted in the same transaction,
/// one with a NULL payload — are delivered as Debezium's router shapes them, in commit order;
/// an update is ignored (with a warning); the table is never written by the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_table_is_read_as_it_is() {
    let fx = Fixture::new(&[Source::Debezium]).await;
    let t = fx.debezium_table();
    let (sink, relay) = fx.start_recording().await;

    fx.exec(format!(
            "INSERT INTO {t} VALUES ('00000000-0000-4000-8000-000000000001', 'Order', 'order-1', 'OrderCreated', '{JSONB}')"
        ),
    )
    .await;
    fx.exec(format!(
            "BEGIN;
             INSERT INTO {t} VALUES ('00000000-0000-4000-8000-000000000002', 'Order', 'order-1', 'OrderPaid', '{{\"paid\": true}}');
             DELETE FROM {t} WHERE id = '00000000-0000-4000-8000-000000000002';
             COMMIT;"
        ),
    )
    .await;
    fx.exec(format!(
            "INSERT INTO {t} VALUES ('00000000-0000-4000-8000-000000000003', 'Customer', 'c-9', 'CustomerDeleted', NULL);
             UPDATE {t} SET type = 'Changed' WHERE id = '00000000-0000-4000-8000-000000000001';"
        ),
    )
    .await;
    wait_for("three events", Duration::from_secs(20), || {
        sink.delivered().len() >= 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = relay.stop().await;
    let delivered = sink.delivered();
    assert_eq!(delivered.len(), 3, "the update is no event: {delivered:?}");
    assert_eq!(report.dead, 0, "{report:?}");

    let by_type = |t: &str| {
        delivered
            .iter()
            .find(|e| e.event_type == t)
            .unwrap_or_else(|| panic!("{t} delivered: {delivered:?}"))
    };
    let created = by_type("OrderCreated");
    assert_eq!(
        created.id.to_string(),
        "00000000-0000-4000-8000-000000000001"
    );
    assert_eq!(created.destination.as_deref(), Some("outbox.event.Order"));
    assert_eq!(created.aggregate_type, "Order");
    assert_eq!(created.aggregate_id, "order-1");
    assert_eq!(created.event_type, "OrderCreated");
    // PostgreSQL's jsonb text as a JSON string: what Debezium's JSON converter sends.
    let text: String = serde_json::from_str(&created.payload).unwrap();
    let jsonb: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT '{JSONB}'::jsonb::text"
    )))
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!(text, jsonb);
    let paid = by_type("OrderPaid"); // the insert of the row deleted in its transaction
    let order = |e: &outbox_types::Event| delivered.iter().position(|d| d.id == e.id);
    assert!(
        order(created) < order(paid),
        "commit order within the aggregate"
    );
    let deleted = by_type("CustomerDeleted");
    assert_eq!(deleted.payload, "null");
    assert_eq!(
        deleted.destination.as_deref(),
        Some("outbox.event.Customer")
    );

    // On the wire (`format = "debezium"`): key and `id` as JSON strings; a NULL payload is the
    // value `null`, not a tombstone (`route.tombstone.on.empty.payload` is off by default).
    let routing = Routing::new(Template::fixed("unused")).with_format(PayloadFormat::Debezium);
    assert_eq!(routing.key(created), "\"order-1\"");
    assert_eq!(
        routing.headers(created),
        vec![(
            "id".to_owned(),
            "\"00000000-0000-4000-8000-000000000001\"".to_owned()
        )]
    );
    assert!(!routing.is_tombstone(deleted));
    assert_eq!(routing.body(deleted), b"null");

    // Nothing written back: the outbox table is empty, the Debezium table as its writers left it.
    assert_eq!(fx.status_counts().await, (0, 0, 0));
    let rows: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id::text, type FROM {t} ORDER BY id"
    )))
    .fetch_all(&fx.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![
            (
                "00000000-0000-4000-8000-000000000001".to_owned(),
                "Changed".to_owned()
            ),
            (
                "00000000-0000-4000-8000-000000000003".to_owned(),
                "CustomerDeleted".to_owned()
            ),
        ]
    );
    fx.cleanup().await;
}

/// Debezium's own publication (all operations, created before the relay) is reused as it is;
/// with `table.op.invalid.behavior = "fatal"` an update stops the relay with an error naming
/// the table and the way past it. Options naming a missing column are refused before anything
/// streams, naming the column and the option.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_publication_is_reused_and_updates_follow_the_invalid_op_option() {
    let mut fx = Fixture::bare(&[Source::Debezium]).await;
    let t = fx.debezium_table();
    // As Debezium's connector creates it: every operation published.
    fx.exec(format!(
        "CREATE PUBLICATION \"{}\" FOR TABLE {t}",
        fx.config.publication
    ))
    .await;

    let mut wrong = fx.config.clone();
    wrong.debezium.field_event_key = "aggregate_id".into();
    let err = outbox_wal::prepare(&wrong).await.unwrap_err().to_string();
    assert!(
        err.contains("`aggregate_id`") && err.contains("table.field.event.key"),
        "{err}"
    );

    fx.config.debezium.op_invalid_behavior = InvalidOp::Fatal;
    outbox_wal::prepare(&fx.config).await.unwrap();
    let (sink, relay) = fx.start_recording().await;
    fx.exec(format!(
            "INSERT INTO {t} VALUES ('00000000-0000-4000-8000-000000000011', 'Order', 'o', 'OrderCreated', '{{}}');
             DELETE FROM {t};"
        ),
    )
    .await;
    wait_for("the insert", Duration::from_secs(20), || {
        sink.delivered().len() == 1
    })
    .await;
    fx.exec(format!(
            "INSERT INTO {t} VALUES ('00000000-0000-4000-8000-000000000012', 'Order', 'o', 'OrderPaid', '{{}}');
             UPDATE {t} SET payload = '{{\"x\": 1}}';"
        ),
    )
    .await;
    let ended = tokio::time::timeout(Duration::from_secs(30), relay.handle)
        .await
        .expect("the relay stops on the update")
        .unwrap();
    let err = ended.unwrap_err().to_string();
    assert!(
        err.contains("table.op.invalid.behavior") && err.contains(&t),
        "{err}"
    );
    fx.cleanup().await;
}

/// An event a destination fails waits in the outbox table and is retried from there in the same
/// Debezium shape: its record (context headers, a NULL header placement as `null`, the
/// tombstone, the typed key) is stored with it under `__outbox.debezium` and comes back
/// unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_events_keep_their_debezium_record() {
    let mut fx = Fixture::new(&[Source::Debezium]).await;
    let t = fx.debezium_table();
    fx.exec(format!("ALTER TABLE {t} ADD COLUMN span text"))
        .await;
    fx.config.debezium.additional_placement = "span:header:tracingspancontext".into();
    fx.config.debezium.tombstone_on_empty_payload = true;
    fx.config.debezium.extended_headers_enabled = true;
    fx.config.debezium.topic_prefix = Some("dbserver1".into());
    let sink = std::sync::Arc::new(outbox_testkit::RecordingSink::with_faults(
        outbox_testkit::Faults {
            retry_rate: 0.5,
            seed: 7,
            ..Default::default()
        },
    ));
    let mut engine = test_relay(&fx.config);
    engine.retry.max_attempts = 1000;
    let relay = start_relay(fx.config.clone(), engine, sink.clone())
        .ready()
        .await;
    for n in 1..=20 {
        let payload = if n % 5 == 0 { "NULL" } else { "'{}'" };
        fx.exec(format!(
            "INSERT INTO {t} VALUES ('00000000-0000-4000-8000-0000000001{n:02}', 'Order', 'o-{}', 'T', {payload}, NULL)",
            n % 3
        ))
        .await;
    }
    wait_for("20 events", Duration::from_secs(60), || {
        sink.distinct_delivered().len() >= 20
    })
    .await;
    let report = relay.stop().await;
    assert_eq!(report.dead, 0, "{report:?}");
    let delivered = sink.delivered();
    assert!(
        delivered.iter().any(|e| e.attempts > 0),
        "some events were retried from the outbox table"
    );
    let routing = Routing::new(Template::fixed("unused")).with_format(PayloadFormat::Debezium);
    for e in &delivered {
        let headers = routing.headers(e);
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "__debezium.context.connectorLogicalName",
                "__debezium.context.taskId",
                "__debezium.context.connectorName",
                "__debezium.context.runId",
                "id",
                "tracingspancontext"
            ],
            "attempt {}: {headers:?}",
            e.attempts
        );
        assert_eq!(headers[5].1, "null");
        assert_eq!(routing.key(e), format!("\"{}\"", e.aggregate_id));
        let null_payload = e.id.to_string().ends_with("05")
            || e.id.to_string().ends_with("10")
            || e.id.to_string().ends_with("15")
            || e.id.to_string().ends_with("20");
        assert_eq!(routing.is_tombstone(e), null_payload, "{e:?}");
    }
    fx.cleanup().await;
}
