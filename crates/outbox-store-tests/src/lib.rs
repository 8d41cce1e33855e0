//! # outbox-store-tests
//!
//! The contract of [`outbox_types::Store`], written once as tests and run by every store crate
//! against its real database: `outbox_store_tests::conformance!(MyHarness::new())` inside a test
//! file expands to one `#[tokio::test]` per property. A store added later passes the same suite
//! as the first one, or it is not done.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_engine::{Relay, RelayConfig};
use outbox_testkit::{Faults, RecordingSink, check_first_delivery_order, numbered};
use outbox_types::{
    BuryEvent, ClaimRequest, DeadFilter, DeadLetterPolicy, EventId, EventState, MAX_LAST_ERROR_LEN,
    NewEvent, RetryEvent, RetryPolicy, Store,
};

/// How the suite gets at a store.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The store under test.
    type Store: Store;
    /// A new, migrated, empty outbox, isolated from every other test.
    async fn fresh(&self) -> Arc<Self::Store>;
    /// Enqueue `events` in one committed transaction through the store's enqueue API; returns
    /// `(id, created)` per event.
    async fn enqueue(&self, store: &Self::Store, events: &[NewEvent]) -> Vec<(EventId, bool)>;
    /// Move every time recorded for these events (`occurred_at`, `enqueued_at`, `claimed_at`,
    /// `delivered_at`, `dead_at`) `by` into the past, as if it all had happened that much
    /// earlier. Lease expiries and due times stay as they are. Lets the suite test retention and
    /// time ranges without waiting.
    async fn backdate(&self, store: &Self::Store, ids: &[EventId], by: Duration);

    /// The source a relay under test claims from, for the relay settings `relay`: the store
    /// itself (table claims) unless the harness tests another source over it — the WAL harness
    /// starts a stream source, so the relay behaviour tests run over both sources.
    async fn source(
        &self,
        store: &Arc<Self::Store>,
        relay: &RelayConfig,
    ) -> Arc<dyn outbox_types::Source> {
        let _ = relay;
        store.clone()
    }

    /// Whether several relays over the same outbox all deliver (table claims), or one does while
    /// the others stand by (one replication slot, one streamer).
    fn relays_share_work(&self) -> bool {
        true
    }

    /// Whether the store's claims skip a deferred destination (`Hold::deferred`, the relay's
    /// fair turns) or claim it as usual (SQLite).
    fn defers(&self) -> bool {
        true
    }
}

/// Expand to one test per property of the store contract, using `$harness` (an expression
/// building a [`Harness`]).
#[macro_export]
macro_rules! conformance {
    ($harness:expr) => {
        $crate::conformance!(@tests $harness;
            claim_returns_due_events_in_order_and_ack_delivers,
            idempotency_key_returns_the_existing_event,
            aggregate_in_flight_blocks_its_later_events_only,
            retry_counts_the_attempt_and_delays_the_event,
            an_unavailable_retry_costs_no_attempt_and_holds_its_aggregate,
            dead_event_blocks_its_aggregate_only_under_block_policy,
            requeue_and_discard_act_on_dead_events_only,
            expired_lease_is_reclaimed_and_stale_writes_are_fenced,
            release_gives_events_back_without_an_attempt,
            purge_deletes_only_old_delivered_events,
            stats_count_every_state,
            last_error_is_truncated,
            concurrent_claims_never_hand_out_an_event_twice,
            three_relays_deliver_everything_in_order_despite_failures,
            three_relays_deliver_in_order_under_the_block_policy,
            dead_policy_block_holds_the_aggregate_in_a_relay_run,
            relay_gives_up_after_max_attempts,
            shutdown_leaves_nothing_claimed,
            pause_holds_only_that_destinations_events,
            held_events_do_not_block_other_destinations,
            a_deferred_destination_keeps_its_place_in_each_aggregate,
            hold_respects_the_dead_letter_policy,
            routes_in_sql_agree_with_resolve,
            destination_stats_count_each_state,
            leases_report_who_holds_what_since_when,
            replay_sends_delivered_events_again,
            purge_dead_deletes_only_old_dead_events,
            purge_never_deletes_an_undelivered_event,
            aggregates_behind_a_long_held_run_are_still_claimed,
            a_hanging_destination_does_not_hold_back_the_others,
            a_batch_waiting_on_a_hanging_destination_gives_its_slot_back,
            claims_are_bounded_by_payload_bytes,
            oversized_payloads_are_buried_unread_and_hold_their_aggregate,
            a_panicking_sink_costs_attempts_not_a_stuck_claim,
            a_paused_destination_waits_in_a_running_relay_while_others_flow,
            a_requeued_dead_event_goes_out_while_the_relay_runs,
            a_backlog_of_one_destination_does_not_starve_the_others,
        );
    };
    (@tests $harness:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::$name(&$harness).await;
            }
        )*
    };
}

/// The relay behaviour tests alone — what a relay does over a source, not what a store's
/// statements do — for a harness whose [`Harness::source`] is not the store itself: WAL mode's
/// stream source runs these, so both sources are held to the same behaviour.
#[macro_export]
macro_rules! relay_behaviour {
    ($harness:expr) => {
        $crate::conformance!(@tests $harness;
            three_relays_deliver_everything_in_order_despite_failures,
            three_relays_deliver_in_order_under_the_block_policy,
            dead_policy_block_holds_the_aggregate_in_a_relay_run,
            relay_gives_up_after_max_attempts,
            shutdown_leaves_nothing_claimed,
            a_hanging_destination_does_not_hold_back_the_others,
            a_batch_waiting_on_a_hanging_destination_gives_its_slot_back,
            a_panicking_sink_costs_attempts_not_a_stuck_claim,
            a_paused_destination_waits_in_a_running_relay_while_others_flow,
            a_requeued_dead_event_goes_out_while_the_relay_runs,
        );
    };
}

mod admin;

pub use admin::*;

fn request(
    owner: &str,
    limit: u32,
    lease: Duration,
    dead_letter: DeadLetterPolicy,
) -> ClaimRequest {
    ClaimRequest {
        owner: owner.into(),
        limit,
        lease,
        dead_letter,
        hold: None,
        max_batch_bytes: u64::MAX,
        max_payload_bytes: u64::MAX,
        up_to_seq: None,
    }
}

pub(crate) fn req(limit: u32) -> ClaimRequest {
    request(
        "test-relay",
        limit,
        Duration::from_secs(60),
        DeadLetterPolicy::Block,
    )
}

pub(crate) fn payload_n(e: &outbox_types::Event) -> u64 {
    let value: serde_json::Value = serde_json::from_str(&e.payload).unwrap_or_default();
    value["n"].as_u64().unwrap_or(u64::MAX)
}

/// Due events come back in enqueue order; ack marks them delivered and they are not claimed again.
pub async fn claim_returns_due_events_in_order_and_ack_delivers<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let events: Vec<NewEvent> = (0..5).map(|i| numbered(&format!("a{i}"), 0)).collect();
    let ids = h.enqueue(&store, &events).await;
    let claim = store.claim(&req(10)).await.unwrap();
    let got: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
    let want: Vec<EventId> = ids.iter().map(|(id, _)| *id).collect();
    assert_eq!(got, want, "claimed in enqueue order");
    assert!(claim.events.windows(2).all(|w| w[0].seq < w[1].seq));
    assert_eq!(
        claim.events[0].payload,
        events[0].payload(),
        "payload kept byte for byte"
    );
    assert_eq!(claim.events[0].attempts, 0);
    let record = store.get(want[0]).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::InFlight);
    assert_eq!(record.lease_owner.as_deref(), Some("test-relay"));

    assert!(
        store.claim(&req(10)).await.unwrap().events.is_empty(),
        "in-flight events are not claimed twice"
    );
    let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
    assert_eq!(store.ack(&claim.lease, &seqs).await.unwrap(), 5);
    let record = store.get(want[0]).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Delivered);
    assert!(record.delivered_at.is_some());
    assert!(
        store.claim(&req(10)).await.unwrap().events.is_empty(),
        "delivered events are not claimed"
    );
    assert_eq!(
        store.ack(&claim.lease, &seqs).await.unwrap(),
        0,
        "a second ack changes nothing"
    );
}

