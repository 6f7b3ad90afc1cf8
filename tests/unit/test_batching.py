"""The coalescer that turns the ticks' concurrent requests into one statement
each (``pacerd.batching``): no I/O, a virtual clock."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import anyio
import anyio.lowlevel
from support.fakes import quiet_row

from pacerd.admission import BRAKE_CHECK_SECONDS
from pacerd.batching import BRAKE_WINDOW_SECONDS, ClosedSnapshot, Coalescer, SharedLedger
from pacerd.clock import ManualClock

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Sequence

    from pacerd.ledger import Ledger
    from pacerd.models import DestinationRow


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


class Snapshots:
    """The closed-destinations read: counts its calls, each held until released."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.calls = 0
        self.gates: list[anyio.Event] = []
        self.fail = False
        # also closed: name -> seconds its cool-down has left (None: paused)
        self.cooling: dict[str, float | None] = {}

    async def read(self) -> dict[str, float | None]:
        self.calls += 1
        gate = anyio.Event()
        self.gates.append(gate)
        await gate.wait()
        if self.fail:
            raise RuntimeError("the read failed")
        return {f"closed-{self.calls}": None, **self.cooling}


async def settle() -> None:
    for _ in range(20):
        await anyio.lowlevel.checkpoint()


async def test_a_check_that_waited_for_a_snapshot_takes_it_however_late_it_wakes() -> None:
    """A busy loop wakes the waiters of a snapshot long after its statement
    began; they are answered from it, not sent round for another (each
    round woke a thousand waiters for nothing)."""
    clock = ManualClock()
    reads = Snapshots(clock)
    snapshot = ClosedSnapshot(reads.read, clock=clock, max_age_seconds=0.02)
    answers: list[frozenset[str]] = []

    async def check() -> None:
        answers.append(await snapshot())

    async with anyio.create_task_group() as tg:
        for _ in range(100):
            tg.start_soon(check)
        await settle()
        clock.advance(0.5)  # the statement and the wake-ups took far longer than the bound
        reads.gates[0].set()
    assert reads.calls == 1
    assert answers == [frozenset({"closed-1"})] * 100
    assert snapshot.statements["closed_destinations"] == 1


async def read_now(snapshot: ClosedSnapshot, reads: Snapshots) -> frozenset[str]:
    """A check that needs a read: the read released at once."""
    answers: list[frozenset[str]] = []

    async def check() -> None:
        answers.append(await snapshot())

    async with anyio.create_task_group() as tg:
        tg.start_soon(check)
        await settle()
        reads.gates[-1].set()
    return answers[0]


async def test_a_check_is_answered_from_a_snapshot_begun_at_most_the_bound_before_it() -> None:
    clock = ManualClock()
    reads = Snapshots(clock)
    snapshot = ClosedSnapshot(reads.read, clock=clock, max_age_seconds=0.02)
    assert await read_now(snapshot, reads) == frozenset({"closed-1"})
    clock.advance(0.015)
    assert await snapshot() == frozenset({"closed-1"})  # begun 15 ms before: recent enough
    assert reads.calls == 1
    clock.advance(0.01)
    assert await read_now(snapshot, reads) == frozenset({"closed-2"})  # 25 ms after: a new read
    assert reads.calls == 2


async def test_a_read_begun_too_long_before_a_check_does_not_answer_it() -> None:
    """A check that arrives while a read is in flight, more than the bound
    after that read began, waits for the next one."""
    clock = ManualClock()
    reads = Snapshots(clock)
    snapshot = ClosedSnapshot(reads.read, clock=clock, max_age_seconds=0.02)
    answers: dict[str, frozenset[str]] = {}

    async def check(name: str) -> None:
        answers[name] = await snapshot()

    async with anyio.create_task_group() as tg:
        tg.start_soon(check, "early")
        await settle()
        clock.advance(0.05)
        tg.start_soon(check, "late")
        await settle()
        reads.gates[0].set()
        await settle()
        assert reads.calls == 2
        reads.gates[1].set()
    assert answers == {"early": frozenset({"closed-1"}), "late": frozenset({"closed-2"})}


