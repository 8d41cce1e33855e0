//! What the WAL source holds in memory between the replication stream and the relay engine.
//!
//! # Two owners for every event
//!
//! An event is delivered either **from the stream** (decoded from the WAL and handed to the
//! engine at once: the fast path, no row written to claim it) or **from the table** (claimed like
//! the polling relay claims, under a lease). Which one depends on its aggregate:
//!
//! - An aggregate is *owned by the table* while the table holds an open event of it that comes
//!   first: a retry waiting for its backoff, a dead event under the `block` policy, events given
//!   back because an earlier one failed, events of a paused destination after it was resumed,
//!   rows left undelivered when the session started that the stream will not send again. Every newer event of such an aggregate the
//!   stream decodes is *handed back* to the table too (a table row is already there; a logical
//!   message is inserted as a row), so it goes out after the older ones, by table claims, in
//!   order.
//! - Every other aggregate's events go out from the stream.
//!
//! The table never claims a row the stream holds: table claims are bounded by the lowest seq
//! the stream holds and the highest it has seen (see [`State::table_bound`]). A row the table
//! claimed that the stream decodes later (a long transaction that committed late) is checked
//! against the table before it is published and skipped if it was settled already.
//!
//! # Which WAL position may be confirmed
//!
//! PostgreSQL re-sends, after a restart, every transaction whose commit lies at or after the
//! slot's confirmed position. The confirmed position moves past a transaction only once every
//! event of it, and of every earlier transaction, is *settled*: delivered and (for table rows)
//! marked delivered, dead-lettered, or handed to the table durably. Confirming anything earlier
//! is what loses events; confirming later only costs duplicates after a crash.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use outbox_types::{AggregateKey, Event, Hold};
use uuid::Uuid;

use crate::lsn::Lsn;

/// Where an event came from: decides how it is marked delivered, handed back or buried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// A row of the outbox table (its `seq` is the row's primary key).
    Table,
    /// A logical message (its `seq` is the message's LSN).
    Message,
}

/// An event decoded from the stream.
#[derive(Debug)]
pub(crate) struct Item {
    pub event: Event,
    pub origin: Origin,
    /// The transaction whose position it holds (`None`: none).
    pub tx: Option<u64>,
    /// The streaming session that decoded it.
    pub epoch: u64,
    pub bytes: usize,
    /// It cannot be delivered (unreadable, too large): dead-letter it with this reason.
    pub dead: Option<String>,
    /// A table row the table may have settled already (see the module docs): check it before
    /// publishing.
    pub check: bool,
    /// Its place in stream order (counts every event decoded).
    arrival: u64,
}

impl Item {
    pub fn aggregate(&self) -> AggregateKey {
        AggregateKey {
            aggregate_type: self.event.aggregate_type.clone(),
            aggregate_id: self.event.aggregate_id.clone(),
        }
    }
}

/// What the state keeps of an event the engine claimed from the stream.
#[derive(Clone, Debug)]
pub(crate) struct Out {
    pub origin: Origin,
    pub tx: Option<u64>,
    pub epoch: u64,
    pub bytes: usize,
    pub aggregate: AggregateKey,
    /// The whole event, for messages (handing one back or burying it inserts it as a row).
    pub event: Option<Event>,
}

/// Open table events known of an aggregate the table owns, and inserts under way.
#[derive(Debug, Default)]
struct Owned {
    seqs: BTreeSet<i64>,
    inserting: u32,
}

struct Tx {
    end: Option<Lsn>,
    open: u64,
}

/// The events of one aggregate waiting to be claimed, in stream order.
#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    /// Its key in [`State::ready`] while it is there.
    ready_at: Option<u64>,
}

/// What [`State::take`] decided for the events waiting.
#[derive(Default)]
pub(crate) struct Taken {
    /// Handed to the engine, in stream order (the lease is registered).
    pub batch: Vec<Event>,
    /// Messages whose aggregate the table owns: to insert as pending rows.
    pub hand_back: Vec<(Event, Out)>,
    /// Items that cannot be delivered: to dead-letter.
    pub dead: Vec<Item>,
    /// Table rows of the batch to check against the table before publishing.
    pub check: Vec<i64>,
}

