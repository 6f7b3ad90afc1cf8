#!/usr/bin/env bash
# The test command: set up, make sure the services answer, then lint, type-check and test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,demo
bash scripts/services.sh
.venv/bin/ruff check pacerd tests bench
.venv/bin/ruff format --check pacerd tests bench
.venv/bin/mypy
.venv/bin/pytest -q "$@"
