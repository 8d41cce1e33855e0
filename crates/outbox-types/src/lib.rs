//! # outbox-types
//!
//! The vocabulary of the outbox toolkit, with no database, network or runtime dependency:
//!
//! - [`NewEvent`] is what a writer enqueues inside its own transaction; [`Event`] is what a relay
//!   claims and hands to a sink.
//! - [`EventState`] is the lifecycle every store implements the same way:
//!   `pending → in_flight → delivered | dead`, with a retry sending an event back to `pending`.
//! - [`Store`] is the contract a database implements (claim, ack, retry, bury, release, and the
//!   admin operations); [`Sink`] is the contract a destination implements (publish a batch, one
//!   [`Outcome`] per event).
//! - [`RetryPolicy`] computes exponential backoff with full jitter and decides when an event is
//!   dead.
//!
//! Everything that does I/O lives in other crates: `outbox-postgresql` and `outbox-sqlite` implement
//! [`Store`], `outbox-engine` runs the claim → publish → ack loop, `outbox-sink-*` implement
//! [`Sink`]. Keeping this crate free of I/O lets every one of them agree on the words without
//! agreeing on a driver.
//!
//! ```
//! use outbox_types::NewEvent;
//!
//! #[derive(serde::Serialize)]
//! struct OrderCreated { order_id: u64, amount_cents: u64 }
//!
//! let event = NewEvent::new("order", "42", "OrderCreated", &OrderCreated { order_id: 42, amount_cents: 1999 })
//!     .unwrap()
//!     .with_destination("orders")
//!     .with_header("tenant", "acme")
//!     .with_idempotency_key("order-42-created");
//! assert_eq!(event.payload(), r#"{"order_id":42,"amount_cents":1999}"#);
//! ```

pub mod batch;
pub mod cloudevents;
mod error;
mod event;
pub mod migration;
pub mod redact;
mod retry;
pub mod route;
pub mod routing;
mod sink;
pub mod sink_config;
mod source;
pub mod sql_admin;
pub mod sql_reading;
pub mod sql_script;
pub mod sql_store;
mod store;
pub mod store_impl;
pub mod table_outbox;

pub use error::{EncodeError, StoreError};
pub use event::{
    AggregateKey, Event, EventId, EventRecord, EventState, Headers, MAX_LAST_ERROR_LEN, NewEvent,
    ParseStateError, RESERVED_HEADER_PREFIX, check_first_delivery_order, headers_for_display,
    is_relay_header, is_reserved_header, is_valid_traceparent, truncate_error,
};
pub use retry::{DeadLetterPolicy, RetryPolicy, humantime_duration};
pub use sink::{Outcome, Sink, SinkError};
pub use source::Source;
pub use store::{
    BuryEvent, Claim, ClaimRequest, ClaimSort, DeadFilter, DestinationStats, Hold, Lease,
    LeaseHolder, OutboxStats, PausedDestination, Reading, ReplayFilter, ReplayStep, RetryEvent,
    RowBytes, SortedClaim, Store, bury_malformed, bury_oversized, bury_oversized_metadata,
    check_payload, held_behind_buried,
};
