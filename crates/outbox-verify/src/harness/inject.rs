//! Phase 2, faults: inject one scheduled fault and undo it.
//!
//! Why its own module: each fault kind is a small action on a relay, a link, the database or a
//! broker; [`inject`] serializes faults per target (so one fault's end does not undo another's
//! middle) and records what happened. The lease-clock fault, which has more to watch, is in
//! [`super::pause`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox_testkit::TcpProxy;

use super::Ctx;
use super::pause::pause_relay;
use crate::Error;
use crate::dest::{Destination, UNROUTED};
use crate::faults::{Fault, Scheduled};
use crate::relays::Relays;
use crate::report::FaultRecord;
use crate::writers;

/// What a fault holds while it acts: faults with the same target take turns.
pub(super) fn target_of(fault: &Fault) -> String {
    match fault {
        Fault::KillRelay { relay, .. } => format!("relay{relay}"),
        // One pause at a time: a pause proves fencing only if another relay is running to
        // re-claim the paused one's events.
        Fault::PauseRelay { .. } => "pause".into(),
        Fault::CutRelayDatabase { .. } => "relay_db".into(),
        Fault::CutWriterDatabase { .. } => "writer_db".into(),
        Fault::RestartDatabase { .. } => "database".into(),
        Fault::CutBroker { dest, .. }
        | Fault::Outage { dest, .. }
        | Fault::BrokerLatency { dest, .. }
        | Fault::BrokerDrops { dest, .. } => format!("link:{dest}"),
        Fault::RestartBroker { dest, .. } => format!("broker:{dest}"),
        Fault::TerminateRelayConnections
        | Fault::TerminateWriterConnections
        | Fault::Poison { .. } => "none".into(),
    }
}

/// Inject one fault and undo it; `None` when it was skipped because the writers had stopped
/// before its turn came.
pub(super) async fn inject(ctx: &Ctx, scheduled: Scheduled) -> Option<FaultRecord> {
    let target = target_of(&scheduled.fault);
    let _guard = match ctx.locks.get(&target) {
        Some(lock) if target != "none" => Some(lock.lock().await),
        _ => None,
    };
    if ctx.writing_done.load(Ordering::SeqCst) {
        return None;
    }
    let started_s = ctx.started.elapsed().as_secs_f64();
    let result = act(ctx, &scheduled.fault).await;
    let (note, failed) = match result {
        Ok(note) => (note, false),
        Err(error) => (error.to_string(), true),
    };
    Some(FaultRecord {
        scheduled,
        started_s,
        ended_s: ctx.started.elapsed().as_secs_f64(),
        note,
        failed,
    })
}

async fn act(ctx: &Ctx, fault: &Fault) -> Result<String, Error> {
    match fault {
        Fault::KillRelay { relay, down_ms } => kill_relay(ctx, *relay, *down_ms).await,
        Fault::PauseRelay { relay } => pause_relay(ctx, *relay).await,
        Fault::TerminateRelayConnections => terminate(ctx, "outbox_verify_relay").await,
        Fault::TerminateWriterConnections => terminate(ctx, "outbox_verify_writer").await,
        Fault::CutRelayDatabase { ms } => cut(&ctx.relay_db, *ms).await,
        Fault::CutWriterDatabase { ms } => cut(&ctx.writer_db, *ms).await,
        Fault::RestartDatabase { immediate, down_ms } => {
            let Some(cluster) = &ctx.cluster else {
                return Err(Error::Invalid(
                    "the harness does not own the database".into(),
                ));
            };
            cluster
                .restart(*immediate, Duration::from_millis(*down_ms))
                .await?;
            Ok(String::new())
        }
        Fault::CutBroker { dest: name, ms } | Fault::Outage { dest: name, ms } => {
            cut(proxy(ctx, name)?, *ms).await
        }
        Fault::BrokerLatency {
            dest: name,
            latency_ms,
            ms,
        } => {
            let proxy = proxy(ctx, name)?;
            proxy.set_latency(Duration::from_millis(*latency_ms));
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            proxy.set_latency(Duration::ZERO);
            Ok(String::new())
        }
        Fault::BrokerDrops {
            dest: name,
            rate,
            ms,
        } => {
            let proxy = proxy(ctx, name)?;
            proxy.set_drop_rate(*rate);
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            proxy.set_drop_rate(0.0);
            Ok(String::new())
        }
        Fault::RestartBroker {
            dest: name,
            down_ms,
        } => {
            let d = dest(ctx, name)?;
            d.stop_broker().await?;
            tokio::time::sleep(Duration::from_millis(*down_ms)).await;
            d.start_broker().await?;
            Ok(String::new())
        }
        Fault::Poison { dest: name } => poison(ctx, name).await,
    }
}

/// SIGKILL the relay in `relay`, keep it down `down_ms`, start a new one.
async fn kill_relay(ctx: &Ctx, relay: usize, down_ms: u64) -> Result<String, Error> {
    let mut slot = ctx.relays.slots[relay].lock().await;
    let id = slot.relay_id.clone();
    slot.held_down = true;
    Relays::kill(&mut slot).await?;
    tokio::time::sleep(Duration::from_millis(down_ms)).await;
    ctx.relays.spawn(&mut slot)?;
    slot.held_down = false;
    Ok(format!("killed {id}, started {}", slot.relay_id))
}

/// Cut a link for `ms`.
async fn cut(proxy: &TcpProxy, ms: u64) -> Result<String, Error> {
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(ms)).await;
    proxy.restore();
    Ok(String::new())
}

/// Write a poison event for `name` (a destination, or [`UNROUTED`]).
async fn poison(ctx: &Ctx, name: &str) -> Result<String, Error> {
    let d = if name == UNROUTED {
        None
    } else {
        Some(dest(ctx, name)?.clone())
    };
    let shape = |p: serde_json::Value| match &d {
        Some(d) => d.poison(p),
        None => Some(p),
    };
    let n = ctx.poison_numbers.fetch_add(1, Ordering::SeqCst);
    let mut last = None;
    // The writers' link may be cut right now: try for a while.
    for _ in 0..50 {
        match writers::write_poison(&ctx.writer_options, name, n, shape, &ctx.log).await {
            Ok(()) => return Ok(format!("poison-{n}")),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(last.unwrap_or_else(|| Error::Timeout("writing a poison event".into())))
}

fn dest<'a>(ctx: &'a Ctx, name: &str) -> Result<&'a Arc<dyn Destination>, Error> {
    ctx.dests
        .iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| Error::Invalid(format!("no destination {name}")))
}

/// The proxy in front of destination `name`'s broker.
fn proxy<'a>(ctx: &'a Ctx, name: &str) -> Result<&'a TcpProxy, Error> {
    dest(ctx, name)?
        .proxy()
        .ok_or_else(|| Error::Invalid(format!("{name} has no proxy")))
}

async fn terminate(ctx: &Ctx, app: &str) -> Result<String, Error> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(app)
    .fetch_one(&ctx.admin)
    .await?;
    Ok(format!("terminated {n} connections"))
}
