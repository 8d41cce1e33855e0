//! What operators and the CLI ask of the outbox: counts per state and per destination, one
//! event, the dead events (list, requeue, discard), leases, paused destinations, replays of
//! delivered events and the schema check.

use crate::MySqlStore;
use crate::decode::Columns;
use crate::error::map_sqlx;
use crate::sql::json_text;
use chrono::{DateTime, Utc};
use outbox_types::route::RouteTable;
use outbox_types::sql_store::{id_list, outbox_stats, sorted_destination_stats};
use outbox_types::{DeadFilter, DestinationStats, EventId, OutboxStats, ReplayStep, StoreError};
use sqlx::{AssertSqlSafe, Row};

/// The longest paused destination name and "paused by" text.
const MAX_NAME_CHARS: usize = 255;

outbox_types::impl_sql_admin_reads! {
    store: MySqlStore,
    bind_id: EventId::to_string,
    pauser: pauser,
}

outbox_types::impl_sql_admin_writes! {
    store: MySqlStore,
    requeue_dead: |store, filter| {
        let sql = store.sql();
        on_dead(store, filter, &sql.requeue_dead_all, &sql.requeue_dead_ids).await
    },
    discard_dead: |store, filter| {
        let sql = store.sql();
        on_dead(store, filter, &sql.discard_dead_all, &sql.discard_dead_ids).await
    },
    replay_step: |store, filter, routes, after_seq, limit| {
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
    },
}

/// Where [`check`] says the schema is.
fn schema_place(store: &MySqlStore) -> String {
    format!("table {}", store.outbox.quoted_table())
}

pub(crate) async fn stats(store: &MySqlStore) -> Result<OutboxStats, StoreError> {
    let row = sqlx::query(AssertSqlSafe(store.sql().stats.as_str()))
        .fetch_one(&store.pool)
        .await
        .map_err(map_sqlx)?;
    let oldest: Option<DateTime<Utc>> = row.try_get("oldest").map_err(map_sqlx)?;
    let observed_at: DateTime<Utc> = row.try_get("observed_at").map_err(map_sqlx)?;
    outbox_stats(&Columns(&row), oldest, observed_at)
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
    sorted_destination_stats(rows.iter().map(Columns), |row| {
        let route: Vec<u8> = row.0.try_get("route").map_err(map_sqlx)?;
        String::from_utf8(route)
            .map_err(|e| StoreError::Database(format!("a routed destination is not UTF-8: {e}")))
    })
}

/// A destination to pause, 1 to [`MAX_NAME_CHARS`] characters; the "paused by" text cut to as
/// many.
fn pauser(destination: &str, by: &str) -> Result<String, StoreError> {
    if destination.is_empty() || destination.chars().count() > MAX_NAME_CHARS {
        return Err(StoreError::Invalid(format!(
            "the destination to pause must be 1 to {MAX_NAME_CHARS} characters long"
        )));
    }
    Ok(by.chars().take(MAX_NAME_CHARS).collect())
}
