//! The WAL source's own statements on the outbox table: mark delivered (or delete), hand
//! failed stream events to the table, dead-letter, insert messages as rows, the checks against
//! the table, the heartbeat. Each is one statement per batch.

use std::collections::HashSet;
use std::time::Duration;

use outbox_types::{AggregateKey, DeadLetterPolicy, Event, RetryEvent};
use sqlx::postgres::PgArguments;
use sqlx::query::QueryScalar;
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};
use uuid::Uuid;

use crate::config::WalConfig;
use crate::error::{WalError, map_sqlx};
use crate::slot::outbox_table;

/// A statement of [`update_visible`] and the parameters bound to it so far.
type SeqQuery = QueryScalar<'static, Postgres, i64, PgArguments>;

/// Run `update` (an `UPDATE … WHERE seq = ANY(…) … RETURNING seq`) over `seqs` until every row
/// is either updated or found already `delivered`/`dead`. Returns `(updated, already_done)`.
///
/// Why the loop: PostgreSQL writes a transaction's commit record (which is what lets logical
/// decoding send it) a moment *before* the transaction becomes visible to new snapshots. A relay
/// as fast as this one can see an event in the WAL, deliver it, and run its UPDATE while the row
/// is still invisible; that UPDATE silently matches nothing. Rows neither updated nor found done
/// are retried for a little while; a row that stays invisible for seconds is gone (purged or
/// discarded) and left alone.
///
/// `bind` binds a round's parameters to the statement: the seqs still missing, and whatever it
/// derives from them (kept aligned with them).
async fn update_visible(
    pool: &PgPool,
    cfg: &WalConfig,
    update: &str,
    seqs: &[i64],
    bind: impl Fn(SeqQuery, Vec<i64>) -> SeqQuery,
) -> Result<(u64, u64), WalError> {
    let mut missing: Vec<i64> = seqs.to_vec();
    let (mut updated, mut already) = (0u64, 0u64);
    for round in 0..200u32 {
        let statement = sqlx::query_scalar(AssertSqlSafe(update.to_owned()));
        let done: HashSet<i64> = bind(statement, missing.clone())
            .fetch_all(pool)
            .await
            .map_err(map_sqlx)?
            .into_iter()
            .collect();
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

/// Settle delivered table rows: mark them delivered, or delete them with `delete_on_ack`
/// (nothing delivered is kept: `retention.delivered = "0s"`). The statement runs through
/// [`update_visible`], binding `seqs` as `$1`; returns its `(marked or deleted, found already
/// delivered or dead)`.
pub(crate) async fn settle_delivered(
    pool: &PgPool,
    cfg: &WalConfig,
    seqs: &[i64],
) -> Result<(u64, u64), WalError> {
    let sql = if cfg.delete_on_ack {
        format!(
            "DELETE FROM {} WHERE seq = ANY($1) AND status IN ('pending', 'in_flight') RETURNING seq",
            outbox_table(cfg)
        )
    } else {
        format!(
            "UPDATE {} SET status = 'delivered', delivered_at = now(),
                 lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
             WHERE seq = ANY($1) AND status IN ('pending', 'in_flight')
             RETURNING seq",
            outbox_table(cfg)
        )
    };
    update_visible(pool, cfg, &sql, seqs, |statement, seqs| {
        statement.bind(seqs)
    })
    .await
}

/// Stream table rows that failed go to the table for their retry: attempt counted (unless the
/// destination was unavailable), error kept (the mark of a row waiting for its retry), due after
/// their delay. Table claims take them up from there.
pub(crate) async fn retry_rows(
    pool: &PgPool,
    cfg: &WalConfig,
    retries: &[&RetryEvent],
) -> Result<u64, WalError> {
    let sql = format!(
        "UPDATE {} AS o SET status = 'pending', attempts = o.attempts + r.cost,
             next_attempt_at = now() + r.delay_ms * interval '1 millisecond', last_error = r.error,
             lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
         FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::int[]) AS r(seq, delay_ms, error, cost)
         WHERE o.seq = r.seq AND o.status IN ('pending', 'in_flight')
         RETURNING o.seq",
        outbox_table(cfg)
    );
    let by_seq: std::collections::HashMap<i64, &RetryEvent> =
        retries.iter().map(|r| (r.seq, *r)).collect();
    let seqs: Vec<i64> = by_seq.keys().copied().collect();
    let (done, _) = update_visible(pool, cfg, &sql, &seqs, |statement, seqs| {
        // One lookup per row, and the four arrays stay aligned with the seqs bound.
        let mut bound = Vec::with_capacity(seqs.len());
        let mut delays = Vec::with_capacity(seqs.len());
        let mut errors = Vec::with_capacity(seqs.len());
        let mut costs = Vec::with_capacity(seqs.len());
        for (seq, r) in seqs.iter().filter_map(|s| by_seq.get(s).map(|r| (*s, r))) {
            bound.push(seq);
            delays.push(i64::try_from(r.delay.as_millis()).unwrap_or(i64::MAX));
            errors.push(r.error.clone());
            costs.push(i32::from(r.counts_attempt));
        }
        statement.bind(bound).bind(delays).bind(errors).bind(costs)
    })
    .await?;
    Ok(done)
}

/// Dead-letter table rows: `(seq, attempts already made, error)`; the attempt that gave up is
/// counted. Returns how many.
pub(crate) async fn bury_rows(
    pool: &PgPool,
    cfg: &WalConfig,
    dead: &[(i64, u32, String)],
) -> Result<u64, WalError> {
    let sql = format!(
        "UPDATE {} AS o SET status = 'dead', attempts = o.attempts + 1, dead_at = now(), last_error = r.error,
             lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
         FROM unnest($1::bigint[], $2::text[]) AS r(seq, error)
         WHERE o.seq = r.seq AND o.status IN ('pending', 'in_flight')
         RETURNING o.seq",
        outbox_table(cfg)
    );
    let by_seq: std::collections::HashMap<i64, &String> =
        dead.iter().map(|(seq, _, error)| (*seq, error)).collect();
    let seqs: Vec<i64> = by_seq.keys().copied().collect();
    let (buried, _) = update_visible(pool, cfg, &sql, &seqs, |statement, seqs| {
        let errors: Vec<String> = seqs
            .iter()
            .filter_map(|s| by_seq.get(s))
            .map(|e| (*e).clone())
            .collect();
        statement.bind(seqs).bind(errors)
    })
    .await?;
    Ok(buried)
}

/// A message event going to the table as a row: pending (handed back, retried, released) or
/// dead.
#[derive(Clone, Debug)]
pub(crate) struct MessageRow {
    event: Event,
    status: &'static str,
    attempts: u32,
    delay: Duration,
    error: Option<String>,
}

impl MessageRow {
    /// A pending row with `attempts` made, due after `delay`.
    pub fn pending(
        event: Event,
        attempts: u32,
        delay: Option<Duration>,
        error: Option<String>,
    ) -> Self {
        MessageRow {
            event,
            status: "pending",
            attempts,
            delay: delay.unwrap_or_default(),
            error,
        }
    }

    /// A dead row.
    pub fn dead(event: Event, error: String) -> Self {
        MessageRow {
            attempts: event.attempts,
            event,
            status: "dead",
            delay: Duration::ZERO,
            error: Some(error),
        }
    }

    pub fn is_dead(&self) -> bool {
        self.status == "dead"
    }

    /// This row as a dead row in a form the outbox table can hold, after `refusal` (the
    /// database's error) refused it as it was: text fields cut with a marker, headers and
    /// idempotency key left out when long (`limits::storable`), and with `drop_payload` the
    /// payload too; what was cut and the original sizes go into `last_error`, after the
    /// event's own last error.
    fn cut(&self, refusal: &str, drop_payload: bool) -> MessageRow {
        let (mut event, note) = crate::limits::storable(self.event.clone(), drop_payload);
        if drop_payload {
            event.headers = outbox_types::Headers::new();
        }
        // The table refuses empty names; a Debezium row may have had them.
        for field in [
            &mut event.aggregate_type,
            &mut event.aggregate_id,
            &mut event.event_type,
        ] {
            if field.is_empty() {
                *field = "(empty)".to_owned();
            }
        }
        let before = self
            .error
            .as_deref()
            .map(|e| format!(" Its last error before: {e}"))
            .unwrap_or_default();
        let error = outbox_types::truncate_error(&format!(
            "the outbox table refused this event as it was ({refusal}), so it is dead instead of {}.{note}{before}",
            if self.is_dead() {
                "dead as it was"
            } else {
                "waiting for its delivery"
            }
        ));
        MessageRow {
            attempts: self.attempts,
            event,
            status: "dead",
            delay: Duration::ZERO,
            error: Some(error),
        }
    }
}

/// What [`insert_messages`] made of one row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Inserted {
    /// The seq of the row written (`None`: a row with its id was there already, or the row
    /// could not be written in any form).
    pub seq: Option<i64>,
    /// The table refused it as it was: it was written as a dead row in cut form.
    pub cut: bool,
}

