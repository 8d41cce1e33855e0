//! # outbox-postgres
//!
//! The PostgreSQL home of the outbox: embedded migrations, [`PgOutbox::enqueue`] into the
//! caller's own transaction, and [`PgStore`], the [`Store`] a relay claims from.
//!
//! ```no_run
//! use outbox_core::NewEvent;
//! use outbox_postgres::PgOutbox;
//!
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = PgOutbox::new(); // table "outbox"."events"
//! outbox.migrate(&pool).await?;
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
//!     .bind(42_i64).bind(1999_i64)
//!     .execute(&mut *tx).await?;
//! let event = NewEvent::new("order", "42", "OrderCreated", &serde_json::json!({"amount": 1999}))?;
//! outbox.enqueue(&mut *tx, &event).await?;
//! tx.commit().await?; // the order and its event exist together, or neither does
//! # Ok(()) }
//! ```
//!
//! Claims are serialized across relays with a transaction-scoped advisory lock taken just before
//! the claim statement (see `outbox_core::Store` for why that is what keeps per-aggregate order
//! with several relays). The lock is held for the duration of one short `UPDATE … RETURNING`;
//! publishing, acking and retrying run without it.

mod error;
mod migrations;
mod names;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_core::{
    BuryEvent, Claim, ClaimRequest, DeadFilter, DeadLetterPolicy, Event, EventId, EventRecord,
    Headers, Lease, NewEvent, OutboxStats, RetryEvent, Store, StoreError,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, PgExecutor, PgPool, Row};
use uuid::Uuid;

pub use migrations::MigrationReport;

use error::map_sqlx;
use names::{check_identifier, fnv1a};

/// The result of an enqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Enqueued {
    /// The event's id: the new one, or, for a duplicate idempotency key, the existing event's.
    pub id: EventId,
    /// `false` when the idempotency key matched an existing event and nothing was written.
    pub created: bool,
}

/// Where the outbox table lives, and the SQL to use it. Cheap to clone.
///
/// The names are configurable so the outbox never collides with the application's own tables or
/// migrations; the default is the table `events` in its own schema `outbox`.
#[derive(Clone, Debug)]
pub struct PgOutbox {
    inner: Arc<Names>,
}

#[derive(Debug)]
struct Names {
    schema: String,
    table: String,
    qualified: String,
    sql: Sql,
}

/// Statements rendered once per outbox (they embed the table name).
#[derive(Debug)]
struct Sql {
    enqueue: String,
    enqueue_batch: String,
    claim: String,
    ack: String,
    retry: String,
    bury: String,
    release: String,
    get: String,
    list_dead: String,
    requeue_dead: String,
    discard_dead: String,
    purge: String,
    stats: String,
    oldest: String,
}

const RECORD_COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, payload::text AS payload, \
     destination, headers::text AS headers, idempotency_key, occurred_at, enqueued_at, attempts, \
     status, next_attempt_at, last_error, lease_owner, lease_expires_at, delivered_at, dead_at";

impl Default for PgOutbox {
    fn default() -> Self {
        Self::new()
    }
}

impl PgOutbox {
    /// The outbox in table `outbox.events`.
    pub fn new() -> Self {
        Self::with_names("outbox", "events")
            .unwrap_or_else(|_| unreachable!("default names are valid"))
    }

