"""The ``pacerd`` command as a process, on a given ledger, with no other PACERD_* setting."""

from __future__ import annotations

import os
import subprocess
import sys


def run_pacerd(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")}
    env["PACERD_DATABASE__DSN"] = dsn
    return subprocess.run(
        [sys.executable, "-m", "pacerd", *args],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
