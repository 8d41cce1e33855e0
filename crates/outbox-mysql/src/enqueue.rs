//! Writing events: [`MySqlOutbox::enqueue`] and [`MySqlOutbox::enqueue_batch`], on the caller's
//! connection or transaction ([`EnqueueTarget`]), with the field limits the table's columns
//! impose checked before anything is sent.

use crate::MySqlOutbox;
use crate::error::{NO_SUCH_PROCEDURE, error_number, map_sqlx};
use outbox_types::sql_store::Enqueued;
use outbox_types::{EventId, NewEvent, StoreError};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, MySqlConnection, MySqlPool, Row, Transaction};
use std::collections::{HashMap, HashSet};
use std::future::Future;

/// The longest `aggregate_type`, in characters.
pub const MAX_AGGREGATE_TYPE_CHARS: usize = 100;

/// The longest `aggregate_id`, `event_type` and idempotency key, in characters.
pub const MAX_KEY_CHARS: usize = 255;

/// The longest explicit destination, in characters.
pub const MAX_DESTINATION_CHARS: usize = 1024;

/// How many bytes of events one `CALL` of the enqueue procedure carries at most; larger
/// batches are split into several calls, in order, on the same connection (well under the
/// 16 MiB default `max_allowed_packet` of MariaDB; MySQL 8's is 64 MiB).
const BATCH_BYTES: usize = 4 << 20;

/// How many events one `CALL` carries at most: the procedure collects what it reports about
/// events it did not simply write (duplicates) in one string, which costs time in the square of
/// their number.
const BATCH_EVENTS: usize = 1000;

/// What an enqueue runs on. Built implicitly from `&mut MySqlConnection` (so `&mut *tx`),
/// `&mut Transaction`, `&mut PoolConnection` or `&MySqlPool`.
///
/// On a connection (or a transaction), every statement of the enqueue runs there: inside the
/// caller's transaction if one is open. On a pool, the enqueue takes one connection for its
/// statements, each of which autocommits.
#[derive(Debug)]
pub enum EnqueueTarget<'a> {
    /// A connection, usually inside the caller's transaction.
    Connection(&'a mut MySqlConnection),
    /// A pool: autocommit.
    Pool(&'a MySqlPool),
}

impl<'a> From<&'a mut MySqlConnection> for EnqueueTarget<'a> {
    fn from(conn: &'a mut MySqlConnection) -> Self {
        EnqueueTarget::Connection(conn)
    }
}

impl<'a, 'c> From<&'a mut Transaction<'c, MySql>> for EnqueueTarget<'a> {
    fn from(tx: &'a mut Transaction<'c, MySql>) -> Self {
        EnqueueTarget::Connection(tx)
    }
}

impl<'a> From<&'a mut PoolConnection<MySql>> for EnqueueTarget<'a> {
    fn from(conn: &'a mut PoolConnection<MySql>) -> Self {
        EnqueueTarget::Connection(conn)
    }
}

impl<'a> From<&'a MySqlPool> for EnqueueTarget<'a> {
    fn from(pool: &'a MySqlPool) -> Self {
        EnqueueTarget::Pool(pool)
    }
}

impl<'a> EnqueueTarget<'a> {
    /// The connection to write on: the caller's, or one acquired from the pool into `pooled`
    /// (which keeps it until the caller is done).
    async fn connection<'b>(
        self,
        pooled: &'b mut Option<PoolConnection<MySql>>,
    ) -> Result<&'b mut MySqlConnection, StoreError>
    where
        'a: 'b,
    {
        match self {
            EnqueueTarget::Connection(conn) => Ok(conn),
            EnqueueTarget::Pool(pool) => {
                let conn = pool.acquire().await.map_err(map_sqlx)?;
                Ok(&mut **pooled.insert(conn))
            }
        }
    }
}

