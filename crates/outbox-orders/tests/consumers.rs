//! The delivery and billing handlers without a broker, on SQLite and on the machine's
//! PostgreSQL: a duplicate has no effect, a cancellation before its creation is refused as
//! transient (the transport delivers it again later), malformed messages are not transient.
//! And the whole demo, small, as `outbox demo` runs it.

use outbox_testkit::unique;
use std::sync::atomic::Ordering;

use chrono::Utc;
use outbox_inbox::{Delivery, EventId, InboxHandler, Processed};
use outbox_orders::Db;
use outbox_orders::consumers::{Action, Consumer, Service};
use outbox_orders::order::{OrderCancelled, OrderCreated};
use outbox_types::routing::header;
use uuid::Uuid;

async fn open(service: Service, postgres: bool) -> (Consumer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let db = if postgres {
        let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        Db::connect(&url, Some(&unique("outbox_t_orders_consumer")), 2)
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432")
    } else {
        let url = format!("sqlite://{}", dir.path().join("consumer.db").display());
        Db::connect(&url, None, 2).await.unwrap()
    };
    (Consumer::open(service, db).await.unwrap(), dir)
}

fn delivery(id: EventId, event_type: &str, payload: &impl serde::Serialize) -> Delivery {
    let mut d = Delivery::new(id, serde_json::to_vec(payload).unwrap(), "test");
    d.headers
        .insert(header::EVENT_TYPE.to_owned(), event_type.to_owned());
    d
}

fn created(order_id: Uuid) -> OrderCreated {
    OrderCreated {
        order_id,
        product: "lamp".into(),
        quantity: 3,
        customer: None,
        amount_cents: 4_500,
        created_at: Utc::now(),
    }
}

fn cancelled(order_id: Uuid) -> OrderCancelled {
    OrderCancelled {
        order_id,
        amount_cents: 4_500,
        cancelled_at: Utc::now(),
    }
}

async fn effects_once(service: Service, postgres: bool) {
    let (c, _dir) = open(service, postgres).await;
    let order = Uuid::now_v7();
    let (create_id, cancel_id) = (EventId::new(), EventId::new());
    let create = delivery(create_id, "OrderCreated", &created(order));
    let cancel = delivery(cancel_id, "OrderCancelled", &cancelled(order));

    // Cancellation first: refused, transient, nothing recorded (not even the inbox row).
    let err = c.handle(&cancel).await.unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert!(c.ledger().await.unwrap().is_empty());

    assert_eq!(c.handle(&create).await.unwrap(), Processed::Applied(()));
    assert_eq!(c.handle(&create).await.unwrap(), Processed::Duplicate);
    assert_eq!(c.handle(&cancel).await.unwrap(), Processed::Applied(()));
    assert_eq!(c.handle(&cancel).await.unwrap(), Processed::Duplicate);
    assert_eq!(c.handle(&create).await.unwrap(), Processed::Duplicate);

    let (open, close) = service.actions();
    let ledger: Vec<(Uuid, Action)> = c
        .ledger()
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.order_id, e.action))
        .collect();
    assert_eq!(ledger, vec![(order, open), (order, close)]);
    let counters = c.counters();
    assert_eq!(counters.duplicates.load(Ordering::Relaxed), 3);
    assert_eq!(counters.opened.load(Ordering::Relaxed), 1);
    assert_eq!(counters.closed.load(Ordering::Relaxed), 1);

    // Other event types are recorded without an effect; malformed ones are not transient.
    let other = delivery(EventId::new(), "OrderShipped", &serde_json::json!({}));
    assert_eq!(c.handle(&other).await.unwrap(), Processed::Applied(()));
    let bad = delivery(EventId::new(), "OrderCreated", &serde_json::json!({"x": 1}));
    assert!(!c.handle(&bad).await.unwrap_err().is_transient());
    let headless = Delivery::new(EventId::new(), b"{}".to_vec(), "test");
    assert!(!c.handle(&headless).await.unwrap_err().is_transient());
    assert_eq!(c.ledger().await.unwrap().len(), 2);
}

/// [`effects_once`] as one test per service and database (`true`: PostgreSQL).
macro_rules! effects_once_tests {
    ($($name:ident: $service:ident, $postgres:literal;)*) => {$(
        #[tokio::test]
        async fn $name() {
            effects_once(Service::$service, $postgres).await;
        }
    )*};
}

effects_once_tests! {
    sqlite_delivery_effects_once: Delivery, false;
    sqlite_billing_effects_once: Billing, false;
    postgres_delivery_effects_once: Delivery, true;
    postgres_billing_effects_once: Billing, true;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_clean() {
    let dir = tempfile::tempdir().unwrap();
    let args = outbox_orders::demo::DemoArgs {
        orders: Some(150),
        rate: 0.0,
        redeliver: 0.5,
        seed: 7,
        dir: Some(dir.path().to_owned()),
        quiet: true,
        ..Default::default()
    };
    outbox_orders::demo::run(args.clone()).await.unwrap();
    // Again in the same directory: the files are recreated, not reused.
    outbox_orders::demo::run(args).await.unwrap();
}
