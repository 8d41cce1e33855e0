//! The shared store contract, against a real PostgreSQL.

mod common;

outbox_store_tests::conformance!(common::PgHarness);
