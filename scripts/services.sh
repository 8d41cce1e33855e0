#!/usr/bin/env bash
# Make sure every service the test suite talks to is up, starting the ones that are down.
# Idempotent: a running service is left alone. Commands are the machine's own (see
# ../shared/services.md); Kafka (tansu) is handled by scripts/kafka.sh when present.
set -euo pipefail
cd "$(dirname "$0")/.."

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {
  local name=$1 port=$2 tries=${3:-60}
  for _ in $(seq "$tries"); do
    listening "$port" && return 0
    sleep 1
  done
  echo "services: $name did not come up on 127.0.0.1:$port" >&2
  return 1
}

ensure() {
  local name=$1 port=$2; shift 2
  if listening "$port"; then
    echo "services: $name is up on :$port"
    return 0
  fi
  echo "services: starting $name"
  "$@" >/dev/null 2>&1 || true
  wait_for "$name" "$port"
  echo "services: $name is up on :$port"
}

ensure PostgreSQL 5432 bash -c 'pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start'
ensure Redis 6379 redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
ensure RabbitMQ 5672 rabbitmq-server -detached
ensure NATS 4222 start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
ensure MariaDB 3306 start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd

if [ -x scripts/kafka.sh ]; then
  scripts/kafka.sh
fi
