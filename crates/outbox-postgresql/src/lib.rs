//! # outbox-postgresql
//!
//! The PostgreSQL home of the outbox: embedded migrations, [`PgOutbox::enqueue`] into the
//! caller's own transaction, and [`PgStore`], the [`Store`] a relay claims from.
//!
//! ```no_run
//! use outbox_types::NewEvent;
//! use outbox_postgresql::PgOutbox;
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
//! the claim statement (see `outbox_types::Store` for why that is what keeps per-aggregate order
//! with several relays). The lock is held for the duration of one short `UPDATE … RETURNING`;
//! publishing, acking and retrying run without it. Inside that statement the rows are locked with
//! `FOR UPDATE SKIP LOCKED`, and an event skipped because someone else holds its row holds back
//! the rest of its aggregate for that claim (see the comment on the claim SQL for why).
//!
//! ## What the table checks when a row is written
//!
//! Writers in other languages insert into the table directly (or call the enqueue function), so
//! the table itself refuses what the relay could only dead-letter later (migration 6 of the plain
//! layout, 5 of the partitioned one; the contract for writers is `docs/table-contract.md`):
//!
//! - `id` defaults to a new time-ordered UUID v7 (built from `gen_random_uuid()` and
//!   `clock_timestamp()`: PostgreSQL 15 has no `uuidv7()`). In the partitioned layout the
//!   default is on the `_keys` table, whose row a writer inserts first and whose id the event
//!   takes; the event table has none, so an event cannot get an id its keys row lacks.
//! - The trigger `<table>_header_rules` (function `<table>_check_headers`): `headers` is a JSON
//!   object of string values with no name under the prefix `outbox-` (reserved for the relay's
//!   own message headers) other than `outbox-partition`. A writer's `INSERT` (or an `UPDATE`
//!   that sets `headers`) that breaks it fails with SQLSTATE `23514` and a message naming the
//!   header, inside its own transaction; [`PgOutbox::enqueue`] refuses the same names before
//!   sending anything.
//!
//! A trigger, not a CHECK constraint, because of what each costs a writer. PostgreSQL prepares a
//! table's check constraints anew for every statement that writes it (it reads the stored
//! expression and plans it), and this one (a `jsonpath` over the members, and, to leave the
//! relay's updates of old rows alone, a condition on the row's state) added 6 to 12 µs to a
//! single-row `INSERT` with empty headers and 15 to 17 µs with two, against 0 to 1 µs and 4.5 to
//! 5.5 µs for the trigger, whose plan PL/pgSQL caches for the session (20,000 `INSERT`s in a
//! loop, medians of six and of eight interleaved runs, PostgreSQL 15 on the 2-core development
//! machine; a writer's small transaction costs the server about 200 to 250 µs of CPU,
//! `outbox-bench writer-cost`). The trigger also sees only new rows, so an outbox that holds
//! rows written before it upgrades without a validation scan, and the relay settles those rows
//! as before.
//!
//! ## Autovacuum
//!
//! The outbox is a queue table: every event is inserted, updated at least twice (claim, ack;
//! once more per retry) and, after retention, deleted — three or more dead row versions each,
//! and none of those updates can be HOT because `status` is part of the partial indexes'
//! predicates. PostgreSQL's defaults vacuum a table once 20% of it is dead; for an outbox that
//! keeps a week of delivered events that is millions of dead versions, most of them in the
//! small `_open`, `_blockers` and `_heads` indexes every claim walks, so claims slow down exactly when
//! the backlog grows. Migration 2 therefore sets, on the outbox table only:
//!
//! | setting | value | why |
//! |---|---|---|
//! | `autovacuum_vacuum_scale_factor` | 0.01 | vacuum after 1% of the table is dead, not 20% |
//! | `autovacuum_vacuum_threshold` | 1000 | … plus 1000 rows, so a small outbox is not vacuumed constantly |
//! | `autovacuum_analyze_scale_factor` | 0.02 | the status mix shifts fast; the planner's choice of partial index depends on it |
//! | `autovacuum_analyze_threshold` | 1000 | as above |
//! | `autovacuum_vacuum_cost_delay` | 1 (ms) | half the default pause, so the worker keeps up with the churn |
//!
//! Setting them takes only a `SHARE UPDATE EXCLUSIVE` lock (reads and writes go on). Busier
//! outboxes can lower the scale factor further (`ALTER TABLE outbox.events SET
//! (autovacuum_vacuum_scale_factor = 0.002)`) or raise `autovacuum_vacuum_cost_limit`; and keep
//! long-running transactions away from the database, since vacuum cannot remove row versions a
//! still-open snapshot may see. Past a few million events a day, the partitioned layout avoids
//! the question: its retention deletes nothing.
//!
//! ## Partitioned mode
//!
//! [`PgOutbox::partitioned`] keeps the events in a table range-partitioned by `enqueued_at`
//! (daily by default, see [`Partitioning`]). Retention then drops whole partitions instead of
//! deleting rows: no `DELETE`, no dead versions, no vacuum debt. [`PgOutbox::maintain_partitions`]
//! creates the partitions writers will need ([`Partitioning::ahead`]) and drops those whose range
//! and every delivery are past [`Partitioning::retention`]; a partition holding any pending,
//! in-flight or dead event is never dropped, whatever its age. Call it on a schedule (every few
//! minutes to hourly, from one process or several: runs are serialized) and once before writers
//! start. A default partition catches events no dated partition covers, so a late maintenance
//! run never fails a writer.
//!
//! What differs from the plain layout:
//!
//! - PostgreSQL requires a partitioned table's unique constraints to include the partition key,
//!   so the event `id` and the idempotency key are kept unique across partitions by a small,
//!   unpartitioned `<table>_keys` table (id, key, enqueued_at). The enqueue statement writes it
//!   first and the event only if that created a row, in one statement inside the caller's
//!   transaction, with the same results as the plain layout. Its rows go with their events
//!   (same statement for purge and discard; by `enqueued_at` range right after a partition is
//!   dropped).
//! - `seq` comes from a sequence, and the primary key is `(seq, enqueued_at)`.
//! - Creating or dropping a partition takes an `ACCESS EXCLUSIVE` lock on the outbox table for
//!   a few milliseconds, waited for at most [`Partitioning::lock_timeout`].
//! - `purge_delivered` still works (and is how rows that landed in the default partition are
//!   cleaned), but is not needed for dated partitions.
//! - The WAL relay (`outbox-wal`) is not supported on the partitioned layout.
//!
//! Every [`Store`] operation behaves the same: the conformance suite runs against both layouts.
//!
//! ### Moving an existing outbox to the partitioned layout
//!
//! A table cannot be turned into a partitioned one in place, so the move goes through a second
//! outbox table, without losing or reordering events:
//!
//! 1. Create it next to the old one: `PgOutbox::partitioned("outbox", "events_p", …)`,
//!    `migrate`, `maintain_partitions`.
//! 2. Deploy the writers with the new outbox. Events enqueued from then on go to the new table.
//! 3. Drain the old table: run the relay against it with `stop_when_idle` (`outbox relay
//!    --drain`) until no event is pending or in flight, and only then start the relay on the
//!    new table — an aggregate's old events are then all delivered before its new ones.
//!    (Dead events of the old table stay there; requeue or discard them first if they matter.)
//! 4. After the retention period, drop the old table and its `_migrations` and `_paused`
//!    tables.
//!
//! Idempotency keys are only checked within one table: during step 2, a writer retrying an
//! enqueue that first reached the old table is not recognised as a duplicate by the new one;
//! consumers deduplicate on the event id anyway (at-least-once delivery).

mod error;
mod migrations;
mod names;
mod partition;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_types::route::{RouteTable, SqlDialect};
use outbox_types::{
    AggregateKey, BuryEvent, Claim, ClaimRequest, ClaimSort, DeadFilter, DeadLetterPolicy,
    DestinationStats, Event, EventId, EventRecord, Lease, LeaseHolder, NewEvent, OutboxStats,
    PausedDestination, Reading, ReplayFilter, ReplayStep, RetryEvent, Store, StoreError,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, PgExecutor, PgPool, Row};
