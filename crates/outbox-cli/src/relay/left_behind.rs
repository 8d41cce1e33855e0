//! What the relay says as it exits: what the outbox still holds against what it held when the
//! relay started.
//!
//! Why its own module: both modes end with the same accounting (dead letters gained during
//! the run, and after a drain what is still pending and why), read from the store, not from the
//! engine, so it counts what the engine did not see.

/// How both modes end, in `async fn run` after the engine returned its `report`: what the outbox
/// holds now, the exit line — the engine's counts, the dead letters counted from the store, then
/// the mode's own fields and its message (`fields`, as `tracing::info!` takes them) — and after a
/// drain what is left.
macro_rules! report_exit {
    ($started:expr, $report:expr, $($fields:tt)+) => {{
        let left = $crate::relay::left_behind::left_behind(
            $started.dyn_store.as_ref(),
            $started.at_start.as_ref(),
        )
        .await;
        tracing::info!(
            delivered = $report.delivered,
            retried = $report.retried,
            dead = left.dead_this_run.unwrap_or($report.dead),
            $($fields)+
        );
        left.report($started.config.relay.stop_when_idle);
    }};
}
pub(super) use report_exit;

/// What the outbox holds as a relay exits, against what it held at its start.
pub(super) struct LeftBehind {
    stats: Option<outbox_types::OutboxStats>,
    /// Dead events the outbox gained while the relay ran: every dead letter counts, also those
    /// written where the engine does not see them (a row the WAL stream could not read).
    pub(super) dead_this_run: Option<u64>,
}

pub(super) async fn left_behind(
    store: &dyn outbox_types::Store,
    at_start: Option<&outbox_types::OutboxStats>,
) -> LeftBehind {
    let stats = store.stats().await.ok();
    let dead_this_run = stats
        .as_ref()
        .zip(at_start)
        .map(|(now, start)| now.dead.saturating_sub(start.dead));
    LeftBehind {
        stats,
        dead_this_run,
    }
}

impl LeftBehind {
    /// After a drain, say what it leaves: events still pending or in flight, and why they may be.
    pub(super) fn report(&self, drained: bool) {
        let Some(stats) = self.stats.as_ref().filter(|_| drained) else {
            return;
        };
        if stats.pending + stats.in_flight == 0 {
            tracing::info!(dead = stats.dead, "Drained: nothing is pending.");
        } else {
            tracing::warn!(
                pending = stats.pending,
                waiting_for_retry = stats.retrying,
                in_flight = stats.in_flight,
                dead = stats.dead,
                "Drain finished with events still pending: retries due later than --drain-wait, events of paused destinations or held behind a dead event, or events another relay holds. `outbox status` shows them; run the drain again later, or raise --drain-wait."
            );
        }
    }
}
