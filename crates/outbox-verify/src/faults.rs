//! The fault schedule: which fault happens when, drawn from the run's seed.
//!
//! Why a schedule computed up front rather than faults drawn as the run goes: the schedule is
//! printed and stored in the report, and `--seed` reproduces it exactly (the same faults at the
//! same offsets with the same targets), so a failing run can be replayed. The interleaving with
//! real processes is not reproducible, which is the point of running them; the schedule is.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// One kind of fault, with its target and parameters.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// SIGKILL relay `relay`, keep it down `down_ms`, start a new process.
    KillRelay {
        /// Slot.
        relay: usize,
        /// Milliseconds down.
        down_ms: u64,
    },
    /// SIGSTOP relay `relay` while it holds claimed events, past its lease, then SIGCONT: its
    /// late writes must be fenced.
    PauseRelay {
        /// Slot.
        relay: usize,
    },
    /// `pg_terminate_backend` every relay connection.
    TerminateRelayConnections,
    /// `pg_terminate_backend` every writer connection (may leave ambiguous commits).
    TerminateWriterConnections,
    /// Cut the relays' link to the database for `ms`.
    CutRelayDatabase {
        /// Milliseconds.
        ms: u64,
    },
    /// Cut the writers' link to the database for `ms` (COMMITs in flight become ambiguous).
    CutWriterDatabase {
        /// Milliseconds.
        ms: u64,
    },
    /// Restart the database (owned cluster only): `immediate` is a crash (recovery on start).
    RestartDatabase {
        /// Crash instead of a clean shutdown.
        immediate: bool,
        /// Milliseconds down.
        down_ms: u64,
    },
    /// Cut the relays' link to a destination for `ms`.
    CutBroker {
        /// Destination.
        dest: String,
        /// Milliseconds.
        ms: u64,
    },
    /// Add `latency_ms` to every chunk between relays and a destination for `ms`.
    BrokerLatency {
        /// Destination.
        dest: String,
        /// Added delay per chunk.
        latency_ms: u64,
        /// Milliseconds.
        ms: u64,
    },
    /// Reset connections between relays and a destination at random for `ms`.
    BrokerDrops {
        /// Destination.
        dest: String,
        /// Probability per forwarded chunk.
        rate: f64,
        /// Milliseconds.
        ms: u64,
    },
    /// Stop the broker process, start it again after `down_ms`.
    RestartBroker {
        /// Destination.
        dest: String,
        /// Milliseconds down.
        down_ms: u64,
    },
    /// A long outage of one destination (its link cut for `ms`, once per run) while the others
    /// keep flowing: under the relays' default attempts it must cost time, not events (no event
    /// dead but the poison ones, order kept).
    Outage {
        /// Destination.
        dest: String,
        /// Milliseconds.
        ms: u64,
    },
    /// Commit an event the destination's sink always rejects.
    Poison {
        /// Destination.
        dest: String,
    },
}

impl Fault {
    /// The kind's name, for counting.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillRelay { .. } => "kill_relay",
            Fault::PauseRelay { .. } => "pause_relay",
            Fault::TerminateRelayConnections => "terminate_relay_connections",
            Fault::TerminateWriterConnections => "terminate_writer_connections",
            Fault::CutRelayDatabase { .. } => "cut_relay_database",
            Fault::CutWriterDatabase { .. } => "cut_writer_database",
            Fault::RestartDatabase { .. } => "restart_database",
            Fault::CutBroker { .. } => "cut_broker",
            Fault::BrokerLatency { .. } => "broker_latency",
            Fault::BrokerDrops { .. } => "broker_drops",
            Fault::RestartBroker { .. } => "restart_broker",
            Fault::Outage { .. } => "outage",
            Fault::Poison { .. } => "poison",
        }
    }
}

/// A fault at an offset from the start of the run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scheduled {
    /// Milliseconds after the writers started.
    pub at_ms: u64,
    /// What.
    pub fault: Fault,
}

/// What the run has, so only applicable faults are scheduled.
#[derive(Clone, Debug, Default)]
pub struct Capabilities {
    /// Relay processes.
    pub relays: usize,
    /// Whether the harness owns the database (it can restart it).
    pub owns_database: bool,
    /// Destinations with a proxy in front (link faults).
    pub proxied: Vec<String>,
    /// Destinations whose broker can be restarted.
    pub restartable: Vec<String>,
    /// Destinations with a poison payload.
    pub poisonable: Vec<String>,
    /// The relays' lease: pauses last past it.
    pub lease: Duration,
}

/// How many faults of each kind, and how long the fault phase lasts.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Intensity {
    /// Length of the fault phase.
    pub duration: Duration,
    /// Faults of each applicable kind (per target where the kind has one).
    pub per_kind: u32,
    /// One outage of this length of one proxied destination (zero: none).
    pub outage: Duration,
}