use uuid::Uuid;

pub use migrations::MigrationReport;
pub use partition::{KeepReason, KeptPartition, PartitionInterval, PartitionReport, Partitioning};

use error::map_sqlx;
use names::{check_identifier, fnv1a};
use outbox_types::migration::{Schema, check_current};
use outbox_types::sql_store::{
    bytes, check_destination, count, decode_headers, millis, parse_state,
};

/// The result of an enqueue (shared by every store: [`outbox_types::sql_store::Enqueued`]).
pub use outbox_types::sql_store::Enqueued;

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
    /// `Some` for the partitioned layout (see [`Partitioning`]).
    partitioning: Option<Partitioning>,
}

/// Statements rendered once per outbox (they embed the table name).
#[derive(Debug)]
struct Sql {
    enqueue: String,
    enqueue_batch: String,
    /// Plain layout only: the same rows when no event carries an idempotency key, as a plain
    /// `INSERT` (an `ON CONFLICT` insert goes through PostgreSQL's speculative-insertion path,
    /// which costs a writer's transaction measurably more; see `outbox-bench write-overhead`).
    enqueue_unkeyed: Option<String>,
    enqueue_batch_unkeyed: Option<String>,
    claim: String,
    ack: String,
    ack_delete: String,
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
    leases: String,
    pause: String,
    resume: String,
    paused: String,
    purge_dead: String,
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
    /// assert!(outbox_postgresql::PgOutbox::with_names("billing_outbox", "events").is_ok());
    /// assert!(outbox_postgresql::PgOutbox::with_names("x; drop table y", "events").is_err());
    /// ```
    pub fn with_names(schema: &str, table: &str) -> Result<Self, StoreError> {
        Self::build(schema, table, None)
    }

    /// The outbox in table `schema.table`, range-partitioned by `enqueued_at` (see the crate
    /// docs, "Partitioned mode"). Retention then drops whole partitions
    /// ([`PgOutbox::maintain_partitions`]) instead of deleting rows.
    ///
    /// ```
    /// use outbox_postgresql::{PgOutbox, Partitioning};
    /// let outbox = PgOutbox::partitioned("outbox", "events", Partitioning::default()).unwrap();
    /// assert!(outbox.partitioning().is_some());
    /// ```
    pub fn partitioned(
        schema: &str,
        table: &str,
        partitioning: Partitioning,
    ) -> Result<Self, StoreError> {
        Self::build(schema, table, Some(partitioning))
    }

    fn build(
        schema: &str,
        table: &str,
        partitioning: Option<Partitioning>,
    ) -> Result<Self, StoreError> {
        check_identifier("schema", schema)?;
        check_identifier("table", table)?;
        let qualified = format!("\"{schema}\".\"{table}\"");
        let paused = format!("\"{schema}\".\"{table}_paused\"");
        let keys = format!("\"{schema}\".\"{table}_keys\"");
        let sql = Sql::render(
            &qualified,
            &paused,
            partitioning.as_ref().map(|_| keys.as_str()),
        );
        Ok(PgOutbox {
            inner: Arc::new(Names {
                schema: schema.to_owned(),
                table: table.to_owned(),
                qualified,
                sql,
                partitioning,
            }),
        })
    }

    /// The partitioning settings, for an outbox in the partitioned layout.
    pub fn partitioning(&self) -> Option<&Partitioning> {
        self.inner.partitioning.as_ref()
    }

    /// `"schema"."table_keys"`: the partitioned layout's table of ids and idempotency keys.
    pub(crate) fn keys_table(&self) -> String {
        format!("\"{}\".\"{}_keys\"", self.inner.schema, self.inner.table)
    }

