//! Decoding the parts of the `pgoutput` protocol (version 1) that the replication client hands
//! over raw: `Relation` and `Insert`, and turning an inserted outbox row into an [`Event`].
//!
//! `Begin`, `Commit` and logical `Message`s are parsed by the client itself. Of updates and
//! deletes only the relation is read (a reused Debezium publication publishes them; the
//! `debezium` source ignores deletes and reports updates); truncates, type and origin messages
//! are skipped. Column values arrive in text form; the replication session pins
//! `DateStyle=ISO` and `TimeZone=UTC` so timestamps always read the same.

use std::collections::HashMap;

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_types::{Event, EventId, Headers};
use uuid::Uuid;

/// One decoded `pgoutput` message we care about.
#[derive(Debug)]
pub(crate) enum Decoded<'a> {
    /// A relation (table) description, sent before the first change of a table in a session and
    /// again after its definition changed.
    Relation(Relation),
    /// A new row: the relation id and the column values in text form (`None` = SQL NULL).
    Insert {
        relid: u32,
        values: Vec<Option<&'a [u8]>>,
    },
    /// An update of a row of the relation (only its id is read).
    Update { relid: u32 },
    /// A delete of a row (ignored wherever it is: nothing reads deletes).
    Delete,
    /// Anything else (truncates, types, origins).
    Other,
}

/// A table as described by a `Relation` message.
#[derive(Clone, Debug)]
pub(crate) struct Relation {
    pub relid: u32,
    pub namespace: String,
    pub name: String,
    pub columns: Vec<String>,
    /// The type OID of each column.
    pub types: Vec<u32>,
}

impl Relation {
    /// Each column's position, by name.
    pub fn column_index(&self) -> HashMap<&str, usize> {
        self.columns
            .iter()
            .enumerate()
            .map(|(i, c)| (c.as_str(), i))
            .collect()
    }
}

struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.data.len() < n {
            return Err(format!(
                "pgoutput message truncated: wanted {n} bytes, {} left",
                self.data.len()
            ));
        }
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn i16(&mut self) -> Result<i16, String> {
        let b = self.take(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }
    fn i32(&mut self) -> Result<i32, String> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn cstr(&mut self) -> Result<String, String> {
        let end = self
            .data
            .iter()
            .position(|&b| b == 0)
            .ok_or("pgoutput string without terminator")?;
        let text = String::from_utf8_lossy(&self.data[..end]).into_owned();
        self.data = &self.data[end + 1..];
        Ok(text)
    }
}

/// Decode one XLogData payload.
pub(crate) fn decode(data: &[u8]) -> Result<Decoded<'_>, String> {
    let mut r = Reader { data };
    let tag = r.u8()?;
    match tag {
        b'R' => {
            let relid = r.i32()? as u32;
            let namespace = r.cstr()?;
            let name = r.cstr()?;
            let _replica_identity = r.u8()?;
            let ncols = r.i16()?.max(0) as usize;
            let mut columns = Vec::with_capacity(ncols);
            let mut types = Vec::with_capacity(ncols);
            for _ in 0..ncols {
                let _flags = r.u8()?;
                columns.push(r.cstr()?);
                types.push(r.i32()? as u32);
                let _typmod = r.i32()?;
            }
            Ok(Decoded::Relation(Relation {
                relid,
                namespace,
                name,
                columns,
                types,
            }))
        }
        b'I' => {
            let relid = r.i32()? as u32;
            let kind = r.u8()?;
            if kind != b'N' {
                return Err(format!(
                    "pgoutput Insert: expected a new tuple ('N'), got {:?}",
                    kind as char
                ));
            }
            let ncols = r.i16()?.max(0) as usize;
            let mut values = Vec::with_capacity(ncols);
            for _ in 0..ncols {
                match r.u8()? {
                    b'n' | b'u' => values.push(None),
                    b't' | b'b' => {
                        let len = r.i32()?.max(0) as usize;
                        values.push(Some(r.take(len)?));
                    }
                    other => {
                        return Err(format!(
                            "pgoutput tuple: unknown column kind {:?}",
                            other as char
                        ));
                    }
                }
            }
            Ok(Decoded::Insert { relid, values })
        }
        b'U' => Ok(Decoded::Update {
            relid: r.i32()? as u32,
        }),
        b'D' => Ok(Decoded::Delete),
        _ => Ok(Decoded::Other),
    }
}

