//! The JetStream adapter against the machine's NATS (`OUTBOX_TEST_NATS_URL`, default
//! `127.0.0.1:4222`); every test uses its own stream.

#![cfg(all(feature = "nats", feature = "sqlite"))]

mod common;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer, consumer::pull, stream};
use outbox_inbox::{AdapterOptions, EventId, InboxHandler};
use tokio::task::JoinHandle;

use common::{eventually, fixture, unique};

async fn setup() -> (jetstream::Context, String, PullConsumer) {
    let url = std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(url)
        .await
        .expect("NATS must be running on 127.0.0.1:4222");
    let js = jetstream::new(client);
    let name = unique("inbox").to_uppercase();
    let subject = format!("{}.events", name.to_lowercase());
    let stream = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    let consumer: PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("billing".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    (js, subject, consumer)
}

async fn publish(js: &jetstream::Context, subject: &str, id: Option<EventId>, body: &'static str) {
    let mut headers = HeaderMap::new();
    if let Some(id) = id {
        headers.insert("outbox-event-id", id.to_string().as_str());
    }
    js.publish_with_headers(subject.to_owned(), headers, body.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Run the adapter over `consumer` in the background, until aborted.
fn spawn_run(
    consumer: &PullConsumer,
    handler: impl InboxHandler + 'static,
    options: AdapterOptions,
) -> JoinHandle<Result<(), outbox_inbox::Error>> {
    let consumer = consumer.clone();
    tokio::spawn(async move { outbox_inbox::nats::run(&consumer, &handler, &options).await })
}

/// Wait up to `timeout` for every message to be acked.
async fn wait_settled(consumer: &PullConsumer, timeout: Duration) -> bool {
    eventually(timeout, || settled(consumer)).await
}

async fn delete_stream(js: &jetstream::Context, consumer: &PullConsumer) {
    js.delete_stream(consumer.cached_info().stream_name.clone())
        .await
        .unwrap();
}

async fn settled(consumer: &PullConsumer) -> bool {
    match consumer.get_info().await {
        Ok(info) => info.num_pending == 0 && info.num_ack_pending == 0,
        Err(_) => false,
    }
}

#[tokio::test]
async fn same_event_twice_applies_once_and_acks() {
    let f = fixture().await;
    let (js, subject, consumer) = setup().await;
    let id = EventId::new();
    publish(&js, &subject, Some(id), r#"{"n":1}"#).await;
    publish(&js, &subject, Some(id), r#"{"n":1}"#).await;

    let runner = spawn_run(&consumer, f.handler(), AdapterOptions::default());
    assert!(wait_settled(&consumer, Duration::from_secs(15)).await);
    runner.abort();
    assert_eq!(f.effects().await, 1);
    assert!(f.parked().await.is_empty());
    delete_stream(&js, &consumer).await;
}

#[tokio::test]
async fn always_failing_handler_is_parked_after_max_attempts_and_acked() {
    let f = fixture().await;
    let (js, subject, consumer) = setup().await;
    let id = EventId::new();
    publish(&js, &subject, Some(id), r#"{"n":2}"#).await;

    let options = AdapterOptions::default()
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(100));
    let runner = spawn_run(&consumer, f.failing_handler(), options);
    assert!(f.wait_parked(Duration::from_secs(20)).await);
    assert!(wait_settled(&consumer, Duration::from_secs(10)).await);
    runner.abort();
    f.assert_parked_after_failures(id, 3, br#"{"n":2}"#).await;
    delete_stream(&js, &consumer).await;
}

#[tokio::test]
async fn message_without_event_id_is_parked_at_once() {
    let f = fixture().await;
    let (js, subject, consumer) = setup().await;
    publish(&js, &subject, None, "not an event").await;
    let runner = spawn_run(&consumer, f.handler(), AdapterOptions::default());
    assert!(wait_settled(&consumer, Duration::from_secs(15)).await);
    runner.abort();
    let parked = f.parked().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].event_id, None);
    assert_eq!(parked[0].attempts, 1);
    delete_stream(&js, &consumer).await;
}

#[tokio::test]
async fn failed_first_delivery_is_redelivered_and_applied_once() {
    let f = fixture().await;
    let (js, subject, consumer) = setup().await;
    publish(&js, &subject, Some(EventId::new()), r#"{"n":3}"#).await;
    let options = AdapterOptions::default().with_retry_delay(Duration::from_millis(100));
    let runner = spawn_run(&consumer, f.flaky_handler(), options);
    assert!(eventually(Duration::from_secs(15), || async { f.effects().await == 1 }).await);
    assert!(wait_settled(&consumer, Duration::from_secs(10)).await);
    runner.abort();
    assert_eq!(f.effects().await, 1);
    assert!(f.parked().await.is_empty());
    delete_stream(&js, &consumer).await;
}

#[tokio::test]
async fn malformed_payload_is_parked_without_retries() {
    let f = fixture().await;
    let (js, subject, consumer) = setup().await;
    publish(&js, &subject, Some(EventId::new()), "not json").await;
    let options = AdapterOptions::default().with_max_attempts(5);
    let runner = spawn_run(&consumer, f.json_handler(), options);
    assert!(f.wait_parked(Duration::from_secs(15)).await);
    assert!(wait_settled(&consumer, Duration::from_secs(10)).await);
    runner.abort();
    let parked = f.parked().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].attempts, 1);
    assert!(
        parked[0].error.contains("not the expected JSON"),
        "{}",
        parked[0].error
    );
    delete_stream(&js, &consumer).await;
}