    /// Create the partitions due soon and drop the ones whose events are all delivered and past
    /// retention (see [`Partitioning`]). Call it regularly (every few minutes to every hour) and
    /// at start-up; `now` is the current time. An error for an outbox that is not partitioned.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use outbox_postgresql::{PgOutbox, Partitioning};
    /// let outbox = PgOutbox::partitioned("outbox", "events", Partitioning::default())?;
    /// outbox.migrate(&pool).await?;
    /// let report = outbox.maintain_partitions(&pool, chrono::Utc::now()).await?;
    /// println!("created {:?}, dropped {:?}", report.created, report.dropped);
    /// # Ok(()) }
    /// ```
    pub async fn maintain_partitions(
        &self,
        pool: &PgPool,
        now: DateTime<Utc>,
    ) -> Result<PartitionReport, StoreError> {
        partition::maintain(self, pool, now).await
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

    /// The DDL [`PgOutbox::migrate`] applies to a database without this outbox, with the
    /// bookkeeping rows that record it applied, as one SQL script: for review, and for teams
    /// that apply schema changes with their own migration tool (`outbox schema print`).
    pub fn schema_script(&self) -> String {
        migrations::script(self)
    }

    /// The schema version in the database (`0` if never migrated) and the newest this build
    /// knows.
    pub async fn schema_version(&self, pool: &PgPool) -> Result<(i64, i64), StoreError> {
        Ok((
            migrations::current_version(self, pool).await?,
            migrations::latest_version(self),
        ))
    }

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
        .bind(event.id().as_uuid())
        .bind(event.aggregate_type())
        .bind(event.aggregate_id())
        .bind(event.event_type())
        .bind(event.payload())
        .bind(event.destination())
        .bind(event.headers_json())
        .bind(event.idempotency_key())
        .bind(event.occurred_at());
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
        let unkeyed = if first_with_key.is_empty() {
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
    /// `t` is the quoted outbox table, `p` the quoted paused-destinations table, `keys` the
    /// quoted keys table of the partitioned layout.
    fn render(t: &str, p: &str, keys: Option<&str>) -> Self {
        // Deletes report how many events they removed; in the partitioned layout they remove
        // the events' ids and keys from the keys table in the same statement.
        let counted_delete = |delete: String| match keys {
            None => format!("WITH d AS ({delete} RETURNING id) SELECT count(*) AS n FROM d"),
            Some(k) => format!(
                "WITH d AS ({delete} RETURNING id),
                      k AS (DELETE FROM {k} WHERE id IN (SELECT id FROM d))
                 SELECT count(*) AS n FROM d"
            ),
        };
        let (enqueue, enqueue_batch) = match keys {
            None => (plain_enqueue(t), plain_enqueue_batch(t)),
            Some(k) => (keyed_enqueue(t, k), keyed_enqueue_batch(t, k)),
        };
        // The partitioned layout needs the keys table even without a key: it is what keeps ids
        // unique across partitions.
        let (enqueue_unkeyed, enqueue_batch_unkeyed) = match keys {
            None => (
                Some(plain_enqueue_unkeyed(t)),
                Some(plain_enqueue_batch_unkeyed(t)),
            ),
            Some(_) => (None, None),
        };
        Sql {
            enqueue,
            enqueue_batch,
            enqueue_unkeyed,
            enqueue_batch_unkeyed,
            claim: claim_sql(t, None),
            ack: format!(
                "UPDATE {t} SET status = 'delivered', delivered_at = now(),
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq = ANY($1) AND lease_token = $2 AND status = 'in_flight'"
            ),
            // The ack of a store that keeps nothing delivered: the row goes at once. A delete
            // writes one small WAL record per row where the update writes a whole new row
            // version and its index entries (measured by `outbox-bench drain --delete-on-ack`).
            ack_delete: counted_delete(format!(
                "DELETE FROM {t} WHERE seq = ANY($1) AND lease_token = $2 AND status = 'in_flight'"
            )),
            retry: format!(
                "UPDATE {t} AS o SET status = 'pending', attempts = o.attempts + r.cost,
                     next_attempt_at = now() + r.delay_ms * interval '1 millisecond', last_error = r.error,
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM unnest($1::bigint[], $2::bigint[], $3::text[], $5::int[]) AS r(seq, delay_ms, error, cost)
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
                "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = now(), dead_at = NULL, last_error = NULL
                 WHERE status = 'dead' AND ($1::uuid[] IS NULL OR id = ANY($1))"
            ),
            discard_dead: counted_delete(format!(
                "DELETE FROM {t} WHERE status = 'dead' AND ($1::uuid[] IS NULL OR id = ANY($1))"
            )),
            // The outer WHERE repeats the condition: a row changed between the subquery's
            // snapshot and the delete (a replay, say) is re-checked on its latest version.
            purge: counted_delete(format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t}
                     WHERE status = 'delivered' AND delivered_at < now() - $1 * interval '1 millisecond'
                     ORDER BY seq LIMIT $2)
                   AND status = 'delivered' AND delivered_at < now() - $1 * interval '1 millisecond'"
            )),
            // $1 age ms, $2 limit. Through the `_dead` partial index.
            purge_dead: counted_delete(format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t}
                     WHERE status = 'dead' AND dead_at < now() - $1 * interval '1 millisecond'
                     ORDER BY seq LIMIT $2)
                   AND status = 'dead' AND dead_at < now() - $1 * interval '1 millisecond'"
            )),
            // In-flight rows only (the `_open` partial index), on the database's clock.
            leases: format!(
                "SELECT COALESCE(lease_owner, '') AS owner, count(*) AS events,
                        min(claimed_at) AS claimed_since, max(lease_expires_at) AS expires_at,
                        count(*) FILTER (WHERE lease_expires_at <= now()) AS expired
                 FROM {t} WHERE status = 'in_flight'
                 GROUP BY 1 ORDER BY 1"
            ),
            pause: format!(
                "INSERT INTO {p} (destination, paused_by) VALUES ($1, $2)
                 ON CONFLICT (destination) DO NOTHING"
            ),
            resume: format!("DELETE FROM {p} WHERE destination = $1"),
            paused: format!(
                "SELECT destination, paused_at, paused_by FROM {p} ORDER BY destination"
            ),
            stats: format!(
                "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                        count(*) FILTER (WHERE status = 'pending' AND (attempts > 0 OR last_error IS NOT NULL)) AS retrying,
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

/// Enqueue into the plain layout. `$1` id … `$9` occurred_at. A duplicate idempotency key
/// updates nothing but locks and returns the existing row (`xmax <> 0`: not created).
fn plain_enqueue(t: &str) -> String {
    format!(
        "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at)
         VALUES ($1, $2, $3, $4, $5::json, $6, $7::jsonb, $8, $9)
         ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
         DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key
         RETURNING id, (xmax = 0) AS created"
    )
}

/// [`plain_enqueue`] for an event without an idempotency key: nothing to conflict on, so a plain
/// `INSERT` (a duplicate id still fails on the unique constraint, as it does there). Same
/// parameters, `$8` being NULL.
fn plain_enqueue_unkeyed(t: &str) -> String {
    format!(
        "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at)
         VALUES ($1, $2, $3, $4, $5::json, $6, $7::jsonb, $8, $9)"
    )
}

/// [`plain_enqueue_batch`] for a batch in which no event has an idempotency key; same parameters.
fn plain_enqueue_batch_unkeyed(t: &str) -> String {
    format!(
        "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at)
         SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination, u.headers::jsonb, u.idempotency_key, u.occurred_at
         FROM {BATCH_UNNEST}
         ORDER BY u.ord"
    )
}

/// The events of a batch as rows, in array order (`u.ord`).
const BATCH_UNNEST: &str = "unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::timestamptz[])
              WITH ORDINALITY AS u(id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at, ord)";

/// A batch into the plain layout: the same columns as arrays, inserted in array order.
fn plain_enqueue_batch(t: &str) -> String {
    format!(
        "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at)
         SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination, u.headers::jsonb, u.idempotency_key, u.occurred_at
         FROM {BATCH_UNNEST}
         ORDER BY u.ord
         ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
         DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key
         RETURNING id, idempotency_key, (xmax = 0) AS created"
    )
}

/// Enqueue into the partitioned layout, one statement: the id and key go into the keys table
/// first (its primary key and unique index are what make them unique across partitions), and
/// the event row is written only when that insert created a keys row. Same parameters and
/// result as [`plain_enqueue`]. The event takes the keys row's `enqueued_at`, so both agree on
/// the partition the event lives in (retention removes a dropped partition's keys by range).
/// A duplicate locks the keys row, never the event row.
fn keyed_enqueue(t: &str, k: &str) -> String {
    format!(
        "WITH k AS (
             INSERT INTO {k} (id, idempotency_key) VALUES ($1, $8)
             ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
             DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key
             RETURNING id, enqueued_at, (xmax = 0) AS created
         ),
         e AS (
             INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at, enqueued_at)
             SELECT $1, $2, $3, $4, $5::json, $6, $7::jsonb, $8, $9, k.enqueued_at FROM k WHERE k.created
             RETURNING seq
         )
         SELECT id, created FROM k"
    )
}

/// A batch into the partitioned layout: keys first, then, in array order, the events whose
/// keys row was created.
fn keyed_enqueue_batch(t: &str, k: &str) -> String {
    format!(
        "WITH u AS MATERIALIZED (SELECT * FROM {BATCH_UNNEST}),
         k AS (
             INSERT INTO {k} (id, idempotency_key)
             SELECT u.id, u.idempotency_key FROM u ORDER BY u.ord
             ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
             DO UPDATE SET idempotency_key = EXCLUDED.idempotency_key
             RETURNING id, idempotency_key, enqueued_at, (xmax = 0) AS created
         ),
         e AS (
             INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at, enqueued_at)
             SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination, u.headers::jsonb, u.idempotency_key, u.occurred_at, k.enqueued_at
             FROM u JOIN k ON k.id = u.id AND k.created
             ORDER BY u.ord
             RETURNING seq
         )
         SELECT id, idempotency_key, created FROM k"
    )
}

/// The route expressions a claim with destinations on hold compares against the paused names:
/// the table's `CASE` over the candidate (`e`) and over the blocker probe's row (`b`), both bound
/// to the same placeholders.
struct HoldSql {
    /// The route `CASE` over the candidate row `e`.
    route_e: String,
    /// The same over a blocker `b`.
    route_b: String,
    /// The same over an earlier open row `d`, when a destination is deferred.
    route_d: Option<String>,
}

/// Run in the claim's transaction just before the claim statement: the advisory lock that
/// serializes claims across relays (`$1` the outbox's lock key).
///
/// (Tried and dropped: `enable_sort = off` here, to keep the planner from sorting all open rows
/// under statistics taken while nothing was open. The sorts it must still do then carry the
/// disable cost, which swamps every other difference: the claim's `UPDATE` went to a
/// sequential scan of the whole table. The `_heads` predicate, below, does it instead.)
const CLAIM_SETUP: &str = "SELECT pg_advisory_xact_lock($1)";

