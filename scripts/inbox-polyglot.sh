#!/usr/bin/env bash
# The inbox from other languages, proven against the real services (issue 24): Python
# (psycopg + pika, psycopg + confluent-kafka) and Node (pg + amqplib) consumers of the `outbox`
# relay's RabbitMQ and Kafka output, with duplicates injected (consumers killed between commit
# and ack, failures after the effect was written, every event replayed, racing claims); exits 1
# unless every effect was applied exactly once; then the Order system's billing service written in
# Python (crates/outbox-orders/python, nats-py + psycopg) over NATS JetStream, the same way. What it
# checks: examples/inbox-polyglot/prove.py.
#
#   1. installs, idempotently (checks first), a Python venv under .cache/inbox-py and Node
#      modules under .cache/inbox-node (scripts/inbox-deps.sh, pinned versions);
#   2. makes sure the Kafka test broker runs (scripts/kafka.sh) and PostgreSQL, RabbitMQ and
#      NATS listen (scripts/services.sh starts them; this script does not);
#   3. builds the `outbox` binary unless OUTBOX_BIN names one;
#   4. runs prove.py (extra arguments are passed on, e.g. --break-claim to watch it fail).
#
# Environment: OUTBOX_BIN, OUTBOX_TEST_DATABASE_URL (postgresql://postgres@127.0.0.1:5432/test),
# OUTBOX_TEST_AMQP_URL, OUTBOX_TEST_KAFKA_BROKERS, OUTBOX_TEST_NATS_URL, CARGO_TARGET_DIR (honoured, as cargo does).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="$ROOT/.cache"
PYENV="$CACHE/inbox-py"
NODEDIR="$CACHE/inbox-node"

fail() {
    echo "scripts/inbox-polyglot.sh: $*" >&2
    exit 1
}

# --- 1. Python and Node dependencies ---------------------------------------------------------
"$ROOT/scripts/inbox-deps.sh"

# --- 2. services ---------------------------------------------------------------------------------
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
listening 5432 || fail "PostgreSQL does not listen on 127.0.0.1:5432 (scripts/services.sh starts it)"
listening 5672 || fail "RabbitMQ does not listen on 127.0.0.1:5672 (scripts/services.sh starts it)"
listening 4222 || fail "NATS does not listen on 127.0.0.1:4222 (scripts/services.sh starts it)"
"$ROOT/scripts/kafka.sh" >/dev/null

# --- 3. the relay binary -----------------------------------------------------------------------
BIN="${OUTBOX_BIN:-}"
if [ -z "$BIN" ]; then
    (cd "$ROOT" && cargo build -q -p outbox-cli --bin outbox) || fail "cargo build -p outbox-cli failed"
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/outbox"
fi
[ -x "$BIN" ] || fail "no outbox binary at $BIN"

# --- 4. the proof --------------------------------------------------------------------------------
export NODE_PATH="$NODEDIR/node_modules"
exec "$PYENV/bin/python" "$ROOT/examples/inbox-polyglot/prove.py" --outbox "$BIN" \
    --dsn "${OUTBOX_TEST_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/test}" \
    --amqp-url "${OUTBOX_TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}" \
    --kafka-brokers "${OUTBOX_TEST_KAFKA_BROKERS:-127.0.0.1:19092}" \
    --nats-url "${OUTBOX_TEST_NATS_URL:-nats://127.0.0.1:4222}" "$@"
