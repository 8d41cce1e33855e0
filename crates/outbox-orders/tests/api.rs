//! The order service's HTTP API against a real server on port 0, on SQLite and on the
//! machine's PostgreSQL (`OUTBOX_TEST_DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`,
//! a fresh `outbox_t_…` schema per test): status codes, error bodies, and what each request
//! wrote — the order row and its event together, or nothing.

use outbox_testkit::unique;

use outbox_orders::Db;
use outbox_orders::order::OrderStore;
use serde_json::{Value, json};

fn database_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Postgres,
}

struct Service {
    base: String,
    store: OrderStore,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(backend: Backend) -> Service {
    let dir = tempfile::tempdir().unwrap();
    let store = match backend {
        Backend::Sqlite => {
            let url = format!("sqlite://{}", dir.path().join("orders.db").display());
            OrderStore::new(Db::connect(&url, None, 4).await.unwrap(), None)
        }
        Backend::Postgres => {
            let schema = unique("outbox_t_orders_api");
            let db = Db::connect(&database_url(), Some(&schema), 4)
                .await
                .expect("PostgreSQL must be running on 127.0.0.1:5432");
            let outbox = outbox_postgresql::PgOutbox::with_names(&schema, "events").unwrap();
            OrderStore::new(db, Some(outbox))
        }
    };
    store.migrate().await.unwrap();
    store.migrate().await.unwrap(); // idempotent
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(outbox_orders::http::serve(listener, store.clone(), async {
        let _ = stopped.await;
    }));
    Service {
        base,
        store,
        http: reqwest::Client::new(),
        _dir: dir,
        _stop: stop,
    }
}

impl Service {
    async fn send(&self, method: reqwest::Method, path: &str, body: Option<&str>) -> (u16, Value) {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = body {
            request = request.body(body.to_owned());
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let bytes = response.bytes().await.unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    async fn post(&self, path: &str, body: &str) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, Some(body)).await
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.send(reqwest::Method::GET, path, None).await
    }

    /// (event type, aggregate id, idempotency key) of every outbox row, in write order.
    async fn events(&self) -> Vec<(String, String, Option<String>)> {
        self.store
            .outbox_rows("event_type, aggregate_id, idempotency_key")
            .await
            .unwrap()
    }

