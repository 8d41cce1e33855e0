//! The webhook destination: an axum receiver on loopback that applies each POST through the
//! inbox and answers `200` only after the effect committed, so a `2xx` means what the sink
//! assumes it means.
//!
//! Relays reach it through a [`TcpProxy`] (cut, latency, drops). Its poison is a payload marked
//! `"poison": true`, answered `400` every time: the sink must bury it, never retry it forever
//! and never count it delivered. When the consumer "crashes after its commit" (an injected
//! fault) the receiver answers `503`, so the relay retries and the inbox must drop the
//! duplicate.

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use outbox_inbox::Delivery;
use outbox_testkit::TcpProxy;
use outbox_types::EventId;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use super::{Destination, DestinationHandler, Endpoint};
use crate::Error;

/// The receiver and its proxy.
pub struct WebhookDestination {
    endpoint: Endpoint,
    listener: Mutex<Option<tokio::net::TcpListener>>,
}

impl WebhookDestination {
    /// Bind the receiver on `127.0.0.1:0` and put a proxy in front of it.
    pub async fn start(name: &str) -> Result<Self, Error> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(Error::io("binding the webhook receiver"))?;
        let addr: SocketAddr = listener
            .local_addr()
            .map_err(Error::io("binding the webhook receiver"))?;
        let proxy = TcpProxy::start(addr)
            .await
            .map_err(Error::io("starting the webhook proxy"))?;
        Ok(WebhookDestination {
            endpoint: Endpoint::proxied(name, proxy, |addr| {
                serde_json::json!({
                    "type": "webhook",
                    "url": format!("http://{addr}/hooks/${{event_type}}"),
                    "request_timeout": "2s",
                    "connect_timeout": "1s",
                    "max_retry_after": "2s",
                })
            }),
            listener: Mutex::new(Some(listener)),
        })
    }
}

async fn receive(
    State(handler): State<Arc<DestinationHandler>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let id = headers
        .get("outbox-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<EventId>().ok());
    let poison = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("poison").and_then(serde_json::Value::as_bool))
        .unwrap_or(false);
    if poison {
        // Refused, not received: the consumer never accepts it.
        return (
            StatusCode::BAD_REQUEST,
            "poison event refused by the receiver".into(),
        );
    }
    handler.record(id, &body);
    let Some(id) = id else {
        return (StatusCode::BAD_REQUEST, "no outbox-event-id header".into());
    };
    let delivery = Delivery::new(id, body.to_vec(), handler.name().to_owned());
    match handler.apply(&delivery).await {
        Ok(_) => (StatusCode::OK, "ok".into()),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()),
    }
}

#[async_trait]
impl Destination for WebhookDestination {
    fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    fn poison(&self, mut payload: serde_json::Value) -> Option<serde_json::Value> {
        payload["poison"] = serde_json::Value::Bool(true);
        Some(payload)
    }

    async fn start_consumer(
        &self,
        handler: Arc<DestinationHandler>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<JoinHandle<()>, Error> {
        let listener = self
            .listener
            .lock()
            .await
            .take()
            .ok_or_else(|| Error::Invalid("the webhook consumer was started twice".into()))?;
        let app = axum::Router::new()
            .route("/hooks/{event_type}", post(receive))
            .with_state(handler);
        Ok(tokio::spawn(async move {
            let shutdown = async move {
                while !*stop.borrow() {
                    if stop.changed().await.is_err() {
                        break;
                    }
                }
            };
            if let Err(error) = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::warn!(%error, "The webhook receiver stopped.");
            }
        }))
    }
}
