//! Against the real NATS JetStream server on 127.0.0.1:4222 and the real PostgreSQL outbox:
//! exactly the committed events arrive, with their routing, headers and per-aggregate order;
//! duplicates are dropped by `Nats-Msg-Id`; a missing stream is a clear rejection; a broker that
//! is down at start-up keeps the events pending until it is back.

use outbox_sink_tests as common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use outbox_engine::RelayConfig;
use outbox_sink_nats::NatsSink;
use outbox_types::{Outcome, Sink, Store};

const NATS: &str = "nats://127.0.0.1:4222";

fn relay_config(stop_when_idle: bool) -> RelayConfig {
    common::relay_config("nats-test", stop_when_idle)
}

async fn jetstream_context() -> jetstream::Context {
    let client = async_nats::connect(NATS)
        .await
        .expect("NATS with JetStream must be running on 127.0.0.1:4222");
    jetstream::new(client)
}

/// Every message stored in `stream`, in stream order.
async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
) -> Vec<jetstream::message::StreamMessage> {
    let mut handle = js.get_stream(stream).await.unwrap();
    let info = handle.info().await.unwrap().clone();
    let mut out = Vec::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        if info.state.messages == 0 {
            break;
        }
        out.push(handle.get_raw_message(seq).await.unwrap());
    }
    out
}

fn header(m: &jetstream::message::StreamMessage, name: &str) -> Option<String> {
    m.headers.get(name).map(|v| v.as_str().to_owned())
}

/// A test's own names from `tag`: the subject prefix `outbox_<id>` and the stream `S_<ID>`.
fn own_prefix_and_stream(tag: &str) -> (String, String) {
    let id = common::unique(tag);
    (format!("outbox_{id}"), format!("S_{id}").to_uppercase())
}

