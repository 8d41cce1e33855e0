#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster with logical replication enabled, for WAL mode (outbox-wal)
# tests and benchmarks. The machine's shared PostgreSQL on :5432 runs with wal_level=replica and
# is never touched here.
#
#   scripts/pg-logical.sh start   # idempotent: reuses a running cluster, starts (and creates) it otherwise
#   scripts/pg-logical.sh stop    # stops it if it runs
#   scripts/pg-logical.sh url     # prints the connection URL (database `outbox`)
#   scripts/pg-logical.sh status  # exit 0 when it is up
#
# Settings: wal_level=logical, max_replication_slots=10, max_wal_senders=10, trust auth for user
# `postgres`, databases `postgres` and `outbox`. Data in $PG_LOGICAL_DIR (default
# <repo>/.cache/pg-logical, ignored by git), port $PG_LOGICAL_PORT (default 54329), listening on
# 127.0.0.1 and a unix socket in the data directory. initdb refuses to run as root, so the server
# runs as the `postgres` OS user when the script is run by root.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${PG_LOGICAL_DIR:-$REPO/.cache/pg-logical}"
PORT="${PG_LOGICAL_PORT:-54329}"
PGBIN="${PG_LOGICAL_BIN:-/usr/lib/postgresql/15/bin}"
URL="postgres://postgres@127.0.0.1:${PORT}/outbox"

as_pg() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

sql() { "$PGBIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d "${2:-postgres}" -qAtX -c "$1"; }

up() { "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$PORT" -U postgres >/dev/null 2>&1; }

check_ours() {
  local level
  level="$(sql 'SHOW wal_level' 2>/dev/null || true)"
  if [ "$level" != logical ]; then
    echo "pg-logical: a server on 127.0.0.1:$PORT answers but has wal_level=${level:-unknown};" \
      "stop it or choose another port with PG_LOGICAL_PORT" >&2
    return 1
  fi
}

ensure_outbox_db() {
  if [ "$(sql "SELECT 1 FROM pg_database WHERE datname = 'outbox'")" != 1 ]; then
    sql 'CREATE DATABASE outbox' 2>/dev/null || [ "$(sql "SELECT 1 FROM pg_database WHERE datname = 'outbox'")" = 1 ]
  fi
}

start() {
  mkdir -p "$(dirname "$DIR")"
  # Several test processes may call `start` at once: one does the work, the others wait for it.
  exec 9>"$(dirname "$DIR")/.pg-logical-$PORT.lock"
  flock 9
  if up; then
    check_ours
    ensure_outbox_db
    echo "pg-logical: up on 127.0.0.1:$PORT ($DIR)"
    return 0
  fi
  if [ ! -x "$PGBIN/initdb" ]; then
    echo "pg-logical: $PGBIN/initdb not found; install postgresql-15 (apt-get install postgresql-15)" >&2
    return 1
  fi
  if [ ! -s "$DIR/PG_VERSION" ]; then
    rm -rf "$DIR"
    mkdir -p "$DIR"
    [ "$(id -u)" = 0 ] && chown postgres:postgres "$DIR"
    chmod 700 "$DIR"
    as_pg "$PGBIN/initdb" -D "$DIR" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$DIR.initdb.log" 2>&1 \
      || { cat "$DIR.initdb.log" >&2; return 1; }
    cat >>"$DIR/postgresql.conf" <<EOF
# outbox WAL-mode test cluster (scripts/pg-logical.sh)
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$DIR'
wal_level = logical
max_replication_slots = 10
max_wal_senders = 10
max_connections = 200
EOF
    # Replication connections from loopback with trust, like ordinary ones.
    echo "host replication all 127.0.0.1/32 trust" >>"$DIR/pg_hba.conf"
  fi
  # A server killed hard leaves its pid file behind; pg_ctl copes, but a stale one from another
  # boot (pid reused) would make it refuse.
  if [ -f "$DIR/postmaster.pid" ] && ! up; then
    local pid
    pid="$(head -1 "$DIR/postmaster.pid")"
    if ! kill -0 "$pid" 2>/dev/null; then rm -f "$DIR/postmaster.pid"; fi
  fi
  # 9>&-: the server must not inherit the lock, or it would hold it for its whole life.
  as_pg "$PGBIN/pg_ctl" -D "$DIR" -l "$DIR/server.log" -w -t 60 start >/dev/null 9>&- \
    || { tail -20 "$DIR/server.log" >&2; return 1; }
  check_ours
  ensure_outbox_db
  echo "pg-logical: started on 127.0.0.1:$PORT ($DIR)"
}

stop() {
  if [ -s "$DIR/PG_VERSION" ] && as_pg "$PGBIN/pg_ctl" -D "$DIR" status >/dev/null 2>&1; then
    as_pg "$PGBIN/pg_ctl" -D "$DIR" -m fast -w stop >/dev/null
    echo "pg-logical: stopped"
  else
    echo "pg-logical: not running"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  url) echo "$URL" ;;
  status) up && check_ours ;;
  *)
    echo "usage: $0 start|stop|url|status" >&2
    exit 2
    ;;
esac
