//! The claim: the advisory lock that serializes claims across relays, then one statement that
//! finds, locks and leases the due events (see [`crate::sql`] for its design), sorted by the
//! core's [`ClaimSort`] into deliverable and buried rows.

use crate::PgStore;
use crate::decode::decode_event;
use crate::error::map_sqlx;
use crate::sql::{CLAIM_SETUP, HoldSql, claim_sql};
use outbox_types::route::SqlDialect;
use outbox_types::sql_store::{bytes, millis};
use outbox_types::{
    AggregateKey, Claim, ClaimRequest, ClaimSort, DeadLetterPolicy, Lease, StoreError,
};
use sqlx::{AssertSqlSafe, Row};
use uuid::Uuid;

pub(crate) async fn claim(store: &PgStore, request: &ClaimRequest) -> Result<Claim, StoreError> {
    let token = Uuid::now_v7();
    let mut tx = store.pool.begin().await.map_err(map_sqlx)?;
    sqlx::query(CLAIM_SETUP)
        .bind(store.outbox.lock_key("claim"))
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx)?;
    let hold = request
        .hold
        .as_deref()
        .filter(|h| !h.paused.is_empty() || !h.deferred.is_empty());
    let held_sql;
    let (sql, route_binds, held) = match hold {
        None => (store.sql().claim.as_str(), Vec::new(), None),
        Some(hold) => {
            let dialect = SqlDialect::Postgres { first_param: 12 };
            let route_e = hold.routes.sql_case(dialect, Some("e"));
            let route_b = hold.routes.sql_case(dialect, Some("b"));
            let route_d =
                (!hold.deferred.is_empty()).then(|| hold.routes.sql_case(dialect, Some("d")).sql);
            held_sql = claim_sql(
                store.outbox.qualified_table(),
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
        .bind(request.up_to_seq.unwrap_or(i64::MAX))
        .bind(bytes(request.max_metadata_bytes));
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
        let payload_bytes: Option<i64> = row.try_get("payload_bytes").map_err(map_sqlx)?;
        let metadata_bytes: Option<i64> = row.try_get("metadata_bytes").map_err(map_sqlx)?;
        // NULL when the statement left out a key over the metadata limit.
        let aggregate = || {
            Ok(AggregateKey::from_columns(
                row.try_get("aggregate_type").map_err(map_sqlx)?,
                row.try_get("aggregate_id").map_err(map_sqlx)?,
            ))
        };
        outbox_types::sort_claimed_row!(
            sort,
            seq,
            payload_bytes,
            metadata_bytes,
            aggregate,
            || decode_event(row)
        );
    }
    let lease = Lease {
        owner: request.owner.clone(),
        token,
    };
    sort.finish().into_claim(store, lease).await
}