/// The schedule for `seed`.
pub fn schedule(seed: u64, caps: &Capabilities, intensity: Intensity) -> Vec<Scheduled> {
    let mut rng = StdRng::seed_from_u64(seed);
    let total_ms = u64::try_from(intensity.duration.as_millis()).unwrap_or(u64::MAX);
    // Leave the first seconds for the system to warm up and the last ones for faults to end
    // before the writers stop.
    let start = (total_ms / 20).clamp(1_000, 5_000);
    let end = total_ms.saturating_sub(total_ms / 8).max(start + 1);
    let mut out = Vec::new();
    let mut add = |rng: &mut StdRng, fault: Fault| {
        let at_ms = rng.random_range(start..end);
        out.push(Scheduled { at_ms, fault });
    };
    let n = intensity.per_kind;
    for _ in 0..n {
        if caps.relays > 0 {
            let relay = rng.random_range(0..caps.relays);
            let down_ms = rng.random_range(200..3_000);
            add(&mut rng, Fault::KillRelay { relay, down_ms });
            // A pause needs someone to re-claim: only with two relays or more.
            if caps.relays > 1 {
                let relay = rng.random_range(0..caps.relays);
                add(&mut rng, Fault::PauseRelay { relay });
            }
            add(&mut rng, Fault::TerminateRelayConnections);
            let ms = rng.random_range(500..4_000);
            add(&mut rng, Fault::CutRelayDatabase { ms });
        }
        add(&mut rng, Fault::TerminateWriterConnections);
        let ms = rng.random_range(300..2_000);
        add(&mut rng, Fault::CutWriterDatabase { ms });
        if caps.owns_database {
            let immediate = rng.random_bool(0.5);
            let down_ms = rng.random_range(200..2_000);
            add(&mut rng, Fault::RestartDatabase { immediate, down_ms });
        }
        for dest in &caps.proxied {
            let ms = rng.random_range(500..5_000);
            add(
                &mut rng,
                Fault::CutBroker {
                    dest: dest.clone(),
                    ms,
                },
            );
            let latency_ms = rng.random_range(20..1_500);
            let ms = rng.random_range(1_000..5_000);
            add(
                &mut rng,
                Fault::BrokerLatency {
                    dest: dest.clone(),
                    latency_ms,
                    ms,
                },
            );
            let rate = rng.random_range(0.01..0.3);
            let ms = rng.random_range(1_000..5_000);
            add(
                &mut rng,
                Fault::BrokerDrops {
                    dest: dest.clone(),
                    rate,
                    ms,
                },
            );
        }
        for dest in &caps.restartable {
            let down_ms = rng.random_range(500..4_000);
            add(
                &mut rng,
                Fault::RestartBroker {
                    dest: dest.clone(),
                    down_ms,
                },
            );
        }
        for dest in &caps.poisonable {
            add(&mut rng, Fault::Poison { dest: dest.clone() });
        }
    }
    let outage_ms = u64::try_from(intensity.outage.as_millis()).unwrap_or(u64::MAX);
    if outage_ms > 0 && !caps.proxied.is_empty() {
        // Early enough to end well before the writers stop, so the drain is timed too.
        let dest = caps.proxied[rng.random_range(0..caps.proxied.len())].clone();
        let at_ms = start.max(end.saturating_sub(outage_ms) / 3);
        out.push(Scheduled {
            at_ms,
            fault: Fault::Outage {
                dest,
                ms: outage_ms,
            },
        });
    }
    out.sort_by_key(|s| s.at_ms);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> Capabilities {
        Capabilities {
            relays: 2,
            owns_database: true,
            proxied: vec!["nats".into(), "webhook".into()],
            restartable: vec!["nats".into()],
            poisonable: vec!["webhook".into()],
            lease: Duration::from_secs(3),
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let i = Intensity {
            duration: Duration::from_secs(90),
            per_kind: 3,
            outage: Duration::from_secs(30),
        };
        assert_eq!(schedule(7, &caps(), i), schedule(7, &caps(), i));
        assert_ne!(schedule(7, &caps(), i), schedule(8, &caps(), i));
    }

    #[test]
    fn every_applicable_kind_appears_inside_the_window() {
        let i = Intensity {
            duration: Duration::from_secs(90),
            per_kind: 2,
            outage: Duration::from_secs(30),
        };
        let s = schedule(1, &caps(), i);
        let kinds: std::collections::BTreeSet<&str> = s.iter().map(|f| f.fault.kind()).collect();
        assert_eq!(kinds.len(), 13, "{kinds:?}");
        let outages: Vec<&Scheduled> = s.iter().filter(|f| f.fault.kind() == "outage").collect();
        assert_eq!(outages.len(), 1, "one outage per run");
        assert!(
            outages[0].at_ms + 30_000 < 90_000 - 90_000 / 8,
            "it ends before the fault phase does: {outages:?}"
        );
        assert!(s.iter().all(|f| f.at_ms >= 1_000 && f.at_ms < 90_000));
        assert!(s.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        // One relay: nothing could re-claim a paused relay's events.
        let one = Capabilities {
            relays: 1,
            ..caps()
        };
        assert!(
            !schedule(1, &one, i)
                .iter()
                .any(|f| f.fault.kind() == "pause_relay")
        );
    }
}
