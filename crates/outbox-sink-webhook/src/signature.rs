//! Request signatures: the two schemes the sink can sign with, and the helpers a receiver uses
//! to check them. See the [crate docs](crate#signatures) for which to choose.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// How requests are signed when a `secret` is configured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum SignatureScheme {
    /// `X-Outbox-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>` (the
    /// header name is `signature_header`). The default, kept for existing receivers; it does not
    /// cover the event id.
    #[default]
    #[serde(rename = "outbox-v1")]
    OutboxV1,
    /// [Standard Webhooks](https://www.standardwebhooks.com/): `webhook-id` (the event id),
    /// `webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256(key,
    /// "<id>.<timestamp>.<body>")>`. Recommended: the id is signed too, and receivers can use
    /// the Standard Webhooks libraries.
    #[serde(rename = "standard-webhooks")]
    StandardWebhooks,
}

/// A signature header value is malformed, wrong, or too old. Returned by [`verify_signature`]
/// and [`verify_standard_webhook`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignatureError {
    /// The header does not parse: outbox-v1 lacks `t=` or `v1=`; standard-webhooks has no
    /// `v1,<base64>` entry or a `webhook-timestamp` that is not an integer.
    #[error(
        "malformed signature header (outbox-v1: `t=<unix seconds>,v1=<hex>`; standard-webhooks: `v1,<base64>` entries separated by spaces, and an integer `webhook-timestamp`)"
    )]
    Malformed,
    /// No signature matches: wrong secret, or the body, id or timestamp was changed.
    #[error("signature does not match the body")]
    Mismatch,
    /// The timestamp is further from now than the tolerance: a replay, or a skewed clock.
    #[error("signature timestamp is {skew_seconds} s away from now, beyond the tolerance")]
    Stale {
        /// How far `t` is from now.
        skew_seconds: u64,
    },
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this never falls back in practice.
    let mut mac = Hmac::<Sha256>::new_from_slice(key)
        .unwrap_or_else(|_| Hmac::<Sha256>::new(&Default::default()));
    for part in parts {
        mac.update(part);
    }
    mac
}

fn outbox_v1_mac(secret: &[u8], timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
    hmac(secret, &[timestamp.to_string().as_bytes(), b".", body])
}

fn standard_mac(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
    hmac(
        key,
        &[
            id.as_bytes(),
            b".",
            timestamp.to_string().as_bytes(),
            b".",
            body,
        ],
    )
}

fn check_skew(timestamp: u64, now: u64, tolerance: Duration) -> Result<(), SignatureError> {
    let skew = now.abs_diff(timestamp);
    if skew > tolerance.as_secs() {
        return Err(SignatureError::Stale { skew_seconds: skew });
    }
    Ok(())
}

/// The outbox-v1 signature header value for `body` sent at `timestamp` (unix seconds):
/// `t=<timestamp>,v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
///
/// ```
/// let header = outbox_sink_webhook::sign(b"secret", 1_700_000_000, b"{}");
/// assert!(header.starts_with("t=1700000000,v1="));
/// assert_eq!(header.len(), "t=1700000000,v1=".len() + 64);
/// ```
pub fn sign(secret: &[u8], timestamp: u64, body: &[u8]) -> String {
    let tag = outbox_v1_mac(secret, timestamp, body)
        .finalize()
        .into_bytes();
    format!("t={timestamp},v1={}", hex::encode(tag))
}

/// Check an outbox-v1 signature header against the raw `body`, in constant time, accepting a
/// timestamp at most `tolerance` away from `now` (unix seconds). Any of several `v1` entries may
/// match (secret rotation).
///
/// ```
/// use std::time::Duration;
/// let header = outbox_sink_webhook::sign(b"s", 1_000, b"{}");
/// assert!(outbox_sink_webhook::verify_signature(b"s", &header, b"{}", 1_010, Duration::from_secs(300)).is_ok());
/// ```
pub fn verify_signature(
    secret: &[u8],
    header: &str,
    body: &[u8],
    now: u64,
    tolerance: Duration,
) -> Result<(), SignatureError> {
    let mut timestamp = None;
    let mut candidates = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => timestamp = v.parse::<u64>().ok(),
            Some(("v1", v)) => {
                candidates.push(hex::decode(v).map_err(|_| SignatureError::Malformed)?)
            }
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or(SignatureError::Malformed)?;
    if candidates.is_empty() {
        return Err(SignatureError::Malformed);
    }
    let matched = candidates.iter().any(|tag| {
        outbox_v1_mac(secret, timestamp, body)
            .verify_slice(tag)
            .is_ok()
    });
    if !matched {
        return Err(SignatureError::Mismatch);
    }
    check_skew(timestamp, now, tolerance)
}

