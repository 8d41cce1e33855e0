//! The contract between the relay and a database.
//!
//! # Claims, leases and fencing
//!
//! A relay *claims* a batch: the store marks the events `in_flight` with a lease owner, a lease
//! expiry and a fresh fencing token (one per claim). Every later write for those events — ack,
//! retry, bury, release — names the token and touches only rows that still carry it. When a relay
//! dies, or stalls past its lease (a long GC pause, `SIGSTOP`, a network partition), its events
//! become claimable again; the next claim gives them a new token, so the stalled relay's late acks
//! match nothing and are reported as fenced instead of overwriting newer state.
//!
//! # Ordering
//!
//! A store never hands out an event while an earlier event of the same aggregate is in flight
//! under an unexpired lease, waiting for a retry, or dead under [`DeadLetterPolicy::Block`]. Events
//! of one aggregate inside one claim come back in enqueue order. Claims by several relays are
//! serialized by the store (PostgreSQL: a transaction-scoped advisory lock around the claim
//! statement; SQLite: its single writer), which is what makes the rule hold with many relays: a
//! claim always sees every earlier claim's result.
//!
//! # Time
//!
//! Stores compare times on one clock: the database's. Lease expiry and due times written by one
//! relay host are then read consistently by another, whatever the skew between the hosts. (An
//! embedded database such as SQLite has no clock of its own: its store uses the host's, which
//! every process sharing the file also reads.)

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::StoreError;
use crate::event::{AggregateKey, Event, EventId, EventRecord};
use crate::retry::DeadLetterPolicy;
use crate::route::RouteTable;

/// What a relay asks for when it claims.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    /// Who claims: shown in `outbox status` as the lease owner.
    pub owner: String,
    /// At most this many events.
    pub limit: u32,
    /// How long the claim is exclusive. Past it, another relay may claim the same events.
    pub lease: Duration,
    /// Whether a dead event holds back the later events of its aggregate.
    pub dead_letter: DeadLetterPolicy,
    /// Destinations whose events are not claimed now (paused by an operator, or deferred for
    /// one claim so that a backlog of one destination does not fill every batch).
    pub hold: Option<Arc<Hold>>,
    /// Most bytes one claim returns, counting whole rows (the payload and every other column
    /// the claim reads, as [`RowBytes`] measures them): events are taken in `seq` order while
    /// the rows before them add up to less than this (the first one always), so a relay's
    /// memory is bounded by bytes and not only by `limit`. A row buried unread (over
    /// [`ClaimRequest::max_payload_bytes`] or [`ClaimRequest::max_metadata_bytes`]) counts as
    /// nothing. `u64::MAX`: no bound.
    pub max_batch_bytes: u64,
    /// An event whose payload is larger than this is not loaded: the claim buries it at once
    /// with a reason that names the limit ([`bury_oversized`]). `u64::MAX`: no bound.
    pub max_payload_bytes: u64,
    /// An event whose other columns together ([`RowBytes::metadata`]: id, aggregate type and
    /// id, event type, destination, headers, idempotency key) take more bytes than this is not
    /// loaded either: the claim buries it with a reason that names this limit
    /// ([`bury_oversized_metadata`]). The database measures the columns; none of them, not
    /// even the aggregate key, reaches the relay when the row is over a limit.
    /// `u64::MAX`: no bound.
    pub max_metadata_bytes: u64,
    /// Only events with a `seq` up to this. A stream source claims from its table only the rows
    /// its stream has passed, and never one it holds itself. `None`: no bound.
    pub up_to_seq: Option<i64>,
}

impl ClaimRequest {
    /// A request with no destination on hold.
    pub fn new(
        owner: impl Into<String>,
        limit: u32,
        lease: Duration,
        dead_letter: DeadLetterPolicy,
    ) -> Self {
        ClaimRequest {
            owner: owner.into(),
            limit,
            lease,
            dead_letter,
            hold: None,
            max_batch_bytes: u64::MAX,
            max_payload_bytes: u64::MAX,
            max_metadata_bytes: u64::MAX,
            up_to_seq: None,
        }
    }

