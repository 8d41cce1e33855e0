//! Decoding the parts of the `pgoutput` protocol (version 1) that the replication client hands
//! over raw: `Relation` and `Insert`, and turning an inserted outbox row into an [`Event`].
//!
//! `Begin`, `Commit` and logical `Message`s are parsed by the client itself. Updates, deletes,
//! truncates, type and origin messages are not needed (the publication publishes inserts only)
//! and are skipped. Column values arrive in text form; the replication session pins
//! `DateStyle=ISO` and `TimeZone=UTC` so timestamps always read the same.

use std::collections::HashMap;

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_core::{Event, EventId, Headers};
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
    /// Anything else (updates, deletes, truncates, types, origins).
    Other,
}

/// A table as described by a `Relation` message.
#[derive(Clone, Debug)]
pub(crate) struct Relation {
    pub relid: u32,
    pub namespace: String,
    pub name: String,
    pub columns: Vec<String>,
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
            for _ in 0..ncols {
                let _flags = r.u8()?;
                columns.push(r.cstr()?);
                let _type_oid = r.i32()?;
                let _typmod = r.i32()?;
            }
            Ok(Decoded::Relation(Relation {
                relid,
                namespace,
                name,
                columns,
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
        _ => Ok(Decoded::Other),
    }
}

/// Where each outbox column sits in the table's relation.
#[derive(Clone, Debug)]
pub(crate) struct OutboxLayout {
    seq: usize,
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
}

impl OutboxLayout {
    /// Map the columns of `relation`; fails when a required column is missing.
    pub fn of(relation: &Relation) -> Result<Self, String> {
        let index: HashMap<&str, usize> = relation
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| (c.as_str(), i))
            .collect();
        let need = |name: &str| {
            index.get(name).copied().ok_or_else(|| {
                format!(
                    "outbox table {}.{} has no column `{name}` in the replication stream",
                    relation.namespace, relation.name
                )
            })
        };
        Ok(OutboxLayout {
            seq: need("seq")?,
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
            status: index.get("status").copied(),
            attempts: index.get("attempts").copied(),
        })
    }

    /// Turn an inserted row into an event. Returns `None` for rows not inserted as `pending`
    /// (dead-letter rows that WAL mode itself inserts for message events).
    pub fn event(&self, values: &[Option<&[u8]>]) -> Result<Option<Event>, String> {
        let text = |i: usize| -> Result<Option<&str>, String> {
            match values.get(i).copied().flatten() {
                None => Ok(None),
                Some(bytes) => std::str::from_utf8(bytes)
                    .map(Some)
                    .map_err(|e| format!("column {i} is not UTF-8: {e}")),
            }
        };
        let required = |i: usize, name: &str| -> Result<&str, String> {
            text(i)?.ok_or_else(|| format!("outbox column `{name}` is NULL"))
        };
        let optional = |i: Option<usize>| -> Result<Option<&str>, String> {
            match i {
                Some(i) => text(i),
                None => Ok(None),
            }
        };
        if let Some(status) = optional(self.status)?
            && status != "pending"
        {
            return Ok(None);
        }
        let seq: i64 = required(self.seq, "seq")?
            .parse()
            .map_err(|e| format!("outbox column `seq`: {e}"))?;
        let id = Uuid::parse_str(required(self.id, "id")?)
            .map_err(|e| format!("outbox row {seq}: column `id`: {e}"))?;
        let headers: Headers = match optional(self.headers)? {
            Some(json) if json != "{}" => serde_json::from_str(json).map_err(|e| {
                format!("outbox row {seq}: headers are not an object of strings: {e}")
            })?,
            _ => Headers::new(),
        };
        let time = |i: Option<usize>, name: &str| -> Result<Option<DateTime<Utc>>, String> {
            optional(i)?
                .map(|t| {
                    parse_timestamptz(t).map_err(|e| format!("outbox row {seq}: `{name}`: {e}"))
                })
                .transpose()
        };
        let now = Utc::now();
        let occurred_at = time(self.occurred_at, "occurred_at")?.unwrap_or(now);
        let enqueued_at = time(self.enqueued_at, "enqueued_at")?.unwrap_or(now);
        let attempts = optional(self.attempts)?
            .and_then(|a| a.parse::<u32>().ok())
            .unwrap_or(0);
        Ok(Some(Event {
            seq,
            id: EventId::from_uuid(id),
            aggregate_type: required(self.aggregate_type, "aggregate_type")?.to_owned(),
            aggregate_id: required(self.aggregate_id, "aggregate_id")?.to_owned(),
            event_type: required(self.event_type, "event_type")?.to_owned(),
            payload: required(self.payload, "payload")?.to_owned(),
            destination: optional(self.destination)?.map(str::to_owned),
            headers,
            idempotency_key: optional(self.idempotency_key)?.map(str::to_owned),
            occurred_at,
            enqueued_at,
            attempts,
        }))
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
    let naive = NaiveDateTime::parse_from_str(local, "%Y-%m-%d %H:%M:%S%.f").map_err(|_| bad())?;
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
mod tests {
    use super::*;

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    #[test]
    fn relation_and_insert_decode() {
        let cols = [
            "seq",
            "id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
            "headers",
            "status",
            "occurred_at",
        ];
        let mut rel = vec![b'R'];
        rel.extend_from_slice(&16384i32.to_be_bytes());
        cstr(&mut rel, "outbox");
        cstr(&mut rel, "events");
        rel.push(b'd');
        rel.extend_from_slice(&(cols.len() as i16).to_be_bytes());
        for c in cols {
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
        let event = layout.event(&values).unwrap().unwrap();
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
    fn timestamps_with_every_offset_form() {
        let t = parse_timestamptz("2024-01-02 03:04:05.123456+00").unwrap();
        assert_eq!(t.to_rfc3339(), "2024-01-02T03:04:05.123456+00:00");
        let t = parse_timestamptz("2024-01-02 03:04:05-05:30").unwrap();
        assert_eq!(t.to_rfc3339(), "2024-01-02T08:34:05+00:00");
        assert!(parse_timestamptz("yesterday").is_err());
    }
}