/// A second enqueue with the same idempotency key writes nothing and returns the first id.
pub async fn idempotency_key_returns_the_existing_event<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let first = numbered("a", 1).with_idempotency_key("order-1-created");
    let again = numbered("a", 2).with_idempotency_key("order-1-created");
    let other = numbered("a", 3).with_idempotency_key("order-2-created");
    let r1 = h.enqueue(&store, std::slice::from_ref(&first)).await;
    let r2 = h.enqueue(&store, &[again.clone(), other, again]).await;
    assert_eq!(r1[0], (first.id(), true));
    assert_eq!(
        r2[0],
        (first.id(), false),
        "duplicate key returns the existing id"
    );
    assert!(r2[1].1, "a new key is written");
    assert_eq!(r2[2], (first.id(), false));
    // The very same event (same id, same key) enqueued again is a duplicate too.
    let r3 = h.enqueue(&store, std::slice::from_ref(&first)).await;
    assert_eq!(
        r3[0],
        (first.id(), false),
        "re-enqueueing the same event writes nothing"
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.pending, 2, "{stats:?}");
}

/// While an event is in flight, later events of its aggregate wait; other aggregates go on.
pub async fn aggregate_in_flight_blocks_its_later_events_only<H: Harness>(h: &H) {
    let store = h.fresh().await;
    h.enqueue(
        &store,
        &[numbered("a", 1), numbered("a", 2), numbered("b", 1)],
    )
    .await;
    let first = store.claim(&req(1)).await.unwrap();
    assert_eq!(first.events.len(), 1);
    assert_eq!(
        (
            first.events[0].aggregate_id.as_str(),
            payload_n(&first.events[0])
        ),
        ("a", 1)
    );
    let second = store.claim(&req(10)).await.unwrap();
    let got: Vec<(&str, u64)> = second
        .events
        .iter()
        .map(|e| (e.aggregate_id.as_str(), payload_n(e)))
        .collect();
    assert_eq!(got, vec![("b", 1)], "a/2 must wait for a/1");
    store
        .ack(&first.lease, &[first.events[0].seq])
        .await
        .unwrap();
    let third = store.claim(&req(10)).await.unwrap();
    let got: Vec<(&str, u64)> = third
        .events
        .iter()
        .map(|e| (e.aggregate_id.as_str(), payload_n(e)))
        .collect();
    assert_eq!(got, vec![("a", 2)]);
    // Several events of one aggregate come in one claim, in order.
    h.enqueue(
        &store,
        &[numbered("c", 1), numbered("c", 2), numbered("c", 3)],
    )
    .await;
    let fourth = store.claim(&req(10)).await.unwrap();
    let got: Vec<u64> = fourth.events.iter().map(payload_n).collect();
    assert_eq!(got, vec![1, 2, 3]);
}

/// A retry counts the attempt, stores the error, and makes the event (and its aggregate) wait.
pub async fn retry_counts_the_attempt_and_delays_the_event<H: Harness>(h: &H) {
    let store = h.fresh().await;
    h.enqueue(
        &store,
        &[numbered("a", 1), numbered("a", 2), numbered("b", 1)],
    )
    .await;
    let claim = store.claim(&req(1)).await.unwrap();
    let a1 = claim.events[0].clone();
    let retry = RetryEvent {
        counts_attempt: true,
        seq: a1.seq,
        delay: Duration::from_secs(3600),
        error: "broker down".into(),
    };
    assert_eq!(store.retry(&claim.lease, &[retry]).await.unwrap(), 1);
    let record = store.get(a1.id).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Pending);
    assert_eq!(record.event.attempts, 1);
    assert_eq!(record.last_error.as_deref(), Some("broker down"));
    assert!(record.next_attempt_at > chrono::Utc::now() + chrono::TimeDelta::seconds(3000));
    let next = store.claim(&req(10)).await.unwrap();
    let got: Vec<&str> = next
        .events
        .iter()
        .map(|e| e.aggregate_id.as_str())
        .collect();
    assert_eq!(got, vec!["b"], "a/1 is not due and a/2 waits behind it");
    assert_eq!(store.stats().await.unwrap().retrying, 1);

    // A zero delay makes it due at once, with its attempt count.
    h.enqueue(&store, &[numbered("c", 1)]).await;
    let c = store.claim(&req(10)).await.unwrap();
    let retry = RetryEvent {
        counts_attempt: true,
        seq: c.events[0].seq,
        delay: Duration::ZERO,
        error: "blip".into(),
    };
    store.retry(&c.lease, &[retry]).await.unwrap();
    let again = store.claim(&req(10)).await.unwrap();
    assert_eq!(again.events.len(), 1);
    assert_eq!(again.events[0].attempts, 1);
}

/// A retry for an unavailable destination (`counts_attempt: false`) leaves `attempts` alone,
/// however often it happens, yet keeps the error and holds the aggregate's later events behind
/// the waiting one exactly like a counted retry: an outage costs time, not attempts, and never
/// reorders an aggregate.
pub async fn an_unavailable_retry_costs_no_attempt_and_holds_its_aggregate<H: Harness>(h: &H) {
    let store = h.fresh().await;
    h.enqueue(
        &store,
        &[numbered("a", 1), numbered("a", 2), numbered("b", 1)],
    )
    .await;
    let claim = store.claim(&req(1)).await.unwrap();
    let a1 = claim.events[0].clone();
    assert_eq!(a1.aggregate_id, "a");
    // Three outage rounds: due at once each time, claimed again, unavailable again.
    let mut lease = claim.lease;
    for round in 0..3 {
        let unavailable = RetryEvent {
            counts_attempt: false,
            seq: a1.seq,
            delay: Duration::ZERO,
            error: format!("connection refused (round {round})"),
        };
        assert_eq!(store.retry(&lease, &[unavailable]).await.unwrap(), 1);
        let again = store.claim(&req(1)).await.unwrap();
        assert_eq!(again.events.len(), 1, "round {round}");
        assert_eq!(again.events[0].seq, a1.seq, "the head comes back first");
        assert_eq!(again.events[0].attempts, 0, "round {round}: no attempt");
        lease = again.lease;
    }
    // Waiting for a later probe: a/2 must not overtake it, b flows.
    let wait = RetryEvent {
        counts_attempt: false,
        seq: a1.seq,
        delay: Duration::from_secs(3600),
        error: "connection refused".into(),
    };
    store.retry(&lease, &[wait]).await.unwrap();
    let record = store.get(a1.id).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Pending);
    assert_eq!(record.event.attempts, 0);
    assert_eq!(record.last_error.as_deref(), Some("connection refused"));
    let next = store.claim(&req(10)).await.unwrap();
    let got: Vec<(&str, u32)> = next
        .events
        .iter()
        .map(|e| (e.aggregate_id.as_str(), e.attempts))
        .collect();
    assert_eq!(got, vec![("b", 0)], "a/2 waits behind the unavailable a/1");
    assert_eq!(
        store.stats().await.unwrap().retrying,
        1,
        "the waiting event counts as retrying"
    );
}