/// The HMAC key of a Standard Webhooks secret: `whsec_<base64>` is base64-decoded (the spec's
/// serialisation); any other text is used as its raw bytes. `None` for `whsec_` followed by
/// something that is not base64, or by nothing.
///
/// ```
/// use outbox_sink_webhook::standard_webhooks_key;
/// assert_eq!(standard_webhooks_key("whsec_aGVsbG8="), Some(b"hello".to_vec()));
/// assert_eq!(standard_webhooks_key("hello"), Some(b"hello".to_vec()));
/// assert_eq!(standard_webhooks_key("whsec_!!"), None);
/// ```
pub fn standard_webhooks_key(secret: &str) -> Option<Vec<u8>> {
    let key = match secret.strip_prefix("whsec_") {
        Some(encoded) => BASE64.decode(encoded).ok()?,
        None => secret.as_bytes().to_vec(),
    };
    (!key.is_empty()).then_some(key)
}

/// The Standard Webhooks `webhook-signature` value for message `id` sent at `timestamp` (unix
/// seconds): `v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>`. `key` is the decoded
/// key ([`standard_webhooks_key`]).
///
/// ```
/// let key = outbox_sink_webhook::standard_webhooks_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
/// let signature = outbox_sink_webhook::sign_standard_webhook(
///     &key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1_614_265_330, br#"{"test": 2432232314}"#);
/// assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
/// ```
pub fn sign_standard_webhook(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> String {
    let tag = standard_mac(key, id, timestamp, body)
        .finalize()
        .into_bytes();
    format!("v1,{}", BASE64.encode(tag))
}

/// Check a Standard Webhooks request: the `webhook-id`, `webhook-timestamp` and
/// `webhook-signature` header values against the raw `body`, in constant time, accepting a
/// timestamp at most `tolerance` away from `now` (unix seconds). Any `v1` entry of the
/// space-separated list may match (secret rotation); other versions (`v1a`) are skipped.
///
/// ```
/// use std::time::Duration;
/// use outbox_sink_webhook::{sign_standard_webhook, standard_webhooks_key, verify_standard_webhook};
/// let key = standard_webhooks_key("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD").unwrap();
/// let signature = sign_standard_webhook(&key, "evt_1", 1_000, b"{}");
/// assert!(verify_standard_webhook(&key, "evt_1", "1000", &signature, b"{}", 1_010, Duration::from_secs(300)).is_ok());
/// assert!(verify_standard_webhook(&key, "evt_2", "1000", &signature, b"{}", 1_010, Duration::from_secs(300)).is_err());
/// ```
pub fn verify_standard_webhook(
    key: &[u8],
    webhook_id: &str,
    webhook_timestamp: &str,
    webhook_signature: &str,
    body: &[u8],
    now: u64,
    tolerance: Duration,
) -> Result<(), SignatureError> {
    let timestamp = webhook_timestamp
        .trim()
        .parse::<u64>()
        .map_err(|_| SignatureError::Malformed)?;
    let mut candidates = Vec::new();
    for entry in webhook_signature.split(' ').filter(|e| !e.is_empty()) {
        if let Some(("v1", encoded)) = entry.split_once(',') {
            candidates.push(
                BASE64
                    .decode(encoded)
                    .map_err(|_| SignatureError::Malformed)?,
            );
        }
    }
    if candidates.is_empty() {
        return Err(SignatureError::Malformed);
    }
    let matched = candidates.iter().any(|tag| {
        standard_mac(key, webhook_id, timestamp, body)
            .verify_slice(tag)
            .is_ok()
    });
    if !matched {
        return Err(SignatureError::Mismatch);
    }
    check_skew(timestamp, now, tolerance)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outbox_v1_signatures_verify_and_detect_tampering_and_replays() {
        let header = sign(b"s3cret", 1_000, b"{\"a\":1}");
        let tolerance = Duration::from_secs(300);
        assert_eq!(
            verify_signature(b"s3cret", &header, b"{\"a\":1}", 1_100, tolerance),
            Ok(())
        );
        assert_eq!(
            verify_signature(b"s3cret", &header, b"{\"a\":2}", 1_100, tolerance),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify_signature(b"other", &header, b"{\"a\":1}", 1_100, tolerance),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify_signature(b"s3cret", &header, b"{\"a\":1}", 2_000, tolerance),
            Err(SignatureError::Stale {
                skew_seconds: 1_000
            })
        );
        assert_eq!(
            verify_signature(b"s3cret", "v1=00", b"{}", 0, tolerance),
            Err(SignatureError::Malformed)
        );
        // Rotation: a second v1 that matches is enough.
        let rotated = format!("{header},v1={}", "ab".repeat(32));
        assert_eq!(
            verify_signature(b"s3cret", &rotated, b"{\"a\":1}", 1_000, tolerance),
            Ok(())
        );
    }

    /// The published vectors of the Standard Webhooks reference libraries
    /// (github.com/standard-webhooks/standard-webhooks, `libraries/rust/src/lib.rs` `test_sign`
    /// and `libraries/go/webhook_test.go` `TestWebhookSign`): computed by someone else, so they
    /// check the message layout, the key decoding and the encoding, not just self-consistency.
    #[test]
    fn standard_webhooks_signatures_match_the_spec_test_vectors() {
        let vectors: &[(&str, &str, u64, &[u8], &str)] = &[
            (
                "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
                "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
                1_649_367_553,
                br#"{"email":"test@example.com","username":"test_user"}"#,
                "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
            ),
            (
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#,
                "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            ),
        ];
        let tolerance = Duration::from_secs(300);
        for &(secret, id, timestamp, body, expected) in vectors {
            let key = standard_webhooks_key(secret).unwrap();
            assert_eq!(sign_standard_webhook(&key, id, timestamp, body), expected);
            let ts = timestamp.to_string();
            assert_eq!(
                verify_standard_webhook(&key, id, &ts, expected, body, timestamp + 10, tolerance),
                Ok(())
            );
            // Rotation: the good signature second in a space-separated list, after a v1a.
            let list = format!("v1a,AAAA v1,{} {expected}", BASE64.encode([0u8; 32]));
            assert_eq!(
                verify_standard_webhook(&key, id, &ts, &list, body, timestamp, tolerance),
                Ok(())
            );
            assert_eq!(
                verify_standard_webhook(
                    &key,
                    "msg_other",
                    &ts,
                    expected,
                    body,
                    timestamp,
                    tolerance
                ),
                Err(SignatureError::Mismatch),
                "the id is signed"
            );
            assert_eq!(
                verify_standard_webhook(&key, id, &ts, expected, b"{}", timestamp, tolerance),
                Err(SignatureError::Mismatch)
            );
            assert_eq!(
                verify_standard_webhook(&key, id, &ts, expected, body, timestamp + 301, tolerance),
                Err(SignatureError::Stale { skew_seconds: 301 })
            );
            assert_eq!(
                verify_standard_webhook(&key, id, "soon", expected, body, timestamp, tolerance),
                Err(SignatureError::Malformed)
            );
            assert_eq!(
                verify_standard_webhook(&key, id, &ts, "v1,", body, timestamp, tolerance),
                Err(SignatureError::Mismatch),
                "an empty signature matches nothing"
            );
            assert_eq!(
                verify_standard_webhook(&key, id, &ts, "v1a,AAAA", body, timestamp, tolerance),
                Err(SignatureError::Malformed)
            );
        }
        assert_eq!(standard_webhooks_key("whsec_"), None);
        assert_eq!(standard_webhooks_key(""), None);
    }
}
