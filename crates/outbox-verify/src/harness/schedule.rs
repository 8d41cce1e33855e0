//! Phase 1, setup: the run's fault schedule, from what this run can do.
//!
//! Why its own module: which faults apply depends on the setup (relays, an owned database,
//! proxied, restartable and poisonable destinations); the schedule itself is
//! [`crate::faults::schedule`], seeded, and written to `schedule.json` for the record.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tokio::sync::Mutex;

use super::Options;
use super::inject::target_of;
use crate::Error;
use crate::dest::{Destination, UNROUTED};
use crate::faults::{self, Capabilities, Intensity, Scheduled};

/// The faults this run injects, in order, saved to `work/schedule.json`.
pub(super) fn schedule(
    options: &Options,
    dests: &[Arc<dyn Destination>],
    owns_database: bool,
    destinations_style: bool,
    work: &Path,
) -> Result<Vec<Scheduled>, Error> {
    let names = |keep: &dyn Fn(&Arc<dyn Destination>) -> bool| {
        dests
            .iter()
            .filter(|d| keep(d))
            .map(|d| d.name().to_owned())
            .collect()
    };
    let mut caps = Capabilities {
        relays: options.relays,
        owns_database,
        proxied: names(&|d| d.proxy().is_some()),
        restartable: names(&|d| d.can_restart()),
        poisonable: names(&|d| d.poison(serde_json::json!({})).is_some()),
        lease: options.lease,
    };
    if destinations_style {
        caps.poisonable.push(UNROUTED.to_owned());
    }
    let mut schedule = faults::schedule(
        options.seed,
        &caps,
        Intensity {
            duration: options.duration,
            per_kind: options.faults_per_kind,
            outage: options.outage,
        },
    );
    if !options.only_faults.is_empty() {
        schedule.retain(|s| options.only_faults.iter().any(|k| k == s.fault.kind()));
    }
    std::fs::write(
        work.join("schedule.json"),
        serde_json::to_vec_pretty(&schedule).unwrap_or_default(),
    )
    .map_err(Error::io("writing the schedule"))?;
    Ok(schedule)
}

/// One lock per target the schedule acts on (see [`target_of`]).
pub(super) fn locks(schedule: &[Scheduled]) -> BTreeMap<String, Mutex<()>> {
    let mut locks = BTreeMap::new();
    for s in schedule {
        locks
            .entry(target_of(&s.fault))
            .or_insert_with(|| Mutex::new(()));
    }
    locks
}
