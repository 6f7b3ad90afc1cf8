#!/usr/bin/env bash
# The test command: set up, make sure the services answer, then lint, type-check and test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,demo
bash scripts/services.sh
.venv/bin/ruff check pacerd pacerd_demo tests bench
.venv/bin/ruff format --check pacerd pacerd_demo tests bench
.venv/bin/mypy
# The tests that run daemons go to one worker, one at a time (their xdist_group,
# tests/conftest.py); everything else is spread over the other worker(s).
.venv/bin/pytest -q -n "${PACERD_TEST_WORKERS:-2}" --dist loadgroup "$@"
