//! The relay's own statements on the outbox table: mark delivered, dead-letter, the catch-up
//! scan, the duplicate check, the heartbeat. Each is one statement per batch.

use std::collections::HashSet;
use std::time::Duration;

use outbox_core::{Event, EventId, Headers};
use sqlx::{AssertSqlSafe, PgPool, Row};
use uuid::Uuid;

use crate::config::WalConfig;
use crate::engine::{Dead, Meta, Origin, WriteBack, WriteBackDone};
use crate::error::{WalError, map_sqlx};
use crate::slot::outbox_table;

/// Read as text where a hand-altered table could hold anything (`id`, `payload`, `headers`), so
/// a bad value is reported for its column instead of failing the whole statement.
/// The event's columns for the catch-up page, each as text so one bad value fails only its
/// row; a payload above the limit (`$4`) is not read.
const PAGE_COLUMNS: &str = "seq, id::text AS id, aggregate_type::text AS aggregate_type, \
     aggregate_id::text AS aggregate_id, event_type::text AS event_type, \
     CASE WHEN payload_bytes > $4 THEN NULL ELSE payload::text END AS payload, \
     destination::text AS destination, headers::text AS headers, idempotency_key::text AS idempotency_key, \
     occurred_at, enqueued_at, attempts";

/// Run `update` (an `UPDATE … WHERE seq = ANY(…) … RETURNING seq`) over `seqs` until every row
/// is either updated or found already `delivered`/`dead`. Returns `(updated, already_done)`.
///
/// Why the loop: PostgreSQL writes a transaction's commit record (which is what lets logical
/// decoding send it) a moment *before* the transaction becomes visible to new snapshots. A relay
/// as fast as this one can see an event in the WAL, deliver it, and run its UPDATE while the row
/// is still invisible; that UPDATE silently matches nothing. Rows neither updated nor found done
/// are retried for a little while; a row that stays invisible for seconds is gone (purged or
/// discarded) and left alone.
async fn update_visible<F, Fut>(
    pool: &PgPool,
    cfg: &WalConfig,
    seqs: &[i64],
    update: F,
) -> Result<(u64, u64), WalError>
where
    F: Fn(Vec<i64>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<i64>, WalError>>,
{
    let mut missing: Vec<i64> = seqs.to_vec();
    let (mut updated, mut already) = (0u64, 0u64);
    for round in 0..200u32 {
        let done: HashSet<i64> = update(missing.clone()).await?.into_iter().collect();
        updated += done.len() as u64;
        missing.retain(|s| !done.contains(s));
        if missing.is_empty() {
            break;
        }
        let finished = already_done(pool, cfg, &missing).await?;
        already += finished.len() as u64;
        missing.retain(|s| !finished.contains(s));
        if missing.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(if round < 20 { 2 } else { 20 })).await;
    }
    if !missing.is_empty() {
        tracing::warn!(
            rows = missing.len(),
            "Outbox rows from the stream are not in the table (purged or discarded?); left alone."
        );
    }
    Ok((updated, already))
}

/// Mark table rows delivered; returns `(marked, already delivered or dead)`.
async fn mark_delivered(
    pool: &PgPool,
    cfg: &WalConfig,
    seqs: &[i64],
) -> Result<(u64, u64), WalError> {
    let sql = format!(
        "UPDATE {} SET status = 'delivered', delivered_at = now(),
             lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
         WHERE seq = ANY($1) AND status IN ('pending', 'in_flight')
         RETURNING seq",
        outbox_table(cfg)
    );
    update_visible(pool, cfg, seqs, |seqs| {
        let sql = sql.clone();
        async move {
            sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(seqs)
                .fetch_all(pool)
                .await
                .map_err(map_sqlx)
        }
    })
    .await
}

