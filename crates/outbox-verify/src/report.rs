//! The run's report: a JSON file with everything, and a one-screen summary.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::checker::{Finding, Verdict};
use crate::faults::Scheduled;
use crate::history::{History, LateWrites, LeaseFault, TxnOutcome};
use crate::relays::UnexpectedExit;

/// One sample of the system's state while it runs.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    /// Seconds since the writers started.
    pub t_s: f64,
    /// Undelivered events (pending + in flight); `None` when the database did not answer.
    pub backlog: Option<i64>,
    /// Age of the oldest undelivered event, seconds.
    pub oldest_s: Option<f64>,
    /// Transactions the writers finished.
    pub txns: u64,
    /// Messages the consumers received.
    pub received: u64,
    /// Resident memory of each relay process, KiB (`None`: not running).
    pub relay_rss_kib: Vec<Option<u64>>,
}

/// What one fault did.
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecord {
    /// The scheduled fault.
    #[serde(flatten)]
    pub scheduled: Scheduled,
    /// When it actually started, seconds after the writers started.
    pub started_s: f64,
    /// When it ended.
    pub ended_s: f64,
    /// What happened, or why it could not be done.
    pub note: String,
    /// Whether the harness failed to inject it.
    pub failed: bool,
}

/// What a relay's logs said, over all its incarnations.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LogSummary {
    /// Lines per level.
    pub levels: BTreeMap<String, u64>,
    /// WARN and ERROR lines by message, most frequent first (at most 15).
    pub messages: Vec<(String, u64)>,
    /// ERROR lines, the first 10 in full.
    pub errors: Vec<String>,
}

/// Everything about a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunReport {
    /// The seed (`--seed` replays the schedule).
    pub seed: u64,
    /// `short`, `long`, `load` or `custom`.
    pub profile: String,
    /// The options in force.
    pub options: serde_json::Value,
    /// Destinations used.
    pub destinations: Vec<String>,
    /// Whether the relays were configured with `[destinations]` (else the legacy `[sink]`).
    pub destinations_config: bool,
    /// Seconds the writers ran.
    pub write_s: f64,
    /// Seconds the drain took (after healing).
    pub drain_s: f64,
    /// Whether the outbox drained and the consumers caught up before the drain timeout.
    pub drained: bool,
    /// Faults injected, by kind.
    pub faults_by_kind: BTreeMap<String, u64>,
    /// Every fault with what happened.
    pub faults: Vec<FaultRecord>,
    /// Lease-clock faults.
    pub lease_faults: Vec<LeaseFault>,
    /// Relay processes that ended on their own.
    pub relay_exits: Vec<UnexpectedExit>,
    /// Exit status of each relay at the final SIGTERM (`None`: had to be killed).
    pub relay_stops: Vec<(String, Option<String>)>,
    /// Relay logs.
    pub relay_logs: LogSummary,
    /// Messages the inbox adapters parked.
    pub parked: Vec<String>,
    /// Samples over time.
    pub timeline: Vec<Sample>,
    /// The checker's verdict.
    pub verdict: Verdict,
    /// Commit-to-receipt latency per destination, overall and for events committed during the
    /// outage (the `outage` fault).
    pub latency: Vec<DestinationLatency>,
    /// Where the files of the run are.
    pub work_dir: String,
}

impl RunReport {
    /// Violations, plus harness-level failures (relays that did not stop cleanly).
    pub fn violations(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = self
            .verdict
            .violations()
            .into_iter()
            .map(|(n, c)| (n.to_owned(), c))
            .collect();
        let unclean = self
            .relay_stops
            .iter()
            .filter(|(_, s)| s.as_deref() != Some("exit status: 0"))
            .count();
        if unclean > 0 {
            v.push(("relay_unclean_stop".into(), unclean as u64));
        }
        v
    }

