//! What the harness records while it runs: the writers' transactions, what arrived at each
//! destination, and the state of the outbox and of the consumer's effects at the end.
//!
//! Why these are plain data, separate from the code that produces them: the
//! [checker](crate::checker) is a pure function of them, so it is tested with fabricated
//! histories (a lost event, a phantom, an order violation, a double effect) and a real run can
//! be re-checked from its JSON files without running anything again.

use std::collections::{HashMap, HashSet};

use outbox_types::EventId;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// One event a writer put into a transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenEvent {
    /// The event id the writer chose.
    pub id: EventId,
    /// The aggregate (`aggregate_type/aggregate_id`), the unit of ordering.
    pub aggregate: String,
    /// Per-aggregate sequence number from the business table, also in the payload. Committed
    /// events of one aggregate carry 1, 2, 3, … in commit order.
    pub seq: u64,
    /// The destination this event must reach (the harness's name for it).
    pub destination: String,
    /// A poison event: its sink always rejects it, so it must end dead, never delivered.
    pub poison: bool,
}

/// How a writer's transaction ended, as far as the writer knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TxnOutcome {
    /// COMMIT returned success.
    Committed,
    /// The writer rolled back on purpose.
    RolledBack,
    /// The writer killed its own connection before COMMIT (pg_terminate_backend or a dropped
    /// socket): the server aborts the transaction.
    Crashed,
    /// A statement before COMMIT failed (the connection was killed by a fault, the database
    /// restarted): COMMIT was never sent, so nothing was committed.
    Failed,
    /// COMMIT was sent but its result never came back: committed or not, only the database
    /// knows. Resolved after the run.
    Ambiguous,
}

/// One business transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Txn {
    /// The transaction's id, also the primary key of its business row.
    pub id: Uuid,
    /// Which writer ran it.
    pub writer: u32,
    /// What the writer saw.
    pub outcome: TxnOutcome,
    /// The events it enqueued.
    pub events: Vec<WrittenEvent>,
    /// When COMMIT returned success (Unix milliseconds): where each event's latency starts.
    #[serde(default)]
    pub committed_unix_ms: Option<u64>,
}

/// One message as a consumer received it, in arrival order per destination.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observed {
    /// The harness's destination name.
    pub destination: String,
    /// Arrival index at that destination (0, 1, 2, …).
    pub index: u64,
    /// The event id the message carried (`None`: unreadable, itself a violation).
    pub event_id: Option<EventId>,
    /// The aggregate from the payload.
    pub aggregate: Option<String>,
    /// The per-aggregate sequence number from the payload.
    pub seq: Option<u64>,
    /// When the consumer received it (Unix milliseconds).
    #[serde(default)]
    pub received_unix_ms: Option<u64>,
}

/// An outbox row at the end of the run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxRow {
    /// `pending`, `in_flight`, `delivered` or `dead`.
    pub status: String,
    /// Failed attempts.
    pub attempts: i32,
    /// The last error, for dead events.
    pub last_error: Option<String>,
}

/// Everything the checker reads.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct History {
    /// Every transaction every writer started.
    pub txns: Vec<Txn>,
    /// Every message every consumer received.
    pub observed: Vec<Observed>,
    /// The outbox table at the end, by event id.
    pub outbox: HashMap<EventId, OutboxRow>,
    /// How many times the consumer's effect was applied, by event id (from the effects table in
    /// the consumer's database, written in the inbox transaction).
    pub effects: HashMap<EventId, u32>,
    /// Ids of the business rows in the database at the end: the ground truth of which
    /// transactions committed. Ambiguous transactions are resolved against it; a rolled-back
    /// transaction with a row, or a committed one without, is an atomicity violation.
    pub business_rows: HashSet<Uuid>,
    /// One entry per lease-clock fault (a relay paused past its lease, then resumed).
    pub lease_faults: Vec<LeaseFault>,
    /// Per destination whose broker can be read back independently of the consumer (Kafka's
    /// log from offset 0): every event id the broker holds at the end. For a lost event it
    /// tells whether the broker never stored it or the consumer never read it.
    #[serde(default)]
    pub broker_held: HashMap<String, HashSet<EventId>>,
    /// Per destination read back that way: events its log does not hold although the broker
    /// acknowledged storing them at a partition and offset (from the relays' logs of the acks
    /// they received). An event here that was never received was dropped by the broker after
    /// its ack, which no relay can prevent or notice.
    #[serde(default)]
    pub broker_dropped: HashMap<String, HashSet<EventId>>,
}

/// What a lease-clock fault did: a relay was paused (SIGSTOP) past its lease while it held
/// claimed events, other relays re-claimed them, then it was resumed (SIGCONT).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseFault {
    /// The paused relay's id (its `relay_id`, the lease owner column).
    pub relay: String,
    /// Events it held (in flight under its lease) when it was paused.
    pub held: u64,
    /// How many of those another relay had claimed (a different lease token) by the time it was
    /// resumed.
    pub reclaimed: u64,
    /// What its log, from the moment it was resumed to the end of that process, shows about
    /// its late writes. Must not be [`LateWrites::Unfenced`] or [`LateWrites::Pending`]
    /// whenever `reclaimed > 0`.
    pub late_writes: LateWrites,
    /// Its log file and the byte offset at which it was resumed, so the verdict can be settled
    /// from the whole log after the run (a stale batch can take longer than the fault waits).
    #[serde(default)]
    pub log: Option<(String, u64)>,
    /// The lease tokens the held events were under (one per claim).
    #[serde(default)]
    pub leases: Vec<String>,
}

/// What became of a resumed relay's writes for a batch it no longer owned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LateWrites {
    /// Its log says a write was fenced ("Lease expired before the write") or given up
    /// ("Could not record the batch before its lease ran out").
    Fenced,
    /// The process was killed (its log has no "Relay stopped.") before it logged a fenced
    /// write: it did not get to write that batch back, or wrote it and was killed before it
    /// could log anything; the harness cannot tell these apart from outside (the stores'
    /// fencing tests cover the write itself), so it counts them apart.
    NeverWritten,
    /// The events were all of one claim, and the first thing the resumed relay logged was that
    /// claim failing ("Claim failed"): it was frozen while its claim was committing, the
    /// database went away meanwhile (a restart fault), and the answer never reached it. The
    /// relay never had those events, so it had nothing to write back.
    ClaimLost,
    /// Before it was paused, it had already given up writing back every batch it held ("Could
    /// not record the batch before its lease ran out", logged with the lease once the batch's
    /// last write was tried): it had nothing left to write under those leases when it resumed.
    GivenUpBeforePause,
    /// The process went on and stopped normally ("Relay stopped.") and never logged a fenced
    /// write: a write for events another relay owned went through, or was silently dropped.
    Unfenced,
    /// Not settled yet (the process is still running and has not written back).
    Pending,
}

/// Now, as Unix milliseconds: writers and consumers run in this one process, so their stamps
/// share one clock and a difference of two is a latency.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