    /// Bound the claim by bytes (see [`ClaimRequest::max_batch_bytes`] and
    /// [`ClaimRequest::max_payload_bytes`]).
    pub fn with_byte_limits(mut self, max_batch_bytes: u64, max_payload_bytes: u64) -> Self {
        self.max_batch_bytes = max_batch_bytes;
        self.max_payload_bytes = max_payload_bytes;
        self
    }

    /// Bound the bytes of an event's columns other than the payload (see
    /// [`ClaimRequest::max_metadata_bytes`]).
    pub fn with_metadata_limit(mut self, max_metadata_bytes: u64) -> Self {
        self.max_metadata_bytes = max_metadata_bytes;
        self
    }
}

/// Destinations a claim skips: every event that `routes` sends to one of `paused` or
/// `deferred` stays pending. A paused destination's events do not hold back other
/// destinations' events; a deferred one's do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hold {
    /// How events map to destinations (rendered into the claim's SQL).
    pub routes: RouteTable,
    /// Names of the destinations an operator paused.
    pub paused: Vec<String>,
    /// Names of destinations skipped by this one claim only: the relay's fair turn for the
    /// others after a claim that one destination's backlog filled. A table claim takes none of
    /// their events, but unlike a paused destination's, their open rows still hold back the
    /// later events of their aggregates (even a row that is merely due): the turn changes which
    /// aggregates go first, never the order within one. A store may claim them as usual instead
    /// (SQLite does); a stream source need not defer (its events are new, not a backlog), and
    /// must not treat them as paused (nothing is handed back for them).
    pub deferred: Vec<String>,
}

/// Proof of a claim: the owner and the fencing token every follow-up write must present.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The claiming relay.
    pub owner: String,
    /// Unique per claim; rows re-claimed by someone else carry another token.
    pub token: Uuid,
}

/// A claimed batch.
#[derive(Clone, Debug)]
pub struct Claim {
    /// The lease over every event in `events`.
    pub lease: Lease,
    /// Claimed events, in enqueue (`seq`) order.
    pub events: Vec<Event>,
    /// Rows this claim took and buried at once instead of handing them out (malformed, or over
    /// [`ClaimRequest::max_payload_bytes`] or [`ClaimRequest::max_metadata_bytes`]): the relay
    /// counts them as dead.
    pub buried: u64,
}

/// A failed delivery to try again later.
#[derive(Clone, Debug)]
pub struct RetryEvent {
    /// The event.
    pub seq: i64,
    /// How long from now until it is due again.
    pub delay: Duration,
    /// Why it failed (stored truncated).
    pub error: String,
    /// Whether the failure counts toward `max_attempts`: `false` when the destination was
    /// unavailable ([`crate::Outcome::Unavailable`]), so an outage costs time, not attempts,
    /// however long it lasts. Either way the row keeps `error` as its `last_error`: a pending
    /// row with a `last_error` (or attempts) is what marks it as waiting for its retry, and so
    /// holds the later events of its aggregate behind it (in every store's claim and index).
    pub counts_attempt: bool,
}

/// A claimed row that cannot be decoded into an [`Event`] (edited by hand, written by a foreign
/// writer): the store buries it at once instead of failing the whole claim, so one bad row
/// never stops the outbox — it waits among the dead events for an operator.
pub fn bury_malformed(seq: i64, error: &StoreError) -> BuryEvent {
    BuryEvent {
        seq,
        error: format!(
            "the stored row cannot be read as an event ({error}); fix the row and run `outbox dead requeue`, or `outbox dead purge` it"
        ),
    }
}

/// A claimed event whose payload is above [`ClaimRequest::max_payload_bytes`]: the store buries
/// it without loading the payload, so one huge row cannot exhaust the relay's memory, and its
/// aggregate waits behind it like behind any dead event.
pub fn bury_oversized(seq: i64, bytes: u64, limit: u64) -> BuryEvent {
    bury_over_limits(
        seq,
        &[OverLimit {
            what: "the payload is",
            bytes,
            setting: "relay.max_payload_bytes",
            limit,
        }],
    )
}

