"""``bench/sim_compare.py`` runs the seeds it is told (the tests' seeds or
others) and says, for a miss, on how many of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bench import sim_compare

if TYPE_CHECKING:
    import pytest


def test_seeds_from_the_first_seed_on_and_misses_counted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # S5 (120 s of virtual time) twice per law: the halving baseline needs
    # over a minute to reach 90 % of capacity from 1/s, far past S5's 45 s
    assert sim_compare.main(["--first-seed", "10", "--seeds", "2", "--workers", "1", "S5"]) == 0
    out = capsys.readouterr().out
    assert "Worst of 2 seeds (10..11)" in out
    row = next(line for line in out.splitlines() if "| time_to_90pct_s |" in line)
    pacerd_cell, halving_cell = (cell.strip() for cell in row.split("|")[4:6])
    assert pacerd_cell.endswith(" ok")
    assert halving_cell.endswith("MISS (2 of 2)")
    assert "pacerd misses 0 target(s)" in out
