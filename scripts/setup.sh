#!/usr/bin/env bash
# Creates .venv and installs pacerd with the given extras (default: dev).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-dev}
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$extras]"
