#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster with logical replication enabled, for WAL mode (outbox-wal)
# tests and benchmarks. The machine's shared PostgreSQL on :5432 runs with wal_level=replica and
# is never touched here.
#
#   scripts/pg-logical.sh start   # idempotent: reuses a running cluster, starts (and creates) it otherwise
#   scripts/pg-logical.sh stop    # stops it if it runs
#   scripts/pg-logical.sh url     # prints the connection URL (database `outbox`)
#   scripts/pg-logical.sh status  # exit 0 when it is up
#   scripts/pg-logical.sh rootcert       # prints the path of the CA that signed the server's certificate
#   scripts/pg-logical.sh wrong-rootcert # prints the path of an unrelated CA (for failing verification)
#
# Settings: wal_level=logical, max_replication_slots=40, max_wal_senders=40, trust auth for user
# `postgres`, databases `postgres` and `outbox`. Data in $PG_LOGICAL_DIR (default
# <repo>/.cache/pg-logical, ignored by git), port $PG_LOGICAL_PORT (default 54329), listening on
# 127.0.0.1 and a unix socket in the data directory. initdb refuses to run as root, so the server
# runs as the `postgres` OS user when the script is run by root.
#
# TLS: `ssl = on` with a certificate for `localhost` and 127.0.0.1, signed by a throwaway CA that
# is generated with openssl the first time (`rootcert` prints where it is). Clients may connect
# with or without TLS (the pg_hba lines are `host`, not `hostssl`). A cluster created by an older
# version of this script, or already running without TLS, gets it on the next `start` (a reload,
# no restart).
#
# Database `outbox` has EXECUTE on pg_logical_emit_message revoked from PUBLIC, as WAL mode's
# message source requires (the superuser `postgres` keeps it); tests that need the open default
# create their own database.
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
  # Any role could otherwise inject events through WAL mode's message source (see the
  # outbox-wal crate docs, "Capture sources"). Every overload, whatever this server version has.
  local open
  open="$(sql "SELECT count(*) FROM pg_proc WHERE proname = 'pg_logical_emit_message'
                 AND pronamespace = 'pg_catalog'::regnamespace
                 AND has_function_privilege('public', oid, 'EXECUTE')" outbox)"
  if [ "$open" != 0 ]; then
    sql "DO \$\$ DECLARE f regprocedure; BEGIN
           FOR f IN SELECT oid::regprocedure FROM pg_proc
                    WHERE proname = 'pg_logical_emit_message' AND pronamespace = 'pg_catalog'::regnamespace
           LOOP EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f); END LOOP;
         END \$\$" outbox
  fi
}

# The server certificate (CN and SAN localhost, SAN IP 127.0.0.1) and its CA, in the data
# directory $1; an unrelated CA next to them for tests that must fail verification. Created only
# when one of them is missing.
ensure_certs() {
  local d="$1"
  if as_pg test -s "$d/server.crt" && as_pg test -s "$d/server.key" \
    && as_pg test -s "$d/outbox-test-ca.crt" && as_pg test -s "$d/outbox-test-wrong-ca.crt"; then
    return 0
  fi
  if ! command -v openssl >/dev/null; then
    echo "pg-logical: openssl not found; install it (apt-get install openssl) for the TLS test certificate" >&2
    return 1
  fi
  # shellcheck disable=SC2016
  as_pg bash -c '
    set -euo pipefail
    cd "$1"
    umask 077
    tmp="$(mktemp -d)"
    trap "rm -rf \"$tmp\"" EXIT
    ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    openssl req -x509 $ec -days 3650 -subj "/CN=outbox pg-logical test CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout "$tmp/ca.key" -out "$tmp/ca.crt" 2>/dev/null
    openssl req -x509 $ec -days 3650 -subj "/CN=outbox pg-logical unrelated CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout "$tmp/wrong.key" -out "$tmp/wrong.crt" 2>/dev/null
    openssl req $ec -subj "/CN=localhost" -keyout "$tmp/server.key" -out "$tmp/server.csr" 2>/dev/null
    printf "%s\n" "subjectAltName=DNS:localhost,IP:127.0.0.1" "basicConstraints=critical,CA:FALSE" \
      "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" >"$tmp/ext"
    openssl x509 -req -in "$tmp/server.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -set_serial "0x$(openssl rand -hex 8)" \
      -days 3650 -extfile "$tmp/ext" -out "$tmp/server.crt" 2>/dev/null
    install -m 600 "$tmp/server.key" server.key
    install -m 644 "$tmp/server.crt" server.crt
    install -m 644 "$tmp/ca.crt" outbox-test-ca.crt
    install -m 644 "$tmp/wrong.crt" outbox-test-wrong-ca.crt
  ' ensure-certs "$d"
}

# TLS on, on a cluster that runs: certificates in its data directory, `ssl = on`, reload.
ensure_ssl() {
  if [ "$(sql 'SHOW ssl')" = on ]; then
    return 0
  fi
  local data
  data="$(sql 'SHOW data_directory')"
  ensure_certs "$data"
  sql "ALTER SYSTEM SET ssl = on"
  sql "SELECT pg_reload_conf()" >/dev/null
  for _ in $(seq 50); do
    [ "$(sql 'SHOW ssl')" = on ] && return 0
    sleep 0.1
  done
  echo "pg-logical: could not turn TLS on (see $data/log or the server log)" >&2
  return 1
}

# Path of a CA file in the running cluster's data directory.
cert_path() {
  up || { echo "pg-logical: not running; run \`$0 start\` first" >&2; return 1; }
  local data
  data="$(sql 'SHOW data_directory')"
  as_pg test -s "$data/$1" || { echo "pg-logical: $data/$1 is missing; run \`$0 start\`" >&2; return 1; }
  echo "$data/$1"
}

# Enough slots and senders for the test suites running their tests in parallel (one slot per
# test). A cluster made by an older version of this script had 10: raised and restarted here.
ensure_limits() {
  local slots
  slots="$(sql 'SHOW max_replication_slots')"
  if [ "${slots:-0}" -lt 40 ]; then
    sql "ALTER SYSTEM SET max_replication_slots = 40" >/dev/null
    sql "ALTER SYSTEM SET max_wal_senders = 40" >/dev/null
    as_pg "$PGBIN/pg_ctl" -D "$DIR" -l "$DIR/server.log" -w -t 60 restart >/dev/null 9>&- \
      || { tail -20 "$DIR/server.log" >&2; return 1; }
  fi
}

start() {
  mkdir -p "$(dirname "$DIR")"
  # Several test processes may call `start` at once: one does the work, the others wait for it.
  exec 9>"$(dirname "$DIR")/.pg-logical-$PORT.lock"
  flock 9
  if up; then
    check_ours
    ensure_limits
    ensure_ssl
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
max_replication_slots = 40
max_wal_senders = 40
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
  ensure_limits
  ensure_ssl
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
  rootcert) cert_path outbox-test-ca.crt ;;
  wrong-rootcert) cert_path outbox-test-wrong-ca.crt ;;
  *)
    echo "usage: $0 start|stop|url|status|rootcert|wrong-rootcert" >&2
    exit 2
    ;;
esac
