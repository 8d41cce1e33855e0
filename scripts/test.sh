#!/usr/bin/env bash
# The whole test suite, as CI runs it: services up, formatting, lints, then every test of the
# workspace against the real databases and brokers on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/outbox-target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

scripts/build-deps.sh
scripts/services.sh
# Python and Node clients for the tests of writers and consumers in other languages.
scripts/inbox-deps.sh

# Schemas left behind by earlier test runs (each test makes its own) are dropped first.
psql -h 127.0.0.1 -U postgres -d test -qAt -c "
  SELECT format('DROP SCHEMA IF EXISTS %I CASCADE;', nspname) FROM pg_namespace
  WHERE nspname LIKE 'outbox\_t\_%' OR nspname LIKE 'outbox\_kill\_%' OR nspname LIKE 'outbox\_bench\_%'" \
  | psql -h 127.0.0.1 -U postgres -d test -q >/dev/null

# Replication slots test runs left behind (a killed run cannot drop its own) keep WAL and use up
# the logical cluster's slots: dropped when inactive.
if scripts/pg-logical.sh status >/dev/null 2>&1; then
  psql "$(scripts/pg-logical.sh url)" -qAt -c "
    SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
    WHERE NOT active AND slot_name LIKE 'owt\_%'" >/dev/null || true
fi

cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --no-fail-fast
# Issue 41's records at their real size in WAL mode (300 MB logical messages and a 300 MB outbox
# row; about two minutes, 900 MB of WAL): ignored in the run above. Prints the relay's peak RSS.
cargo test -p outbox-cli --test hostile wal_records_of_the_issues_size -- --ignored --nocapture
# Feature-gated code the default build does not compile: the OpenTelemetry trace-context helper.
cargo test -p outbox --features opentelemetry --test trace
# Install paths: the slim `postgres,webhook` build installed with cargo install (links no
# OpenSSL, zlib or librdkafka; delivers), the default build's links, and `cargo package`.
scripts/install-check.sh
# The inbox from Python and Node consumers (psycopg, pika, confluent-kafka; pg, amqplib) of the
# relay's RabbitMQ and Kafka output, duplicates injected; fails when an effect is applied twice.
scripts/inbox-polyglot.sh
# docs/from-debezium.md followed word for word on fresh databases with a running writer, for both
# cut-overs (side by side, --reuse-slot): every row arrives once, in order per key.
scripts/debezium-guide.sh
# The correctness harness (crates/outbox-verify/README.md), in both relay modes: the same engine
# over table claims and over the replication stream.
cargo run -q -p outbox-verify -- --profile short
cargo run -q -p outbox-verify -- --profile short --mode wal