/// Whether a failed statement would fail the same way however often it is tried: the data is
/// what the table cannot hold (SQLSTATE class 22 data exception, 23 integrity constraint, 54
/// program limit, e.g. "index row size exceeds maximum", and P0001, a trigger's refusal).
/// Everything else (a lost connection, a serialization failure, a lock timeout, a missing
/// privilege) may pass.
pub(crate) fn is_permanent(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("22")
                || code.starts_with("23")
                || code.starts_with("54")
                || code == "P0001"
        }),
        _ => false,
    }
}

/// The database's refusal, for `last_error`: its SQLSTATE and message (never a row value:
/// PostgreSQL's messages name columns, types and indexes; the DETAIL that may quote a value
/// is left out).
fn refusal(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => format!(
            "SQLSTATE {}: {}",
            db.code().as_deref().unwrap_or("?"),
            outbox_types::truncate_error(db.message())
        ),
        other => other.to_string(),
    }
}

/// `event`'s headers as the outbox table stores them: without names under the reserved prefix
/// `outbox-` other than `outbox-partition` (which this relay writes itself, for Debezium
/// tables), since the table's header trigger refuses those. A logical message, a Debezium
/// table's `header` placement or a stream table row from before that table's trigger may carry
/// one; no sink ever sends such a header (routing leaves every `outbox-` name out), so dropping
/// it changes nothing a consumer sees, where keeping it would fail the insert and stop the relay
/// handing failed events to the table.
fn storable_headers(event: &Event) -> String {
    let kept: std::collections::BTreeMap<&String, &String> = event
        .headers
        .iter()
        .filter(|(name, _)| !outbox_types::is_reserved_header(name))
        .collect();
    serde_json::to_string(&kept).unwrap_or_else(|_| "{}".to_owned())
}

