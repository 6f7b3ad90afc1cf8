"""The collector's settings of a started process (``pacerd.heap``)."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import pytest

from pacerd import heap

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """The test process's collector as it was, whatever the test did to it."""
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.fixture
def settles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each call of ``heap.settle``, recorded instead of run."""
    calls: list[int] = []
    monkeypatch.setattr(heap, "settle", lambda: calls.append(1))
    return calls


@pytest.mark.usefixtures("restored_gc")
def test_settle_freezes_what_exists_and_raises_only_the_young_threshold() -> None:
    gc.unfreeze()
    _, middle, oldest = gc.get_threshold()
    survivor = [object()]  # a container alive at start-up
    assert any(o is survivor for o in gc.get_objects())

    heap.settle()

    assert gc.get_freeze_count() > 0
    assert not any(o is survivor for o in gc.get_objects())  # no collection walks it again
    assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, middle, oldest)
    assert heap.YOUNG_THRESHOLD > 700  # CPython's default, which promotes what is in flight


def test_a_worker_settles_when_it_reports_it_has_started(settles: list[int]) -> None:
    status = heap.SettleOnStart()
    assert settles == []
    status.started()
    assert settles == [1]
