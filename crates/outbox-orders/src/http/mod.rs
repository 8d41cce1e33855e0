//! The order service's HTTP API (axum).
//!
//! | route | answer |
//! |---|---|
//! | `POST /orders` `{product, quantity, customer?, amount?}` | 201 with the order; 400 malformed JSON; 422 invalid field; 409 credit limit |
//! | `POST /orders/{id}/cancel` | 200 with the order (also when it was cancelled before: no second event); 404 |
//! | `GET /orders/{id}` | 200 with the order; 404 |
//! | `GET /healthz` | 200 once the service answers |
//!
//! Every error is JSON: `{"error": "...", "field": "..."}` (see [`ApiError`]). The body of
//! `POST /orders` is read as bytes and validated by [`NewOrder::from_json`], so a malformed
//! body gets the same JSON error shape as an invalid field instead of axum's plain-text
//! rejection. The content type is not checked: `curl -d '{…}'` works as it is.
//!
//! Like mini-redis' server, [`serve`] takes the listener and a shutdown future: the binary
//! passes ctrl-c, the demo and the tests a channel, and tests bind port 0.

mod error;

use std::future::Future;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use uuid::Uuid;

pub use error::ApiError;

use crate::order::{CREDIT_LIMIT_CENTS, Cancelled, Created, NewOrder, OrderStore};

/// The routes over `store`.
pub fn router(store: OrderStore) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .route("/orders/{id}/cancel", post(cancel_order))
        .route("/healthz", get(|| async { "ok" }))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                Json(serde_json::json!({"error": "no such route"})),
            )
        })
        .with_state(store)
}

/// Serve the API on `listener` until `shutdown` completes; requests in progress finish first.
///
/// ```no_run
/// # async fn demo(store: outbox_orders::order::OrderStore) -> std::io::Result<()> {
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
/// println!("listening on {}", listener.local_addr()?);
/// outbox_orders::http::serve(listener, store, async { let _ = tokio::signal::ctrl_c().await; }).await?;
/// # Ok(()) }
/// ```
pub async fn serve(
    listener: tokio::net::TcpListener,
    store: OrderStore,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(store))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn create_order(
    State(store): State<OrderStore>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let new = NewOrder::from_json(&body)?;
    match store.create(&new).await? {
        Created::Order(order) => Ok((
            StatusCode::CREATED,
            [(header::LOCATION, format!("/orders/{}", order.id))],
            Json(order),
        )),
        Created::CreditLimitExceeded { open_cents } => Err(ApiError::CreditLimitExceeded {
            open: money(open_cents),
            limit: money(CREDIT_LIMIT_CENTS),
        }),
    }
}

async fn get_order(
    State(store): State<OrderStore>,
    OrderId(id): OrderId,
) -> Result<impl IntoResponse, ApiError> {
    match store.get(id).await? {
        Some(order) => Ok(Json(order)),
        None => Err(ApiError::NotFound),
    }
}

async fn cancel_order(
    State(store): State<OrderStore>,
    OrderId(id): OrderId,
) -> Result<impl IntoResponse, ApiError> {
    match store.cancel(id).await? {
        Cancelled::Now(order) | Cancelled::Already(order) => Ok(Json(order)),
        Cancelled::NotFound => Err(ApiError::NotFound),
    }
}

/// The `{id}` of an order's route. An id that is not a UUID names no order: 404, like any
/// other unknown id; a path axum cannot read is its own rejection.
struct OrderId(Uuid);

impl<S: Send + Sync> FromRequestParts<S> for OrderId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let id = Uuid::parse_str(&id).map_err(|_| ApiError::NotFound.into_response())?;
        Ok(OrderId(id))
    }
}

fn money(cents: i64) -> String {
    format!("{}.{:02}", cents / 100, cents % 100)
}
