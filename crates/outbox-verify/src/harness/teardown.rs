//! The last step: brokers shut down, the run's schemas dropped, the throwaway cluster stopped.
//!
//! Why its own module: a run against a shared database must leave it as it found it; a run
//! with its own cluster drops the whole cluster instead.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

use super::Ctx;
use super::setup::{Consumers, Database};

/// Release everything the run started (best effort: the report is already written).
pub(super) async fn teardown(ctx: Arc<Ctx>, db: Database, consumers: Consumers) {
    for d in &ctx.dests {
        d.shutdown().await;
    }
    let names = &db.names;
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        names.consumer_schema
    )))
    .execute(&consumers.pool)
    .await;
    if db.cluster.is_none() {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE; DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            names.outbox_schema, names.business_schema
        )))
        .execute(&db.admin)
        .await;
    }
    db.admin.close().await;
    drop(ctx);
    drop(db);
}