async def test_a_failed_read_fails_the_checks_that_waited_for_it_and_the_next_one_reads_again() -> (
    None
):
    clock = ManualClock()
    reads = Snapshots(clock)
    reads.fail = True
    snapshot = ClosedSnapshot(reads.read, clock=clock, max_age_seconds=0.02)
    failures: list[str] = []

    async def check() -> None:
        try:
            await snapshot()
        except RuntimeError as exc:
            failures.append(str(exc))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(check)
        await settle()
        reads.gates[0].set()
    assert failures == ["the read failed"] * 3
    assert reads.calls == 1
    reads.fail = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(check)
        await settle()
        reads.gates[1].set()
    assert reads.calls == 2


async def test_the_reader_cancelled_mid_read_still_answers_the_others() -> None:
    clock = ManualClock()
    reads = Snapshots(clock)
    snapshot = ClosedSnapshot(reads.read, clock=clock, max_age_seconds=0.02)
    answers: list[frozenset[str]] = []
    scope = anyio.CancelScope()

    async def first() -> None:
        with scope:
            await snapshot()

    async def other() -> None:
        answers.append(await snapshot())

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await settle()
        tg.start_soon(other)
        await settle()
        scope.cancel()
        await settle()
        reads.gates[0].set()
    assert answers == [frozenset({"closed-1"})]
    assert reads.calls == 1


async def test_while_notices_are_heard_a_snapshot_stands_until_a_notice() -> None:
    """Every pause, resume and cool-down is noticed as it commits: the checks
    read nothing more until one comes, or until the snapshot is
    ``noticed_age_seconds`` old (the session may have died without a word);
    without notices they read every ``max_age_seconds``."""
    clock = ManualClock()
    reads = Snapshots(clock)
    heard = True
    snapshot = ClosedSnapshot(
        reads.read, clock=clock, max_age_seconds=0.02, noticed_age_seconds=1.0,
        noticed=lambda: heard,
    )  # fmt: skip
    assert await read_now(snapshot, reads) == {"closed-1"}
    for _ in range(9):
        clock.advance(0.1)
        assert await snapshot() == {"closed-1"}  # 0.9 s of checks: no read
    assert reads.calls == 1
    snapshot.changed()  # a notice: the next check reads
    assert await read_now(snapshot, reads) == {"closed-2"}
    clock.advance(1.01)  # nothing noticed for longer than the bound: read all the same
    assert await read_now(snapshot, reads) == {"closed-3"}
    heard = False  # the session lost: poll again
    clock.advance(0.03)
    assert await read_now(snapshot, reads) == {"closed-4"}
    assert reads.calls == 4


async def test_a_cool_down_ends_within_a_snapshot() -> None:
    """A snapshot that stands for long never holds a destination closed past
    the end its read gave (counted from when the read returned)."""
    clock = ManualClock()
    reads = Snapshots(clock)
    reads.cooling = {"cooling": 0.5}
    snapshot = ClosedSnapshot(reads.read, clock=clock, max_age_seconds=0.02, noticed=lambda: True)
    assert await read_now(snapshot, reads) == {"closed-1", "cooling"}
    clock.advance(0.49)
    assert await snapshot() == {"closed-1", "cooling"}
    clock.advance(0.02)
    assert await snapshot() == {"closed-1"}  # its cool-down is over
    assert reads.calls == 1


async def test_a_slices_check_looks_its_destination_up_and_every_destination_paused() -> None:
    clock = ManualClock()
    reads = Snapshots(clock)
    reads.cooling = {"cooling": 0.5}
    snapshot = ClosedSnapshot(reads.read, clock=clock, max_age_seconds=0.02, noticed=lambda: True)
    assert await read_now(snapshot, reads) == {"closed-1", "cooling"}
    checks = {name: await snapshot.closes(name) for name in ("closed-1", "cooling", "open")}
    assert checks == {"closed-1": True, "cooling": True, "open": False}
    clock.advance(0.51)
    assert not await snapshot.closes("cooling")  # its cool-down is over
    reads.cooling = {"*": None}
    snapshot.changed()  # every destination paused: a notice
    async with anyio.create_task_group() as tg:
        tg.start_soon(snapshot.closes, "open")
        await settle()
        reads.gates[-1].set()
    assert await snapshot.closes("open")
    assert reads.calls == 2


