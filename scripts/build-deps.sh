#!/usr/bin/env bash
# Build prerequisites beyond the Rust toolchain: the Kafka client (rdkafka) builds librdkafka, and
# the OpenSSL and zlib it links statically, from source, so it needs a C compiler, make and perl
# (OpenSSL's build scripts). Idempotent: checks first, installs only what is missing (Debian
# packages; needs root or sudo). A build without Kafka (`--no-default-features --features
# postgres,webhook`, say) needs none of them.
set -euo pipefail

missing=()
command -v cc >/dev/null 2>&1 || missing+=(gcc)
command -v make >/dev/null 2>&1 || missing+=(make)
command -v perl >/dev/null 2>&1 || missing+=(perl)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "build-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