/// A claimed event whose columns other than the payload ([`RowBytes::metadata`]) are above
/// [`ClaimRequest::max_metadata_bytes`] together: buried without loading any of them, as
/// [`bury_oversized`] does for a payload.
///
/// ```
/// let bury = outbox_types::bury_oversized_metadata(7, 52_428_900, 65_536);
/// assert!(bury.error.contains("52428900 bytes together, above relay.max_metadata_bytes = 65536"));
/// ```
pub fn bury_oversized_metadata(seq: i64, bytes: u64, limit: u64) -> BuryEvent {
    bury_over_limits(seq, &[metadata_over(bytes, limit)])
}

/// One limit a row is over, for the reason [`bury_over_limits`] writes.
struct OverLimit {
    what: &'static str,
    bytes: u64,
    setting: &'static str,
    limit: u64,
}

fn metadata_over(bytes: u64, limit: u64) -> OverLimit {
    OverLimit {
        what: "the other columns (id, aggregate type and id, event type, destination, headers, idempotency key) are",
        bytes,
        setting: "relay.max_metadata_bytes",
        limit,
    }
}

/// The reason for a row over one or more byte limits: each size and the setting it is above,
/// then what an operator can do.
fn bury_over_limits(seq: i64, over: &[OverLimit]) -> BuryEvent {
    let sizes: Vec<String> = over
        .iter()
        .map(|o| {
            let together = if o.setting == "relay.max_metadata_bytes" {
                " together"
            } else {
                ""
            };
            format!(
                "{} {} bytes{together}, above {} = {}",
                o.what, o.bytes, o.setting, o.limit
            )
        })
        .collect();
    let settings: Vec<&str> = over.iter().map(|o| o.setting).collect();
    BuryEvent {
        seq,
        error: format!(
            "{}: the relay does not deliver it; raise {} (if the destination accepts such messages) and run `outbox dead requeue`, \
             or `outbox dead purge` it",
            sizes.join(", and "),
            settings.join(" and ")
        ),
    }
}

/// The sizes of a claimed row, in bytes, as the database measured them before sending any of
/// it: what [`ClaimSort`] decides on without loading an oversized column.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowBytes {
    /// The payload's text.
    pub payload: u64,
    /// Every other column the claim reads, as text, added up: id, aggregate type, aggregate
    /// id, event type, destination, headers and idempotency key. (Times and counts are
    /// fixed-size numbers in every store, and not counted.)
    pub metadata: u64,
}

impl RowBytes {
    /// The reason to bury a row of these sizes under `request`'s limits, or `None` when it may
    /// be loaded.
    ///
    /// ```
    /// use outbox_types::{ClaimRequest, DeadLetterPolicy, RowBytes};
    /// let request = ClaimRequest::new("r", 10, std::time::Duration::from_secs(30), DeadLetterPolicy::Block)
    ///     .with_byte_limits(1_000_000, 100)
    ///     .with_metadata_limit(50);
    /// assert!(RowBytes { payload: 100, metadata: 50 }.over_limits(7, &request).is_none());
    /// let both = RowBytes { payload: 101, metadata: 51 }.over_limits(7, &request).unwrap();
    /// assert!(both.error.contains("101 bytes, above relay.max_payload_bytes = 100"));
    /// assert!(both.error.contains("51 bytes together, above relay.max_metadata_bytes = 50"));
    /// ```
    pub fn over_limits(self, seq: i64, request: &ClaimRequest) -> Option<BuryEvent> {
        let mut over = Vec::new();
        if self.payload > request.max_payload_bytes {
            over.push(OverLimit {
                what: "the payload is",
                bytes: self.payload,
                setting: "relay.max_payload_bytes",
                limit: request.max_payload_bytes,
            });
        }
        if self.metadata > request.max_metadata_bytes {
            over.push(metadata_over(self.metadata, request.max_metadata_bytes));
        }
        (!over.is_empty()).then(|| bury_over_limits(seq, &over))
    }

    /// What the row counts toward [`ClaimRequest::max_batch_bytes`]: the whole row, or nothing
    /// for a row over a limit (it is buried, not loaded).
    pub fn batch_bytes(self, request: &ClaimRequest) -> u64 {
        if self.payload > request.max_payload_bytes || self.metadata > request.max_metadata_bytes {
            0
        } else {
            self.payload.saturating_add(self.metadata)
        }
    }
}

