//! # outbox-orders
//!
//! The seeds' worked example, built on this toolkit: an **order service** that writes each
//! state change and its event in one transaction, and **delivery** and **billing** services
//! that consume those events exactly once through an inbox — plus the `outbox demo` that runs
//! all of it in one process.
//!
//! ```text
//!  HTTP ──▶ order-service ──(orders row + outbox row, one commit)──▶ orders DB
//!                                                                     │
//!                                        outbox relay (claim → publish → ack)
//!                                                                     │
//!                                NATS JetStream / Kafka / in-process bus (at least once)
//!                                           │                          │
//!             delivery-service (inbox + slot, one commit)   billing-service (inbox + charge)
//! ```
//!
//! - [`order`]: requests, validation, the orders table, `OrderCreated` / `OrderCancelled`, and
//!   [`order::OrderStore`], which writes an order and its event with `PgOutbox::enqueue` /
//!   `SqliteOutbox::enqueue` inside the same transaction (PostgreSQL or SQLite, picked by URL).
//! - [`http`]: the axum API with a typed error ([`http::ApiError`]) that maps to status codes.
//! - [`consumers`]: delivery and billing as one [`outbox_inbox::InboxHandler`] each, written
//!   once, driven by any transport.
//! - [`transport`]: NATS JetStream (feature `nats`) and Kafka (feature `kafka`) plumbing.
//! - [`bus`]: the demo's in-process broker (the relay's sink on one end, redeliveries included).
//! - [`load`]: an HTTP load generator; [`check`]: the exactly-once check of the three
//!   databases; [`demo`]: `outbox demo`.
//! - [`service`]: what the `order-service`, `delivery-service` and `billing-service` binaries
//!   run.
//!
//! See `crates/outbox-orders/README.md` for running it on PostgreSQL and NATS with the `outbox`
//! daemon as a separate process.

pub mod bus;
pub mod check;
pub mod consumers;
pub mod db;
pub mod demo;
mod error;
pub mod http;
pub mod load;
pub mod order;
pub mod service;
pub mod transport;

pub use db::Db;
pub use error::Error;
