#!/usr/bin/env bash
# The test command: set up, make sure the services answer, then lint, type-check and test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,demo
bash scripts/services.sh
.venv/bin/ruff check pacerd pacerd_demo tests bench
.venv/bin/ruff format --check pacerd pacerd_demo tests bench
.venv/bin/mypy
# The tests are spread over the workers; an xdist_group (the claim plans' large
# ledgers, built once) keeps its tests on one worker.
.venv/bin/pytest -q -n "${PACERD_TEST_WORKERS:-2}" --dist loadgroup "$@"
