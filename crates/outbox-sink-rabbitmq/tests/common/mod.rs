//! Shared by the RabbitMQ sink's integration tests: the machine's RabbitMQ (127.0.0.1:5672,
//! guest/guest), queues bound by the test itself and read back with `basic_get`, and a fresh
//! PostgreSQL outbox per test.

#![allow(dead_code)]

pub use outbox_sink_tests::*;

use lapin::message::Delivery;
use lapin::options::{BasicGetOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::AMQPValue;
use lapin::{Channel, Connection, ConnectionProperties};
use outbox_testkit::rabbitmq;
use std::sync::Mutex;

/// The machine's RabbitMQ.
pub const URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A test's own connection and channel to RabbitMQ, to set up queues and read them. It keeps
/// the names of the exchanges and queues the test made, for [`Rabbit::clean_up`].
pub struct Rabbit {
    pub connection: Connection,
    pub channel: Channel,
    exchanges: Mutex<Vec<String>>,
    queues: Mutex<Vec<String>>,
}

impl Rabbit {
    pub async fn connect() -> Self {
        let connection = Connection::connect(URL, ConnectionProperties::default())
            .await
            .expect("RabbitMQ must be running on 127.0.0.1:5672 with guest/guest (scripts/services.sh starts it)");
        let channel = connection.create_channel().await.unwrap();
        Rabbit {
            connection,
            channel,
            exchanges: Mutex::default(),
            queues: Mutex::default(),
        }
    }

    /// A name no other test uses for an exchange of this test's own (declared by the test or by
    /// the sink); [`Rabbit::clean_up`] deletes it.
    pub fn exchange(&self, prefix: &str) -> String {
        let exchange = unique(prefix);
        self.exchanges.lock().unwrap().push(exchange.clone());
        exchange
    }

    /// Deletes every queue [`Rabbit::queue_bound`] made and every exchange
    /// [`Rabbit::exchange`] named.
    pub async fn clean_up(&self) {
        let queues = std::mem::take(&mut *self.queues.lock().unwrap());
        for queue in queues {
            self.delete_queue(&queue).await;
        }
        let exchanges = std::mem::take(&mut *self.exchanges.lock().unwrap());
        for exchange in exchanges {
            self.delete_exchange(&exchange).await;
        }
    }

    /// A durable topic exchange, as the sink's `declare = true` makes it.
    pub async fn declare_exchange(&self, exchange: &str) {
        rabbitmq::declare_topic_exchange(&self.channel, exchange)
            .await
            .unwrap();
    }

    /// A durable queue of the test's own bound to `exchange` with `key`; [`Rabbit::clean_up`]
    /// deletes it.
    pub async fn queue_bound(&self, exchange: &str, key: &str) -> String {
        let queue = unique("outbox_q");
        rabbitmq::declare_bound_queue(&self.channel, &queue, exchange, key)
            .await
            .unwrap();
        self.queues.lock().unwrap().push(queue.clone());
        queue
    }

    /// Every message in `queue` right now, in queue order.
    pub async fn drain(&self, queue: &str) -> Vec<Delivery> {
        let mut out = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            out.push(message.delivery);
        }
        out
    }

    /// Wait until `queue` holds `expected` messages (confirms come before the message is
    /// visible to `basic_get` only in rare cases), then drain it.
    pub async fn drain_expecting(&self, queue: &str, expected: usize) -> Vec<Delivery> {
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            out.extend(self.drain(queue).await);
            if out.len() >= expected || tokio::time::Instant::now() >= deadline {
                // One more look, so extras show up as a failure.
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                out.extend(self.drain(queue).await);
                return out;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    pub async fn delete_queue(&self, queue: &str) {
        let _ = self
            .channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await;
    }

    pub async fn delete_exchange(&self, exchange: &str) {
        let _ = self
            .channel
            .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
            .await;
    }
}

/// The header `name` of `delivery` as text.
pub fn header(delivery: &Delivery, name: &str) -> Option<String> {
    let headers = delivery.properties.headers().as_ref()?;
    match headers
        .inner()
        .get(&lapin::types::ShortString::from(name))?
    {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        other => Some(format!("{other:?}")),
    }
}
