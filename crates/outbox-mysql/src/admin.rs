//! What operators and the CLI ask of the outbox: counts per state and per destination, one
//! event, the dead events (list, requeue, discard), leases, paused destinations, replays of
//! delivered events and the schema check.

use crate::MySqlStore;
use crate::decode::{Columns, decode_record};
use crate::error::map_sqlx;
use crate::sql::json_text;
use chrono::{DateTime, Utc};
use outbox_types::migration::{Schema, check_current};
use outbox_types::route::RouteTable;
use outbox_types::sql_store::{
    destination_stats as destination_stats_of, id_list, lease_holder, outbox_stats,
    paused_destination, sort_destinations,
};
use outbox_types::{
    DeadFilter, DestinationStats, EventId, EventRecord, LeaseHolder, OutboxStats,
    PausedDestination, ReplayFilter, ReplayStep, StoreError,
};
use sqlx::{AssertSqlSafe, Row};

/// The longest paused destination name and "paused by" text.
const MAX_NAME_CHARS: usize = 255;

pub(crate) async fn stats(store: &MySqlStore) -> Result<OutboxStats, StoreError> {
    let row = sqlx::query(AssertSqlSafe(store.sql().stats.as_str()))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    let oldest: Option<DateTime<Utc>> = row.try_get("oldest").map_err(map_sqlx)?;
    let observed_at: DateTime<Utc> = row.try_get("observed_at").map_err(map_sqlx)?;
    outbox_stats(&Columns(&row), oldest, observed_at)
}

pub(crate) async fn get(
    store: &MySqlStore,
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
    store: &MySqlStore,
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
    store: &MySqlStore,
    filter: &DeadFilter,
) -> Result<u64, StoreError> {
    let sql = store.sql();
    on_dead(store, filter, &sql.requeue_dead_all, &sql.requeue_dead_ids).await
}

pub(crate) async fn discard_dead(
    store: &MySqlStore,
    filter: &DeadFilter,
) -> Result<u64, StoreError> {
    let sql = store.sql();
    on_dead(store, filter, &sql.discard_dead_all, &sql.discard_dead_ids).await
}

/// Runs `all` or, for a list of ids, `ids` over their JSON array (an empty list changes
/// nothing and runs nothing); the rows it changed.
async fn on_dead(
    store: &MySqlStore,
    filter: &DeadFilter,
    all: &str,
    ids: &str,
) -> Result<u64, StoreError> {
    let done = match filter {
        DeadFilter::All => sqlx::query(AssertSqlSafe(all)).execute(&store.pool).await,
        DeadFilter::Ids(list) if list.is_empty() => return Ok(0),
        DeadFilter::Ids(list) => {
            sqlx::query(AssertSqlSafe(ids))
                .bind(id_list(list)?)
                .execute(&store.pool)
                .await
        }
    }
    .map_err(map_sqlx)?;
    Ok(done.rows_affected())
}

pub(crate) async fn destination_stats(
    store: &MySqlStore,
    routes: &RouteTable,
) -> Result<Vec<DestinationStats>, StoreError> {
    let built = store.sql().destination_stats(routes);
    let rows = built
        .query()
        .fetch_all(&store.pool)
        .await
        .map_err(map_sqlx)?;
    let out = rows
        .iter()
        .map(|row| {
            let route: Vec<u8> = row.try_get("route").map_err(map_sqlx)?;
            let route = String::from_utf8(route).map_err(|e| {
                StoreError::Database(format!("a routed destination is not UTF-8: {e}"))
            })?;
            destination_stats_of(&Columns(row), route)
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(sort_destinations(out))
}

pub(crate) async fn leases(store: &MySqlStore) -> Result<Vec<LeaseHolder>, StoreError> {
    let rows = sqlx::query(AssertSqlSafe(store.sql().leases.as_str()))
        .fetch_all(&store.pool)
        .await
        .map_err(map_sqlx)?;
    rows.iter().map(|row| lease_holder(&Columns(row))).collect()
}

pub(crate) async fn pause(
    store: &MySqlStore,
    destination: &str,
    by: &str,
) -> Result<bool, StoreError> {
    if destination.is_empty() || destination.chars().count() > MAX_NAME_CHARS {
        return Err(StoreError::Invalid(format!(
            "the destination to pause must be 1 to {MAX_NAME_CHARS} characters long"
        )));
    }
    let by: String = by.chars().take(MAX_NAME_CHARS).collect();
    let done = sqlx::query(AssertSqlSafe(store.sql().pause.as_str()))
        .bind(destination)
        .bind(by)
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected() == 1)
}

pub(crate) async fn resume(store: &MySqlStore, destination: &str) -> Result<bool, StoreError> {
    let done = sqlx::query(AssertSqlSafe(store.sql().resume.as_str()))
        .bind(destination)
        .execute(&store.pool)
        .await
        .map_err(map_sqlx)?;
    Ok(done.rows_affected() > 0)
}

pub(crate) async fn paused(store: &MySqlStore) -> Result<Vec<PausedDestination>, StoreError> {
    let rows = sqlx::query(AssertSqlSafe(store.sql().paused.as_str()))
        .fetch_all(&store.pool)
        .await
        .map_err(map_sqlx)?;
    rows.iter()
        .map(|row| paused_destination(&Columns(row)))
        .collect()
}

pub(crate) async fn replay(
    store: &MySqlStore,
    filter: &ReplayFilter,
    routes: &RouteTable,
    after_seq: Option<i64>,
    limit: u32,
) -> Result<ReplayStep, StoreError> {
    if limit == 0 {
        return Ok(ReplayStep::default());
    }
    let page = store
        .sql()
        .replay_page(filter, routes, after_seq.unwrap_or(0), i64::from(limit));
    let seqs: Vec<i64> = page
        .query()
        .fetch_all(&store.pool)
        .await
        .map_err(map_sqlx)?
        .iter()
        .map(|row| row.try_get("seq").map_err(map_sqlx))
        .collect::<Result<_, _>>()?;
    if seqs.is_empty() {
        return Ok(ReplayStep::default());
    }
    let done = sqlx::query(AssertSqlSafe(store.sql().replay_update.as_str()))
        .bind(json_text(&seqs)?)
        .execute(&store.pool)
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

pub(crate) async fn check(store: &MySqlStore) -> Result<(), StoreError> {
    let (current, latest) = store.outbox.schema_version(&store.pool).await?;
    let place = format!("table {}", store.outbox.quoted_table());
    check_current(Schema::OUTBOX, &place, current, latest)
}
