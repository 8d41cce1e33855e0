//! What operators and the CLI ask of the outbox: counts per state and per destination, one
//! event, the dead events (list, requeue, discard), leases, paused destinations, replays of
//! delivered events and the schema check.

use crate::SqliteStore;
use crate::decode::Columns;
use crate::error::map_sqlx;
use crate::sql::{destination_stats_sql, number_placeholders, replay_sql};
use crate::time::{Stamp, clamp_micros, now_micros};
use chrono::Utc;
use outbox_types::route::{RouteTable, SqlDialect};
use outbox_types::sql_store::{
    StoredRow, check_pause, id_list, outbox_stats, sorted_destination_stats,
};
use outbox_types::{DeadFilter, DestinationStats, EventId, OutboxStats, ReplayStep, StoreError};
use sqlx::{AssertSqlSafe, Row};

outbox_types::impl_sql_admin_reads! {
    store: SqliteStore,
    bind_id: EventId::to_string,
    pauser: check_pause,
    write_turn: SqliteStore::write_turn,
    now: now_micros,
}

outbox_types::impl_sql_admin_writes! {
    store: SqliteStore,
    requeue_dead: |store, filter| {
        let (all, ids) = (&store.sql().requeue_dead_all, &store.sql().requeue_dead_ids);
        on_dead(store, filter, all, ids, Stamp::Now).await
    },
    discard_dead: |store, filter| {
        let (all, ids) = (&store.sql().discard_dead_all, &store.sql().discard_dead_ids);
        on_dead(store, filter, all, ids, Stamp::None).await
    },
    replay_step: |store, filter, routes, after_seq, limit| {
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
    },
}

/// Where [`check`] says the schema is.
fn schema_place(store: &SqliteStore) -> String {
    format!("table {}", store.outbox.quoted_table())
}

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
    sorted_destination_stats(rows.iter().map(Columns), |row| row.text("route"))
}
