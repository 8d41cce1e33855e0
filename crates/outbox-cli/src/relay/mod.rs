//! `outbox relay`: the daemon's life from the signal handlers to its last log line.
//!
//! Why a module of its own: `main.rs` dispatches arguments; the relay's supervision — stop
//! signals taken over first, the start raced against them, the side tasks it spawns and aborts,
//! the run in either mode and what it reports as it exits — is one job, one file per step:
//!
//! - [`shutdown`]: SIGTERM and SIGINT, listened for before anything else;
//! - [`flags`]: the relay's flags over its configuration;
//! - [`start`]: store, sinks, metrics and the retention task, up to "Relaying.";
//! - [`retention`]: the retention task;
//! - [`poll`] and [`wal`]: the engine over the outbox table or the replication stream;
//! - [`left_behind`]: what the outbox still holds as the relay exits.

mod flags;
mod left_behind;
mod poll;
mod retention;
mod shutdown;
mod start;
mod wal;

pub(crate) use shutdown::shutdown_signal;

use crate::RelayArgs;
use crate::config;
use shutdown::Shutdown;

/// Run `outbox relay` until a stop signal (or, with `--drain`, until nothing is due).
pub(crate) async fn run(args: RelayArgs) -> anyhow::Result<()> {
    // The very first thing: from here on SIGTERM and SIGINT are a clean stop, also while the
    // relay is still loading its configuration or connecting (a service manager, or the verify
    // harness, may stop a relay it has just started).
    let mut shutdown = Shutdown::install();
    let started = tokio::select! {
        started = start::start(&args) => started?,
        () = shutdown.signalled() => {
            tracing::info!("Shutdown requested before the relay started: nothing to finish.");
            return Ok(());
        }
    };
    if started.config.mode == config::Mode::Wal {
        wal::run(started, shutdown).await
    } else {
        poll::run(started, shutdown).await
    }
}