    /// The outbox in table `schema.table`. Both must be plain lowercase identifiers.
    ///
    /// ```
    /// assert!(outbox_postgres::PgOutbox::with_names("billing_outbox", "events").is_ok());
    /// assert!(outbox_postgres::PgOutbox::with_names("x; drop table y", "events").is_err());
    /// ```
    pub fn with_names(schema: &str, table: &str) -> Result<Self, StoreError> {
        check_identifier("schema", schema)?;
        check_identifier("table", table)?;
        let qualified = format!("\"{schema}\".\"{table}\"");
        let sql = Sql::render(&qualified);
        Ok(PgOutbox {
            inner: Arc::new(Names {
                schema: schema.to_owned(),
                table: table.to_owned(),
                qualified,
                sql,
            }),
        })
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// `"schema"."table"`, ready to use in SQL.
    pub fn qualified_table(&self) -> &str {
        &self.inner.qualified
    }

    pub(crate) fn migrations_table(&self) -> String {
        format!(
            "\"{}\".\"{}_migrations\"",
            self.inner.schema, self.inner.table
        )
    }

    pub(crate) fn render(&self, template: &str) -> String {
        template
            .replace("{t}", &self.inner.qualified)
            .replace("{table}", &self.inner.table)
            .replace("{schema}", &self.inner.schema)
    }

    /// A stable advisory lock key for `purpose` on this outbox.
    pub(crate) fn lock_key(&self, purpose: &str) -> i64 {
        fnv1a(&format!("outbox:{purpose}:{}", self.inner.qualified)) as i64
    }

    /// Create or upgrade the outbox schema. Idempotent, safe to call from several processes at
    /// once, and atomic.
    pub async fn migrate(&self, pool: &PgPool) -> Result<MigrationReport, StoreError> {
        migrations::run(self, pool).await
    }

    /// The schema version in the database (`0` if never migrated) and the newest this build
    /// knows.
    pub async fn schema_version(&self, pool: &PgPool) -> Result<(i64, i64), StoreError> {
        Ok((
            migrations::current_version(self, pool).await?,
            migrations::latest_version(),
        ))
    }

    /// Add `event` to the outbox through `executor` — normally `&mut *tx` of the caller's own
    /// transaction, so the event commits or rolls back with the business change. Never commits
    /// by itself.
    ///
    /// With an idempotency key that is already in the table, nothing is written and the existing
    /// event's id comes back with `created: false`.
    pub async fn enqueue<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        event: &NewEvent,
    ) -> Result<Enqueued, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.inner.sql.enqueue.as_str()))
            .bind(event.id().as_uuid())
            .bind(event.aggregate_type())
            .bind(event.aggregate_id())
            .bind(event.event_type())
            .bind(event.payload())
            .bind(event.destination())
            .bind(event.headers_json())
            .bind(event.idempotency_key())
            .bind(event.occurred_at())
            .fetch_one(executor)
            .await
            .map_err(map_sqlx)?;
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
        let mut first_with_key: HashMap<&str, usize> = HashMap::new();
        let mut to_write: Vec<&NewEvent> = Vec::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            match event.idempotency_key() {
                Some(key) if first_with_key.contains_key(key) => {}
                Some(key) => {
                    first_with_key.insert(key, i);
                    to_write.push(event);
                }
                None => to_write.push(event),
            }
        }
        let n = to_write.len();
        let mut ids = Vec::with_capacity(n);
        let mut aggregate_types = Vec::with_capacity(n);
        let mut aggregate_ids = Vec::with_capacity(n);
        let mut event_types = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut destinations = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut keys = Vec::with_capacity(n);
        let mut occurred = Vec::with_capacity(n);
        for e in &to_write {
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
        let rows = sqlx::query(AssertSqlSafe(self.inner.sql.enqueue_batch.as_str()))
            .bind(&ids)
            .bind(&aggregate_types)
            .bind(&aggregate_ids)
            .bind(&event_types)
            .bind(&payloads)
            .bind(&destinations)
            .bind(&headers)
            .bind(&keys)
            .bind(&occurred)
            .fetch_all(executor)
            .await
            .map_err(map_sqlx)?;
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
                    let first = first_with_key.get(key).copied() == Some(i);
                    Ok(Enqueued {
                        id: found.id,
                        created: found.created && first,
                    })
                }
            })
            .collect()
    }
}

