//! The sink alone against the machine's RabbitMQ: body formats and permanent failures.

mod common;

use outbox_sink_rabbitmq::RabbitMqSink;
use outbox_types::{Event, Outcome, Sink};

fn event(aggregate: &str, aggregate_type: &str, payload: &str) -> Event {
    common::claimed_event(aggregate_type, aggregate, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_bodies_are_structured_envelopes() {
    let rabbit = common::Rabbit::connect().await;
    let exchange = rabbit.exchange("outbox_ex_ce");
    rabbit.declare_exchange(&exchange).await;
    let queue = rabbit.queue_bound(&exchange, "#").await;
    let sink = RabbitMqSink::connect(common::config(serde_json::json!({
        "exchange": exchange,
        "format": "cloudevents",
        "cloudevents_source": "/orders-service",
    })))
    .unwrap();
    let e = event("42", "order", r#"{"amount": 1999}"#);
    assert_eq!(
        sink.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Delivered]
    );
    let messages = rabbit.drain_expecting(&queue, 1).await;
    assert_eq!(messages.len(), 1);
    let m = &messages[0];
    assert_eq!(
        m.properties.content_type().as_ref().map(|s| s.as_str()),
        Some("application/cloudevents+json")
    );
    assert_eq!(
        m.properties.kind().as_ref().map(|s| s.as_str()),
        Some("OrderCreated")
    );
    let body: serde_json::Value = serde_json::from_slice(&m.data).unwrap();
    assert_eq!(body["specversion"], "1.0");
    assert_eq!(body["id"], e.id.to_string());
    assert_eq!(body["data"]["amount"], 1999);
    rabbit.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_exchange_rejects_its_events_and_the_rest_of_the_batch_is_delivered() {
    let rabbit = common::Rabbit::connect().await;
    let prefix = common::unique("outbox_ex_mix");
    let present = format!("{prefix}.present");
    let missing = format!("{prefix}.missing");
    rabbit.declare_exchange(&present).await;
    let queue = rabbit.queue_bound(&present, "#").await;
    // The exchange is `<prefix>.<aggregate_type>`: one of them does not exist.
    let sink = RabbitMqSink::connect(common::config(serde_json::json!({
        "exchange": format!("{prefix}.${{aggregate_type}}"),
        "max_message_bytes": 1000,
    })))
    .unwrap();
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(2000));
    let batch = vec![
        event("1", "present", "{}"),
        event("2", "missing", "{}"),
        event("3", "present", "{}"),
        event("4", "present", &big),
    ];
    let outcomes = sink.publish(&batch).await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert_eq!(outcomes[2], Outcome::Delivered);
    common::assert_rejected(
        &outcomes[1],
        &[
            &format!("exchange `{missing}` does not exist"),
            "declare = true",
        ],
        "a missing exchange must be rejected",
    );
    common::assert_rejected(
        &outcomes[3],
        &["max_message_bytes"],
        "a too-large message must be rejected",
    );
    assert_eq!(rabbit.drain_expecting(&queue, 2).await.len(), 2);

    // An exchange deleted after the sink checked it: the publish fails on the channel (retry,
    // since the channel error cannot be pinned on one message up front), then it is rejected.
    rabbit.delete_queue(&queue).await;
    rabbit.delete_exchange(&present).await;
    let again = sink.publish(&[event("5", "present", "{}")]).await;
    assert!(
        matches!(&again[..], [Outcome::Reject { reason }] | [Outcome::Retry { reason, .. }] | [Outcome::Unavailable { reason, .. }] if reason.contains(&present)),
        "{again:?}"
    );
    let last = sink.publish(&[event("6", "present", "{}")]).await;
    assert!(
        matches!(&last[..], [Outcome::Reject { reason }] if reason.contains("does not exist")),
        "{last:?}"
    );
}

/// A row's headers that pose as the relay's own in another case (`Outbox-Event-Id`), or as its
/// `timestamp_in_ms`, never reach the queue: AMQP header names are case-sensitive, so they would
/// travel beside the real ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_relay_headers_in_any_case_do_not_travel() {
    let rabbit = common::Rabbit::connect().await;
    let exchange = rabbit.exchange("outbox_ex_forged");
    rabbit.declare_exchange(&exchange).await;
    let queue = rabbit.queue_bound(&exchange, "#").await;
    let sink =
        RabbitMqSink::connect(common::config(serde_json::json!({ "exchange": exchange }))).unwrap();
    let mut e = common::with_forged_relay_headers(event("42", "order", "{}"));
    e.headers.insert("TIMESTAMP_IN_MS".into(), "forged".into());
    assert_eq!(
        sink.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Delivered]
    );
    let messages = rabbit.drain_expecting(&queue, 1).await;
    assert_eq!(messages.len(), 1);
    let headers: Vec<(String, String)> = messages[0]
        .properties
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .keys()
        .map(|k| {
            let name = k.as_str().to_owned();
            let value = common::header(&messages[0], &name).unwrap_or_default();
            (name, value)
        })
        .collect();
    common::assert_no_forged_relay_headers(&e, &headers);
    assert!(
        !headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("timestamp_in_ms") && n != "timestamp_in_ms"),
        "{headers:?}"
    );
    rabbit.clean_up().await;
}

