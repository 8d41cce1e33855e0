//! Writing events: [`PgOutbox::enqueue`] and [`PgOutbox::enqueue_batch`] into the caller's
//! own transaction, in the plain or the partitioned layout.

use crate::PgOutbox;
use crate::error::map_sqlx;
use outbox_types::sql_store::{Enqueued, keyed_batch};
use outbox_types::{EventId, NewEvent, StoreError};
use sqlx::{AssertSqlSafe, PgExecutor, Row};
use std::collections::HashMap;
use uuid::Uuid;

impl PgOutbox {
    /// Add `event` to the outbox through `executor` — normally `&mut *tx` of the caller's own
    /// transaction, so the event commits or rolls back with the business change. Never commits
    /// by itself.
    ///
    /// With an idempotency key that is already in the table, nothing is written and the existing
    /// event's id comes back with `created: false`. A header name the table refuses (under the
    /// reserved prefix `outbox-`) is [`StoreError::Encode`] before anything is sent.
    pub async fn enqueue<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        event: &NewEvent,
    ) -> Result<Enqueued, StoreError> {
        event.check_headers()?;
        // Both statements take the same parameters; only the keyed one reports back.
        let unkeyed = match event.idempotency_key() {
            None => self.inner.sql.enqueue_unkeyed.as_ref(),
            Some(_) => None,
        };
        let query = sqlx::query(AssertSqlSafe(
            unkeyed.unwrap_or(&self.inner.sql.enqueue).as_str(),
        ))
        .bind(event.id().as_uuid());
        let query = outbox_types::bind_event_columns!(query, event).bind(event.occurred_at());
        if unkeyed.is_some() {
            query.execute(executor).await.map_err(map_sqlx)?;
            return Ok(Enqueued {
                id: event.id(),
                created: true,
            });
        }
        let row = query.fetch_one(executor).await.map_err(map_sqlx)?;
        let id: Uuid = row.try_get("id").map_err(map_sqlx)?;
        let created: bool = row.try_get("created").map_err(map_sqlx)?;
        Ok(Enqueued {
            id: EventId::from_uuid(id),
            created,
        })
    }

    /// Add several events in one statement, in order. Same rules as [`PgOutbox::enqueue`]; a key
    /// repeated inside the batch counts once (the first event wins).
    pub async fn enqueue_batch<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        events: &[NewEvent],
    ) -> Result<Vec<Enqueued>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        // First occurrence of each key is written; later ones resolve to it.
        let batch = keyed_batch(events)?;
        let n = batch.to_write.len();
        let mut ids = Vec::with_capacity(n);
        let mut aggregate_types = Vec::with_capacity(n);
        let mut aggregate_ids = Vec::with_capacity(n);
        let mut event_types = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut destinations = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut keys = Vec::with_capacity(n);
        let mut occurred = Vec::with_capacity(n);
        for e in &batch.to_write {
            ids.push(*e.id().as_uuid());
            aggregate_types.push(e.aggregate_type());
            aggregate_ids.push(e.aggregate_id());
            event_types.push(e.event_type());
            payloads.push(e.payload());
            destinations.push(e.destination());
            headers.push(e.headers_json());
            keys.push(e.idempotency_key());
            occurred.push(e.occurred_at());
        }
        let unkeyed = if batch.first_with_key.is_empty() {
            self.inner.sql.enqueue_batch_unkeyed.as_ref()
        } else {
            None
        };
        let query = sqlx::query(AssertSqlSafe(
            unkeyed.unwrap_or(&self.inner.sql.enqueue_batch).as_str(),
        ))
        .bind(&ids)
        .bind(&aggregate_types)
        .bind(&aggregate_ids)
        .bind(&event_types)
        .bind(&payloads)
        .bind(&destinations)
        .bind(&headers)
        .bind(&keys)
        .bind(&occurred);
        if unkeyed.is_some() {
            query.execute(executor).await.map_err(map_sqlx)?;
            return Ok(events
                .iter()
                .map(|e| Enqueued {
                    id: e.id(),
                    created: true,
                })
                .collect());
        }
        let rows = query.fetch_all(executor).await.map_err(map_sqlx)?;
        let mut by_key: HashMap<String, Enqueued> = HashMap::new();
        for row in rows {
            let key: Option<String> = row.try_get("idempotency_key").map_err(map_sqlx)?;
            if let Some(key) = key {
                let id: Uuid = row.try_get("id").map_err(map_sqlx)?;
                let created: bool = row.try_get("created").map_err(map_sqlx)?;
                by_key.insert(
                    key,
                    Enqueued {
                        id: EventId::from_uuid(id),
                        created,
                    },
                );
            }
        }
        events
            .iter()
            .enumerate()
            .map(|(i, e)| match e.idempotency_key() {
                None => Ok(Enqueued {
                    id: e.id(),
                    created: true,
                }),
                Some(key) => {
                    let found = by_key.get(key).copied().ok_or_else(|| {
                        StoreError::Database(format!(
                            "enqueue returned no row for idempotency key `{key}`"
                        ))
                    })?;
                    let first = batch.first_with_key.get(key).copied() == Some(i);
                    Ok(Enqueued {
                        id: found.id,
                        created: found.created && first,
                    })
                }
            })
            .collect()
    }
}