/// Why a store reads a row, which decides what it makes of a malformed one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// To deliver it: anything malformed is an error, and the claim buries the row.
    Delivery,
    /// To show it to an operator (`outbox dead list|show`): what is malformed is shown as well
    /// as it can be (the row is probably dead for exactly that reason, and must still be
    /// listed).
    Display,
}

/// A payload stored in a text column (SQLite, MySQL), where a foreign writer can store anything:
/// for delivery it must be JSON (every sink labels it so); for display it is shown as it is.
pub fn check_payload(seq: i64, payload: String, reading: Reading) -> Result<String, StoreError> {
    if reading == Reading::Delivery
        && let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&payload)
    {
        return Err(StoreError::Corrupt {
            seq,
            reason: format!("payload is not JSON ({e})"),
        });
    }
    Ok(payload)
}

/// Sorts the rows a claim statement returned into events to hand out and rows to bury, the same
/// way in every store: a row over [`ClaimRequest::max_payload_bytes`] or
/// [`ClaimRequest::max_metadata_bytes`] is buried unread ([`RowBytes::over_limits`]), a row that
/// cannot be decoded is buried with the reason ([`bury_malformed`]), and under
/// [`DeadLetterPolicy::Block`] the later events of their aggregates in the same claim are
/// released ([`held_behind_buried`]).
///
/// The store's statement measures each row's columns and sends none of an oversized row's but
/// its aggregate key, and that only when the key itself is within
/// [`ClaimRequest::max_metadata_bytes`]: a key over it is `None` here. No event the claim hands
/// out can belong to such an aggregate (its own columns would be over the limit too), so
/// nothing waits behind it in this claim; the database's own ordering holds the aggregate from
/// the next claim on.
///
/// ```
/// use outbox_types::{AggregateKey, ClaimRequest, ClaimSort, DeadLetterPolicy, RowBytes, StoreError};
/// # fn ev(seq: i64, agg: &str) -> outbox_types::Event {
/// #   outbox_types::NewEvent::from_json("t", agg, "E", "{}").unwrap().claimed(seq) }
/// let request = ClaimRequest::new("r", 10, std::time::Duration::from_secs(30), DeadLetterPolicy::Block)
///     .with_byte_limits(1_000_000, 100)
///     .with_metadata_limit(1_000);
/// let key = |a: &str| Ok(Some(AggregateKey { aggregate_type: "t".into(), aggregate_id: a.into() }));
/// let small = RowBytes { payload: 2, metadata: 60 };
/// let mut sort = ClaimSort::new(&request);
/// sort.row(1, small, || key("a"), || Ok(ev(1, "a")))?;
/// let big = RowBytes { payload: 5_000, metadata: 60 };
/// let buried = sort.row(2, big, || key("a"), || unreachable!("never loaded"))?;
/// assert!(buried.unwrap().contains("5000 bytes"));
/// sort.row(3, small, || key("a"), || Ok(ev(3, "a")))?;
/// sort.row(4, small, || key("b"), || Err(StoreError::Corrupt { seq: 4, reason: "bad".into() }))?;
/// // An aggregate key of 50 MB: over the limit by itself, so the store does not send it.
/// let huge = RowBytes { payload: 2, metadata: 50_000_000 };
/// sort.row(5, huge, || Ok(None), || unreachable!("never loaded"))?;
/// let sorted = sort.finish();
/// assert_eq!(sorted.events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1]);
/// assert_eq!(sorted.bury.len(), 3);
/// assert_eq!(sorted.release, vec![3]);
/// # Ok::<(), StoreError>(())
/// ```
pub struct ClaimSort<'r> {
    request: &'r ClaimRequest,
    events: Vec<Event>,
    bury: Vec<BuryEvent>,
    buried: Vec<(i64, AggregateKey)>,
}

/// A claim sorted by [`ClaimSort`].
#[derive(Debug, Default)]
pub struct SortedClaim {
    /// To hand out, in `seq` order.
    pub events: Vec<Event>,
    /// To bury now, under the claim's lease.
    pub bury: Vec<BuryEvent>,
    /// To release now (held behind a buried row of their aggregate).
    pub release: Vec<i64>,
}

