//! The partitioned layout's upkeep: create the partitions writers will need soon, drop the ones
//! retention is done with.
//!
//! Why partitions: in the plain layout retention is a `DELETE` of delivered rows, which leaves as
//! many dead row versions for vacuum to clean as it deleted, on the table every claim reads. A
//! partition whose events are all delivered and past retention can instead be dropped whole —
//! no per-row work, nothing left for vacuum. The rule that makes this safe: a partition holding
//! any event that is pending, in flight or dead is never dropped, whatever its age.
//!
//! Partitions are named `<table>_p<YYYYMMDD>` (daily) or `<table>_p<YYYYMMDDHH>` (hourly), in UTC;
//! the range a partition covers is read back from its name, and tables with other names (the
//! `<table>_default` catch-all, anything an operator attached) are never dropped.
//!
//! Locks: creating and dropping a partition both take an `ACCESS EXCLUSIVE` lock on the outbox
//! table (PostgreSQL has to update its partition descriptor), which makes writers and relays wait
//! for as long as it is held. The expensive check ("are all its events delivered and old?") runs
//! before, without that lock; under the lock only two index probes repeat the part of the check
//! that matters for safety (nothing pending, in flight or dead), so it is held for milliseconds.
//! The wait *for* the lock is bounded by [`Partitioning::lock_timeout`]: a long transaction on
//! the outbox makes this run skip the partition (reported as [`KeepReason::LockTimeout`]) rather
//! than queue every writer behind it.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, NaiveDateTime, TimeDelta, Timelike, Utc};
use outbox_types::StoreError;
use sqlx::{AssertSqlSafe, PgPool, Row};

use crate::PgOutbox;
use crate::error::map_sqlx;

/// How much time one partition covers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PartitionInterval {
    /// One UTC day per partition (`<table>_pYYYYMMDD`).
    #[default]
    Daily,
    /// One UTC hour per partition (`<table>_pYYYYMMDDHH`), for outboxes that write tens of
    /// millions of events a day.
    Hourly,
}

impl PartitionInterval {
    fn step(self) -> TimeDelta {
        match self {
            PartitionInterval::Daily => TimeDelta::days(1),
            PartitionInterval::Hourly => TimeDelta::hours(1),
        }
    }

    /// The start of the partition holding `at`.
    fn floor(self, at: DateTime<Utc>) -> DateTime<Utc> {
        let day = at.date_naive();
        let start = match self {
            PartitionInterval::Daily => day.and_hms_opt(0, 0, 0),
            PartitionInterval::Hourly => day.and_hms_opt(at.hour(), 0, 0),
        };
        start.map(|s| s.and_utc()).unwrap_or(at)
    }

    fn suffix(self, start: DateTime<Utc>) -> String {
        match self {
            PartitionInterval::Daily => start.format("%Y%m%d").to_string(),
            PartitionInterval::Hourly => start.format("%Y%m%d%H").to_string(),
        }
    }
}

/// The partitioned layout's settings: see [`PgOutbox::partitioned`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partitioning {
    /// How much time one partition covers.
    pub interval: PartitionInterval,
    /// Partitions created ahead of the current one, so a maintenance run that is late or fails
    /// for a while never leaves writers without a partition (they would land in the default
    /// partition, which rotation cannot drop).
    pub ahead: u32,
    /// How long delivered events are kept: a partition is dropped once its whole range is older
    /// than this and every event in it was delivered longer ago than this.
    pub retention: Duration,
    /// Longest wait for the table lock that creating or dropping a partition needs.
    pub lock_timeout: Duration,
}

impl Default for Partitioning {
    /// Daily partitions, 3 ahead, 7 days of retention, a 5 s lock wait.
    fn default() -> Self {
        Partitioning {
            interval: PartitionInterval::Daily,
            ahead: 3,
            retention: Duration::from_secs(7 * 24 * 3600),
            lock_timeout: Duration::from_secs(5),
        }
    }
}

