#!/usr/bin/env bash
# Install, idempotently (check first, install only what is missing), what the writers and the
# inbox's consumers in other languages need: a Python venv under .cache/inbox-py (psycopg, pika,
# confluent-kafka, nats-py; and redis, cloudevents, standardwebhooks for the wire-format check)
# and Node modules under .cache/inbox-node (pg, amqplib), pinned. Used by scripts/test.sh
# (crates/outbox-cli/tests/writers.rs runs examples/writers with them, wire_format.rs runs
# crates/outbox-cli/tests/wire/check.py), scripts/inbox-polyglot.sh and scripts/orders.sh; prints
# nothing when everything is there.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="$ROOT/.cache"
PYENV="$CACHE/inbox-py"
NODEDIR="$CACHE/inbox-node"
LOG="$CACHE/inbox-deps-install.log"
PY_PACKAGES=("psycopg[binary]==3.3.9" "pika==1.4.4" "confluent-kafka==2.16.1" "nats-py==2.16.0"
    "redis==8.1.0" "cloudevents==2.2.0" "standardwebhooks==1.1.0")
NODE_PACKAGES=("pg@8.23.1" "amqplib@2.3.1")

fail() {
    echo "scripts/inbox-deps.sh: $*" >&2
    exit 1
}
mkdir -p "$CACHE"

if ! "$PYENV/bin/python" -c 'import psycopg, pika, confluent_kafka, nats, redis, cloudevents.core, standardwebhooks' >/dev/null 2>&1; then
    echo "inbox-deps: installing ${PY_PACKAGES[*]} into $PYENV (log: $LOG)"
    command -v python3 >/dev/null || fail "python3 is not installed (apt-get install python3 python3-venv)"
    [ -x "$PYENV/bin/python" ] || python3 -m venv "$PYENV" >>"$LOG" 2>&1 \
        || fail "python3 -m venv $PYENV failed (apt-get install python3-venv?); see $LOG"
    "$PYENV/bin/pip" install --disable-pip-version-check --no-input -q "${PY_PACKAGES[@]}" >>"$LOG" 2>&1 \
        || fail "pip install failed; see $LOG"
fi
if ! NODE_PATH="$NODEDIR/node_modules" node -e "require('pg'); require('amqplib')" >/dev/null 2>&1; then
    echo "inbox-deps: installing ${NODE_PACKAGES[*]} into $NODEDIR (log: $LOG)"
    command -v npm >/dev/null || fail "node and npm are not installed (Node 20 or later)"
    mkdir -p "$NODEDIR"
    npm install --prefix "$NODEDIR" --no-audit --no-fund --loglevel=error "${NODE_PACKAGES[@]}" >>"$LOG" 2>&1 \
        || fail "npm install failed; see $LOG"
fi
