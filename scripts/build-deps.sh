#!/usr/bin/env bash
# Build prerequisites beyond the Rust toolchain: the Kafka client (rdkafka) builds librdkafka from
# source with TLS, so it needs a C compiler, make and OpenSSL's headers. Idempotent: checks first,
# installs only what is missing (Debian packages; needs root or sudo).
set -euo pipefail

missing=()
command -v cc >/dev/null 2>&1 || missing+=(gcc)
command -v make >/dev/null 2>&1 || missing+=(make)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
if ! { [ -f /usr/include/openssl/ssl.h ] || pkg-config --exists openssl 2>/dev/null; }; then
  missing+=(libssl-dev)
fi
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "build-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
