//! Phase 5, judge and report: the checker's verdict on the history, the faults by kind, the
//! latencies, the relays' exits and logs, in one [`RunReport`] written as JSON.
//!
//! Why its own module: the report is what a person (or CI) reads after a run; assembling it
//! from the phases' results is one job, apart from producing those results.

use std::collections::BTreeMap;

use super::Options;
use super::check::Stopped;
use super::writing::Written;
use crate::Error;
use crate::checker;
use crate::dest::ConsumerSide;
use crate::faults::Fault;
use crate::history::History;
use crate::relays::Relays;
use crate::report::{self, FaultRecord, RunReport};

/// How the drain went.
pub(super) struct Drained {
    pub(super) drained: bool,
    pub(super) drain_s: f64,
}

/// Everything the report is built from.
pub(super) struct Results<'a> {
    pub(super) options: &'a Options,
    pub(super) destinations_style: bool,
    pub(super) started_unix_ms: u64,
    pub(super) written: Written,
    pub(super) drained: Drained,
    pub(super) stopped: Stopped,
    pub(super) history: History,
    pub(super) relays: &'a Relays,
    pub(super) side: &'a ConsumerSide,
}

/// Judge the history, build the report and write it to `options.report_path`.
pub(super) async fn write(results: Results<'_>) -> Result<RunReport, Error> {
    let Results {
        options,
        destinations_style,
        started_unix_ms,
        written,
        drained,
        stopped,
        history,
        relays,
        side,
    } = results;
    let verdict = checker::check(&history);
    let faults_by_kind = faults_by_kind(&written.faults);
    let outage = written
        .faults
        .iter()
        .find_map(|f| match &f.scheduled.fault {
            Fault::Outage { dest, .. } if !f.failed => Some((
                dest.as_str(),
                started_unix_ms + (f.started_s * 1000.0) as u64,
                started_unix_ms + (f.ended_s * 1000.0) as u64,
            )),
            _ => None,
        });
    let latency = report::latencies(&history, outage);
    let report = RunReport {
        seed: options.seed,
        profile: options.profile.name().to_owned(),
        options: serde_json::to_value(options).unwrap_or_default(),
        destinations: options.destinations.clone(),
        destinations_config: destinations_style,
        write_s: written.write_s,
        drain_s: drained.drain_s,
        drained: drained.drained,
        faults_by_kind,
        faults: written.faults,
        lease_faults: history.lease_faults.clone(),
        relay_exits: relays.exits.lock().await.clone(),
        relay_stops: stopped.relay_stops,
        relay_logs: report::summarize_logs(&relays.log_files()),
        parked: side.parked(),
        timeline: stopped.timeline,
        verdict,
        latency,
        work_dir: options.work_dir.display().to_string(),
    };
    std::fs::write(
        &options.report_path,
        serde_json::to_vec_pretty(&report).unwrap_or_default(),
    )
    .map_err(Error::io(format!(
        "writing {}",
        options.report_path.display()
    )))?;
    Ok(report)
}

/// How many faults of each kind ran (failed ones not counted).
fn faults_by_kind(records: &[FaultRecord]) -> BTreeMap<String, u64> {
    let mut by_kind = BTreeMap::new();
    for f in records {
        if !f.failed {
            *by_kind
                .entry(f.scheduled.fault.kind().to_owned())
                .or_default() += 1;
        }
    }
    by_kind
}