/// The claim statement. `$1` limit, `$2` owner, `$3` token, `$4` dead blocks, `$5` lease ms, `$6`
/// most payload bytes in the batch, `$7` most payload bytes of one event, `$8` the highest seq
/// to claim; with a hold, `$9` the paused destination names (`text[]`) and `$10…` the route
/// table's values.
///
/// A row is due when pending and its time has come, or in flight under an expired lease (its
/// relay died). It is held back by any earlier row of its aggregate that is in flight under a
/// live lease, waiting for a retry, or dead when dead blocks. The blocker probe's WHERE repeats
/// the predicate of the `_blockers` partial index, the scans' that of `_open` and `_heads`, so
/// the cost does not grow with the delivered rows kept for retention. `_heads` holds the same
/// rows as `_open` (the status check allows four values), but its predicate is written
/// `status NOT IN ('delivered', 'dead')`, which the planner cannot prove for `_open`: under
/// statistics taken while nothing was open every path over open rows looks free, and the
/// `_heads` walk found each next aggregate by sorting all open rows from `_open` (16k buffers
/// per claim at a 40k backlog, growing with it). Now only `_heads` can serve it.
///
/// Finding the due rows, in two parts so that a claim's work is bounded by its limit and not by
/// the backlog:
///
/// - `window`: the first `4 × limit` rows due by time, in seq order, each probed for a blocker;
///   the first `limit` unblocked ones are taken. With many aggregates this fills the claim, and
///   an aggregate's due rows go in one claim, in order.
/// - `heads`, only when the window was full and gave fewer than `limit`: most of the front of the
///   queue is held back (another relay holds the head of every aggregate, or a few aggregates
///   wait behind a retry or a dead event with long queues behind them). Walking on in seq order
///   would probe every held row — with 144 aggregates and a 600k backlog, a claim that finds
///   nothing took seconds, growing with the backlog, while holding the claim lock. Instead a
///   loose index scan over `_heads` visits up to `limit` aggregates that have open rows, from
///   the aggregate of a random open row onward (wrapping around), and takes each one's first
///   open row when it is due and unblocked (`heads`), and behind each such head up to 15 more
///   rows that are due and unblocked (`runs`, the same test the window applies). Every
///   aggregate is reached within a few claims whatever is held in front of it; a head never
///   passes an earlier row of its aggregate (the rows before it are delivered, dead, or on
///   hold). Heads alone would give each aggregate one event per claim while the front of the
///   queue stays held (e.g. a broker's aggregates waiting for retries).
///
/// Why the due rows are then locked in separate steps and not with one `SELECT … FOR UPDATE SKIP
/// LOCKED LIMIT n`: `SKIP LOCKED` silently passes over a due row that another transaction holds
/// at this instant — a writer whose duplicate-key enqueue hit it (`ON CONFLICT DO UPDATE` locks
/// the row until that transaction ends), a stalled relay's late retry or release of an expired
/// lease, an operator's `SELECT … FOR UPDATE`. Such a row is neither claimed nor a blocker (a
/// pending row with no attempt never is), so a one-step claim would hand out the *next* event of
/// its aggregate ahead of it. Instead:
///
/// 1. `due`: the rows found above, read without locking;
/// 2. `locked`: those rows locked with `SKIP LOCKED`, the due condition checked again on the
///    latest committed version (a row acked or retried since the statement's snapshot drops out).
///    Each row is looked up by its seq (a `LATERAL` lookup): as a join, statistics taken while
///    nothing was open (autovacuum analyzes an outbox table when it is drained) let the planner
///    hash every open row to lock 500 of them — claims of 10 s at a 120k backlog in the load
///    profile, growing with the backlog they let grow;
/// 3. `skipped`: per aggregate, the first `due` row that did not make it into `locked`. A locked
///    row is claimed only when no skipped row of its aggregate comes before it.
///
/// `SKIP LOCKED` still keeps the claim from ever waiting on a row lock; the price of a skipped
/// row is that this claim leaves its aggregate alone, and the next claim picks it up. The claim
/// stays serialized across relays by the advisory lock taken just before it.
fn claim_sql(t: &str, hold: Option<&HoldSql>) -> String {
    // `$9` the paused destinations, `$10` the deferred ones (for this claim only). Neither's
    // rows are candidates; a paused destination's rows hold nothing back (its events wait
    // apart), a deferred one's hold back their aggregate's later events as usual, and so does a
    // deferred row that is merely due (`deferred_probe`): skipping a destination for one turn
    // must not let another destination's event pass an earlier one of the same aggregate.
    let (hold_e, hold_b) = match hold {
        Some(h) => (
            format!(
                "AND NOT (COALESCE({}, '') = ANY($9::text[] || $10::text[]))",
                h.route_e
            ),
            format!("AND NOT (COALESCE({}, '') = ANY($9::text[]))", h.route_b),
        ),
        None => (String::new(), String::new()),
    };
    // Through the `_heads` index (open rows by aggregate and seq); only built when a
    // destination is deferred.
    let deferred_probe = match hold.and_then(|h| h.route_d.as_deref()) {
        Some(route_d) => format!(
            "AND NOT EXISTS (
                 SELECT 1 FROM {t} d
                 WHERE d.aggregate_type = e.aggregate_type
                   AND d.aggregate_id = e.aggregate_id
                   AND d.seq < e.seq
                   AND d.status NOT IN ('delivered', 'dead')
                   AND COALESCE({route_d}, '') = ANY($10::text[]))"
        ),
        None => String::new(),
    };
    // Due by time (pending and its time has come, or in flight under an expired lease), for
    // the row aliased `a`: read on the snapshot by the scans, re-checked on the latest version
    // by the lock step.
    let due_by_time_of = |a: &str| {
        format!(
            "CASE WHEN {a}.status = 'pending' THEN {a}.next_attempt_at <= statement_timestamp()
                  ELSE {a}.lease_expires_at <= statement_timestamp() END AND {a}.seq <= $8"
        )
    };
    let due_by_time = due_by_time_of("e");
    let due_on_latest = due_by_time_of("l");
    // OFFSET 0 keeps the probe a per-row lookup in the `_blockers` index: flattened into an
    // anti-join, statistics gathered while nothing was in flight let the planner join every
    // candidate against every blocker (seconds on a 100k backlog, measured by outbox-bench).
    // The probe walks the index downwards from the candidate: a blocker is usually just before
    // it (its aggregate's head, in flight), while below that lie the entries every delivered
    // event of the aggregate left behind until vacuum removes them (one per claim). Walking up
    // from the aggregate's first entry passed all of them: with 144 aggregates and 475k
    // delivered events, 1.2 ms per probe and claims of seconds that held back vacuum and grew
    // (the load profile); downwards, 0.03 ms.
    let unblocked = format!(
        "NOT EXISTS (
             SELECT 1 FROM {t} b
             WHERE b.aggregate_type = e.aggregate_type
               AND b.aggregate_id = e.aggregate_id
               AND b.seq < e.seq
               AND (b.status IN ('in_flight', 'dead') OR (b.status = 'pending' AND (b.attempts > 0 OR b.last_error IS NOT NULL)))
               AND CASE b.status
                       WHEN 'in_flight' THEN b.lease_expires_at > statement_timestamp()
                       WHEN 'dead' THEN $4
                       ELSE b.next_attempt_at > statement_timestamp() END
               {hold_b}
             ORDER BY b.seq DESC
             OFFSET 0)
         {deferred_probe}"
    );
    format!(
        "WITH RECURSIVE window_due AS MATERIALIZED (
             SELECT e.seq, e.aggregate_type, e.aggregate_id FROM (
                 SELECT e.seq, e.aggregate_type, e.aggregate_id FROM {t} e
                 WHERE e.status IN ('pending', 'in_flight') AND {due_by_time} {hold_e}
                 ORDER BY e.seq
                 LIMIT $1 * 4
             ) e
             WHERE {unblocked}
             ORDER BY e.seq
             LIMIT $1
         ),
         start AS MATERIALIZED (
             SELECT s.aggregate_type, s.aggregate_id FROM {t} s
             -- Only when the window gave too few: was it full (more due rows lie beyond)?
             -- This re-walks the window's cheap part; materializing the window instead would
             -- make every claim read all 4 x limit rows.
             WHERE (SELECT count(*) FROM window_due) < $1
               AND EXISTS (
                   SELECT 1 FROM {t} e
                   WHERE e.status IN ('pending', 'in_flight') AND {due_by_time} {hold_e}
                   ORDER BY e.seq
                   OFFSET $1 * 4 - 1 LIMIT 1)
               AND s.status IN ('pending', 'in_flight')
               AND s.seq >= (SELECT min(o.seq) + floor(random() * (max(o.seq) - min(o.seq) + 1))::bigint
                             FROM {t} o WHERE o.status IN ('pending', 'in_flight'))
             ORDER BY s.seq
             LIMIT 1
         ),
         walk (aggregate_type, aggregate_id, n) AS (
             SELECT aggregate_type, aggregate_id, 1 FROM start
             UNION ALL
             SELECT nx.aggregate_type, nx.aggregate_id, w.n + 1 FROM walk w
             CROSS JOIN LATERAL (
                 SELECT x.aggregate_type, x.aggregate_id FROM (
                     (SELECT h.aggregate_type, h.aggregate_id FROM {t} h
                      WHERE h.status NOT IN ('delivered', 'dead')
                        AND (h.aggregate_type, h.aggregate_id) > (w.aggregate_type, w.aggregate_id)
                      ORDER BY h.aggregate_type, h.aggregate_id
                      LIMIT 1)
                     UNION ALL
                     (SELECT h.aggregate_type, h.aggregate_id FROM {t} h
                      WHERE h.status NOT IN ('delivered', 'dead')
                      ORDER BY h.aggregate_type, h.aggregate_id
                      LIMIT 1)
                 ) x
                 LIMIT 1
             ) nx
             WHERE w.n < $1
               AND NOT EXISTS (
                   SELECT 1 FROM start s
                   WHERE s.aggregate_type = nx.aggregate_type AND s.aggregate_id = nx.aggregate_id)
         ),
         heads AS (
             SELECT e.seq, e.aggregate_type, e.aggregate_id FROM walk w
             CROSS JOIN LATERAL (
                 SELECT e.seq, e.aggregate_type, e.aggregate_id, e.status, e.next_attempt_at, e.lease_expires_at
                 FROM {t} e
                 WHERE e.aggregate_type = w.aggregate_type AND e.aggregate_id = w.aggregate_id
                   AND e.status NOT IN ('delivered', 'dead') {hold_e}
                 ORDER BY e.seq
                 LIMIT 1
             ) e
             WHERE {due_by_time} AND {unblocked}
         ),
         runs AS (
             SELECT e.seq, e.aggregate_type, e.aggregate_id FROM heads hd
             CROSS JOIN LATERAL (
                 SELECT e.seq, e.aggregate_type, e.aggregate_id, e.status, e.next_attempt_at, e.lease_expires_at
                 FROM {t} e
                 WHERE e.aggregate_type = hd.aggregate_type AND e.aggregate_id = hd.aggregate_id
                   AND e.seq > hd.seq
                   AND e.status NOT IN ('delivered', 'dead') {hold_e}
                 ORDER BY e.seq
                 LIMIT 15
             ) e
             WHERE {due_by_time} AND {unblocked}
         ),
         due AS MATERIALIZED (
             SELECT seq, aggregate_type, aggregate_id FROM window_due
             UNION
             SELECT seq, aggregate_type, aggregate_id FROM heads
             UNION
             SELECT seq, aggregate_type, aggregate_id FROM runs
             ORDER BY seq
             LIMIT $1
         ),
         locked AS MATERIALIZED (
             SELECT l.seq, l.bytes FROM due d
             CROSS JOIN LATERAL (
                 SELECT l.seq, octet_length(l.payload::text) AS bytes FROM {t} l
                 WHERE l.seq = d.seq
                   AND l.status IN ('pending', 'in_flight')
                   AND {due_on_latest}
                 FOR UPDATE OF l SKIP LOCKED
             ) l
         ),
         -- The byte budget: locked rows in seq order while the payloads before them stay under
         -- $6 (the first always). What it leaves out comes after everything it keeps, so no
         -- aggregate's later event is claimed without its earlier one. A payload above $7 counts
         -- as nothing: it is returned without its payload and buried.
         budget AS (
             SELECT x.seq FROM (
                 SELECT k.seq, k.b,
                        sum(k.b) OVER (ORDER BY k.seq ROWS UNBOUNDED PRECEDING) AS running
                 FROM (SELECT seq, CASE WHEN bytes > $7 THEN 0 ELSE bytes END AS b FROM locked) k
             ) x
             WHERE x.running - x.b < $6
         ),
         skipped AS (
             SELECT d.aggregate_type, d.aggregate_id, min(d.seq) AS seq FROM due d
             WHERE NOT EXISTS (SELECT 1 FROM locked k WHERE k.seq = d.seq)
             GROUP BY d.aggregate_type, d.aggregate_id
         )
         UPDATE {t} AS o
         SET status = 'in_flight', lease_owner = $2, lease_token = $3,
             lease_expires_at = statement_timestamp() + $5 * interval '1 millisecond',
             claimed_at = statement_timestamp()
         FROM budget k
         WHERE o.seq = k.seq
           AND NOT EXISTS (
               SELECT 1 FROM skipped s
               WHERE s.aggregate_type = o.aggregate_type AND s.aggregate_id = o.aggregate_id
                 AND s.seq < o.seq)
         RETURNING o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type,
                   CASE WHEN octet_length(o.payload::text) > $7 THEN NULL ELSE o.payload::text END AS payload,
                   octet_length(o.payload::text) AS payload_bytes,
                   pg_typeof(o.payload) IN ('json'::regtype, 'jsonb'::regtype) AS payload_typed,
                   o.destination, o.headers::text AS headers, o.idempotency_key, o.occurred_at, o.enqueued_at, o.attempts"
    )
}

