"""How ``bench/real_scenarios.py`` chooses its scenarios, and the tables the
benchmarks print."""

from __future__ import annotations

import pytest

from bench import common, real_scenarios


def test_only_picks_the_named_scenarios_on_every_upstream() -> None:
    known = real_scenarios.plans(nginx=True)
    got = real_scenarios.selected(known, "drain,S5")
    assert {p.name for p in got} == {"drain", "S5"}
    assert len(got) == sum(p.name in ("drain", "S5") for p in known)
    assert real_scenarios.selected(known, "") == known


def test_a_name_that_is_no_scenario_stops_the_run_and_says_which_there_are() -> None:
    with pytest.raises(SystemExit, match=r"no scenario deep_cut \(there are: .*deepcut"):
        real_scenarios.selected(real_scenarios.plans(nginx=False), "drain,deep_cut")


def test_a_table_without_rows_is_its_header() -> None:
    assert common.table(["scenario", "seed"], []).splitlines()[0] == "| scenario | seed |"
