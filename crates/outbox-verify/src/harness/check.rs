//! Phase 5, stop and collect: the background tasks and relays stopped (SIGTERM, they must exit
//! 0), the consumers stopped, and the final state read into the [`History`] the checker judges.
//!
//! Why its own module: what the checker sees is decided here — the outbox rows, the business
//! rows, what the consumers observed and applied, what the brokers still hold, and the lease
//! faults settled from the relays' whole logs.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use outbox_types::EventId;
use sqlx::AssertSqlSafe;

use super::Ctx;
use super::setup::{Consumers, Names};
use super::writing::Background;
use crate::Error;
use crate::dest::ConsumerSide;
use crate::history::{History, LateWrites, LeaseFault, OutboxRow};
use crate::relays;
use crate::report::Sample;

/// What stopping leaves for the report.
pub(super) struct Stopped {
    /// Each relay's exit status at the final SIGTERM (`None`: it had to be killed).
    pub(super) relay_stops: Vec<(String, Option<String>)>,
    pub(super) timeline: Vec<Sample>,
}

/// Stop the supervisor, the relays (SIGTERM, 20 s grace), the sampler and the consumers.
pub(super) async fn stop(ctx: &Ctx, background: Background, consumers: &mut Consumers) -> Stopped {
    let _ = background.stop.send(true);
    let _ = background.supervisor.await;
    let relay_stops = ctx.relays.stop_all(Duration::from_secs(20)).await;
    let timeline = background.sampler.await.unwrap_or_default();
    // Let consumers finish what is in flight to them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = consumers.stop.send(true);
    for t in consumers.tasks.drain(..) {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    Stopped {
        relay_stops,
        timeline,
    }
}

/// The final state, with what the brokers hold, saved to `work/history.json`.
pub(super) async fn history(
    ctx: &Arc<Ctx>,
    side: &ConsumerSide,
    names: &Names,
    work: &Path,
) -> Result<History, Error> {
    let mut history = collect(ctx, side, names).await?;
    for d in &ctx.dests {
        if let Some(read_back) = d.held_by_broker().await {
            history
                .broker_held
                .insert(d.name().to_owned(), read_back.held);
            history
                .broker_dropped
                .insert(d.name().to_owned(), read_back.dropped_after_ack);
        }
    }
    std::fs::write(
        work.join("history.json"),
        serde_json::to_vec(&history).unwrap_or_default(),
    )
    .map_err(Error::io("writing the history"))?;
    Ok(history)
}

/// Read the final state.
async fn collect(ctx: &Ctx, side: &ConsumerSide, names: &Names) -> Result<History, Error> {
    let rows: Vec<(uuid::Uuid, String, i32, Option<String>)> = sqlx::query_as(AssertSqlSafe(
        format!("SELECT id, status, attempts, last_error FROM {}", ctx.table),
    ))
    .fetch_all(&ctx.admin)
    .await?;
    let outbox = rows
        .into_iter()
        .map(|(id, status, attempts, last_error)| {
            (
                EventId::from_uuid(id),
                OutboxRow {
                    status,
                    attempts,
                    last_error,
                },
            )
        })
        .collect();
    let business: Vec<(uuid::Uuid,)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT txn FROM {}.business",
        names.business_schema
    )))
    .fetch_all(&ctx.admin)
    .await?;
    Ok(History {
        txns: ctx.log.txns(),
        observed: side.observed(),
        outbox,
        effects: side.effects().await?,
        business_rows: business.into_iter().map(|(t,)| t).collect(),
        lease_faults: ctx
            .lease_faults
            .lock()
            .await
            .iter()
            .cloned()
            .map(settle_late_writes)
            .collect(),
        broker_held: HashMap::new(),
        broker_dropped: HashMap::new(),
    })
}

/// Settle a lease fault that had not shown a fenced write by the time the fault ended, from the
/// resumed process's whole log (every relay process has stopped by now): a fenced marker later
/// on means fenced; a log that ends without "Relay stopped." means the process was killed before
/// it wrote that batch back; a normal stop without any fenced write is a violation.
fn settle_late_writes(mut fault: LeaseFault) -> LeaseFault {
    if fault.late_writes != LateWrites::Pending || fault.reclaimed == 0 {
        return fault;
    }
    let Some((log, offset)) = &fault.log else {
        return fault;
    };
    let (before, text) = relays::log_split(Path::new(log), *offset);
    let stopped = text.find(relays::STOPPED_MARKER);
    // The first thing the resumed relay said about its claim was that it failed.
    let claim_failed_first = text
        .find(relays::CLAIM_FAILED_MARKER)
        .is_some_and(|at| stopped.is_none_or(|stop| at < stop));
    fault.late_writes = if relays::FENCED_MARKERS.iter().any(|m| text.contains(m)) {
        LateWrites::Fenced
    } else if gave_up_every_lease(&before, &fault.leases) {
        LateWrites::GivenUpBeforePause
    } else if fault.leases.len() == 1 && claim_failed_first {
        LateWrites::ClaimLost
    } else if stopped.is_some() {
        LateWrites::Unfenced
    } else {
        LateWrites::NeverWritten
    };
    fault
}

