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
# promtool (Debian's prometheus package) checks deploy/alerts.yml in tests/unit/test_deploy.py;
# without it those tests are skipped.
if ! command -v promtool >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null \
    || echo "setup: promtool not installed; the alert rule tests will be skipped" >&2
fi