/// Dead-letter table rows.
async fn bury_rows(pool: &PgPool, cfg: &WalConfig, dead: &[&Dead]) -> Result<u64, WalError> {
    let sql = format!(
        "UPDATE {} AS o SET status = 'dead', attempts = r.attempts, dead_at = now(), last_error = r.error,
             lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
         FROM unnest($1::bigint[], $2::int[], $3::text[]) AS r(seq, attempts, error)
         WHERE o.seq = r.seq AND o.status IN ('pending', 'in_flight')
         RETURNING o.seq",
        outbox_table(cfg)
    );
    let by_seq: std::collections::HashMap<i64, &Dead> =
        dead.iter().map(|d| (d.event.seq, *d)).collect();
    let seqs: Vec<i64> = by_seq.keys().copied().collect();
    let (buried, _) = update_visible(pool, cfg, &seqs, |seqs| {
        let sql = sql.clone();
        let attempts: Vec<i32> = seqs
            .iter()
            .filter_map(|s| by_seq.get(s))
            .map(|d| i32::try_from(d.event.attempts).unwrap_or(i32::MAX))
            .collect();
        let errors: Vec<String> = seqs
            .iter()
            .filter_map(|s| by_seq.get(s))
            .map(|d| d.error.clone())
            .collect();
        async move {
            sqlx::query_scalar(AssertSqlSafe(sql))
                .bind(&seqs)
                .bind(&attempts)
                .bind(&errors)
                .fetch_all(pool)
                .await
                .map_err(map_sqlx)
        }
    })
    .await?;
    Ok(buried)
}

/// Dead-letter message events as `dead` rows of the outbox table, so `outbox dead list/retry`
/// sees them. An idempotency key already taken by another row is dropped from the dead row
/// (it stays in the row's last error) rather than losing the event.
async fn bury_messages(pool: &PgPool, cfg: &WalConfig, dead: &[&Dead]) -> Result<u64, WalError> {
    let mut inserted = 0;
    let mut rest: Vec<&Dead> = dead.to_vec();
    for keep_keys in [true, false] {
        if rest.is_empty() {
            break;
        }
        let ids: Vec<Uuid> = rest.iter().map(|d| *d.event.id.as_uuid()).collect();
        let agg_types: Vec<&str> = rest
            .iter()
            .map(|d| d.event.aggregate_type.as_str())
            .collect();
        let agg_ids: Vec<&str> = rest.iter().map(|d| d.event.aggregate_id.as_str()).collect();
        let types: Vec<&str> = rest.iter().map(|d| d.event.event_type.as_str()).collect();
        let payloads: Vec<&str> = rest.iter().map(|d| d.event.payload.as_str()).collect();
        let destinations: Vec<Option<&str>> = rest
            .iter()
            .map(|d| d.event.destination.as_deref())
            .collect();
        let headers: Vec<String> = rest
            .iter()
            .map(|d| serde_json::to_string(&d.event.headers).unwrap_or_else(|_| "{}".to_owned()))
            .collect();
        let keys: Vec<Option<&str>> = rest
            .iter()
            .map(|d| {
                if keep_keys {
                    d.event.idempotency_key.as_deref()
                } else {
                    None
                }
            })
            .collect();
        let occurred: Vec<chrono::DateTime<chrono::Utc>> =
            rest.iter().map(|d| d.event.occurred_at).collect();
        let enqueued: Vec<chrono::DateTime<chrono::Utc>> =
            rest.iter().map(|d| d.event.enqueued_at).collect();
        let attempts: Vec<i32> = rest
            .iter()
            .map(|d| i32::try_from(d.event.attempts).unwrap_or(i32::MAX))
            .collect();
        let errors: Vec<String> = rest
            .iter()
            .map(|d| match (&d.event.idempotency_key, keep_keys) {
                (Some(key), false) => outbox_core::truncate_error(&format!(
                    "{} (idempotency key `{key}` was taken by another row)",
                    d.error
                )),
                _ => d.error.clone(),
            })
            .collect();
        let rows = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                             idempotency_key, occurred_at, enqueued_at, status, attempts, last_error, dead_at)
             SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination,
                    u.headers::jsonb, u.idempotency_key, u.occurred_at, u.enqueued_at, 'dead', u.attempts, u.error, now()
             FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                         $8::text[], $9::timestamptz[], $10::timestamptz[], $11::int[], $12::text[])
                  AS u(id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                       idempotency_key, occurred_at, enqueued_at, attempts, error)
             ON CONFLICT DO NOTHING
             RETURNING id",
            outbox_table(cfg)
        )))
        .bind(&ids)
        .bind(&agg_types)
        .bind(&agg_ids)
        .bind(&types)
        .bind(&payloads)
        .bind(&destinations)
        .bind(&headers)
        .bind(&keys)
        .bind(&occurred)
        .bind(&enqueued)
        .bind(&attempts)
        .bind(&errors)
        .fetch_all(pool)
        .await
        .map_err(map_sqlx)?;
        let written: HashSet<Uuid> = rows
            .iter()
            .filter_map(|r| r.try_get::<Uuid, _>("id").ok())
            .collect();
        inserted += written.len() as u64;
        // Rows whose id already exists are done (written by an earlier attempt); rows refused
        // for their idempotency key go again without it.
        let existing: HashSet<Uuid> = if written.len() < rest.len() {
            let missing: Vec<Uuid> = rest
                .iter()
                .map(|d| *d.event.id.as_uuid())
                .filter(|id| !written.contains(id))
                .collect();
            sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT id FROM {} WHERE id = ANY($1)",
                outbox_table(cfg)
            )))
            .bind(&missing)
            .fetch_all(pool)
            .await
            .map_err(map_sqlx)?
            .into_iter()
            .collect()
        } else {
            HashSet::new()
        };
        rest.retain(|d| {
            let id = d.event.id.as_uuid();
            !written.contains(id) && !existing.contains(id)
        });
    }
    Ok(inserted)
}