impl Sql {
    fn render(t: &str) -> Self {
        Sql {
            enqueue: format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at)
                 VALUES ($1, $2, $3, $4, $5::json, $6, $7::jsonb, $8, $9)
                 ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
                 DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key
                 RETURNING id, (xmax = 0) AS created"
            ),
            enqueue_batch: format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at)
                 SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination, u.headers::jsonb, u.idempotency_key, u.occurred_at
                 FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::timestamptz[])
                      WITH ORDINALITY AS u(id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at, ord)
                 ORDER BY u.ord
                 ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
                 DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key
                 RETURNING id, idempotency_key, (xmax = 0) AS created"
            ),
            // $1 limit, $2 owner, $3 token, $4 dead blocks, $5 lease ms.
            // A row is due when pending and its time has come, or in flight under an expired
            // lease (its relay died). It is held back by any earlier row of its aggregate that is
            // in flight under a live lease, waiting for a retry, or dead when dead blocks. The
            // blocker probe's WHERE repeats the predicate of the `_blockers` partial index.
            claim: format!(
                "WITH due AS (
                     SELECT e.seq FROM {t} e
                     WHERE e.status IN ('pending', 'in_flight')
                       AND CASE WHEN e.status = 'pending' THEN e.next_attempt_at <= statement_timestamp()
                                ELSE e.lease_expires_at <= statement_timestamp() END
                       AND NOT EXISTS (
                           SELECT 1 FROM {t} b
                           WHERE b.aggregate_type = e.aggregate_type
                             AND b.aggregate_id = e.aggregate_id
                             AND b.seq < e.seq
                             AND (b.status IN ('in_flight', 'dead') OR (b.status = 'pending' AND b.attempts > 0))
                             AND CASE b.status
                                     WHEN 'in_flight' THEN b.lease_expires_at > statement_timestamp()
                                     WHEN 'dead' THEN $4
                                     ELSE b.next_attempt_at > statement_timestamp() END)
                     ORDER BY e.seq
                     LIMIT $1
                     FOR UPDATE SKIP LOCKED
                 )
                 UPDATE {t} AS o
                 SET status = 'in_flight', lease_owner = $2, lease_token = $3,
                     lease_expires_at = statement_timestamp() + $5 * interval '1 millisecond'
                 FROM due WHERE o.seq = due.seq
                 RETURNING o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text AS payload,
                           o.destination, o.headers::text AS headers, o.idempotency_key, o.occurred_at, o.enqueued_at, o.attempts"
            ),
            ack: format!(
                "UPDATE {t} SET status = 'delivered', delivered_at = now(),
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq = ANY($1) AND lease_token = $2 AND status = 'in_flight'"
            ),
            retry: format!(
                "UPDATE {t} AS o SET status = 'pending', attempts = o.attempts + 1,
                     next_attempt_at = now() + r.delay_ms * interval '1 millisecond', last_error = r.error,
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS r(seq, delay_ms, error)
                 WHERE o.seq = r.seq AND o.lease_token = $4 AND o.status = 'in_flight'"
            ),
            bury: format!(
                "UPDATE {t} AS o SET status = 'dead', attempts = o.attempts + 1, dead_at = now(), last_error = r.error,
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM unnest($1::bigint[], $2::text[]) AS r(seq, error)
                 WHERE o.seq = r.seq AND o.lease_token = $3 AND o.status = 'in_flight'"
            ),
            release: format!(
                "UPDATE {t} SET status = 'pending', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq = ANY($1) AND lease_token = $2 AND status = 'in_flight'"
            ),
            get: format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE id = $1"),
            list_dead: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} WHERE status = 'dead' AND seq > $1 ORDER BY seq LIMIT $2"
            ),
            requeue_dead: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = now(), dead_at = NULL
                 WHERE status = 'dead' AND ($1::uuid[] IS NULL OR id = ANY($1))"
            ),
            discard_dead: format!(
                "DELETE FROM {t} WHERE status = 'dead' AND ($1::uuid[] IS NULL OR id = ANY($1))"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t}
                     WHERE status = 'delivered' AND delivered_at < now() - $1 * interval '1 millisecond'
                     ORDER BY seq LIMIT $2)"
            ),
            stats: format!(
                "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                        count(*) FILTER (WHERE status = 'pending' AND attempts > 0) AS retrying,
                        count(*) FILTER (WHERE status = 'in_flight') AS in_flight,
                        count(*) FILTER (WHERE status = 'delivered') AS delivered,
                        count(*) FILTER (WHERE status = 'dead') AS dead,
                        now() AS observed_at
                 FROM {t}"
            ),
            oldest: format!(
                "SELECT enqueued_at FROM {t} WHERE status IN ('pending', 'in_flight') ORDER BY seq LIMIT 1"
            ),
        }
    }
}

