//! Shared by the webhook sink's integration tests: the sink test kit (re-exported, with its
//! sink configuration from JSON), and the check every test makes of a signed request.

#![allow(dead_code)]

pub use outbox_sink_tests::*;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_sink_webhook::verify_signature;

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
