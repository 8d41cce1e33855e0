//! The checker: a pure function from a [`History`] to a [`Verdict`].
//!
//! What it proves, and how each property is computed:
//!
//! - **Atomicity**: the business row of a transaction exists exactly when the writer saw it
//!   commit (ambiguous commits are resolved by that row), and its events are in the outbox
//!   exactly then.
//! - **Lost** = committed, not poison, never received by any consumer. Must be 0.
//! - **Phantom** = received, but its transaction did not commit (rolled back, crashed, failed,
//!   ambiguous and absent), or its id was never written at all, or unreadable. Must be 0.
//! - **Order**: per aggregate, the first deliveries (duplicates ignored) arrive with strictly
//!   increasing per-aggregate sequence numbers. Must hold.
//! - **Duplicates**: deliveries beyond the first of each event. Counted, allowed
//!   (at-least-once).
//! - **Effects**: every received event had its effect applied through the inbox exactly once:
//!   twice or more is a violation, never is a violation too (the consumer lost it).
//! - **Dead letters**: the dead events are exactly the committed poison events; a poison event
//!   must never be received.
//! - **Misrouted**: an event received at a destination other than the one it was meant for.
//! - **Fencing**: after every lease-clock fault where other relays re-claimed the paused
//!   relay's events, the paused relay's late writes were fenced.
//!
//! The checker cannot pass vacuously: [`Verdict::violations`] also fails a run in which nothing
//! committed or nothing was received, and the unit tests below feed it each kind of violation.

use std::collections::{BTreeMap, HashMap, HashSet};

use outbox_types::EventId;
use serde::Serialize;

use crate::history::{History, LateWrites, TxnOutcome, WrittenEvent};

/// At most this many examples of each violation are kept in the report.
const EXAMPLES: usize = 20;

/// A count and a few examples.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// How many.
    pub count: u64,
    /// Up to 20 of them, described.
    pub examples: Vec<String>,
}

impl Finding {
    fn add(&mut self, example: impl FnOnce() -> String) {
        self.count += 1;
        if self.examples.len() < EXAMPLES {
            self.examples.push(example());
        }
    }
}

/// Transaction counts by outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TxnCounts {
    /// Writers saw COMMIT succeed.
    pub committed: u64,
    /// Rolled back on purpose.
    pub rolled_back: u64,
    /// The writer killed its own connection mid-transaction.
    pub crashed: u64,
    /// A fault broke the transaction before COMMIT.
    pub failed: u64,
    /// COMMIT's result was lost; found committed in the database afterwards.
    pub ambiguous_committed: u64,
    /// COMMIT's result was lost; not in the database.
    pub ambiguous_aborted: u64,
}

/// The checker's result.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Transactions by outcome.
    pub txns: TxnCounts,
    /// Events of committed transactions (poison included).
    pub committed_events: u64,
    /// Committed poison events.
    pub poison_events: u64,
    /// Messages received by the consumers, duplicates included.
    pub received: u64,
    /// Distinct events received.
    pub received_distinct: u64,
    /// Received more than once (allowed).
    pub duplicates: u64,
    /// Effects applied (sum over events).
    pub effects_applied: u64,
    /// Dead events in the outbox.
    pub dead: u64,
    /// Committed, never received.
    pub lost: Finding,
    /// Of the lost events, those the broker's log holds (read back after the run, where the
    /// destination allows it): the consumer side never read them.
    pub lost_held_by_broker: u64,
    /// Of the lost events, those the broker's log does not hold: never stored, or dropped.
    pub lost_not_in_broker: u64,
    /// Committed, never received, and acknowledged by the broker at a partition and offset its
    /// log does not hold (`History::broker_dropped`): lost by the broker after its ack, not by
    /// the relay. Reported, and not a violation of the outbox's guarantees.
    pub dropped_by_broker: Finding,
    /// Received, never committed.
    pub phantom: Finding,
    /// First deliveries of an aggregate out of sequence order.
    pub order_violations: Finding,
    /// Effects applied more than once.
    pub double_effects: Finding,
    /// Received but the effect was never applied.
    pub missing_effects: Finding,
    /// Dead but not poison.
    pub unexpected_dead: Finding,
    /// Poison but not dead (or received).
    pub poison_not_dead: Finding,
    /// Business row and writer's view disagree, or outbox rows and commit disagree.
    pub atomicity: Finding,
    /// Received at the wrong destination.
    pub misrouted: Finding,
    /// Lease faults whose paused relay's late writes were not fenced.
    pub unfenced: Finding,
    /// Committed events still undelivered in the outbox at the end (pending or in flight): the
    /// run did not drain; reported to explain `lost`.
    pub undrained: u64,
}

