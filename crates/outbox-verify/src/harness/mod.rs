//! One run of the harness: set up, write under faults, heal, drain, check, report.
//!
//! The phases, and why each exists:
//!
//! 1. **Setup** — a throwaway PostgreSQL cluster (or a given database), the outbox migrated,
//!    business tables, the consumer's inbox and effects tables in the machine's shared
//!    PostgreSQL (never faulted, so consumer failures cannot reorder what is observed), the
//!    destinations with a proxy in front of each broker, a proxy for the relays' and one for the
//!    writers' database links, and the relay processes.
//! 2. **Write under faults** — writers run for the profile's duration while the seeded schedule
//!    injects faults and a supervisor restarts relays that died on their own (recorded).
//! 3. **Heal** — every fault undone: links restored, brokers and database up, relays resumed
//!    and running.
//! 4. **Drain** — wait until the outbox has nothing pending or in flight and the consumers have
//!    received every delivered event, or the drain timeout.
//! 5. **Check** — relays stopped with SIGTERM (they must exit 0), the final state read, the
//!    checker run, the report written.

//!
//! One file per phase: [`options`] (what a run is asked to do), [`setup`], [`relay_config`] and
//! [`schedule`] (phase 1), [`writing`], [`inject`] and [`pause`] (phase 2), [`drain`] (phases 3
//! and 4), [`check`] and [`run_report`] (phase 5), [`teardown`]. This file holds what the phases
//! share ([`Ctx`]) and [`run`], which calls them in order.

mod check;
mod drain;
mod inject;
mod options;
mod pause;
mod relay_config;
mod run_report;
mod schedule;
mod setup;
mod teardown;
mod writing;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::{Duration, Instant};

use outbox_testkit::TcpProxy;
use sqlx::PgPool;
use tokio::sync::Mutex;

pub use options::{Options, Profile};

use crate::Error;
use crate::cluster::PgCluster;
use crate::dest::Destination;
use crate::history::LeaseFault;
use crate::relays::Relays;
use crate::report::RunReport;
use crate::writers::{WriterLog, WriterOptions};

/// Everything faults act on.
struct Ctx {
    relays: Arc<Relays>,
    relay_db: TcpProxy,
    writer_db: TcpProxy,
    cluster: Option<Arc<PgCluster>>,
    admin: PgPool,
    table: String,
    dests: Vec<Arc<dyn Destination>>,
    writer_options: Arc<WriterOptions>,
    log: Arc<WriterLog>,
    lease: Duration,
    lease_faults: Mutex<Vec<LeaseFault>>,
    /// Serializes faults per target (a link, the database, a broker) so one fault's end does
    /// not undo another's middle.
    locks: BTreeMap<String, Mutex<()>>,
    poison_numbers: AtomicU64,
    started: Instant,
    /// Set when the writers stopped: faults not yet begun are skipped.
    writing_done: AtomicBool,
}

/// Run the harness.
pub async fn run(options: Options) -> Result<RunReport, Error> {
    // 1. Setup.
    let (work, logs) = setup::work_dirs(&options)?;
    let (db, links) = setup::database(&options, &work).await?;
    let dests = setup::destinations(&options, &work).await?;
    let config_path = work.join("relay.toml");
    let destinations_style =
        relay_config::configure(&options, &db, &links, &dests, &config_path).await?;
    let writer_options = setup::writers(&options, &db, &links, &dests).await?;
    let mut consumers = setup::consumers(&options, &db.names, &dests).await?;
    let relays = setup::relays(&options, &config_path, &logs).await?;
    let log = Arc::new(WriterLog::new(&work.join("history.jsonl"))?);
    let schedule = schedule::schedule(
        &options,
        &dests,
        db.cluster.is_some(),
        destinations_style,
        &work,
    )?;
    let started_unix_ms = crate::history::unix_ms();
    let ctx = Arc::new(Ctx {
        relays,
        relay_db: links.relay_db,
        writer_db: links.writer_db,
        cluster: db.cluster.clone(),
        admin: db.admin.clone(),
        table: db.outbox.qualified_table().to_owned(),
        dests,
        writer_options,
        log,
        lease: options.lease,
        lease_faults: Mutex::new(Vec::new()),
        locks: schedule::locks(&schedule),
        poison_numbers: AtomicU64::new(0),
        started: Instant::now(),
        writing_done: AtomicBool::new(false),
    });

    // 2. Write under faults.
    let (written, background) =
        writing::write_under_faults(&ctx, &consumers.side, &options, &schedule).await;

    // 3. Heal; 4. drain.
    drain::heal(&ctx).await?;
    print_progress("healed; draining");
    let drain_started = Instant::now();
    let drained = drain::drain(&ctx, &consumers.side, options.drain_timeout).await;
    let drain_s = drain_started.elapsed().as_secs_f64();
    print_progress(&format!(
        "drain {} after {drain_s:.1} s; stopping relays",
        if drained { "complete" } else { "TIMED OUT" }
    ));

    // 5. Stop, collect, check, report.
    let stopped = check::stop(&ctx, background, &mut consumers).await;
    let history = check::history(&ctx, &consumers.side, &db.names, &work).await?;
    let report = run_report::write(run_report::Results {
        options: &options,
        destinations_style,
        started_unix_ms,
        written,
        drained: run_report::Drained { drained, drain_s },
        stopped,
        history,
        relays: &ctx.relays,
        side: &consumers.side,
    })
    .await?;
    teardown::teardown(ctx, db, consumers).await;
    Ok(report)
}

fn print_progress(message: &str) {
    eprintln!("outbox-verify: {message}");
}
