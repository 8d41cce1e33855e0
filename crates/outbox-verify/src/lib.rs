//! # outbox-verify
//!
//! A Jepsen-style correctness harness for the outbox. It runs the real thing — concurrent
//! writers committing business transactions with events into PostgreSQL, one to three real
//! `outbox relay` processes, real destinations — injects faults on a seeded schedule (SIGKILL
//! and SIGSTOP of relays, cut and degraded links through a TCP proxy, broker restarts, killed
//! database connections, database restarts, poison events), then lets everything heal, drains
//! the outbox and checks what the consumers received against what the writers committed:
//!
//! - nothing committed is lost, nothing rolled back is sent;
//! - per-aggregate order holds among first deliveries;
//! - effects applied through the inbox happen exactly once;
//! - dead letters are exactly the poison events;
//! - a relay paused past its lease has its late writes fenced.
//!
//! Why a harness and not more unit tests: the promise is about the system under failures that
//! unit tests do not produce — a COMMIT whose answer is lost, a relay frozen between publish and
//! ack, a broker that vanishes mid-batch. Those only happen with real processes, real sockets
//! and real databases.
//!
//! The pieces, each usable on its own:
//!
//! - [`history`] and [`checker`]: the recorded facts and the pure function that judges them.
//! - [`writers`]: business transactions with rollbacks, self-inflicted crashes and ambiguous
//!   commits.
//! - [`relays`]: `outbox relay` child processes with kill / pause / resume / restart.
//! - [`dest`]: the destinations behind one trait ([`dest::Destination`]): the relay's config
//!   for it, the broker's lifecycle, and a consumer that applies effects through
//!   `outbox-inbox`.
//! - [`cluster`]: a throwaway PostgreSQL cluster the harness can restart.
//! - [`faults`]: the seeded schedule.
//! - [`harness`]: the run itself, with its profiles; [`report`]: the summary and JSON.
//!
//! See the crate's README for how to run it and what each profile does.

pub mod checker;
pub mod cluster;
pub mod dest;
pub mod error;
pub mod faults;
pub mod harness;
pub mod history;
pub mod relays;
pub mod report;
pub mod writers;

pub use error::Error;