impl MySqlOutbox {
    /// Add `event` to the outbox through `target` — normally `&mut *tx` of the caller's own
    /// transaction, so the event commits or rolls back with the business change. Never commits
    /// by itself. One `CALL` of the enqueue procedure (see the crate docs).
    ///
    /// With an idempotency key that is already in the table, nothing is written and the existing
    /// event's id comes back with `created: false`.
    pub fn enqueue<'a>(
        &'a self,
        target: impl Into<EnqueueTarget<'a>>,
        event: &'a NewEvent,
    ) -> impl Future<Output = Result<Enqueued, StoreError>> + Send + 'a {
        let target = target.into();
        async move {
            validate(event)?;
            let mut pooled = None;
            let conn = target.connection(&mut pooled).await?;
            self.call(conn, &[event]).await?.pop().ok_or_else(|| {
                StoreError::Database(format!(
                    "event {} was not resolved after enqueue",
                    event.id()
                ))
            })
        }
    }

    /// Add several events, in order, in as few calls as possible (see the crate docs). Same
    /// rules as [`MySqlOutbox::enqueue`]; a key repeated inside the batch counts once (the first
    /// event wins).
    pub fn enqueue_batch<'a>(
        &'a self,
        target: impl Into<EnqueueTarget<'a>>,
        events: &'a [NewEvent],
    ) -> impl Future<Output = Result<Vec<Enqueued>, StoreError>> + Send + 'a {
        let target = target.into();
        async move {
            if events.is_empty() {
                return Ok(Vec::new());
            }
            // First occurrence of each key is written; later ones resolve to it.
            let mut first_with_key: HashMap<&str, usize> = HashMap::new();
            let mut to_write: Vec<&NewEvent> = Vec::with_capacity(events.len());
            let mut ids: HashSet<EventId> = HashSet::with_capacity(events.len());
            for (i, event) in events.iter().enumerate() {
                validate(event)?;
                if let Some(key) = event.idempotency_key() {
                    if first_with_key.contains_key(key) {
                        continue;
                    }
                    first_with_key.insert(key, i);
                }
                if !ids.insert(event.id()) {
                    return Err(StoreError::Invalid(format!(
                        "event id {} appears twice in one batch",
                        event.id()
                    )));
                }
                to_write.push(event);
            }
            let mut pooled = None;
            let conn = target.connection(&mut pooled).await?;
            let mut written: HashMap<EventId, Enqueued> = HashMap::with_capacity(to_write.len());
            for chunk in chunks(&to_write) {
                let done = self.call(conn, chunk).await?;
                written.extend(chunk.iter().map(|e| e.id()).zip(done));
            }
            events
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let first = match e.idempotency_key() {
                        Some(key) => first_with_key.get(key).copied().unwrap_or(i),
                        None => i,
                    };
                    let owner = events.get(first).map(NewEvent::id).unwrap_or(e.id());
                    let done = written.get(&owner).copied().ok_or_else(|| {
                        StoreError::Database(format!(
                            "event {owner} was not resolved after enqueue"
                        ))
                    })?;
                    Ok(Enqueued {
                        id: done.id,
                        created: done.created && i == first,
                    })
                })
                .collect()
        }
    }

    /// One `CALL` of the enqueue procedure (migration 6) with `chunk` as its JSON array: what
    /// happened to each event, in order. An event that was not written because another event
    /// has its id is an error.
    async fn call(
        &self,
        conn: &mut MySqlConnection,
        chunk: &[&NewEvent],
    ) -> Result<Vec<Enqueued>, StoreError> {
        let events: Vec<serde_json::Value> = chunk.iter().map(|e| batch_row(e)).collect();
        let rows = sqlx::query(AssertSqlSafe(self.sql().enqueue_batch.as_str()))
            .bind(serde_json::Value::Array(events).to_string())
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.call_error(e))?;
        if rows.len() != chunk.len() {
            return Err(StoreError::Database(format!(
                "the enqueue procedure `{}_enqueue_batch` answered {} rows for {} events",
                self.table(),
                rows.len(),
                chunk.len()
            )));
        }
        chunk
            .iter()
            .zip(&rows)
            .map(|(event, row)| {
                let taken: Option<i64> = row.try_get("taken_by_seq").map_err(map_sqlx)?;
                if let Some(seq) = taken {
                    return Err(id_taken(event.id(), seq));
                }
                let id: String = row.try_get("id").map_err(map_sqlx)?;
                let id = id.parse::<EventId>().map_err(|e| {
                    StoreError::Database(format!(
                        "event {}: the enqueue procedure answered `{id}`, not an event id: {e}",
                        event.id()
                    ))
                })?;
                let created: i64 = row.try_get("created").map_err(map_sqlx)?;
                Ok(Enqueued {
                    id,
                    created: created != 0,
                })
            })
            .collect()
    }

    /// A failed `CALL`: an outbox migrated before the procedure existed is
    /// [`StoreError::NotMigrated`]; the procedure's "retry the transaction" (SQLSTATE 40001: the
    /// event holding a key was committed after the caller's transaction began reading, or kept
    /// disappearing) is [`StoreError::Unavailable`]; the rest as every statement's.
    fn call_error(&self, error: sqlx::Error) -> StoreError {
        match &error {
            sqlx::Error::Database(db) if error_number(&error) == Some(NO_SUCH_PROCEDURE) => {
                StoreError::NotMigrated(format!(
                    "{}: the outbox schema is older than this library (no procedure {}_enqueue_batch): run `outbox migrate` (or MySqlOutbox::migrate): {}",
                    self.table(),
                    self.table(),
                    db.message()
                ))
            }
            sqlx::Error::Database(db) if db.code().as_deref() == Some("40001") => {
                StoreError::Unavailable(db.message().to_owned())
            }
            _ => map_sqlx(error),
        }
    }
}

pub(crate) fn id_taken(id: EventId, seq: i64) -> StoreError {
    StoreError::Database(format!(
        "event {id} was not written: another event (seq {seq}) already has this id"
    ))
}