/// Run one write-back, retrying while the database is unreachable. Cancelled (dropped) when the
/// session ends; whatever it did not finish is redone after the restart, because the positions
/// it guarded were never confirmed.
pub(crate) async fn write_back(
    pool: PgPool,
    cfg: std::sync::Arc<WalConfig>,
    wb: WriteBack,
) -> (WriteBackDone, Vec<Meta>) {
    let mut failures = 0u32;
    let seqs: Vec<i64> = wb.delivered.iter().map(|(seq, _)| *seq).collect();
    let dead_rows: Vec<&Dead> = wb
        .dead
        .iter()
        .filter(|d| d.meta.origin == Origin::Table)
        .collect();
    let dead_msgs: Vec<&Dead> = wb
        .dead
        .iter()
        .filter(|d| d.meta.origin == Origin::Message)
        .collect();
    let mut marked = None;
    let mut buried_rows = None;
    let mut buried_msgs = None;
    loop {
        let result: Result<(), WalError> = async {
            if marked.is_none() {
                marked = Some(if seqs.is_empty() {
                    (0, 0)
                } else {
                    mark_delivered(&pool, &cfg, &seqs).await?
                });
            }
            if buried_rows.is_none() {
                buried_rows = Some(if dead_rows.is_empty() {
                    0
                } else {
                    bury_rows(&pool, &cfg, &dead_rows).await?
                });
            }
            if buried_msgs.is_none() {
                buried_msgs = Some(if dead_msgs.is_empty() {
                    0
                } else {
                    bury_messages(&pool, &cfg, &dead_msgs).await?
                });
            }
            Ok(())
        }
        .await;
        match result {
            Ok(()) => break,
            Err(error) => {
                failures += 1;
                let pause = backoff(failures, cfg.max_reconnect_backoff);
                tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, "Write-back to the outbox table failed; retrying. Nothing is confirmed meanwhile.");
                tokio::time::sleep(pause).await;
            }
        }
    }
    let (marked, already_done) = marked.unwrap_or((0, 0));
    let mut txs: Vec<Option<u64>> = wb.delivered.iter().map(|(_, tx)| *tx).collect();
    txs.extend(wb.dead.iter().map(|d| d.meta.tx));
    let metas: Vec<Meta> = wb.dead.iter().map(|d| d.meta).collect();
    (
        WriteBackDone {
            txs,
            marked,
            already_done,
            dead: wb.dead.len() as u64,
        },
        metas,
    )
}