/// A dead event holds back its own aggregate under `Block`, nobody under `Skip`.
pub async fn dead_event_blocks_its_aggregate_only_under_block_policy<H: Harness>(h: &H) {
    let store = h.fresh().await;
    h.enqueue(
        &store,
        &[numbered("a", 1), numbered("a", 2), numbered("b", 1)],
    )
    .await;
    let claim = store.claim(&req(1)).await.unwrap();
    let bury = BuryEvent {
        seq: claim.events[0].seq,
        error: "payload rejected".into(),
    };
    assert_eq!(store.bury(&claim.lease, &[bury]).await.unwrap(), 1);
    let record = store.get(claim.events[0].id).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Dead);
    assert_eq!(record.event.attempts, 1);
    assert!(record.dead_at.is_some());

    let blocked = store.claim(&req(10)).await.unwrap();
    let got: Vec<&str> = blocked
        .events
        .iter()
        .map(|e| e.aggregate_id.as_str())
        .collect();
    assert_eq!(
        got,
        vec!["b"],
        "block: a/2 waits behind dead a/1, b goes on"
    );
    store
        .release(&blocked.lease, &[blocked.events[0].seq])
        .await
        .unwrap();

    let skip = request(
        "test-relay",
        10,
        Duration::from_secs(60),
        DeadLetterPolicy::Skip,
    );
    let skipped = store.claim(&skip).await.unwrap();
    let mut got: Vec<(&str, u64)> = skipped
        .events
        .iter()
        .map(|e| (e.aggregate_id.as_str(), payload_n(e)))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![("a", 2), ("b", 1)],
        "skip: a/2 goes past dead a/1"
    );
}

/// Requeue makes dead events pending with attempts reset; discard deletes them; neither touches
/// events in other states.
pub async fn requeue_and_discard_act_on_dead_events_only<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let ids = h
        .enqueue(
            &store,
            &[
                numbered("a", 1),
                numbered("b", 1),
                numbered("c", 1),
                numbered("d", 1),
            ],
        )
        .await;
    let claim = store.claim(&req(3)).await.unwrap();
    let buries: Vec<BuryEvent> = claim
        .events
        .iter()
        .map(|e| BuryEvent {
            seq: e.seq,
            error: "no".into(),
        })
        .collect();
    store.bury(&claim.lease, &buries).await.unwrap();
    let dead = store.list_dead(None, 10).await.unwrap();
    assert_eq!(dead.len(), 3);
    let page = store.list_dead(Some(dead[0].event.seq), 1).await.unwrap();
    assert_eq!(page.len(), 1);
    assert_eq!(
        page[0].event.seq, dead[1].event.seq,
        "list_dead pages by seq"
    );

    let pending_id = ids[3].0;
    let n = store
        .requeue_dead(&DeadFilter::Ids(vec![ids[0].0, pending_id]))
        .await
        .unwrap();
    assert_eq!(n, 1, "only the dead one is requeued");
    let record = store.get(ids[0].0).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Pending);
    assert_eq!(record.event.attempts, 0);
    assert!(record.dead_at.is_none());
    // A fresh start: not counted as waiting for a retry, and its old rejection is not shown as
    // its destination's last error.
    assert!(record.last_error.is_none(), "{record:?}");
    assert_eq!(store.stats().await.unwrap().retrying, 0);

    assert_eq!(
        store
            .discard_dead(&DeadFilter::Ids(vec![ids[1].0, pending_id]))
            .await
            .unwrap(),
        1
    );
    assert!(store.get(ids[1].0).await.unwrap().is_none());
    assert!(
        store.get(pending_id).await.unwrap().is_some(),
        "a pending event is never discarded"
    );
    assert_eq!(store.requeue_dead(&DeadFilter::All).await.unwrap(), 1);
    assert_eq!(store.stats().await.unwrap().dead, 0);
    assert_eq!(store.discard_dead(&DeadFilter::All).await.unwrap(), 0);
}

/// After its lease expires an event can be claimed by another relay, and the first relay's
/// writes no longer match it.
pub async fn expired_lease_is_reclaimed_and_stale_writes_are_fenced<H: Harness>(h: &H) {
    let store = h.fresh().await;
    h.enqueue(&store, &[numbered("a", 1), numbered("a", 2)])
        .await;
    let short = request(
        "relay-1",
        10,
        Duration::from_millis(200),
        DeadLetterPolicy::Block,
    );
    let stale = store.claim(&short).await.unwrap();
    assert_eq!(stale.events.len(), 2);
    assert!(
        store.claim(&req(10)).await.unwrap().events.is_empty(),
        "lease still live"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let fresh = store
        .claim(&request(
            "relay-2",
            10,
            Duration::from_secs(60),
            DeadLetterPolicy::Block,
        ))
        .await
        .unwrap();
    let got: Vec<u64> = fresh.events.iter().map(payload_n).collect();
    assert_eq!(
        got,
        vec![1, 2],
        "expired lease is claimable again, in order"
    );
    assert_ne!(stale.lease.token, fresh.lease.token);
    let seqs: Vec<i64> = stale.events.iter().map(|e| e.seq).collect();
    assert_eq!(
        store.ack(&stale.lease, &seqs).await.unwrap(),
        0,
        "stale ack is fenced"
    );
    let retry: Vec<RetryEvent> = stale
        .events
        .iter()
        .map(|e| RetryEvent {
            counts_attempt: true,
            seq: e.seq,
            delay: Duration::ZERO,
            error: "x".into(),
        })
        .collect();
    assert_eq!(
        store.retry(&stale.lease, &retry).await.unwrap(),
        0,
        "stale retry is fenced"
    );
    assert_eq!(
        store.release(&stale.lease, &seqs).await.unwrap(),
        0,
        "stale release is fenced"
    );
    let record = store.get(fresh.events[0].id).await.unwrap().unwrap();
    assert_eq!(record.lease_owner.as_deref(), Some("relay-2"));
    assert_eq!(store.ack(&fresh.lease, &seqs).await.unwrap(), 2);
}

/// Released events are pending again, due at once, with no attempt counted.
pub async fn release_gives_events_back_without_an_attempt<H: Harness>(h: &H) {
    let store = h.fresh().await;
    h.enqueue(&store, &[numbered("a", 1), numbered("a", 2)])
        .await;
    let claim = store.claim(&req(10)).await.unwrap();
    let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
    assert_eq!(store.release(&claim.lease, &seqs).await.unwrap(), 2);
    let again = store.claim(&req(10)).await.unwrap();
    assert_eq!(again.events.len(), 2);
    assert!(again.events.iter().all(|e| e.attempts == 0));
}

/// Retention deletes delivered events older than the cutoff, and never anything else.
pub async fn purge_deletes_only_old_delivered_events<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let ids = h
        .enqueue(
            &store,
            &(0..6)
                .map(|i| numbered(&format!("p{i}"), 0))
                .collect::<Vec<_>>(),
        )
        .await;
    // 3 delivered, 1 dead, 1 in flight, 1 pending.
    let claim = store.claim(&req(5)).await.unwrap();
    let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
    store.ack(&claim.lease, &seqs[..3]).await.unwrap();
    store
        .bury(
            &claim.lease,
            &[BuryEvent {
                seq: seqs[3],
                error: "x".into(),
            }],
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .purge_delivered(Duration::from_secs(3600), 100)
            .await
            .unwrap(),
        0,
        "too recent"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        store
            .purge_delivered(Duration::from_millis(1), 2)
            .await
            .unwrap(),
        2,
        "batch limit holds"
    );
    assert_eq!(
        store
            .purge_delivered(Duration::from_millis(1), 100)
            .await
            .unwrap(),
        1
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.dead, stats.in_flight, stats.pending),
        (0, 1, 1, 1),
        "{stats:?}"
    );
    assert!(store.get(ids[5].0).await.unwrap().is_some());
}