impl Verdict {
    /// The names and counts of every violated property; empty means the run passed.
    pub fn violations(&self) -> Vec<(&'static str, u64)> {
        let mut v: Vec<(&'static str, u64)> = [
            ("lost", &self.lost),
            ("phantom", &self.phantom),
            ("order", &self.order_violations),
            ("double_effects", &self.double_effects),
            ("missing_effects", &self.missing_effects),
            ("unexpected_dead", &self.unexpected_dead),
            ("poison_not_dead", &self.poison_not_dead),
            ("atomicity", &self.atomicity),
            ("misrouted", &self.misrouted),
            ("unfenced", &self.unfenced),
        ]
        .into_iter()
        .filter(|(_, f)| f.count > 0)
        .map(|(name, f)| (name, f.count))
        .collect();
        // A run that committed or received nothing proves nothing.
        if self.committed_events == 0 {
            v.push(("vacuous_nothing_committed", 1));
        } else if self.received_distinct == 0 {
            v.push(("vacuous_nothing_received", 1));
        }
        v
    }

    /// Whether every property held.
    pub fn passed(&self) -> bool {
        self.violations().is_empty()
    }
}

/// Check `history`.
pub fn check(history: &History) -> Verdict {
    let mut verdict = Verdict::default();
    let commits = commits(history, &mut verdict);
    check_outbox_rows(history, &commits, &mut verdict);
    let received = check_arrivals(
        history,
        &commits.committed,
        &commits.not_committed,
        &mut verdict,
    );
    check_lost(history, &commits.committed, &received, &mut verdict);
    check_effects(history, &commits.committed, &received, &mut verdict);
    check_dead_letters(history, &commits.committed, &mut verdict);
    check_fencing(history, &mut verdict);
    verdict
}

/// The written events sorted by whether their transaction committed.
struct Commits<'h> {
    committed: Committed<'h>,
    not_committed: NotCommitted<'h>,
}

type Committed<'h> = HashMap<EventId, &'h WrittenEvent>;
type NotCommitted<'h> = HashMap<EventId, (TxnOutcome, &'h WrittenEvent)>;

/// Which transactions committed: the writer's word, or for ambiguous ones the business row.
/// Counts the outcomes and checks each business row against its transaction's outcome.
fn commits<'h>(history: &'h History, verdict: &mut Verdict) -> Commits<'h> {
    let mut committed: HashMap<EventId, &WrittenEvent> = HashMap::new();
    let mut not_committed: HashMap<EventId, (TxnOutcome, &WrittenEvent)> = HashMap::new();
    for txn in &history.txns {
        let has_row = history.business_rows.contains(&txn.id);
        let is_committed = match txn.outcome {
            TxnOutcome::Committed => {
                verdict.txns.committed += 1;
                if !has_row {
                    verdict.atomicity.add(|| {
                        format!("txn {} committed but its business row is missing", txn.id)
                    });
                }
                true
            }
            TxnOutcome::Ambiguous if has_row => {
                verdict.txns.ambiguous_committed += 1;
                true
            }
            TxnOutcome::Ambiguous => {
                verdict.txns.ambiguous_aborted += 1;
                false
            }
            other => {
                match other {
                    TxnOutcome::RolledBack => verdict.txns.rolled_back += 1,
                    TxnOutcome::Crashed => verdict.txns.crashed += 1,
                    _ => verdict.txns.failed += 1,
                }
                if has_row {
                    verdict.atomicity.add(|| {
                        format!("txn {} ended {other:?} but its business row exists", txn.id)
                    });
                }
                false
            }
        };
        for event in &txn.events {
            if is_committed {
                committed.insert(event.id, event);
                verdict.committed_events += 1;
                if event.poison {
                    verdict.poison_events += 1;
                }
            } else {
                not_committed.insert(event.id, (txn.outcome, event));
            }
        }
    }

    Commits {
        committed,
        not_committed,
    }
}

