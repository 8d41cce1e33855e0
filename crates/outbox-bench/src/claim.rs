//! `claim-latency`: how long a claim takes, and how fast a serial drain goes, as the delivered
//! rows kept for retention grow.

use super::*;

/// Claim + ack one batch at a time until nothing is pending: (claim ms per batch, claim+ack ms
/// per batch, events/s).
pub(crate) async fn claim_drain(
    store: &PgStore,
    batch_size: u32,
) -> anyhow::Result<(Vec<f64>, Vec<f64>, f64)> {
    let request = outbox_types::ClaimRequest::new(
        "bench",
        batch_size,
        Duration::from_secs(30),
        DeadLetterPolicy::Block,
    );
    let mut claim_ms = Vec::new();
    let mut cycle_ms = Vec::new();
    let started = Instant::now();
    let mut drained = 0u64;
    loop {
        let t0 = Instant::now();
        let claim = store.claim(&request).await?;
        let t1 = Instant::now();
        if claim.events.is_empty() {
            break;
        }
        let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
        store.ack(&claim.lease, &seqs).await?;
        claim_ms.push((t1 - t0).as_secs_f64() * 1000.0);
        cycle_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
        drained += seqs.len() as u64;
    }
    Ok((
        claim_ms,
        cycle_ms,
        drained as f64 / started.elapsed().as_secs_f64(),
    ))
}

pub(crate) fn p99(xs: &[f64]) -> f64 {
    let mut sorted = xs.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    sorted
        .get(((sorted.len() as f64) * 0.99) as usize)
        .copied()
        .unwrap_or(0.0)
}

pub(crate) async fn claim_latency(
    url: &str,
    json_out: Option<&std::path::Path>,
    args: ClaimArgs,
) -> anyhow::Result<()> {
    let schema = schema_name("claim");
    let mut rows = Vec::new();
    println!(
        "claim-latency: {} pending events of 400 B over 1000 aggregates claimed and acked {} at a time, one after the other, on top of a delivered history of {:?} rows",
        args.pending, args.batch_size, args.delivered
    );
    for &delivered in &args.delivered {
        let row = in_fresh_schema(url, &schema, async |store| {
            let t = store.outbox().qualified_table().to_owned();
            // History: delivered rows, written directly (this measures the claim, not the writer).
            let history_started = Instant::now();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, status, delivered_at)
                 SELECT gen_random_uuid(), 'order', (g % 1000)::text, 'OrderUpdated',
                        json_build_object('n', g, 'pad', repeat('x', 380)), 'delivered', now()
                 FROM generate_series(1, $1) AS g"
            )))
            .bind(delivered as i64)
            .execute(store.pool())
            .await?;
            fill(store, args.pending, 1000, 400).await?;
            crate::execute(store, format!("VACUUM ANALYZE {t}")).await?;
            let size: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT pg_size_pretty(pg_total_relation_size('{t}'))"
            )))
            .fetch_one(store.pool())
            .await?;
            let (claim_ms, cycle_ms, rate) = claim_drain(store, args.batch_size).await?;
            println!(
                "delivered history {:>9} ({size}, written in {:.0} s): claim of {} median {:.2} ms, p99 {:.2} ms; claim+ack cycle median {:.2} ms; serial drain {:.0} events/s",
                delivered,
                history_started.elapsed().as_secs_f64(),
                args.batch_size,
                median(claim_ms.clone()),
                p99(&claim_ms),
                median(cycle_ms.clone()),
                rate
            );
            let mut row = serde_json::json!({
                "delivered_rows": delivered, "table_size": size,
                "claim_ms_median": median(claim_ms.clone()), "claim_ms_p99": p99(&claim_ms),
                "cycle_ms_median": median(cycle_ms), "serial_drain_events_per_second": rate,
            });

            if args.held_snapshot_rounds > 0 {
                // A transaction that took its snapshot and stays open: nothing newer than it can be
                // vacuumed, so every claim and ack below leaves dead versions in the indexes.
                let mut holder = store.pool().acquire().await?;
                sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
                    .execute(&mut *holder)
                    .await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*) FROM {t} WHERE false"
                )))
                .execute(&mut *holder)
                .await?;
                let mut last = (Vec::new(), Vec::new(), 0.0);
                for _ in 0..args.held_snapshot_rounds {
                    fill(store, args.pending, 1000, 400).await?;
                    last = claim_drain(store, args.batch_size).await?;
                }
                // Each event leaves two versions behind that the snapshot pins: the claim's and the
                // ack's (the statistics collector reports them too late to read here).
                let dead = u64::from(args.held_snapshot_rounds) * args.pending * 2;
                sqlx::query("ROLLBACK").execute(&mut *holder).await?;
                let (held_claim, held_cycle, held_rate) = last;
                let slowdown = median(held_claim.clone()) / median(claim_ms).max(1e-9);
                println!(
                    "  with a transaction held open over {} rounds of {} events ({dead} dead row versions it pins): last round's claim median {:.2} ms ({slowdown:.2}x), p99 {:.2} ms; cycle {:.2} ms; serial drain {:.0} events/s",
                    args.held_snapshot_rounds,
                    args.pending,
                    median(held_claim.clone()),
                    p99(&held_claim),
                    median(held_cycle.clone()),
                    held_rate
                );
                row["held_snapshot"] = serde_json::json!({
                    "rounds": args.held_snapshot_rounds, "dead_tuples": dead,
                    "claim_ms_median": median(held_claim.clone()), "claim_ms_p99": p99(&held_claim),
                    "cycle_ms_median": median(held_cycle), "serial_drain_events_per_second": held_rate,
                    "slowdown": slowdown,
                });
            }
                Ok(row)
        })
        .await?;
        rows.push(row);
    }
    if rows.len() >= 2 {
        let first = rows[0]["claim_ms_median"].as_f64().unwrap_or(0.0);
        let last = rows[rows.len() - 1]["claim_ms_median"]
            .as_f64()
            .unwrap_or(0.0);
        let first_rate = rows[0]["serial_drain_events_per_second"]
            .as_f64()
            .unwrap_or(0.0);
        let last_rate = rows[rows.len() - 1]["serial_drain_events_per_second"]
            .as_f64()
            .unwrap_or(0.0);
        if first > 0.0 && last_rate > 0.0 {
            println!(
                "slowdown from the smallest to the largest history: median claim {:.2}x, drain rate {:.2}x (target ≤ 1.25x)",
                last / first,
                first_rate / last_rate
            );
        }
    }
    record(
        json_out,
        serde_json::json!({"scenario": "claim-latency", "pending": args.pending, "batch_size": args.batch_size, "rows": rows}),
    )
}