/// Stats count each state and report the age of the oldest undelivered event.
pub async fn stats_count_every_state<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let empty = store.stats().await.unwrap();
    assert_eq!(
        empty.pending + empty.in_flight + empty.delivered + empty.dead,
        0
    );
    assert!(empty.oldest_pending_age().is_none());
    h.enqueue(
        &store,
        &(0..5)
            .map(|i| numbered(&format!("s{i}"), 0))
            .collect::<Vec<_>>(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let claim = store.claim(&req(3)).await.unwrap();
    store
        .ack(&claim.lease, &[claim.events[0].seq])
        .await
        .unwrap();
    store
        .bury(
            &claim.lease,
            &[BuryEvent {
                seq: claim.events[1].seq,
                error: "x".into(),
            }],
        )
        .await
        .unwrap();
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.in_flight, stats.delivered, stats.dead),
        (2, 1, 1, 1),
        "{stats:?}"
    );
    let age = stats.oldest_pending_age().unwrap();
    assert!(age >= Duration::from_millis(10), "{age:?}");
}

/// A huge error message is stored cut to the bound.
pub async fn last_error_is_truncated<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let ids = h.enqueue(&store, &[numbered("a", 1)]).await;
    let claim = store.claim(&req(1)).await.unwrap();
    let huge = "é".repeat(20_000);
    store
        .retry(
            &claim.lease,
            &[RetryEvent {
                counts_attempt: true,
                seq: claim.events[0].seq,
                delay: Duration::ZERO,
                error: huge,
            }],
        )
        .await
        .unwrap();
    let record = store.get(ids[0].0).await.unwrap().unwrap();
    let stored = record.last_error.unwrap();
    assert!(stored.len() <= MAX_LAST_ERROR_LEN, "{}", stored.len());
    assert!(stored.len() > MAX_LAST_ERROR_LEN / 2);
}

/// Many concurrent claimers: every event is handed out once while its lease lives, and each
/// aggregate's events come out in order.
pub async fn concurrent_claims_never_hand_out_an_event_twice<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let mut events = Vec::new();
    for n in 0..40u64 {
        for a in 0..25 {
            events.push(numbered(&format!("c{a}"), n));
        }
    }
    h.enqueue(&store, &events).await;
    let mut tasks = Vec::new();
    // Claims are serialized by the store and an aggregate's next event is claimable only after
    // the previous one was acked, so numbering claims as they return orders each aggregate's
    // events in the order they were handed out.
    let clock = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for worker in 0..6 {
        let store = store.clone();
        let clock = clock.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let claim = store
                    .claim(&request(
                        &format!("w{worker}"),
                        37,
                        Duration::from_secs(60),
                        DeadLetterPolicy::Block,
                    ))
                    .await
                    .unwrap();
                if claim.events.is_empty() {
                    // Others may still hold events whose successors become due after their ack.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let stats = store.stats().await.unwrap();
                    if stats.pending == 0 && stats.in_flight == 0 {
                        return mine;
                    }
                    continue;
                }
                let tick = clock.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
                mine.extend(
                    claim
                        .events
                        .iter()
                        .enumerate()
                        .map(|(i, e)| ((tick, i), e.id, e.aggregate_id.clone(), payload_n(e))),
                );
                let acked = store.ack(&claim.lease, &seqs).await.unwrap();
                assert_eq!(acked as usize, seqs.len());
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let distinct: HashSet<EventId> = all.iter().map(|(_, id, _, _)| *id).collect();
    assert_eq!(all.len(), 1000, "each event claimed exactly once");
    assert_eq!(distinct.len(), 1000);
    all.sort_by_key(|(order, _, _, _)| *order);
    let mut per_agg: HashMap<String, Vec<u64>> = HashMap::new();
    for (_, _, agg, n) in &all {
        per_agg.entry(agg.clone()).or_default().push(*n);
    }
    for (agg, ns) in per_agg {
        assert_eq!(
            ns,
            (0..40).collect::<Vec<_>>(),
            "aggregate {agg}: complete and handed out in order"
        );
    }
}

fn relay_config(id: &str) -> RelayConfig {
    RelayConfig {
        relay_id: id.into(),
        batch_size: 200,
        poll_interval: Duration::from_millis(10),
        lease: Duration::from_secs(30),
        retry: RetryPolicy {
            base: Duration::from_millis(5),
            cap: Duration::from_millis(40),
            max_attempts: 25,
        },
        dead_letter: DeadLetterPolicy::Skip,
        ..RelayConfig::default()
    }
}

/// Aggregates whose events sit behind a long held-back run still get claimed, and in order. In
/// front of them: 600 events behind a dead event (dead blocks), 600 behind an event waiting an
/// hour for its retry, 600 behind an event another relay holds — far more than one claim looks
/// at in seq order. Each claim must still hand out the later aggregates' events, never a held
/// one, and each aggregate's events in order, until all of them are delivered.
pub async fn aggregates_behind_a_long_held_run_are_still_claimed<H: Harness>(h: &H) {
    const HELD: u64 = 600;
    let store = h.fresh().await;
    h.enqueue(&store, &[numbered("dead", 0), numbered("retry", 0)])
        .await;
    let first = store.claim(&req(2)).await.unwrap();
    assert_eq!(first.events.len(), 2);
    let bury = BuryEvent {
        seq: first.events[0].seq,
        error: "payload rejected".into(),
    };
    assert_eq!(store.bury(&first.lease, &[bury]).await.unwrap(), 1);
    let retry = RetryEvent {
        counts_attempt: true,
        seq: first.events[1].seq,
        delay: Duration::from_secs(3600),
        error: "broker unavailable".into(),
    };
    assert_eq!(store.retry(&first.lease, &[retry]).await.unwrap(), 1);
    h.enqueue(&store, &[numbered("held", 0)]).await;
    let other = request(
        "other-relay",
        1,
        Duration::from_secs(600),
        DeadLetterPolicy::Block,
    );
    let held = store.claim(&other).await.unwrap();
    assert_eq!(held.events.len(), 1);
    let mut behind = Vec::new();
    for n in 1..=HELD {
        for aggregate in ["dead", "retry", "held"] {
            behind.push(numbered(aggregate, n));
        }
    }
    for chunk in behind.chunks(600) {
        h.enqueue(&store, chunk).await;
    }
    let late = ["late-a", "late-b", "late-c"];
    let mut tail = Vec::new();
    for n in 0..3 {
        for aggregate in late {
            tail.push(numbered(aggregate, n));
        }
    }
    h.enqueue(&store, &tail).await;

    let mut next = std::collections::HashMap::new();
    let mut delivered = 0;
    let mut claims = 0;
    for _ in 0..20 {
        if delivered == tail.len() {
            break;
        }
        let claim = store.claim(&req(10)).await.unwrap();
        claims += 1;
        assert!(
            !claim.events.is_empty(),
            "a claim found nothing while {} later events were due",
            tail.len() - delivered
        );
        for e in &claim.events {
            assert!(
                late.contains(&e.aggregate_id.as_str()),
                "claimed {}/{} from behind a held event",
                e.aggregate_id,
                payload_n(e)
            );
            let expected = next.entry(e.aggregate_id.clone()).or_insert(0);
            assert_eq!(payload_n(e), *expected, "{} out of order", e.aggregate_id);
            *expected += 1;
        }
        let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
        assert_eq!(
            store.ack(&claim.lease, &seqs).await.unwrap(),
            seqs.len() as u64
        );
        delivered += seqs.len();
    }
    assert_eq!(delivered, tail.len(), "every later event was delivered");
    assert_eq!(
        claims, 1,
        "one claim of 10 takes all 9 due events, several per aggregate"
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.pending, HELD * 3 + 1, "the held runs are untouched");
    assert_eq!(stats.in_flight, 1);
}

