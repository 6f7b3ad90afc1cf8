#!/usr/bin/env bash
# The README's first command: pacerd drains a backlog of overdue jobs (what
# the upstreams accept at capacity over the run: about 27,000) into two
# rate-limited model upstreams whose capacity steps down and up, live in the
# terminal; then a summary and demo-output/pacing.png.
#
# Creates .venv and installs pacerd[demo] if needed, makes sure PostgreSQL and
# RabbitMQ answer, then runs `python -m pacerd_demo`. Arguments are passed
# on: --quick (about 20 s, 3,000 jobs), --duration SECONDS (default 180), --workers N,
# --jobs N, --no-live, --database NAME (default pacerd_demo, dropped and recreated).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import pacerd_demo, matplotlib" >/dev/null 2>&1; then
  echo "demo: installing pacerd[demo] into .venv"
  bash scripts/setup.sh demo
fi
bash scripts/services.sh
exec .venv/bin/python -m pacerd_demo "$@"
