#!/usr/bin/env bash
# The shipped `outbox relay` binary, timed as users run it, once per runtime given
# (`--worker-threads` values; `default` = tokio's one worker per core). Prints, per run, the
# process's CPU per delivered event (user + system: for a drain the whole run's, from
# /usr/bin/time; for steady writers from their start to the last event written), its
# peak RSS, and events/s. The sink is a file sink (JSON lines; its writes go through tokio's
# blocking pool, one hand-off per batch), or with OUTBOX_BENCH_SINK=redis a Redis stream on
# 127.0.0.1:6379 (XADD over one connection, no hand-off).
#
#   scripts/bench-relay-runtime.sh drain  [poll|wal] EVENTS   RUNTIMES...
#   scripts/bench-relay-runtime.sh steady poll|wal RATE SECS RUNTIMES...
#
#   drain:  a backlog of EVENTS rows drained by `outbox relay --drain` (polling mode), or, in WAL
#           mode, by a relay whose slot (`outbox wal prepare`) is older than the backlog: a relay
#           restarted after an outage or a deploy. The WAL relay runs until the sink holds every
#           event; its CPU and wall time are counted from its start to then.
#   steady: pgbench writers (8 connections, one INSERT per transaction, paced at RATE/s for SECS)
#           beside a running relay, in polling mode (127.0.0.1:5432) or WAL mode (the logical
#           cluster of scripts/pg-logical.sh); the relay is stopped once it wrote every event.
#
#   scripts/bench-relay-runtime.sh drain 100000 1 default
#   scripts/bench-relay-runtime.sh drain wal 100000 1
#   scripts/bench-relay-runtime.sh steady wal 2000 20 1 default 1 default
#
# Needs a release build (`cargo build --release -p outbox-cli`; OUTBOX_BIN overrides the binary),
# pgbench and PostgreSQL on 127.0.0.1:5432 (trust auth, database `test`). Each run gets a schema
# of its own (and in WAL mode a slot and publication of its own), dropped afterwards. Workload:
# ~400-byte JSON payloads over 1,000 aggregates, the relay's default settings.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n 10,11p "$0" >&2
  exit 2
}
scenario="${1:-}"
case "$scenario" in
  drain) mode=poll
    case "${2:-}" in poll | wal) mode="$2"; shift ;; esac
    [ $# -ge 3 ] || usage; events="$2"; shift 2 ;;
  steady) [ $# -ge 5 ] || usage; mode="$2"; rate="$3"; seconds="$4"; shift 4
    case "$mode" in poll | wal) ;; *) usage ;; esac ;;
  *) usage ;;
esac
runtimes=("$@")

sink="${OUTBOX_BENCH_SINK:-file}"
bin="${OUTBOX_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/outbox-target}/release/outbox}"
[ -x "$bin" ] || { echo "no release binary at $bin: run cargo build --release -p outbox-cli" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "needs /usr/bin/time (Debian package time)" >&2; exit 2; }
db="postgres://postgres@127.0.0.1:5432/test"
if [ "$mode" = wal ]; then
  scripts/pg-logical.sh status >/dev/null 2>&1 || scripts/pg-logical.sh start >/dev/null
  db="$(scripts/pg-logical.sh url)"
