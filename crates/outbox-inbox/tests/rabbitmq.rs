//! The RabbitMQ adapter against the machine's broker (`OUTBOX_TEST_AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`); every test uses its own queue, classic or quorum
//! (whose attempts the adapter counts differently). The scenarios every broker passes are in
//! `common`; here: its channel.

#![cfg(all(feature = "rabbitmq", feature = "sqlite"))]

mod common;

use std::time::Duration;

use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel as AmqpChannel, Connection, ConnectionProperties};
use outbox_inbox::{AdapterOptions, EventId, InboxHandler};

use common::{Channel, Runner, eventually};
use outbox_testkit::unique;

async fn amqp_channel() -> AmqpChannel {
    let url = std::env::var("OUTBOX_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("RabbitMQ must be running on 127.0.0.1:5672");
    connection.create_channel().await.unwrap()
}

/// A queue of its own, quorum or classic, with a channel to publish on and one for the
/// adapter.
struct Queue<const QUORUM: bool> {
    publisher: AmqpChannel,
    consumer: AmqpChannel,
    queue: String,
}

impl<const QUORUM: bool> Queue<QUORUM> {
    /// Messages ready in the queue (AMQP does not count those delivered and not yet acked).
    async fn ready(&self) -> u32 {
        outbox_testkit::rabbitmq::ready_messages(&self.publisher, &self.queue)
            .await
            .unwrap()
    }
}

impl<const QUORUM: bool> Channel for Queue<QUORUM> {
    async fn open() -> Self {
        let publisher = amqp_channel().await;
        let queue = unique("inbox_q");
        let mut args = FieldTable::default();
        if QUORUM {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString(LongString::from("quorum")),
            );
        }
        publisher
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: QUORUM,
                    ..Default::default()
                },
                args,
            )
            .await
            .unwrap();
        Queue {
            publisher,
            consumer: amqp_channel().await,
            queue,
        }
    }

    async fn publish(&mut self, id: Option<EventId>, body: &'static str) {
        let mut headers = FieldTable::default();
        if let Some(id) = id {
            headers.insert(
                "outbox-event-id".into(),
                AMQPValue::LongString(LongString::from(id.to_string())),
            );
        }
        self.publisher
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    fn spawn_run(&self, handler: impl InboxHandler + 'static, options: AdapterOptions) -> Runner {
        let (consumer, queue) = (self.consumer.clone(), self.queue.clone());
        tokio::spawn(async move {
            outbox_inbox::rabbitmq::run(&consumer, &queue, &handler, &options).await
        })
    }

    /// Nothing left in the queue once the adapter's channel is closed: AMQP only counts ready
    /// messages, so wait until none is, give the adapter 500 ms to settle what it holds, then
    /// close its channel (what it had not acked comes back) and count again.
    async fn wait_settled(&self, timeout: Duration) -> bool {
        if !eventually(timeout, || async { self.ready().await == 0 }).await {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = self.consumer.close(200, "OK".into()).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.ready().await == 0
    }

    async fn delete(self) {
        let _ = self
            .publisher
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

common::channel_tests!(@as Queue<false>;
    same_event_twice_applies_once_and_acks = same_event_twice_applies_once_and_acks,
    always_failing_handler_is_parked_after_max_attempts_classic_queue =
        always_failing_handler_is_parked_after_max_attempts_and_acked,
    failed_first_delivery_is_redelivered_and_applied_once_classic_queue =
        failed_first_delivery_is_delivered_again_and_applied_once,
    message_without_event_id_is_parked_at_once = message_without_event_id_is_parked_at_once,
    malformed_payload_is_parked_without_retries = malformed_payload_is_parked_without_retries,
);

common::channel_tests!(@as Queue<true>;
    always_failing_handler_is_parked_after_max_attempts_quorum_queue =
        always_failing_handler_is_parked_after_max_attempts_and_acked,
    failed_first_delivery_is_redelivered_and_applied_once_quorum_queue =
        failed_first_delivery_is_delivered_again_and_applied_once,
);
