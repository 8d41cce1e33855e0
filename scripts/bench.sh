#!/usr/bin/env bash
# Every benchmark behind the README's "Performance" section, in the order it is written there.
# Appends JSON lines to the file given (default bench-results/<time>.jsonl) and prints the tables.
#
#   scripts/bench.sh                 # polling relay scenarios against the local PostgreSQL (~30 min)
#   BENCH_SINKS=1 scripts/bench.sh   # also drain into every broker (starts tansu for Kafka)
#   BENCH_HISTORY=10000,10000000 scripts/bench.sh   # delivered-history sizes of claim-latency
#
# Figures mean something only on a quiet machine: stop other work first.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/outbox-target}"
out="${1:-bench-results/$(date -u +%Y%m%dT%H%M%SZ).jsonl}"
mkdir -p "$(dirname "$out")"

scripts/services.sh
cargo build --release -p outbox-bench
bench="$CARGO_TARGET_DIR/release/outbox-bench"
run() { echo; echo "\$ outbox-bench $*"; "$bench" --json-out "$out" "$@"; }

# 1. What enqueueing costs a business transaction, and the library's overhead over raw SQL.
run write-overhead
# 1b. pgbench-style writer cost: business UPDATE + one event, for a hand-written insert into a
#     primary-key-only table, our enqueue (and without each index), and a logical message; then
#     the same with our WAL relay delivering beside the writers (on the logical cluster).
scripts/pg-logical.sh start
run --database-url "$(scripts/pg-logical.sh url)" writer-cost --relay both
# 2. Drain a backlog into the in-process sink: ours against the seeds' naive relay, then 1M.
run drain --events 100000 --relay both
run drain --events 1000000
if [[ "${BENCH_SINKS:-0}" == 1 ]]; then
  scripts/kafka.sh
  run drain --events 100000 --sink all
fi
# 3. Steady state with writers at 1k and 5k events/s and flat out; the baseline at 1k/s.
run steady --rates 1000,5000,max
run steady --rates 1000 --relay naive
# 4. Claim cost against the delivered history, and with a long-running transaction held open.
run claim-latency --delivered "${BENCH_HISTORY:-10000,1000000}"

echo
echo "JSON lines: $out"
