//! The RabbitMQ adapter against the machine's broker (`OUTBOX_TEST_AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`); every test uses its own queue.

#![cfg(all(feature = "rabbitmq", feature = "sqlite"))]

mod common;

use std::time::Duration;

use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use outbox_inbox::{AdapterOptions, EventId, InboxHandler};
use tokio::task::JoinHandle;

use common::{eventually, fixture, unique};

async fn channel() -> Channel {
    let url = std::env::var("OUTBOX_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("RabbitMQ must be running on 127.0.0.1:5672");
    connection.create_channel().await.unwrap()
}

async fn declare(channel: &Channel, quorum: bool) -> String {
    let queue = unique("inbox_q");
    let mut args = FieldTable::default();
    if quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("quorum")),
        );
    }
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: quorum,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
    queue
}

async fn publish(channel: &Channel, queue: &str, id: EventId, body: &[u8]) {
    let mut headers = FieldTable::default();
    headers.insert(
        "outbox-event-id".into(),
        AMQPValue::LongString(LongString::from(id.to_string())),
    );
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default().with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Run the adapter over `queue` on `consumer` in the background, until aborted.
fn spawn_run(
    consumer: &Channel,
    queue: &str,
    handler: impl InboxHandler + 'static,
    options: AdapterOptions,
) -> JoinHandle<Result<(), outbox_inbox::Error>> {
    let (consumer, queue) = (consumer.clone(), queue.to_owned());
    tokio::spawn(
        async move { outbox_inbox::rabbitmq::run(&consumer, &queue, &handler, &options).await },
    )
}

/// Messages left in `queue` once the adapter's channel is closed (unacked ones come back).
async fn left_after_close(consumer_channel: Channel, queue: &str) -> u32 {
    let _ = consumer_channel.close(200, "OK".into()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ch = channel().await;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let count = q.message_count();
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    count
}

#[tokio::test]
async fn same_event_twice_applies_once_and_acks() {
    let f = fixture().await;
    let publisher = channel().await;
    let queue = declare(&publisher, false).await;
    let id = EventId::new();
    publish(&publisher, &queue, id, br#"{"n":1}"#).await;
    publish(&publisher, &queue, id, br#"{"n":1}"#).await;

    let consumer = channel().await;
    let runner = spawn_run(&consumer, &queue, f.handler(), AdapterOptions::default());
    assert!(eventually(Duration::from_secs(15), || async { f.effects().await == 1 }).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    runner.abort();
    assert_eq!(f.effects().await, 1);
    assert_eq!(
        left_after_close(consumer, &queue).await,
        0,
        "both deliveries acked"
    );
}

async fn poison(quorum: bool) {
    let f = fixture().await;
    let publisher = channel().await;
    let queue = declare(&publisher, quorum).await;
    let id = EventId::new();
    publish(&publisher, &queue, id, br#"{"n":2}"#).await;

    let consumer = channel().await;
    let options = AdapterOptions::default()
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(100));
    let runner = spawn_run(&consumer, &queue, f.failing_handler(), options);
    assert!(f.wait_parked(Duration::from_secs(20)).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    runner.abort();
    f.assert_parked_after_failures(id, 3, br#"{"n":2}"#).await;
    assert_eq!(
        left_after_close(consumer, &queue).await,
        0,
        "parked message acked"
    );
}

#[tokio::test]
async fn always_failing_handler_is_parked_after_max_attempts_classic_queue() {
    poison(false).await;
}

#[tokio::test]
async fn always_failing_handler_is_parked_after_max_attempts_quorum_queue() {
    poison(true).await;
}