/// A column of a record read past for its size (see [`decode_head`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Column<'a> {
    /// SQL NULL, or a TOASTed value left unchanged (never in an insert).
    Null,
    /// The whole value, in text form.
    Whole(&'a [u8]),
    /// A value whose length is known but whose bytes were not kept.
    Cut { len: usize },
}

impl Column<'_> {
    /// Its length in bytes (0 for NULL).
    pub fn len(&self) -> usize {
        match self {
            Column::Null => 0,
            Column::Whole(v) => v.len(),
            Column::Cut { len } => *len,
        }
    }

    /// Its text, when it was kept whole and is UTF-8.
    pub fn text(&self) -> Option<&str> {
        match self {
            Column::Whole(v) => std::str::from_utf8(v).ok(),
            _ => None,
        }
    }
}

/// What the kept beginning of a record read past for its size tells about it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Head<'a> {
    /// A new row of relation `relid`: its leading columns, as far as the kept bytes reach
    /// (fewer than the table has when they end early).
    Insert {
        relid: u32,
        columns: Vec<Column<'a>>,
    },
    /// A logical decoding message: its prefix (when the kept bytes hold all of it) and LSN.
    Message {
        transactional: bool,
        lsn: u64,
        prefix: Option<String>,
    },
    /// An update of a row of `relid`.
    Update { relid: u32 },
    /// A relation description (a table of some thousand columns).
    Relation {
        relid: u32,
        namespace: Option<String>,
        name: Option<String>,
    },
    /// Anything else, or too little kept to tell.
    Other,
}

/// Read what can be read of the first bytes of a `pgoutput` message that was too large to be
/// held: never fails, says less when less was kept.
pub(crate) fn decode_head(data: &[u8]) -> Head<'_> {
    let mut r = Reader { data };
    let Ok(tag) = r.u8() else {
        return Head::Other;
    };
    match tag {
        b'I' => {
            let (Ok(relid), Ok(b'N'), Ok(ncols)) = (r.i32(), r.u8(), r.i16()) else {
                return Head::Other;
            };
            let mut columns = Vec::new();
            for _ in 0..ncols.max(0) {
                match r.u8() {
                    Ok(b'n' | b'u') => columns.push(Column::Null),
                    Ok(b't' | b'b') => {
                        let Ok(len) = r.i32() else { break };
                        let len = len.max(0) as usize;
                        if r.data.len() >= len {
                            columns.push(Column::Whole(r.take(len).unwrap_or_default()));
                        } else {
                            columns.push(Column::Cut { len });
                            break;
                        }
                    }
                    _ => break,
                }
            }
            Head::Insert {
                relid: relid as u32,
                columns,
            }
        }
        b'M' => {
            let (Ok(flags), Ok(hi), Ok(lo)) = (r.u8(), r.i32(), r.i32()) else {
                return Head::Other;
            };
            let lsn = (u64::from(hi as u32) << 32) | u64::from(lo as u32);
            Head::Message {
                transactional: flags & 1 != 0,
                lsn,
                prefix: r.cstr().ok(),
            }
        }
        b'U' => match r.i32() {
            Ok(relid) => Head::Update {
                relid: relid as u32,
            },
            Err(_) => Head::Other,
        },
        b'R' => match r.i32() {
            Ok(relid) => Head::Relation {
                relid: relid as u32,
                namespace: r.cstr().ok(),
                name: r.cstr().ok(),
            },
            Err(_) => Head::Other,
        },
        _ => Head::Other,
    }
}

/// The sizes the record limits are checked against: the payload column's (when `payload` is
/// one of `columns`) and the sum of every other column's.
pub(crate) fn column_sizes<'a>(
    columns: impl IntoIterator<Item = Column<'a>>,
    payload: usize,
) -> (Option<u64>, u64) {
    let mut payload_len = None;
    let mut others = 0u64;
    for (i, column) in columns.into_iter().enumerate() {
        if i == payload {
            payload_len = Some(column.len() as u64);
        } else {
            others += column.len() as u64;
        }
    }
    (payload_len, others)
}

