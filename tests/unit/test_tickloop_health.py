"""The tick loop's health check of its destinations: a destination whose
plan skipped ticks that would send nothing (a sparse plan) is due at the tick
before its next one, not a tick after its last."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

from pacerd.tickloop import _Active

if TYPE_CHECKING:
    from pacerd.admission import DestinationAdmission


def active(last_pass: float, next_deadline: float | None, tick: float = 1.0) -> _Active:
    admission = SimpleNamespace(
        next_deadline=next_deadline,
        config=SimpleNamespace(params=SimpleNamespace(tick_seconds=tick)),
    )
    return _Active(
        admission=cast("DestinationAdmission", admission), partition=0, last_pass=last_pass
    )


async def test_a_destination_is_due_from_its_last_pass_on_the_schedule() -> None:
    assert active(100.0, 101.0).due_since() == 100.0
    assert active(100.0, None).due_since() == 100.0  # mid-tick: no plan yet
    assert active(100.3, 101.0).due_since() == 100.3  # a late pass


async def test_a_sparse_plan_is_due_from_the_tick_before_the_one_it_skipped_to() -> None:
    # ticks of 0.2 s, the next in 2 s: due from 1.8 s on, not from the last pass
    assert active(100.0, 102.0, tick=0.2).due_since() == 101.8
