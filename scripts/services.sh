#!/usr/bin/env bash
# Makes sure the local PostgreSQL and RabbitMQ answer; starts them if they do not.
set -euo pipefail

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
amqp_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && rabbitmq-diagnostics -q check_running >/dev/null 2>&1; }

wait_for() {  # name, check, seconds
  local name=$1 check=$2 seconds=$3
  for _ in $(seq 1 "$seconds"); do
    if "$check"; then echo "services: $name is up"; return 0; fi
    sleep 1
  done
  echo "services: $name did not come up within ${seconds}s" >&2
  return 1
}

if ! pg_up; then
  echo "services: starting PostgreSQL"
  if command -v pg_ctlcluster >/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start || true
  fi
fi
wait_for PostgreSQL pg_up 60

if ! amqp_up; then
  echo "services: starting RabbitMQ"
  if command -v rabbitmq-server >/dev/null; then
    rabbitmq-server -detached >/dev/null 2>&1 || true
  fi
fi
wait_for RabbitMQ amqp_up 120
