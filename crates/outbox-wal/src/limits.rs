//! How large one record of the WAL may be, and what becomes of one that is larger.
//!
//! Anyone who may insert into a captured table (or, with the message source on, call
//! `pg_logical_emit_message`) decides how large a record the relay reads. Two bounds, both
//! from the engine's settings, keep that from stalling replication or exhausting memory:
//!
//! - **On the wire** ([`Limits::wire`]): the replication client reads past a record larger
//!   than `max_payload_bytes + max_metadata_bytes` (doubled with the message source on: a
//!   message's payload travels as an escaped JSON string) plus [`FRAMING`], keeping only its
//!   first [`Limits::prefix`] bytes: enough for the XLogData header, the `pgoutput` message
//!   kind, the relation, and the leading columns of a row whose columns other than the payload
//!   are within `max_metadata_bytes`. The slot moves past it; what it was is dead-lettered
//!   from what those bytes tell (`stream` module).
//! - **Per column** ([`Limits::check_row`], [`Limits::check_event`]): a record within the wire
//!   bound whose payload is over `max_payload_bytes`, or whose other columns together are over
//!   `max_metadata_bytes`, is dead-lettered before it is decoded into an event or copied
//!   anywhere: one check, on the `pgoutput` tuple, for every table source, and one on the
//!   decoded envelope of a message.
//!
//! A dead event that has to be written into the outbox table (it came from a message, the
//! stream table or a Debezium table, so no row holds it) is written in a form the table can
//! hold ([`storable`]): fields cut to [`KEEP_FIELD_BYTES`] with a marker, the payload left
//! out when it is over the limit, the original sizes in `last_error`.

use outbox_types::{Event, Headers};

/// Room on the wire for what is not a column value: the XLogData header, the `pgoutput`
/// message and tuple headers, the fixed-size columns (ids, timestamps, counters), a message
/// envelope's keys.
pub(crate) const FRAMING: u64 = 64 * 1024;

/// The replication client's cap on one message.
const MAX_WIRE: u64 = pgwire_replication::protocol::framing::MAX_MESSAGE_SIZE as u64;

/// How much of a text field a dead row written in storable form keeps. Small enough that a
/// row of such fields fits every index of the outbox table (a btree entry must stay under
/// about 2,700 bytes: `aggregate_type` and `aggregate_id` share one).
pub(crate) const KEEP_FIELD_BYTES: usize = 256;

/// The record limits of one relay: `relay.max_payload_bytes` and `relay.max_metadata_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    pub max_payload_bytes: u64,
    pub max_metadata_bytes: u64,
    /// Whether logical messages are read (their payload is escaped: up to twice its size).
    pub messages: bool,
}

impl Default for Limits {
    /// The engine's defaults, without messages.
    fn default() -> Self {
        let relay = outbox_engine::RelayConfig::default();
        Limits {
            max_payload_bytes: relay.max_payload_bytes,
            max_metadata_bytes: relay.max_metadata_bytes,
            messages: false,
        }
    }
}

/// Why an event is not delivered for its size: the payload, the other columns together, or
/// the whole record (read past on the wire, its parts unknown).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Oversize {
    Payload { bytes: u64, limit: u64 },
    Metadata { bytes: u64, limit: u64 },
    Record { bytes: u64, limit: u64 },
}

impl Oversize {
    /// What is over which setting (no advice: that depends on where the event is kept).
    pub fn what(&self) -> String {
        match self {
            Oversize::Payload { bytes, limit } => {
                format!("the payload is {bytes} bytes, above relay.max_payload_bytes = {limit}")
            }
            Oversize::Metadata { bytes, limit } => format!(
                "the columns other than the payload (aggregate type and id, event type, destination, headers, idempotency key, …) take {bytes} bytes together, above relay.max_metadata_bytes = {limit}"
            ),
            Oversize::Record { bytes, limit } => format!(
                "the record is {bytes} bytes in the WAL, above the {limit} bytes the relay reads of one record (relay.max_payload_bytes + relay.max_metadata_bytes + framing; the relay read past it)"
            ),
        }
    }