impl SortedClaim {
    /// Bury and release under `lease` what the sort decided, and return the claim to hand out.
    pub async fn into_claim<S: Store + ?Sized>(
        self,
        store: &S,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        if !self.bury.is_empty() {
            store.bury(&lease, &self.bury).await?;
        }
        if !self.release.is_empty() {
            store.release(&lease, &self.release).await?;
        }
        Ok(Claim {
            lease,
            buried: self.bury.len() as u64,
            events: self.events,
        })
    }
}

impl<'r> ClaimSort<'r> {
    /// Sorting for `request`'s limits and dead-letter policy.
    pub fn new(request: &'r ClaimRequest) -> Self {
        ClaimSort {
            request,
            events: Vec::new(),
            bury: Vec::new(),
            buried: Vec::new(),
        }
    }

    /// One claimed row: its `seq`, its sizes as the database measured them, its aggregate
    /// (`None` when the store did not send a key over [`ClaimRequest::max_metadata_bytes`]),
    /// and how to decode it (not called when the row is over a limit). Returns the reason when
    /// the row is to be buried, for the store's log.
    pub fn row(
        &mut self,
        seq: i64,
        bytes: RowBytes,
        aggregate: impl FnOnce() -> Result<Option<AggregateKey>, StoreError>,
        decode: impl FnOnce() -> Result<Event, StoreError>,
    ) -> Result<Option<&str>, StoreError> {
        let bury = match bytes.over_limits(seq, self.request) {
            Some(bury) => bury,
            None => match decode() {
                Ok(event) => {
                    self.events.push(event);
                    return Ok(None);
                }
                Err(error) => bury_malformed(seq, &error),
            },
        };
        if let Some(key) = aggregate()? {
            self.buried.push((seq, key));
        }
        self.bury.push(bury);
        Ok(self.bury.last().map(|b| b.error.as_str()))
    }

    /// The events to hand out, the rows to bury and the events to release.
    pub fn finish(mut self) -> SortedClaim {
        self.events.sort_unstable_by_key(|e| e.seq);
        let release = held_behind_buried(&mut self.events, &self.buried, self.request.dead_letter);
        SortedClaim {
            events: self.events,
            bury: self.bury,
            release,
        }
    }
}

/// The events of a claim that must wait behind a row the same claim buried (malformed or
/// oversized): under [`DeadLetterPolicy::Block`], every event of `events` that comes after a
/// buried row of its aggregate. They are taken out of `events` and their seqs returned, for the
/// store to release them (no attempt counted); under `Skip` nothing is held.
///
/// Without this, the claim would hand out an aggregate's later events while its earlier one
/// went dead in the same statement: an order violation the relay cannot see.
///
/// ```
/// use outbox_types::{AggregateKey, DeadLetterPolicy, held_behind_buried};
/// # fn ev(seq: i64, agg: &str) -> outbox_types::Event {
/// #   outbox_types::NewEvent::from_json("t", agg, "E", "{}").unwrap().claimed(seq) }
/// let mut events = vec![ev(1, "a"), ev(3, "a"), ev(4, "b")];
/// let buried = [(2, AggregateKey { aggregate_type: "t".into(), aggregate_id: "a".into() })];
/// let held = held_behind_buried(&mut events, &buried, DeadLetterPolicy::Block);
/// assert_eq!(held, vec![3]);
/// assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 4]);
/// ```
pub fn held_behind_buried(
    events: &mut Vec<Event>,
    buried: &[(i64, AggregateKey)],
    policy: DeadLetterPolicy,
) -> Vec<i64> {
    if buried.is_empty() || policy != DeadLetterPolicy::Block {
        return Vec::new();
    }
    let mut held = Vec::new();
    events.retain(|e| {
        let behind = buried.iter().any(|(seq, key)| {
            e.seq > *seq
                && e.aggregate_type == key.aggregate_type
                && e.aggregate_id == key.aggregate_id
        });
        if behind {
            held.push(e.seq);
        }
        !behind
    });
    held
}

/// A delivery given up on.
#[derive(Clone, Debug)]
pub struct BuryEvent {
    /// The event.
    pub seq: i64,
    /// Why (stored truncated).
    pub error: String,
}

