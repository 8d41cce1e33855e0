//! The shared store contract, against a real MySQL / MariaDB.

mod common;

outbox_store_tests::conformance!(common::MySqlHarness);