/// The outbox agrees with the commits: every committed event is in it (counting those still
/// undelivered), no event of a transaction that did not commit is.
fn check_outbox_rows(history: &History, commits: &Commits<'_>, verdict: &mut Verdict) {
    let Commits {
        committed,
        not_committed,
    } = commits;
    for (id, event) in committed {
        match history.outbox.get(id) {
            None => verdict.atomicity.add(|| {
                format!(
                    "event {id} ({} #{}) committed but not in the outbox",
                    event.aggregate, event.seq
                )
            }),
            Some(row) if row.status == "pending" || row.status == "in_flight" => {
                verdict.undrained += 1
            }
            Some(_) => {}
        }
    }
    for (id, (outcome, event)) in not_committed {
        if history.outbox.contains_key(id) {
            verdict.atomicity.add(|| {
                format!(
                    "event {id} ({} #{}) is in the outbox but its transaction ended {outcome:?}",
                    event.aggregate, event.seq
                )
            });
        }
    }
}

/// What arrived: phantoms, misroutes, duplicates, first-delivery order. Returns how many times
/// each event was received.
fn check_arrivals(
    history: &History,
    committed: &Committed<'_>,
    not_committed: &NotCommitted<'_>,
    verdict: &mut Verdict,
) -> HashMap<EventId, u64> {
    let mut observed = history.observed.clone();
    observed.sort_by(|a, b| (&a.destination, a.index).cmp(&(&b.destination, b.index)));
    let mut received: HashMap<EventId, u64> = HashMap::new();
    let mut last_seq: BTreeMap<(&str, String), (u64, EventId)> = BTreeMap::new();
    for o in &observed {
        verdict.received += 1;
        let Some(id) = o.event_id else {
            verdict.phantom.add(|| {
                format!(
                    "message #{} at {} has no readable event id",
                    o.index, o.destination
                )
            });
            continue;
        };
        let count = received.entry(id).or_insert(0);
        *count += 1;
        let first = *count == 1;
        match committed.get(&id) {
            Some(event) => {
                if event.destination != o.destination && first {
                    verdict.misrouted.add(|| {
                        format!(
                            "event {id} meant for {} arrived at {}",
                            event.destination, o.destination
                        )
                    });
                }
                if event.poison && first {
                    verdict
                        .poison_not_dead
                        .add(|| format!("poison event {id} was received at {}", o.destination));
                }
            }
            None if first => {
                let why = match not_committed.get(&id) {
                    Some((outcome, event)) => format!(
                        "event {id} ({} #{}) received at {} but its transaction ended {outcome:?}",
                        event.aggregate, event.seq, o.destination
                    ),
                    None => format!("event {id} received at {} was never written", o.destination),
                };
                verdict.phantom.add(|| why);
            }
            None => {}
        }
        if !first {
            continue;
        }
        // Order among first deliveries, per destination and aggregate. The sequence number is
        // taken from what the writer wrote when known (the payload can only agree).
        let (aggregate, seq) = match committed.get(&id) {
            Some(e) => (Some(e.aggregate.clone()), Some(e.seq)),
            None => (o.aggregate.clone(), o.seq),
        };
        if let (Some(aggregate), Some(seq)) = (aggregate, seq) {
            let key = (o.destination.as_str(), aggregate);
            if let Some((prev, prev_id)) = last_seq.get(&key)
                && seq <= *prev
            {
                let (prev, prev_id) = (*prev, *prev_id);
                verdict.order_violations.add(|| {
                    format!(
                        "aggregate {} at {}: #{seq} ({id}) first arrived after #{prev} ({prev_id})",
                        key.1, key.0
                    )
                });
            }
            let entry = last_seq.entry(key).or_insert((seq, id));
            if seq > entry.0 {
                *entry = (seq, id);
            }
        }
    }
    verdict.received_distinct = received.len() as u64;
    verdict.duplicates = verdict.received - verdict.received_distinct;

    received
}

