"""Exit statuses: distinct, and the systemd unit restarts only those that can heal."""

from __future__ import annotations

from pathlib import Path

from pacerd import exitcodes

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "pacerd.service"


def unit_values(key: str) -> list[str]:
    values: list[str] = []
    for line in UNIT.read_text().splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name == key:
            values += value.split()
    return values


def test_each_kind_of_failure_has_its_own_status() -> None:
    codes = {name: value for name, value in vars(exitcodes).items() if name.startswith("EX_")}
    assert len(set(codes.values())) == len(codes), codes


def test_the_unit_does_not_restart_permanent_failures() -> None:
    prevented = {int(v) for v in unit_values("RestartPreventExitStatus")}
    assert set(exitcodes.PERMANENT) <= prevented
    assert exitcodes.EX_NOT_MIGRATED in prevented
    assert exitcodes.EX_CONFIG in prevented


def test_the_unit_restarts_what_may_heal() -> None:
    assert unit_values("Restart") == ["on-failure"]
    prevented = {int(v) for v in unit_values("RestartPreventExitStatus")}
    assert exitcodes.EX_UNAVAILABLE not in prevented
    assert exitcodes.EX_FAILURE not in prevented