/// Why a partition past retention was kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepReason {
    /// It holds pending or in-flight events.
    Undelivered,
    /// It holds dead events (requeue or discard them, or let dead-letter retention go first).
    Dead,
    /// Some of its events were delivered less than the retention period ago.
    DeliveredWithinRetention,
    /// The table lock was not granted within [`Partitioning::lock_timeout`]; the next run
    /// tries again.
    LockTimeout,
}

/// A partition past retention that was not dropped, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptPartition {
    /// The partition's table name.
    pub name: String,
    /// Why it stays.
    pub reason: KeepReason,
}

/// What one [`PgOutbox::maintain_partitions`] run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartitionReport {
    /// Partitions created, oldest first.
    pub created: Vec<String>,
    /// Partitions dropped, oldest first.
    pub dropped: Vec<String>,
    /// Partitions past retention that stay, oldest first.
    pub kept: Vec<KeptPartition>,
    /// Partitions that could not be created because the default partition holds rows in their
    /// range (maintenance was late); those rows stay in the default partition.
    pub blocked: Vec<String>,
    /// Keys-table rows removed for the dropped partitions.
    pub keys_removed: u64,
}

/// A dated partition: its name and range.
#[derive(Clone, Debug)]
struct Dated {
    name: String,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
}

/// The range a partition name of this outbox stands for, if it is one of ours.
fn parse_name(table: &str, name: &str) -> Option<Dated> {
    let digits = name.strip_prefix(table)?.strip_prefix("_p")?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (from, step) = match digits.len() {
        8 => (
            NaiveDate::parse_from_str(digits, "%Y%m%d")
                .ok()?
                .and_hms_opt(0, 0, 0)?,
            TimeDelta::days(1),
        ),
        10 => (
            NaiveDateTime::parse_from_str(&format!("{digits}0000"), "%Y%m%d%H%M%S").ok()?,
            TimeDelta::hours(1),
        ),
        _ => return None,
    };
    let from = from.and_utc();
    Some(Dated {
        name: name.to_owned(),
        from,
        to: from + step,
    })
}

fn sql_time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S+00").to_string()
}

fn lock_timeout_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// SQLSTATE of a lock wait that ran into `lock_timeout`.
fn is_lock_timeout(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

/// SQLSTATE 23514 (check violation): the default partition holds rows of the new range.
fn is_default_conflict(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("23514"))
}

pub(crate) async fn maintain(
    outbox: &PgOutbox,
    pool: &PgPool,
    now: DateTime<Utc>,
) -> Result<PartitionReport, StoreError> {
    let Some(config) = outbox.partitioning().cloned() else {
        return Err(StoreError::Invalid(format!(
            "outbox table {} is not partitioned: there are no partitions to maintain",
            outbox.qualified_table()
        )));
    };
    let mut report = PartitionReport::default();
    // One maintainer at a time per outbox (several relays may run it); session-level, so it is
    // held across the short transactions below.
    let mut conn = pool.acquire().await.map_err(map_sqlx)?;
    let key = outbox.lock_key("partitions");
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(key)
        .fetch_one(&mut *conn)
        .await
        .map_err(map_sqlx)?;
    if !got {
        return Ok(report);
    }
    let result = run(outbox, &config, &mut conn, now, &mut report).await;
    let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .execute(&mut *conn)
        .await;
    if unlocked.is_err() {
        // Never hand a connection holding the lock back to the pool.
        let _ = conn.detach();
    }
    result?;
    Ok(report)
}

async fn existing(
    outbox: &PgOutbox,
    conn: &mut sqlx::PgConnection,
) -> Result<Vec<Dated>, StoreError> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i
         JOIN pg_class c ON c.oid = i.inhrelid
         JOIN pg_class p ON p.oid = i.inhparent
         JOIN pg_namespace n ON n.oid = p.relnamespace
         WHERE n.nspname = $1 AND p.relname = $2",
    )
    .bind(outbox.schema())
    .bind(outbox.table())
    .fetch_all(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    let mut dated: Vec<Dated> = names
        .iter()
        .filter_map(|n| parse_name(outbox.table(), n))
        .collect();
    dated.sort_by_key(|d| d.from);
    Ok(dated)
}

