//! RabbitMQ set-up written once for everything that reads back what the RabbitMQ sink
//! published: the sink's integration tests, the inbox's RabbitMQ tests and the bench's
//! `drain --sink rabbitmq` destination all need the same exchange, queue and count.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind};

/// Which set-up step failed, naming the exchange or queue, so a caller's error report says
/// what it was declaring rather than only what the broker answered.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("declaring exchange {exchange}")]
    Exchange {
        exchange: String,
        #[source]
        source: lapin::Error,
    },
    #[error("declaring queue {queue}")]
    Queue {
        queue: String,
        #[source]
        source: lapin::Error,
    },
    #[error("binding queue {queue} to {exchange}")]
    Bind {
        queue: String,
        exchange: String,
        #[source]
        source: lapin::Error,
    },
}

/// Declares `exchange` as a durable topic exchange, as the sink's `declare = true` makes it.
pub async fn declare_topic_exchange(channel: &Channel, exchange: &str) -> Result<(), SetupError> {
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|source| SetupError::Exchange {
            exchange: exchange.to_owned(),
            source,
        })
}

/// Declares `queue` as a durable (classic) queue and binds it to `exchange` with `key`, so it
/// keeps every message the sink routes there with that key.
pub async fn declare_bound_queue(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    key: &str,
) -> Result<(), SetupError> {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|source| SetupError::Queue {
            queue: queue.to_owned(),
            source,
        })?;
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|source| SetupError::Bind {
            queue: queue.to_owned(),
            exchange: exchange.to_owned(),
            source,
        })
}

/// The messages ready in `queue` (a passive declare: AMQP does not count those delivered and
/// not yet acked).
pub async fn ready_messages(channel: &Channel, queue: &str) -> Result<u32, lapin::Error> {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(declared.message_count())
}