    /// The one-screen summary.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        self.write_run(&mut s);
        self.write_faults(&mut s);
        self.write_resources(&mut s);
        self.write_checks(&mut s);
        let violations = self.violations();
        if violations.is_empty() {
            let _ = writeln!(s, "PASS");
        } else {
            let list: Vec<String> = violations.iter().map(|(n, c)| format!("{n}={c}")).collect();
            let _ = writeln!(s, "FAIL: {}", list.join(" "));
        }
        let _ = write!(s, "files: {}", self.work_dir);
        s
    }

    /// What ran, and the transactions and events it counted.
    fn write_run(&self, s: &mut String) {
        let v = &self.verdict;
        let _ = writeln!(
            s,
            "outbox-verify  profile={}  mode={}  seed={}  destinations={}  config={}",
            self.profile,
            self.options["mode"].as_str().unwrap_or("poll"),
            self.seed,
            self.destinations.join(","),
            if self.destinations_config {
                "[destinations]"
            } else {
                "[sink]"
            }
        );
        let _ = writeln!(
            s,
            "writes {:.0}s, drain {:.1}s ({})",
            self.write_s,
            self.drain_s,
            if self.drained {
                "drained"
            } else {
                "NOT drained before the timeout"
            }
        );
        let t = &v.txns;
        let _ = writeln!(
            s,
            "txns: {} committed, {} rolled back, {} crashed, {} failed by faults, ambiguous {} committed / {} not",
            t.committed,
            t.rolled_back,
            t.crashed,
            t.failed,
            t.ambiguous_committed,
            t.ambiguous_aborted
        );
        let _ = writeln!(
            s,
            "events: {} committed ({} poison), {} received ({} distinct, {} duplicates), {} effects, {} dead",
            v.committed_events,
            v.poison_events,
            v.received,
            v.received_distinct,
            v.duplicates,
            v.effects_applied,
            v.dead
        );
    }

    /// The faults injected, and what the lease faults led to.
    fn write_faults(&self, s: &mut String) {
        let faults: Vec<String> = self
            .faults_by_kind
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        let failed = self.faults.iter().filter(|f| f.failed).count();
        let _ = writeln!(
            s,
            "faults ({}{}): {}",
            self.faults.len(),
            if failed > 0 {
                format!(", {failed} not injected")
            } else {
                String::new()
            },
            faults.join(" ")
        );
        let reclaimed: u64 = self.lease_faults.iter().map(|l| l.reclaimed).sum();
        // Pauses whose events were re-claimed, by what became of the paused relay's writes.
        let reclaimed_and = |late_writes: LateWrites| {
            self.lease_faults
                .iter()
                .filter(|l| l.reclaimed > 0 && l.late_writes == late_writes)
                .count()
        };
        let fenced = reclaimed_and(LateWrites::Fenced);
        let never_written = reclaimed_and(LateWrites::NeverWritten);
        let claim_lost = reclaimed_and(LateWrites::ClaimLost);
        let given_up = reclaimed_and(LateWrites::GivenUpBeforePause);
        let with_reclaim = self.lease_faults.iter().filter(|l| l.reclaimed > 0).count();
        let _ = writeln!(
            s,
            "lease faults: {} pauses, {} with events re-claimed ({} events), {} of those fenced, {} killed before any late write, {} whose claim never got its answer, {} that had given up their batches before the pause",
            self.lease_faults.len(),
            with_reclaim,
            reclaimed,
            fenced,
            never_written,
            claim_lost,
            given_up
        );
    }

    /// Backlog, memory, latency and the relays' logs.
    fn write_resources(&self, s: &mut String) {
        if let (Some(max_backlog), Some(rss)) = (
            self.timeline.iter().filter_map(|x| x.backlog).max(),
            rss_range(&self.timeline),
        ) {
            let _ = writeln!(
                s,
                "backlog max {max_backlog}; relay RSS, all relays together: {} → {} → {} KiB (first sample → after 60 s → last, max {})",
                rss.first, rss.warm, rss.last, rss.max
            );
        }
        if !self.latency.is_empty() {
            let _ = writeln!(
                s,
                "latency, commit → first receipt, p50/p99/max ms (events committed during the outage):"
            );
            for d in &self.latency {
                let _ = writeln!(
                    s,
                    "  {:<10}{} {}{}",
                    d.destination,
                    if d.down { " (down)" } else { "" },
                    d.all.as_ref().map_or("-".into(), LatencyFigures::short),
                    d.during_outage
                        .as_ref()
                        .map_or(String::new(), |f| format!("  ({})", f.short())),
                );
            }
        }
        let _ = writeln!(
            s,
            "relay logs: {}; unexpected relay exits: {}",
            self.relay_logs
                .levels
                .iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect::<Vec<_>>()
                .join(" "),
            self.relay_exits.len()
        );
    }

    /// Each property checked, with a few examples of what broke it.
    fn write_checks(&self, s: &mut String) {
        let v = &self.verdict;
        let _ = writeln!(s, "checks:");
        let rows: [(&str, &Finding, &str); 10] = [
            ("lost", &v.lost, "must be 0"),
            ("phantom", &v.phantom, "must be 0"),
            ("order violations", &v.order_violations, "must be 0"),
            ("double effects", &v.double_effects, "must be 0"),
            ("missing effects", &v.missing_effects, "must be 0"),
            ("dead, not poison", &v.unexpected_dead, "must be 0"),
            ("poison, not dead", &v.poison_not_dead, "must be 0"),
            ("atomicity", &v.atomicity, "must be 0"),
            ("misrouted", &v.misrouted, "must be 0"),
            ("unfenced lease", &v.unfenced, "must be 0"),
        ];
        for (name, finding, rule) in rows {
            let mark = if finding.count == 0 { "ok  " } else { "FAIL" };
            let _ = writeln!(s, "  {mark} {name:<18} {:>6}   ({rule})", finding.count);
            if name == "lost" && v.lost_held_by_broker + v.lost_not_in_broker > 0 {
                let _ = writeln!(
                    s,
                    "         read back from the broker: {} held by it (never consumed), {} not in it",
                    v.lost_held_by_broker, v.lost_not_in_broker
                );
            }
            for e in finding.examples.iter().take(3) {
                let _ = writeln!(s, "         {e}");
            }
        }
        if v.dropped_by_broker.count > 0 {
            let _ = writeln!(
                s,
                "  note dropped by broker {:>6}   (acknowledged by the broker, absent from its log: a broker fault, not counted as lost)",
                v.dropped_by_broker.count
            );
            for e in v.dropped_by_broker.examples.iter().take(3) {
                let _ = writeln!(s, "         {e}");
            }
        }
    }
}

