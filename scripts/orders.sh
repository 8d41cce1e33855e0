#!/usr/bin/env bash
# Run the Order system (crates/outbox-orders) on PostgreSQL + NATS JetStream, with the `outbox` relay
# as a process of its own — the way a service in any language would use it.
#
#   scripts/orders.sh [start]   start everything; idempotent (what already runs is left alone)
#   scripts/orders.sh stop      stop what this script started (SIGTERM, then wait)
#   scripts/orders.sh status    what runs, and what each database holds
#
# `start`:
#   1. scripts/services.sh makes sure PostgreSQL and NATS (and the test suite's other services)
#      are up (skip with ORDERS_SKIP_SERVICES=1);
#   2. creates the databases `orders`, `delivery` and `billing` on the local PostgreSQL if missing
#      (one per service: nothing is shared but the broker);
#   3. builds the four binaries: outbox, order-service, delivery-service, billing-service;
#   4. starts order-service on $ORDERS_LISTEN (it migrates its `orders` table and the outbox
#      table `outbox.events`) and waits for /healthz;
#   5. starts `outbox relay --config crates/outbox-orders/outbox.toml` (NATS destination; creates the
#      JetStream stream ORDERS over orders.>) and waits for its /readyz;
#   6. starts delivery-service and billing-service, each a durable JetStream consumer of ORDERS
#      writing to its own database, and waits until both consume;
#   7. starts billing-py, the billing service written in Python (crates/outbox-orders/python: nats-py
#      and psycopg, no Rust; its inbox created by `outbox inbox migrate`) on database billing_py,
#      the same effects as billing-service by another language (skip with ORDERS_PYTHON=0; its
#      venv comes from scripts/inbox-deps.sh).
# Logs and pid files are in .cache/orders/ of the repository.
#
# Environment:
#   ORDERS_PG             PostgreSQL server URL without database (postgres://postgres@127.0.0.1:5432)
#   ORDERS_LISTEN         order-service address (127.0.0.1:8080)
#   ORDERS_METRICS        relay /metrics, /healthz, /readyz address (127.0.0.1:9464)
#   NATS_URL              NATS server (nats://127.0.0.1:4222)
#   ORDERS_PROFILE        cargo profile: debug (default, quicker to build) or release
#   ORDERS_SKIP_SERVICES  1 = do not run scripts/services.sh
#   ORDERS_PYTHON         0 = do not start billing-py
#   CARGO_TARGET_DIR      honoured, as cargo does
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUN="$ROOT/.cache/orders"
PG="${ORDERS_PG:-postgres://postgres@127.0.0.1:5432}"
LISTEN="${ORDERS_LISTEN:-127.0.0.1:8080}"
METRICS="${ORDERS_METRICS:-127.0.0.1:9464}"
NATS="${NATS_URL:-nats://127.0.0.1:4222}"
PROFILE="${ORDERS_PROFILE:-debug}"
CONFIG="$ROOT/crates/outbox-orders/outbox.toml"
# Start order; `stop` goes the other way round.
SERVICES=(order-service relay delivery-service billing-service billing-py)
PYTHON="${ORDERS_PYTHON:-1}"

mkdir -p "$RUN"

say() { echo "orders: $*"; }
fail() {
    echo "orders: $*" >&2
    exit 1
}

pid_of() { cat "$RUN/$1.pid" 2>/dev/null || true; }

running() {
    local pid
    pid=$(pid_of "$1")
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# wait_until SECONDS SERVICE DESCRIPTION COMMAND...: poll COMMAND every 0.2 s; fail with the
# service's log when it does not succeed in time or the service died.
wait_until() {
    local secs=$1 name=$2 what=$3
    shift 3
    local deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if ! running "$name"; then
            tail -n 30 "$RUN/$name.log" >&2 || true
            fail "$name exited before $what (log: $RUN/$name.log)"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            tail -n 30 "$RUN/$name.log" >&2 || true
            fail "$name: no $what within ${secs}s (log: $RUN/$name.log)"
        fi
        sleep 0.2
    done
}

listening() { (exec 3<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null; }

# launch NAME ADDRESS COMMAND...: start COMMAND in the background unless NAME already runs.
# ADDRESS (host:port) must be free, so the readiness checks cannot be answered by a stranger.
launch() {
    local name=$1 address=$2
    shift 2
    if running "$name"; then
        say "$name already running (pid $(pid_of "$name"))"
        return 0
    fi
    if [ -n "$address" ] && listening "$address"; then
        fail "something else already listens on $address (needed by $name); see the environment variables in $0"
    fi
    echo "--- $(date -u +%FT%TZ) $*" >>"$RUN/$name.log"
    nohup "$@" >>"$RUN/$name.log" 2>&1 </dev/null &
    echo $! >"$RUN/$name.pid"
    say "started $name (pid $!, log .cache/orders/$name.log)"
}

bin_dir() {
    local target="${CARGO_TARGET_DIR:-$ROOT/target}"
    case "$PROFILE" in
        debug) echo "$target/debug" ;;
        release) echo "$target/release" ;;
        *) fail "ORDERS_PROFILE must be debug or release, not $PROFILE" ;;
    esac
}

