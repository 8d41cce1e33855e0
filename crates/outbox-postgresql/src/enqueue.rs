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
    ///
    /// What the writer's role needs (docs/table-contract.md, "Privileges"): in the plain
    /// layout, `INSERT` on the table for an event without a key and `EXECUTE` on
    /// `<table>_enqueue_batch` for one with a key; in the partitioned layout, `EXECUTE` on
    /// `<table>_enqueue_batch`. Never a right to read or change rows.
    pub async fn enqueue<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        event: &NewEvent,
    ) -> Result<Enqueued, StoreError> {
        event.check_headers()?;
        let unkeyed = match event.idempotency_key() {
            None => self.inner.sql.enqueue_unkeyed.as_ref(),
            Some(_) => None,
        };
        let Some(sql) = unkeyed else {
            let done = self
                .enqueue_batch(executor, std::slice::from_ref(event))
                .await?;
            return done.into_iter().next().ok_or_else(|| {
                StoreError::Database(format!("enqueue of event {} returned nothing", event.id()))
            });
        };
        let query = sqlx::query(AssertSqlSafe(sql.as_str())).bind(event.id().as_uuid());
        outbox_types::bind_event_columns!(query, event)
            .bind(event.occurred_at())
            .execute(executor)
            .await
            .map_err(map_sqlx)?;
        Ok(Enqueued {
            id: event.id(),
            created: true,
        })
    }

    /// Add several events in one statement, in order. Same rules (and privileges) as
    /// [`PgOutbox::enqueue`]; a key repeated inside the batch counts once (the first event
    /// wins).
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
        let rows = query.fetch_all(executor).await.map_err(|e| match &e {
            // The function comes with migration 7 (plain), 6 (partitioned).
            sqlx::Error::Database(db) if db.code().as_deref() == Some("42883") => {
                StoreError::NotMigrated(format!(
                    "{}: the outbox schema is older than this library (no function {}_enqueue_batch): run `outbox migrate` (or PgOutbox::migrate)",
                    self.qualified_table(),
                    self.table()
                ))
            }
            _ => map_sqlx(e),
        })?;
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
                    // Read after the insert, without a lock: the event holding the key may have
                    // been deleted (purged, discarded) in between.
                    let found = by_key.get(key).copied().ok_or_else(|| {
                        StoreError::Unavailable(format!(
                            "event {}: the event holding idempotency key `{key}` was deleted while it was enqueued; try again",
                            e.id()
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