/// The issue's proof: 3 relays, 20k events over 500 aggregates, 10% random transient failures
/// and a few poison events. Every healthy event is delivered exactly once, first deliveries keep
/// per-aggregate order, no event is ever in flight twice at once, exactly the poison events end
/// up dead, and the relays' counters balance.
pub async fn three_relays_deliver_everything_in_order_despite_failures<H: Harness>(h: &H) {
    three_relays(h, DeadLetterPolicy::Skip).await;
}

/// The same run under the default `Block` policy: a poison event's aggregate stops behind it,
/// every other aggregate is delivered in full.
pub async fn three_relays_deliver_in_order_under_the_block_policy<H: Harness>(h: &H) {
    three_relays(h, DeadLetterPolicy::Block).await;
}

async fn three_relays<H: Harness>(h: &H, policy: DeadLetterPolicy) {
    const AGGREGATES: u64 = 500;
    const PER_AGGREGATE: u64 = 40;
    const POISON_N: u64 = 13;
    let total = AGGREGATES * PER_AGGREGATE;
    let store = h.fresh().await;
    let mut events = Vec::with_capacity(total as usize);
    for n in 0..PER_AGGREGATE {
        for a in 0..AGGREGATES {
            events.push(numbered(&format!("r{a}"), n));
        }
    }
    for chunk in events.chunks(2_000) {
        h.enqueue(&store, chunk).await;
    }
    let poisoned_aggregate = |aggregate_id: &str| aggregate_id.ends_with('7');
    let poison = move |e: &outbox_types::Event| {
        poisoned_aggregate(&e.aggregate_id) && payload_n(e) == POISON_N
    };
    // A publish takes a moment, so two publishes of one event at once would overlap and be
    // caught by the sink.
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        retry_rate: 0.10,
        reject: Some(Arc::new(poison)),
        delay: Duration::from_millis(1),
        seed: 7,
        ..Faults::default()
    }));
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut relays = Vec::new();
    for i in 0..3 {
        let config = RelayConfig {
            dead_letter: policy,
            ..relay_config(&format!("relay-{i}"))
        };
        let relay = Relay::new(h.source(&store, &config).await, sink.clone(), config);
        let mut stop = stop_tx.subscribe();
        relays.push(tokio::spawn(relay.run(async move {
            let _ = stop.recv().await;
        })));
    }
    let poisoned = (0..AGGREGATES)
        .filter(|a| poisoned_aggregate(&format!("r{a}")))
        .count() as u64;
    let expected_dead = poisoned;
    // Under Block, everything after the poison event of its aggregate stays pending.
    let expected_held = match policy {
        DeadLetterPolicy::Block => poisoned * (PER_AGGREGATE - POISON_N - 1),
        DeadLetterPolicy::Skip => 0,
    };
    let expected_delivered = total - expected_dead - expected_held;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    loop {
        let stats = store.stats().await.unwrap();
        if stats.delivered + stats.dead == expected_delivered + expected_dead
            && stats.in_flight == 0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "relays did not finish: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_tx.send(()).unwrap();
    let mut reports = Vec::new();
    for r in relays {
        reports.push(r.await.unwrap());
    }
    let stats = store.stats().await.unwrap();
    assert_eq!(
        stats.dead, expected_dead,
        "exactly the poison events are dead: {stats:?}"
    );
    assert_eq!(stats.delivered, expected_delivered, "{stats:?}");
    assert_eq!(
        (stats.pending, stats.in_flight),
        (expected_held, 0),
        "{stats:?}"
    );

    let delivered = sink.delivered();
    let distinct = sink.distinct_delivered();
    assert_eq!(distinct.len() as u64, expected_delivered);
    assert_eq!(
        delivered.len(),
        distinct.len(),
        "no event delivered twice: no lease ran out, so no relay may publish another's event"
    );
    if policy == DeadLetterPolicy::Block {
        assert!(
            delivered
                .iter()
                .all(|e| !poisoned_aggregate(&e.aggregate_id) || payload_n(e) < POISON_N),
            "nothing after a poison event was delivered under Block"
        );
    }
    let violations = check_first_delivery_order(&delivered);
    assert!(
        violations.is_empty(),
        "order violations: {:?}",
        &violations[..violations.len().min(5)]
    );
    assert!(
        sink.overlaps().is_empty(),
        "events in flight twice: {:?}",
        sink.overlaps()
    );

    // The relays' books balance: every claimed event was settled exactly one way, every
    // delivery and burial was recorded once, and nothing was fenced under a 30 s lease.
    let sum = |f: fn(&outbox_engine::RelayReport) -> u64| reports.iter().map(f).sum::<u64>();
    assert_eq!(sum(|r| r.fenced), 0, "{reports:?}");
    assert_eq!(sum(|r| r.delivered), expected_delivered, "{reports:?}");
    assert_eq!(sum(|r| r.dead), expected_dead, "{reports:?}");
    assert_eq!(
        sum(|r| r.claimed),
        sum(|r| r.delivered) + sum(|r| r.retried) + sum(|r| r.dead) + sum(|r| r.released),
        "{reports:?}"
    );
    assert_eq!(
        sink.attempts(),
        sum(|r| r.delivered) + sum(|r| r.retried) + sum(|r| r.dead),
        "each publish attempt was settled as delivered, retried or dead: {reports:?}"
    );
    let retried = sum(|r| r.retried);
    assert!(
        retried > 1_000,
        "the failure path was exercised: {retried} retries"
    );
    if h.relays_share_work() {
        assert!(
            reports.iter().all(|r| r.delivered > 0),
            "all three relays worked: {reports:?}"
        );
    } else {
        assert_eq!(
            reports.iter().filter(|r| r.delivered > 0).count(),
            1,
            "one relay streams, the others stand by: {reports:?}"
        );
    }
    let dead = store.list_dead(None, 1000).await.unwrap();
    assert!(dead.iter().all(|r| poison(&r.event)));
    assert!(
        dead.iter()
            .all(|r| r.last_error.as_deref().unwrap_or("").contains("rejected"))
    );
}

/// A relay gives up on an event that fails every time once it reached `max_attempts`: the event
/// is dead with the attempt count and a "gave up after" error, and under `Block` its aggregate's
/// later events wait behind it.
pub async fn relay_gives_up_after_max_attempts<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let ids = h
        .enqueue(
            &store,
            &[numbered("m", 1), numbered("m", 2), numbered("n", 1)],
        )
        .await;
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        fail: Some(Arc::new(|e: &outbox_types::Event| {
            e.aggregate_id == "m" && payload_n(e) == 1
        })),
        ..Faults::default()
    }));
    let config = RelayConfig {
        retry: RetryPolicy {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(5),
            max_attempts: 3,
        },
        dead_letter: DeadLetterPolicy::Block,
        ..relay_config("giver-upper")
    };
    let relay = Relay::new(h.source(&store, &config).await, sink.clone(), config);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let stats = store.stats().await.unwrap();
        if stats.dead == 1 && stats.delivered == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{stats:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.send(()).unwrap();
    let report = run.await.unwrap();
    assert_eq!((report.retried, report.dead, report.delivered), (2, 1, 1));
    let m1 = store.get(ids[0].0).await.unwrap().unwrap();
    assert_eq!(m1.state, EventState::Dead);
    assert_eq!(m1.event.attempts, 3);
    let error = m1.last_error.unwrap_or_default();
    assert!(error.contains("gave up after 3 attempts"), "{error}");
    assert!(error.contains("failing by test predicate"), "{error}");
    let m2 = store.get(ids[1].0).await.unwrap().unwrap();
    assert_eq!(m2.state, EventState::Pending, "m/2 waits behind dead m/1");
    assert_eq!(m2.event.attempts, 0);
    assert_eq!(sink.attempts(), 4, "three tries of m/1, one of n/1");
}

