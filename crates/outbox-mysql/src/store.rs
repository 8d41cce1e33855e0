//! [`MySqlStore`]: the [`Store`] a relay claims from (see the crate docs for the claim design).

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_types::route::RouteTable;
use outbox_types::{
    AggregateKey, BuryEvent, Claim, ClaimRequest, ClaimSort, DeadFilter, DeadLetterPolicy,
    DestinationStats, Event, EventId, EventRecord, Lease, LeaseHolder, OutboxStats,
    PausedDestination, Reading, ReplayFilter, ReplayStep, RetryEvent, SortedClaim, Store,
    StoreError,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions, MySqlRow};
use sqlx::{AssertSqlSafe, MySqlPool, Row};
use uuid::Uuid;

use crate::error::map_sqlx;
use crate::session::Session;
use crate::sql::Sql;
use crate::{MySqlOutbox, decode_id, json_text, micros};
use outbox_types::migration::{Schema, check_current};
use outbox_types::sql_store::{count, decode_headers, id_list, parse_state};

/// How long a claim waits for the claim lock before it claims without it (see the crate docs).
pub const CLAIM_LOCK_WAIT_SECONDS: u32 = 5;

/// The longest lease owner stored; the [`Lease`] handed back keeps the whole name.
const MAX_OWNER_CHARS: usize = 255;

/// The longest paused destination name and "paused by" text.
const MAX_NAME_CHARS: usize = 255;

/// The outbox as a relay sees it: a pool and an outbox location.
#[derive(Clone, Debug)]
pub struct MySqlStore {
    pool: MySqlPool,
    outbox: MySqlOutbox,
}

impl MySqlStore {
    /// A store over an existing pool.
    pub fn new(pool: MySqlPool, outbox: MySqlOutbox) -> Self {
        MySqlStore { pool, outbox }
    }

