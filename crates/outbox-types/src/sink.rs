//! The contract between the relay and a destination.
//!
//! A sink turns each event into a message at its destination and reports, per event, one of
//! four outcomes:
//!
//! - [`Outcome::Delivered`]: the destination confirmed it (broker ack, 2xx…).
//! - [`Outcome::Unavailable`]: the destination could not be reached or is not serving (connection
//!   refused or reset, DNS or TLS failure, connect or publish timeout, channel or connection
//!   closed, no leader, HTTP 408/429/502/503/504, a whole call failing). It says nothing about the
//!   event, so however long it lasts it costs **no attempt** (the failure is kept as the event's
//!   `last_error`, which marks it waiting and holds its aggregate's later events behind it): an
//!   outage costs time, never events. The relay waits, probes the destination with one call at
//!   a time and resumes when it answers.
//! - [`Outcome::Retry`]: this event failed in a way that may pass (a per-message error the
//!   destination did not explain, HTTP 500). It costs an attempt; after `max_attempts` it is dead.
//! - [`Outcome::Reject`]: the destination refused this event and will refuse it again (message
//!   too large, invalid subject, missing topic or stream, HTTP 4xx): it is dead at once.
//!
//! Each sink's crate docs list which of its failures map to which outcome. A failed delivery is
//! data for the relay's retry and dead-letter path, never a panic or an error that unwinds the
//! relay loop.

use std::time::Duration;

use async_trait::async_trait;
use thiserror::Error;

use crate::event::Event;

/// What became of one event handed to a sink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The destination confirmed it.
    Delivered,
    /// The destination is unreachable or not serving: the event waits, and no attempt is
    /// counted (see the module docs).
    Unavailable {
        /// Why, for `last_error` and logs.
        reason: String,
        /// When the destination asked to be called again (`Retry-After`); `None` lets the
        /// relay's outage backoff decide.
        after: Option<Duration>,
    },
    /// This event failed but may succeed later; it costs an attempt.
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

    /// The destination is unreachable or not serving; costs no attempt.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Outcome::Unavailable {
            reason: reason.into(),
            after: None,
        }
    }

    /// The reason of a failure, if it is one.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Outcome::Delivered => None,
            Outcome::Unavailable { reason, .. }
            | Outcome::Retry { reason, .. }
            | Outcome::Reject { reason } => Some(reason),
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
