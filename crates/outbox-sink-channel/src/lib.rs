//! # outbox-sink-channel
//!
//! A sink that hands events to a [`tokio::sync::mpsc`] channel in the same process: for tests,
//! for embedding the relay in a service that consumes its own events, and as the zero-cost
//! destination of the drain benchmark.
//!
//! An event counts as delivered once the channel accepted it. The channel is bounded, so a slow
//! receiver slows the relay down instead of growing memory; a dropped receiver turns every
//! publish into a retryable failure (the events stay in the outbox).
//!
//! ```
//! # #[tokio::main] async fn main() {
//! use outbox_types::{Outcome, Sink};
//! let (sink, mut rx) = outbox_sink_channel::ChannelSink::new(16);
//! # let event = outbox_types::NewEvent::from_json("order", "1", "OrderCreated", "{}").unwrap().claimed(1);
//! assert_eq!(sink.publish(&[event]).await, vec![Outcome::Delivered]);
//! assert_eq!(rx.recv().await.unwrap().event_type, "OrderCreated");
//! # }
//! ```

use async_trait::async_trait;
use outbox_types::{Event, Outcome, Sink, SinkError};
use tokio::sync::mpsc;

/// Sends each published event into a bounded channel.
#[derive(Clone, Debug)]
pub struct ChannelSink {
    tx: mpsc::Sender<Event>,
}

impl ChannelSink {
    /// A sink and the receiving end of its channel, holding at most `capacity` unread events.
    pub fn new(capacity: usize) -> (Self, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (ChannelSink { tx }, rx)
    }

    /// A sink over an existing sender.
    pub fn from_sender(tx: mpsc::Sender<Event>) -> Self {
        ChannelSink { tx }
    }
}

#[async_trait]
impl Sink for ChannelSink {
    fn name(&self) -> &str {
        "channel"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(events.len());
        for event in events {
            let outcome = match self.tx.send(event.clone()).await {
                Ok(()) => Outcome::Delivered,
                Err(_) => Outcome::unavailable("the channel's receiver was dropped"),
            };
            outcomes.push(outcome);
        }
        outcomes
    }

    async fn check(&self) -> Result<(), SinkError> {
        if self.tx.is_closed() {
            Err(SinkError::Unavailable(
                "the channel's receiver was dropped".into(),
            ))
        } else {
            Ok(())
        }
    }
}
