//! The shared store contract, against a real PostgreSQL, with the outbox in the partitioned
//! layout (events range-partitioned by `enqueued_at`, ids and keys in the keys table).

mod common;

outbox_store_tests::conformance!(common::PgPartitionedHarness);
