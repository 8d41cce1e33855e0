//! Pieces every SQL store (`outbox-postgresql`, `outbox-mysql`, `outbox-sqlite`) needs that are
//! not SQL: the [`Enqueued`] result, the identifier check for configurable table names, the
//! conversions of durations and counts to and from bind parameters, and the decoding of stored
//! text into the core's types with the same [`StoreError::Corrupt`] messages, and the rows an
//! operator reads (an event's record, counts, leases, paused destinations) built from the
//! columns of a [`StoredRow`].
//!
//! Why here: each store used to carry its own copy of these, word for word, and a fix to one
//! copy missed the others. They do no I/O and need no driver, so they live next to the types
//! they produce; each store keeps its SQL, its driver and its locking.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::{
    BuryEvent, DestinationStats, Event, EventId, EventRecord, EventState, Headers, LeaseHolder,
    NewEvent, OutboxStats, ParseStateError, PausedDestination, RetryEvent, StoreError,
};

/// The result of an enqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Enqueued {
    /// The event's id: the new one, or, for a duplicate idempotency key, the existing event's.
    pub id: EventId,
    /// `false` when the idempotency key matched an existing event and nothing was written.
    pub created: bool,
}

/// A batch to enqueue in one statement, one event per idempotency key: the first event with a
/// key is written, later ones with the same key resolve to it.
#[derive(Debug)]
pub struct KeyedBatch<'e> {
    /// The events to write, in batch order.
    pub to_write: Vec<&'e NewEvent>,
    /// Each key's first event, by its index in the batch.
    pub first_with_key: HashMap<&'e str, usize>,
}

/// `events` as a [`KeyedBatch`], each event's headers checked first (a reserved name is
/// [`StoreError::Encode`] before anything is sent).
pub fn keyed_batch(events: &[NewEvent]) -> Result<KeyedBatch<'_>, StoreError> {
    let mut first_with_key: HashMap<&str, usize> = HashMap::new();
    let mut to_write: Vec<&NewEvent> = Vec::with_capacity(events.len());
    for (i, event) in events.iter().enumerate() {
        event.check_headers()?;
        match event.idempotency_key() {
            Some(key) if first_with_key.contains_key(key) => {}
            Some(key) => {
                first_with_key.insert(key, i);
                to_write.push(event);
            }
            None => to_write.push(event),
        }
    }
    Ok(KeyedBatch {
        to_write,
        first_with_key,
    })
}

/// `$query` with the columns of the [`NewEvent`] `$event` that every store's single-event
/// enqueue statement takes after the event's id, in its order: aggregate type, aggregate id,
/// event type, payload, destination, headers (JSON text), idempotency key. The store binds the
/// id before and the times after, each in its own encoding. A macro because the query type is
/// the driver's (`sqlx`).
#[macro_export]
macro_rules! bind_event_columns {
    ($query:expr, $event:ident) => {
        $query
            .bind($event.aggregate_type())
            .bind($event.aggregate_id())
            .bind($event.event_type())
            .bind($event.payload())
            .bind($event.destination())
            .bind($event.headers_json())
            .bind($event.idempotency_key())
    };
}

/// Sort one claimed row into the [`ClaimSort`](crate::ClaimSort) `$sort` (see
/// [`ClaimSort::row`](crate::ClaimSort::row)): its `$seq`, its payload's and its other columns'
/// sizes as the database reported them (`$payload_bytes`, `$metadata_bytes`: each a signed
/// integer or NULL, which counts as 0), its aggregate (a closure giving `None` for a key the
/// statement did not send) and its decoding (a closure); a row that cannot be delivered is
/// logged, once, with the same words in every store, and dead-lettered with the claim. `?`
/// passes a failure to read the row on. A macro because the log is the store's (`tracing`,
/// which this crate does not use).
#[macro_export]
macro_rules! sort_claimed_row {
    ($sort:ident, $seq:ident, $payload_bytes:expr, $metadata_bytes:expr, $aggregate:expr, $decode:expr) => {
        let bytes = $crate::RowBytes {
            payload: u64::try_from($payload_bytes.unwrap_or(0)).unwrap_or(0),
            metadata: u64::try_from($metadata_bytes.unwrap_or(0)).unwrap_or(0),
        };
        if let Some(error) = $sort.row($seq, bytes, $aggregate, $decode)? {
            ::tracing::warn!(
                seq = $seq,
                error,
                "Claimed a row that cannot be delivered; it is dead-lettered."
            );
        }
    };
}

/// The driver errors (`sqlx::Error` variants) of a database server's connection that broke or
/// could not be had (I/O, TLS, protocol, pool time-out or closed, a crashed worker), as a
/// pattern: what the PostgreSQL and MySQL stores report as [`StoreError::Unavailable`] whatever
/// the database said, so a relay backs off and tries again. A macro because `sqlx` is the
/// store's.
#[macro_export]
macro_rules! sqlx_connection_trouble {
    () => {
        ::sqlx::Error::Io(_)
            | ::sqlx::Error::Tls(_)
            | ::sqlx::Error::PoolTimedOut
            | ::sqlx::Error::PoolClosed
            | ::sqlx::Error::WorkerCrashed
            | ::sqlx::Error::Protocol(_)
    };
}

