//! Phases 3 and 4, heal and drain: every fault undone, then wait until the outbox has nothing
//! pending or in flight and the consumers have received every delivered event. Also the
//! timeline's sample, which reads the same counts.
//!
//! Why its own module: healing and draining decide whether what the checker sees is the end
//! state; the drain's patience rules (a slow consumer is not a lost event) live here.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use outbox_types::EventId;
use sqlx::AssertSqlSafe;

use super::{Ctx, print_progress};
use crate::Error;
use crate::dest::ConsumerSide;
use crate::relays::Relays;
use crate::report::Sample;

/// Links restored, database and brokers up, relays resumed and running.
pub(super) async fn heal(ctx: &Ctx) -> Result<(), Error> {
    ctx.relay_db.heal();
    ctx.writer_db.heal();
    if let Some(c) = &ctx.cluster
        && !c.is_up().await
    {
        c.start().await?;
    }
    for d in &ctx.dests {
        if let Some(p) = d.proxy() {
            p.heal();
        }
        d.start_broker().await?;
    }
    ctx.relays.heal().await
}

pub(super) async fn sample(ctx: &Ctx, side: &ConsumerSide) -> Sample {
    let row: Option<(i64, Option<f64>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT count(*), extract(epoch FROM now() - min(enqueued_at))::float8 FROM {} WHERE status IN ('pending', 'in_flight')",
        ctx.table
    )))
    .fetch_one(&ctx.admin)
    .await
    .ok();
    let mut rss = Vec::new();
    for slot in &ctx.relays.slots {
        rss.push(match slot.try_lock() {
            Ok(slot) => Relays::rss_kib(&slot),
            Err(_) => None,
        });
    }
    Sample {
        t_s: ctx.started.elapsed().as_secs_f64(),
        backlog: row.map(|r| r.0),
        oldest_s: row.and_then(|r| r.1),
        txns: ctx.log.len() as u64,
        received: side.received() as u64,
        relay_rss_kib: rss,
    }
}

/// Wait until nothing is pending or in flight and every delivered event was received. Past
/// `timeout`, keep waiting while the consumers still make progress (a slow consumer is not a
/// lost event), up to three times `timeout`.
pub(super) async fn drain(ctx: &Ctx, side: &ConsumerSide, timeout: Duration) -> bool {
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut progress = (0usize, Instant::now());
    loop {
        let counts: Result<(i64, i64), _> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE status IN ('pending', 'in_flight')), count(*) FILTER (WHERE status = 'delivered') FROM {}",
            ctx.table
        )))
        .fetch_one(&ctx.admin)
        .await;
        let received = side.received();
        if received > progress.0 {
            progress = (received, Instant::now());
        }
        if let Ok((open, delivered)) = counts {
            let distinct: HashSet<EventId> = side
                .observed()
                .into_iter()
                .filter_map(|o| o.event_id)
                .collect();
            if open == 0 && distinct.len() as i64 >= delivered {
                return true;
            }
            if last_report.elapsed() > Duration::from_secs(10) {
                print_progress(&format!(
                    "draining: {open} pending or in flight, {delivered} delivered, {} received",
                    distinct.len()
                ));
                last_report = Instant::now();
            }
        }
        let elapsed = started.elapsed();
        let stalled = progress.1.elapsed() > Duration::from_secs(10);
        if elapsed > timeout * 3 || (elapsed > timeout && stalled) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