/// Backlog per destination: the route `CASE` (`$1…`) grouped over the undelivered rows (the
/// `_open` partial index) and the dead ones (the `_dead` index). Delivered rows, the bulk of a
/// table kept for retention, are never read.
fn destination_stats_sql(t: &str, route: &str) -> String {
    format!(
        "SELECT x.route,
                count(*) FILTER (WHERE x.status = 'pending') AS pending,
                count(*) FILTER (WHERE x.status = 'pending' AND x.failed) AS retrying,
                count(*) FILTER (WHERE x.status = 'in_flight') AS in_flight,
                count(*) FILTER (WHERE x.status = 'dead') AS dead,
                min(x.enqueued_at) FILTER (WHERE x.status IN ('pending', 'in_flight')) AS oldest,
                -- The newest failed row's error: the greatest zero-padded seq, cut off again (a
                -- running max, no sort of every waiting row's error).
                substr(max(lpad(x.seq::text, 20, '0') || x.last_error)
                    FILTER (WHERE x.status IN ('pending', 'in_flight') AND x.failed), 21) AS last_error
         FROM (
             SELECT COALESCE({route}, '') AS route, e.seq, e.status, e.enqueued_at, e.last_error,
                    (e.attempts > 0 OR e.last_error IS NOT NULL) AS failed
             FROM {t} e WHERE e.status IN ('pending', 'in_flight')
             UNION ALL
             SELECT COALESCE({route}, '') AS route, e.seq, e.status, e.enqueued_at, NULL, false
             FROM {t} e WHERE e.status = 'dead'
         ) x
         GROUP BY x.route"
    )
}

/// One replay step. `$1` after seq, `$2` from, `$3` to, `$4` event type or NULL, `$5` limit;
/// with a destination, `$6` its name and `$7…` the route table's values.
///
/// The page is the first `limit` matching delivered rows after `$1` in seq order (a walk of the
/// primary key: delivered rows have no index of their own, which is what keeps acks cheap). The
/// update re-checks `status` on each row's latest version, so a row purged or changed since the
/// page was read is left alone.
fn replay_sql(t: &str, route: Option<&str>) -> String {
    let destination = route
        .map(|r| format!("AND COALESCE({r}, '') = $6"))
        .unwrap_or_default();
    format!(
        "WITH page AS MATERIALIZED (
             SELECT e.seq FROM {t} e
             WHERE e.status = 'delivered' AND e.seq > $1
               AND e.enqueued_at >= $2 AND e.enqueued_at < $3
               AND ($4::text IS NULL OR e.event_type = $4)
               {destination}
             ORDER BY e.seq
             LIMIT $5
         ),
         done AS (
             UPDATE {t} AS o
             SET status = 'pending', attempts = 0, next_attempt_at = now(), delivered_at = NULL,
                 dead_at = NULL, last_error = NULL,
                 lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
             FROM page p
             WHERE o.seq = p.seq AND o.status = 'delivered'
             RETURNING o.seq
         )
         SELECT (SELECT count(*) FROM page) AS scanned,
                (SELECT max(seq) FROM page) AS last_seq,
                (SELECT count(*) FROM done) AS replayed"
    )
}