/// Insert message events as rows of the outbox table, so table claims (and `outbox dead …`)
/// find them. Returns what became of each row, in input order ([`Inserted`]; its seq is
/// `None` where a row with that id existed already: written by an earlier attempt, or the
/// same message re-sent). An idempotency key already taken by another row is dropped from the
/// new row (it stays in its last error) rather than losing the event.
///
/// Never retried forever for its data: when the batch fails for what a row holds (see
/// [`is_permanent`]: a 96 KB `aggregate_id` over the btree's row size, a value the column's
/// type refuses), the rows go one by one, and each the table refuses is written as a dead row
/// in cut form ([`MessageRow::cut`]: fields cut, original sizes and the refusal in
/// `last_error`), then with its payload and headers left out too; a row refused even so is
/// logged as an error and given up, so the position moves past it. A transient failure
/// (connection, serialization, lock) is returned for the caller to retry.
pub(crate) async fn insert_messages(
    pool: &PgPool,
    cfg: &WalConfig,
    rows: &[MessageRow],
) -> Result<Vec<Inserted>, WalError> {
    let whole = |seq: Option<i64>| Inserted { seq, cut: false };
    match insert_rows(pool, cfg, rows).await {
        Ok(seqs) => return Ok(seqs.into_iter().map(whole).collect()),
        Err(error) if !is_permanent(&error) => {
            return Err(map_sqlx(error));
        }
        Err(_) => {}
    }
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let refused = match insert_rows(pool, cfg, std::slice::from_ref(row)).await {
            Ok(seqs) => {
                out.push(whole(seqs.first().copied().flatten()));
                continue;
            }
            Err(error) if is_permanent(&error) => refusal(&error),
            Err(error) => return Err(map_sqlx(error)),
        };
        let mut written = None;
        for drop_payload in [false, true] {
            let cut = row.cut(&refused, drop_payload);
            match insert_rows(pool, cfg, std::slice::from_ref(&cut)).await {
                Ok(seqs) => {
                    written = Some(seqs.first().copied().flatten());
                    break;
                }
                Err(error) if is_permanent(&error) => {
                    tracing::debug!(error = %refusal(&error), drop_payload, "The outbox table refused a cut copy too.");
                }
                Err(error) => return Err(map_sqlx(error)),
            }
        }
        match written {
            Some(seq) => {
                tracing::warn!(id = %row.event.id, seq, refusal = %refused, "The outbox table cannot hold an event handed to it from the stream; it is dead in cut form (`outbox dead show` says what was cut), and the stream moves on.");
                out.push(Inserted { seq, cut: true });
            }
            None => {
                tracing::error!(id = %row.event.id, refusal = %refused, "The outbox table refuses an event handed to it from the stream in every form; it is given up (not delivered, not dead-lettered) so the slot can move on.");
                out.push(Inserted {
                    seq: None,
                    cut: true,
                });
            }
        }
    }
    Ok(out)
}