/// Under the default `Block` policy a poison event stops its aggregate (and only it) in a real
/// relay run.
pub async fn dead_policy_block_holds_the_aggregate_in_a_relay_run<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let mut events = Vec::new();
    for n in 0..5u64 {
        for a in ["x", "y", "z"] {
            events.push(numbered(a, n));
        }
    }
    h.enqueue(&store, &events).await;
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        reject: Some(Arc::new(|e: &outbox_types::Event| {
            e.aggregate_id == "y" && payload_n(e) == 2
        })),
        ..Faults::default()
    }));
    let config = RelayConfig {
        dead_letter: DeadLetterPolicy::Block,
        stop_when_idle: true,
        ..relay_config("blocker")
    };
    let report = Relay::new(h.source(&store, &config).await, sink.clone(), config)
        .run(std::future::pending())
        .await;
    assert_eq!(report.dead, 1);
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.dead, stats.pending),
        (12, 1, 2),
        "{stats:?}"
    );
    let y: Vec<u64> = sink
        .delivered()
        .iter()
        .filter(|e| e.aggregate_id == "y")
        .map(payload_n)
        .collect();
    assert_eq!(y, vec![0, 1]);
}

/// Stopping a relay mid-run finishes the batches in flight and leaves no event claimed.
pub async fn shutdown_leaves_nothing_claimed<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let events: Vec<NewEvent> = (0..3000)
        .map(|i| numbered(&format!("g{}", i % 300), i / 300))
        .collect();
    h.enqueue(&store, &events).await;
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        delay: Duration::from_millis(5),
        ..Faults::default()
    }));
    let config = RelayConfig {
        batch_size: 100,
        ..relay_config("stopper")
    };
    let relay = Relay::new(h.source(&store, &config).await, sink.clone(), config);
    let counters = relay.counters();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    while counters.report().delivered < 200 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tx.send(()).unwrap();
    let report = run.await.unwrap();
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.in_flight, 0, "nothing left claimed: {stats:?}");
    assert!(stats.pending > 0, "stopped before the end: {stats:?}");
    assert_eq!(stats.delivered, report.delivered);
    assert_eq!(
        sink.distinct_delivered().len() as u64,
        report.delivered,
        "every published event was acked"
    );
}

/// A destination whose publish never returns (a broker behind a cut link). Counts its calls
/// and how many were out at once.
#[derive(Default)]
struct Hanging {
    calls: std::sync::atomic::AtomicU64,
    out: std::sync::atomic::AtomicU64,
    most_out: std::sync::atomic::AtomicU64,
}

/// Decrements `out` when a hanging call is dropped (its timeout fired).
struct OutGuard<'a>(&'a Hanging);

impl Drop for OutGuard<'_> {
    fn drop(&mut self) {
        self.0.out.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait]
impl outbox_types::Sink for Hanging {
    fn name(&self) -> &str {
        "stuck"
    }
    async fn publish(&self, _events: &[outbox_types::Event]) -> Vec<outbox_types::Outcome> {
        use std::sync::atomic::Ordering::SeqCst;
        self.calls.fetch_add(1, SeqCst);
        let out = self.out.fetch_add(1, SeqCst) + 1;
        self.most_out.fetch_max(out, SeqCst);
        let _guard = OutGuard(self);
        std::future::pending().await
    }
}

const GOOD: u64 = 40;
const STUCK: u64 = 8;
const PER_AGGREGATE: u64 = 10;

/// A relay over two destinations, `good` (a [`RecordingSink`]) and `stuck` (a [`Hanging`]
/// one), with 40 good and 8 stuck aggregates of 10 events each enqueued interleaved, run with
/// `config` until `done` says so; returns the sinks, the report, and how long it took.
async fn run_with_a_hanging_destination<H: Harness>(
    h: &H,
    config: RelayConfig,
    done: impl Fn(&RecordingSink, &outbox_engine::RelayReport) -> bool,
) -> (
    Arc<H::Store>,
    Arc<RecordingSink>,
    Arc<Hanging>,
    outbox_engine::RelayReport,
    Duration,
) {
    use outbox_types::route::{Pattern, RouteRule, RouteTable};
    let store = h.fresh().await;
    let event = |aggregate_type: &str, a: u64, n: u64| {
        NewEvent::new(
            aggregate_type,
            format!("{aggregate_type}{a}"),
            "Numbered",
            &serde_json::json!({ "n": n }),
        )
        .unwrap()
    };
    let mut events = Vec::new();
    for n in 0..PER_AGGREGATE {
        for a in 0..GOOD {
            events.push(event("good", a, n));
            if a < STUCK {
                events.push(event("stuck", a, n));
            }
        }
    }
    h.enqueue(&store, &events).await;
    let routes = RouteTable::new(
        ["good", "stuck"],
        vec![
            RouteRule::to("stuck").aggregate_type(Pattern::parse("stuck")),
            RouteRule::to("good"),
        ],
    )
    .unwrap();
    let good = Arc::new(RecordingSink::new());
    let stuck = Arc::new(Hanging::default());
    let router = outbox_engine::router::Router::new(
        routes.clone(),
        vec![
            (
                "good".to_owned(),
                good.clone() as Arc<dyn outbox_types::Sink>,
            ),
            (
                "stuck".to_owned(),
                stuck.clone() as Arc<dyn outbox_types::Sink>,
            ),
        ],
    )
    .unwrap();
    let relay = Relay::new(h.source(&store, &config).await, Arc::new(router), config)
        .with_routes(Arc::new(routes));
    let counters = relay.counters();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let started = std::time::Instant::now();
    let run = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !done(&good, &counters.report()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the healthy destination got {} of {} events: {:?}",
            good.distinct_delivered().len(),
            GOOD * PER_AGGREGATE,
            counters.report()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    tx.send(()).unwrap();
    let report = run.await.unwrap();
    (store, good, stuck, report, elapsed)
}

fn hanging_config(id: &str) -> RelayConfig {
    RelayConfig {
        publish_timeout: Duration::from_secs(1),
        retry: RetryPolicy {
            base: Duration::from_millis(5),
            cap: Duration::from_millis(20),
            max_attempts: 10_000,
        },
        ..relay_config(id)
    }
}

/// The healthy destination's events were each published once and in order, and the hanging
/// one's all wait in the outbox.
async fn check_isolation<S: Store + ?Sized>(
    store: &S,
    good: &RecordingSink,
    report: &outbox_engine::RelayReport,
) {
    assert_eq!(
        good.attempts(),
        GOOD * PER_AGGREGATE,
        "each healthy event was published exactly once: none shared a timeout with the hanging \
         destination ({report:?})"
    );
    let violations = check_first_delivery_order(&good.delivered());
    assert!(violations.is_empty(), "{violations:?}");
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.delivered, GOOD * PER_AGGREGATE, "{stats:?}");
    assert_eq!(
        (stats.pending, stats.in_flight, stats.dead),
        (STUCK * PER_AGGREGATE, 0, 0),
        "the hanging destination's events all wait in the outbox: {stats:?}"
    );
}

/// With two destinations, one of which hangs, the other's events are each published once, in
/// order, while the hanging one's wait in the outbox: a wave of the healthy destination never
/// shares a timeout with the hanging one, and once it timed out the hanging destination is left
/// alone for a cooldown instead of being waited on by every batch.
pub async fn a_hanging_destination_does_not_hold_back_the_others<H: Harness>(h: &H) {
    let config = RelayConfig {
        batch_size: 100,
        destination_cooldown: Duration::from_secs(30),
        ..hanging_config("isolated")
    };
    // Wait until the stuck destination's events were also claimed during its cooldown.
    let (store, good, stuck, report, elapsed) =
        run_with_a_hanging_destination(h, config, |g, r| {
            g.distinct_delivered().len() as u64 >= GOOD * PER_AGGREGATE
                && r.short_circuited >= STUCK
        })
        .await;
    check_isolation(store.as_ref(), &good, &report).await;
    // Calls start at 0 s, then after each 1 s timeout plus a cooldown of 0.5 s, 1 s, 2 s …: by
    // 6.5 s at most 4. Without the cooldown every batch would call it again.
    let calls = stuck.calls.load(std::sync::atomic::Ordering::SeqCst);
    let elapsed = elapsed.as_secs_f64();
    let allowed = if elapsed < 6.0 {
        4
    } else {
        2 + (elapsed / 2.0) as u64
    };
    assert!(
        (1..=allowed).contains(&calls),
        "after its first timeout the hanging destination was left alone for the cooldown: \
         {calls} calls in {elapsed:.1} s ({report:?})"
    );
    assert!(report.short_circuited >= STUCK, "{report:?}");
}