/// Latency figures of a set of events.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LatencyFigures {
    /// Events measured.
    pub events: u64,
    /// Median, milliseconds.
    pub p50_ms: u64,
    /// 99th percentile, milliseconds.
    pub p99_ms: u64,
    /// Slowest, milliseconds.
    pub max_ms: u64,
}

impl LatencyFigures {
    fn of(mut ms: Vec<u64>) -> Option<Self> {
        if ms.is_empty() {
            return None;
        }
        ms.sort_unstable();
        let at = |q: f64| ms[((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1];
        Some(LatencyFigures {
            events: ms.len() as u64,
            p50_ms: at(0.50),
            p99_ms: at(0.99),
            max_ms: ms[ms.len() - 1],
        })
    }

    fn short(&self) -> String {
        format!(
            "{}/{}/{} ({} events)",
            self.p50_ms, self.p99_ms, self.max_ms, self.events
        )
    }
}

/// One destination's commit-to-receipt latency: what an outage of another destination must
/// not change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DestinationLatency {
    /// The harness's destination name.
    pub destination: String,
    /// Whether it is the destination the outage took down.
    pub down: bool,
    /// Every committed event that arrived (its first arrival).
    pub all: Option<LatencyFigures>,
    /// The events committed while the outage lasted.
    pub during_outage: Option<LatencyFigures>,
}

/// Commit-to-first-receipt latency per destination. `outage`: the destination taken down and
/// the window (Unix ms) it was down, whose committed events are also measured on their own.
pub fn latencies(history: &History, outage: Option<(&str, u64, u64)>) -> Vec<DestinationLatency> {
    let mut first: std::collections::HashMap<(&str, outbox_types::EventId), u64> =
        std::collections::HashMap::new();
    for o in &history.observed {
        if let (Some(id), Some(at)) = (o.event_id, o.received_unix_ms) {
            first
                .entry((o.destination.as_str(), id))
                .and_modify(|t| *t = (*t).min(at))
                .or_insert(at);
        }
    }
    let mut all: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    let mut during: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for txn in &history.txns {
        let (TxnOutcome::Committed, Some(committed)) = (txn.outcome, txn.committed_unix_ms) else {
            continue;
        };
        for e in txn.events.iter().filter(|e| !e.poison) {
            let Some(&received) = first.get(&(e.destination.as_str(), e.id)) else {
                continue;
            };
            let ms = received.saturating_sub(committed);
            all.entry(&e.destination).or_default().push(ms);
            if outage.is_some_and(|(_, from, to)| committed >= from && committed <= to) {
                during.entry(&e.destination).or_default().push(ms);
            }
        }
    }
    all.into_iter()
        .map(|(destination, ms)| DestinationLatency {
            destination: destination.to_owned(),
            down: outage.is_some_and(|(d, _, _)| d == destination),
            all: LatencyFigures::of(ms),
            during_outage: during.remove(destination).and_then(LatencyFigures::of),
        })
        .collect()
}

/// Total relay RSS over the samples that had every relay running: the first (start-up), the
/// first one 60 s or more into the run (warmed up: pools and caches filled), the last and the
/// maximum. Flat memory means the last is close to the warmed-up value.
struct RssRange {
    first: u64,
    warm: u64,
    last: u64,
    max: u64,
}

fn rss_range(timeline: &[Sample]) -> Option<RssRange> {
    let totals: Vec<(f64, u64)> = timeline
        .iter()
        .filter(|s| !s.relay_rss_kib.is_empty() && s.relay_rss_kib.iter().all(Option::is_some))
        .map(|s| (s.t_s, s.relay_rss_kib.iter().flatten().sum()))
        .collect();
    let (_, first) = *totals.first()?;
    let (_, last) = *totals.last()?;
    let warm = totals
        .iter()
        .find(|(t, _)| *t >= 60.0)
        .map_or(last, |(_, kib)| *kib);
    Some(RssRange {
        first,
        warm,
        last,
        max: totals.iter().map(|(_, kib)| *kib).max()?,
    })
}

/// Summarize relay log files (JSON lines as `outbox --log-format json` writes them).
pub fn summarize_logs(files: &[std::path::PathBuf]) -> LogSummary {
    let mut summary = LogSummary::default();
    let mut messages: BTreeMap<String, u64> = BTreeMap::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                *summary.levels.entry("unparsed".into()).or_default() += 1;
                if summary.errors.len() < 10 && !line.trim().is_empty() {
                    summary.errors.push(line.chars().take(300).collect());
                }
                continue;
            };
            let level = v["level"].as_str().unwrap_or("?").to_owned();
            *summary.levels.entry(level.clone()).or_default() += 1;
            if level == "WARN" || level == "ERROR" {
                let message = v["message"]
                    .as_str()
                    .or_else(|| v["fields"]["message"].as_str())
                    .unwrap_or("?")
                    .to_owned();
                *messages.entry(format!("{level} {message}")).or_default() += 1;
                if level == "ERROR" && summary.errors.len() < 10 {
                    summary.errors.push(line.chars().take(300).collect());
                }
            }
        }
    }
    let mut list: Vec<(String, u64)> = messages.into_iter().collect();
    list.sort_by_key(|m| std::cmp::Reverse(m.1));
    list.truncate(15);
    summary.messages = list;
    summary
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Observed, Txn, WrittenEvent};
    use outbox_types::EventId;

    fn event(destination: &str, poison: bool) -> WrittenEvent {
        WrittenEvent {
            id: EventId::new(),
            aggregate: format!("{destination}/a"),
            seq: 1,
            destination: destination.into(),
            poison,
        }
    }

    #[test]
    fn latency_runs_from_commit_to_first_receipt_and_splits_off_the_outage() {
        let mut h = History::default();
        let mut txn = |committed: u64, e: WrittenEvent, outcome: TxnOutcome| {
            h.txns.push(Txn {
                id: uuid::Uuid::now_v7(),
                writer: 0,
                outcome,
                events: vec![e.clone()],
                committed_unix_ms: Some(committed),
            });
            e
        };
        // file: 100 events at 1..=100 ms latency, ten of them committed during the outage.
        let mut arrivals = Vec::new();
        for i in 0..100u64 {
            let e = txn(1_000 + i * 10, event("file", false), TxnOutcome::Committed);
            arrivals.push(("file", e.id, 1_000 + i * 10 + i + 1));
            // A duplicate later: only the first arrival counts.
            arrivals.push(("file", e.id, 90_000));
        }
        // nats, the one down: 5 s late.
        let e = txn(1_500, event("nats", false), TxnOutcome::Committed);
        arrivals.push(("nats", e.id, 6_500));
        // Neither a poison event nor a rolled-back one is measured.
        let p = txn(1_500, event("nats", true), TxnOutcome::Committed);
        arrivals.push(("nats", p.id, 1_501));
        let r = txn(1_500, event("file", false), TxnOutcome::RolledBack);
        arrivals.push(("file", r.id, 1_501));
        for (index, (d, id, at)) in arrivals.into_iter().enumerate() {
            h.observed.push(Observed {
                destination: d.into(),
                index: index as u64,
                event_id: Some(id),
                aggregate: None,
                seq: None,
                received_unix_ms: Some(at),
            });
        }
        let got = latencies(&h, Some(("nats", 1_400, 1_490)));
        assert_eq!(got.len(), 2, "{got:?}");
        let file = &got[0];
        assert_eq!(file.destination, "file");
        assert!(!file.down);
        let all = file.all.as_ref().unwrap();
        assert_eq!(
            (all.events, all.p50_ms, all.p99_ms, all.max_ms),
            (100, 50, 99, 100)
        );
        let during = file.during_outage.as_ref().unwrap();
        assert_eq!(
            (during.events, during.p50_ms, during.max_ms),
            (10, 45, 50),
            "events committed at 1400..=1490: latencies 41..=50"
        );
        let nats = &got[1];
        assert!(nats.down);
        assert_eq!(nats.all.as_ref().unwrap().max_ms, 5_000);
        assert_eq!(nats.all.as_ref().unwrap().events, 1, "poison not measured");
        assert!(nats.during_outage.is_none(), "committed after the window");
    }
}