async fn run(
    outbox: &PgOutbox,
    config: &Partitioning,
    conn: &mut sqlx::PgConnection,
    now: DateTime<Utc>,
    report: &mut PartitionReport,
) -> Result<(), StoreError> {
    let schema = outbox.schema();
    let parent = outbox.qualified_table();
    let timeout = lock_timeout_ms(config.lock_timeout);

    // Create: the current partition and `ahead` more, skipping ranges already covered.
    let have = existing(outbox, conn).await?;
    let first = config.interval.floor(now);
    for i in 0..=i64::from(config.ahead) {
        let from = first + config.interval.step() * i32::try_from(i).unwrap_or(i32::MAX);
        let to = from + config.interval.step();
        if have.iter().any(|d| d.from < to && from < d.to) {
            continue;
        }
        let name = format!("{}_p{}", outbox.table(), config.interval.suffix(from));
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS \"{schema}\".\"{name}\" PARTITION OF {parent}
             FOR VALUES FROM ('{}') TO ('{}')",
            sql_time(from),
            sql_time(to)
        );
        match in_lock_timeout(conn, timeout, &ddl).await {
            Ok(()) => report.created.push(name),
            Err(e) if is_default_conflict(&e) => report.blocked.push(name),
            Err(e) if is_lock_timeout(&e) => {
                tracing::warn!(
                    partition = %name,
                    "Could not create the outbox partition: the table lock was not granted in time; the next run retries."
                );
            }
            Err(e) => return Err(map_sqlx(e)),
        }
    }

    // Drop: partitions whose whole range and every delivery are past retention.
    let retention = TimeDelta::from_std(config.retention).unwrap_or(TimeDelta::MAX);
    let cutoff = now
        .checked_sub_signed(retention)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    for part in existing(outbox, conn).await? {
        if part.to > cutoff {
            continue;
        }
        let table = format!("\"{schema}\".\"{}\"", part.name);
        // Without the table lock: the full check, including the scan for recent deliveries.
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {table} WHERE status IN ('pending', 'in_flight')) AS undelivered,
                    EXISTS (SELECT 1 FROM {table} WHERE status = 'dead') AS dead,
                    EXISTS (SELECT 1 FROM {table} WHERE delivered_at >= $1) AS recent"
        )))
        .bind(cutoff)
        .fetch_one(&mut *conn)
        .await
        .map_err(map_sqlx)?;
        let flag = |name: &str| row.try_get::<bool, _>(name).map_err(map_sqlx);
        let reason = if flag("undelivered")? {
            Some(KeepReason::Undelivered)
        } else if flag("dead")? {
            Some(KeepReason::Dead)
        } else if flag("recent")? {
            Some(KeepReason::DeliveredWithinRetention)
        } else {
            None
        };
        if let Some(reason) = reason {
            report.kept.push(KeptPartition {
                name: part.name,
                reason,
            });
            continue;
        }
        match drop_partition(outbox, conn, &part, &table, timeout).await? {
            None => {
                report.dropped.push(part.name.clone());
                report.keys_removed += remove_keys(outbox, conn, &part).await?;
            }
            Some(reason) => report.kept.push(KeptPartition {
                name: part.name,
                reason,
            }),
        }
    }
    Ok(())
}

/// Run one DDL statement in its own transaction with a lock timeout.
async fn in_lock_timeout(
    conn: &mut sqlx::PgConnection,
    timeout_ms: i64,
    ddl: &str,
) -> Result<(), sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    sqlx::query(AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = '{timeout_ms}ms'"
    )))
    .execute(&mut *tx)
    .await?;
    sqlx::query(AssertSqlSafe(ddl)).execute(&mut *tx).await?;
    tx.commit().await
}