/// The columns of a whole row, as [`Column`]s.
pub(crate) fn whole<'a>(values: &[Option<&'a [u8]>]) -> Vec<Column<'a>> {
    values
        .iter()
        .map(|v| match v {
            Some(v) => Column::Whole(v),
            None => Column::Null,
        })
        .collect()
}

/// What identifies a row that is not delivered for its size, read from its leading columns
/// (each `None` when it was not kept whole).
#[derive(Debug, Default)]
pub(crate) struct Identity {
    pub seq: Option<i64>,
    pub id: Option<Uuid>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    /// The row's `status`, when kept: only `pending` rows are events.
    pub status: Option<String>,
}

/// Where each outbox column sits in the table's relation.
#[derive(Clone, Debug)]
pub(crate) struct OutboxLayout {
    /// The `seq` column; `None` for a stream table, whose events take their LSN as `seq`.
    seq: Option<usize>,
    id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: usize,
    payload: usize,
    destination: Option<usize>,
    headers: Option<usize>,
    idempotency_key: Option<usize>,
    occurred_at: Option<usize>,
    enqueued_at: Option<usize>,
    status: Option<usize>,
    attempts: Option<usize>,
    /// Whether `payload` is a `json`/`jsonb` column (PostgreSQL checked it) or must be checked.
    payload_is_json: bool,
}

/// `json` and `jsonb`.
const JSON_TYPES: [u32; 2] = [114, 3802];

/// An inserted outbox row that cannot be read as an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BadRow {
    /// Its primary key, when even that cannot be read (then it cannot be dead-lettered).
    pub seq: Option<i64>,
    /// Its `attempts`, to keep when it is dead-lettered.
    pub attempts: u32,
    /// What is wrong, naming the column.
    pub reason: String,
}

/// The text every malformed row gets as `last_error`, in polling and WAL mode alike: what is
/// wrong and what to do about it.
pub(crate) fn malformed_error(seq: i64, reason: &str) -> String {
    outbox_types::bury_malformed(
        seq,
        &outbox_types::StoreError::Corrupt {
            seq,
            reason: reason.to_owned(),
        },
    )
    .error
}

/// A stand-in event for a row that cannot be decoded, carrying what the dead-letter write
/// needs: its `seq` and `attempts`.
pub(crate) fn placeholder(seq: i64, attempts: u32) -> Event {
    Event {
        seq,
        id: EventId::from_uuid(Uuid::nil()),
        aggregate_type: String::new(),
        aggregate_id: String::new(),
        event_type: String::new(),
        payload: "null".to_owned(),
        destination: None,
        headers: Headers::new(),
        idempotency_key: None,
        occurred_at: Utc::now(),
        enqueued_at: Utc::now(),
        attempts,
    }
}

/// Check that a payload stored in a column that is not `json` is JSON after all.
pub(crate) fn check_json(payload: &str) -> Result<(), String> {
    serde_json::from_str::<serde::de::IgnoredAny>(payload)
        .map(|_| ())
        .map_err(|e| format!("column `payload` is not JSON ({e})"))
}

/// Headers as stored (JSON text) into [`Headers`].
pub(crate) fn parse_headers(json: &str) -> Result<Headers, String> {
    serde_json::from_str(json).map_err(|e| {
        format!("column `headers` is not a JSON object of strings ({e}); store every header value as a string")
    })
}

impl OutboxLayout {
    /// The position of the `payload` column.
    pub fn payload_index(&self) -> usize {
        self.payload
    }

    /// Whether an inserted row is `pending` (a row without a `status` column is): only those
    /// are events; the relay inserts dead copies itself.
    pub fn is_pending(&self, values: &[Option<&[u8]>]) -> bool {
        match self.status.map(|i| values.get(i).copied().flatten()) {
            Some(Some(status)) => status == b"pending",
            _ => true,
        }
    }