fi
export PGOPTIONS="-c client_min_messages=warning"
work="$(mktemp -d)"
relay_pid=""
cleanup() {
  [ -z "$relay_pid" ] || pkill -TERM -P "$relay_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# Events the sink holds: lines of the file, or entries of the Redis stream.
written() {
  if [ "$sink" = redis ]; then redis-cli -h 127.0.0.1 XLEN "$name"; else wc -l <"$work/events.jsonl"; fi
}

# utime + stime of a process, in clock ticks.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

insert_row="INSERT INTO %s.events (aggregate_type, aggregate_id, event_type, payload)"

for runtime in "${runtimes[@]}"; do
  name="outbox_bench_rt_$$_${RANDOM}"
  : >"$work/events.jsonl"
  {
    if [ "$mode" = wal ]; then
      printf 'mode = "wal"\n\n[wal]\nslot = "%s"\npublication = "%s"\n\n' "$name" "$name"
    fi
    printf '[database]\nurl = "%s"\nschema = "%s"\n\n' "$db" "$name"
    if [ "$sink" = redis ]; then
      printf '[destinations.sink]\ntype = "redis"\nurl = "redis://127.0.0.1:6379/0"\nstream = "%s"\n' "$name"
    else
      printf '[destinations.sink]\ntype = "file"\npath = "%s"\n' "$work/events.jsonl"
    fi
  } >"$work/outbox.toml"
  "$bin" migrate --config "$work/outbox.toml" >/dev/null 2>"$work/log" || { cat "$work/log" >&2; exit 1; }
  flags=()
  [ "$runtime" = default ] || flags=(--worker-threads "$runtime")

  if [ "$scenario" = drain ]; then
    # In WAL mode the slot exists before the backlog is written, as for a relay that was down.
    [ "$mode" != wal ] || "$bin" wal prepare --config "$work/outbox.toml" >/dev/null 2>"$work/log" \
      || { cat "$work/log" >&2; exit 1; }
    # shellcheck disable=SC2059
    psql "$db" -qAt -v ON_ERROR_STOP=1 -c "$(printf "$insert_row" "\"$name\"")
      SELECT 'agg', 'a' || (n % 1000), 'BenchEvent',
             json_build_object('n', n, 'pad', repeat('x', 370))::jsonb
      FROM generate_series(1, $events) AS n" >/dev/null
    psql "$db" -qAt -c "VACUUM ANALYZE \"$name\".events" >/dev/null
  fi
  if [ "$scenario" = drain ] && [ "$mode" = wal ]; then
    start="$(date +%s.%N)"
    /usr/bin/time -f '%e %U %S %M' -o "$work/time" \
      "$bin" "${flags[@]}" relay --config "$work/outbox.toml" >/dev/null 2>"$work/log" &
    relay_pid=$!
    for _ in $(seq 1 6000); do
      [ "$(written)" -lt "$events" ] || break
      sleep 0.05
    done
    end="$(date +%s.%N)"
    outbox_pid="$(pgrep -P "$relay_pid")"
    cpu="$(cpu_ticks "$outbox_pid")"
    pkill -TERM -P "$relay_pid"
    wait "$relay_pid" || { cat "$work/log" >&2; exit 1; }
    relay_pid=""
    read -r _ _ _ rss_kb <"$work/time"
    wall="$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')"
    user="$(awk -v c="$cpu" -v hz="$(getconf CLK_TCK)" 'BEGIN { print c / hz }')"
    sys=0
    label="drain wal, $events events in ${wall} s"
    rate_out="$(awk -v n="$events" -v w="$wall" 'BEGIN { printf "%.0f", n / w }')"
  elif [ "$scenario" = drain ]; then
    /usr/bin/time -f '%e %U %S %M' -o "$work/time" \
      "$bin" "${flags[@]}" relay --config "$work/outbox.toml" --drain >/dev/null 2>"$work/log" \
      || { cat "$work/log" >&2; exit 1; }
    read -r wall user sys rss_kb <"$work/time"
    label="drain, $events events in ${wall} s"
    rate_out="$(awk -v n="$events" -v w="$wall" 'BEGIN { printf "%.0f", n / w }')"
  else
    /usr/bin/time -f '%e %U %S %M' -o "$work/time" \
      "$bin" "${flags[@]}" relay --config "$work/outbox.toml" >/dev/null 2>"$work/log" &
    relay_pid=$!
    sleep 3 # the relay connects (in WAL mode creates its slot) before the writers start
    outbox_pid="$(pgrep -P "$relay_pid")"
    cpu_before="$(cpu_ticks "$outbox_pid")"
    {
      printf '\\set agg random(1, 1000)\n\\set n random(1, 1000000000)\n'
      # shellcheck disable=SC2059
      printf "$insert_row VALUES ('agg', 'a' || :agg, 'BenchEvent',\n  json_build_object('n', :n, 'pad', repeat('x', 370))::jsonb);\n" "\"$name\""
    } >"$work/writer.sql"
    pgbench -n -c 8 -j 2 -R "$rate" -T "$seconds" -f "$work/writer.sql" "$db" >"$work/pgbench" 2>&1 \
      || { cat "$work/pgbench" >&2; exit 1; }
    events="$(psql "$db" -qAt -c "SELECT count(*) FROM \"$name\".events")"
    for _ in $(seq 1 600); do
      [ "$(written)" -lt "$events" ] || break
      sleep 0.1
    done
    cpu_after="$(cpu_ticks "$outbox_pid")"
    pkill -TERM -P "$relay_pid" # the relay, not /usr/bin/time (which SIGTERM would kill)
    wait "$relay_pid" || { cat "$work/log" >&2; exit 1; }
    relay_pid=""
    read -r wall user sys rss_kb <"$work/time"
    tps="$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$work/pgbench")"
    # From the writers' start to the last event written: start-up and shutdown left out.
    user="$(awk -v a="$cpu_before" -v b="$cpu_after" -v hz="$(getconf CLK_TCK)" 'BEGIN { print (b - a) / hz }')"
    sys=0
    label="steady $mode, $rate/s offered for $seconds s, writers reached ${tps%.*}/s"
    rate_out="${tps%.*}"
  fi
  written="$(written)"
  [ "$sink" != redis ] || redis-cli -h 127.0.0.1 DEL "$name" >/dev/null
  if [ "$mode" = wal ]; then
    psql "$db" -qAt -c "SELECT pg_drop_replication_slot('$name')" >/dev/null || true
    psql "$db" -qAt -c "DROP PUBLICATION IF EXISTS \"$name\"" >/dev/null
  fi
  psql "$db" -qAt -c "DROP SCHEMA \"$name\" CASCADE" >/dev/null
  awk -v r="$runtime" -v what="$label" -v n="$events" -v got="$written" -v per="$rate_out" \
    -v u="$user" -v s="$sys" -v m="$rss_kb" 'BEGIN {
    printf "relay, worker threads %-7s %s: %d of %d events written, %s events/s, CPU %.1f us/event (%.2f s), peak RSS %.1f MB\n",
      r, what, got, n, per, (u + s) / n * 1e6, u + s, m / 1024 }'
done
