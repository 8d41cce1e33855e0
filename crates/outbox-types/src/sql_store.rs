//! Pieces every SQL store (`outbox-postgresql`, `outbox-mysql`, `outbox-sqlite`) needs that are
//! not SQL: the [`Enqueued`] result, the identifier check for configurable table names, the
//! conversions of durations and counts to and from bind parameters, and the decoding of stored
//! text into the core's types with the same [`StoreError::Corrupt`] messages, and the JSON
//! batches the MySQL and SQLite settle statements read.
//!
//! Why here: each store used to carry its own copy of these, word for word, and a fix to one
//! copy missed the others. They do no I/O and need no driver, so they live next to the types
//! they produce; each store keeps its SQL, its driver and its locking.

use std::time::Duration;

use crate::{BuryEvent, EventId, EventState, Headers, ParseStateError, RetryEvent, StoreError};

/// The result of an enqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Enqueued {
    /// The event's id: the new one, or, for a duplicate idempotency key, the existing event's.
    pub id: EventId,
    /// `false` when the idempotency key matched an existing event and nothing was written.
    pub created: bool,
}

/// The longest table (or schema) name the stores accept: derived names such as
/// `<table>_migrations` and PostgreSQL's index names then stay within every database's
/// identifier limit (PostgreSQL 63 bytes, MySQL 64 characters), and one configuration works for
/// every store. Each store passes its own limit to [`check_identifier`].
pub const MAX_IDENTIFIER_LEN: usize = 48;

/// Check that `name` is a plain SQL identifier (`[a-z_][a-z0-9_]*`, at most `max_len` bytes).
/// Names are interpolated into SQL, so nothing else is accepted; `what` names it in the error
/// (`table`, `schema`).
///
/// ```
/// use outbox_types::sql_store::check_identifier;
/// assert!(check_identifier("table", "outbox_events", 48).is_ok());
/// let err = check_identifier("table", "x; drop table y", 48).unwrap_err();
/// assert!(err.to_string().contains("not a plain identifier"));
/// ```
pub fn check_identifier(what: &str, name: &str, max_len: usize) -> Result<(), StoreError> {
    let plain = !name.is_empty()
        && name.len() <= max_len
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "{what} `{name}` is not a plain identifier: use lowercase letters, digits and `_`, starting with a letter or `_`, at most {max_len} characters"
        )))
    }
}

/// A 64-bit FNV-1a hash: stable across builds and platforms, used for migration checksums and
/// lock keys.
pub fn fnv1a(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// A duration as whole milliseconds for a bind parameter, saturating at `i64::MAX`.
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A duration as whole microseconds for a bind parameter, saturating at `i64::MAX`.
pub fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// A byte limit as a bind parameter (`u64::MAX`, no limit, becomes `i64::MAX`).
pub fn bytes(limit: u64) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// A count the database returned as a signed integer (a negative one cannot happen; it reads
/// as 0).
pub fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A stored `headers` text as [`Headers`], for delivery.
pub fn decode_headers(seq: i64, text: &str) -> Result<Headers, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
        seq,
        reason: format!("headers are not a JSON object of strings: {e}"),
    })
}

/// A stored event id (text column `column`) as an [`EventId`].
pub fn parse_event_id(seq: i64, column: &str, text: &str) -> Result<EventId, StoreError> {
    text.parse::<EventId>().map_err(|e| StoreError::Corrupt {
        seq,
        reason: format!("{column} `{text}` is not a UUID: {e}"),
    })
}

/// A stored `status` as an [`EventState`].
pub fn parse_state(seq: i64, status: &str) -> Result<EventState, StoreError> {
    status
        .parse()
        .map_err(|e: ParseStateError| StoreError::Corrupt {
            seq,
            reason: e.to_string(),
        })
}

/// A destination name to pause: any non-empty text (the route table decides what it matches).
pub fn check_destination(destination: &str) -> Result<(), StoreError> {
    if destination.is_empty() {
        return Err(StoreError::Invalid(
            "the destination to pause must not be empty".to_owned(),
        ));
    }
    Ok(())
}

