//! Phase 2, write under faults: writers for the profile's duration while the schedule injects
//! faults, a supervisor restarts relays that died on their own and a sampler records the
//! timeline.
//!
//! Why its own module: this is the run's only timed phase; it starts the writers, the
//! background tasks and one task per scheduled fault, stops the writers when the time is up and
//! gives the faults under way a minute to end.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::inject::inject;
use super::{Ctx, Options, print_progress};
use crate::dest::ConsumerSide;
use crate::faults::Scheduled;
use crate::report::{FaultRecord, Sample};
use crate::writers;

/// The tasks that run from the first write to the final stop: the relays' supervisor and the
/// sampler.
pub(super) struct Background {
    pub(super) stop: watch::Sender<bool>,
    pub(super) supervisor: JoinHandle<()>,
    pub(super) sampler: JoinHandle<Vec<Sample>>,
}

/// What the writing phase leaves for the report: its length and the faults that ran.
pub(super) struct Written {
    pub(super) write_s: f64,
    pub(super) faults: Vec<FaultRecord>,
}

/// Write for `options.duration` under the scheduled faults; the background tasks keep running.
pub(super) async fn write_under_faults(
    ctx: &Arc<Ctx>,
    side: &Arc<ConsumerSide>,
    options: &Options,
    schedule: &[Scheduled],
) -> (Written, Background) {
    let (stop_writers, writers_stopped) = watch::channel(false);
    let writer_tasks: Vec<_> = (0..options.writers)
        .map(|w| {
            tokio::spawn(writers::run(
                w,
                ctx.writer_options.clone(),
                options.seed,
                ctx.log.clone(),
                writers_stopped.clone(),
            ))
        })
        .collect();
    let background = start_background(ctx, side, options.sample_every);
    let fault_tasks = spawn_faults(ctx, schedule);
    print_progress(&format!(
        "seed {}: {} writers, {} relays, destinations {}, {} faults over {} s (work dir {})",
        options.seed,
        options.writers,
        options.relays,
        options.destinations.join(","),
        schedule.len(),
        options.duration.as_secs(),
        options.work_dir.display()
    ));
    tokio::time::sleep(options.duration).await;
    let _ = stop_writers.send(true);
    for t in writer_tasks {
        let _ = t.await;
    }
    ctx.log.flush();
    let write_s = ctx.started.elapsed().as_secs_f64();
    print_progress(&format!(
        "writers stopped after {write_s:.0} s with {} transactions; waiting for faults to end",
        ctx.log.len()
    ));
    let faults = end_faults(ctx, fault_tasks).await;
    (Written { write_s, faults }, background)
}

/// The supervisor (`Restart=always` for the relays) and the sampler, until `stop`.
fn start_background(ctx: &Arc<Ctx>, side: &Arc<ConsumerSide>, every: Duration) -> Background {
    let (stop, background_stopped) = watch::channel(false);
    let supervisor = {
        let relays = ctx.relays.clone();
        let mut stopped = background_stopped.clone();
        tokio::spawn(async move {
            while !*stopped.borrow() {
                relays.supervise().await;
                tokio::select! {
                    _ = stopped.changed() => {}
                    _ = tokio::time::sleep(Duration::from_millis(300)) => {}
                }
            }
        })
    };
    let sampler = {
        let ctx = ctx.clone();
        let side = side.clone();
        let mut stopped = background_stopped.clone();
        tokio::spawn(async move {
            let mut timeline = Vec::new();
            while !*stopped.borrow() {
                timeline.push(super::drain::sample(&ctx, &side).await);
                tokio::select! {
                    _ = stopped.changed() => {}
                    _ = tokio::time::sleep(every) => {}
                }
            }
            timeline.push(super::drain::sample(&ctx, &side).await);
            timeline
        })
    };
    Background {
        stop,
        supervisor,
        sampler,
    }
}

/// One task per scheduled fault, each waiting for its moment.
fn spawn_faults(ctx: &Arc<Ctx>, schedule: &[Scheduled]) -> Vec<JoinHandle<Option<FaultRecord>>> {
    schedule
        .iter()
        .cloned()
        .map(|s| {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let at = Duration::from_millis(s.at_ms);
                tokio::time::sleep_until((ctx.started + at).into()).await;
                inject(&ctx, s).await
            })
        })
        .collect()
}

/// Faults still queued behind others (on the same target) are skipped now that the writers
/// stopped; the ones under way get a minute to end, then are cut short (healing undoes
/// whatever they left).
async fn end_faults(
    ctx: &Ctx,
    fault_tasks: Vec<JoinHandle<Option<FaultRecord>>>,
) -> Vec<FaultRecord> {
    ctx.writing_done.store(true, Ordering::SeqCst);
    let mut records = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for mut t in fault_tasks {
        match tokio::time::timeout_at(deadline, &mut t).await {
            Ok(Ok(Some(record))) => records.push(record),
            Ok(_) => {}
            Err(_) => t.abort(),
        }
    }
    records
}