/// Committed, not poison, never received: lost, unless the broker dropped it after its ack.
fn check_lost(
    history: &History,
    committed: &Committed<'_>,
    received: &HashMap<EventId, u64>,
    verdict: &mut Verdict,
) {
    for (id, event) in committed {
        if event.poison {
            continue;
        }
        if !received.contains_key(id) {
            if history
                .broker_dropped
                .get(&event.destination)
                .is_some_and(|dropped| dropped.contains(id))
            {
                verdict.dropped_by_broker.add(|| {
                    format!(
                        "event {id} ({} #{}, for {}): the broker acknowledged it at an offset its log does not hold",
                        event.aggregate, event.seq, event.destination
                    )
                });
                continue;
            }
            let state = history
                .outbox
                .get(id)
                .map(|r| r.status.as_str())
                .unwrap_or("missing");
            let in_broker = history
                .broker_held
                .get(&event.destination)
                .map(|held| held.contains(id));
            match in_broker {
                Some(true) => verdict.lost_held_by_broker += 1,
                Some(false) => verdict.lost_not_in_broker += 1,
                None => {}
            }
            verdict.lost.add(|| {
                format!(
                    "event {id} ({} #{}, for {}) committed, never received; outbox state {state}{}",
                    event.aggregate,
                    event.seq,
                    event.destination,
                    match in_broker {
                        Some(true) => "; the broker holds it (the consumer never read it)",
                        Some(false) => "; the broker does not hold it",
                        None => "",
                    }
                )
            });
        }
    }
}

/// Every received event's effect applied exactly once.
fn check_effects(
    history: &History,
    committed: &Committed<'_>,
    received: &HashMap<EventId, u64>,
    verdict: &mut Verdict,
) {
    for (id, n) in &history.effects {
        verdict.effects_applied += u64::from(*n);
        if *n > 1 {
            verdict
                .double_effects
                .add(|| format!("event {id}: effect applied {n} times"));
        }
    }
    for id in received.keys() {
        if committed.get(id).is_some_and(|e| e.poison) {
            continue;
        }
        if history.effects.get(id).copied().unwrap_or(0) == 0 {
            verdict
                .missing_effects
                .add(|| format!("event {id} received but its effect was never applied"));
        }
    }
}

/// Dead letters: exactly the committed poison events.
fn check_dead_letters(history: &History, committed: &Committed<'_>, verdict: &mut Verdict) {
    let dead: HashSet<EventId> = history
        .outbox
        .iter()
        .filter(|(_, r)| r.status == "dead")
        .map(|(id, _)| *id)
        .collect();
    verdict.dead = dead.len() as u64;
    for id in &dead {
        if !committed.get(id).is_some_and(|e| e.poison) {
            let error = history
                .outbox
                .get(id)
                .and_then(|r| r.last_error.clone())
                .unwrap_or_default();
            verdict
                .unexpected_dead
                .add(|| format!("event {id} is dead but not poison: {error}"));
        }
    }
    for (id, event) in committed {
        if event.poison && !dead.contains(id) {
            let state = history
                .outbox
                .get(id)
                .map(|r| r.status.as_str())
                .unwrap_or("missing");
            verdict
                .poison_not_dead
                .add(|| format!("poison event {id} ended {state}, not dead"));
        }
    }
}

