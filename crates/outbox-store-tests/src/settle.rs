//! Settling a claim: ack, retry, dead (bury, requeue, discard), release, lease fencing, and
//! the counts those states leave behind.

use std::time::Duration;

use outbox_testkit::numbered;
use outbox_types::{
    BuryEvent, ClaimRequest, DeadFilter, DeadLetterPolicy, EventState, MAX_LAST_ERROR_LEN,
    RetryEvent, Store,
};

use crate::harness::*;

/// A retry counts the attempt, stores the error, and makes the event (and its aggregate) wait.
pub async fn retry_counts_the_attempt_and_delays_the_event<H: Harness>(h: &H) {
    let (store, claim) = a1_claimed(h).await;
    let a1 = claim.events[0].clone();
    let retry = counted_retry(a1.seq, Duration::from_secs(3600), "broker down");
    assert_eq!(store.retry(&claim.lease, &[retry]).await.unwrap(), 1);
    let record = store.get(a1.id).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Pending);
    assert_eq!(record.event.attempts, 1);
    assert_eq!(record.last_error.as_deref(), Some("broker down"));
    assert!(record.next_attempt_at > chrono::Utc::now() + chrono::TimeDelta::seconds(3000));
    let next = store.claim(&claim_up_to(10)).await.unwrap();
    assert_eq!(
        aggregate_ids(&next.events),
        vec!["b"],
        "a/1 is not due and a/2 waits behind it"
    );
    assert_eq!(store.stats().await.unwrap().retrying, 1);

    // A zero delay makes it due at once, with its attempt count.
    h.enqueue(&store, &[numbered("c", 1)]).await;
    let c = store.claim(&claim_up_to(10)).await.unwrap();
    let retry = counted_retry(c.events[0].seq, Duration::ZERO, "blip");
    store.retry(&c.lease, &[retry]).await.unwrap();
    let again = store.claim(&claim_up_to(10)).await.unwrap();
    assert_eq!(again.events.len(), 1);
    assert_eq!(again.events[0].attempts, 1);
}

/// A retry for an unavailable destination (`counts_attempt: false`) leaves `attempts` alone,
/// however often it happens, yet keeps the error and holds the aggregate's later events behind
/// the waiting one exactly like a counted retry: an outage costs time, not attempts, and never
/// reorders an aggregate.
pub async fn an_unavailable_retry_costs_no_attempt_and_holds_its_aggregate<H: Harness>(h: &H) {
    let (store, claim) = a1_claimed(h).await;
    let a1 = claim.events[0].clone();
    assert_eq!(a1.aggregate_id, "a");
    // Three outage rounds: due at once each time, claimed again, unavailable again.
    let mut lease = claim.lease;
    for round in 0..3 {
        let unavailable = unavailable_retry(
            a1.seq,
            Duration::ZERO,
            format!("connection refused (round {round})"),
        );
        assert_eq!(store.retry(&lease, &[unavailable]).await.unwrap(), 1);
        let again = store.claim(&claim_up_to(1)).await.unwrap();
        assert_eq!(again.events.len(), 1, "round {round}");
        assert_eq!(again.events[0].seq, a1.seq, "the head comes back first");
        assert_eq!(again.events[0].attempts, 0, "round {round}: no attempt");
        lease = again.lease;
    }
    // Waiting for a later probe: a/2 must not overtake it, b flows.
    let wait = unavailable_retry(a1.seq, Duration::from_secs(3600), "connection refused");
    store.retry(&lease, &[wait]).await.unwrap();
    let record = store.get(a1.id).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Pending);
    assert_eq!(record.event.attempts, 0);
    assert_eq!(record.last_error.as_deref(), Some("connection refused"));
    let next = store.claim(&claim_up_to(10)).await.unwrap();
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
    let (store, claim) = a1_claimed(h).await;
    let bury = buried(claim.events[0].seq, "payload rejected");
    assert_eq!(store.bury(&claim.lease, &[bury]).await.unwrap(), 1);
    let record = store.get(claim.events[0].id).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Dead);
    assert_eq!(record.event.attempts, 1);
    assert!(record.dead_at.is_some());

    let blocked = store.claim(&claim_up_to(10)).await.unwrap();
    assert_eq!(
        aggregate_ids(&blocked.events),
        vec!["b"],
        "block: a/2 waits behind dead a/1, b goes on"
    );
    store
        .release(&blocked.lease, &[blocked.events[0].seq])
        .await
        .unwrap();

    let skip = ClaimRequest {
        dead_letter: DeadLetterPolicy::Skip,
        ..claim_up_to(10)
    };
    let skipped = store.claim(&skip).await.unwrap();
    let mut got = labels(&skipped.events);
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
            &numbered_all(&[("a", 1), ("b", 1), ("c", 1), ("d", 1)]),
        )
        .await;
    let due = store.get(ids[0].0).await.unwrap().unwrap().next_attempt_at;
    let claim = store.claim(&claim_up_to(3)).await.unwrap();
    let buries: Vec<BuryEvent> = claim.events.iter().map(|e| buried(e.seq, "no")).collect();
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
    // Due no later than when it was claimed, not from the requeue on: a claim whose clock was
    // read before the requeue but whose rows were read after must find it due, or it would take
    // its aggregate's later events ahead of it (see `Store::requeue_dead`).
    assert!(record.next_attempt_at <= due, "{record:?} was due at {due}");

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
    let short = ClaimRequest {
        lease: Duration::from_millis(200),
        ..claim_as("relay-1", 10)
    };
    let stale = store.claim(&short).await.unwrap();
    assert_eq!(stale.events.len(), 2);
    assert!(claims_nothing(&*store).await, "lease still live");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let fresh = store.claim(&claim_as("relay-2", 10)).await.unwrap();
    let got: Vec<u64> = fresh.events.iter().map(payload_n).collect();
    assert_eq!(
        got,
        vec![1, 2],
        "expired lease is claimable again, in order"
    );
    assert_ne!(stale.lease.token, fresh.lease.token);
    let seqs = seqs_of(&stale.events);
    assert_eq!(
        store.ack(&stale.lease, &seqs).await.unwrap(),
        0,
        "stale ack is fenced"
    );
    let retry: Vec<RetryEvent> = stale
        .events
        .iter()
        .map(|e| counted_retry(e.seq, Duration::ZERO, "x"))
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
    let claim = store.claim(&claim_up_to(10)).await.unwrap();
    let seqs = seqs_of(&claim.events);
    assert_eq!(store.release(&claim.lease, &seqs).await.unwrap(), 2);
    let again = store.claim(&claim_up_to(10)).await.unwrap();
    assert_eq!(again.events.len(), 2);
    assert!(again.events.iter().all(|e| e.attempts == 0));
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
    let claim = store.claim(&claim_up_to(3)).await.unwrap();
    store
        .ack(&claim.lease, &[claim.events[0].seq])
        .await
        .unwrap();
    store
        .bury(&claim.lease, &[buried(claim.events[1].seq, "x")])
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
    let claim = store.claim(&claim_up_to(1)).await.unwrap();
    let huge = "é".repeat(20_000);
    store
        .retry(
            &claim.lease,
            &[counted_retry(claim.events[0].seq, Duration::ZERO, huge)],
        )
        .await
        .unwrap();
    let record = store.get(ids[0].0).await.unwrap().unwrap();
    let stored = record.last_error.unwrap();
    assert!(stored.len() <= MAX_LAST_ERROR_LEN, "{}", stored.len());
    assert!(stored.len() > MAX_LAST_ERROR_LEN / 2);
}