    /// Connect with settings suited to a relay (small pool, short acquire timeout so a database
    /// outage surfaces as a retryable error instead of a hang). The URL is not echoed in errors
    /// with its password.
    pub async fn connect(url: &str, outbox: MySqlOutbox) -> Result<Self, StoreError> {
        let options: MySqlConnectOptions = url.parse().map_err(|e: sqlx::Error| {
            StoreError::Invalid(format!("invalid MySQL URL `{}`: {e}", redact_url(url)))
        })?;
        let unreachable = |e: sqlx::Error| {
            StoreError::Unavailable(format!("cannot connect to {}: {e}", redact_url(url)))
        };
        // One direct connection first: it fails fast with the real cause (refused, unknown host,
        // access denied) where a pool would only report a timeout.
        let probe = <sqlx::MySqlConnection as sqlx::Connection>::connect_with(&options)
            .await
            .map_err(unreachable)?;
        let _ = sqlx::Connection::close(probe).await;
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await
            .map_err(unreachable)?;
        Ok(MySqlStore { pool, outbox })
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The outbox location.
    pub fn outbox(&self) -> &MySqlOutbox {
        &self.outbox
    }

    fn sql(&self) -> &Sql {
        self.outbox.sql()
    }

    /// Steps 2 to 4 of a claim (see the crate docs), on a session that may hold the claim lock.
    async fn claim_rows(
        &self,
        session: &mut Session,
        request: &ClaimRequest,
        token: Uuid,
    ) -> Result<SortedClaim, StoreError> {
        let sql = self.sql();
        let block = request.dead_letter == DeadLetterPolicy::Block;
        let limit = i64::from(request.limit);
        // A plain read outside any transaction: what is due now, unblocked, in seq order.
        let hold = request
            .hold
            .as_deref()
            .filter(|h| !h.paused.is_empty() || !h.deferred.is_empty());
        let candidates = match hold {
            None => {
                sqlx::query(AssertSqlSafe(sql.claim_candidates.as_str()))
                    .bind(block)
                    .bind(limit)
                    .bind(block)
                    .bind(limit)
                    .bind(limit)
                    .fetch_all(session.conn())
                    .await
            }
            Some(hold) => {
                let built = sql.held_claim_candidates(
                    &hold.routes,
                    &hold.paused,
                    &hold.deferred,
                    block,
                    limit,
                );
                built.query().fetch_all(session.conn()).await
            }
        }
        .map_err(map_sqlx)?;
        if candidates.is_empty() {
            return Ok(SortedClaim::default());
        }
        let mut wanted = Vec::with_capacity(candidates.len());
        // The byte budget: candidates in seq order while the payloads before them add up to
        // less than `max_batch_bytes` (the first always). What it leaves out comes after
        // everything it keeps. A payload above `max_payload_bytes` counts as nothing: it is
        // locked without its payload and buried.
        let mut running: u64 = 0;
        for row in &candidates {
            let size: Option<i64> = row.try_get("bytes").map_err(map_sqlx)?;
            let size = u64::try_from(size.unwrap_or(0)).unwrap_or(0);
            let size = if size > request.max_payload_bytes {
                0
            } else {
                size
            };
            if !wanted.is_empty() && running >= request.max_batch_bytes {
                break;
            }
            running = running.saturating_add(size);
            let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
            let aggregate = AggregateKey {
                aggregate_type: row.try_get("aggregate_type").map_err(map_sqlx)?,
                aggregate_id: row.try_get("aggregate_id").map_err(map_sqlx)?,
            };
            wanted.push((seq, aggregate));
        }
        let seqs: Vec<i64> = wanted.iter().map(|(seq, _)| *seq).collect();

        session.begin().await?;
        let locked = sqlx::query(AssertSqlSafe(sql.claim_lock_rows.as_str()))
            .bind(i64::try_from(request.max_payload_bytes).unwrap_or(i64::MAX))
            .bind(json_text(&seqs)?)
            .fetch_all(session.conn())
            .await
            .map_err(map_sqlx)?;
        let locked_seqs = locked
            .iter()
            .map(|row| row.try_get::<i64, _>("seq").map_err(map_sqlx))
            .collect::<Result<HashSet<i64>, _>>()?;
        let keep = keep_in_order(&wanted, locked_seqs);
        if keep.is_empty() {
            session.rollback().await?;
            return Ok(SortedClaim::default());
        }
        // Rows that cannot be delivered are claimed with the rest and buried right after, so one
        // bad row neither fails the claim nor lets its aggregate's later events overtake it.
        let mut sort = ClaimSort::new(request);
        let mut kept = Vec::with_capacity(keep.len());
        for row in &locked {
            let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
            if !keep.contains(&seq) {
                continue;
            }
            kept.push(seq);
            let size: Option<i64> = row.try_get("payload_bytes").map_err(map_sqlx)?;
            let size = u64::try_from(size.unwrap_or(0)).unwrap_or(0);
            let aggregate = || {
                wanted
                    .iter()
                    .find(|(s, _)| *s == seq)
                    .map(|(_, key)| key.clone())
                    .ok_or_else(|| {
                        StoreError::Database(format!("claimed row {seq} was no candidate"))
                    })
            };
            if let Some(error) = sort.row(seq, aggregate, size, || decode_event(row))? {
                tracing::warn!(
                    seq,
                    error,
                    "Claimed a row that cannot be delivered; it is dead-lettered."
                );
            }
        }
        let owner: String = request.owner.chars().take(MAX_OWNER_CHARS).collect();
        let done = sqlx::query(AssertSqlSafe(sql.claim_update.as_str()))
            .bind(json_text(&kept)?)
            .bind(owner)
            .bind(token.to_string())
            .bind(micros(request.lease))
            .execute(session.conn())
            .await
            .map_err(map_sqlx)?;
        if done.rows_affected() != kept.len() as u64 {
            return Err(StoreError::Database(format!(
                "claim marked {} of the {} rows it had locked",
                done.rows_affected(),
                kept.len()
            )));
        }
        session.commit().await?;
        Ok(sort.finish())
    }
}

/// Which of the `wanted` candidates (in seq order) a claim may take, given the seqs it could lock
/// and found still due: a candidate it could not take holds back every later candidate of its
/// aggregate, which must not overtake it.
fn keep_in_order(wanted: &[(i64, AggregateKey)], locked: HashSet<i64>) -> HashSet<i64> {
    let mut held_back: HashSet<&AggregateKey> = HashSet::new();
    let mut keep = HashSet::with_capacity(locked.len());
    for (seq, aggregate) in wanted {
        if held_back.contains(aggregate) {
            continue;
        }
        if locked.contains(seq) {
            keep.insert(*seq);
        } else {
            held_back.insert(aggregate);
        }
    }
    keep
}

/// `scheme://user:secret@host/db?password=…` with both masked: the one redactor of
/// [`outbox_types::redact`], re-exported where callers have always found it.
pub use outbox_types::redact::redact_url;

fn decode_event(row: &MySqlRow) -> Result<Event, StoreError> {
    decode_event_as(row, Reading::Delivery)
}

fn decode_event_as(row: &MySqlRow, reading: Reading) -> Result<Event, StoreError> {
    let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
    let headers: String = row.try_get("headers").map_err(map_sqlx)?;
    let attempts: i32 = row.try_get("attempts").map_err(map_sqlx)?;
    let (id, headers) = match reading {
        Reading::Delivery => (decode_id(row, "id", seq)?, decode_headers(seq, &headers)?),
        Reading::Display => (
            decode_id(row, "id", seq).unwrap_or_else(|_| EventId::from_uuid(Uuid::nil())),
            outbox_types::headers_for_display(&headers),
        ),
    };
    Ok(Event {
        seq,
        id,
        aggregate_type: row.try_get("aggregate_type").map_err(map_sqlx)?,
        aggregate_id: row.try_get("aggregate_id").map_err(map_sqlx)?,
        event_type: row.try_get("event_type").map_err(map_sqlx)?,
        payload: outbox_types::check_payload(
            seq,
            row.try_get("payload").map_err(map_sqlx)?,
            reading,
        )?,
        destination: row.try_get("destination").map_err(map_sqlx)?,
        headers,
        idempotency_key: row.try_get("idempotency_key").map_err(map_sqlx)?,
        occurred_at: row.try_get("occurred_at").map_err(map_sqlx)?,
        enqueued_at: row.try_get("enqueued_at").map_err(map_sqlx)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

fn decode_record(row: &MySqlRow) -> Result<EventRecord, StoreError> {
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
fn count_of(row: &MySqlRow, name: &str) -> Result<u64, StoreError> {
    let n: i64 = row.try_get(name).map_err(map_sqlx)?;
    Ok(count(n))
}

#[async_trait]
impl Store for MySqlStore {
    fn kind(&self) -> &'static str {
        "mysql"
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = Uuid::now_v7();
        let lease = Lease {
            owner: request.owner.clone(),
            token,
        };
        if request.limit == 0 {
            return Ok(Claim {
                lease,
                events: Vec::new(),
                buried: 0,
            });
        }
        let sql = self.sql();
        let mut session = Session::open(&self.pool).await?;
        let serialized = match session
            .get_lock(&sql.claim_lock, CLAIM_LOCK_WAIT_SECONDS)
            .await
        {
            Ok(serialized) => serialized,
            Err(error) => {
                session.abandon(&sql.claim_unlock).await;
                return Err(error);
            }
        };
        if !serialized {
            tracing::warn!(
                table = self.outbox.table(),
                wait_s = CLAIM_LOCK_WAIT_SECONDS,
                "Outbox claim lock not granted in time; claiming without it (still safe, less efficient)."
            );
        }
        match self.claim_rows(&mut session, request, token).await {
            Ok(sorted) => {
                // The claim is committed: hand it out even if the release fails. The session then
                // still counts as holding the lock and is closed on drop, which releases it.
                if let Err(error) = session.release_lock(&sql.claim_unlock).await {
                    tracing::warn!(%error, "Releasing the outbox claim lock failed; closing the connection.");
                }
                sorted.into_claim(self, lease).await
            }
            Err(error) => {
                session.abandon(&sql.claim_unlock).await;
                Err(error)
            }
        }
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(AssertSqlSafe(self.sql().ack.as_str()))
            .bind(json_text(seqs)?)
            .bind(lease.token.to_string())
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError> {
        if events.is_empty() {
            return Ok(0);
        }
        let batch: Vec<serde_json::Value> = events
            .iter()
            .map(|e| {
                serde_json::json!({
                    "seq": e.seq,
                    "delay_us": micros(e.delay),
                    "error": outbox_types::truncate_error(&e.error),
                    "cost": i32::from(e.counts_attempt),
                })
            })
            .collect();
        let done = sqlx::query(AssertSqlSafe(self.sql().retry.as_str()))
            .bind(json_text(&batch)?)
            .bind(lease.token.to_string())
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError> {
        if events.is_empty() {
            return Ok(0);
        }
        let batch: Vec<serde_json::Value> = events
            .iter()
            .map(|e| {
                serde_json::json!({
                    "seq": e.seq,
                    "error": outbox_types::truncate_error(&e.error),
                })
            })
            .collect();
        let done = sqlx::query(AssertSqlSafe(self.sql().bury.as_str()))
            .bind(json_text(&batch)?)
            .bind(lease.token.to_string())
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
            .bind(json_text(seqs)?)
            .bind(lease.token.to_string())
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
        let oldest: Option<DateTime<Utc>> = row.try_get("oldest").map_err(map_sqlx)?;
        let observed_at: DateTime<Utc> = row.try_get("observed_at").map_err(map_sqlx)?;
        Ok(OutboxStats {
            pending: count_of(&row, "pending")?,
            retrying: count_of(&row, "retrying")?,
            in_flight: count_of(&row, "in_flight")?,
            delivered: count_of(&row, "delivered")?,
            dead: count_of(&row, "dead")?,
            oldest_pending_enqueued_at: oldest,
            observed_at: Some(observed_at),
        })
    }

    async fn get(&self, id: EventId) -> Result<Option<EventRecord>, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql().get.as_str()))
            .bind(id.to_string())
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
        let done = match filter {
            DeadFilter::All => {
                sqlx::query(AssertSqlSafe(self.sql().requeue_dead_all.as_str()))
                    .execute(&self.pool)
                    .await
            }
            DeadFilter::Ids(ids) if ids.is_empty() => return Ok(0),
            DeadFilter::Ids(ids) => {
                sqlx::query(AssertSqlSafe(self.sql().requeue_dead_ids.as_str()))
                    .bind(id_list(ids)?)
                    .execute(&self.pool)
                    .await
            }
        }
        .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn discard_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError> {
        let done = match filter {
            DeadFilter::All => {
                sqlx::query(AssertSqlSafe(self.sql().discard_dead_all.as_str()))
                    .execute(&self.pool)
                    .await
            }
            DeadFilter::Ids(ids) if ids.is_empty() => return Ok(0),
            DeadFilter::Ids(ids) => {
                sqlx::query(AssertSqlSafe(self.sql().discard_dead_ids.as_str()))
                    .bind(id_list(ids)?)
                    .execute(&self.pool)
                    .await
            }
        }
        .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn purge_delivered(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        if limit == 0 {
            return Ok(0);
        }
        let done = sqlx::query(AssertSqlSafe(self.sql().purge.as_str()))
            .bind(micros(older_than))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn destination_stats(
        &self,
        routes: &RouteTable,
    ) -> Result<Vec<DestinationStats>, StoreError> {
        let built = self.sql().destination_stats(routes);
        let rows = built
            .query()
            .fetch_all(&self.pool)
            .await
            .map_err(map_sqlx)?;
        let mut out = rows
            .iter()
            .map(|row| {
                let route: Vec<u8> = row.try_get("route").map_err(map_sqlx)?;
                let route = String::from_utf8(route).map_err(|e| {
                    StoreError::Database(format!("a routed destination is not UTF-8: {e}"))
                })?;
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
        if destination.is_empty() || destination.chars().count() > MAX_NAME_CHARS {
            return Err(StoreError::Invalid(format!(
                "the destination to pause must be 1 to {MAX_NAME_CHARS} characters long"
            )));
        }
        let by: String = by.chars().take(MAX_NAME_CHARS).collect();
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
        let page = self
            .sql()
            .replay_page(filter, routes, after_seq.unwrap_or(0), i64::from(limit));
        let seqs: Vec<i64> = page
            .query()
            .fetch_all(&self.pool)
            .await
            .map_err(map_sqlx)?
            .iter()
            .map(|row| row.try_get("seq").map_err(map_sqlx))
            .collect::<Result<_, _>>()?;
        if seqs.is_empty() {
            return Ok(ReplayStep::default());
        }
        let done = sqlx::query(AssertSqlSafe(self.sql().replay_update.as_str()))
            .bind(json_text(&seqs)?)
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(ReplayStep {
            replayed: done.rows_affected(),
            next_after: seqs
                .last()
                .copied()
                .filter(|_| seqs.len() >= limit as usize),
        })
    }

    async fn purge_dead(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        if limit == 0 {
            return Ok(0);
        }
        let done = sqlx::query(AssertSqlSafe(self.sql().purge_dead.as_str()))
            .bind(micros(older_than))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    }

    async fn check(&self) -> Result<(), StoreError> {
        let (current, latest) = self.outbox.schema_version(&self.pool).await?;
        let place = format!("table {}", self.outbox.quoted_table());
        check_current(Schema::OUTBOX, &place, current, latest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("mysql://u:secret@h:3306/db"),
            "mysql://u:***@h:3306/db"
        );
        assert_eq!(redact_url("mysql://u@h/db"), "mysql://u@h/db");
        assert_eq!(redact_url("mysql://h/db"), "mysql://h/db");
    }

    /// `OUTBOX_TEST_MYSQL_URL`, or the machine's local MariaDB `test` database.
    fn database_url() -> String {
        std::env::var("OUTBOX_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
    }

    fn unique_table(tag: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        format!("ob_t_{}_{tag}_{}", std::process::id(), nanos % 100_000)
    }

    /// The tabular `EXPLAIN` of `sql` with `binds`, as `(table, key)` pairs.
    async fn plan(
        pool: &MySqlPool,
        sql: &str,
        binds: &[serde_json::Value],
    ) -> Vec<(String, String)> {
        let explain = format!("EXPLAIN {sql}");
        let mut query = sqlx::query(AssertSqlSafe(explain.as_str()));
        for b in binds {
            query = match b {
                serde_json::Value::Bool(v) => query.bind(*v),
                serde_json::Value::Number(n) => query.bind(n.as_i64().unwrap()),
                other => query.bind(other.as_str().unwrap().to_owned()),
            };
        }
        query
            .fetch_all(pool)
            .await
            .unwrap()
            .iter()
            .map(|r| {
                let table: Option<String> = r.try_get("table").unwrap();
                let key: Option<String> = r.try_get("key").unwrap();
                (table.unwrap_or_default(), key.unwrap_or_default())
            })
            .collect()
    }

    #[tokio::test]
    async fn statements_use_the_intended_indexes_on_a_small_and_a_retention_heavy_table() {
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&database_url())
            .await
            .expect("MariaDB/MySQL must be running on 127.0.0.1:3306 with a `test` database");
        let outbox = MySqlOutbox::with_table(&unique_table("plan")).unwrap();
        outbox.migrate(&pool).await.unwrap();
        let t = outbox.quoted_table();
        let sql = outbox.sql();
        let seqs = serde_json::json!("[1, 2, 3]");
        let ids = serde_json::json!(format!("[\"{}\"]", Uuid::nil()));
        let token = serde_json::json!(Uuid::nil().to_string());
        for round in 0..2 {
            if round == 1 {
                // Mostly delivered rows, as in a table kept for retention, and a small backlog:
                // seqs 1..=21000 from a portable digits cross join (MySQL has no seq_1_to_n).
                let digits = "(SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                     UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                     UNION ALL SELECT 8 UNION ALL SELECT 9)";
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, headers,
                                      occurred_at, enqueued_at, next_attempt_at, status, delivered_at)
                     SELECT UUID(), 'agg', CONCAT('a', s.n % 300), 'E', '{{}}', '{{}}', UTC_TIMESTAMP(6),
                            UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
                            IF(s.n < 20000, 'delivered', 'pending'), UTC_TIMESTAMP(6)
                     FROM (SELECT d1.n + 10 * d2.n + 100 * d3.n + 1000 * d4.n + 10000 * d5.n AS n
                           FROM {digits} d1, {digits} d2, {digits} d3, {digits} d4, {digits} d5) AS s
                     WHERE s.n < 21000"
                )))
                .execute(&pool)
                .await
                .unwrap();
                sqlx::query(AssertSqlSafe(format!("ANALYZE TABLE {t}")))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            let candidates = plan(
                &pool,
                &sql.claim_candidates,
                &[true.into(), 200.into(), true.into(), 200.into(), 200.into()],
            )
            .await;
            assert!(
                candidates
                    .iter()
                    .filter(|(t, _)| t == "e")
                    .all(|(_, k)| k == "open_seq"),
                "round {round}: {candidates:?}"
            );
            let probes: Vec<_> = candidates.iter().filter(|(t, _)| t == "b").collect();
            assert_eq!(probes.len(), 6, "round {round}: {candidates:?}");
            assert!(
                probes.iter().all(|(_, k)| k == "blockers"),
                "round {round}: {candidates:?}"
            );
            // The statements built around a route table read through the same indexes.
            let routes = RouteTable::new(
                ["kafka", "hooks"],
                vec![
                    outbox_types::route::RouteRule::to("hooks")
                        .event_type(outbox_types::route::Pattern::parse("Hook*")),
                    outbox_types::route::RouteRule::to("kafka"),
                ],
            )
            .unwrap();
            let built = |b: crate::sql::Built| -> (String, Vec<serde_json::Value>) {
                let binds = b
                    .binds
                    .iter()
                    .map(|a| match a {
                        crate::sql::Arg::Text(v) => serde_json::json!(v),
                        crate::sql::Arg::Int(v) => serde_json::json!(v),
                        crate::sql::Arg::Bool(v) => serde_json::json!(v),
                    })
                    .collect();
                (b.sql, binds)
            };
            let (held, held_binds) =
                built(sql.held_claim_candidates(&routes, &["hooks".into()], &[], true, 200));
            let held_plan = plan(&pool, &held, &held_binds).await;
            assert!(
                held_plan
                    .iter()
                    .filter(|(t, _)| t == "e")
                    .all(|(_, k)| k == "open_seq"),
                "round {round}: {held_plan:?}"
            );
            let held_probes: Vec<_> = held_plan.iter().filter(|(t, _)| t == "b").collect();
            assert_eq!(held_probes.len(), 6, "round {round}: {held_plan:?}");
            assert!(
                held_probes.iter().all(|(_, k)| k == "blockers"),
                "round {round}: {held_plan:?}"
            );
            // A deferred destination: its earlier open rows are probed through `blockers` too.
            let (deferred, deferred_binds) =
                built(sql.held_claim_candidates(&routes, &[], &["hooks".into()], true, 200));
            let deferred_plan = plan(&pool, &deferred, &deferred_binds).await;
            assert!(
                deferred_plan
                    .iter()
                    .filter(|(t, _)| t == "e")
                    .all(|(_, k)| k == "open_seq"),
                "round {round}: {deferred_plan:?}"
            );
            let deferred_probes: Vec<_> = deferred_plan
                .iter()
                .filter(|(t, _)| t == "b" || t == "d")
                .collect();
            assert_eq!(deferred_probes.len(), 8, "round {round}: {deferred_plan:?}");
            assert!(
                deferred_probes.iter().all(|(_, k)| k == "blockers"),
                "round {round}: {deferred_plan:?}"
            );
            let filter = outbox_types::ReplayFilter {
                from: chrono::DateTime::<Utc>::MIN_UTC,
                to: Utc::now(),
                destination: Some("kafka".into()),
                event_type: Some("E".into()),
            };
            for (name, (statement, binds)) in [
                ("destination stats", built(sql.destination_stats(&routes))),
                (
                    "replay page",
                    built(sql.replay_page(&filter, &routes, 0, 100)),
                ),
            ] {
                let p = plan(&pool, &statement, &binds).await;
                let e: Vec<_> = p.iter().filter(|(t, _)| t == "e").collect();
                assert!(
                    !e.is_empty() && e.iter().all(|(_, k)| k == "open_seq"),
                    "{name}, round {round}: {p:?}"
                );
            }
            for (name, statement, binds) in [
                ("leases", &sql.leases, vec![]),
                ("purge dead", &sql.purge_dead, vec![1.into(), 10.into()]),
            ] {
                let p = plan(&pool, statement, &binds).await;
                assert!(
                    p.iter().any(|(_, k)| k == "open_seq"),
                    "{name}, round {round}: {p:?}"
                );
            }
            for (name, statement, binds) in [
                (
                    "lock rows",
                    &sql.claim_lock_rows,
                    vec![i64::MAX.into(), seqs.clone()],
                ),
                (
                    "claim update",
                    &sql.claim_update,
                    vec![seqs.clone(), "o".into(), token.clone(), 1.into()],
                ),
                ("ack", &sql.ack, vec![seqs.clone(), token.clone()]),
                ("release", &sql.release, vec![seqs.clone(), token.clone()]),
                ("replay update", &sql.replay_update, vec![seqs.clone()]),
                ("requeue", &sql.requeue_dead_ids, vec![ids.clone()]),
                ("discard", &sql.discard_dead_ids, vec![ids.clone()]),
                ("resolve ids", &sql.resolve_ids, vec![ids.clone()]),
                (
                    "resolve keys",
                    &sql.resolve_keys,
                    vec![serde_json::json!("[\"k\"]")],
                ),
            ] {
                let p = plan(&pool, statement, &binds).await;
                let e: Vec<_> = p.iter().filter(|(t, _)| t == "e").collect();
                assert_eq!(e.len(), 1, "{name}, round {round}: {p:?}");
                assert!(
                    ["PRIMARY", "id_key", "idempotency_key"].contains(&e[0].1.as_str()),
                    "{name}, round {round}: the table is looked up by key, not scanned: {p:?}"
                );
            }
        }
        sqlx::query(AssertSqlSafe(format!(
            "DROP TABLE {t}, {}, `{}_paused`",
            outbox.migrations_table(),
            outbox.table()
        )))
        .execute(&pool)
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn a_session_dropped_while_holding_the_lock_gives_it_back() {
        let pool = MySqlPoolOptions::new()
            .max_connections(3)
            .connect(&database_url())
            .await
            .expect("MariaDB/MySQL must be running on 127.0.0.1:3306 with a `test` database");
        let outbox = MySqlOutbox::with_table(&unique_table("lock")).unwrap();
        let sql = outbox.sql();
        let is_free = format!(
            "SELECT IS_FREE_LOCK(CONCAT('outbox:claim:', MD5(CONCAT(DATABASE(), '.', '{}'))))",
            outbox.table()
        );
        let mut session = Session::open(&pool).await.unwrap();
        assert!(session.get_lock(&sql.claim_lock, 1).await.unwrap());
        session.begin().await.unwrap();
        let free: Option<i64> = sqlx::query_scalar(AssertSqlSafe(is_free.as_str()))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(free, Some(0));
        // As when the claiming future is dropped half-way: no explicit release.
        drop(session);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let free: Option<i64> = sqlx::query_scalar(AssertSqlSafe(is_free.as_str()))
                .fetch_one(&pool)
                .await
                .unwrap();
            if free == Some(1) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the lock was never released"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // And a cleanly finished session goes back to the pool holding nothing.
        let mut session = Session::open(&pool).await.unwrap();
        assert!(session.get_lock(&sql.claim_lock, 1).await.unwrap());
        session.release_lock(&sql.claim_unlock).await.unwrap();
        drop(session);
        let free: Option<i64> = sqlx::query_scalar(AssertSqlSafe(is_free.as_str()))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(free, Some(1));
    }

    fn agg(id: &str) -> AggregateKey {
        AggregateKey {
            aggregate_type: "t".into(),
            aggregate_id: id.into(),
        }
    }

    #[test]
    fn a_candidate_not_taken_holds_back_its_aggregate_only() {
        let wanted = vec![
            (1, agg("a")),
            (2, agg("b")),
            (3, agg("a")),
            (4, agg("b")),
            (5, agg("c")),
        ];
        // a/1 was locked by someone else: a/3 must wait; b and c go on.
        let keep = keep_in_order(&wanted, [2, 3, 4, 5].into_iter().collect());
        let mut keep: Vec<i64> = keep.into_iter().collect();
        keep.sort();
        assert_eq!(keep, vec![2, 4, 5]);
        // b/4 lost only itself: nothing after it in b.
        let keep = keep_in_order(&wanted, [1, 2, 3, 5].into_iter().collect());
        assert_eq!(keep.len(), 4);
    }
}
