//! What operators and the CLI ask of the outbox: counts per state and per destination, one
//! event, the dead events (list, requeue, discard), leases, paused destinations, replays of
//! delivered events and the schema check.

use crate::SqliteStore;
use crate::decode::{Columns, decode_record};
use crate::error::map_sqlx;
use crate::sql::{destination_stats_sql, number_placeholders, replay_sql};
use crate::time::{Stamp, clamp_micros, now_micros};
use chrono::Utc;
use outbox_types::migration::{Schema, check_current};
use outbox_types::route::{RouteTable, SqlDialect};
use outbox_types::sql_store::{
    StoredRow, check_destination, destination_stats as destination_stats_of, id_list, lease_holder,
    outbox_stats, paused_destination, sort_destinations,
};
use outbox_types::{
    DeadFilter, DestinationStats, EventId, EventRecord, LeaseHolder, OutboxStats,
    PausedDestination, ReplayFilter, ReplayStep, StoreError,
};
use sqlx::{AssertSqlSafe, Row};

pub(crate) async fn stats(store: &SqliteStore) -> Result<OutboxStats, StoreError> {
    let observed_at = Utc::now();
    let row = sqlx::query(AssertSqlSafe(store.sql().stats.as_str()))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    let row = Columns(&row);
    let oldest = row.opt_time(0, "oldest")?;
    outbox_stats(&row, oldest, observed_at)
}

pub(crate) async fn get(
    store: &SqliteStore,
    id: EventId,
) -> Result<Option<EventRecord>, StoreError> {
    let row = sqlx::query(AssertSqlSafe(store.sql().get.as_str()))
        .bind(id.to_string())
        .fetch_optional(&store.pool)
        .await
        .map_err(map_sqlx)?;
    row.as_ref().map(decode_record).transpose()
}

pub(crate) async fn list_dead(
    store: &SqliteStore,
    after_seq: Option<i64>,
    limit: u32,
) -> Result<Vec<EventRecord>, StoreError> {
    let rows = sqlx::query(AssertSqlSafe(store.sql().list_dead.as_str()))
        .bind(after_seq.unwrap_or(0))
        .bind(i64::from(limit))
        .fetch_all(&store.pool)
        .await
        .map_err(map_sqlx)?;
    rows.iter().map(decode_record).collect()
}

pub(crate) async fn requeue_dead(
    store: &SqliteStore,
    filter: &DeadFilter,
) -> Result<u64, StoreError> {
    let (all, ids) = (&store.sql().requeue_dead_all, &store.sql().requeue_dead_ids);
    on_dead(store, filter, all, ids, Stamp::Now).await
}

pub(crate) async fn discard_dead(
    store: &SqliteStore,
    filter: &DeadFilter,
) -> Result<u64, StoreError> {
    let (all, ids) = (&store.sql().discard_dead_all, &store.sql().discard_dead_ids);
    on_dead(store, filter, all, ids, Stamp::None).await
}

/// Runs `all` or, for a list of ids, `ids` over their JSON array, under the write turn, with
/// the current time as the last parameter when `stamp` says so; the rows it changed.
async fn on_dead(
    store: &SqliteStore,
    filter: &DeadFilter,
    all: &str,
    ids: &str,
    stamp: Stamp,
) -> Result<u64, StoreError> {
    let (statement, list) = match filter {
        DeadFilter::All => (all, None),
        DeadFilter::Ids(list) => (ids, Some(id_list(list)?)),
    };
    let _turn = store.writes.lock().await;
    let mut query = sqlx::query(AssertSqlSafe(statement));
    if let Some(list) = list {
        query = query.bind(list);
    }
    if stamp == Stamp::Now {
        query = query.bind(now_micros());
    }
    let done = query.execute(&store.pool).await.map_err(map_sqlx)?;
    Ok(done.rows_affected())
}

pub(crate) async fn destination_stats(
    store: &SqliteStore,
    routes: &RouteTable,
) -> Result<Vec<DestinationStats>, StoreError> {
    let route = routes.sql_case(SqlDialect::Sqlite, Some("e"));
    let sql = destination_stats_sql(
        store.outbox.quoted_table(),
        &number_placeholders(&route.sql, 1),
    );
    let mut query = sqlx::query(AssertSqlSafe(sql));
    for value in &route.binds {
        query = query.bind(value.as_str());
    }
    let rows = query.fetch_all(&store.pool).await.map_err(map_sqlx)?;
    let out = rows
        .iter()
        .map(|row| {
            let row = Columns(row);
            let route = row.text("route")?;
            destination_stats_of(&row, route)
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(sort_destinations(out))
}

pub(crate) async fn leases(store: &SqliteStore) -> Result<Vec<LeaseHolder>, StoreError> {
    let rows = sqlx::query(AssertSqlSafe(store.sql().leases.as_str()))
        .bind(now_micros())
        .fetch_all(&store.pool)
        .await
        .map_err(map_sqlx)?;
    rows.iter().map(|row| lease_holder(&Columns(row))).collect()
}

pub(crate) async fn pause(
    store: &SqliteStore,
    destination: &str,
    by: &str,
) -> Result<bool, StoreError> {
    check_destination(destination)?;
    let _turn = store.writes.lock().await;
    let done = sqlx::query(AssertSqlSafe(store.sql().pause.as_str()))
        .bind(destination)
        .bind(now_micros())
        .bind(by)
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected() == 1)
}

pub(crate) async fn resume(store: &SqliteStore, destination: &str) -> Result<bool, StoreError> {
    let _turn = store.writes.lock().await;
    let done = sqlx::query(AssertSqlSafe(store.sql().resume.as_str()))
        .bind(destination)
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected() > 0)
}

pub(crate) async fn paused(store: &SqliteStore) -> Result<Vec<PausedDestination>, StoreError> {
    let rows = sqlx::query(AssertSqlSafe(store.sql().paused.as_str()))
        .fetch_all(&store.pool)
        .await
        .map_err(map_sqlx)?;
    rows.iter()
        .map(|row| paused_destination(&Columns(row)))
        .collect()
}

pub(crate) async fn replay(
    store: &SqliteStore,
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
        .map(|_| routes.sql_case(SqlDialect::Sqlite, Some("e")));
    let sql = replay_sql(
        store.outbox.quoted_table(),
        route
            .as_ref()
            .map(|r| number_placeholders(&r.sql, 8))
            .as_deref(),
    );
    let _turn = store.writes.lock().await;
    let mut query = sqlx::query(AssertSqlSafe(sql))
        .bind(after_seq.unwrap_or(0))
        .bind(clamp_micros(filter.from.timestamp_micros()))
        .bind(clamp_micros(filter.to.timestamp_micros()))
        .bind(filter.event_type.as_deref())
        .bind(i64::from(limit))
        .bind(now_micros());
    if let (Some(destination), Some(route)) = (&filter.destination, &route) {
        query = query.bind(destination.as_str());
        for value in &route.binds {
            query = query.bind(value.as_str());
        }
    }
    let rows = query.fetch_all(&store.pool).await.map_err(map_sqlx)?;
    let mut last = None;
    for row in &rows {
        let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
        last = last.max(Some(seq));
    }
    Ok(ReplayStep {
        replayed: rows.len() as u64,
        next_after: last.filter(|_| rows.len() >= limit as usize),
    })
}

pub(crate) async fn check(store: &SqliteStore) -> Result<(), StoreError> {
    let (current, latest) = store.outbox.schema_version(&store.pool).await?;
    let place = format!("table {}", store.outbox.quoted_table());
    check_current(Schema::OUTBOX, &place, current, latest)
}