/// A batch whose remaining events all wait for a hanging destination writes back what it
/// settled and gives its slot back, so the relay claims the next batch meanwhile: with one slot
/// and the cooldown off, calls to the hanging destination from several batches are out at
/// once (never more than the four batches a slot may have alive), and the healthy destination
/// is served in full.
pub async fn a_batch_waiting_on_a_hanging_destination_gives_its_slot_back<H: Harness>(h: &H) {
    let config = RelayConfig {
        batch_size: 10,
        max_batches_in_flight: 1,
        destination_cooldown: Duration::ZERO,
        ..hanging_config("slot-giver")
    };
    let (store, good, stuck, report, _) = run_with_a_hanging_destination(h, config, |g, _| {
        g.distinct_delivered().len() as u64 >= GOOD * PER_AGGREGATE
    })
    .await;
    check_isolation(store.as_ref(), &good, &report).await;
    let most_out = stuck.most_out.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (2..=4).contains(&most_out),
        "calls to the hanging destination out at once: {most_out} ({report:?})"
    );
    assert_eq!(report.short_circuited, 0, "the cooldown is off: {report:?}");
}

/// An event whose payload is exactly `bytes` long (`{"p":"xxx…"}`).
fn sized(aggregate_id: &str, bytes: usize) -> NewEvent {
    let pad = "x".repeat(bytes - r#"{"p":""}"#.len());
    NewEvent::from_json("agg", aggregate_id, "Sized", format!(r#"{{"p":"{pad}"}}"#))
        .unwrap_or_else(|e| panic!("a sized payload is JSON: {e}"))
}

/// A claim stops adding events once their payloads reach `max_batch_bytes` (the first always
/// comes back), takes them in seq order so no aggregate's later event comes without its earlier
/// one, and the next claim goes on where it stopped.
pub async fn claims_are_bounded_by_payload_bytes<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let mut events = Vec::new();
    for n in 0..10 {
        events.push(sized(&format!("a{}", n % 3), 1000));
    }
    h.enqueue(&store, &events).await;
    let request = req(100).with_byte_limits(3500, 1_000_000);
    let first = store.claim(&request).await.unwrap();
    // 0, 1000, 2000 and 3000 bytes before each: four events; the fifth would start at 4000.
    assert_eq!(
        first.events.len(),
        4,
        "{:?}",
        first.events.iter().map(|e| e.seq).collect::<Vec<_>>()
    );
    let seqs: Vec<i64> = first.events.iter().map(|e| e.seq).collect();
    store.ack(&first.lease, &seqs).await.unwrap();
    let second = store.claim(&request).await.unwrap();
    assert_eq!(second.events.len(), 4);
    assert!(
        second.events[0].seq > seqs[3],
        "the next claim goes on in seq order"
    );
    let seqs: Vec<i64> = second.events.iter().map(|e| e.seq).collect();
    store.ack(&second.lease, &seqs).await.unwrap();
    // Two 1000-byte events left, then one larger than the whole budget: it still comes back,
    // alone.
    h.enqueue(&store, &[sized("big", 5000)]).await;
    let third = store
        .claim(&req(100).with_byte_limits(1000, 1_000_000))
        .await
        .unwrap();
    assert_eq!(third.events.len(), 1, "1000 bytes before the second: one");
    let seqs: Vec<i64> = third.events.iter().map(|e| e.seq).collect();
    store.ack(&third.lease, &seqs).await.unwrap();
    let fourth = store
        .claim(&req(100).with_byte_limits(1000, 1_000_000))
        .await
        .unwrap();
    assert_eq!(fourth.events.len(), 1);
    let last = store
        .claim(&req(100).with_byte_limits(1000, 1_000_000))
        .await
        .unwrap();
    assert_eq!(last.events.len(), 1);
    assert_eq!(last.events[0].aggregate_id, "big");
    assert_eq!(last.events[0].payload.len(), 5000);
}

/// A payload above `max_payload_bytes` is never handed out: the claim buries it with a reason
/// that names the limit, and under `Block` the later events of its aggregate in the same claim
/// wait behind it (released, no attempt counted) while other aggregates go on; under `Skip`
/// they go on too.
pub async fn oversized_payloads_are_buried_unread_and_hold_their_aggregate<H: Harness>(h: &H) {
    for policy in [DeadLetterPolicy::Block, DeadLetterPolicy::Skip] {
        let store = h.fresh().await;
        let ids = h
            .enqueue(
                &store,
                &[
                    sized("a", 100),
                    sized("a", 5000),
                    sized("a", 100),
                    sized("b", 100),
                ],
            )
            .await;
        let request = ClaimRequest {
            dead_letter: policy,
            ..req(100).with_byte_limits(1_000_000, 1000)
        };
        let claim = store.claim(&request).await.unwrap();
        assert_eq!(claim.buried, 1, "the relay counts it as dead");
        let got: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
        let big = store.get(ids[1].0).await.unwrap().unwrap();
        assert_eq!(big.state, EventState::Dead, "{policy:?}");
        let error = big.last_error.unwrap_or_default();
        assert!(
            error.contains("5000 bytes") && error.contains("max_payload_bytes = 1000"),
            "{error}"
        );
        match policy {
            DeadLetterPolicy::Block => {
                assert_eq!(
                    got,
                    vec![ids[0].0, ids[3].0],
                    "a's third event waits behind the dead one"
                );
                let behind = store.get(ids[2].0).await.unwrap().unwrap();
                assert_eq!(behind.state, EventState::Pending);
                assert_eq!(behind.event.attempts, 0);
            }
            DeadLetterPolicy::Skip => {
                assert_eq!(got, vec![ids[0].0, ids[2].0, ids[3].0]);
            }
        }
    }
}

/// A sink that panics fails its call, not the relay: the events of the call count an attempt
/// each and are retried, the poison one ends dead after `max_attempts`, the others are
/// delivered, and nothing stays in flight.
pub async fn a_panicking_sink_costs_attempts_not_a_stuck_claim<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let ids = h
        .enqueue(
            &store,
            &[numbered("p", 1), numbered("q", 1), numbered("q", 2)],
        )
        .await;
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        panic: Some(Arc::new(|e: &outbox_types::Event| e.aggregate_id == "p")),
        ..Faults::default()
    }));
    let config = RelayConfig {
        retry: RetryPolicy {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(5),
            max_attempts: 3,
        },
        // One event per call, so the panic is the poison event's alone.
        batch_size: 1,
        stop_when_idle: true,
        ..relay_config("panicker")
    };
    let report = tokio::time::timeout(
        Duration::from_secs(60),
        Relay::new(h.source(&store, &config).await, sink.clone(), config)
            .run(std::future::pending()),
    )
    .await
    .expect("the relay finishes although its sink panics");
    assert_eq!(report.dead, 1, "{report:?}");
    let poison = store.get(ids[0].0).await.unwrap().unwrap();
    assert_eq!(poison.state, EventState::Dead);
    assert_eq!(poison.event.attempts, 3);
    let error = poison.last_error.unwrap_or_default();
    assert!(
        error.contains("panicked: panicking by test predicate"),
        "{error}"
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.in_flight, stats.pending),
        (2, 0, 0),
        "{stats:?}"
    );
}