/// The outbox as a relay sees it: a pool and an outbox location.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    outbox: PgOutbox,
}

impl PgStore {
    /// A store over an existing pool.
    pub fn new(pool: PgPool, outbox: PgOutbox) -> Self {
        PgStore { pool, outbox }
    }

    /// Connect with settings suited to a relay (small pool, short acquire timeout so a database
    /// outage surfaces as a retryable error instead of a hang). The URL is not echoed in errors
    /// with its password.
    pub async fn connect(url: &str, outbox: PgOutbox) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(|e: sqlx::Error| {
            StoreError::Invalid(format!("invalid PostgreSQL URL `{}`: {e}", redact_url(url)))
        })?;
        let unreachable = |e: sqlx::Error| {
            StoreError::Unavailable(format!("cannot connect to {}: {e}", redact_url(url)))
        };
        // One direct connection first: it fails fast with the real cause (refused, unknown host,
        // authentication) where a pool would only report a timeout.
        let probe = <sqlx::PgConnection as sqlx::Connection>::connect_with(&options)
            .await
            .map_err(unreachable)?;
        let _ = sqlx::Connection::close(probe).await;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await
            .map_err(unreachable)?;
        Ok(PgStore { pool, outbox })
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The outbox location.
    pub fn outbox(&self) -> &PgOutbox {
        &self.outbox
    }

    fn sql(&self) -> &Sql {
        &self.outbox.inner.sql
    }
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let credentials = &url[scheme_end + 3..at];
            match credentials.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme_end + 3],
                    &credentials[..colon],
                    &url[at..]
                ),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn decode_headers(seq: i64, text: &str) -> Result<Headers, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
        seq,
        reason: format!("headers are not a JSON object of strings: {e}"),
    })
}

