//! The relay over the outbox table: claims, leases, acks.
//!
//! Why its own module: the default mode's run and its exit line, beside [`super::wal`]'s.

use super::left_behind::left_behind;
use super::shutdown::Shutdown;
use super::start::Started;

/// Run the engine over the store until `shutdown`, then say what it did and what is left.
pub(super) async fn run(mut started: Started, shutdown: Shutdown) -> anyhow::Result<()> {
    let report = started
        .run_engine(started.dyn_store.clone(), shutdown)
        .await;
    let left = left_behind(started.dyn_store.as_ref(), started.at_start.as_ref()).await;
    tracing::info!(
        delivered = report.delivered,
        retried = report.retried,
        dead = left.dead_this_run.unwrap_or(report.dead),
        released = report.released,
        fenced = report.fenced,
        "Relay exited."
    );
    left.report(started.config.relay.stop_when_idle);
    Ok(())
}
