#!/usr/bin/env bash
# Follow docs/from-debezium.md word for word, as a new user would, and check that nothing is lost
# or sent twice: for each cut-over of the guide (side by side, and --reuse-slot), a fresh
# database on the logical-replication cluster (scripts/pg-logical.sh) gets Debezium's documented
# outbox table and a writer that keeps inserting rows (three keys, a sequence number each) while
# the guide's commands run. The commands are read out of the guide's `sh` blocks marked
# `<!-- debezium-guide: … -->` and run as they are, in a directory holding the Debezium Server
# `application.properties` they name (PostgreSQL connector, Outbox Event Router, HTTP sink
# pointed at a receiver of this script); `outbox relay` runs in the background until every row
# arrived. Then, per key, the received rows must be consecutive, each once, in order, up to the
# last one written; with --reuse-slot from the first one (the "connector's" slot existed before
# the writer started), side by side from a row no later than the one after those written when
# `outbox wal prepare` returned (what came before is the connector's to deliver).
#
# Needs: the logical cluster (started if not), python3, psql; builds `outbox` with cargo.
# Exit status 0 when both cut-overs pass; every failure says which and why.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
GUIDE="$ROOT/docs/from-debezium.md"
WRITE_SECONDS="${DEBEZIUM_GUIDE_WRITE_SECONDS:-6}"

fail() {
    echo "scripts/debezium-guide.sh: $*" >&2
    exit 1
}