/// A relay's pool on the database server at `$url` (a `&str`), for the PostgreSQL and MySQL
/// stores' `connect`: the URL parsed into `$db`'s connect options (a bad one is
/// [`StoreError::Invalid`], "invalid `$name` URL"); one direct connection first, which fails fast
/// with the real cause (refused, unknown host, authentication) where a pool would only report a
/// timeout; then a small pool (8 connections) with a short acquire timeout (5 s), so a database
/// outage surfaces as a retryable error instead of a hang. A failure to connect is
/// [`StoreError::Unavailable`]; no error echoes the URL's password. It expands to an awaited
/// expression of type `Result<sqlx::Pool<$db>, StoreError>`, for the body of an `async fn`; a
/// macro because `sqlx` is the store's.
#[macro_export]
macro_rules! connect_relay_pool {
    ($db:ty, $name:literal, $url:expr) => {
        async {
            let url: &str = $url;
            let options: <<$db as ::sqlx::Database>::Connection as ::sqlx::Connection>::Options =
                url.parse().map_err(|e: ::sqlx::Error| {
                    $crate::StoreError::Invalid(format!(
                        concat!("invalid ", $name, " URL `{}`: {}"),
                        $crate::redact::redact_url(url),
                        e
                    ))
                })?;
            let unreachable = |e: ::sqlx::Error| {
                $crate::StoreError::Unavailable(format!(
                    "cannot connect to {}: {e}",
                    $crate::redact::redact_url(url)
                ))
            };
            let probe =
                <<$db as ::sqlx::Database>::Connection as ::sqlx::Connection>::connect_with(
                    &options,
                )
                .await
                .map_err(unreachable)?;
            let _ = ::sqlx::Connection::close(probe).await;
            ::sqlx::pool::PoolOptions::<$db>::new()
                .max_connections(8)
                .acquire_timeout(::std::time::Duration::from_secs(5))
                .connect_with(options)
                .await
                .map_err(unreachable)
        }
        .await
    };
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

/// A pause request checked ([`check_destination`]): the "paused by" text to store, as it is.
pub fn check_pause<'b>(destination: &str, by: &'b str) -> Result<&'b str, StoreError> {
    check_destination(destination)?;
    Ok(by)
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

/// One result row, read column by column the way a store's driver reads it: the columns of the
/// operator's reads are the same in every store, only how a column becomes a value differs
/// (SQLite keeps times as microseconds). Each store wraps its driver's row in a type that
/// implements this (PostgreSQL and MySQL with [`impl_stored_row!`](crate::impl_stored_row)),
/// and the builders below ([`event_record`], [`outbox_stats`], [`destination_stats`],
/// [`lease_holder`], [`paused_destination`]) are written once.
pub trait StoredRow {
    /// Column `name`, a count the database returns as a signed integer (see [`count`]).
    fn count(&self, name: &str) -> Result<u64, StoreError>;
    /// Column `name`, text that is never NULL.
    fn text(&self, name: &str) -> Result<String, StoreError>;
    /// Column `name`, text or NULL.
    fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError>;
    /// Column `name`, a time that is never NULL; `seq` names the row in a
    /// [`StoreError::Corrupt`] (0 for a row that is no event's).
    fn time(&self, seq: i64, name: &str) -> Result<DateTime<Utc>, StoreError>;
    /// Column `name`, a time or NULL; `seq` as for [`StoredRow::time`].
    fn opt_time(&self, seq: i64, name: &str) -> Result<Option<DateTime<Utc>>, StoreError>;
}

/// Implement [`StoredRow`] for `$wrapper`, a tuple struct around a reference to a driver's row
/// (`struct Columns<'r>(&'r PgRow)`), for a driver that decodes times itself: every column is
/// read with `sqlx::Row::try_get` and a driver error goes through `$map_err` (the store's
/// `map_sqlx`). The caller depends on `sqlx` and `chrono`.
#[macro_export]
macro_rules! impl_stored_row {
    ($wrapper:ident, $map_err:path) => {
        impl $crate::sql_store::StoredRow for $wrapper<'_> {
            fn count(&self, name: &str) -> Result<u64, $crate::StoreError> {
                let n: i64 = ::sqlx::Row::try_get(self.0, name).map_err($map_err)?;
                Ok($crate::sql_store::count(n))
            }

            fn text(&self, name: &str) -> Result<String, $crate::StoreError> {
                ::sqlx::Row::try_get(self.0, name).map_err($map_err)
            }

            fn opt_text(&self, name: &str) -> Result<Option<String>, $crate::StoreError> {
                ::sqlx::Row::try_get(self.0, name).map_err($map_err)
            }

            fn time(
                &self,
                _seq: i64,
                name: &str,
            ) -> Result<::chrono::DateTime<::chrono::Utc>, $crate::StoreError> {
                ::sqlx::Row::try_get(self.0, name).map_err($map_err)
            }

            fn opt_time(
                &self,
                _seq: i64,
                name: &str,
            ) -> Result<Option<::chrono::DateTime<::chrono::Utc>>, $crate::StoreError> {
                ::sqlx::Row::try_get(self.0, name).map_err($map_err)
            }
        }
    };
}