/// Lock the outbox table, check again with two index probes that nothing in the partition is
/// pending, in flight or dead (a replay may have moved a delivered event back since the full
/// check), and drop it. `None` when dropped.
async fn drop_partition(
    outbox: &PgOutbox,
    conn: &mut sqlx::PgConnection,
    part: &Dated,
    table: &str,
    timeout_ms: i64,
) -> Result<Option<KeepReason>, StoreError> {
    let attempt = async {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::query(AssertSqlSafe(format!(
            "SET LOCAL lock_timeout = '{timeout_ms}ms'"
        )))
        .execute(&mut *tx)
        .await?;
        // The parent first, like every query on the outbox does: no lock-order deadlock.
        sqlx::query(AssertSqlSafe(format!(
            "LOCK TABLE ONLY {} IN ACCESS EXCLUSIVE MODE",
            outbox.qualified_table()
        )))
        .execute(&mut *tx)
        .await?;
        let busy: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {table} WHERE status IN ('pending', 'in_flight'))
                 OR EXISTS (SELECT 1 FROM {table} WHERE status = 'dead')"
        )))
        .fetch_one(&mut *tx)
        .await?;
        if busy {
            tx.rollback().await?;
            return Ok(Some(KeepReason::Undelivered));
        }
        sqlx::query(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(None)
    };
    match attempt.await {
        Ok(outcome) => {
            if outcome.is_none() {
                tracing::info!(partition = %part.name, "Outbox partition dropped: every event delivered and past retention.");
            }
            Ok(outcome)
        }
        Err(e) if is_lock_timeout(&e) => Ok(Some(KeepReason::LockTimeout)),
        Err(e) => Err(map_sqlx(e)),
    }
}

/// Remove a dropped partition's rows from the keys table, in batches, by their `enqueued_at`
/// (the keys row carries its event's), so their ids and idempotency keys are free again as they
/// would be after a purge. Until this finishes, an enqueue with one of those keys still finds
/// it taken, as if the event were kept a moment longer.
async fn remove_keys(
    outbox: &PgOutbox,
    conn: &mut sqlx::PgConnection,
    part: &Dated,
) -> Result<u64, StoreError> {
    const BATCH: i64 = 10_000;
    let keys = outbox.keys_table();
    let mut removed = 0;
    loop {
        let done = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {keys} WHERE id IN (
                 SELECT id FROM {keys} WHERE enqueued_at >= $1 AND enqueued_at < $2 LIMIT $3)"
        )))
        .bind(part.from)
        .bind(part.to)
        .bind(BATCH)
        .execute(&mut *conn)
        .await
        .map_err(map_sqlx)?;
        removed += done.rows_affected();
        if done.rows_affected() < BATCH as u64 {
            return Ok(removed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_foreign_names_are_ignored() {
        let at = DateTime::parse_from_rfc3339("2025-03-09T17:42:00Z")
            .unwrap()
            .to_utc();
        let day = PartitionInterval::Daily.floor(at);
        assert_eq!(PartitionInterval::Daily.suffix(day), "20250309");
        let d = parse_name("events", "events_p20250309").unwrap();
        assert_eq!((d.from, d.to), (day, day + TimeDelta::days(1)));
        let hour = PartitionInterval::Hourly.floor(at);
        assert_eq!(PartitionInterval::Hourly.suffix(hour), "2025030917");
        let h = parse_name("events", "events_p2025030917").unwrap();
        assert_eq!((h.from, h.to), (hour, hour + TimeDelta::hours(1)));
        for foreign in [
            "events_default",
            "events_p2025",
            "events_p20251399",
            "other_p20250309",
            "events_p2025030x",
            "events_keys",
        ] {
            assert!(parse_name("events", foreign).is_none(), "{foreign}");
        }
    }
}
