//! Claims: what a claim hands out, in which order, to whom, and within which bounds.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_testkit::numbered;
use outbox_types::{ClaimRequest, DeadLetterPolicy, EventId, EventState, NewEvent, Store};

use crate::harness::*;

/// Due events come back in enqueue order; ack marks them delivered and they are not claimed again.
pub async fn claim_returns_due_events_in_order_and_ack_delivers<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let events: Vec<NewEvent> = (0..5).map(|i| numbered(&format!("a{i}"), 0)).collect();
    let ids = h.enqueue(&store, &events).await;
    let claim = store.claim(&claim_up_to(10)).await.unwrap();
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
        claims_nothing(&*store).await,
        "in-flight events are not claimed twice"
    );
    let seqs = seqs_of(&claim.events);
    assert_eq!(store.ack(&claim.lease, &seqs).await.unwrap(), 5);
    let record = store.get(want[0]).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Delivered);
    assert!(record.delivered_at.is_some());
    assert!(
        claims_nothing(&*store).await,
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
    let (store, first) = a1_claimed(h).await;
    assert_eq!(first.events.len(), 1);
    assert_eq!(
        (
            first.events[0].aggregate_id.as_str(),
            payload_n(&first.events[0])
        ),
        ("a", 1)
    );
    let second = store.claim(&claim_up_to(10)).await.unwrap();
    let got = labels(&second.events);
    assert_eq!(got, vec![("b", 1)], "a/2 must wait for a/1");
    store
        .ack(&first.lease, &[first.events[0].seq])
        .await
        .unwrap();
    let third = store.claim(&claim_up_to(10)).await.unwrap();
    let got = labels(&third.events);
    assert_eq!(got, vec![("a", 2)]);
    // Several events of one aggregate come in one claim, in order.
    h.enqueue(
        &store,
        &[numbered("c", 1), numbered("c", 2), numbered("c", 3)],
    )
    .await;
    let fourth = store.claim(&claim_up_to(10)).await.unwrap();
    let got: Vec<u64> = fourth.events.iter().map(payload_n).collect();
    assert_eq!(got, vec![1, 2, 3]);
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
            claim_and_ack_until_drained(
                &*store,
                &format!("w{worker}"),
                37,
                Duration::from_secs(60),
                Duration::from_millis(20),
                |events| {
                    let tick = clock.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    mine.extend(
                        events
                            .iter()
                            .enumerate()
                            .map(|(i, e)| ((tick, i), e.id, e.aggregate_id.clone(), payload_n(e))),
                    );
                },
            )
            .await;
            mine
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
    let first = store.claim(&claim_up_to(2)).await.unwrap();
    assert_eq!(first.events.len(), 2);
    let bury = buried(first.events[0].seq, "payload rejected");
    assert_eq!(store.bury(&first.lease, &[bury]).await.unwrap(), 1);
    let retry = counted_retry(
        first.events[1].seq,
        Duration::from_secs(3600),
        "broker unavailable",
    );
    assert_eq!(store.retry(&first.lease, &[retry]).await.unwrap(), 1);
    h.enqueue(&store, &[numbered("held", 0)]).await;
    let other = ClaimRequest::new(
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
        let claim = store.claim(&claim_up_to(10)).await.unwrap();
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
        let seqs = seqs_of(&claim.events);
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
    let request = claim_up_to(100).with_byte_limits(3500, 1_000_000);
    let first = store.claim(&request).await.unwrap();
    // 0, 1000, 2000 and 3000 bytes before each: four events; the fifth would start at 4000.
    assert_eq!(first.events.len(), 4, "{:?}", seqs_of(&first.events));
    let seqs = seqs_of(&first.events);
    store.ack(&first.lease, &seqs).await.unwrap();
    let second = store.claim(&request).await.unwrap();
    assert_eq!(second.events.len(), 4);
    assert!(
        second.events[0].seq > seqs[3],
        "the next claim goes on in seq order"
    );
    let seqs = seqs_of(&second.events);
    store.ack(&second.lease, &seqs).await.unwrap();
    // Two 1000-byte events left, then one larger than the whole budget: it still comes back,
    // alone.
    h.enqueue(&store, &[sized("big", 5000)]).await;
    let third = store
        .claim(&claim_up_to(100).with_byte_limits(1000, 1_000_000))
        .await
        .unwrap();
    assert_eq!(third.events.len(), 1, "1000 bytes before the second: one");
    let seqs = seqs_of(&third.events);
    store.ack(&third.lease, &seqs).await.unwrap();
    let fourth = store
        .claim(&claim_up_to(100).with_byte_limits(1000, 1_000_000))
        .await
        .unwrap();
    assert_eq!(fourth.events.len(), 1);
    let last = store
        .claim(&claim_up_to(100).with_byte_limits(1000, 1_000_000))
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
            ..claim_up_to(100).with_byte_limits(1_000_000, 1000)
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

/// An event of aggregate `aggregate_id` whose headers take about `bytes` bytes (one header of
/// `bytes` characters) and whose payload is tiny: what `max_metadata_bytes` measures.
fn with_header_bytes(aggregate_id: &str, bytes: usize) -> NewEvent {
    numbered(aggregate_id, 0).with_header("big", "h".repeat(bytes))
}

/// `max_batch_bytes` counts whole rows, not only payloads: events with tiny payloads and large
/// headers stop a claim as large payloads would (20 rows of 50 MB headers once took a relay to
/// 3.2 GB).
pub async fn claims_are_bounded_by_whole_rows<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let events: Vec<NewEvent> = (0..10)
        .map(|n| with_header_bytes(&format!("a{n}"), 1000))
        .collect();
    h.enqueue(&store, &events).await;
    // About 1070 bytes a row (1000 of headers, the id, names and the payload): 0, ~1070 and
    // ~2140 before the first three, ~3210 before the fourth.
    let request = claim_up_to(100).with_byte_limits(2500, 1_000_000);
    let first = store.claim(&request).await.unwrap();
    assert_eq!(
        first.events.len(),
        3,
        "headers count toward max_batch_bytes: {:?}",
        seqs_of(&first.events)
    );
    store
        .ack(&first.lease, &seqs_of(&first.events))
        .await
        .unwrap();
    let second = store.claim(&request).await.unwrap();
    assert_eq!(
        second.events.len(),
        3,
        "the next claim goes on in seq order"
    );
    assert!(second.events[0].seq > first.events[2].seq);
}

/// An event whose columns other than the payload (here: its headers, its event type, its
/// aggregate key) are above `max_metadata_bytes` together is never handed out: the claim buries
/// it without loading them, with a reason that names the limit and the size; under `Block` the
/// later events of its aggregate wait behind it, under `Skip` they go on; other aggregates go
/// on either way. An aggregate key over the limit by itself is not even sent to the relay: the
/// rows of that aggregate are buried all the same, and no other aggregate is held.
pub async fn oversized_metadata_is_buried_unread_and_holds_its_aggregate<H: Harness>(h: &H) {
    // 255 characters of 4 bytes: 1020 bytes, over the limit alone (and within what every
    // store's aggregate_id column holds).
    let huge_key = "\u{1F980}".repeat(255);
    for policy in [DeadLetterPolicy::Block, DeadLetterPolicy::Skip] {
        let store = h.fresh().await;
        let ids = ids_of(
            h.enqueue(
                &store,
                &[
                    numbered("a", 1),
                    with_header_bytes("a", 5000),
                    numbered("a", 3),
                    numbered("b", 1),
                    // Within MySQL's column sizes, over the limit together.
                    NewEvent::from_json("agg", "c", "E".repeat(255), "{}")
                        .unwrap()
                        .with_destination("d".repeat(900)),
                    numbered(&huge_key, 1),
                    numbered(&huge_key, 2),
                    numbered("d", 1),
                ],
            )
            .await,
        );
        let request = ClaimRequest {
            dead_letter: policy,
            ..claim_up_to(100)
                .with_byte_limits(1_000_000, 1_000_000)
                .with_metadata_limit(1000)
        };
        let claim = store.claim(&request).await.unwrap();
        assert_eq!(claim.buried, 4, "{policy:?}: the relay counts them as dead");
        let got: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
        for (i, what) in [
            (1, "headers"),
            (4, "event type and destination"),
            (5, "key"),
            (6, "key"),
        ] {
            let record = store.get(ids[i]).await.unwrap().unwrap();
            assert_eq!(record.state, EventState::Dead, "{policy:?}: {what}");
            let error = record.last_error.unwrap_or_default();
            assert!(
                error.contains("bytes together, above relay.max_metadata_bytes = 1000")
                    && !error.contains("max_payload_bytes"),
                "{policy:?}: {what}: {error}"
            );
        }
        let headers_error = store.get(ids[1]).await.unwrap().unwrap().last_error;
        let size: u64 = headers_error
            .as_deref()
            .and_then(|e| e.split(" are ").nth(1))
            .and_then(|e| e.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(
            (5000..5200).contains(&size),
            "the reason gives the size measured: {headers_error:?}"
        );
        match policy {
            DeadLetterPolicy::Block => {
                assert_eq!(
                    got,
                    vec![ids[0], ids[3], ids[7]],
                    "a's third event waits behind the dead one"
                );
                let behind = store.get(ids[2]).await.unwrap().unwrap();
                assert_eq!(behind.state, EventState::Pending);
                assert_eq!(behind.event.attempts, 0);
            }
            DeadLetterPolicy::Skip => {
                assert_eq!(got, vec![ids[0], ids[2], ids[3], ids[7]]);
            }
        }
    }
}
