//! The sink alone against the real test broker: body formats and permanent failures.

mod common;

use outbox_sink_kafka::KafkaSink;
use outbox_types::{Event, Outcome, Sink};
use rdkafka::Message;

fn event(aggregate: &str, payload: &str, destination: Option<String>) -> Event {
    Event {
        destination,
        ..common::claimed_event("order", aggregate, payload)
    }
}

/// A topic of the test's own (named `prefix_…`, one partition), and a sink that sends to it
/// from the shared test broker with `settings` added; `None` (the test is skipped) when no test
/// broker is running.
async fn sink_on_own_topic(
    prefix: &str,
    mut settings: serde_json::Value,
) -> Option<(String, KafkaSink)> {
    if !common::kafka_available() {
        return None;
    }
    let topic = common::unique(prefix);
    common::create_topic(&common::brokers(), &topic, 1).await;
    settings["brokers"] = serde_json::json!([common::brokers()]);
    settings["topic"] = topic.clone().into();
    Some((topic, KafkaSink::connect(common::config(settings)).unwrap()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_bodies_are_structured_envelopes() {
    let Some((topic, sink)) = sink_on_own_topic(
        "outbox_ce",
        serde_json::json!({
            "format": "cloudevents",
            "cloudevents_source": "/orders-service",
            "compression": "zstd",
        }),
    )
    .await
    else {
        return;
    };
    let e = event("42", r#"{"amount": 1999}"#, None);
    assert_eq!(
        sink.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Delivered]
    );
    let m = &common::consume_only_record(&topic).await;
    assert_eq!(
        common::header(m, "content-type").as_deref(),
        Some("application/cloudevents+json")
    );
    let body: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
    assert_eq!(body["specversion"], "1.0");
    assert_eq!(body["id"], e.id.to_string());
    assert_eq!(body["source"], "/orders-service");
    assert_eq!(body["data"]["amount"], 1999);
    assert_eq!(body["traceparent"], e.headers["traceparent"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_too_large_is_rejected_and_the_rest_of_the_batch_is_delivered() {
    let Some((topic, sink)) = sink_on_own_topic(
        "outbox_big",
        serde_json::json!({ "max_message_bytes": 10000 }),
    )
    .await
    else {
        return;
    };
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(20_000));
    let batch = vec![
        event("1", "{}", None),
        event("2", &big, None),
        event("3", "{}", None),
        event("4", "{}", Some("has a space".into())),
    ];
    let outcomes = sink.publish(&batch).await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert_eq!(outcomes[2], Outcome::Delivered);
    common::assert_rejected(
        &outcomes[1],
        &[&topic, "max_message_bytes"],
        "a too-large record must be rejected",
    );
    common::assert_rejected(
        &outcomes[3],
        &["has a space", "destination"],
        "an illegal topic name must be rejected",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_is_rejected_when_auto_creation_is_off() {
    if !common::kafka_available() {
        return;
    }
    let topic = common::unique("outbox_nocreate");
    let sink = KafkaSink::connect(common::config(serde_json::json!({
        "brokers": common::brokers(),
        "topic": topic,
        "delivery_timeout": "3s",
        "allow_auto_create_topics": false,
        // How long librdkafka waits for a new topic to show up before it calls it missing.
        "properties": {"topic.metadata.propagation.max.ms": 500},
    })))
    .unwrap();
    // Once librdkafka learnt the topic is missing, every record for it is refused at once.
    for _ in 0..2 {
        let outcomes = sink.publish(&[event("1", "{}", None)]).await;
        let [outcome] = &outcomes[..] else {
            panic!("a missing topic must be rejected: {outcomes:?}");
        };
        common::assert_rejected(
            outcome,
            &[
                &format!("topic `{topic}` does not exist"),
                "create the topic",
            ],
            "a missing topic must be rejected",
        );
    }
}

/// `record_timestamp = "occurred_at"`: the record's timestamp is the event's `occurred_at` in
/// milliseconds; by default it is the time of publishing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_timestamp_is_the_publish_time_or_occurred_at() {
    let occurred = chrono::DateTime::parse_from_rfc3339("2026-01-02T03:04:05.678901Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    for (setting, expect_occurred) in [("publish_time", false), ("occurred_at", true)] {
        let Some((topic, sink)) = sink_on_own_topic(
            "outbox_ts",
            serde_json::json!({ "record_timestamp": setting }),
        )
        .await
        else {
            return;
        };
        let mut e = event("7", "{}", None);
        e.occurred_at = occurred;
        let before = chrono::Utc::now().timestamp_millis();
        assert_eq!(
            sink.publish(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        let after = chrono::Utc::now().timestamp_millis();
        let at = common::consume_only_record(&topic)
            .await
            .timestamp()
            .to_millis()
            .expect("a record timestamp");
        if expect_occurred {
            assert_eq!(at, occurred.timestamp_millis(), "{setting}");
        } else {
            assert!(
                (before - 1_000..=after + 1_000).contains(&at),
                "{setting}: {at} not between {before} and {after}"
            );
        }
    }
}

/// A row's headers that pose as the relay's own in another case (`Outbox-Event-Id`) never reach
/// the topic: Kafka header names are case-sensitive, so they would travel beside the real ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_relay_headers_in_any_case_do_not_travel() {
    let Some((topic, sink)) = sink_on_own_topic("outbox_forged", serde_json::json!({})).await
    else {
        return;
    };
    let e = common::with_forged_relay_headers(event("42", "{}", None));
    assert_eq!(
        sink.publish(std::slice::from_ref(&e)).await,
        vec![Outcome::Delivered]
    );
    let m = common::consume_only_record(&topic).await;
    use rdkafka::message::Headers;
    let headers: Vec<(String, String)> = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| {
                    (
                        h.key.to_owned(),
                        String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    common::assert_no_forged_relay_headers(&e, &headers);
}
