//! Writing events: [`SqliteOutbox::enqueue`] and [`SqliteOutbox::enqueue_batch`] into the
//! caller's own transaction, one statement each.

use crate::SqliteOutbox;
use crate::decode::decode_id;
use crate::error::map_sqlx;
use crate::time::{clamp_micros, now_micros};
use outbox_types::sql_store::{Enqueued, keyed_batch};
use outbox_types::{EventId, NewEvent, StoreError};
use sqlx::{AssertSqlSafe, Row, SqliteExecutor};
use std::collections::HashMap;

impl SqliteOutbox {
    /// Add `event` to the outbox through `executor` — normally `&mut *tx` of the caller's own
    /// transaction, so the event commits or rolls back with the business change. One statement;
    /// never commits by itself.
    ///
    /// With an idempotency key that is already in the table, nothing is written and the existing
    /// event's id comes back with `created: false`. A header name the table refuses (under the
    /// reserved prefix `outbox-`) is [`StoreError::Encode`] before anything is sent.
    pub async fn enqueue<'e, E: SqliteExecutor<'e>>(
        &self,
        executor: E,
        event: &NewEvent,
    ) -> Result<Enqueued, StoreError> {
        event.check_headers()?;
        let query = sqlx::query(AssertSqlSafe(self.inner.sql.enqueue.as_str()))
            .bind(event.id().to_string());
        let row = outbox_types::bind_event_columns!(query, event)
            .bind(clamp_micros(event.occurred_at().timestamp_micros()))
            .bind(now_micros())
            .fetch_optional(executor)
            .await
            .map_err(map_sqlx)?;
        match row {
            Some(row) => {
                let id = decode_id(&row, "id", 0)?;
                Ok(Enqueued {
                    id,
                    created: id == event.id(),
                })
            }
            // The key is taken by a row with this very id: the same event enqueued again.
            None => Ok(Enqueued {
                id: event.id(),
                created: false,
            }),
        }
    }

    /// Add several events in one statement, in order. Same rules as [`SqliteOutbox::enqueue`]; a
    /// key repeated inside the batch counts once (the first event wins).
    pub async fn enqueue_batch<'e, E: SqliteExecutor<'e>>(
        &self,
        executor: E,
        events: &[NewEvent],
    ) -> Result<Vec<Enqueued>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        // First occurrence of each key is written; later ones resolve to it.
        let batch = keyed_batch(events)?;
        let to_write: Vec<serde_json::Value> = batch.to_write.into_iter().map(batch_row).collect();
        let rows_json = serde_json::Value::Array(to_write).to_string();
        let rows = sqlx::query(AssertSqlSafe(self.inner.sql.enqueue_batch.as_str()))
            .bind(rows_json)
            .bind(now_micros())
            .fetch_all(executor)
            .await
            .map_err(map_sqlx)?;
        // Rows come back for inserted events and for keys that matched another event; a key
        // with no row matched an event with the same id (the same event enqueued again).
        let mut by_key: HashMap<String, EventId> = HashMap::new();
        for row in &rows {
            let key: Option<String> = row.try_get("idempotency_key").map_err(map_sqlx)?;
            if let Some(key) = key {
                by_key.insert(key, decode_id(row, "id", 0)?);
            }
        }
        Ok(events
            .iter()
            .enumerate()
            .map(|(i, e)| match e.idempotency_key() {
                None => Enqueued {
                    id: e.id(),
                    created: true,
                },
                Some(key) => {
                    let first = batch.first_with_key.get(key).copied().unwrap_or(i);
                    let written = events.get(first).map(NewEvent::id).unwrap_or(e.id());
                    let id = by_key.get(key).copied().unwrap_or(written);
                    Enqueued {
                        id,
                        created: i == first && by_key.get(key) == Some(&written),
                    }
                }
            })
            .collect())
    }
}

/// One event of a batch as a JSON object for `json_each`. The payload and headers travel as JSON
/// strings holding their exact text, so the stored bytes are the writer's bytes.
fn batch_row(e: &NewEvent) -> serde_json::Value {
    serde_json::json!({
        "id": e.id().to_string(),
        "aggregate_type": e.aggregate_type(),
        "aggregate_id": e.aggregate_id(),
        "event_type": e.event_type(),
        "payload": e.payload(),
        "destination": e.destination(),
        "headers": e.headers_json(),
        "idempotency_key": e.idempotency_key(),
        "occurred_at": clamp_micros(e.occurred_at().timestamp_micros()),
    })
}
