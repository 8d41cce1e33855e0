#!/usr/bin/env bash
# The install paths, taken the way a user takes them (scripts/test.sh runs this after the tests):
#
#   1. `cargo install --path crates/outbox-cli --no-default-features --features postgres,webhook`
#      — the slim build: it must link no OpenSSL, no zlib and no librdkafka, refuse a Kafka
#      destination naming the feature to add, and deliver events written with the PostgreSQL
#      enqueue function (committed ones only, in order) to a webhook receiver.
#   2. The default build (every database and sink, what the Dockerfile ships) links no OpenSSL or
#      zlib either: both are compiled in, so it runs on a slim base image.
#   3. Every library crate packages and builds from its package alone (`cargo package`), as
#      crates.io would build it.
#
# Installs into a temporary root; the build artefacts go to the shared CARGO_TARGET_DIR, so a
# second run rebuilds nothing that did not change. Needs the local PostgreSQL (scripts/services.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/outbox-target}"
PG_URL="${OUTBOX_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
say() { echo "install-check: $*"; }
fail() { echo "install-check: FAILED: $*" >&2; exit 1; }

work="$(mktemp -d)"
schema="outbox_t_install_$$"
receiver_pid=""
cleanup() {
  [ -n "$receiver_pid" ] && kill "$receiver_pid" 2>/dev/null || true
  psql "$PG_URL" -qAt -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# Linked against a shared OpenSSL or zlib?
links_ssl_or_zlib() { ldd "$1" | grep -E 'lib(ssl|crypto|z)\.so' || true; }

# --- 1. the slim build, installed ----------------------------------------------------------------
say "cargo install --path crates/outbox-cli --no-default-features --features postgres,webhook"
cargo install --quiet --locked --debug --path crates/outbox-cli \
  --no-default-features --features postgres,webhook --root "$work/root"
bin="$work/root/bin/outbox"
version="$("$bin" --version)" || fail "the installed binary does not run"
case "$version" in
  "outbox "*" (postgres, webhook, stdout, file)") ;;
  *) fail "outbox --version says \`$version\`, not the features it was built with" ;;
esac
linked="$(links_ssl_or_zlib "$bin")"
[ -z "$linked" ] || fail "the postgres,webhook build links $linked"
if grep -q rd_kafka_new "$bin"; then fail "the postgres,webhook build contains librdkafka"; fi

# A destination this build lacks: exit 2, naming the feature.
set +e
said="$(OUTBOX_DATABASE__URL="$PG_URL" OUTBOX_DESTINATIONS__K__TYPE=kafka \
  OUTBOX_DESTINATIONS__K__BROKERS=127.0.0.1:9 "$bin" config check 2>&1)"
code=$?
set -e
[ "$code" = 2 ] || fail "config check of a kafka destination exited $code, not 2: $said"
case "$said" in
  *"built without the \`kafka\` cargo feature"*) ;;
  *) fail "config check of a kafka destination did not name the feature: $said" ;;
esac

# A webhook receiver that records each body (one JSON line per request) and answers 200.
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
python3 - "$port" "$work/received.jsonl" <<'EOF' &
import http.server, sys
port, out = int(sys.argv[1]), sys.argv[2]
class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(out, "ab") as f:
            f.write(body.replace(b"\n", b" ") + b"\n")
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Hook).serve_forever()
EOF
receiver_pid=$!

export OUTBOX_DATABASE__URL="$PG_URL" OUTBOX_DATABASE__SCHEMA="$schema" \
  OUTBOX_DESTINATIONS__HOOK__TYPE=webhook OUTBOX_DESTINATIONS__HOOK__URL="http://127.0.0.1:$port/events"
"$bin" migrate >/dev/null 2>&1 || fail "migrate with the slim build"
psql "$PG_URL" -qAt -v ON_ERROR_STOP=1 >/dev/null <<EOF
BEGIN;
SELECT $schema.events_enqueue('order', '1', 'OrderPlaced', '{"n": 1}');
SELECT $schema.events_enqueue('order', '1', 'OrderPaid', '{"n": 2}');
COMMIT;
BEGIN;
SELECT $schema.events_enqueue('order', '1', 'OrderCancelled', '{"n": 99}');
ROLLBACK;
BEGIN;
SELECT $schema.events_enqueue('order', '1', 'OrderShipped', '{"n": 3}');
COMMIT;
EOF
timeout 60 "$bin" relay --drain >"$work/relay.log" 2>&1 || { cat "$work/relay.log" >&2; fail "relay --drain"; }
got="$(python3 -c '
import json, sys
print(" ".join(str(json.loads(line)["n"]) for line in open(sys.argv[1])))' "$work/received.jsonl")"
[ "$got" = "1 2 3" ] || fail "the webhook received payloads [$got], not [1 2 3] (committed ones, in order)"
unset OUTBOX_DATABASE__URL OUTBOX_DATABASE__SCHEMA OUTBOX_DESTINATIONS__HOOK__TYPE OUTBOX_DESTINATIONS__HOOK__URL
say "slim build: no OpenSSL, zlib or librdkafka linked; delivered the 3 committed events in order"

# --- 2. the default build links no OpenSSL or zlib ----------------------------------------------
cargo build --quiet --locked -p outbox-cli --bin outbox
linked="$(links_ssl_or_zlib "$CARGO_TARGET_DIR/debug/outbox")"
[ -z "$linked" ] || fail "the default build links $linked"
grep -q rd_kafka_new "$CARGO_TARGET_DIR/debug/outbox" || fail "the default build has no librdkafka?"
say "default build: librdkafka with OpenSSL and zlib compiled in, none linked from the system"

# --- 3. every library crate packages and builds alone -------------------------------------------
# The benchmark and the verification harness are tools of this repository (publish = false).
# Cargo verifies each package against the others through a local registry. Its sources are
# unpacked under $CARGO_HOME/registry/src/-<hash>/ and not unpacked again for the same version,
# and what it builds from them is never rebuilt for the same version either (registry sources
# are taken to be immutable): an earlier run's outbox packages (same 0.1.0, older code) would
# be used instead of this checkout's. Both are removed first: that registry's `outbox*`
# sources, and every build of an `outbox*` crate in the target directory (this checkout's are
# rebuilt in a minute or two; no dependency is).
registry="${CARGO_HOME:-$HOME/.cargo}/registry"
rm -rf "$registry"/src/-*/outbox-* "$registry"/cache/-*/outbox-*
rm -rf "$CARGO_TARGET_DIR"/debug/.fingerprint/outbox* "$CARGO_TARGET_DIR"/debug/deps/liboutbox* \
  "$CARGO_TARGET_DIR"/debug/deps/outbox* "$CARGO_TARGET_DIR"/debug/build/outbox*
cargo package --quiet --workspace --locked --exclude outbox-bench --exclude outbox-verify
say "cargo package: every published crate builds from its package"
