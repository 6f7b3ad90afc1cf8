"""The coalescer that turns the ticks' concurrent requests into one statement
each (``pacerd.batching``): no I/O, a virtual clock."""

from __future__ import annotations

import anyio
import anyio.lowlevel

from pacerd.batching import Coalescer
from pacerd.clock import ManualClock


class Recorder:
    def __init__(self, *, fail: bool = False, gate: anyio.Event | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail = fail
        self.gate = gate

    async def run(self, keys: list[int]) -> list[int]:
        self.batches.append(list(keys))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("the statement failed")
        return [k * 10 for k in keys]


async def test_requests_made_together_share_one_run_and_get_their_own_result() -> None:
    recorder = Recorder()
    coalesce: Coalescer[int, int] = Coalescer("t", recorder.run, clock=ManualClock())
    results: dict[int, int] = {}

    async def ask(k: int) -> None:
        results[k] = await coalesce(k)

    async with anyio.create_task_group() as tg:
        for k in range(100):
            tg.start_soon(ask, k)
    assert recorder.batches == [list(range(100))]
    assert results == {k: k * 10 for k in range(100)}
    assert coalesce.statements["t"] == 1


async def test_requests_made_apart_run_apart() -> None:
    recorder = Recorder()
    coalesce: Coalescer[int, int] = Coalescer("t", recorder.run, clock=ManualClock())
    assert await coalesce(1) == 10
    assert await coalesce(2) == 20
    assert recorder.batches == [[1], [2]]


async def test_a_failure_reaches_every_caller_of_the_batch() -> None:
    recorder = Recorder(fail=True)
    coalesce: Coalescer[int, int] = Coalescer("t", recorder.run, clock=ManualClock())
    failures: list[int] = []

    async def ask(k: int) -> None:
        try:
            await coalesce(k)
        except RuntimeError:
            failures.append(k)

    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(ask, k)
    assert sorted(failures) == [0, 1, 2]
    assert recorder.batches == [[0, 1, 2]]


async def test_a_caller_cancelled_while_it_waits_hands_its_result_back() -> None:
    """A claim whose tick was cancelled (leadership lost) is released, not
    left to its lease; the batch still serves everyone else."""
    gate = anyio.Event()
    recorder = Recorder(gate=gate)
    abandoned: list[tuple[int, int]] = []

    async def on_abandoned(key: int, result: int) -> None:
        abandoned.append((key, result))

    coalesce: Coalescer[int, int] = Coalescer(
        "t", recorder.run, clock=ManualClock(), on_abandoned=on_abandoned
    )
    served: dict[int, int] = {}
    scopes = {k: anyio.CancelScope() for k in range(3)}

    async def ask(k: int) -> None:
        with scopes[k]:
            served[k] = await coalesce(k)

    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(ask, k)
        while not recorder.batches:
            await anyio.lowlevel.checkpoint()
        scopes[0].cancel()  # the batch's runner: its statement runs on, shielded
        scopes[2].cancel()
        gate.set()
    assert served == {1: 10}
    assert sorted(abandoned) == [(0, 0), (2, 20)]
    assert recorder.batches == [[0, 1, 2]]


async def test_a_window_lets_later_requests_join() -> None:
    clock = ManualClock()
    recorder = Recorder()
    coalesce: Coalescer[int, int] = Coalescer("t", recorder.run, clock=clock, window_seconds=0.01)
    results: list[int] = []

    async def ask(k: int, after: float) -> None:
        if after:
            await clock.sleep_until(clock.monotonic() + after)
        results.append(await coalesce(k))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, 1, 0.0)
        tg.start_soon(ask, 2, 0.005)
        tg.start_soon(ask, 3, 0.05)
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        clock.advance(0.006)
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        clock.advance(0.01)
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        clock.advance(0.05)
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        clock.advance(0.02)
    assert recorder.batches == [[1, 2], [3]]
    assert sorted(results) == [10, 20, 30]