/// Which dead events an admin operation applies to.
#[derive(Clone, Debug)]
pub enum DeadFilter {
    /// These ids (ids that are not dead are ignored).
    Ids(Vec<EventId>),
    /// Every dead event.
    All,
}

/// Counts and lag, for `outbox status` and metrics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OutboxStats {
    /// Waiting for delivery (including those waiting for a retry).
    pub pending: u64,
    /// Pending events that already failed at least once.
    pub retrying: u64,
    /// Claimed by a relay right now.
    pub in_flight: u64,
    /// Acknowledged and not yet purged.
    pub delivered: u64,
    /// Given up on.
    pub dead: u64,
    /// When the oldest undelivered (pending or in-flight) event was enqueued.
    pub oldest_pending_enqueued_at: Option<DateTime<Utc>>,
    /// The database's clock when the figures were read.
    pub observed_at: Option<DateTime<Utc>>,
}

impl OutboxStats {
    /// Age of the oldest undelivered event: how far behind the relay is.
    pub fn oldest_pending_age(&self) -> Option<Duration> {
        let oldest = self.oldest_pending_enqueued_at?;
        let now = self.observed_at.unwrap_or_else(Utc::now);
        (now - oldest).to_std().ok().or(Some(Duration::ZERO))
    }
}

/// Backlog of one destination, for `outbox status` and the per-destination gauges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestinationStats {
    /// The destination, as resolved by the route table; `None` for events no route matches.
    pub destination: Option<String>,
    /// Waiting for delivery (including those waiting for a retry).
    pub pending: u64,
    /// Pending events that already failed at least once.
    pub retrying: u64,
    /// Claimed by a relay right now.
    pub in_flight: u64,
    /// Given up on.
    pub dead: u64,
    /// When the oldest undelivered (pending or in-flight) event was enqueued.
    pub oldest_pending_enqueued_at: Option<DateTime<Utc>>,
    /// The error of its newest undelivered event that failed before (what the destination said
    /// last, as stored: truncated); `None` when none did.
    #[serde(default)]
    pub last_error: Option<String>,
}

/// A relay holding claims, for `outbox status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseHolder {
    /// The relay (its `relay_id`).
    pub owner: String,
    /// Events it holds in flight.
    pub events: u64,
    /// When it claimed the oldest of them.
    pub claimed_since: Option<DateTime<Utc>>,
    /// When its latest lease runs out.
    pub expires_at: Option<DateTime<Utc>>,
    /// Of its events, how many are under a lease that has already run out (the relay died or
    /// stalled; another relay may claim them).
    pub expired: u64,
}

/// A destination an operator paused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedDestination {
    /// Its name.
    pub destination: String,
    /// Since when (database clock).
    pub paused_at: DateTime<Utc>,
    /// Who paused it (free text: user, host).
    pub paused_by: String,
}

/// Which delivered events a replay sends again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayFilter {
    /// Written (enqueued) at or after this time.
    pub from: DateTime<Utc>,
    /// Written before this time.
    pub to: DateTime<Utc>,
    /// Only events routed to this destination (resolved with the route table given).
    pub destination: Option<String>,
    /// Only events of this exact type.
    pub event_type: Option<String>,
}

/// What one step of a replay did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayStep {
    /// Events put back to pending by this step.
    pub replayed: u64,
    /// Where the next step starts (`after_seq`); `None` once the range is done.
    pub next_after: Option<i64>,
}