/// A batch as JSON text, for a statement that reads it with `json_each` or `JSON_TABLE`.
/// Numbers, strings and maps of them always encode; the error is only there to avoid a panic
/// path.
pub fn json_text<T: serde::Serialize + ?Sized>(value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value)
        .map_err(|e| StoreError::Invalid(format!("batch cannot be encoded as JSON: {e}")))
}

/// Event ids as a JSON array of their text, for a statement that reads a list of ids.
pub fn id_list(ids: &[EventId]) -> Result<String, StoreError> {
    json_text(&ids.iter().map(EventId::to_string).collect::<Vec<_>>())
}

/// A retry batch as JSON text, one object per event: its `seq`, its `error` (truncated with
/// [`truncate_error`](crate::truncate_error)), its `cost` (1 when the failure counts as an
/// attempt, else 0) and, under `when_key`, what `when` makes of its delay: the store's statement
/// decides whether that is a delay (`delay_us`) or an instant (`due`).
pub fn retry_batch(
    events: &[RetryEvent],
    when_key: &str,
    when: impl Fn(Duration) -> i64,
) -> Result<String, StoreError> {
    let batch: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            let mut item = serde_json::json!({
                "seq": e.seq,
                "error": crate::truncate_error(&e.error),
                "cost": i32::from(e.counts_attempt),
            });
            item[when_key] = when(e.delay).into();
            item
        })
        .collect();
    json_text(&batch)
}

/// A bury batch as JSON text, one object per event: its `seq` and its `error` (truncated with
/// [`truncate_error`](crate::truncate_error)).
pub fn bury_batch(events: &[BuryEvent]) -> Result<String, StoreError> {
    let batch: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            serde_json::json!({
                "seq": e.seq,
                "error": crate::truncate_error(&e.error),
            })
        })
        .collect();
    json_text(&batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass_and_everything_else_is_refused() {
        assert!(check_identifier("table", "outbox_events", 48).is_ok());
        assert!(check_identifier("table", "_x1", 48).is_ok());
        assert!(check_identifier("table", &"a".repeat(48), 48).is_ok());
        for bad in ["", "Events", "1events", "bad-name", "x'y", "db.events"] {
            assert!(
                matches!(
                    check_identifier("table", bad, 48),
                    Err(StoreError::Invalid(_))
                ),
                "{bad:?}"
            );
        }
        // The limit is the caller's.
        assert!(check_identifier("table", &"a".repeat(49), 48).is_err());
        assert!(check_identifier("table", &"a".repeat(49), 60).is_ok());
    }

    #[test]
    fn fnv1a_is_stable() {
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn conversions_saturate() {
        assert_eq!(millis(Duration::MAX), i64::MAX);
        assert_eq!(micros(Duration::from_millis(2)), 2000);
        assert_eq!(bytes(u64::MAX), i64::MAX);
        assert_eq!(count(-1), 0);
        assert_eq!(count(7), 7);
    }

    #[test]
    fn bad_stored_text_is_corrupt_with_its_seq() {
        assert!(matches!(
            decode_headers(7, "[1]"),
            Err(StoreError::Corrupt { seq: 7, .. })
        ));
        assert!(matches!(
            parse_event_id(8, "id", "nope"),
            Err(StoreError::Corrupt { seq: 8, .. })
        ));
        assert!(matches!(
            parse_state(9, "lost"),
            Err(StoreError::Corrupt { seq: 9, .. })
        ));
        assert!(check_destination("").is_err());
    }

    #[test]
    fn settle_batches_carry_what_the_statements_read() {
        let retry = RetryEvent {
            seq: 3,
            delay: Duration::from_micros(5),
            error: "boom".to_owned(),
            counts_attempt: true,
        };
        let text = retry_batch(&[retry], "delay_us", micros).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&text).unwrap(),
            serde_json::json!([{"seq": 3, "delay_us": 5, "error": "boom", "cost": 1}])
        );
        let bury = BuryEvent {
            seq: 4,
            error: "bad".to_owned(),
        };
        let text = bury_batch(&[bury]).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&text).unwrap(),
            serde_json::json!([{"seq": 4, "error": "bad"}])
        );
    }
}