/// The frame size a rejection reason names: `… take N bytes …, more than the M bytes …`.
fn sizes_in(reason: &str) -> (usize, usize) {
    let number_before = |marker: &str| {
        let end = reason
            .find(marker)
            .unwrap_or_else(|| panic!("{marker}: {reason}"));
        let digits: String = reason[..end]
            .chars()
            .rev()
            .take_while(char::is_ascii_digit)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        digits.parse::<usize>().unwrap()
    };
    (
        number_before(" bytes in their AMQP frame"),
        number_before(" bytes RabbitMQ's frame size"),
    )
}

/// A header too large for one AMQP frame used to make RabbitMQ close the connection
/// (`FRAME_ERROR`): every message of the batch failed as "unavailable", the event was never
/// dead-lettered, and each retry took the connection down again. Now the sink measures each
/// message's header frame against the negotiated `frame_max` and rejects the one that cannot
/// fit, naming both sizes; the rest of the batch is delivered on the same connection. The
/// measure is exact: a header frame of exactly `frame_max` bytes goes through, one byte more
/// is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_too_large_for_a_frame_is_rejected_and_the_connection_stays_up() {
    let rabbit = common::Rabbit::connect().await;
    let exchange = rabbit.exchange("outbox_ex_frame");
    rabbit.declare_exchange(&exchange).await;
    let queue = rabbit.queue_bound(&exchange, "#").await;
    let sink =
        RabbitMqSink::connect(common::config(serde_json::json!({ "exchange": exchange }))).unwrap();
    let with_header = |aggregate: &str, len: usize| {
        let mut e = event(aggregate, "order", "{}");
        e.headers.insert("x-big".into(), "h".repeat(len));
        e
    };
    let batch = vec![
        event("1", "order", "{}"),
        with_header("2", 300_000),
        event("3", "order", "{}"),
    ];
    let outcomes = sink.publish(&batch).await;
    assert_eq!(outcomes[0], Outcome::Delivered, "{outcomes:?}");
    assert_eq!(outcomes[2], Outcome::Delivered, "{outcomes:?}");
    let reason = common::rejection(&outcomes[1]).to_owned();
    assert!(reason.contains("frame_max"), "{reason}");
    let (size, limit) = sizes_in(&reason);
    assert!(size > limit && limit >= 4096, "{reason}");
    assert_eq!(rabbit.drain_expecting(&queue, 2).await.len(), 2);

    // Exactly at the limit: sent and confirmed; one byte over: rejected, nothing sent.
    let fits = 300_000 - (size - limit);
    let at_limit = sink.publish(&[with_header("4", fits)]).await;
    assert_eq!(
        at_limit,
        vec![Outcome::Delivered],
        "a frame of exactly {limit} bytes"
    );
    let over = sink.publish(&[with_header("5", fits + 1)]).await;
    assert_eq!(sizes_in(common::rejection(&over[0])), (limit + 1, limit));
    assert_eq!(rabbit.drain_expecting(&queue, 1).await.len(), 1);
    rabbit.clean_up().await;
}
