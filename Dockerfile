# syntax=docker/dockerfile:1
#
# The relay as a container image: `docker build -t outbox:0.1.0 .` (the tag is the workspace
# version, which deploy/kubernetes/relay.yaml pins) then, for example,
#   docker run --rm -e OUTBOX_DATABASE__URL=postgres://outbox@db:5432/app \
#     -e OUTBOX_DESTINATIONS__EVENTS__TYPE=kafka -e OUTBOX_DESTINATIONS__EVENTS__BROKERS=kafka:9092 \
#     -e OUTBOX_DESTINATIONS__EVENTS__TOPIC='events.${event_type}' outbox
# Every setting can come from OUTBOX_SECTION__KEY variables (see outbox.example.toml), so the
# image needs no config file; one can still be mounted and named with `relay --config`.
# deploy/kubernetes/relay.yaml runs it with probes and a graceful stop.
#
# Not built on the machine this repository is developed on (it has no container engine): the
# binary it builds is the one CI tests, `cargo build --release -p outbox-cli --bin outbox`.

FROM rust:1.95-bookworm AS build
# librdkafka, and the OpenSSL and zlib it links statically, are built from source: a C toolchain
# (in the image), make and perl (scripts/build-deps.sh installs the same on a developer machine).
RUN apt-get update \
    && apt-get install -y --no-install-recommends perl make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Debug info goes to outbox.debug beside the binary (kept in the build stage, for symbolizing
# a crash report); the shipped binary is stripped.
RUN cargo build --release --locked -p outbox-cli --bin outbox \
    && objcopy --only-keep-debug target/release/outbox target/release/outbox.debug \
    && objcopy --strip-debug --add-gnu-debuglink=target/release/outbox.debug target/release/outbox

FROM debian:bookworm-slim AS runtime
# The binary needs no OpenSSL or zlib from the image (both are compiled in, see the workspace's
# rdkafka features); CA certificates for TLS to brokers, databases and webhooks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin outbox
COPY --from=build /src/target/release/outbox /usr/local/bin/outbox
USER 10001:10001
# /metrics, /healthz and /readyz; JSON logs for the platform's log collector. On every
# interface: the orchestrator's probes and the scraper come from outside the container. What
# anyone else who reaches the port can do is bounded by the relay (metrics.header_timeout, 5 s,
# for a request's headers or an idle connection; metrics.max_connections, 64, a quarter per
# address, beyond which a connection is refused at once: the port never takes the descriptors
# the relay's own connections need); keep the port on a network only those reach
# (deploy/kubernetes/relay.yaml has a NetworkPolicy for it).
ENV OUTBOX_METRICS__LISTEN=0.0.0.0:9464 \
    OUTBOX_LOG_FORMAT=json
EXPOSE 9464
# Exec form: the relay is PID 1 and gets SIGTERM itself (it stops claiming, finishes the wave
# being published, acks it and releases the rest; nothing stays claimed).
ENTRYPOINT ["/usr/local/bin/outbox"]
CMD ["relay"]
