//! The claim: one `BEGIN IMMEDIATE` transaction (SQLite has one writer at a time, which is
//! what serializes claims across relays) that finds, locks and leases the due events, sorted by
//! the core's [`ClaimSort`] into deliverable and buried rows.

use crate::SqliteStore;
use crate::decode::{decode_event, opt_text_as};
use crate::error::map_sqlx;
use crate::sql::{HoldSql, claim_sql, number_placeholders};
use crate::time::{after, now_micros};
use outbox_types::route::SqlDialect;
use outbox_types::sql_store::{bytes, json_text};
use outbox_types::{
    AggregateKey, Claim, ClaimRequest, ClaimSort, DeadLetterPolicy, Lease, Reading, StoreError,
};
use sqlx::{AssertSqlSafe, Row};
use uuid::Uuid;

pub(crate) async fn claim(
    store: &SqliteStore,
    request: &ClaimRequest,
) -> Result<Claim, StoreError> {
    let token = Uuid::now_v7();
    // Only the paused destinations: a deferred one (the relay's fair turn, see `Hold`) is
    // claimed as usual here. Skipping it would need, per candidate, a look at the earlier
    // open rows of its aggregate, and SQLite has no index over those (writers would pay
    // for one on every insert); an embedded outbox rarely has several busy destinations.
    let hold = request.hold.as_deref().filter(|h| !h.paused.is_empty());
    let (sql, held) = match hold {
        None => (std::borrow::Cow::Borrowed(&store.sql().claim), None),
        Some(hold) => {
            let route_e = hold.routes.sql_case(SqlDialect::Sqlite, Some("e"));
            let route_b = hold.routes.sql_case(SqlDialect::Sqlite, Some("b"));
            let sql = claim_sql(
                store.outbox.quoted_table(),
                Some(&HoldSql {
                    route_e: number_placeholders(&route_e.sql, 11),
                    route_b: number_placeholders(&route_b.sql, 11),
                }),
            );
            let paused = json_text(&hold.paused)?;
            (std::borrow::Cow::Owned(sql), Some((paused, route_e.binds)))
        }
    };
    let rows = {
        let _turn = store.writes.lock().await;
        let now = now_micros();
        let mut query = sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(i64::from(request.limit))
            .bind(&request.owner)
            .bind(token.to_string())
            .bind(after(now, request.lease))
            .bind(now)
            .bind(request.dead_letter == DeadLetterPolicy::Block)
            .bind(bytes(request.max_batch_bytes))
            .bind(bytes(request.max_payload_bytes))
            .bind(bytes(request.max_metadata_bytes));
        if let Some((paused, binds)) = &held {
            query = query.bind(paused.as_str());
            for value in binds {
                query = query.bind(value.as_str());
            }
        }
        query.fetch_all(&store.pool).await.map_err(map_sqlx)?
    };
    let mut sort = ClaimSort::new(request);
    for row in &rows {
        let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
        let payload_bytes: Option<i64> = row.try_get("payload_bytes").map_err(map_sqlx)?;
        let metadata_bytes: Option<i64> = row.try_get("metadata_bytes").map_err(map_sqlx)?;
        // Read as an operator would see it: the row may be buried for bytes that are not
        // UTF-8 in exactly these columns. NULL when the statement left out a key over the
        // metadata limit.
        let aggregate = || {
            Ok(AggregateKey::from_columns(
                opt_text_as(row, "aggregate_type", Reading::Display)?,
                opt_text_as(row, "aggregate_id", Reading::Display)?,
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
