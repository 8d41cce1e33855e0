//! The contract between the relay and a destination.
//!
//! A sink turns each event into a message at its destination and reports, per event, one of
//! three outcomes: [`Outcome::Delivered`] once the destination confirmed it (broker ack, 2xx…),
//! [`Outcome::Retry`] for a failure that may pass (broker down, timeout, 5xx, 429), and
//! [`Outcome::Reject`] for a failure that will not (payload refused, message too large, 4xx).
//! A failed delivery is data for the relay's retry and dead-letter path, never a panic or an
//! error that unwinds the relay loop.

use std::time::Duration;

use async_trait::async_trait;
use thiserror::Error;

use crate::event::Event;

/// What became of one event handed to a sink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The destination confirmed it.
    Delivered,
    /// It failed but may succeed later.
    Retry {
        /// Why, for `last_error` and logs.
        reason: String,
        /// When the destination asked to be retried (`Retry-After`); `None` lets the relay's
        /// backoff decide.
        after: Option<Duration>,
    },
    /// It will never succeed as it is: bury it.
    Reject {
        /// Why, for `last_error` and logs.
        reason: String,
    },
}

impl Outcome {
    /// A retryable failure with the relay's own backoff.
    pub fn retry(reason: impl Into<String>) -> Self {
        Outcome::Retry {
            reason: reason.into(),
            after: None,
        }
    }

    /// A permanent failure.
    pub fn reject(reason: impl Into<String>) -> Self {
        Outcome::Reject {
            reason: reason.into(),
        }
    }
}

/// A sink that cannot even start (bad configuration, unusable credentials).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SinkError {
    /// The configuration cannot work; the message says which setting and how to fix it.
    #[error("sink configuration error: {0}")]
    Config(String),
    /// The destination cannot be reached right now.
    #[error("destination unavailable: {0}")]
    Unavailable(String),
}

/// A destination for events.
///
/// # Contract
/// - `publish` returns exactly one [`Outcome`] per input event, in input order.
/// - Delivery is at least once: a sink may deliver an event and still report a failure (an ack
///   lost on the way back); the event will then be published again. It must put the event id
///   where consumers can deduplicate on it (message id, header).
/// - The relay hands a batch that holds **at most one event per aggregate**, so everything in
///   one call may be published concurrently; per-aggregate order is kept by the relay, which
///   publishes the next event of an aggregate only after the previous one was delivered.
/// - `publish` may be called concurrently from several tasks.
/// - `publish` should return within the relay's publish timeout; when it does not, the relay
///   counts every event of the call as a retryable failure.
#[async_trait]
pub trait Sink: Send + Sync + 'static {
    /// A short name for logs and metrics (`stdout`, `kafka`, …).
    fn name(&self) -> &str;

    /// Publish `events`; one outcome per event, same order.
    async fn publish(&self, events: &[Event]) -> Vec<Outcome>;

    /// Whether the destination is reachable (readiness). Defaults to always ready.
    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }
}

#[async_trait]
impl<S: Sink + ?Sized> Sink for std::sync::Arc<S> {
    fn name(&self) -> &str {
        (**self).name()
    }
    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        (**self).publish(events).await
    }
    async fn check(&self) -> Result<(), SinkError> {
        (**self).check().await
    }
}
