//! The shared store contract, against a real SQLite file (a new one per test).

mod common;

outbox_store_tests::conformance!(common::SqliteHarness);