create_databases() {
    local db
    for db in orders delivery billing billing_py; do
        if [ "$(psql "$PG/postgres" -Atc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
            psql "$PG/postgres" -qc "CREATE DATABASE $db" >/dev/null
            say "created database $db"
        fi
    done
}

start() {
    if [ "${ORDERS_SKIP_SERVICES:-0}" != 1 ]; then
        "$ROOT/scripts/services.sh"
    fi
    command -v psql >/dev/null || fail "psql is needed to create the databases"
    create_databases

    local flags=()
    [ "$PROFILE" = release ] && flags+=(--release)
    say "building (cargo build ${flags[*]:-} -p outbox-cli -p outbox-orders)"
    (cd "$ROOT" && cargo build ${flags[@]+"${flags[@]}"} -q -p outbox-cli -p outbox-orders --bins) ||
        fail "the build failed"
    local bin
    bin=$(bin_dir)

    launch order-service "$LISTEN" "$bin/order-service" \
        --database-url "$PG/orders" --listen "$LISTEN" \
        --outbox-schema outbox --outbox-table events
    wait_until 60 order-service "answer on http://$LISTEN/healthz" curl -fsS "http://$LISTEN/healthz"

    launch relay "$METRICS" "$bin/outbox" relay --config "$CONFIG" --metrics-listen "$METRICS"
    wait_until 60 relay "ready on http://$METRICS/readyz" curl -fsS "http://$METRICS/readyz"

    local service
    for service in delivery billing; do
        launch "$service-service" "" "$bin/$service-service" \
            --database-url "$PG/$service" --transport nats --nats-url "$NATS" \
            --stream ORDERS --subjects 'orders.>'
    done
    for service in delivery billing; do
        wait_until 60 "$service-service" "JetStream consumer" \
            grep -q "Consuming from NATS JetStream" "$RUN/$service-service.log"
    done

    if [ "$PYTHON" != 0 ]; then
        "$ROOT/scripts/inbox-deps.sh"
        "$bin/outbox" inbox migrate --database-url "$PG/billing_py" --table inbox >/dev/null
        launch billing-py "" "$ROOT/.cache/inbox-py/bin/python" "$ROOT/crates/outbox-orders/python/billing_service.py" \
            --database-url "$PG/billing_py" --nats-url "$NATS" --stream ORDERS --subjects 'orders.>'
        wait_until 60 billing-py "JetStream consumer" \
            grep -q "Consuming from NATS JetStream" "$RUN/billing-py.log"
    fi

    cat <<EOF

The Order system is up:
  order-service     http://$LISTEN          (database orders: table orders, outbox.events)
  outbox relay      http://$METRICS/metrics (NATS stream ORDERS, subjects orders.<event type>)
  delivery-service  database delivery       (tables delivery_slots, inbox)
  billing-service   database billing        (tables billing_ledger, inbox)
  billing-py        database billing_py     (the same, in Python: crates/outbox-orders/python)

Try:
  curl -s -XPOST http://$LISTEN/orders -d '{"product": "desk lamp", "quantity": 2, "amount": 39.90}'
  curl -s -XPOST http://$LISTEN/orders/<id>/cancel
  scripts/orders.sh status
  scripts/orders.sh stop
EOF
}

stop() {
    local i name pid
    for ((i = ${#SERVICES[@]} - 1; i >= 0; i--)); do
        name=${SERVICES[$i]}
        if running "$name"; then
            pid=$(pid_of "$name")
            kill -TERM "$pid"
            local deadline=$((SECONDS + 30))
            while kill -0 "$pid" 2>/dev/null; do
                if [ "$SECONDS" -ge "$deadline" ]; then
                    say "$name (pid $pid) did not stop within 30s of SIGTERM; sending SIGKILL"
                    kill -KILL "$pid" 2>/dev/null || true
                fi
                sleep 0.2
            done
            say "stopped $name"
        fi
        rm -f "$RUN/$name.pid"
    done
}

status() {
    local name
    for name in "${SERVICES[@]}"; do
        if running "$name"; then
            say "$name running (pid $(pid_of "$name"))"
        else
            say "$name not running"
        fi
    done
    command -v psql >/dev/null || return 0
    echo
    psql "$PG/orders" -Atc "SELECT 'orders: ' || status || ' ' || count(*) FROM orders GROUP BY status ORDER BY status" 2>/dev/null || true
    psql "$PG/orders" -Atc "SELECT 'outbox: ' || status || ' ' || count(*) FROM outbox.events GROUP BY status ORDER BY status" 2>/dev/null || true
    psql "$PG/delivery" -Atc "SELECT 'delivery: ' || action || ' ' || count(*) FROM delivery_slots GROUP BY action ORDER BY action" 2>/dev/null || true
    psql "$PG/billing" -Atc "SELECT 'billing: ' || action || ' ' || count(*) || ' (' || (sum(value) / 100.0)::NUMERIC(14, 2) || ')' FROM billing_ledger GROUP BY action ORDER BY action" 2>/dev/null || true
    psql "$PG/billing_py" -Atc "SELECT 'billing-py: ' || action || ' ' || count(*) || ' (' || (sum(value) / 100.0)::NUMERIC(14, 2) || ')' FROM billing_ledger GROUP BY action ORDER BY action" 2>/dev/null || true
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) fail "usage: scripts/orders.sh [start|stop|status]" ;;
esac