fn decode_event(row: &PgRow) -> Result<Event, StoreError> {
    let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
    let headers: String = row.try_get("headers").map_err(map_sqlx)?;
    let attempts: i32 = row.try_get("attempts").map_err(map_sqlx)?;
    Ok(Event {
        seq,
        id: EventId::from_uuid(row.try_get::<Uuid, _>("id").map_err(map_sqlx)?),
        aggregate_type: row.try_get("aggregate_type").map_err(map_sqlx)?,
        aggregate_id: row.try_get("aggregate_id").map_err(map_sqlx)?,
        event_type: row.try_get("event_type").map_err(map_sqlx)?,
        payload: row.try_get("payload").map_err(map_sqlx)?,
        destination: row.try_get("destination").map_err(map_sqlx)?,
        headers: decode_headers(seq, &headers)?,
        idempotency_key: row.try_get("idempotency_key").map_err(map_sqlx)?,
        occurred_at: row.try_get("occurred_at").map_err(map_sqlx)?,
        enqueued_at: row.try_get("enqueued_at").map_err(map_sqlx)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

fn decode_record(row: &PgRow) -> Result<EventRecord, StoreError> {
    let event = decode_event(row)?;
    let status: String = row.try_get("status").map_err(map_sqlx)?;
    let state = status
        .parse()
        .map_err(|e: outbox_core::ParseStateError| StoreError::Corrupt {
            seq: event.seq,
            reason: e.to_string(),
        })?;
    Ok(EventRecord {
        event,
        state,
        next_attempt_at: row.try_get("next_attempt_at").map_err(map_sqlx)?,
        last_error: row.try_get("last_error").map_err(map_sqlx)?,
        lease_owner: row.try_get("lease_owner").map_err(map_sqlx)?,
        lease_expires_at: row.try_get("lease_expires_at").map_err(map_sqlx)?,
        delivered_at: row.try_get("delivered_at").map_err(map_sqlx)?,
        dead_at: row.try_get("dead_at").map_err(map_sqlx)?,
    })
}

fn dead_ids(filter: &DeadFilter) -> Option<Vec<Uuid>> {
    match filter {
        DeadFilter::All => None,
        DeadFilter::Ids(ids) => Some(ids.iter().map(|id| *id.as_uuid()).collect()),
    }
}

#[async_trait]
impl Store for PgStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = Uuid::now_v7();
        let mut tx = self.pool.begin().await.map_err(map_sqlx)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(self.outbox.lock_key("claim"))
            .execute(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        let rows = sqlx::query(AssertSqlSafe(self.sql().claim.as_str()))
            .bind(i64::from(request.limit))
            .bind(&request.owner)
            .bind(token)
            .bind(request.dead_letter == DeadLetterPolicy::Block)
            .bind(millis(request.lease))
            .fetch_all(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        tx.commit().await.map_err(map_sqlx)?;
        let mut events = rows
            .iter()
            .map(decode_event)
            .collect::<Result<Vec<_>, _>>()?;
        events.sort_unstable_by_key(|e| e.seq);
        Ok(Claim {
            lease: Lease {
                owner: request.owner.clone(),
                token,
            },
            events,
        })
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(AssertSqlSafe(self.sql().ack.as_str()))
            .bind(seqs)
            .bind(lease.token)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError> {
        if events.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        let delays: Vec<i64> = events.iter().map(|e| millis(e.delay)).collect();
        let errors: Vec<String> = events
            .iter()
            .map(|e| outbox_core::truncate_error(&e.error))
            .collect();
        let done = sqlx::query(AssertSqlSafe(self.sql().retry.as_str()))
            .bind(&seqs)
            .bind(&delays)
            .bind(&errors)
            .bind(lease.token)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError> {
        if events.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        let errors: Vec<String> = events
            .iter()
            .map(|e| outbox_core::truncate_error(&e.error))
            .collect();
        let done = sqlx::query(AssertSqlSafe(self.sql().bury.as_str()))
            .bind(&seqs)
            .bind(&errors)
            .bind(lease.token)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(AssertSqlSafe(self.sql().release.as_str()))
            .bind(seqs)
            .bind(lease.token)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql().stats.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        let count = |name: &str| -> Result<u64, StoreError> {
            let n: i64 = row.try_get(name).map_err(map_sqlx)?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        let oldest: Option<DateTime<Utc>> =
            sqlx::query_scalar(AssertSqlSafe(self.sql().oldest.as_str()))
                .fetch_optional(&self.pool)
                .await
                .map_err(map_sqlx)?;
        Ok(OutboxStats {
            pending: count("pending")?,
            retrying: count("retrying")?,
            in_flight: count("in_flight")?,
            delivered: count("delivered")?,
            dead: count("dead")?,
            oldest_pending_enqueued_at: oldest,
            observed_at: Some(row.try_get("observed_at").map_err(map_sqlx)?),
        })
    }

    async fn get(&self, id: EventId) -> Result<Option<EventRecord>, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql().get.as_str()))
            .bind(id.as_uuid())
            .fetch_optional(&self.pool)
            .await
            .map_err(map_sqlx)?;
        row.as_ref().map(decode_record).transpose()
    }

    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: u32,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(self.sql().list_dead.as_str()))
            .bind(after_seq.unwrap_or(0))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(map_sqlx)?;
        rows.iter().map(decode_record).collect()
    }

    async fn requeue_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql().requeue_dead.as_str()))
            .bind(dead_ids(filter))
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn discard_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql().discard_dead.as_str()))
            .bind(dead_ids(filter))
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn purge_delivered(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql().purge.as_str()))
            .bind(millis(older_than))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn check(&self) -> Result<(), StoreError> {
        let (current, latest) = self.outbox.schema_version(&self.pool).await?;
        if current < latest {
            return Err(StoreError::NotMigrated(format!(
                "outbox schema in {} is at version {current}, this build needs {latest}",
                self.outbox.qualified_table()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact_url("postgres://h/db"), "postgres://h/db");
    }
}