/// Whether the log before the pause says the relay gave up the last write-back of the batch of
/// every one of `leases` (the give-up line names its lease in the JSON field `lease` and says
/// `"last_write":true`; the harness runs relays with `--log-format json`): it then had nothing
/// left to write under them. A lease without such a line keeps the fault open.
fn gave_up_every_lease(before: &str, leases: &[String]) -> bool {
    !leases.is_empty()
        && leases.iter().all(|lease| {
            let field = format!("\"lease\":\"{lease}\"");
            before.lines().any(|line| {
                line.contains(relays::GIVEN_UP_MARKER)
                    && line.contains(&field)
                    && line.contains("\"last_write\":true")
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paused relay's fault, holding events of `leases`, settled from its log: `before_pause`
    /// up to the pause, `after_resume` from the moment it was resumed.
    fn settled(before_pause: &str, after_resume: &str, leases: &[&str]) -> LateWrites {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("relay.log");
        let before = format!("INFO Claimed 40 events\n{before_pause}");
        std::fs::write(&log, format!("{before}{after_resume}")).expect("log written");
        settle_late_writes(LeaseFault {
            relay: "relay-1".into(),
            held: 40,
            reclaimed: 40,
            late_writes: LateWrites::Pending,
            log: Some((log.display().to_string(), before.len() as u64)),
            leases: leases.iter().map(|l| (*l).to_owned()).collect(),
        })
        .late_writes
    }

    #[test]
    fn a_late_write_is_settled_from_the_resumed_relays_log() {
        let claim_failed =
            "WARN Claim failed; the database may be down. Events stay in the outbox.\n";
        let fenced = "WARN Lease expired before the write; another relay owns these events.\n";
        let stopped = "INFO Relay stopped.\n";
        // What the engine logs when it gives up a write-back: `last` when it was the batch's last.
        let given_up = |lease: &str, last: bool| {
            format!(
                "{{\"level\":\"WARN\",\"message\":\"Could not record the batch before its lease ran out; its events will be claimed and published again.\",\"lease\":\"{lease}\",\"last_write\":{last},\"operations\":\"ack,release\"}}\n"
            )
        };
        let gave_up = |lease: &str| given_up(lease, true);
        for (before, after, leases, expected) in [
            (
                String::new(),
                format!("{fenced}{stopped}"),
                &["a"][..],
                LateWrites::Fenced,
            ),
            (
                String::new(),
                format!("{claim_failed}{fenced}{stopped}"),
                &["a"],
                LateWrites::Fenced,
            ),
            // Given up after it was resumed: its last write was tried then.
            (
                String::new(),
                format!("{}{stopped}", gave_up("a")),
                &["a"],
                LateWrites::Fenced,
            ),
            // The claim it was frozen in never got its answer: it never had the events.
            (
                String::new(),
                format!("{claim_failed}{stopped}"),
                &["a"],
                LateWrites::ClaimLost,
            ),
            // Two claims held: the failed one may be the other; a missing fence stays a violation.
            (
                String::new(),
                format!("{claim_failed}{stopped}"),
                &["a", "b"],
                LateWrites::Unfenced,
            ),
            // It stopped normally before any claim failed, and never fenced: a violation.
            (
                String::new(),
                format!("{stopped}{claim_failed}"),
                &["a"],
                LateWrites::Unfenced,
            ),
            (
                String::new(),
                String::new(),
                &["a"],
                LateWrites::NeverWritten,
            ),
            // Every batch it held was given up before the pause: nothing was left to write.
            (
                format!("{}{}", gave_up("a"), gave_up("b")),
                stopped.to_owned(),
                &["a", "b"],
                LateWrites::GivenUpBeforePause,
            ),
            // Only what was settled so far was given up: the rest of the batch may still be
            // written back after the pause, so the fault stays open.
            (
                given_up("a", false),
                stopped.to_owned(),
                &["a"],
                LateWrites::Unfenced,
            ),
            // One of them given up, the other not heard of: a violation.
            (
                gave_up("a"),
                stopped.to_owned(),
                &["a", "b"],
                LateWrites::Unfenced,
            ),
            // A give-up line that names no lease settles nothing.
            (
                "WARN Could not record the batch before its lease ran out\n".to_owned(),
                stopped.to_owned(),
                &["a"],
                LateWrites::Unfenced,
            ),
        ] {
            assert_eq!(
                settled(&before, &after, leases),
                expected,
                "{before:?} then {after:?} with leases {leases:?}"
            );
        }
    }
}
