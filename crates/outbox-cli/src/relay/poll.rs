//! The relay over the outbox table: claims, leases, acks.
//!
//! Why its own module: the default mode's run and its exit line, beside [`super::wal`]'s.

use super::left_behind::report_exit;
use super::shutdown::Shutdown;
use super::start::Started;

/// Run the engine over the store until `shutdown`, then say what it did and what is left.
pub(super) async fn run(mut started: Started, shutdown: Shutdown) -> anyhow::Result<()> {
    let report = started
        .run_engine(started.dyn_store.clone(), shutdown)
        .await;
    report_exit!(
        started,
        report,
        released = report.released,
        fenced = report.fenced,
        "Relay exited."
    );
    Ok(())
}