    /// What `columns` (a row's leading columns) tell of the row.
    pub fn identity(&self, columns: &[Column<'_>]) -> Identity {
        let text = |i: Option<usize>| i.and_then(|i| columns.get(i)).and_then(Column::text);
        Identity {
            seq: text(self.seq).and_then(|s| s.parse().ok()),
            id: text(Some(self.id)).and_then(|s| Uuid::parse_str(s).ok()),
            aggregate_type: text(Some(self.aggregate_type)).map(str::to_owned),
            aggregate_id: text(Some(self.aggregate_id)).map(str::to_owned),
            event_type: text(Some(self.event_type)).map(str::to_owned),
            status: text(self.status).map(str::to_owned),
        }
    }

    /// Map the columns of `relation`; fails when a required column is missing.
    pub fn of(relation: &Relation) -> Result<Self, String> {
        Self::map(relation, true)
    }

    /// Map the columns of a stream table (`<table>_stream`): the outbox table's event columns
    /// without `seq` and the delivery state, which such a table does not have.
    pub fn of_stream(relation: &Relation) -> Result<Self, String> {
        Self::map(relation, false)
    }

    /// The event columns, and with `delivery_state` the `seq`, `status` and `attempts` of the
    /// outbox table.
    fn map(relation: &Relation, delivery_state: bool) -> Result<Self, String> {
        let index = relation.column_index();
        let need = |name: &str| {
            index.get(name).copied().ok_or_else(|| {
                format!(
                    "outbox table {}.{} has no column `{name}` in the replication stream",
                    relation.namespace, relation.name
                )
            })
        };
        let state = |name: &str| {
            if delivery_state {
                index.get(name).copied()
            } else {
                None
            }
        };
        Ok(OutboxLayout {
            seq: if delivery_state {
                Some(need("seq")?)
            } else {
                None
            },
            id: need("id")?,
            aggregate_type: need("aggregate_type")?,
            aggregate_id: need("aggregate_id")?,
            event_type: need("event_type")?,
            payload: need("payload")?,
            destination: index.get("destination").copied(),
            headers: index.get("headers").copied(),
            idempotency_key: index.get("idempotency_key").copied(),
            occurred_at: index.get("occurred_at").copied(),
            enqueued_at: index.get("enqueued_at").copied(),
            status: state("status"),
            attempts: state("attempts"),
            payload_is_json: index
                .get("payload")
                .and_then(|&i| relation.types.get(i))
                .is_some_and(|t| JSON_TYPES.contains(t)),
        })
    }

    /// Turn an inserted row into an event; `lsn` is its position in the WAL, the `seq` of a row
    /// without one. Returns `None` for rows not inserted as `pending` (dead-letter rows that WAL
    /// mode itself inserts for message events). A row that cannot be read is a [`BadRow`] whose
    /// reason names the column.
    pub fn event(&self, values: &[Option<&[u8]>], lsn: i64) -> Result<Option<Event>, BadRow> {
        let row = Columns { values };
        let bad = |seq: Option<i64>, attempts: u32, reason: String| BadRow {
            seq,
            attempts,
            reason,
        };
        if let Some(status) = row
            .optional(self.status, "status")
            .map_err(|r| bad(None, 0, r))?
            && status != "pending"
        {
            return Ok(None);
        }
        let seq: i64 = match self.seq {
            None => lsn,
            Some(column) => row
                .required(column, "seq")
                .and_then(|s| {
                    s.parse()
                        .map_err(|e| format!("column `seq` is not a number ({e})"))
                })
                .map_err(|r| bad(None, 0, r))?,
        };
        let attempts = row
            .optional(self.attempts, "attempts")
            .ok()
            .flatten()
            .and_then(|a| a.parse::<u32>().ok())
            .unwrap_or(0);
        self.read(&row, seq, attempts)
            .map(Some)
            .map_err(|reason| bad(Some(seq), attempts, reason))
    }

    fn read(&self, row: &Columns<'_, '_>, seq: i64, attempts: u32) -> Result<Event, String> {
        let id = row.required(self.id, "id")?;
        let id = Uuid::parse_str(id).map_err(|e| format!("column `id` is not a UUID ({e})"))?;
        let headers = match row.optional(self.headers, "headers")? {
            Some(json) if json != "{}" => parse_headers(json)?,
            _ => Headers::new(),
        };
        let payload = row.required(self.payload, "payload")?;
        if !self.payload_is_json {
            check_json(payload)?;
        }
        let time = |i: Option<usize>, name: &str| -> Result<Option<DateTime<Utc>>, String> {
            row.optional(i, name)?
                .map(|t| parse_timestamptz(t).map_err(|e| format!("column `{name}`: {e}")))
                .transpose()
        };
        let now = Utc::now();
        let occurred_at = time(self.occurred_at, "occurred_at")?.unwrap_or(now);
        let enqueued_at = time(self.enqueued_at, "enqueued_at")?.unwrap_or(now);
        Ok(Event {
            seq,
            id: EventId::from_uuid(id),
            aggregate_type: row
                .required(self.aggregate_type, "aggregate_type")?
                .to_owned(),
            aggregate_id: row.required(self.aggregate_id, "aggregate_id")?.to_owned(),
            event_type: row.required(self.event_type, "event_type")?.to_owned(),
            payload: payload.to_owned(),
            destination: row
                .optional(self.destination, "destination")?
                .map(str::to_owned),
            headers,
            idempotency_key: row
                .optional(self.idempotency_key, "idempotency_key")?
                .map(str::to_owned),
            occurred_at,
            enqueued_at,
            attempts,
        })
    }
}

/// The text-form column values of one inserted row.
struct Columns<'r, 'v> {
    values: &'r [Option<&'v [u8]>],
}