/// The in-memory side of a WAL source. See the module docs.
pub(crate) struct State {
    /// The current streaming session; events of earlier sessions no longer hold positions.
    pub epoch: u64,
    txs: VecDeque<Tx>,
    tx_base: u64,
    current_tx: Option<u64>,
    pub commit_time: Option<chrono::DateTime<chrono::Utc>>,
    /// The newest position that may be confirmed.
    ack: Lsn,
    /// Decoded, not yet claimed: per aggregate, in stream order.
    waiting: HashMap<AggregateKey, Queue>,
    /// The aggregates with events waiting and none out, by the arrival of their first waiting
    /// event: a claim takes from the front, so it costs what it takes, not what waits.
    ready: BTreeMap<u64, AggregateKey>,
    /// How many events wait.
    waiting_count: usize,
    /// The arrival number of the next event decoded.
    arrivals: u64,
    /// Stream events claimed and not settled, per aggregate.
    out: HashMap<AggregateKey, u32>,
    /// Stream leases: what each claimed event is.
    leases: HashMap<Uuid, HashMap<i64, Out>>,
    /// Table rows the stream holds (waiting, claimed, or being written), counted per seq.
    held: BTreeMap<i64, u32>,
    /// The highest table seq the stream has decoded.
    pub seen_max: i64,
    /// The end of the last transaction decoded.
    pub decoded_end: Lsn,
    /// Table rows up to this seq may have been settled by the table: check them.
    pub check_up_to: i64,
    /// Aggregates the table owns.
    owned: HashMap<AggregateKey, Owned>,
    /// Aggregates whose events went to the table because their destination was paused, with
    /// those events; they become the table's when the destination resumes.
    paused: HashMap<AggregateKey, Owned>,
    paused_names: Vec<String>,
    /// Table leases: the events of each table claim.
    table_leases: HashMap<Uuid, Vec<(i64, AggregateKey)>>,
    pub buffered_events: usize,
    pub buffered_bytes: usize,
}

impl State {
    pub fn new() -> Self {
        State {
            epoch: 0,
            txs: VecDeque::new(),
            tx_base: 0,
            current_tx: None,
            commit_time: None,
            ack: Lsn::ZERO,
            waiting: HashMap::new(),
            ready: BTreeMap::new(),
            waiting_count: 0,
            arrivals: 0,
            out: HashMap::new(),
            leases: HashMap::new(),
            held: BTreeMap::new(),
            seen_max: 0,
            decoded_end: Lsn::ZERO,
            check_up_to: 0,
            owned: HashMap::new(),
            paused: HashMap::new(),
            paused_names: Vec::new(),
            table_leases: HashMap::new(),
            buffered_events: 0,
            buffered_bytes: 0,
        }
    }

    /// A new streaming session starts from `confirmed`: what the previous one decoded and did
    /// not hand out is dropped (the server sends it again); table rows it saw may come again
    /// and are checked.
    pub fn begin_session(&mut self, confirmed: Lsn) {
        self.epoch += 1;
        self.ready.clear();
        self.waiting_count = 0;
        for (_, queue) in std::mem::take(&mut self.waiting) {
            for item in &queue.items {
                self.forget(item);
            }
        }
        self.txs.clear();
        self.tx_base = 0;
        self.current_tx = None;
        self.commit_time = None;
        self.ack = confirmed;
        self.check_up_to = self.check_up_to.max(self.seen_max);
    }

    fn forget(&mut self, item: &Item) {
        self.buffered_events = self.buffered_events.saturating_sub(1);
        self.buffered_bytes = self.buffered_bytes.saturating_sub(item.bytes);
        if item.origin == Origin::Table {
            self.unhold(item.event.seq);
        }
    }

    fn hold(&mut self, seq: i64) {
        *self.held.entry(seq).or_insert(0) += 1;
    }

