//! Shared by the webhook sink's integration tests: the sink test kit (re-exported, with its
//! sink configuration from JSON), the check every test makes of a signed request, and one
//! event published through a sink of nothing but a URL.

#![allow(dead_code)]

pub use outbox_sink_tests::*;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_sink_webhook::{WebhookSink, verify_signature};
use outbox_types::{Event, Outcome, Sink};

/// Seconds since the Unix epoch, as a signature's timestamp counts them.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `signature` (the `X-Outbox-Signature` header) verifies for `body` with `secret`, now, with
/// the five minutes' tolerance a receiver would allow.
pub fn assert_signed_now(secret: &str, signature: &str, body: &[u8]) {
    verify_signature(
        secret.as_bytes(),
        signature,
        body,
        unix_now(),
        Duration::from_secs(300),
    )
    .unwrap();
}

/// The outcome of `event` published alone through a sink that has only `url` configured.
pub async fn publish_one(url: String, event: Event) -> Outcome {
    let sink = WebhookSink::connect(config(serde_json::json!({ "url": url }))).unwrap();
    let mut outcomes = sink.publish(&[event]).await;
    assert_eq!(outcomes.len(), 1, "{outcomes:?}");
    outcomes.remove(0)
}