/// The statement(s) of [`insert_messages`] for `rows`, with the database's own errors.
async fn insert_rows(
    pool: &PgPool,
    cfg: &WalConfig,
    rows: &[MessageRow],
) -> Result<Vec<Option<i64>>, sqlx::Error> {
    let mut seqs: std::collections::HashMap<Uuid, i64> = std::collections::HashMap::new();
    let mut rest: Vec<&MessageRow> = rows.iter().collect();
    for keep_keys in [true, false] {
        if rest.is_empty() {
            break;
        }
        let ids: Vec<Uuid> = rest.iter().map(|r| *r.event.id.as_uuid()).collect();
        let agg_types: Vec<&str> = rest
            .iter()
            .map(|r| r.event.aggregate_type.as_str())
            .collect();
        let agg_ids: Vec<&str> = rest.iter().map(|r| r.event.aggregate_id.as_str()).collect();
        let types: Vec<&str> = rest.iter().map(|r| r.event.event_type.as_str()).collect();
        let payloads: Vec<&str> = rest.iter().map(|r| r.event.payload.as_str()).collect();
        let destinations: Vec<Option<&str>> = rest
            .iter()
            .map(|r| r.event.destination.as_deref())
            .collect();
        let headers: Vec<String> = rest.iter().map(|r| storable_headers(&r.event)).collect();
        let keys: Vec<Option<&str>> = rest
            .iter()
            .map(|r| {
                if keep_keys {
                    r.event.idempotency_key.as_deref()
                } else {
                    None
                }
            })
            .collect();
        let occurred: Vec<chrono::DateTime<chrono::Utc>> =
            rest.iter().map(|r| r.event.occurred_at).collect();
        let enqueued: Vec<chrono::DateTime<chrono::Utc>> =
            rest.iter().map(|r| r.event.enqueued_at).collect();
        let statuses: Vec<&str> = rest.iter().map(|r| r.status).collect();
        let attempts: Vec<i32> = rest
            .iter()
            .map(|r| i32::try_from(r.attempts).unwrap_or(i32::MAX))
            .collect();
        let delays: Vec<i64> = rest
            .iter()
            .map(|r| i64::try_from(r.delay.as_millis()).unwrap_or(i64::MAX))
            .collect();
        let errors: Vec<Option<String>> = rest
            .iter()
            .map(|r| match (&r.event.idempotency_key, keep_keys) {
                (Some(key), false) => Some(outbox_types::truncate_error(&format!(
                    "{} (idempotency key `{key}` was taken by another row)",
                    r.error.as_deref().unwrap_or("handed to the table")
                ))),
                _ => r.error.clone(),
            })
            .collect();
        let inserted = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                             idempotency_key, occurred_at, enqueued_at, status, attempts, next_attempt_at,
                             last_error, dead_at)
             SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination,
                    u.headers::jsonb, u.idempotency_key, u.occurred_at, u.enqueued_at, u.status, u.attempts,
                    now() + u.delay_ms * interval '1 millisecond', u.error,
                    CASE WHEN u.status = 'dead' THEN now() END
             FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                         $8::text[], $9::timestamptz[], $10::timestamptz[], $11::text[], $12::int[],
                         $13::bigint[], $14::text[])
                  WITH ORDINALITY AS u(id, aggregate_type, aggregate_id, event_type, payload, destination,
                       headers, idempotency_key, occurred_at, enqueued_at, status, attempts, delay_ms, error, ord)
             ORDER BY u.ord
             ON CONFLICT DO NOTHING
             RETURNING id, seq",
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
        .bind(&statuses)
        .bind(&attempts)
        .bind(&delays)
        .bind(&errors)
        .fetch_all(pool)
        .await?;
        let mut written: HashSet<Uuid> = HashSet::new();
        for row in &inserted {
            let id: Uuid = row.try_get("id")?;
            let seq: i64 = row.try_get("seq")?;
            seqs.insert(id, seq);
            written.insert(id);
        }
        // Rows whose id already exists are done (written by an earlier attempt); rows refused
        // for their idempotency key go again without it.
        let existing: HashSet<Uuid> = if written.len() < rest.len() {
            let missing: Vec<Uuid> = rest
                .iter()
                .map(|r| *r.event.id.as_uuid())
                .filter(|id| !written.contains(id))
                .collect();
            sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT id FROM {} WHERE id = ANY($1)",
                outbox_table(cfg)
            )))
            .bind(&missing)
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect()
        } else {
            HashSet::new()
        };
        rest.retain(|r| {
            let id = r.event.id.as_uuid();
            !written.contains(id) && !existing.contains(id)
        });
    }
    Ok(rows
        .iter()
        .map(|r| seqs.get(r.event.id.as_uuid()).copied())
        .collect())
}

