"""The tick planner: ticks due together are read, planned and first claimed
in one statement each; a task that leaves while its tick is planned gets
nothing, and what was claimed for it is released; a failed statement fails
every tick it served."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
from support.fakes import quiet_row

from pacerd import pacer
from pacerd.admission import AdmissionConfig, DestinationAdmission
from pacerd.clock import ManualClock
from pacerd.errors import LedgerUnavailable
from pacerd.models import ClaimedJob, ClaimRequest, DestinationRow, JobRef
from pacerd.planner import TickPlanner

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    Waits = list[tuple[DestinationAdmission, Callable[[], bool], float]]

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def row(name: str) -> DestinationRow:
    return quiet_row(name, now=NOW, inflight=0)


def job(name: str, n: int) -> ClaimedJob:
    return ClaimedJob(
        job_id=f"{name}-{n}", kind="k", destination=name, attempt=1, revision=0,
        payload_json="{}", cursor_json=None, eligible_at=NOW, live=False,
    )  # fmt: skip


class FakeShared:
    """The planner's side of ``SharedLedger``: counts its statements."""

    def __init__(self) -> None:
        self.statements: Counter[str] = Counter()
        self.claimed: list[ClaimRequest] = []
        self.released: list[JobRef] = []
        self.fail_read = False
        self.claiming = anyio.Event()  # set while a claim statement runs
        self.finish_claim = anyio.Event()
        self.hold_claim = False

    async def read_rows(self, names: Sequence[str]) -> dict[str, DestinationRow]:
        self.statements["read"] += 1
        if self.fail_read:
            raise LedgerUnavailable("the ledger cannot be reached")
        return {n: row(n) for n in names}

    async def save_states(self, saves: Sequence[tuple[str, Mapping[str, Any], int]]) -> None:
        self.statements["save"] += 1

    async def claim_many(
        self, claims: Sequence[tuple[ClaimRequest, str]]
    ) -> dict[str, list[ClaimedJob]]:
        self.statements["claim"] += 1
        self.claimed.extend(request for request, _ in claims)
        self.claiming.set()
        if self.hold_claim:
            await self.finish_claim.wait()
        return {r.destination: [job(r.destination, i) for i in range(r.limit)] for r, _ in claims}

    async def release_abandoned(self, jobs: Sequence[ClaimedJob]) -> None:
        self.released.extend(job.ref for job in jobs)


def admission(name: str, clock: ManualClock) -> DestinationAdmission:
    params = pacer.PacingParams(tick_seconds=1.0, initial_rate=3.0, max_rate=3.0)
    config = AdmissionConfig(destination=name, queue=f"q.{name}", params=params)
    return DestinationAdmission(ledger=None, publisher=None, clock=clock, config=config)  # type: ignore[arg-type]


async def planned(planner: TickPlanner, waits: Waits) -> None:
    """Runs ``planner`` until every (admission, leads, deadline) waiting on it is planned."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(planner.run)
        async with anyio.create_task_group() as waiting:
            for a, leads, deadline in waits:
                waiting.start_soon(planner.wait, a, leads, deadline)
        tg.cancel_scope.cancel()


async def test_ticks_due_together_share_one_read_and_one_claim() -> None:
    clock, shared = ManualClock(start=100.0, autojump=True), FakeShared()
    planner = TickPlanner(shared, clock=clock)  # type: ignore[arg-type]
    admissions = [admission(f"d{i}", clock) for i in range(50)]
    await planned(planner, [(a, lambda: True, 101.0) for a in admissions])
    assert planner.passes == 1
    assert shared.statements == Counter(read=1, claim=1)
    names = sorted(a.config.destination for a in admissions)
    assert sorted(r.destination for r in shared.claimed) == names
    for a in admissions:
        assert a.ready is not None
        assert a.ready.error is None
        assert a.ready.begun is not None
        assert a.ready.jobs is not None
        assert len(a.ready.jobs) == a.ready.begun.limit > 0
        assert a.ready.planning_seconds is not None
        assert a.ready.begun.now == 101.0  # planned when it came due, not before
        assert a.next_deadline == a.ready.begun.plan.next_deadline


async def test_a_task_leaving_while_its_tick_is_planned_gets_nothing_and_its_claim_released() -> (
    None
):
    clock, shared = ManualClock(start=0.0, autojump=True), FakeShared()
    shared.hold_claim = True
    planner = TickPlanner(shared, clock=clock)  # type: ignore[arg-type]
    staying, leaving = admission("stays", clock), admission("leaves", clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(planner.run)
        async with anyio.create_task_group() as waiting:
            waiting.start_soon(planner.wait, staying, lambda: True, 0.0)
            scope = anyio.CancelScope()

            async def leave() -> None:
                with scope:
                    await planner.wait(leaving, lambda: True, 0.0)

            waiting.start_soon(leave)
            await shared.claiming.wait()  # both are being claimed for
            scope.cancel()  # e.g. its partition's lock lost
            await anyio.wait_all_tasks_blocked()
            shared.finish_claim.set()
        tg.cancel_scope.cancel()
    assert staying.ready is not None
    assert staying.ready.jobs
    assert leaving.ready is None
    assert shared.released
    assert {ref.job_id.split("-")[0] for ref in shared.released} == {"leaves"}


async def test_a_failed_read_fails_every_tick_it_served_and_none_is_claimed() -> None:
    clock, shared = ManualClock(start=0.0, autojump=True), FakeShared()
    shared.fail_read = True
    planner = TickPlanner(shared, clock=clock)  # type: ignore[arg-type]
    admissions = [admission(f"d{i}", clock) for i in range(3)]
    await planned(planner, [(a, lambda: True, 0.0) for a in admissions])
    assert shared.statements == Counter(read=1)
    for a in admissions:
        assert a.ready is not None
        assert isinstance(a.ready.error, LedgerUnavailable)


async def test_a_destination_no_longer_led_is_woken_without_a_plan() -> None:
    clock, shared = ManualClock(start=0.0, autojump=True), FakeShared()
    planner = TickPlanner(shared, clock=clock)  # type: ignore[arg-type]
    led, lost = admission("led", clock), admission("lost", clock)
    await planned(planner, [(led, lambda: True, 0.0), (lost, lambda: False, 0.0)])
    assert led.ready is not None
    assert led.ready.jobs
    assert lost.ready is None
    assert lost.state is None
    assert [r.destination for r in shared.claimed] == ["led"]


async def test_a_destination_led_no_more_by_the_claim_is_not_claimed_for() -> None:
    clock, shared = ManualClock(start=0.0, autojump=True), FakeShared()
    planner = TickPlanner(shared, clock=clock)  # type: ignore[arg-type]
    kept, lost = admission("kept", clock), admission("lost", clock)
    answers = iter([True, False])  # led when the pass begins, not by its claim
    await planned(planner, [(kept, lambda: True, 0.0), (lost, lambda: next(answers), 0.0)])
    assert [r.destination for r in shared.claimed] == ["kept"]
    assert lost.ready is not None
    assert lost.ready.begun is not None
    assert lost.ready.jobs is None  # if it ticks after all, it claims for itself
