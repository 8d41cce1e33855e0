//! The JetStream adapter against the machine's NATS (`OUTBOX_TEST_NATS_URL`, default
//! `127.0.0.1:4222`); every test uses its own stream. The scenarios every broker passes are in
//! `common`; here: its channel.

#![cfg(all(feature = "nats", feature = "sqlite"))]

mod common;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer, consumer::pull, stream};
use outbox_inbox::{AdapterOptions, EventId, InboxHandler};

use common::{Channel, Runner, eventually};
use outbox_testkit::unique;

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

    fn spawn_run(&self, handler: impl InboxHandler + 'static, options: AdapterOptions) -> Runner {
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