async def test_callers_cancelled_before_the_statement_are_left_out_of_it() -> None:
    """Where results are handed back (a claim), a caller cancelled before the
    statement is sent (its tick cancelled: leadership lost) is left out of
    it, and a batch left with no caller sends nothing: no claim is made for
    a destination whose leadership was lost while the claim gathered."""
    recorder = Recorder()
    abandoned: list[tuple[int, int]] = []

    async def on_abandoned(key: int, result: int) -> None:
        abandoned.append((key, result))

    coalesce: Coalescer[int, int] = Coalescer(
        "t", recorder.run, clock=ManualClock(), window_seconds=0.01, on_abandoned=on_abandoned
    )
    served: dict[int, int] = {}
    scopes = {k: anyio.CancelScope() for k in range(5)}

    async def ask(k: int) -> None:
        with scopes[k]:
            served[k] = await coalesce(k)

    async with anyio.create_task_group() as tg:  # every caller gone: no statement
        tg.start_soon(ask, 0)
        tg.start_soon(ask, 1)
        await settle()  # both asked; the runner waits out its window
        scopes[1].cancel()
        await settle()
        scopes[0].cancel()
    assert recorder.batches == []
    assert coalesce.statements["t"] == 0
    async with anyio.create_task_group() as tg:  # the runner and one other gone
        tg.start_soon(ask, 2)
        tg.start_soon(ask, 3)
        tg.start_soon(ask, 4)
        await settle()
        scopes[3].cancel()
        await settle()
        scopes[2].cancel()
    assert recorder.batches == [[4]]
    assert served == {4: 40}
    assert abandoned == []


class RowReads:
    """The ledger under ``SharedLedger``'s reads: records each statement."""

    def __init__(self) -> None:
        self.reads: list[tuple[list[str], bool]] = []  # (destinations, with in-flight counts)

    async def read_destinations(
        self, destinations: Sequence[str], now: dt.datetime | None = None, *, inflight: bool = False
    ) -> dict[str, DestinationRow]:
        self.reads.append((list(destinations), inflight))
        return {name: quiet_row(name) for name in destinations}

    async def closed_destinations(self, now: dt.datetime | None = None) -> dict[str, float | None]:
        return {}

    async def has_due_many(self, keys: list[tuple[str, int]]) -> list[int]:
        return [0 for _ in keys]


async def test_brakes_of_destinations_reading_apart_share_a_statement_within_a_window() -> None:
    """Each destination's brake reads its row mid-tick at its own phase of the
    release grid. While another destination braked within the last two
    checks, a read waits ``BRAKE_WINDOW_SECONDS`` for others, and the reads
    asked within it go as one statement, each caller getting its own row. A
    destination braking alone waits for nobody, nor does a tick's own read
    (with its in-flight count), on the way to its first release."""
    clock = ManualClock()
    reads = RowReads()
    shared = SharedLedger(cast("Ledger", reads), clock=clock)
    got: dict[str, str | None] = {}
    w = BRAKE_WINDOW_SECONDS

    async def brake(name: str, after: float) -> None:
        await clock.sleep_until(clock.monotonic() + after)
        row = await shared.read_destination(name)
        got[name] = None if row is None else row.destination

    with anyio.fail_after(5):  # the clock stands still: no window is waited out
        for _ in range(3):  # alone, check after check
            await brake("x", 0.0)
            clock.advance(BRAKE_CHECK_SECONDS)
        row = await shared.read_destination("t", inflight=True)
    assert row is not None
    assert row.destination == "t"
    assert reads.reads == [(["x"], False)] * 3 + [(["t"], True)]

    reads.reads.clear()
    clock.advance(1.0)
    async with anyio.create_task_group() as tg:
        for name, after in (("a", 0.0), ("b", 0.4 * w), ("c", 0.8 * w), ("d", 2.0 * w)):
            tg.start_soon(brake, name, after)
        for _ in range(40):
            await settle()
            clock.advance(0.1 * w)
    # "a" braked alone; "b" found it had, and gathered "c"; "d" waited too
    assert reads.reads == [(["a"], False), (["b", "c"], False), (["d"], False)]
    assert got == {"x": "x", "a": "a", "b": "b", "c": "c", "d": "d"}
    assert shared.statements == {"read_destination": 6, "read_destination_inflight": 1}