/// After each lease fault whose paused relay's events were re-claimed, its late writes were
/// fenced.
fn check_fencing(history: &History, verdict: &mut Verdict) {
    for fault in &history.lease_faults {
        if fault.reclaimed > 0
            && matches!(
                fault.late_writes,
                LateWrites::Unfenced | LateWrites::Pending
            )
        {
            verdict.unfenced.add(|| {
                format!(
                    "relay {} held {} events, {} were re-claimed while it was paused, and its log never shows its late writes fenced ({:?})",
                    fault.relay, fault.held, fault.reclaimed, fault.late_writes
                )
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{LateWrites, LeaseFault, Observed, OutboxRow, Txn};
    use uuid::Uuid;

    /// A small clean history: two aggregates, three committed transactions, one rolled back,
    /// every committed event received once (one twice) and applied once.
    struct Fixture {
        history: History,
        ids: Vec<EventId>,
        rolled_back: EventId,
    }

    impl Fixture {
        /// Take `lost` out of what the consumers received and applied.
        fn never_received(&mut self, lost: &[EventId]) {
            for id in lost {
                self.history.observed.retain(|o| o.event_id != Some(*id));
                self.history.effects.remove(id);
            }
        }

        /// The file broker reads back every written id but `missing`.
        fn broker_holds_all_but(&mut self, missing: &[EventId]) {
            let held: HashSet<EventId> = self
                .ids
                .iter()
                .copied()
                .filter(|id| !missing.contains(id))
                .collect();
            self.history.broker_held.insert("file".into(), held);
        }
    }

    fn event(aggregate: &str, seq: u64) -> WrittenEvent {
        WrittenEvent {
            id: EventId::new(),
            aggregate: aggregate.into(),
            seq,
            destination: "file".into(),
            poison: false,
        }
    }

    fn txn(outcome: TxnOutcome, events: Vec<WrittenEvent>) -> Txn {
        Txn {
            id: Uuid::now_v7(),
            writer: 0,
            outcome,
            events,
            committed_unix_ms: None,
        }
    }

    fn observe(history: &mut History, e: &WrittenEvent) {
        let index = history.observed.len() as u64;
        history.observed.push(Observed {
            destination: e.destination.clone(),
            index,
            event_id: Some(e.id),
            aggregate: Some(e.aggregate.clone()),
            seq: Some(e.seq),
            received_unix_ms: None,
        });
    }

    fn row(status: &str) -> OutboxRow {
        OutboxRow {
            status: status.into(),
            attempts: 0,
            last_error: None,
        }
    }

    fn fixture() -> Fixture {
        let mut history = History::default();
        let t1 = txn(
            TxnOutcome::Committed,
            vec![event("a/1", 1), event("a/1", 2)],
        );
        let t2 = txn(TxnOutcome::Committed, vec![event("b/1", 1)]);
        let t3 = txn(TxnOutcome::Ambiguous, vec![event("a/1", 3)]);
        let rb = txn(TxnOutcome::RolledBack, vec![event("b/1", 2)]);
        let rolled_back = rb.events[0].id;
        let mut ids = Vec::new();
        for t in [&t1, &t2, &t3] {
            history.business_rows.insert(t.id);
            for e in &t.events {
                ids.push(e.id);
                history.outbox.insert(e.id, row("delivered"));
                history.effects.insert(e.id, 1);
            }
        }
        // Arrival: a1, b1, a2, a1 (duplicate), a3.
        observe(&mut history, &t1.events[0]);
        observe(&mut history, &t2.events[0]);
        observe(&mut history, &t1.events[1]);
        observe(&mut history, &t1.events[0]);
        observe(&mut history, &t3.events[0]);
        history.txns = vec![t1, t2, t3, rb];
        Fixture {
            history,
            ids,
            rolled_back,
        }
    }

    #[test]
    fn a_clean_history_passes_and_counts_duplicates() {
        let f = fixture();
        let v = check(&f.history);
        assert!(v.passed(), "{:?}", v.violations());
        assert_eq!(v.committed_events, 4);
        assert_eq!(v.txns.ambiguous_committed, 1);
        assert_eq!(v.txns.rolled_back, 1);
        assert_eq!((v.received, v.received_distinct, v.duplicates), (5, 4, 1));
    }

    #[test]
    fn a_lost_event_is_reported() {
        let mut f = fixture();
        let lost = f.ids[3];
        f.never_received(&[lost]);
        let v = check(&f.history);
        assert_eq!(v.lost.count, 1, "{v:?}");
        assert!(v.lost.examples[0].contains(&lost.to_string()));
        assert_eq!(v.violations(), vec![("lost", 1)]);
        assert_eq!((v.lost_held_by_broker, v.lost_not_in_broker), (0, 0));
    }

    #[test]
    fn an_event_the_broker_acknowledged_and_dropped_is_reported_apart() {
        let mut f = fixture();
        let (dropped, lost) = (f.ids[2], f.ids[3]);
        f.never_received(&[dropped, lost]);
        f.broker_holds_all_but(&[dropped, lost]);
        f.history
            .broker_dropped
            .insert("file".into(), HashSet::from([dropped]));
        let v = check(&f.history);
        assert_eq!(v.dropped_by_broker.count, 1, "{v:?}");
        assert!(v.dropped_by_broker.examples[0].contains(&dropped.to_string()));
        // Not in the broker and no ack for it in the relays' logs: lost, a violation.
        assert_eq!(v.lost.count, 1, "{v:?}");
        assert!(v.lost.examples[0].contains(&lost.to_string()));
        assert_eq!(v.violations(), vec![("lost", 1)]);
    }

    #[test]
    fn a_lost_event_is_placed_by_what_the_broker_holds() {
        let mut f = fixture();
        let (consumer_side, broker_side) = (f.ids[2], f.ids[3]);
        f.never_received(&[consumer_side, broker_side]);
        f.broker_holds_all_but(&[broker_side]);
        let v = check(&f.history);
        assert_eq!(v.lost.count, 2, "{v:?}");
        assert_eq!((v.lost_held_by_broker, v.lost_not_in_broker), (1, 1));
        let about = |id: EventId| {
            v.lost
                .examples
                .iter()
                .find(|e| e.contains(&id.to_string()))
                .cloned()
                .unwrap_or_default()
        };
        assert!(
            about(consumer_side).contains("the consumer never read it"),
            "{:?}",
            v.lost
        );
        assert!(
            about(broker_side).contains("does not hold it"),
            "{:?}",
            v.lost
        );
    }

    #[test]
    fn an_ambiguous_commit_not_in_the_database_is_not_expected() {
        let mut f = fixture();
        let ambiguous = f.history.txns[2].id;
        f.history.business_rows.remove(&ambiguous);
        f.history.outbox.remove(&f.ids[3]);
        // It was still received: that is now a phantom.
        let v = check(&f.history);
        assert_eq!(v.txns.ambiguous_aborted, 1);
        assert_eq!(v.phantom.count, 1, "{v:?}");
        assert_eq!(v.lost.count, 0);
    }

    #[test]
    fn a_phantom_is_reported() {
        let mut f = fixture();
        let rolled_back = f.history.txns[3].events[0].clone();
        observe(&mut f.history, &rolled_back);
        f.history.effects.insert(f.rolled_back, 1);
        let v = check(&f.history);
        assert_eq!(v.phantom.count, 1, "{v:?}");
        assert!(v.phantom.examples[0].contains("RolledBack"));
        // And an id nobody ever wrote.
        let mut f = fixture();
        f.history.observed.push(Observed {
            destination: "file".into(),
            index: 99,
            event_id: Some(EventId::new()),
            aggregate: None,
            seq: None,
            received_unix_ms: None,
        });
        let v = check(&f.history);
        assert_eq!(v.phantom.count, 1);
        assert!(v.phantom.examples[0].contains("never written"));
    }

    #[test]
    fn an_order_violation_is_reported() {
        let mut f = fixture();
        // Swap the first arrivals of a#1 and a#2.
        f.history.observed[0].index = 2;
        f.history.observed[2].index = 0;
        let v = check(&f.history);
        assert_eq!(v.order_violations.count, 1, "{v:?}");
        assert!(v.order_violations.examples[0].contains("#1"));
        assert_eq!(v.violations(), vec![("order", 1)]);
    }

    #[test]
    fn a_late_duplicate_is_not_an_order_violation() {
        let f = fixture();
        // a#1 arrives again after a#2 in the fixture: allowed.
        assert_eq!(check(&f.history).order_violations.count, 0);
    }

    #[test]
    fn a_double_effect_is_reported() {
        let mut f = fixture();
        f.history.effects.insert(f.ids[0], 2);
        let v = check(&f.history);
        assert_eq!(v.double_effects.count, 1, "{v:?}");
        assert_eq!(v.violations(), vec![("double_effects", 1)]);
    }

    #[test]
    fn a_missing_effect_is_reported() {
        let mut f = fixture();
        f.history.effects.remove(&f.ids[1]);
        assert_eq!(check(&f.history).missing_effects.count, 1);
    }

    #[test]
    fn dead_letters_must_be_exactly_the_poison_events() {
        let mut f = fixture();
        let mut poison = event("p/1", 1);
        poison.poison = true;
        let t = txn(TxnOutcome::Committed, vec![poison.clone()]);
        f.history.business_rows.insert(t.id);
        f.history.txns.push(t);
        // Poison still pending: not dead.
        f.history.outbox.insert(poison.id, row("pending"));
        let v = check(&f.history);
        assert_eq!(v.poison_not_dead.count, 1, "{v:?}");
        // Poison dead, plus an ordinary event dead: unexpected.
        f.history.outbox.insert(poison.id, row("dead"));
        f.history.outbox.insert(f.ids[2], row("dead"));
        let v = check(&f.history);
        assert_eq!(v.poison_not_dead.count, 0);
        assert_eq!(v.unexpected_dead.count, 1);
        assert_eq!(v.dead, 2);
    }

    #[test]
    fn atomicity_breaks_are_reported() {
        let mut f = fixture();
        let rb = f.history.txns[3].id;
        f.history.business_rows.insert(rb);
        f.history.outbox.insert(f.rolled_back, row("pending"));
        let committed = f.history.txns[1].id;
        f.history.business_rows.remove(&committed);
        let v = check(&f.history);
        assert_eq!(v.atomicity.count, 3, "{:?}", v.atomicity);
    }

    #[test]
    fn misroutes_and_unfenced_lease_faults_are_reported() {
        let mut f = fixture();
        f.history.observed[1].destination = "nats".into();
        let faults = [
            ("r1", 4, LateWrites::Unfenced),
            ("r2", 0, LateWrites::Pending),
            ("r3", 10, LateWrites::NeverWritten),
            ("r4", 10, LateWrites::Fenced),
        ];
        for (relay, reclaimed, late_writes) in faults {
            f.history.lease_faults.push(LeaseFault {
                relay: relay.into(),
                held: 10,
                reclaimed,
                late_writes,
                log: None,
                leases: vec!["lease-1".into()],
            });
        }
        let v = check(&f.history);
        assert_eq!(v.misrouted.count, 1);
        assert_eq!(v.unfenced.count, 1);
    }

    #[test]
    fn an_empty_run_fails() {
        let v = check(&History::default());
        assert!(!v.passed());
        assert_eq!(v.violations(), vec![("vacuous_nothing_committed", 1)]);
        let mut f = fixture();
        f.history.observed.clear();
        let v = check(&f.history);
        assert!(v.violations().contains(&("vacuous_nothing_received", 1)));
    }
}