/// Give the background connection of `sink` a moment (up to 2 s) to come up.
async fn wait_connected(sink: &NatsSink) {
    for _ in 0..100 {
        if sink.check().await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_publishes_exactly_the_committed_events_with_routing_and_order() {
    let store = Arc::new(common::fresh_store().await);
    let (prefix, stream) = own_prefix_and_stream("t");

    let (committed, committed_ids) = common::enqueue_with_ghosts(
        &store,
        common::special_event(format!("{prefix}.audit"))
            .with_header("Nats-Expected-Stream", "forged"),
    )
    .await;

    let sink = NatsSink::connect(common::config(serde_json::json!({
        "servers": [NATS],
        "subject": format!("{prefix}.${{event_type}}"),
        "create_stream": true,
        "stream_name": stream,
        "client_name": "outbox-sink-nats-test",
    })))
    .await
    .unwrap();
    let report = common::run_to_idle(&store, sink, relay_config(true)).await;
    assert_eq!(report.delivered, committed.len() as u64, "{report:?}");
    assert_eq!(report.dead, 0, "{report:?}");

    let stats = store.stats().await.unwrap();
    assert_eq!(stats.delivered, committed.len() as u64, "{stats:?}");
    assert_eq!(stats.pending + stats.in_flight + stats.dead, 0, "{stats:?}");

    let js = jetstream_context().await;
    let messages = read_stream(&js, &stream).await;
    assert_eq!(
        messages.len(),
        committed.len(),
        "exactly the committed events"
    );
    let by_id: HashMap<String, &jetstream::message::StreamMessage> = messages
        .iter()
        .map(|m| (header(m, "outbox-event-id").unwrap(), m))
        .collect();
    let expected: HashSet<String> = committed_ids.iter().map(|i| i.to_string()).collect();
    assert_eq!(by_id.keys().cloned().collect::<HashSet<_>>(), expected);

    let mut order = Vec::new();
    for m in &messages {
        let event_id = header(m, "outbox-event-id").unwrap();
        assert_eq!(header(m, "Nats-Msg-Id").as_deref(), Some(event_id.as_str()));
        assert_eq!(header(m, "outbox-event-type").as_deref(), Some("Numbered"));
        assert_eq!(header(m, "outbox-aggregate-type").as_deref(), Some("agg"));
        assert_eq!(
            header(m, "content-type").as_deref(),
            Some("application/json")
        );
        assert!(header(m, "Content-Type").is_none(), "one spelling only");
        assert!(header(m, "outbox-occurred-at").is_some());
        assert!(
            header(m, "Outbox-Event-Id").is_none(),
            "no forged twin of outbox-event-id"
        );
        assert!(
            header(m, "Nats-Expected-Stream").is_none(),
            "control headers are not forwarded"
        );
        let payload: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        let aggregate = payload["aggregate"].as_str().unwrap().to_owned();
        assert_eq!(
            header(m, "outbox-aggregate-id").as_deref(),
            Some(aggregate.as_str())
        );
        assert_ne!(aggregate, "ghost");
        if aggregate == "special" {
            assert_eq!(
                m.subject.as_str(),
                format!("{prefix}.audit"),
                "own destination wins"
            );
            assert_eq!(
                header(m, "traceparent").as_deref(),
                Some(common::SPECIAL_TRACEPARENT)
            );
            assert_eq!(
                header(m, "outbox-idempotency-key").as_deref(),
                Some("special-0")
            );
        } else {
            assert_eq!(m.subject.as_str(), format!("{prefix}.Numbered"));
        }
        order.push((aggregate, payload["n"].as_u64().unwrap()));
    }
    let violations = common::order_violations(&order);
    assert!(violations.is_empty(), "{violations:?}");

    js.delete_stream(&stream).await.unwrap();
}

/// A connected sink whose subjects (`outbox_<id>.<event type>`) go to a stream of the test's
/// own, which the sink creates; `extra` adds settings. Returns the sink and the stream's name.
async fn sink_with_own_stream(tag: &str, extra: serde_json::Value) -> (NatsSink, String) {
    let (prefix, stream) = own_prefix_and_stream(tag);
    let mut settings = serde_json::json!({
        "servers": [NATS],
        "subject": format!("{prefix}.${{event_type}}"),
        "create_stream": true,
        "stream_name": stream,
    });
    for (key, value) in extra.as_object().unwrap() {
        settings[key] = value.clone();
    }
    let sink = NatsSink::connect(common::config(settings)).await.unwrap();
    wait_connected(&sink).await;
    (sink, stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_event_is_stored_once() {
    let (sink, stream) = sink_with_own_stream("d", serde_json::json!({})).await;
    let events = vec![common::event("x", 1), common::event("y", 1)];
    assert_eq!(sink.publish(&events).await, vec![Outcome::Delivered; 2]);
    assert_eq!(sink.publish(&events[..1]).await, vec![Outcome::Delivered]);

    let js = jetstream_context().await;
    let messages = read_stream(&js, &stream).await;
    assert_eq!(
        messages.len(),
        2,
        "the second publish of an event is dropped as a duplicate"
    );
    js.delete_stream(&stream).await.unwrap();
}

/// A row's headers in the reserved prefix, in any case, never reach the stream (NATS keeps
/// header names' case, so `Outbox-Tenant` would travel as the writer wrote it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_relay_headers_in_any_case_do_not_travel() {
    let (sink, stream) = sink_with_own_stream("f", serde_json::json!({})).await;
    let e = common::with_forged_relay_headers(common::event("x", 1));
    assert_eq!(
        sink.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Delivered]
    );
    let js = jetstream_context().await;
    let messages = read_stream(&js, &stream).await;
    let headers: Vec<(String, String)> = messages[0]
        .headers
        .iter()
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |v| (name.to_string(), v.as_str().to_owned()))
        })
        .collect();
    common::assert_no_forged_relay_headers(&e, &headers);
    js.delete_stream(&stream).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_headers_send_content_type_as_earlier_releases_did() {
    let (sink, stream) =
        sink_with_own_stream("l", serde_json::json!({ "legacy_headers": true })).await;
    assert_eq!(
        sink.publish(&[common::event("x", 1)]).await,
        vec![Outcome::Delivered]
    );
    let js = jetstream_context().await;
    let messages = read_stream(&js, &stream).await;
    assert_eq!(
        header(&messages[0], "Content-Type").as_deref(),
        Some("application/json")
    );
    assert!(header(&messages[0], "content-type").is_none());
    js.delete_stream(&stream).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_without_a_stream_is_rejected_with_the_fix() {
    let id = common::unique("n");
    let sink = NatsSink::connect(common::config(serde_json::json!({
        "servers": [NATS],
        "subject": format!("nostream_{id}.${{event_type}}"),
    })))
    .await
    .unwrap();
    wait_connected(&sink).await;
    let mut bad = common::event("x", 1);
    bad.event_type = "Has Space".into();
    let outcomes = sink.publish(&[common::event("x", 1), bad]).await;
    common::assert_rejected(
        &outcomes[0],
        &[
            &format!("nostream_{id}.Numbered"),
            "nats stream add",
            "create_stream = true",
        ],
        "a subject no stream captures",
    );
    common::assert_rejected(&outcomes[1], &["whitespace"], "a subject with a space");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_at_start_keeps_events_pending_until_it_is_back() {
    let store = Arc::new(common::fresh_store().await);
    let (prefix, stream) = own_prefix_and_stream("o");

    let proxy = common::cut_proxy("127.0.0.1:4222".parse().unwrap()).await;
    let sink = NatsSink::connect(common::config(serde_json::json!({
        "servers": [format!("nats://{}", proxy.addr())],
        "subject": format!("{prefix}.${{event_type}}"),
        "create_stream": true,
        "stream_name": stream,
        "connect_timeout": "500ms",
        "ack_timeout": "1s",
        "max_reconnect_delay": "200ms",
    })))
    .await
    .expect("a broker that is down is not a configuration error");

    // Down at start-up, then lost while the relay runs: same story, through a reconnect.
    let (report, ids) = common::outage_then_cut_while_running(
        &store,
        sink,
        &proxy,
        "nats-test",
        "NATS unreachable",
    )
    .await;
    assert!(report.unavailable > 0, "{report:?}");

    let js = jetstream_context().await;
    let messages = read_stream(&js, &stream).await;
    let got: HashSet<String> = messages
        .iter()
        .filter_map(|m| header(m, "Nats-Msg-Id"))
        .collect();
    let want: HashSet<String> = ids.iter().map(|i| i.to_string()).collect();
    assert_eq!(got, want);
    assert_eq!(messages.len(), 50, "no duplicates stored");
    let order: Vec<(String, u64)> = messages
        .iter()
        .map(|m| common::aggregate_and_n(&m.payload))
        .collect();
    assert!(common::order_violations(&order).is_empty());
    js.delete_stream(&stream).await.unwrap();
}