scripts/pg-logical.sh status >/dev/null 2>&1 || scripts/pg-logical.sh start >/dev/null
BASE_URL=$(scripts/pg-logical.sh url)
HOSTPORT=${BASE_URL#*@}
HOSTPORT=${HOSTPORT%%/*}
PGHOST=${HOSTPORT%%:*}
PGPORT=${HOSTPORT##*:}
ADMIN_URL="postgres://postgres@$PGHOST:$PGPORT/postgres"

cargo build -q -p outbox-cli
export PATH="${CARGO_TARGET_DIR:-$ROOT/target}/debug:$PATH"
command -v outbox >/dev/null || fail "the outbox binary was not built"

WORK=$(mktemp -d)
PIDS=()
DATABASES=()
cleanup() {
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    # The relay's slot (and with --reuse-slot the connector's) lives in the database: gone first.
    for db in "${DATABASES[@]}"; do
        psql "$ADMIN_URL" -qAt -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '$db'" >/dev/null 2>&1 || true
        psql "$ADMIN_URL" -qAt -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

# The lines of the guide's sh block marked `<!-- debezium-guide: $1 … -->`.
guide_block() {
    awk -v mark="<!-- debezium-guide: $1 " '
        index($0, mark) == 1 { found = 1; next }
        found && /^```sh/ { inside = 1; next }
        inside && /^```/ { exit }
        inside { print }
    ' "$GUIDE"
}

# An HTTP receiver that answers 200 and appends `{"id": <id header>, "body": <body>}` lines.
receiver() {
    python3 - "$1" "$2" <<'PY' &
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
out, port_file = sys.argv[1], sys.argv[2]
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0))).decode()
        with open(out, "a") as f:
            f.write(json.dumps({"id": self.headers.get("id"), "body": body}) + "\n")
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = ThreadingHTTPServer(("127.0.0.1", 0), H)
open(port_file, "w").write(str(server.server_address[1]))
server.serve_forever()
PY
    PIDS+=($!)
}

# Insert rows into `$1`'s outbox until killed: keys k1..k3, seq 1, 2, … each.
writer() {
    local url=$1
    (
        i=0
        while true; do
            i=$((i + 1))
            psql "$url" -qAt -v ON_ERROR_STOP=1 -c "
                INSERT INTO public.outbox VALUES
                  (gen_random_uuid(), 'Order', 'k1', 'Tick', '{\"key\": \"k1\", \"seq\": $i}'),
                  (gen_random_uuid(), 'Order', 'k2', 'Tick', '{\"key\": \"k2\", \"seq\": $i}');
                INSERT INTO public.outbox VALUES
                  (gen_random_uuid(), 'Order', 'k3', 'Tick', '{\"key\": \"k3\", \"seq\": $i}')" \
                >/dev/null
            sleep 0.05
        done
    ) &
    WRITER=$!
    PIDS+=("$WRITER")
}

# `{key: highest seq}` written so far in `$1`, as JSON.
written() {
    psql "$1" -qAt -c "SELECT coalesce(json_object_agg(k, s), '{}') FROM (
        SELECT aggregateid AS k, max((payload->>'seq')::int) AS s FROM public.outbox GROUP BY 1) m"
}

run_cutover() {
    local mode=$1 db="dbzguide_${1//-/_}_$$"
    local slot="dbzg_${1//-/_}_$$"
    local url="postgres://postgres@$PGHOST:$PGPORT/$db"
    local dir="$WORK/$mode"
    mkdir -p "$dir"
    echo "debezium-guide: $mode: fresh database $db"
    psql "$ADMIN_URL" -qAt -c "CREATE DATABASE $db" >/dev/null
    DATABASES+=("$db")
    psql "$url" -qAt -v ON_ERROR_STOP=1 -c "
        CREATE TABLE public.outbox (
            id            UUID         NOT NULL PRIMARY KEY,
            aggregatetype VARCHAR(255) NOT NULL,
            aggregateid   VARCHAR(255) NOT NULL,
            type          VARCHAR(255) NOT NULL,
            payload       JSONB)" >/dev/null
    if [ "$mode" = reuse-slot ]; then
        # What the connector left: its pgoutput slot and publication, rows kept since.
        psql "$url" -qAt -v ON_ERROR_STOP=1 -c "CREATE PUBLICATION dbz_publication FOR TABLE public.outbox" >/dev/null
        psql "$url" -qAt -v ON_ERROR_STOP=1 -c "SELECT pg_create_logical_replication_slot('$slot', 'pgoutput')" >/dev/null
    fi
    receiver "$dir/received.jsonl" "$dir/port"
    for _ in $(seq 50); do [ -s "$dir/port" ] && break; sleep 0.1; done
    [ -s "$dir/port" ] || fail "$mode: the HTTP receiver did not start"
    cat >"$dir/application.properties" <<EOF
debezium.source.connector.class=io.debezium.connector.postgresql.PostgresConnector
debezium.source.offset.storage.file.filename=data/offsets.dat
debezium.source.database.hostname=$PGHOST
debezium.source.database.port=$PGPORT
debezium.source.database.user=postgres
debezium.source.database.dbname=$db
debezium.source.topic.prefix=dbserver1
debezium.source.plugin.name=pgoutput
debezium.source.slot.name=$slot
debezium.source.table.include.list=public.outbox
debezium.transforms=outbox
debezium.transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
debezium.sink.type=http
debezium.sink.http.url=http://127.0.0.1:$(cat "$dir/port")/events
debezium.format.value=json
debezium.format.header=json
EOF
    writer "$url"
    sleep 1
    local marks='{}' relay=''
    while IFS= read -r line; do
        case "$line" in
            ''|'#'*) continue ;;
        esac
        echo "debezium-guide: $mode: \$ $line"
        if [[ "$line" == "outbox relay "* ]]; then
            (cd "$dir" && exec bash -c "$line" >"$dir/relay.log" 2>&1) &
            relay=$!
            PIDS+=("$relay")
        else
            (cd "$dir" && bash -c "$line") >"$dir/step.log" 2>&1 \
                || { cat "$dir/step.log" >&2; fail "$mode: \`$line\` failed"; }
            if [[ "$line" == "outbox wal prepare "* ]]; then
                marks=$(written "$url")
            fi
        fi
    done < <(guide_block "$mode")
    [ -n "$relay" ] || fail "$mode: the guide's block has no \`outbox relay\`"
    sleep "$WRITE_SECONDS"
    kill "$WRITER"
    wait "$WRITER" 2>/dev/null || true
    local last
    last=$(written "$url")
    echo "debezium-guide: $mode: writer stopped at $last; waiting for every row"
    python3 - "$dir/received.jsonl" "$last" "$marks" "$mode" <<'PY' || { tail -n 40 "$dir/relay.log" >&2; fail "$mode: rows lost, repeated or out of order"; }
import json, sys, time
path, last, marks, mode = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
def check():
    seen, ids, why = {}, set(), []
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        r = json.loads(line)
        if r["id"] in ids:
            why.append(f"id {r['id']} twice")
        ids.add(r["id"])
        row = json.loads(json.loads(r["body"]))  # the jsonb text as a JSON string
        seen.setdefault(row["key"], []).append(row["seq"])
    for key, top in last.items():
        got = seen.get(key, [])
        if not got or got[-1] != top:
            why.append(f"{key}: last received {got[-1:]} of {top}")
            continue
        first = 1 if mode == "reuse-slot" else marks.get(key, 0) + 1
        if got != list(range(got[0], top + 1)):
            why.append(f"{key}: not each once in order: {got}")
        if got[0] > first:
            why.append(f"{key}: starts at {got[0]}, rows from {first} on were kept for the relay")
    return why, sum(len(v) for v in seen.values())
deadline = time.time() + 90
while True:
    why, n = check()
    if not why or time.time() > deadline:
        break
    time.sleep(0.5)
if why:
    print("\n".join(why), file=sys.stderr)
    sys.exit(1)
print(f"debezium-guide: {mode}: {n} rows received, each once, in order per key")
PY
    kill "$relay"
    wait "$relay" 2>/dev/null || true
}

run_cutover side-by-side
run_cutover reuse-slot
echo "debezium-guide: both cut-overs of docs/from-debezium.md work as written"