impl<'v> Columns<'_, 'v> {
    fn text(&self, i: usize, name: &str) -> Result<Option<&'v str>, String> {
        match self.values.get(i).copied().flatten() {
            None => Ok(None),
            Some(bytes) => std::str::from_utf8(bytes)
                .map(Some)
                .map_err(|e| format!("column `{name}` is not UTF-8 ({e})")),
        }
    }

    fn required(&self, i: usize, name: &str) -> Result<&'v str, String> {
        self.text(i, name)?
            .ok_or_else(|| format!("column `{name}` is NULL; it needs a value"))
    }

    fn optional(&self, i: Option<usize>, name: &str) -> Result<Option<&'v str>, String> {
        match i {
            Some(i) => self.text(i, name),
            None => Ok(None),
        }
    }
}

/// Parse PostgreSQL's ISO output of a `timestamptz`: `2024-05-01 10:20:30.123456+00`, with an
/// offset of `+HH`, `+HH:MM` or `+HH:MM:SS`.
pub(crate) fn parse_timestamptz(text: &str) -> Result<DateTime<Utc>, String> {
    let bad = || format!("invalid timestamp `{text}`");
    // The offset sign comes after the date (which has its own dashes) and the time.
    let split = text
        .get(19..)
        .and_then(|rest| rest.find(['+', '-']))
        .map(|i| i + 19)
        .ok_or_else(bad)?;
    let (local, offset) = text.split_at(split);
    // `FromStr` parses ISO 8601 without interpreting a format string each time (this runs for
    // every decoded row); it wants the `T` separator.
    let naive: NaiveDateTime = local.replacen(' ', "T", 1).parse().map_err(|_| bad())?;
    let sign: i64 = if offset.starts_with('-') { -1 } else { 1 };
    let mut seconds = 0i64;
    for (i, part) in offset[1..].split(':').enumerate() {
        let value: i64 = part.parse().map_err(|_| bad())?;
        seconds += value
            * match i {
                0 => 3600,
                1 => 60,
                2 => 1,
                _ => return Err(bad()),
            };
    }
    let utc = naive - chrono::Duration::seconds(sign * seconds);
    Ok(DateTime::from_naive_utc_and_offset(utc, Utc))
}

/// A `pgoutput` timestamp (microseconds since 2000-01-01 UTC) as a time.
pub(crate) fn pg_epoch_micros(micros: i64) -> DateTime<Utc> {
    const PG_EPOCH_UNIX_SECS: i64 = 946_684_800;
    DateTime::from_timestamp_micros(micros.saturating_add(PG_EPOCH_UNIX_SECS * 1_000_000))
        .unwrap_or_else(Utc::now)
}