/// Two destinations by aggregate type (`hooks` for `h*`, `main` for the rest), a router over
/// two recording sinks, and a relay over `h`'s source, running until the returned sender fires.
async fn two_destination_relay<H: Harness>(
    h: &H,
    store: &Arc<H::Store>,
    config: RelayConfig,
) -> (
    Arc<RecordingSink>,
    Arc<RecordingSink>,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<outbox_engine::RelayReport>,
) {
    two_destination_relay_with(h, store, config, RecordingSink::new()).await
}

/// [`two_destination_relay`] with `hooks` as the sink of the `hooks` destination (events of
/// aggregate types starting with `h`).
async fn two_destination_relay_with<H: Harness>(
    h: &H,
    store: &Arc<H::Store>,
    config: RelayConfig,
    hooks: RecordingSink,
) -> (
    Arc<RecordingSink>,
    Arc<RecordingSink>,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<outbox_engine::RelayReport>,
) {
    use outbox_types::route::{Pattern, RouteRule, RouteTable};
    let routes = RouteTable::new(
        ["main", "hooks"],
        vec![
            RouteRule::to("hooks").aggregate_type(Pattern::parse("h*")),
            RouteRule::to("main"),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let main = Arc::new(RecordingSink::new());
    let hooks = Arc::new(hooks);
    let router = outbox_engine::router::Router::new(
        routes.clone(),
        vec![
            (
                "main".to_owned(),
                main.clone() as Arc<dyn outbox_types::Sink>,
            ),
            (
                "hooks".to_owned(),
                hooks.clone() as Arc<dyn outbox_types::Sink>,
            ),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let relay = Relay::new(h.source(store, &config).await, Arc::new(router), config)
        .with_routes(Arc::new(routes));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    (main, hooks, tx, run)
}

fn typed_event(aggregate_type: &str, aggregate_id: &str, n: u64) -> NewEvent {
    NewEvent::new(
        aggregate_type,
        aggregate_id,
        "Numbered",
        &serde_json::json!({ "aggregate": aggregate_id, "n": n }),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `outbox pause` while a relay runs: the paused destination's events wait (in the table) while
/// the other destination's events flow, an aggregate with events for both keeps going on the
/// other one, and after the resume the waiting events go out, in order.
pub async fn a_paused_destination_waits_in_a_running_relay_while_others_flow<H: Harness>(h: &H) {
    let store = h.fresh().await;
    assert!(store.pause("hooks", "test").await.unwrap());
    let (main, hooks, stop, run) = two_destination_relay(h, &store, relay_config("pauser")).await;
    let mut events = Vec::new();
    for n in 0..5 {
        events.push(typed_event("main", "m", n));
        events.push(typed_event("hook", "k", n));
    }
    h.enqueue(&store, &events).await;
    wait_until("main's events", || main.distinct_delivered().len() == 5).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(hooks.delivered().is_empty(), "hooks is paused");
    assert!(store.resume("hooks").await.unwrap());
    wait_until("hooks' events after the resume", || {
        hooks.distinct_delivered().len() == 5
    })
    .await;
    let ns: Vec<u64> = hooks.delivered().iter().map(payload_n).collect();
    assert_eq!(ns, [0, 1, 2, 3, 4], "in order, once each");
    // Newer events of the resumed destination go after the ones that waited.
    h.enqueue(&store, &[typed_event("hook", "k", 5)]).await;
    wait_until("the newer one", || hooks.distinct_delivered().len() == 6).await;
    assert!(check_first_delivery_order(&hooks.delivered()).is_empty());
    stop.send(())
        .unwrap_or_else(|_| panic!("the relay ended early"));
    run.await.unwrap();
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.pending, stats.in_flight),
        (11, 0, 0),
        "{stats:?}"
    );
}

/// A backlog of one destination (a slow one, or one back from an outage) does not make the
/// others' new events wait until it is drained: after a claim it filled, the next claim skips it
/// (the relay's fair turn), so `main`'s events, committed after 600 of `hooks`', go out while
/// most of that backlog still waits. And the backlog still drains in order.
pub async fn a_backlog_of_one_destination_does_not_starve_the_others<H: Harness>(h: &H) {
    if !h.defers() {
        eprintln!("this store claims a deferred destination as usual: no fair turns to test");
        return;
    }
    let store = h.fresh().await;
    let mut events = Vec::new();
    for n in 0..100 {
        for k in 0..6 {
            events.push(typed_event("hook", &format!("k{k}"), n));
        }
    }
    for n in 0..5 {
        for m in 0..4 {
            events.push(typed_event("main", &format!("m{m}"), n));
        }
    }
    h.enqueue(&store, &events).await;
    let slow = RecordingSink::with_faults(Faults {
        delay: Duration::from_millis(20),
        ..Faults::default()
    });
    let (main, hooks, stop, run) =
        two_destination_relay_with(h, &store, relay_config("fair"), slow).await;
    wait_until("main's events", || main.distinct_delivered().len() == 20).await;
    let hooks_by_then = hooks.distinct_delivered().len();
    assert!(
        hooks_by_then <= 400,
        "main waited for {hooks_by_then} of the 600 hooks events: claims must not hand the whole backlog out first"
    );
    wait_until("the hooks backlog", || {
        hooks.distinct_delivered().len() == 600
    })
    .await;
    assert!(check_first_delivery_order(&hooks.delivered()).is_empty());
    assert!(check_first_delivery_order(&main.delivered()).is_empty());
    stop.send(())
        .unwrap_or_else(|_| panic!("the relay ended early"));
    run.await.unwrap();
}

/// Under `block`, a rejected event holds its aggregate; `outbox dead requeue` while the relay
/// runs sends it again, and it and the events held behind it go out in order, without a
/// restart; other aggregates are never held.
pub async fn a_requeued_dead_event_goes_out_while_the_relay_runs<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let reject = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let rejecting = reject.clone();
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        reject: Some(Arc::new(move |e: &outbox_types::Event| {
            rejecting.load(std::sync::atomic::Ordering::SeqCst)
                && e.aggregate_id == "p"
                && payload_n(e) == 1
        })),
        ..Faults::default()
    }));
    let config = RelayConfig {
        dead_letter: DeadLetterPolicy::Block,
        ..relay_config("requeuer")
    };
    let relay = Relay::new(h.source(&store, &config).await, sink.clone(), config);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    let mut events = Vec::new();
    for n in 0..4 {
        events.push(numbered("p", n));
        events.push(numbered("q", n));
    }
    h.enqueue(&store, &events).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let stats = store.stats().await.unwrap();
        if stats.dead == 1 && stats.delivered == 5 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{stats:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let p: Vec<u64> = sink
        .delivered()
        .iter()
        .filter(|e| e.aggregate_id == "p")
        .map(payload_n)
        .collect();
    assert_eq!(p, [0], "p waits behind its dead event");
    // The operator fixes the cause and requeues; the relay keeps running.
    reject.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(store.requeue_dead(&DeadFilter::All).await.unwrap(), 1);
    wait_until("p after the requeue", || {
        sink.distinct_delivered().len() == 8
    })
    .await;
    let p: Vec<u64> = sink
        .delivered()
        .iter()
        .filter(|e| e.aggregate_id == "p")
        .map(payload_n)
        .collect();
    assert_eq!(p, [0, 1, 2, 3], "in order, without a restart");
    tx.send(())
        .unwrap_or_else(|_| panic!("the relay ended early"));
    run.await.unwrap();
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.dead, stats.pending),
        (8, 0, 0),
        "{stats:?}"
    );
}
