//! What operators and the CLI ask of the outbox: counts per state and per destination, one
//! event, the dead events (list, requeue, discard), leases, paused destinations, replays of
//! delivered events and the schema check.

use crate::PgStore;
use crate::decode::Columns;
use crate::error::map_sqlx;
use crate::sql::{destination_stats_sql, replay_sql};
use chrono::{DateTime, Utc};
use outbox_types::route::{RouteTable, SqlDialect};
use outbox_types::sql_store::{
    StoredRow, check_pause, count, outbox_stats, sorted_destination_stats,
};
use outbox_types::{DeadFilter, DestinationStats, EventId, OutboxStats, ReplayStep, StoreError};
use sqlx::{AssertSqlSafe, Row};
use uuid::Uuid;

outbox_types::impl_sql_admin_reads! {
    store: PgStore,
    bind_id: EventId::as_uuid,
    pauser: check_pause,
}

outbox_types::impl_sql_admin_writes! {
    store: PgStore,
    requeue_dead: |store, filter| {
        let done = sqlx::query(AssertSqlSafe(store.sql().requeue_dead.as_str()))
            .bind(dead_ids(filter))
            .execute(&store.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(done.rows_affected())
    },
    discard_dead: |store, filter| {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(store.sql().discard_dead.as_str()))
            .bind(dead_ids(filter))
            .fetch_one(&store.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(count(n))
    },
    replay_step: |store, filter, routes, after_seq, limit| {
        let route = filter
            .destination
            .as_ref()
            .map(|_| routes.sql_case(SqlDialect::Postgres { first_param: 7 }, Some("e")));
        let sql = replay_sql(
            store.outbox.qualified_table(),
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
        let row = query.fetch_one(&store.pool).await.map_err(map_sqlx)?;
        let scanned: i64 = row.try_get("scanned").map_err(map_sqlx)?;
        let last_seq: Option<i64> = row.try_get("last_seq").map_err(map_sqlx)?;
        let replayed: i64 = row.try_get("replayed").map_err(map_sqlx)?;
        Ok(ReplayStep {
            replayed: u64::try_from(replayed).unwrap_or(0),
            next_after: last_seq.filter(|_| scanned >= i64::from(limit)),
        })
    },
}

/// Where [`check`] says the schema is.
fn schema_place(store: &PgStore) -> &str {
    store.outbox.qualified_table()
}

pub(crate) async fn stats(store: &PgStore) -> Result<OutboxStats, StoreError> {
    let row = sqlx::query(AssertSqlSafe(store.sql().stats.as_str()))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    let oldest: Option<DateTime<Utc>> =
        sqlx::query_scalar(AssertSqlSafe(store.sql().oldest.as_str()))
            .fetch_optional(&store.pool)
            .await
            .map_err(map_sqlx)?;
    let observed_at = row.try_get("observed_at").map_err(map_sqlx)?;
    outbox_stats(&Columns(&row), oldest, observed_at)
}

pub(crate) async fn destination_stats(
    store: &PgStore,
    routes: &RouteTable,
) -> Result<Vec<DestinationStats>, StoreError> {
    let route = routes.sql_case(SqlDialect::Postgres { first_param: 1 }, Some("e"));
    let sql = destination_stats_sql(store.outbox.qualified_table(), &route.sql);
    let mut query = sqlx::query(AssertSqlSafe(sql));
    for value in &route.binds {
        query = query.bind(value);
    }
    let rows = query.fetch_all(&store.pool).await.map_err(map_sqlx)?;
    sorted_destination_stats(rows.iter().map(Columns), |row| row.text("route"))
}

fn dead_ids(filter: &DeadFilter) -> Option<Vec<Uuid>> {
    match filter {
        DeadFilter::All => None,
        DeadFilter::Ids(ids) => Some(ids.iter().map(|id| *id.as_uuid()).collect()),
    }
}