/// Of `seqs`, the rows that are not pending: settled (delivered, dead), or in flight under a
/// table claim. A stream row among them is not published again.
pub(crate) async fn not_pending(
    pool: &PgPool,
    cfg: &WalConfig,
    seqs: &[i64],
) -> Result<HashSet<i64>, WalError> {
    seqs_where(pool, cfg, seqs, "status <> 'pending'").await
}

/// Of `seqs`, those whose row matches `condition` (a fixed SQL condition on the outbox table).
async fn seqs_where(
    pool: &PgPool,
    cfg: &WalConfig,
    seqs: &[i64],
    condition: &str,
) -> Result<HashSet<i64>, WalError> {
    let rows: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT seq FROM {} WHERE seq = ANY($1) AND {condition}",
        outbox_table(cfg)
    )))
    .bind(seqs)
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    Ok(rows.into_iter().collect())
}

/// Of `seqs` (events the table owns), those it no longer holds open: delivered, deleted, or
/// dead when dead events do not hold their aggregate.
pub(crate) async fn gone(
    pool: &PgPool,
    cfg: &WalConfig,
    seqs: &[i64],
    dead_letter: DeadLetterPolicy,
) -> Result<HashSet<i64>, WalError> {
    let open: HashSet<i64> = sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
        "SELECT seq FROM {} WHERE seq = ANY($1)
           AND (status IN ('pending', 'in_flight') OR (status = 'dead' AND $2))",
        outbox_table(cfg)
    )))
    .bind(seqs)
    .bind(dead_letter == DeadLetterPolicy::Block)
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?
    .into_iter()
    .collect();
    Ok(seqs.iter().copied().filter(|s| !open.contains(s)).collect())
}

/// The rows the table owns as a session starts, with their aggregates: every undelivered row
/// with a `seq` up to `all_up_to` (`Some(i64::MAX)`: every one), and those that hold their
/// aggregate back (in flight, waiting for a retry, dead under `block`) wherever they are.
pub(crate) async fn open_rows(
    pool: &PgPool,
    cfg: &WalConfig,
    all_up_to: Option<i64>,
    dead_letter: DeadLetterPolicy,
) -> Result<Vec<(i64, AggregateKey)>, WalError> {
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT seq, aggregate_type, aggregate_id FROM {} e
         WHERE (e.status IN ('pending', 'in_flight')
                AND (e.seq <= $1 OR e.status = 'in_flight' OR e.attempts > 0 OR e.last_error IS NOT NULL))
            OR (e.status = 'dead' AND $2)",
        outbox_table(cfg)
    )))
    .bind(all_up_to.unwrap_or(i64::MIN))
    .bind(dead_letter == DeadLetterPolicy::Block)
    .fetch_all(pool)
    .await
    .map_err(map_sqlx)?;
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get("seq").map_err(map_sqlx)?,
                AggregateKey {
                    aggregate_type: r.try_get("aggregate_type").map_err(map_sqlx)?,
                    aggregate_id: r.try_get("aggregate_id").map_err(map_sqlx)?,
                },
            ))
        })
        .collect()
}

/// Whether a table claim bounded by `bound` would find anything: a pending row that is due, or
/// a claim whose lease ran out. One index probe: what the relay asks instead of claiming while
/// the table is idle.
pub(crate) async fn any_due(pool: &PgPool, cfg: &WalConfig, bound: i64) -> Result<bool, WalError> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE seq <= $1
           AND ((status = 'pending' AND next_attempt_at <= now())
             OR (status = 'in_flight' AND lease_expires_at <= now())))",
        outbox_table(cfg)
    )))
    .bind(bound)
    .fetch_one(pool)
    .await
    .map_err(map_sqlx)
}

/// Which of `seqs` are already delivered or dead in the table.
pub(crate) async fn already_done(
    pool: &PgPool,
    cfg: &WalConfig,
    seqs: &[i64],
) -> Result<HashSet<i64>, WalError> {
    seqs_where(pool, cfg, seqs, "status IN ('delivered', 'dead')").await
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

/// Exponential pause: 100 ms, 200 ms, … up to `max`.
pub(crate) fn backoff(failures: u32, max: Duration) -> Duration {
    let exponent = failures.saturating_sub(1).min(20);
    Duration::from_millis(100u64.saturating_mul(1 << exponent)).min(max)
}