/// Split `events` into chunks of at most [`BATCH_BYTES`] of text and [`BATCH_EVENTS`] events
/// (and at least one event).
pub(crate) fn chunks<'a, 'e>(events: &'a [&'e NewEvent]) -> Vec<&'a [&'e NewEvent]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, e) in events.iter().enumerate() {
        let size = e.payload().len() + e.headers().len() * 32 + 256;
        if i > start && (bytes + size > BATCH_BYTES || i - start >= BATCH_EVENTS) {
            out.push(&events[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < events.len() {
        out.push(&events[start..]);
    }
    out
}

/// One event of a batch as a JSON object for the enqueue procedure's `JSON_TABLE`. The payload and headers travel as JSON
/// strings holding their exact text, so the stored bytes are the writer's bytes; absent optional
/// fields are left out (a missing path is SQL `NULL`).
pub(crate) fn batch_row(e: &NewEvent) -> serde_json::Value {
    let mut row = serde_json::Map::with_capacity(9);
    row.insert("id".into(), e.id().to_string().into());
    row.insert("aggregate_type".into(), e.aggregate_type().into());
    row.insert("aggregate_id".into(), e.aggregate_id().into());
    row.insert("event_type".into(), e.event_type().into());
    row.insert("payload".into(), e.payload().into());
    if let Some(destination) = e.destination() {
        row.insert("destination".into(), destination.into());
    }
    row.insert("headers".into(), e.headers_json().into());
    if let Some(key) = e.idempotency_key() {
        row.insert("idempotency_key".into(), key.into());
    }
    row.insert(
        "occurred_at".into(),
        e.occurred_at()
            .format("%Y-%m-%d %H:%M:%S%.6f")
            .to_string()
            .into(),
    );
    serde_json::Value::Object(row)
}

/// Refuse what the table would truncate or reject, before anything is sent: a header name
/// under the reserved prefix (the table's triggers refuse it too), and fields too long.
pub(crate) fn validate(e: &NewEvent) -> Result<(), StoreError> {
    e.check_headers()?;
    let checks = [
        (
            "aggregate_type",
            Some(e.aggregate_type()),
            MAX_AGGREGATE_TYPE_CHARS,
        ),
        ("aggregate_id", Some(e.aggregate_id()), MAX_KEY_CHARS),
        ("event_type", Some(e.event_type()), MAX_KEY_CHARS),
        ("idempotency_key", e.idempotency_key(), MAX_KEY_CHARS),
        ("destination", e.destination(), MAX_DESTINATION_CHARS),
    ];
    for (field, value, max) in checks {
        if let Some(value) = value {
            let chars = value.chars().count();
            if chars > max {
                return Err(StoreError::Invalid(format!(
                    "event {}: {field} has {chars} characters; the MySQL outbox keeps at most {max}",
                    e.id()
                )));
            }
        }
    }
    let year = chrono::Datelike::year(&e.occurred_at());
    if !(1000..=9999).contains(&year) {
        return Err(StoreError::Invalid(format!(
            "event {}: occurred_at {} is outside the years 1000-9999 a MySQL DATETIME holds",
            e.id(),
            e.occurred_at()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_fields_are_refused_before_any_sql() {
        let long = NewEvent::new("a", "x".repeat(256), "T", &1).unwrap();
        let err = validate(&long).unwrap_err();
        assert!(
            matches!(&err, StoreError::Invalid(m) if m.contains("aggregate_id has 256")),
            "{err}"
        );
        // Characters, not bytes: 255 multi-byte characters fit.
        let wide = NewEvent::new("a", "é".repeat(255), "T", &1).unwrap();
        assert!(validate(&wide).is_ok());
        let key = NewEvent::new("a", "1", "T", &1)
            .unwrap()
            .with_idempotency_key("k".repeat(300));
        assert!(validate(&key).is_err());
        let old = NewEvent::new("a", "1", "T", &1)
            .unwrap()
            .with_occurred_at(chrono::DateTime::from_timestamp(-40_000_000_000, 0).unwrap());
        assert!(validate(&old).is_err());
    }

    #[test]
    fn batches_are_chunked_by_size_in_order() {
        let big = "x".repeat(1 << 20);
        let events: Vec<NewEvent> = (0..10)
            .map(|i| NewEvent::from_json("a", i.to_string(), "T", format!("\"{big}\"")).unwrap())
            .collect();
        let refs: Vec<&NewEvent> = events.iter().collect();
        let parts = chunks(&refs);
        assert!(parts.len() >= 3, "{}", parts.len());
        let flat: Vec<EventId> = parts
            .iter()
            .flat_map(|c| c.iter().map(|e| e.id()))
            .collect();
        assert_eq!(flat, events.iter().map(NewEvent::id).collect::<Vec<_>>());
        assert_eq!(chunks(&refs[..1]).len(), 1);
        let small: Vec<NewEvent> = (0..2500)
            .map(|i| NewEvent::new("a", i.to_string(), "T", &1).unwrap())
            .collect();
        let refs: Vec<&NewEvent> = small.iter().collect();
        let sizes: Vec<usize> = chunks(&refs).iter().map(|c| c.len()).collect();
        assert_eq!(sizes, [1000, 1000, 500]);
    }
}