#[cfg(test)]
mod head_tests {
    use super::*;

    fn insert(columns: &[Option<&[u8]>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend_from_slice(&16384i32.to_be_bytes());
        m.push(b'N');
        m.extend_from_slice(&(columns.len() as i16).to_be_bytes());
        for c in columns {
            match c {
                None => m.push(b'n'),
                Some(v) => {
                    m.push(b't');
                    m.extend_from_slice(&(v.len() as i32).to_be_bytes());
                    m.extend_from_slice(v);
                }
            }
        }
        m
    }

    #[test]
    fn the_head_of_a_big_row_names_its_leading_columns_and_the_cut_ones_length() {
        let payload = vec![b'x'; 10_000];
        let full = insert(&[
            Some(b"42"),
            None,
            Some(b"order"),
            Some(&payload),
            Some(b"end"),
        ]);
        let head = decode_head(&full[..40]);
        assert_eq!(
            head,
            Head::Insert {
                relid: 16384,
                columns: vec![
                    Column::Whole(b"42"),
                    Column::Null,
                    Column::Whole(b"order"),
                    Column::Cut { len: 10_000 },
                ],
            }
        );
        // Cut inside a length field: the columns before it.
        assert!(
            matches!(decode_head(&full[..25]), Head::Insert { columns, .. } if columns.len() == 3)
        );
        let Head::Insert { columns, .. } = decode_head(&full) else {
            panic!()
        };
        assert_eq!(column_sizes(columns, 3), (Some(10_000), 10));
        assert_eq!(decode_head(b""), Head::Other);
        assert_eq!(decode_head(b"I\0"), Head::Other);
    }

    #[test]
    fn the_head_of_a_big_message_names_its_prefix_and_lsn() {
        let mut m = vec![b'M', 1];
        m.extend_from_slice(&0x0000_0001_0000_0002u64.to_be_bytes());
        m.extend_from_slice(b"outbox\0");
        m.extend_from_slice(&5_000_000i32.to_be_bytes());
        m.extend_from_slice(b"{\"v\":1");
        assert_eq!(
            decode_head(&m),
            Head::Message {
                transactional: true,
                lsn: 0x0000_0001_0000_0002,
                prefix: Some("outbox".into()),
            }
        );
        assert!(matches!(
            decode_head(&m[..13]),
            Head::Message { prefix: None, .. }
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The columns of an outbox table both decoding tests start from (each adds its own last).
    const EVENT_COLUMNS: [&str; 8] = [
        "seq",
        "id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
        "headers",
        "status",
    ];

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    #[test]
    fn relation_and_insert_decode() {
        let cols = [EVENT_COLUMNS.as_slice(), &["occurred_at"]].concat();
        let mut rel = vec![b'R'];
        rel.extend_from_slice(&16384i32.to_be_bytes());
        cstr(&mut rel, "outbox");
        cstr(&mut rel, "events");
        rel.push(b'd');
        rel.extend_from_slice(&(cols.len() as i16).to_be_bytes());
        for c in &cols {
            rel.push(0);
            cstr(&mut rel, c);
            rel.extend_from_slice(&25i32.to_be_bytes());
            rel.extend_from_slice(&(-1i32).to_be_bytes());
        }
        let Decoded::Relation(relation) = decode(&rel).unwrap() else {
            panic!("not a relation")
        };
        assert_eq!(relation.columns.len(), cols.len());
        let layout = OutboxLayout::of(&relation).unwrap();

        let id = Uuid::now_v7().to_string();
        let values = [
            "7",
            &id,
            "order",
            "42",
            "OrderCreated",
            r#"{"a":1}"#,
            r#"{"k": "v"}"#,
            "pending",
            "2024-05-01 10:20:30.5+02",
        ];
        let mut ins = vec![b'I'];
        ins.extend_from_slice(&16384i32.to_be_bytes());
        ins.push(b'N');
        ins.extend_from_slice(&(values.len() as i16).to_be_bytes());
        for v in values {
            ins.push(b't');
            ins.extend_from_slice(&(v.len() as i32).to_be_bytes());
            ins.extend_from_slice(v.as_bytes());
        }
        let Decoded::Insert { relid, values } = decode(&ins).unwrap() else {
            panic!("not an insert")
        };
        assert_eq!(relid, 16384);
        let event = layout.event(&values, 0).unwrap().unwrap();
        assert_eq!(event.seq, 7);
        assert_eq!(event.id.to_string(), id);
        assert_eq!(event.payload, r#"{"a":1}"#);
        assert_eq!(event.headers.get("k").unwrap(), "v");
        assert_eq!(
            event.occurred_at.to_rfc3339(),
            "2024-05-01T08:20:30.500+00:00"
        );
        assert!(
            decode(&ins[..ins.len() - 3]).is_err(),
            "truncation is detected"
        );
    }

    #[test]
    fn malformed_rows_name_the_column_and_keep_their_seq() {
        let columns = [EVENT_COLUMNS.as_slice(), &["attempts"]].concat();
        let relation = |payload_type: u32| Relation {
            relid: 1,
            namespace: "outbox".into(),
            name: "events".into(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            types: columns
                .iter()
                .map(|c| if *c == "payload" { payload_type } else { 25 })
                .collect(),
        };
        let json_layout = OutboxLayout::of(&relation(114)).unwrap();
        let text_layout = OutboxLayout::of(&relation(25)).unwrap();
        let id = Uuid::now_v7().to_string();
        let row = |changes: &[(usize, Option<&'static str>)]| -> Vec<Option<Vec<u8>>> {
            let mut values: Vec<Option<&str>> = vec![
                Some("9"),
                Some(id.as_str()),
                Some("order"),
                Some("1"),
                Some("T"),
                Some("{}"),
                Some("{}"),
                Some("pending"),
                Some("2"),
            ];
            for (i, v) in changes {
                values[*i] = *v;
            }
            values
                .into_iter()
                .map(|v| v.map(|v| v.as_bytes().to_vec()))
                .collect()
        };
        let check = |layout: &OutboxLayout, values: Vec<Option<Vec<u8>>>| {
            let refs: Vec<Option<&[u8]>> = values.iter().map(|v| v.as_deref()).collect();
            layout.event(&refs, 0)
        };
        assert!(check(&json_layout, row(&[])).unwrap().is_some());
        for (changes, column) in [
            (
                vec![(6, Some(r#"{"retry": 3}"#))],
                "column `headers` is not a JSON object of strings",
            ),
            (vec![(4, None)], "column `event_type` is NULL"),
            (vec![(1, Some("not-a-uuid"))], "column `id` is not a UUID"),
        ] {
            let bad = check(&json_layout, row(&changes)).unwrap_err();
            assert_eq!(bad.seq, Some(9));
            assert_eq!(bad.attempts, 2);
            assert!(bad.reason.contains(column), "{}", bad.reason);
        }
        // A payload column that is not `json` is checked here; a `json` one was by PostgreSQL.
        let bad = check(&text_layout, row(&[(5, Some("{oops"))])).unwrap_err();
        assert!(
            bad.reason.contains("column `payload` is not JSON"),
            "{}",
            bad.reason
        );
        assert!(check(&json_layout, row(&[(5, Some("{oops"))])).is_ok());
        // The shared wording: what is wrong and what to do.
        let error = malformed_error(9, &bad.reason);
        assert!(
            error.contains("column `payload`") && error.contains("outbox dead requeue"),
            "{error}"
        );
    }

    #[test]
    fn timestamps_with_every_offset_form() {
        let t = parse_timestamptz("2024-01-02 03:04:05.123456+00").unwrap();
        assert_eq!(t.to_rfc3339(), "2024-01-02T03:04:05.123456+00:00");
        let t = parse_timestamptz("2024-01-02 03:04:05-05:30").unwrap();
        assert_eq!(t.to_rfc3339(), "2024-01-02T08:34:05+00:00");
        assert!(parse_timestamptz("yesterday").is_err());
    }
}