    async fn order_count(&self) -> usize {
        self.store.statuses().await.unwrap().len()
    }
}

async fn create_get_cancel(backend: Backend) {
    let s = start(backend).await;
    let (status, order) = s
        .post(
            "/orders",
            r#"{"product": "desk lamp", "quantity": 2, "customer": "ann", "amount": 39.90}"#,
        )
        .await;
    assert_eq!(status, 201, "{order}");
    let id = order["id"].as_str().unwrap().to_owned();
    assert_eq!(order["status"], "created");
    assert_eq!(order["amount_cents"], 3990);
    assert_eq!(order["customer"], "ann");

    let (status, got) = s.get(&format!("/orders/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(got, order);

    let (status, cancelled) = s.post(&format!("/orders/{id}/cancel"), "").await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled");
    assert!(cancelled["cancelled_at"].is_string());
    // Cancelling again: 200, the same order, no second event.
    let (status, again) = s.post(&format!("/orders/{id}/cancel"), "").await;
    assert_eq!(status, 200);
    assert_eq!(again, cancelled);

    assert_eq!(
        s.events().await,
        vec![
            (
                "OrderCreated".to_owned(),
                id.clone(),
                Some(format!("order-{id}-created"))
            ),
            (
                "OrderCancelled".to_owned(),
                id.clone(),
                Some(format!("order-{id}-cancelled"))
            ),
        ]
    );

    // Unknown ids (and ids that are not UUIDs) are 404 with a JSON error.
    for path in [
        "/orders/0190aaaa-0000-7000-8000-000000000000",
        "/orders/0190aaaa-0000-7000-8000-000000000000/cancel",
        "/orders/42",
    ] {
        let (status, body) = if path.ends_with("cancel") {
            s.post(path, "").await
        } else {
            s.get(path).await
        };
        assert_eq!(status, 404, "{path}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
    assert_eq!(s.events().await.len(), 2);
}

async fn invalid_requests_write_nothing(backend: Backend) {
    let s = start(backend).await;
    // The load's invalid bodies, and these.
    let cases: &[(&str, u16, Option<&str>)] = &[
        ("not json at all", 400, None),
        (r#"[{"product": "lamp"}]"#, 400, None),
        ("", 400, None),
        (
            r#"{"product": "lamp", "quantity": -1}"#,
            422,
            Some("quantity"),
        ),
        (
            r#"{"product": "lamp", "quantity": 2.5}"#,
            422,
            Some("quantity"),
        ),
        (
            r#"{"product": "lamp", "quantity": "3"}"#,
            422,
            Some("quantity"),
        ),
        (r#"{"quantity": 1}"#, 422, Some("product")),
        (
            r#"{"product": "lamp", "quantity": 1, "amount": -0.01}"#,
            422,
            Some("amount"),
        ),
        (
            r#"{"product": "lamp", "quantity": 1, "customer": "  "}"#,
            422,
            Some("customer"),
        ),
        (
            r#"{"product": "lamp", "quantity": 1, "qty": 1}"#,
            422,
            Some("qty"),
        ),
    ];
    for (body, status, field) in outbox_orders::load::INVALID.iter().chain(cases) {
        let (got, answer) = s.post("/orders", body).await;
        assert_eq!(got, *status, "{body}: {answer}");
        assert!(answer["error"].is_string(), "{body}: {answer}");
        match field {
            Some(f) => assert_eq!(answer["field"], *f, "{body}: {answer}"),
            None => assert!(answer.get("field").is_none(), "{body}: {answer}"),
        }
    }
    assert_eq!(s.order_count().await, 0);
    assert!(s.events().await.is_empty());
}

async fn credit_limit_rolls_back_order_and_event(backend: Backend) {
    let s = start(backend).await;
    let ok = json!({"product": "piano", "quantity": 1, "customer": "bob", "amount": 9_000.00});
    let (status, first) = s.post("/orders", &ok.to_string()).await;
    assert_eq!(status, 201, "{first}");
    let over = json!({"product": "piano", "quantity": 1, "customer": "bob", "amount": 1_500.00});
    let (status, answer) = s.post("/orders", &over.to_string()).await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["field"], "amount");
    // The rolled-back order and its event are gone; the first order is untouched.
    assert_eq!(s.order_count().await, 1);
    assert_eq!(s.events().await.len(), 1);
    // Cancelling frees the limit.
    let id = first["id"].as_str().unwrap();
    assert_eq!(s.post(&format!("/orders/{id}/cancel"), "").await.0, 200);
    let (status, _) = s.post("/orders", &over.to_string()).await;
    assert_eq!(status, 201);
    // Orders without a customer have no limit.
    let anonymous = json!({"product": "organ", "quantity": 1, "amount": 50_000.00});
    assert_eq!(s.post("/orders", &anonymous.to_string()).await.0, 201);
    assert_eq!(s.events().await.len(), 4);
}

async fn concurrent_cancels_write_one_event(backend: Backend) {
    let s = start(backend).await;
    let (_, order) = s
        .post("/orders", r#"{"product": "chair", "quantity": 1}"#)
        .await;
    let id = order["id"].as_str().unwrap().to_owned();
    let s = std::sync::Arc::new(s);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let s = s.clone();
        let path = format!("/orders/{id}/cancel");
        tasks.push(tokio::spawn(async move { s.post(&path, "").await.0 }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let cancelled = s
        .events()
        .await
        .into_iter()
        .filter(|(t, _, _)| t == "OrderCancelled")
        .count();
    assert_eq!(cancelled, 1);
}

/// Each scenario as one test per backend, under `#[$attr]`, with the tests' names written out.
macro_rules! on_both_backends {
    (#[$attr:meta] $($scenario:ident: $sqlite:ident, $postgres:ident;)*) => {$(
        #[$attr]
        async fn $sqlite() {
            $scenario(Backend::Sqlite).await;
        }

        #[$attr]
        async fn $postgres() {
            $scenario(Backend::Postgres).await;
        }
    )*};
}

on_both_backends! {
    #[tokio::test]
    create_get_cancel: sqlite_create_get_cancel, postgres_create_get_cancel;
    invalid_requests_write_nothing:
        sqlite_invalid_requests_write_nothing, postgres_invalid_requests_write_nothing;
    credit_limit_rolls_back_order_and_event:
        sqlite_credit_limit_rolls_back_order_and_event,
        postgres_credit_limit_rolls_back_order_and_event;
}

on_both_backends! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    concurrent_cancels_write_one_event:
        sqlite_concurrent_cancels_write_one_event, postgres_concurrent_cancels_write_one_event;
}
