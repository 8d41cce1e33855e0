//! The JetStream adapter against the machine's NATS (`OUTBOX_TEST_NATS_URL`, default
//! `127.0.0.1:4222`); every test uses its own stream. The scenarios it shares with Redis are
//! in `common`; here: its channel and what only NATS tests.

#![cfg(all(feature = "nats", feature = "sqlite"))]

mod common;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer, consumer::pull, stream};
use outbox_inbox::{AdapterOptions, EventId, InboxHandler};
use tokio::task::JoinHandle;

use common::{Channel, eventually, fixture, unique};

/// A stream of its own with the durable pull consumer `billing`.
struct Nats {
    js: jetstream::Context,
    subject: String,
    consumer: PullConsumer,
}

impl Channel for Nats {
    async fn open() -> Nats {
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
        Nats {
            js,
            subject,
            consumer,
        }
    }

    async fn publish(&mut self, id: Option<EventId>, body: &'static str) {
        let mut headers = HeaderMap::new();
        if let Some(id) = id {
            headers.insert("outbox-event-id", id.to_string().as_str());
        }
        self.js
            .publish_with_headers(self.subject.clone(), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    fn spawn_run(
        &self,
        handler: impl InboxHandler + 'static,
        options: AdapterOptions,
    ) -> JoinHandle<Result<(), outbox_inbox::Error>> {
        let consumer = self.consumer.clone();
        tokio::spawn(async move { outbox_inbox::nats::run(&consumer, &handler, &options).await })
    }

    /// Nothing pending and nothing awaiting an ack.
    async fn wait_settled(&self, timeout: Duration) -> bool {
        eventually(timeout, || settled(&self.consumer)).await
    }

    async fn delete(self) {
        self.js
            .delete_stream(self.consumer.cached_info().stream_name.clone())
            .await
            .unwrap();
    }
}

async fn settled(consumer: &PullConsumer) -> bool {
    match consumer.get_info().await {
        Ok(info) => info.num_pending == 0 && info.num_ack_pending == 0,
        Err(_) => false,
    }
}

common::channel_tests!(Nats; failed_first_delivery_is_redelivered_and_applied_once);

#[tokio::test]
async fn message_without_event_id_is_parked_at_once() {
    let f = fixture().await;
    let mut nats = Nats::open().await;
    nats.publish(None, "not an event").await;
    let runner = nats.spawn_run(f.handler(), AdapterOptions::default());
    assert!(nats.wait_settled(Duration::from_secs(15)).await);
    runner.abort();
    let parked = f.parked().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].event_id, None);
    assert_eq!(parked[0].attempts, 1);
    nats.delete().await;
}

#[tokio::test]
async fn malformed_payload_is_parked_without_retries() {
    let f = fixture().await;
    let mut nats = Nats::open().await;
    nats.publish(Some(EventId::new()), "not json").await;
    let options = AdapterOptions::default().with_max_attempts(5);
    let runner = nats.spawn_run(f.json_handler(), options);
    assert!(f.wait_parked(Duration::from_secs(15)).await);
    assert!(nats.wait_settled(Duration::from_secs(10)).await);
    runner.abort();
    let parked = f.parked().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].attempts, 1);
    assert!(
        parked[0].error.contains("not the expected JSON"),
        "{}",
        parked[0].error
    );
    nats.delete().await;
}