/// A database that keeps the outbox.
///
/// Implementations must be safe to call concurrently, from several tasks and several processes
/// sharing one database. Every write after a claim takes the claim's [`Lease`] and only changes
/// rows still held under that lease's token; the returned count says how many did (the rest were
/// *fenced*: their lease expired and someone else claimed them).
///
/// The same conformance suite (`outbox-store-tests`) runs against every implementation.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claim up to `request.limit` due events, respecting per-aggregate order (see the module
    /// docs). Returns an empty claim when nothing is due.
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError>;

    /// Mark events delivered. One statement for the whole batch.
    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError>;

    /// Send failed events back to `pending` with their error and a later due time; `attempts + 1`
    /// where [`RetryEvent::counts_attempt`], else unchanged (see there).
    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError>;

    /// Mark events dead with `attempts + 1` and their error.
    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError>;

    /// Give claimed events back untouched (no attempt counted): used for events not published
    /// because an earlier event of their aggregate failed, or because the relay is stopping.
    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError>;

    /// Counts per state and the age of the oldest undelivered event.
    async fn stats(&self) -> Result<OutboxStats, StoreError>;

    /// One event by id, in whatever state.
    async fn get(&self, id: EventId) -> Result<Option<EventRecord>, StoreError>;

    /// Dead events in enqueue order, starting after `after_seq`, at most `limit`.
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: u32,
    ) -> Result<Vec<EventRecord>, StoreError>;

    /// Make dead events pending again with their attempts reset, due now. Returns how many.
    ///
    /// "Due now" means due no later than now: a store keeps an earlier due time (the one the
    /// event was last claimed at) rather than moving it forward. A claim that compares due times
    /// with a clock read before this write committed, but reads rows after it, must see the
    /// event due. Were it not due, a pending event with no attempts would hold nothing back, so
    /// that claim could take the event's later, due events ahead of it (seen on MySQL, where a
    /// statement's `UTC_TIMESTAMP()` is read before its snapshot is taken).
    async fn requeue_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError>;

    /// Delete dead events for good. Returns how many.
    async fn discard_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError>;

    /// Delete up to `limit` delivered events acknowledged longer than `older_than` ago, oldest
    /// first. Never touches an event in any other state. Returns how many were deleted.
    async fn purge_delivered(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError>;

    /// Check the database answers and the schema is current (readiness).
    async fn check(&self) -> Result<(), StoreError>;

    /// Undelivered and dead counts per destination, as `routes` resolves them (one entry per
    /// destination that has any, plus one with `destination: None` for unroutable events).
    async fn destination_stats(
        &self,
        routes: &RouteTable,
    ) -> Result<Vec<DestinationStats>, StoreError> {
        let _ = routes;
        Err(self.unsupported("destination_stats"))
    }

    /// The relays holding claims right now, with how many events and since when.
    async fn leases(&self) -> Result<Vec<LeaseHolder>, StoreError> {
        Err(self.unsupported("leases"))
    }

    /// Pause `destination`: running relays stop claiming its events within one poll interval.
    /// Returns false if it was already paused.
    async fn pause(&self, destination: &str, by: &str) -> Result<bool, StoreError> {
        let _ = (destination, by);
        Err(self.unsupported("pause"))
    }

    /// Resume a paused destination. Returns false if it was not paused.
    async fn resume(&self, destination: &str) -> Result<bool, StoreError> {
        let _ = destination;
        Err(self.unsupported("resume"))
    }

    /// The paused destinations.
    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError> {
        Err(self.unsupported("paused"))
    }

    /// One step of a replay: put up to `limit` delivered events matching `filter` with
    /// `seq > after_seq` back to `pending` (attempts reset, due now at the latest, as for
    /// [`requeue_dead`](Self::requeue_dead)), keeping their ids and their place in enqueue
    /// order, so consumers see them again and deduplicate on the id.
    /// Call again with [`ReplayStep::next_after`] until it is `None`.
    async fn replay(
        &self,
        filter: &ReplayFilter,
        routes: &RouteTable,
        after_seq: Option<i64>,
        limit: u32,
    ) -> Result<ReplayStep, StoreError> {
        let _ = (filter, routes, after_seq, limit);
        Err(self.unsupported("replay"))
    }

    /// Delete up to `limit` dead events buried longer than `older_than` ago (dead-letter
    /// retention). Returns how many.
    async fn purge_dead(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        let _ = (older_than, limit);
        Err(self.unsupported("purge_dead"))
    }

    /// A short name of the store for messages (`postgres`, `sqlite`, `mysql`).
    fn kind(&self) -> &'static str {
        "custom"
    }

    #[doc(hidden)]
    fn unsupported(&self, operation: &'static str) -> StoreError {
        StoreError::Unsupported {
            store: self.kind(),
            operation,
        }
    }
}