    fn unhold(&mut self, seq: i64) {
        if let Some(n) = self.held.get_mut(&seq) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&seq);
            }
        }
    }

    /// The newest position that may be confirmed.
    pub fn ack(&self) -> Lsn {
        self.ack
    }

    pub fn begin(&mut self, commit_time: chrono::DateTime<chrono::Utc>) {
        let id = self.tx_base + self.txs.len() as u64;
        self.txs.push_back(Tx { end: None, open: 0 });
        self.current_tx = Some(id);
        self.commit_time = Some(commit_time);
    }

    pub fn commit(&mut self, end: Lsn) {
        if let Some(id) = self.current_tx.take()
            && let Some(tx) = self.tx_mut(id)
        {
            tx.end = Some(end);
        }
        self.decoded_end = self.decoded_end.max(end);
        self.commit_time = None;
        self.advance();
    }

    /// A keepalive: with nothing open, everything up to `wal_end` is settled.
    pub fn keepalive(&mut self, wal_end: Lsn) {
        if self.txs.is_empty() && self.current_tx.is_none() && wal_end > self.ack {
            self.ack = wal_end;
        }
    }

    fn tx_mut(&mut self, id: u64) -> Option<&mut Tx> {
        let i = id.checked_sub(self.tx_base)?;
        self.txs.get_mut(usize::try_from(i).ok()?)
    }

    fn advance(&mut self) {
        while let Some(front) = self.txs.front() {
            match front.end {
                Some(end) if front.open == 0 => {
                    if end > self.ack {
                        self.ack = end;
                    }
                    self.txs.pop_front();
                    self.tx_base += 1;
                }
                _ => break,
            }
        }
    }

    /// The transaction an event joins: the current one (`in_tx`), a standalone
    /// non-transactional message ending at `standalone_end`, or none.
    fn join_tx(&mut self, in_tx: bool, standalone_end: Option<Lsn>) -> Option<u64> {
        let tx = if in_tx {
            self.current_tx
        } else if let Some(end) = standalone_end {
            let id = self.tx_base + self.txs.len() as u64;
            self.txs.push_back(Tx {
                end: Some(end),
                open: 0,
            });
            Some(id)
        } else {
            None
        };
        if let Some(id) = tx
            && let Some(t) = self.tx_mut(id)
        {
            t.open += 1;
        }
        tx
    }

    /// An event of the stream settled: its transaction's position may move on.
    pub fn settle(&mut self, tx: Option<u64>, epoch: u64) {
        if epoch != self.epoch {
            return;
        }
        if let Some(id) = tx {
            if let Some(t) = self.tx_mut(id) {
                t.open = t.open.saturating_sub(1);
            }
            self.advance();
        }
    }

    /// Add a decoded event (or one that cannot be delivered: `dead`).
    pub fn push(
        &mut self,
        event: Event,
        origin: Origin,
        in_tx: bool,
        standalone_end: Option<Lsn>,
        dead: Option<String>,
    ) {
        let tx = self.join_tx(in_tx, standalone_end);
        let bytes = crate::limits::event_bytes(&event) + 64;
        let check = origin == Origin::Table && event.seq <= self.check_up_to;
        if origin == Origin::Table {
            self.seen_max = self.seen_max.max(event.seq);
            self.hold(event.seq);
        }
        self.buffered_events += 1;
        self.buffered_bytes += bytes;
        let arrival = self.arrivals;
        self.arrivals += 1;
        let item = Item {
            event,
            origin,
            tx,
            epoch: self.epoch,
            bytes,
            dead,
            check,
            arrival,
        };
        let aggregate = item.aggregate();
        self.waiting_count += 1;
        match self.waiting.get_mut(&aggregate) {
            Some(queue) => queue.items.push_back(item),
            None => {
                let mut queue = Queue::default();
                queue.items.push_back(item);
                self.waiting.insert(aggregate.clone(), queue);
                self.make_ready(&aggregate);
            }
        }
    }

    /// Put `aggregate` among the ready ones if events of it wait and none is out.
    fn make_ready(&mut self, aggregate: &AggregateKey) {
        if self.out.contains_key(aggregate) {
            return;
        }
        if let Some(queue) = self.waiting.get_mut(aggregate)
            && queue.ready_at.is_none()
            && let Some(head) = queue.items.front()
        {
            queue.ready_at = Some(head.arrival);
            self.ready.insert(head.arrival, aggregate.clone());
        }
    }

    /// Whether anything waits to be claimed.
    #[cfg(test)]
    pub fn has_waiting(&self) -> bool {
        self.waiting_count > 0
    }

    /// Whether a claim would find something to do: an event of an aggregate with nothing out
    /// (to take, hand back or bury). Events waiting behind ones out are not.
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Nothing held: every event decoded was settled.
    pub fn is_idle(&self) -> bool {
        self.waiting_count == 0
            && self.out.is_empty()
            && self.held.is_empty()
            && self.buffered_events == 0
    }

    /// The highest seq a table claim may take: below every table row the stream holds, and not
    /// above what the stream has seen (rows past it are the stream's to deliver) unless the
    /// stream does not read table rows at all.
    pub fn table_bound(&self, streams_table: bool) -> i64 {
        let below_held = self
            .held
            .keys()
            .next()
            .map(|lowest| lowest - 1)
            .unwrap_or(i64::MAX);
        if streams_table {
            below_held.min(self.seen_max.max(self.check_up_to))
        } else {
            below_held
        }
    }

    /// A one-line summary for debug logs.
    pub fn summary(&self) -> String {
        format!(
            "waiting {}, out {}, stream leases {}, held {} (lowest {:?}), seen {}, check {}, owned {}, buffered {}",
            self.waiting_count,
            self.out.values().sum::<u32>(),
            self.leases.len(),
            self.held.len(),
            self.held.keys().next(),
            self.seen_max,
            self.check_up_to,
            self.owned.len(),
            self.buffered_events
        )
    }

    fn owns(&self, aggregate: &AggregateKey) -> bool {
        self.owned.contains_key(aggregate)
    }

    /// The table owns `aggregate` from now on, with its open event `seq`.
    pub fn own(&mut self, aggregate: AggregateKey, seq: i64) {
        self.owned.entry(aggregate).or_default().seqs.insert(seq);
    }

    /// An insert that will give the table an event of `aggregate` is under way.
    fn own_inserting(&mut self, aggregate: AggregateKey) {
        self.owned.entry(aggregate).or_default().inserting += 1;
    }

    /// An insert under way for `aggregate` finished (with the new row's seq when it wrote one).
    pub fn inserted(&mut self, aggregate: &AggregateKey, seq: Option<i64>) {
        if let Some(owned) = self.owned.get_mut(aggregate) {
            owned.inserting = owned.inserting.saturating_sub(1);
            if let Some(seq) = seq {
                owned.seqs.insert(seq);
            }
        }
        self.drop_if_done(aggregate);
    }

    /// The table settled its event `seq` of `aggregate` (delivered, or dead under `skip`).
    pub fn table_done(&mut self, aggregate: &AggregateKey, seq: i64) {
        if let Some(owned) = self.owned.get_mut(aggregate) {
            owned.seqs.remove(&seq);
        }
        self.drop_if_done(aggregate);
    }

    fn drop_if_done(&mut self, aggregate: &AggregateKey) {
        if self
            .owned
            .get(aggregate)
            .is_some_and(|o| o.seqs.is_empty() && o.inserting == 0)
        {
            self.owned.remove(aggregate);
        }
    }

    /// Every seq the table is known to hold for the aggregates it owns (for reconciliation).
    pub fn owned_seqs(&self) -> Vec<i64> {
        self.owned
            .values()
            .flat_map(|o| o.seqs.iter().copied())
            .collect()
    }

    /// Forget owned seqs the table no longer holds open (delivered, discarded, purged).
    pub fn reconcile(&mut self, gone: &HashSet<i64>) {
        if gone.is_empty() {
            return;
        }
        let mut empty = Vec::new();
        for (aggregate, owned) in &mut self.owned {
            owned.seqs.retain(|s| !gone.contains(s));
            if owned.seqs.is_empty() && owned.inserting == 0 {
                empty.push(aggregate.clone());
            }
        }
        for aggregate in empty {
            self.owned.remove(&aggregate);
        }
    }

    /// How many aggregates the table owns.
    pub fn owned_count(&self) -> usize {
        self.owned.len()
    }

    /// The destinations paused now changed: aggregates whose events went to the table while
    /// their destination was paused become the table's once it resumes, so the events waiting
    /// there go out before newer ones.
    pub fn set_paused(&mut self, hold: Option<&Hold>) {
        let names: Vec<String> = hold.map(|h| h.paused.clone()).unwrap_or_default();
        if names == self.paused_names {
            return;
        }
        self.paused_names = names;
        for (aggregate, owned) in std::mem::take(&mut self.paused) {
            let into = self.owned.entry(aggregate).or_default();
            into.seqs.extend(owned.seqs);
            into.inserting += owned.inserting;
        }
    }

    /// Take what may be claimed from the stream now: up to `limit` events (and, past the first,
    /// `max_bytes` of whole events: payload and every other column, as a table claim counts) of aggregates that have nothing out and that the table does not
    /// own, in stream order. Events of aggregates the table owns, or of a destination on
    /// `hold`, are handed back; items that cannot be delivered are returned to be buried.
    pub fn take(
        &mut self,
        limit: usize,
        max_bytes: u64,
        hold: Option<&Hold>,
        token: Uuid,
    ) -> Taken {
        let mut taken = Taken::default();
        let mut lease: HashMap<i64, Out> = HashMap::new();
        let mut bytes: u64 = 0;
        let mut in_batch: HashMap<AggregateKey, u32> = HashMap::new();
        // The ready aggregate whose first waiting event came first holds the next event in
        // stream order among those that may go; an aggregate taken from goes back in at its
        // next event, so a batch may hold several events of one aggregate, in order.
        'claim: while let Some((_, aggregate)) = self.ready.pop_first() {
            let Some(mut queue) = self.waiting.remove(&aggregate) else {
                continue;
            };
            queue.ready_at = None;
            let mut blocked = false;
            while let Some(item) = queue.items.pop_front() {
                if item.dead.is_some() {
                    self.waiting_count -= 1;
                    taken.dead.push(item);
                    continue;
                }
                if self.owns(&aggregate) {
                    self.waiting_count -= 1;
                    self.hand_back(item, aggregate.clone(), &mut taken, false);
                    continue;
                }
                let paused = hold.is_some_and(|h| {
                    h.routes
                        .resolve_event(&item.event)
                        .is_some_and(|d| h.paused.iter().any(|p| p == d))
                });
                if paused {
                    self.waiting_count -= 1;
                    self.hand_back(item, aggregate.clone(), &mut taken, true);
                    continue;
                }
                let full =
                    taken.batch.len() >= limit || (!taken.batch.is_empty() && bytes >= max_bytes);
                if full {
                    queue.items.push_front(item);
                    self.put_back(aggregate, queue);
                    break 'claim;
                }
                if lease.contains_key(&item.event.seq) {
                    // The same row twice in one claim: the second waits for the first.
                    queue.items.push_front(item);
                    blocked = true;
                    break;
                }
                self.waiting_count -= 1;
                bytes = bytes.saturating_add(crate::limits::event_bytes(&item.event) as u64);
                if item.check {
                    taken.check.push(item.event.seq);
                }
                *in_batch.entry(aggregate.clone()).or_insert(0) += 1;
                lease.insert(
                    item.event.seq,
                    Out {
                        origin: item.origin,
                        tx: item.tx,
                        epoch: item.epoch,
                        bytes: item.bytes,
                        aggregate: aggregate.clone(),
                        event: (item.origin == Origin::Message).then(|| item.event.clone()),
                    },
                );
                taken.batch.push(item.event);
                break;
            }
            if blocked {
                self.waiting.insert(aggregate, queue);
            } else {
                self.put_back(aggregate, queue);
            }
        }
        // What went out is not ready until it settles.
        for (aggregate, n) in in_batch {
            if let Some(at) = self
                .waiting
                .get_mut(&aggregate)
                .and_then(|q| q.ready_at.take())
            {
                self.ready.remove(&at);
            }
            *self.out.entry(aggregate).or_insert(0) += n;
        }
        if !lease.is_empty() {
            self.leases.insert(token, lease);
        }
        taken
    }

    /// Return an aggregate's queue after a claim looked at it: ready again at its next event.
    fn put_back(&mut self, aggregate: AggregateKey, mut queue: Queue) {
        let Some(head) = queue.items.front() else {
            return;
        };
        queue.ready_at = Some(head.arrival);
        self.ready.insert(head.arrival, aggregate.clone());
        self.waiting.insert(aggregate, queue);
    }

    /// An event of an aggregate the table owns (or of a paused destination) goes to the table:
    /// a table row is there already, so its position is settled now; a message is returned to
    /// be inserted as a row.
    fn hand_back(&mut self, item: Item, aggregate: AggregateKey, taken: &mut Taken, paused: bool) {
        let seq = item.event.seq;
        match item.origin {
            Origin::Table => {
                let target = if paused {
                    &mut self.paused
                } else {
                    &mut self.owned
                };
                target.entry(aggregate).or_default().seqs.insert(seq);
                self.settle(item.tx, item.epoch);
                self.forget(&item);
            }
            Origin::Message => {
                let target = if paused {
                    &mut self.paused
                } else {
                    &mut self.owned
                };
                target.entry(aggregate.clone()).or_default().inserting += 1;
                let out = Out {
                    origin: Origin::Message,
                    tx: item.tx,
                    epoch: item.epoch,
                    bytes: item.bytes,
                    aggregate,
                    event: None,
                };
                taken.hand_back.push((item.event, out));
            }
        }
    }

    /// A message handed back (or buried) was written as a row: its position may move on.
    pub fn written(&mut self, out: &Out) {
        self.buffered_events = self.buffered_events.saturating_sub(1);
        self.buffered_bytes = self.buffered_bytes.saturating_sub(out.bytes);
        self.settle(out.tx, out.epoch);
    }

    /// A dead item was written to the table.
    pub fn buried_item(&mut self, item: &Item) {
        self.settle(item.tx, item.epoch);
        self.forget(item);
    }

    /// Take the events `seqs` of stream lease `token` out of the lease (they are being
    /// settled); their aggregates may have their next events claimed. Unknown seqs are
    /// ignored (another claim's, or settled already).
    pub fn settle_out(
        &mut self,
        token: &Uuid,
        seqs: impl IntoIterator<Item = i64>,
    ) -> Vec<(i64, Out)> {
        let Some(lease) = self.leases.get_mut(token) else {
            return Vec::new();
        };
        let mut settled = Vec::new();
        for seq in seqs {
            if let Some(out) = lease.remove(&seq) {
                settled.push((seq, out));
            }
        }
        if lease.is_empty() {
            self.leases.remove(token);
        }
        for (_, out) in &settled {
            if let Some(n) = self.out.get_mut(&out.aggregate) {
                *n -= 1;
                if *n == 0 {
                    self.out.remove(&out.aggregate);
                    self.make_ready(&out.aggregate);
                }
            }
        }
        settled
    }

    /// Whether `token` is a stream lease.
    pub fn is_stream_lease(&self, token: &Uuid) -> bool {
        self.leases.contains_key(token)
    }

    /// A stream event fully settled (its write, if any, is durable).
    pub fn finish_out(&mut self, seq: i64, out: &Out) {
        self.buffered_events = self.buffered_events.saturating_sub(1);
        self.buffered_bytes = self.buffered_bytes.saturating_sub(out.bytes);
        if out.origin == Origin::Table {
            self.unhold(seq);
        }
        self.settle(out.tx, out.epoch);
    }

    /// A handed-back message's insert was queued: the table owns its aggregate meanwhile.
    pub fn own_message(&mut self, aggregate: AggregateKey) {
        self.own_inserting(aggregate);
    }

    /// Register the events of a table claim; the table owns their aggregates from now on (an
    /// event requeued or replayed by an operator makes its aggregate the table's here).
    pub fn table_claimed(&mut self, token: Uuid, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        let mut list = Vec::with_capacity(events.len());
        for e in events {
            let aggregate = AggregateKey {
                aggregate_type: e.aggregate_type.clone(),
                aggregate_id: e.aggregate_id.clone(),
            };
            self.own(aggregate.clone(), e.seq);
            self.check_up_to = self.check_up_to.max(e.seq);
            list.push((e.seq, aggregate));
        }
        self.table_leases.insert(token, list);
    }

    /// The aggregates of table lease `token`'s events `seqs`.
    pub fn table_events(&self, token: &Uuid, seqs: &[i64]) -> Vec<(i64, AggregateKey)> {
        let Some(list) = self.table_leases.get(token) else {
            return Vec::new();
        };
        list.iter()
            .filter(|(s, _)| seqs.contains(s))
            .cloned()
            .collect()
    }

    /// A table lease is over (its batch wrote back).
    pub fn end_table_lease(&mut self, token: &Uuid, settled: &[i64]) {
        if let Some(list) = self.table_leases.get_mut(token) {
            list.retain(|(s, _)| !settled.contains(s));
            if list.is_empty() {
                self.table_leases.remove(token);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use outbox_types::EventId;

    fn event(agg: &str, seq: i64) -> Event {
        Event {
            seq,
            id: EventId::new(),
            aggregate_type: "a".into(),
            aggregate_id: agg.into(),
            event_type: "T".into(),
            payload: "{}".into(),
            destination: None,
            headers: Default::default(),
            idempotency_key: None,
            occurred_at: Utc::now(),
            enqueued_at: Utc::now(),
            attempts: 0,
        }
    }

    fn key(agg: &str) -> AggregateKey {
        AggregateKey {
            aggregate_type: "a".into(),
            aggregate_id: agg.into(),
        }
    }

    fn state() -> State {
        let mut s = State::new();
        s.begin_session(Lsn(10));
        s
    }

    fn take(s: &mut State) -> (Uuid, Taken) {
        let token = Uuid::now_v7();
        (token, s.take(100, u64::MAX, None, token))
    }

    fn settle_all(s: &mut State, token: Uuid, taken: &Taken) {
        for (seq, out) in s.settle_out(&token, taken.batch.iter().map(|e| e.seq)) {
            s.finish_out(seq, &out);
        }
    }

    #[test]
    fn the_position_moves_only_over_a_settled_prefix_of_transactions() {
        let mut s = state();
        s.begin(Utc::now());
        s.push(event("x", 1), Origin::Table, true, None, None);
        s.commit(Lsn(100));
        s.begin(Utc::now());
        s.push(event("y", 2), Origin::Table, true, None, None);
        s.commit(Lsn(200));
        let (token, taken) = take(&mut s);
        assert_eq!(taken.batch.len(), 2, "two aggregates go in one claim");
        // The later transaction settles first: the position must not move.
        for (seq, out) in s.settle_out(&token, [2]) {
            s.finish_out(seq, &out);
        }
        assert_eq!(s.ack(), Lsn(10));
        for (seq, out) in s.settle_out(&token, [1]) {
            s.finish_out(seq, &out);
        }
        assert_eq!(s.ack(), Lsn(200));
        assert!(s.is_idle());
    }

    #[test]
    fn a_stream_claim_is_bounded_by_whole_events_not_payloads() {
        // Small payloads, large headers: a bound on payloads alone would take all four.
        let mut s = state();
        s.begin(Utc::now());
        for (agg, seq) in [("w", 1), ("x", 2), ("y", 3), ("z", 4)] {
            let mut e = event(agg, seq);
            e.headers.insert("h".into(), "v".repeat(1000));
            s.push(e, Origin::Table, true, None, None);
        }
        s.commit(Lsn(100));
        let token = Uuid::now_v7();
        let taken = s.take(100, 1500, None, token);
        assert_eq!(
            taken.batch.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [1, 2],
            "the second event crosses 1,500 bytes and is the last one taken"
        );
    }

    #[test]
    fn an_aggregate_with_events_out_waits_and_keeps_its_order() {
        let mut s = state();
        s.begin(Utc::now());
        for (agg, seq) in [("x", 1), ("x", 2), ("y", 3)] {
            s.push(event(agg, seq), Origin::Table, true, None, None);
        }
        s.commit(Lsn(100));
        let token = Uuid::now_v7();
        let first = s.take(1, u64::MAX, None, token);
        assert_eq!(first.batch.iter().map(|e| e.seq).collect::<Vec<_>>(), [1]);
        let (_, second) = take(&mut s);
        assert_eq!(
            second.batch.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [3],
            "x/2 waits while x/1 is out"
        );
        settle_all(&mut s, token, &first);
        let (_, third) = take(&mut s);
        assert_eq!(third.batch.iter().map(|e| e.seq).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn events_of_an_aggregate_the_table_owns_are_handed_back_in_order() {
        let mut s = state();
        s.own(key("x"), 5);
        s.begin(Utc::now());
        s.push(event("x", 7), Origin::Table, true, None, None);
        s.push(event("y", 8), Origin::Table, true, None, None);
        let mut msg = event("x", 900);
        msg.payload = "{\"m\":1}".into();
        s.push(msg, Origin::Message, true, None, None);
        s.commit(Lsn(100));
        let (_, taken) = take(&mut s);
        assert_eq!(taken.batch.iter().map(|e| e.seq).collect::<Vec<_>>(), [8]);
        assert_eq!(taken.hand_back.len(), 1, "the message is inserted as a row");
        assert_eq!(s.table_bound(true), 7, "x/7 is the table's, y/8 still held");
        // The table delivers x/5 and x/7; the message's row is still being inserted.
        s.table_done(&key("x"), 5);
        s.table_done(&key("x"), 7);
        assert!(s.owns(&key("x")), "an insert is under way");
        s.inserted(&key("x"), Some(9));
        s.table_done(&key("x"), 9);
        assert!(!s.owns(&key("x")), "back to the stream");
    }

    #[test]
    fn table_claims_stay_below_what_the_stream_holds_and_within_what_it_saw() {
        let mut s = state();
        assert_eq!(s.table_bound(true), 0, "nothing seen yet");
        assert_eq!(
            s.table_bound(false),
            i64::MAX,
            "messages only: the table is the table's"
        );
        s.begin(Utc::now());
        s.push(event("x", 40), Origin::Table, true, None, None);
        s.push(event("y", 50), Origin::Table, true, None, None);
        s.commit(Lsn(100));
        assert_eq!(s.table_bound(true), 39);
        let (token, taken) = take(&mut s);
        settle_all(&mut s, token, &taken);
        assert_eq!(s.table_bound(true), 50);
    }

    #[test]
    fn a_resumed_destination_leaves_its_aggregates_to_the_table() {
        let hold = Hold {
            deferred: Vec::new(),
            routes: outbox_testkit::hooks_and_kafka(),
            paused: vec!["hooks".into()],
        };
        let mut s = state();
        s.set_paused(Some(&hold));
        s.begin(Utc::now());
        let mut paused = event("x", 1);
        paused.event_type = "HookSent".into();
        s.push(paused, Origin::Table, true, None, None);
        s.push(event("x", 2), Origin::Table, true, None, None);
        s.commit(Lsn(100));
        let token = Uuid::now_v7();
        let taken = s.take(100, u64::MAX, Some(&hold), token);
        assert_eq!(
            taken.batch.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [2],
            "a paused destination's event does not hold back others"
        );
        assert!(!s.owns(&key("x")));
        s.set_paused(None);
        assert!(s.owns(&key("x")), "after the resume, x/1 goes first");
    }

    #[test]
    fn dead_items_are_returned_to_bury_and_a_new_session_drops_what_waits() {
        let mut s = state();
        s.begin(Utc::now());
        s.push(event("x", 1), Origin::Table, true, None, Some("bad".into()));
        s.push(event("y", 2), Origin::Table, true, None, None);
        s.commit(Lsn(100));
        let token = Uuid::now_v7();
        let taken = s.take(0, u64::MAX, None, token);
        assert_eq!(taken.dead.len(), 1);
        for item in &taken.dead {
            s.buried_item(item);
        }
        assert!(s.has_waiting());
        s.begin_session(Lsn(50));
        assert!(!s.has_waiting());
        assert_eq!(s.ack(), Lsn(50));
        assert!(s.is_idle());
        // Rows seen by the previous session are checked when they come again.
        s.push(event("y", 2), Origin::Table, false, None, None);
        let (_, again) = take(&mut s);
        assert_eq!(again.check, [2]);
    }

    /// What a claim takes, by the plain definition: scan every waiting event in stream order;
    /// an aggregate with an event out, or one passed over in this claim, is passed over.
    struct Reference {
        waiting: Vec<(String, i64)>,
        out: HashMap<String, u32>,
    }

    impl Reference {
        fn take(&mut self, limit: usize) -> Vec<(String, i64)> {
            let mut taken = Vec::new();
            let mut kept = Vec::new();
            let mut blocked = HashSet::new();
            for (agg, seq) in std::mem::take(&mut self.waiting) {
                if blocked.contains(&agg) || self.out.contains_key(&agg) || taken.len() >= limit {
                    blocked.insert(agg.clone());
                    kept.push((agg, seq));
                } else {
                    taken.push((agg, seq));
                }
            }
            for (agg, _) in &taken {
                *self.out.entry(agg.clone()).or_insert(0) += 1;
            }
            self.waiting = kept;
            taken
        }
    }

    proptest::proptest! {
        /// Claims cost what they take, not what waits (per-aggregate queues), and take exactly
        /// what the plain scan over every waiting event takes, in the same order.
        #[test]
        fn claims_take_what_a_scan_of_everything_waiting_would(
            ops in proptest::collection::vec((0u8..3, 0u8..6, 1usize..5), 1..120)
        ) {
            let mut s = state();
            let mut reference = Reference { waiting: Vec::new(), out: HashMap::new() };
            let mut leases: Vec<(Uuid, Vec<i64>, Vec<String>)> = Vec::new();
            let mut seq = 0;
            s.begin(Utc::now());
            for (op, agg, n) in ops {
                match op {
                    0 => {
                        for _ in 0..n {
                            seq += 1;
                            let agg = format!("g{agg}");
                            s.push(event(&agg, seq), Origin::Table, true, None, None);
                            reference.waiting.push((agg, seq));
                        }
                    }
                    1 => {
                        let token = Uuid::now_v7();
                        let taken = s.take(n, u64::MAX, None, token);
                        let got: Vec<(String, i64)> = taken
                            .batch
                            .iter()
                            .map(|e| (e.aggregate_id.clone(), e.seq))
                            .collect();
                        let want = reference.take(n);
                        proptest::prop_assert_eq!(&got, &want);
                        if !got.is_empty() {
                            leases.push((
                                token,
                                got.iter().map(|(_, q)| *q).collect(),
                                got.iter().map(|(a, _)| a.clone()).collect(),
                            ));
                        }
                    }
                    _ => {
                        if !leases.is_empty() {
                            let (token, seqs, aggs) = leases.remove(usize::from(agg) % leases.len());
                            for (q, out) in s.settle_out(&token, seqs) {
                                s.finish_out(q, &out);
                            }
                            for a in aggs {
                                let n = reference.out.get_mut(&a).expect("out");
                                *n -= 1;
                                if *n == 0 {
                                    reference.out.remove(&a);
                                }
                            }
                        }
                    }
                }
                proptest::prop_assert_eq!(s.has_waiting(), !reference.waiting.is_empty());
            }
        }
    }
}