/// Exponential pause: 100 ms, 200 ms, … up to `max`.
pub(crate) fn backoff(failures: u32, max: Duration) -> Duration {
    let exponent = failures.saturating_sub(1).min(20);
    Duration::from_millis(100u64.saturating_mul(1 << exponent)).min(max)
}

/// Which of `seqs` are already delivered or dead in the table.
pub(crate) async fn already_done(
    pool: &PgPool,
    cfg: &WalConfig,
    seqs: &[i64],
) -> Result<HashSet<i64>, WalError> {
    let rows: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT seq FROM {} WHERE seq = ANY($1) AND status IN ('delivered', 'dead')",
        outbox_table(cfg)
    )))
    .bind(seqs)
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    Ok(rows.into_iter().collect())
}

/// The highest seq in the table now.
pub(crate) async fn max_seq(pool: &PgPool, cfg: &WalConfig) -> Result<i64, WalError> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(max(seq), 0)::bigint FROM {}",
        outbox_table(cfg)
    )))
    .fetch_one(pool)
    .await
    .map_err(map_sqlx)
}

/// A row of the catch-up scan that cannot be read as an event.
pub(crate) struct MalformedRow {
    pub seq: i64,
    pub attempts: u32,
    /// What is wrong, naming the column.
    pub reason: String,
    /// Not malformed but too large: its payload's size, above `max_payload_bytes`.
    pub oversized: Option<u64>,
}

impl MalformedRow {
    /// The dead letter's `last_error`.
    pub fn error(&self, max_payload_bytes: u64) -> String {
        match self.oversized {
            Some(size) => outbox_core::bury_oversized(self.seq, size, max_payload_bytes).error,
            None => crate::pgoutput::malformed_error(self.seq, &self.reason),
        }
    }
}

/// One page of the catch-up scan.
pub(crate) struct Page {
    /// The rows, in seq order.
    pub rows: Vec<Result<Event, MalformedRow>>,
    /// Whether rows past this page may remain (the page was full, or cut by bytes).
    pub more: bool,
}

/// Undelivered rows (`pending` or `in_flight`) after `after`, up to `high_water`, in seq order:
/// at most `limit`, and while the payloads before a row add up to less than
/// `max_buffered_bytes` (the first row always). A row that cannot be read is returned as a
/// [`MalformedRow`], so one bad row never fails the page (and with it every start of the
/// relay); so is one whose payload is above `max_payload_bytes`, without loading the payload.
pub(crate) async fn undelivered(
    pool: &PgPool,
    cfg: &WalConfig,
    after: i64,
    high_water: i64,
    limit: i64,
) -> Result<Page, WalError> {
    let rows = sqlx::query(AssertSqlSafe(format!(
        "WITH page AS (
             SELECT seq FROM {t} WHERE status IN ('pending', 'in_flight') AND seq > $1 AND seq <= $2
             ORDER BY seq LIMIT $3
         ),
         sized AS (
             SELECT e.*, octet_length(e.payload::text) AS payload_bytes,
                    pg_typeof(e.payload) IN ('json'::regtype, 'jsonb'::regtype) AS payload_is_json,
                    count(*) OVER () AS page_rows
             FROM page p JOIN {t} e ON e.seq = p.seq
         ),
         counted AS (
             SELECT s.*, CASE WHEN s.payload_bytes > $4 THEN 0 ELSE s.payload_bytes END AS b
             FROM sized s
         ),
         kept AS (
             SELECT c.*, sum(c.b) OVER (ORDER BY c.seq ROWS UNBOUNDED PRECEDING) AS running
             FROM counted c
         )
         SELECT {PAGE_COLUMNS}, payload_bytes, payload_is_json, page_rows
         FROM kept WHERE running - b < $5
         ORDER BY seq",
        t = outbox_table(cfg)
    )))
    .bind(after)
    .bind(high_water)
    .bind(limit)
    .bind(i64::try_from(cfg.max_payload_bytes).unwrap_or(i64::MAX))
    .bind(i64::try_from(cfg.max_buffered_bytes).unwrap_or(i64::MAX))
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    let page_rows = match rows.first() {
        Some(row) => row.try_get::<i64, _>("page_rows").map_err(map_sqlx)?,
        None => 0,
    };
    let more = page_rows >= limit || (rows.len() as i64) < page_rows;
    let rows = rows
        .iter()
        .map(|row| {
            let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
            let attempts = row
                .try_get::<Option<i32>, _>("attempts")
                .ok()
                .flatten()
                .and_then(|a| u32::try_from(a).ok())
                .unwrap_or(0);
            let size: Option<i32> = row.try_get("payload_bytes").map_err(map_sqlx)?;
            let size = u64::try_from(size.unwrap_or(0)).unwrap_or(0);
            if size > cfg.max_payload_bytes {
                return Ok(Err(MalformedRow {
                    seq,
                    attempts,
                    reason: String::new(),
                    oversized: Some(size),
                }));
            }
            Ok(
                decode_row(row, seq, attempts).map_err(|reason| MalformedRow {
                    seq,
                    attempts,
                    reason,
                    oversized: None,
                }),
            )
        })
        .collect::<Result<_, WalError>>()?;
    Ok(Page { rows, more })
}

