"""The test command relies on ``--dist loadgroup`` keeping each ``xdist_group``
on one worker (the claim-plan ledgers built once): run a small suite that
way and check it."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

SUITE = """
import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("i", range(8))
def test_grouped(i: int) -> None:
    pass
"""


def test_a_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_grouped.py").write_text(SUITE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup",
         "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    workers = re.findall(r"^\[(gw\d+)\].*PASSED", run.stdout, flags=re.MULTILINE)
    assert len(workers) == 8, run.stdout
    assert len(set(workers)) == 1, f"the group ran on {sorted(set(workers))}:\n{run.stdout}"