/// The outbox as a relay sees it: a pool and an outbox location.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    outbox: PgOutbox,
    delete_on_ack: bool,
}

impl PgStore {
    /// A store over an existing pool.
    pub fn new(pool: PgPool, outbox: PgOutbox) -> Self {
        PgStore {
            pool,
            outbox,
            delete_on_ack: false,
        }
    }

    /// Delete each event when it is acked instead of marking it `delivered` (the relay's
    /// `retention.delivered = "0s"`). Nothing delivered is kept, so `outbox replay` has nothing
    /// to replay and `outbox status` counts no delivered events; in exchange the ack writes one
    /// small WAL record per event instead of a new row version with its index entries, and
    /// retention has nothing left to delete. Retried, dead and in-flight events are unaffected.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let store = outbox_postgresql::PgStore::new(pool, outbox_postgresql::PgOutbox::new())
    ///     .with_delete_on_ack(true);
    /// # }
    /// ```
    pub fn with_delete_on_ack(mut self, delete: bool) -> Self {
        self.delete_on_ack = delete;
        self
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
        Ok(PgStore::new(pool, outbox))
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

/// `scheme://user:secret@host/db?password=…` with both masked: the one redactor of
/// [`outbox_types::redact`], re-exported where callers have always found it.
pub use outbox_types::redact::redact_url;

fn decode_event(row: &PgRow) -> Result<Event, StoreError> {
    decode_event_as(row, Reading::Delivery)
}

fn decode_event_as(row: &PgRow, reading: Reading) -> Result<Event, StoreError> {
    let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
    let headers: String = row.try_get("headers").map_err(map_sqlx)?;
    let headers = match reading {
        Reading::Delivery => decode_headers(seq, &headers)?,
        Reading::Display => outbox_types::headers_for_display(&headers),
    };
    let attempts: i32 = row.try_get("attempts").map_err(map_sqlx)?;
    // The stock table's columns are typed (`uuid`, `json`); a hand-altered one may hold text
    // there, which a foreign writer can fill with anything: read it, and say what is wrong.
    let id = match row.try_get::<Uuid, _>("id") {
        Ok(id) => id,
        Err(_) => {
            let text: String = row.try_get("id").map_err(map_sqlx)?;
            Uuid::parse_str(&text).map_err(|e| StoreError::Corrupt {
                seq,
                reason: format!("column `id` is not a UUID ({e})"),
            })?
        }
    };
    let payload: String = row.try_get("payload").map_err(map_sqlx)?;
    let payload = match row.try_get::<bool, _>("payload_typed") {
        Ok(false) => outbox_types::check_payload(seq, payload, reading)?,
        _ => payload,
    };
    Ok(Event {
        seq,
        id: EventId::from_uuid(id),
        aggregate_type: row.try_get("aggregate_type").map_err(map_sqlx)?,
        aggregate_id: row.try_get("aggregate_id").map_err(map_sqlx)?,
        event_type: row.try_get("event_type").map_err(map_sqlx)?,
        payload,
        destination: row.try_get("destination").map_err(map_sqlx)?,
        headers,
        idempotency_key: row.try_get("idempotency_key").map_err(map_sqlx)?,
        occurred_at: row.try_get("occurred_at").map_err(map_sqlx)?,
        enqueued_at: row.try_get("enqueued_at").map_err(map_sqlx)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

fn decode_record(row: &PgRow) -> Result<EventRecord, StoreError> {
    let event = decode_event_as(row, Reading::Display)?;
    let status: String = row.try_get("status").map_err(map_sqlx)?;
    let state = parse_state(event.seq, &status)?;
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

/// Column `name` of `row`, a count.
fn count_of(row: &PgRow, name: &str) -> Result<u64, StoreError> {
    let n: i64 = row.try_get(name).map_err(map_sqlx)?;
    Ok(count(n))
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
        sqlx::query(CLAIM_SETUP)
            .bind(self.outbox.lock_key("claim"))
            .execute(&mut *tx)
            .await
            .map_err(map_sqlx)?;
        let hold = request
            .hold
            .as_deref()
            .filter(|h| !h.paused.is_empty() || !h.deferred.is_empty());
        let held_sql;
        let (sql, route_binds, held) = match hold {
            None => (self.sql().claim.as_str(), Vec::new(), None),
            Some(hold) => {
                let dialect = SqlDialect::Postgres { first_param: 11 };
                let route_e = hold.routes.sql_case(dialect, Some("e"));
                let route_b = hold.routes.sql_case(dialect, Some("b"));
                let route_d = (!hold.deferred.is_empty())
                    .then(|| hold.routes.sql_case(dialect, Some("d")).sql);
                held_sql = claim_sql(
                    self.outbox.qualified_table(),
                    Some(&HoldSql {
                        route_e: route_e.sql,
                        route_b: route_b.sql,
                        route_d,
                    }),
                );
                (held_sql.as_str(), route_e.binds, Some(hold))
            }
        };
        let mut query = sqlx::query(AssertSqlSafe(sql))
            .bind(i64::from(request.limit))
            .bind(&request.owner)
            .bind(token)
            .bind(request.dead_letter == DeadLetterPolicy::Block)
            .bind(millis(request.lease))
            .bind(bytes(request.max_batch_bytes))
            .bind(bytes(request.max_payload_bytes))
            .bind(request.up_to_seq.unwrap_or(i64::MAX));
        if let Some(hold) = held {
            query = query.bind(&hold.paused).bind(&hold.deferred);
            for value in route_binds {
                query = query.bind(value);
            }
        }
        let rows = query.fetch_all(&mut *tx).await.map_err(map_sqlx)?;
        tx.commit().await.map_err(map_sqlx)?;
        let mut sort = ClaimSort::new(request);
        for row in &rows {
            let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
            let size: Option<i32> = row.try_get("payload_bytes").map_err(map_sqlx)?;
            let aggregate = || {
                Ok(AggregateKey {
                    aggregate_type: row.try_get("aggregate_type").map_err(map_sqlx)?,
                    aggregate_id: row.try_get("aggregate_id").map_err(map_sqlx)?,
                })
            };
            let size = u64::try_from(size.unwrap_or(0)).unwrap_or(0);
            if let Some(error) = sort.row(seq, aggregate, size, || decode_event(row))? {
                tracing::warn!(
                    seq,
                    error,
                    "Claimed a row that cannot be delivered; it is dead-lettered."
                );
            }
        }
        let lease = Lease {
            owner: request.owner.clone(),
            token,
        };
        sort.finish().into_claim(self, lease).await
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        if seqs.is_empty() {
            return Ok(0);
        }
        if self.delete_on_ack {
            let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.sql().ack_delete.as_str()))
                .bind(seqs)
                .bind(lease.token)
                .fetch_one(&self.pool)
                .await
                .map_err(map_sqlx)?;
            return Ok(count(n));
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
            .map(|e| outbox_types::truncate_error(&e.error))
            .collect();
        let costs: Vec<i32> = events.iter().map(|e| i32::from(e.counts_attempt)).collect();
        let done = sqlx::query(AssertSqlSafe(self.sql().retry.as_str()))
            .bind(&seqs)
            .bind(&delays)
            .bind(&errors)
            .bind(lease.token)
            .bind(&costs)
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
            .map(|e| outbox_types::truncate_error(&e.error))
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
        let oldest: Option<DateTime<Utc>> =
            sqlx::query_scalar(AssertSqlSafe(self.sql().oldest.as_str()))
                .fetch_optional(&self.pool)
                .await
                .map_err(map_sqlx)?;
        Ok(OutboxStats {
            pending: count_of(&row, "pending")?,
            retrying: count_of(&row, "retrying")?,
            in_flight: count_of(&row, "in_flight")?,
            delivered: count_of(&row, "delivered")?,
            dead: count_of(&row, "dead")?,
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
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.sql().discard_dead.as_str()))
            .bind(dead_ids(filter))
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(count(n))
    }

    async fn purge_delivered(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.sql().purge.as_str()))
            .bind(millis(older_than))
            .bind(i64::from(limit))
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(count(n))
    }

    async fn destination_stats(
        &self,
        routes: &RouteTable,
    ) -> Result<Vec<DestinationStats>, StoreError> {
        let route = routes.sql_case(SqlDialect::Postgres { first_param: 1 }, Some("e"));
        let sql = destination_stats_sql(self.outbox.qualified_table(), &route.sql);
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for value in &route.binds {
            query = query.bind(value);
        }
        let rows = query.fetch_all(&self.pool).await.map_err(map_sqlx)?;
        let mut out = rows
            .iter()
            .map(|row| {
                let route: String = row.try_get("route").map_err(map_sqlx)?;
                Ok(DestinationStats {
                    destination: (!route.is_empty()).then_some(route),
                    pending: count_of(row, "pending")?,
                    retrying: count_of(row, "retrying")?,
                    in_flight: count_of(row, "in_flight")?,
                    dead: count_of(row, "dead")?,
                    oldest_pending_enqueued_at: row.try_get("oldest").map_err(map_sqlx)?,
                    last_error: row.try_get("last_error").map_err(map_sqlx)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        out.sort_by(|a, b| a.destination.cmp(&b.destination));
        Ok(out)
    }

    async fn leases(&self) -> Result<Vec<LeaseHolder>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(self.sql().leases.as_str()))
            .fetch_all(&self.pool)
            .await
            .map_err(map_sqlx)?;
        rows.iter()
            .map(|row| {
                Ok(LeaseHolder {
                    owner: row.try_get("owner").map_err(map_sqlx)?,
                    events: count_of(row, "events")?,
                    claimed_since: row.try_get("claimed_since").map_err(map_sqlx)?,
                    expires_at: row.try_get("expires_at").map_err(map_sqlx)?,
                    expired: count_of(row, "expired")?,
                })
            })
            .collect()
    }

    async fn pause(&self, destination: &str, by: &str) -> Result<bool, StoreError> {
        check_destination(destination)?;
        let done = sqlx::query(AssertSqlSafe(self.sql().pause.as_str()))
            .bind(destination)
            .bind(by)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected() == 1)
    }

    async fn resume(&self, destination: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql().resume.as_str()))
            .bind(destination)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected() > 0)
    }

    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(self.sql().paused.as_str()))
            .fetch_all(&self.pool)
            .await
            .map_err(map_sqlx)?;
        rows.iter()
            .map(|row| {
                Ok(PausedDestination {
                    destination: row.try_get("destination").map_err(map_sqlx)?,
                    paused_at: row.try_get("paused_at").map_err(map_sqlx)?,
                    paused_by: row.try_get("paused_by").map_err(map_sqlx)?,
                })
            })
            .collect()
    }

    async fn replay(
        &self,
        filter: &ReplayFilter,
        routes: &RouteTable,
        after_seq: Option<i64>,
        limit: u32,
    ) -> Result<ReplayStep, StoreError> {
        if limit == 0 {
            return Ok(ReplayStep::default());
        }
        let route = filter
            .destination
            .as_ref()
            .map(|_| routes.sql_case(SqlDialect::Postgres { first_param: 7 }, Some("e")));
        let sql = replay_sql(
            self.outbox.qualified_table(),
            route.as_ref().map(|r| r.sql.as_str()),
        );
        let mut query = sqlx::query(AssertSqlSafe(sql))
            .bind(after_seq.unwrap_or(0))
            .bind(filter.from)
            .bind(filter.to)
            .bind(filter.event_type.as_deref())
            .bind(i64::from(limit));
        if let (Some(destination), Some(route)) = (&filter.destination, &route) {
            query = query.bind(destination);
            for value in &route.binds {
                query = query.bind(value);
            }
        }
        let row = query.fetch_one(&self.pool).await.map_err(map_sqlx)?;
        let scanned: i64 = row.try_get("scanned").map_err(map_sqlx)?;
        let last_seq: Option<i64> = row.try_get("last_seq").map_err(map_sqlx)?;
        let replayed: i64 = row.try_get("replayed").map_err(map_sqlx)?;
        Ok(ReplayStep {
            replayed: u64::try_from(replayed).unwrap_or(0),
            next_after: last_seq.filter(|_| scanned >= i64::from(limit)),
        })
    }

    async fn purge_dead(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.sql().purge_dead.as_str()))
            .bind(millis(older_than))
            .bind(i64::from(limit))
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(count(n))
    }

    async fn check(&self) -> Result<(), StoreError> {
        let (current, latest) = self.outbox.schema_version(&self.pool).await?;
        check_current(
            Schema::OUTBOX,
            self.outbox.qualified_table(),
            current,
            latest,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan of `sql` (with `binds`), as JSON text.
    async fn plan(pool: &PgPool, sql: &str, binds: Vec<PlanArg>) -> String {
        let explain = format!("EXPLAIN (FORMAT JSON) {sql}");
        let mut query = sqlx::query_scalar::<_, serde_json::Value>(AssertSqlSafe(explain.as_str()));
        for b in binds {
            query = match b {
                PlanArg::Int(v) => query.bind(v),
                PlanArg::Bool(v) => query.bind(v),
                PlanArg::Text(v) => query.bind(v),
                PlanArg::Texts(v) => query.bind(v),
                PlanArg::Uuid(v) => query.bind(v),
                PlanArg::Time(v) => query.bind(v),
                PlanArg::NullText => query.bind(None::<String>),
            };
        }
        query.fetch_one(pool).await.unwrap().to_string()
    }

    /// A migrated outbox `events` table in a schema of its own (`outbox_t_<name>_<pid>`),
    /// dropped first if an earlier run left it.
    async fn fresh_outbox(name: &str) -> (PgPool, PgOutbox) {
        let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432");
        let schema = format!("outbox_t_{name}_{}", std::process::id());
        let outbox = PgOutbox::with_names(&schema, "events").unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&pool)
        .await
        .unwrap();
        outbox.migrate(&pool).await.unwrap();
        (pool, outbox)
    }

    async fn drop_outbox(pool: &PgPool, outbox: &PgOutbox) {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            outbox.schema()
        )))
        .execute(pool)
        .await
        .unwrap();
    }

    enum PlanArg {
        Int(i64),
        Bool(bool),
        Text(String),
        Texts(Vec<String>),
        Uuid(Uuid),
        Time(DateTime<Utc>),
        NullText,
    }

    /// On a table that is mostly delivered rows (as retention keeps it), with fresh statistics,
    /// the claim (with and without a hold) and the operator statements over undelivered and
    /// dead rows never scan the table: they read the partial indexes.
    #[tokio::test]
    async fn statements_over_open_rows_use_the_partial_indexes() {
        let (pool, outbox) = fresh_outbox("plan").await;
        let t = outbox.qualified_table();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, status, delivered_at, dead_at, attempts)
             SELECT gen_random_uuid(), 'agg', 'a' || (n % 500), CASE WHEN n % 3 = 0 THEN 'HookSent' ELSE 'Created' END,
                    '{{}}', CASE WHEN n < 49000 THEN 'delivered' WHEN n % 50 = 0 THEN 'dead' ELSE 'pending' END,
                    CASE WHEN n < 49000 THEN now() END, CASE WHEN n >= 49000 AND n % 50 = 0 THEN now() END,
                    CASE WHEN n >= 49000 AND n % 50 = 0 THEN 1 ELSE 0 END
             FROM generate_series(1, 50000) AS n;
             ANALYZE {t};"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let routes = RouteTable::new(
            ["kafka", "hooks"],
            vec![
                outbox_types::route::RouteRule::to("hooks")
                    .event_type(outbox_types::route::Pattern::parse("Hook*")),
                outbox_types::route::RouteRule::to("kafka"),
            ],
        )
        .unwrap();
        let claim_args = || {
            vec![
                PlanArg::Int(200),
                PlanArg::Text("o".into()),
                PlanArg::Uuid(Uuid::nil()),
                PlanArg::Bool(true),
                PlanArg::Int(30_000),
                PlanArg::Int(i64::MAX),
                PlanArg::Int(i64::MAX),
                PlanArg::Int(i64::MAX),
            ]
        };
        let dialect = SqlDialect::Postgres { first_param: 11 };
        let (route_e, route_b, route_d) = (
            routes.sql_case(dialect, Some("e")),
            routes.sql_case(dialect, Some("b")),
            routes.sql_case(dialect, Some("d")),
        );
        let held = claim_sql(
            t,
            Some(&HoldSql {
                route_e: route_e.sql.clone(),
                route_b: route_b.sql.clone(),
                route_d: None,
            }),
        );
        let mut held_args = claim_args();
        held_args.push(PlanArg::Texts(vec!["hooks".into()]));
        held_args.push(PlanArg::Texts(vec![]));
        held_args.extend(route_e.binds.iter().cloned().map(PlanArg::Text));
        let deferred = claim_sql(
            t,
            Some(&HoldSql {
                route_e: route_e.sql.clone(),
                route_b: route_b.sql,
                route_d: Some(route_d.sql),
            }),
        );
        let mut deferred_args = claim_args();
        deferred_args.push(PlanArg::Texts(vec![]));
        deferred_args.push(PlanArg::Texts(vec!["hooks".into()]));
        deferred_args.extend(route_e.binds.iter().cloned().map(PlanArg::Text));
        let stats_route = routes.sql_case(SqlDialect::Postgres { first_param: 1 }, Some("e"));
        let sql = &outbox.inner.sql;
        let checks = vec![
            ("claim", sql.claim.clone(), claim_args()),
            ("claim with a hold", held, held_args),
            ("claim with a deferred destination", deferred, deferred_args),
            (
                "destination stats",
                destination_stats_sql(t, &stats_route.sql),
                stats_route
                    .binds
                    .iter()
                    .cloned()
                    .map(PlanArg::Text)
                    .collect(),
            ),
            ("leases", sql.leases.clone(), vec![]),
            (
                "purge dead",
                sql.purge_dead.clone(),
                vec![PlanArg::Int(1000), PlanArg::Int(100)],
            ),
            (
                "list dead",
                sql.list_dead.clone(),
                vec![PlanArg::Int(0), PlanArg::Int(100)],
            ),
            ("oldest", sql.oldest.clone(), vec![]),
        ];
        for (name, statement, binds) in checks {
            let p = plan(&pool, &statement, binds).await;
            assert!(!p.contains("Seq Scan"), "{name} scans the table: {p}");
            // Any of the partial indexes will do: which one the planner picks for a
            // status filter depends on its estimates (CI once chose `_blockers` for leases).
            assert!(
                [
                    "events_open",
                    "events_blockers",
                    "events_heads",
                    "events_dead"
                ]
                .iter()
                .any(|index| p.contains(index)),
                "{name} reads a partial index: {p}"
            );
        }
        // A replay page walks the primary key from its start seq (delivered rows have no index
        // of their own, by design).
        let replay = plan(
            &pool,
            &replay_sql(t, None),
            vec![
                PlanArg::Int(0),
                PlanArg::Time(Utc::now() - chrono::TimeDelta::hours(1)),
                PlanArg::Time(Utc::now()),
                PlanArg::NullText,
                PlanArg::Int(100),
            ],
        )
        .await;
        assert!(replay.contains("events_pkey"), "{replay}");
        drop_outbox(&pool, &outbox).await;
    }

    /// Buffers one claim touches, from `EXPLAIN (ANALYZE, BUFFERS)`, and how many rows it
    /// claimed; the claim runs in a transaction that is rolled back.
    async fn claim_cost(pool: &PgPool, sql: &str, owner: &str) -> (u64, u64) {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(CLAIM_SETUP)
            .bind(0_i64)
            .execute(&mut *tx)
            .await
            .unwrap();
        let explain = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}");
        let plan: serde_json::Value = sqlx::query_scalar(AssertSqlSafe(explain.as_str()))
            .bind(100_i64)
            .bind(owner)
            .bind(Uuid::now_v7())
            .bind(true)
            .bind(30_000_i64)
            .bind(i64::MAX)
            .bind(i64::MAX)
            .bind(i64::MAX)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        let top = &plan[0]["Plan"];
        let buffers = top["Shared Hit Blocks"].as_u64().unwrap()
            + top["Shared Read Blocks"].as_u64().unwrap();
        (buffers, top["Actual Rows"].as_u64().unwrap())
    }

    /// Two ways a claim's cost used to grow with the backlog, each checked by comparing a
    /// claim's buffers at a 4k and an 80k backlog:
    ///
    /// - With few aggregates and one relay holding the head of each, another relay's claim finds
    ///   nothing due. Before the `_heads` walk it learnt that by probing every held row in seq
    ///   order (seconds at a 600k backlog in the load profile, holding the claim lock).
    /// - Statistics taken while nothing was open (as autovacuum leaves a drained outbox) made
    ///   the planner lock the due rows through a hash of every open row (claims of 10 s at a
    ///   120k backlog in the load profile). The statistics here are taken once, before any
    ///   open row exists.
    #[tokio::test]
    async fn claim_cost_does_not_grow_with_the_backlog() {
        let (pool, outbox) = fresh_outbox("heads").await;
        let t = outbox.qualified_table().to_owned();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, status, delivered_at)
             SELECT gen_random_uuid(), 'order', 'o' || (n % 20), 'Created', '{{}}', 'delivered', now()
             FROM generate_series(1, 2000) AS n;
             ANALYZE {t};"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let add = |from: i64, to: i64| {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'order', 'o' || (n % 20), 'Created', '{{}}'
                 FROM generate_series({from}, {to}) AS n"
            )))
        };
        let store = PgStore::new(pool.clone(), outbox.clone());
        let claim = outbox.inner.sql.claim.clone();
        // (buffers of relay-b's claim while relay-a holds every head, of one after relay-a's ack)
        let measure = || async {
            let holder = store
                .claim(&ClaimRequest {
                    owner: "relay-a".into(),
                    limit: 100,
                    lease: std::time::Duration::from_secs(600),
                    dead_letter: DeadLetterPolicy::Block,
                    hold: None,
                    max_batch_bytes: u64::MAX,
                    max_payload_bytes: u64::MAX,
                    up_to_seq: None,
                })
                .await
                .unwrap();
            let held: std::collections::HashSet<&str> = holder
                .events
                .iter()
                .map(|e| e.aggregate_id.as_str())
                .collect();
            assert_eq!(held.len(), 20, "relay-a holds the head of every aggregate");
            let (empty, claimed) = claim_cost(&pool, &claim, "relay-b").await;
            assert_eq!(claimed, 0, "every aggregate is held by relay-a");
            let seqs: Vec<i64> = holder.events.iter().map(|e| e.seq).collect();
            store.ack(&holder.lease, &seqs).await.unwrap();
            let (full, claimed) = claim_cost(&pool, &claim, "relay-b").await;
            assert_eq!(claimed, 100, "after the ack every aggregate goes on");
            (empty, full)
        };
        add(1, 4_000).execute(&pool).await.unwrap();
        let (empty_small, full_small) = measure().await;
        add(4_001, 80_000).execute(&pool).await.unwrap();
        let (empty_large, full_large) = measure().await;
        // Twenty times the rows. A bounded claim stays within about 2x (concurrent tests keep
        // some dead entries from being marked, so it is not exactly flat); each regression
        // above grew 6-20x.
        assert!(
            empty_large < empty_small * 3,
            "an empty claim read {empty_small} buffers at a 4k backlog and {empty_large} at 80k"
        );
        assert!(
            full_large < full_small * 3,
            "a claim of 100 read {full_small} buffers at a 4k backlog and {full_large} at 80k"
        );
        drop_outbox(&pool, &outbox).await;
    }

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