/// An event whose text and time columns the driver decodes as they are (PostgreSQL, MySQL;
/// SQLite reads them its own way, lossily for display); the store decodes `seq`, `id`, the
/// `payload`, the `headers` and the `attempts` first, as its table stores them.
pub fn event(
    row: &impl StoredRow,
    seq: i64,
    id: EventId,
    payload: String,
    headers: Headers,
    attempts: u32,
) -> Result<Event, StoreError> {
    Ok(Event {
        seq,
        id,
        aggregate_type: row.text("aggregate_type")?,
        aggregate_id: row.text("aggregate_id")?,
        event_type: row.text("event_type")?,
        payload,
        destination: row.opt_text("destination")?,
        headers,
        idempotency_key: row.opt_text("idempotency_key")?,
        occurred_at: row.time(seq, "occurred_at")?,
        enqueued_at: row.time(seq, "enqueued_at")?,
        attempts,
    })
}

/// An operator's view of one event: `event` (decoded for display) and its state columns.
pub fn event_record(row: &impl StoredRow, event: Event) -> Result<EventRecord, StoreError> {
    let seq = event.seq;
    let state = parse_state(seq, &row.text("status")?)?;
    Ok(EventRecord {
        event,
        state,
        next_attempt_at: row.time(seq, "next_attempt_at")?,
        last_error: row.opt_text("last_error")?,
        lease_owner: row.opt_text("lease_owner")?,
        lease_expires_at: row.opt_time(seq, "lease_expires_at")?,
        delivered_at: row.opt_time(seq, "delivered_at")?,
        dead_at: row.opt_time(seq, "dead_at")?,
    })
}

/// The counts per state of the stats row; the oldest pending event and the time of the
/// observation come from wherever the store reads them.
pub fn outbox_stats(
    row: &impl StoredRow,
    oldest_pending_enqueued_at: Option<DateTime<Utc>>,
    observed_at: DateTime<Utc>,
) -> Result<OutboxStats, StoreError> {
    Ok(OutboxStats {
        pending: row.count("pending")?,
        retrying: row.count("retrying")?,
        in_flight: row.count("in_flight")?,
        delivered: row.count("delivered")?,
        dead: row.count("dead")?,
        oldest_pending_enqueued_at,
        observed_at: Some(observed_at),
    })
}

/// One destination's row of the per-destination counts; `route` is its routed destination, the
/// empty text for events no route names.
pub fn destination_stats(
    row: &impl StoredRow,
    route: String,
) -> Result<DestinationStats, StoreError> {
    Ok(DestinationStats {
        destination: (!route.is_empty()).then_some(route),
        pending: row.count("pending")?,
        retrying: row.count("retrying")?,
        in_flight: row.count("in_flight")?,
        dead: row.count("dead")?,
        oldest_pending_enqueued_at: row.opt_time(0, "oldest")?,
        last_error: row.opt_text("last_error")?,
    })
}

/// The per-destination counts in the order operators read them: by destination, unrouted
/// events first.
pub fn sort_destinations(mut stats: Vec<DestinationStats>) -> Vec<DestinationStats> {
    stats.sort_by(|a, b| a.destination.cmp(&b.destination));
    stats
}

/// The per-destination counts of the stats `rows`, each row's routed destination read by
/// `route` (the column's type differs per store), in the order of [`sort_destinations`].
pub fn sorted_destination_stats<R: StoredRow>(
    rows: impl IntoIterator<Item = R>,
    route: impl Fn(&R) -> Result<String, StoreError>,
) -> Result<Vec<DestinationStats>, StoreError> {
    let stats = rows
        .into_iter()
        .map(|row| destination_stats(&row, route(&row)?))
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(sort_destinations(stats))
}

/// One relay's row of the leases read.
pub fn lease_holder(row: &impl StoredRow) -> Result<LeaseHolder, StoreError> {
    Ok(LeaseHolder {
        owner: row.text("owner")?,
        events: row.count("events")?,
        claimed_since: row.opt_time(0, "claimed_since")?,
        expires_at: row.opt_time(0, "expires_at")?,
        expired: row.count("expired")?,
    })
}

/// One row of the paused destinations.
pub fn paused_destination(row: &impl StoredRow) -> Result<PausedDestination, StoreError> {
    Ok(PausedDestination {
        destination: row.text("destination")?,
        paused_at: row.time(0, "paused_at")?,
        paused_by: row.text("paused_by")?,
    })
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