    /// The setting to raise.
    fn setting(&self) -> &'static str {
        match self {
            Oversize::Payload { .. } => "relay.max_payload_bytes",
            Oversize::Metadata { .. } => "relay.max_metadata_bytes",
            Oversize::Record { .. } => "relay.max_payload_bytes or relay.max_metadata_bytes",
        }
    }

    /// The dead letter's reason for an outbox table row, which keeps the event: raise the
    /// limit and requeue it.
    pub fn for_row(&self) -> String {
        format!(
            "{}: the relay does not deliver it; raise {} (if the destination accepts such messages) and run `outbox dead requeue`, or `outbox dead purge` it",
            self.what(),
            self.setting()
        )
    }

    /// The dead letter's reason for an event copied into the outbox table in cut form
    /// ([`storable`]), whose whole self is kept `elsewhere` (or nowhere).
    pub fn for_copy(&self, elsewhere: &str) -> String {
        format!(
            "{}: the relay does not deliver it. {elsewhere} Do not requeue this row: it keeps only what the outbox table can hold; raise {} and write the event again, then `outbox dead purge` this row",
            self.what(),
            self.setting()
        )
    }
}

impl Limits {
    /// Most bytes one record may take on the wire and still be read (the replication
    /// client's `max_message_size`): the two limits, doubled with the message source on,
    /// plus [`FRAMING`]; at most 1 GiB, the client's cap (and PostgreSQL's for one message).
    pub fn wire(&self) -> u64 {
        let columns = self
            .max_payload_bytes
            .saturating_add(self.max_metadata_bytes);
        let columns = if self.messages {
            columns.saturating_mul(2)
        } else {
            columns
        };
        columns.saturating_add(FRAMING).min(MAX_WIRE)
    }

    /// How much of a record read past is kept to tell what it was.
    pub fn prefix(&self) -> u64 {
        self.max_metadata_bytes
            .saturating_add(FRAMING)
            .min(self.wire())
    }

    /// A row's sizes in text form, checked before it is decoded: `payload` the size of its
    /// payload column (when it has one), `others` the sum of every other column's.
    pub fn check_row(&self, payload: Option<u64>, others: u64) -> Result<(), Oversize> {
        self.check(payload.unwrap_or(0), others)
    }

    /// A decoded message's sizes, checked before it becomes an event.
    pub fn check_event(&self, event: &Event) -> Result<(), Oversize> {
        self.check(event.payload.len() as u64, metadata_bytes(event))
    }

    fn check(&self, payload: u64, others: u64) -> Result<(), Oversize> {
        if payload > self.max_payload_bytes {
            return Err(Oversize::Payload {
                bytes: payload,
                limit: self.max_payload_bytes,
            });
        }
        if others > self.max_metadata_bytes {
            return Err(Oversize::Metadata {
                bytes: others,
                limit: self.max_metadata_bytes,
            });
        }
        Ok(())
    }
}

/// The bytes of an event's columns other than the payload.
pub(crate) fn metadata_bytes(event: &Event) -> u64 {
    let headers: usize = event.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    (event.aggregate_type.len()
        + event.aggregate_id.len()
        + event.event_type.len()
        + event.destination.as_deref().map_or(0, str::len)
        + event.idempotency_key.as_deref().map_or(0, str::len)
        + headers) as u64
}

/// The bytes an event holds in memory (its strings), for the stream's buffer accounting.
pub(crate) fn event_bytes(event: &Event) -> usize {
    event.payload.len() + metadata_bytes(event) as usize
}

/// `text` cut to at most [`KEEP_FIELD_BYTES`] (on a character boundary) with a marker naming
/// its full size; unchanged when it fits.
pub(crate) fn cut(text: &str) -> String {
    if text.len() <= KEEP_FIELD_BYTES {
        return text.to_owned();
    }
    let mut end = KEEP_FIELD_BYTES - 64;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…[cut from {} bytes]", &text[..end], text.len())
}