/// One catch-up row as an event; the error names the column and what is wrong with it, in the
/// words the stream decoder uses.
fn decode_row(row: &sqlx::postgres::PgRow, seq: i64, attempts: u32) -> Result<Event, String> {
    fn column<'r, T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>>(
        row: &'r sqlx::postgres::PgRow,
        name: &str,
    ) -> Result<T, String> {
        row.try_get(name).map_err(|e| match e {
            sqlx::Error::ColumnDecode { source, .. }
                if source.is::<sqlx::error::UnexpectedNullError>() =>
            {
                format!("column `{name}` is NULL; it needs a value")
            }
            sqlx::Error::ColumnDecode { source, .. } => {
                format!("column `{name}` cannot be read ({source})")
            }
            other => format!("column `{name}` cannot be read ({other})"),
        })
    }
    let id: String = column(row, "id")?;
    let id = Uuid::parse_str(&id).map_err(|e| format!("column `id` is not a UUID ({e})"))?;
    let headers = match column::<Option<String>>(row, "headers")? {
        Some(json) if json != "{}" => crate::pgoutput::parse_headers(&json)?,
        _ => Headers::new(),
    };
    let payload: String = column(row, "payload")?;
    if !column::<bool>(row, "payload_is_json")? {
        crate::pgoutput::check_json(&payload)?;
    }
    let now = chrono::Utc::now();
    Ok(Event {
        seq,
        id: EventId::from_uuid(id),
        aggregate_type: column(row, "aggregate_type")?,
        aggregate_id: column(row, "aggregate_id")?,
        event_type: column(row, "event_type")?,
        payload,
        destination: column(row, "destination")?,
        headers,
        idempotency_key: column(row, "idempotency_key")?,
        occurred_at: column::<Option<_>>(row, "occurred_at")?.unwrap_or(now),
        enqueued_at: column::<Option<_>>(row, "enqueued_at")?.unwrap_or(now),
        attempts,
    })
}

/// Write a heartbeat: a transactional logical message that gives the slot a commit to confirm.
pub(crate) async fn heartbeat(pool: &PgPool, prefix: &str) -> Result<crate::Lsn, WalError> {
    let lsn: String =
        sqlx::query_scalar("SELECT pg_logical_emit_message(true, $1, ''::bytea)::text")
            .bind(format!("{prefix}{}", crate::message::HEARTBEAT_SUFFIX))
            .fetch_one(pool)
            .await
            .map_err(map_sqlx)?;
    crate::Lsn::parse(&lsn).map_err(WalError::Decode)
}

/// The server's current WAL position.
pub(crate) async fn current_lsn(pool: &PgPool) -> Result<crate::Lsn, WalError> {
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await
        .map_err(map_sqlx)?;
    crate::Lsn::parse(&lsn).map_err(WalError::Decode)
}
