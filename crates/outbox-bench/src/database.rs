//! The bench's own schemas on the benchmarked PostgreSQL: each run gets a fresh outbox in a
//! schema named after the scenario and this process, fills it, reads the server's settings for
//! the report, and drops the schema when done.

use std::time::Instant;

use outbox_postgresql::{PgOutbox, PgStore};
use outbox_types::NewEvent;

pub(crate) fn schema_name(tag: &str) -> String {
    format!("outbox_bench_{tag}_{}", std::process::id())
}

/// A store on an empty outbox in `schema` (what a previous, interrupted run left there is dropped).
async fn fresh(url: &str, schema: &str) -> anyhow::Result<PgStore> {
    let store = PgStore::connect(url, PgOutbox::with_names(schema, "events")?).await?;
    drop_schema(&store).await?;
    store.outbox().migrate(store.pool()).await?;
    Ok(store)
}

/// Runs `body` on a [`fresh`] store in `schema`, then drops the schema, also when `body` failed
/// (its error is the one returned then).
pub(crate) async fn in_fresh_schema<T>(
    url: &str,
    schema: &str,
    body: impl AsyncFnOnce(&PgStore) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let store = fresh(url, schema).await?;
    let result = body(&store).await;
    let dropped = drop_schema(&store).await;
    let value = result?;
    dropped?;
    Ok(value)
}

/// Run one statement of the bench's own making (DDL, `TRUNCATE`, `VACUUM`) on the store's pool.
pub(crate) async fn execute(store: &PgStore, sql: String) -> anyhow::Result<()> {
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(store.pool())
        .await?;
    Ok(())
}

async fn drop_schema(store: &PgStore) -> anyhow::Result<()> {
    execute(
        store,
        format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            store.outbox().schema()
        ),
    )
    .await?;
    Ok(())
}

pub(crate) fn payload(bytes: usize, aggregate: u64, n: u64) -> serde_json::Value {
    let head = format!("{{\"aggregate\":{aggregate},\"n\":{n},\"pad\":\"\"}}");
    let pad = bytes.saturating_sub(head.len());
    serde_json::json!({ "aggregate": aggregate, "n": n, "pad": "x".repeat(pad) })
}

pub(crate) async fn fill(
    store: &PgStore,
    events: u64,
    aggregates: u64,
    payload_bytes: usize,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut batch = Vec::with_capacity(5000);
    for i in 0..events {
        let aggregate = i % aggregates;
        batch.push(NewEvent::new(
            "order",
            aggregate.to_string(),
            "OrderUpdated",
            &payload(payload_bytes, aggregate, i / aggregates),
        )?);
        if batch.len() == 5000 || i + 1 == events {
            let mut tx = store.pool().begin().await?;
            store.outbox().enqueue_batch(&mut *tx, &batch).await?;
            tx.commit().await?;
            batch.clear();
        }
    }
    Ok(started.elapsed().as_secs_f64())
}

pub(crate) async fn server_settings(store: &PgStore) -> anyhow::Result<String> {
    let mut parts = Vec::new();
    for name in [
        "server_version",
        "synchronous_commit",
        "shared_buffers",
        "fsync",
        // Off on the shared development server: dead row versions then go only through
        // on-access pruning and killed index entries, which slows claims on long runs.
        "autovacuum",
        "max_wal_size",
    ] {
        let v: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {name}")))
            .fetch_one(store.pool())
            .await?;
        parts.push(format!("{name}={v}"));
    }
    Ok(parts.join(" "))
}