/// `event` as a dead row the outbox table can hold: every text field cut ([`cut`]), headers
/// and idempotency key dropped when they are over [`KEEP_FIELD_BYTES`] together, the payload
/// replaced by `null` when `drop_payload`. Returns the event and a note of what was changed
/// and the original sizes, for `last_error` (empty when nothing was).
pub(crate) fn storable(mut event: Event, drop_payload: bool) -> (Event, String) {
    let mut notes: Vec<String> = Vec::new();
    for (name, field) in [
        ("aggregate_type", &mut event.aggregate_type),
        ("aggregate_id", &mut event.aggregate_id),
        ("event_type", &mut event.event_type),
    ] {
        if field.len() > KEEP_FIELD_BYTES {
            notes.push(format!("{name} {} bytes", field.len()));
            *field = cut(field);
        }
    }
    if let Some(destination) = &event.destination
        && destination.len() > KEEP_FIELD_BYTES
    {
        notes.push(format!("destination {} bytes", destination.len()));
        event.destination = Some(cut(destination));
    }
    if let Some(key) = &event.idempotency_key
        && key.len() > KEEP_FIELD_BYTES
    {
        notes.push(format!("idempotency_key {} bytes (left out)", key.len()));
        event.idempotency_key = None;
    }
    let headers: usize = event.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    if headers > KEEP_FIELD_BYTES {
        notes.push(format!(
            "headers {} bytes in {} (left out)",
            headers,
            event.headers.len()
        ));
        event.headers = Headers::new();
    }
    if drop_payload {
        notes.push(format!("payload {} bytes (left out)", event.payload.len()));
        event.payload = "null".to_owned();
    }
    let note = if notes.is_empty() {
        String::new()
    } else {
        format!(
            " Kept in a form the outbox table can hold, cut: {}.",
            notes.join(", ")
        )
    };
    (event, note)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(messages: bool) -> Limits {
        Limits {
            max_payload_bytes: 1024 * 1024,
            max_metadata_bytes: 64 * 1024,
            messages,
        }
    }

    #[test]
    fn the_wire_bound_leaves_room_for_escaped_messages() {
        assert_eq!(limits(false).wire(), 1024 * 1024 + 64 * 1024 + FRAMING);
        assert_eq!(limits(true).wire(), 2 * (1024 * 1024 + 64 * 1024) + FRAMING);
        assert_eq!(limits(false).prefix(), 64 * 1024 + FRAMING);
        let tiny = Limits {
            max_payload_bytes: 1,
            max_metadata_bytes: u64::MAX,
            messages: true,
        };
        assert_eq!(tiny.wire(), MAX_WIRE);
    }

    #[test]
    fn payload_and_other_columns_are_checked_apart() {
        let l = limits(false);
        assert!(l.check_row(Some(1024 * 1024), 64 * 1024).is_ok());
        let payload = l.check_row(Some(1024 * 1024 + 1), 10).unwrap_err();
        let reason = payload.for_row();
        assert!(
            reason.contains("1048577 bytes, above relay.max_payload_bytes = 1048576")
                && reason.contains("outbox dead requeue"),
            "{reason}"
        );
        let others = l.check_row(Some(10), 64 * 1024 + 1).unwrap_err();
        let reason = others.for_copy("The row stays in x.");
        assert!(
            reason.contains("65537 bytes together, above relay.max_metadata_bytes = 65536")
                && reason.contains("The row stays in x. Do not requeue"),
            "{reason}"
        );
    }

    #[test]
    fn storable_cuts_fields_and_says_what_it_cut() {
        let mut event = crate::pgoutput::placeholder(1, 0);
        event.aggregate_type = "order".into();
        event.aggregate_id = "é".repeat(50_000);
        event.payload = "{\"a\":1}".into();
        event.idempotency_key = Some("k".repeat(300));
        event.headers.insert("x".into(), "y".repeat(400));
        let (kept, note) = storable(event, true);
        assert_eq!(kept.aggregate_type, "order");
        assert!(kept.aggregate_id.len() <= KEEP_FIELD_BYTES + 40);
        assert!(kept.aggregate_id.ends_with("…[cut from 100000 bytes]"));
        assert_eq!(kept.payload, "null");
        assert!(kept.headers.is_empty() && kept.idempotency_key.is_none());
        for part in [
            "aggregate_id 100000 bytes",
            "idempotency_key 300 bytes",
            "headers 401 bytes",
            "payload 7 bytes",
        ] {
            assert!(note.contains(part), "{note}");
        }
        let small = crate::pgoutput::placeholder(2, 0);
        assert_eq!(storable(small, false).1, "");
    }
}
