"""The fakes of pacerd's seams, in one place, held to the real things by the
contract suite (``tests/contract``; the simulation's ledger view in
``tests/sim/test_sim_contract.py``):

- ``FakeLedger``: ``admission.AdmissionLedger`` in memory, with the SQL's
  semantics (the two-lane claim, the fenced transitions, the in-flight
  count, the destination's counters, cool-down and pacer state), an
  optional overdue backlog of generated jobs (endless if asked), a price
  per operation and a record of what it claimed and released;
- ``FakePublisher``: ``publisher.Publisher``, routing what was declared (or
  everything), each message confirmed, refused or timed out as its
  ``outcome`` says, after a price per publish and a confirm delay; it counts
  what it sent and confirmed and hands the confirmed jobs to ``on_confirmed``;
- ``VirtualClock``: ``clock.Clock`` in virtual time, for anyio: ``drive``
  moves the time to the earliest sleeper once every task waits.

The other clocks are single already: ``pacerd.clock.ManualClock`` (and the
real ``SystemClock``), and the simulation's trio ``SimClock``.
"""

from __future__ import annotations

import datetime as dt
import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from pacerd.errors import PublishRejected
from pacerd.models import ClaimedJob, DestinationRow, JobRef, JobState

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from pacerd.clock import Clock
    from pacerd.errors import PublishError

    Price = Callable[[], Awaitable[None]]
    """What one ledger operation costs (awaited before it runs)."""
    PublishPrice = Callable[[int], Awaitable[None]]
    """What publishing ``n`` messages costs (awaited before their confirms)."""

EPOCH_AT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)  # VirtualClock's wall time at 0


def quiet_row(
    destination: str, *, now: dt.datetime = EPOCH_AT, inflight: int | None = None
) -> DestinationRow:
    """A destination's row with nothing to tell: open, unled, no outcome yet."""
    return DestinationRow(
        destination=destination, paused=False, paused_all=False, cooldown_until=None, epoch=0,
        pacer_state=None, n_accepted=0, n_refused=0, n_accepted_fresh=0, n_refused_fresh=0,
        n_retry_after=0, leader=None, leader_since=None, now=now, inflight=inflight,
    )  # fmt: skip


class VirtualClock:
    """``pacerd.clock.Clock`` in virtual time: ``drive`` lets every task run until
    it waits, then moves the time to the earliest sleeper's deadline."""

    def __init__(self) -> None:
        self._mono = 0.0
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._count = 0

    def monotonic(self) -> float:
        return self._mono

    def now(self) -> dt.datetime:
        return EPOCH_AT + dt.timedelta(seconds=self._mono)

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= self._mono:
            await anyio.lowlevel.checkpoint()
            return
        woken = anyio.Event()
        self._count += 1
        heapq.heappush(self._sleepers, (deadline, self._count, woken))
        await woken.wait()

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self._mono + max(0.0, seconds))

    async def drive(self, until: float) -> None:
        while self._mono < until:
            for _ in range(100):  # everything runnable runs (all I/O here is on this clock)
                await anyio.lowlevel.checkpoint()
            if self._sleepers:
                self._mono = max(self._mono, self._sleepers[0][0])
                while self._sleepers and self._sleepers[0][0] <= self._mono:
                    heapq.heappop(self._sleepers)[2].set()


# ---------------------------------------------------------------------------
# the ledger


@dataclass(slots=True, kw_only=True)
class _Job:
    job_id: str
    destination: str
    due: dt.datetime  # next_attempt_at
    kind: str = "k"
    payload_json: str = "{}"
    state: JobState = JobState.SCHEDULED
    attempt: int = 0
    ever_offered: bool = False
    epoch: int = 0  # admit_epoch of its current claim


@dataclass(slots=True, kw_only=True)
class _Destination:
    name: str
    overdue: float = 0  # generated overdue jobs still to come (inf: endless)
    generated: int = 0
    paused: bool = False
    cooldown_until: dt.datetime | None = None
    epoch: int = 0
    pacer_state: dict[str, Any] | None = None
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("accepted", "refused", "accepted_fresh", "refused_fresh", "retry_after"), 0
        )
    )


class FakeLedger:
    """``AdmissionLedger`` in memory, on ``clock``'s wall time. Every operation
    first awaits ``price`` (none: it never awaits). ``claimed`` counts the jobs
    it claimed, all told; ``released`` lists the refs it released."""

    def __init__(self, clock: Clock, *, price: Price | None = None) -> None:
        self.clock = clock
        self.price = price
        self.claimed = 0
        self.released: list[JobRef] = []
        self._destinations: dict[str, _Destination] = {}
        self._jobs: dict[str, _Job] = {}
        self._origin = clock.now() - dt.timedelta(days=1)  # the generated jobs' due time

    # -- what the SQL API and the tests do -----------------------------------

    def add_destination(self, name: str, *, overdue: int | None = 0) -> None:
        """Registers ``name`` with ``overdue`` generated jobs due long ago
        (None: endless), older than any job scheduled."""
        self._destinations[name] = _Destination(
            name=name, overdue=math.inf if overdue is None else overdue
        )

    def pause(self, destination: str, *, paused: bool = True) -> None:
        """``pacerd.pause`` (``paused`` False: ``pacerd.resume``) of a known destination."""
        self._destinations[destination].paused = paused

    def cool_down(self, destination: str, seconds: float) -> None:
        """A Retry-After of ``seconds`` reported for ``destination`` now."""
        dest = self._destinations[destination]
        until = self.clock.now() + dt.timedelta(seconds=seconds)
        dest.cooldown_until = max(dest.cooldown_until or until, until)

    def schedule(
        self, job_id: str, destination: str, *, eligible_at: dt.datetime | None = None
    ) -> None:
        """``pacerd.schedule``: a new job (its destination registered on the way)."""
        if destination not in self._destinations:
            self.add_destination(destination)
        due = eligible_at or self.clock.now()
        self._jobs.setdefault(job_id, _Job(job_id=job_id, destination=destination, due=due))

    def report(self, ref: JobRef, *, accepted: bool, retry_after_s: float | None = None) -> bool:
        """``pacerd.report`` of ``ok`` or ``refused``: False when stale."""
        job = self._jobs.get(ref.job_id)
        if job is None or job.attempt != ref.attempt or not _inflight(job):
            return False
        now, dest = self.clock.now(), self._destinations[job.destination]
        job.ever_offered = True
        fresh = job.epoch >= dest.epoch
        outcome = "accepted" if accepted else "refused"
        dest.counters[outcome] += 1
        dest.counters[f"{outcome}_fresh"] += fresh
        if accepted:
            job.state = JobState.COMPLETED
            return True
        job.state = JobState.SCHEDULED
        if retry_after_s is not None:
            until = now + dt.timedelta(seconds=retry_after_s)
            dest.counters["retry_after"] += 1
            dest.cooldown_until = max(dest.cooldown_until or until, until)
            job.due = max(job.due, until)
        return True

    # -- AdmissionLedger -------------------------------------------------------

    async def _io(self) -> None:
        if self.price is not None:
            await self.price()

    async def read_destination(
        self, destination: str, *, inflight: bool = False
    ) -> DestinationRow | None:
        await self._io()
        dest = self._destinations.get(destination)
        if dest is None:
            return None
        n = dest.counters
        return DestinationRow(
            destination=destination, paused=dest.paused, paused_all=False,
            cooldown_until=dest.cooldown_until, epoch=dest.epoch, pacer_state=dest.pacer_state,
            n_accepted=n["accepted"], n_refused=n["refused"],
            n_accepted_fresh=n["accepted_fresh"], n_refused_fresh=n["refused_fresh"],
            n_retry_after=n["retry_after"], leader=None, leader_since=None, now=self.clock.now(),
            inflight=self._count_inflight(destination) if inflight else None,
        )  # fmt: skip

    def _count_inflight(self, destination: str) -> int:
        return sum(j.destination == destination and _inflight(j) for j in self._jobs.values())

    async def is_closed(self, destination: str) -> bool:
        row = await self.read_destination(destination)
        return row is not None and row.closed

    async def has_due(self, destination: str, *, at_least: int = 1) -> int:
        await self._io()
        dest = self._destinations.get(destination)
        if dest is None:
            return 0
        due = dest.overdue + len(self._due(destination, self.clock.now()))
        return int(min(at_least, due))

    async def claim_due(
        self,
        destination: str,
        *,
        live_limit: int,
        limit: int,
        claim_seconds: float,
        epoch: int,
        live_window_seconds: float,
        instance: str,
    ) -> list[ClaimedJob]:
        """Up to ``limit`` due jobs, oldest first, ``live_limit`` of them kept
        for the live lane (never offered, due within the live window), each
        lane giving the other what it cannot fill; none while the destination
        is paused or cooling down (``claim_due`` in ``pacerd/sql/queries.sql``)."""
        await self._io()
        dest = self._destinations.get(destination)
        now = self.clock.now()
        if limit <= 0 or dest is None or dest.paused or (dest.cooldown_until or now) > now:
            return []
        horizon = now - dt.timedelta(seconds=live_window_seconds)
        due = self._due(destination, now)
        live = [job for job in due if not job.ever_offered and job.due > horizon][:limit]
        backlog = [job for job in due if job.ever_offered or job.due <= horizon][:limit]
        backlog_due = int(min(limit, dest.overdue + len(backlog)))
        n_live = min(len(live), max(max(0, live_limit), limit - backlog_due))
        n_backlog = min(backlog_due, limit - n_live)
        generated = [self._generate(dest) for _ in range(int(min(n_backlog, dest.overdue)))]
        picked = live[:n_live] + generated + backlog[: n_backlog - len(generated)]
        for job in picked:
            job.state, job.epoch = JobState.CLAIMED, epoch
            job.attempt += 1
        self.claimed += len(picked)
        lanes = {job.job_id: job in live for job in picked}
        return [_claimed(job, live=lanes[job.job_id]) for job in sorted(picked, key=_order)]

    async def mark_offered(self, refs: Sequence[JobRef], *, offer_seconds: float) -> list[JobRef]:
        await self._io()
        done = [ref for ref in refs if self._current(ref, JobState.CLAIMED)]
        for ref in done:
            job = self._jobs[ref.job_id]
            job.state, job.ever_offered = JobState.OFFERED, True
        return done

    async def release_claims(self, refs: Sequence[JobRef], *, reason: str) -> list[JobRef]:
        await self._io()
        done = [ref for ref in refs if self._current(ref, JobState.CLAIMED)]
        for ref in done:
            self._jobs[ref.job_id].state = JobState.SCHEDULED
        self.released.extend(done)
        return done

    async def save_pacer_state(
        self, destination: str, state: Mapping[str, Any], *, epoch: int
    ) -> None:
        await self._io()
        dest = self._destinations.get(destination)
        if dest is not None:
            dest.pacer_state = dict(state)
            dest.epoch = max(dest.epoch, epoch)

    # -- internals ---------------------------------------------------------------

    def _due(self, destination: str, now: dt.datetime) -> list[_Job]:
        due = [
            job
            for job in self._jobs.values()
            if job.destination == destination and job.state is JobState.SCHEDULED and job.due <= now
        ]
        return sorted(due, key=_order)

    def _generate(self, dest: _Destination) -> _Job:
        dest.overdue -= 1
        dest.generated += 1
        job_id = f"{dest.name}-{dest.generated}"
        due = self._origin + dt.timedelta(microseconds=dest.generated)
        job = self._jobs[job_id] = _Job(
            job_id=job_id, destination=dest.name, due=due, ever_offered=True
        )
        return job

    def _current(self, ref: JobRef, state: JobState) -> bool:
        job = self._jobs.get(ref.job_id)
        return job is not None and job.attempt == ref.attempt and job.state is state


def _inflight(job: _Job) -> bool:
    return job.state in (JobState.CLAIMED, JobState.OFFERED)


def _order(job: _Job) -> tuple[dt.datetime, str]:
    return job.due, job.job_id


def _claimed(job: _Job, *, live: bool) -> ClaimedJob:
    return ClaimedJob(
        job_id=job.job_id, kind=job.kind, destination=job.destination, attempt=job.attempt,
        revision=0, payload_json=job.payload_json, cursor_json=None, eligible_at=job.due,
        live=live,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# the publisher


def unroutable(destination: str) -> PublishRejected:
    """The error of a message no queue is bound for (the real publisher's words)."""
    return PublishRejected(f"unroutable: no queue is bound for {destination!r} (fake)")


class FakePublisher:
    """``Publisher``. A message is routed when its destination was declared
    (``routes`` None: every destination is); a routed one gets ``outcome``'s
    answer (None: confirmed). ``publish_many`` first awaits ``price(n)``,
    then ``confirm_seconds`` on ``clock``, and it never awaits without
    either. ``sent`` / ``confirmed`` count messages, ``unconfirmed`` those
    awaiting their confirm (``peak``: the most at once), ``sent_at`` the
    clock's time of each call; ``on_confirmed`` gets each call's confirmed
    jobs, in order."""

    def __init__(
        self,
        clock: Clock | None = None,
        *,
        routes: set[str] | None = None,
        outcome: Callable[[ClaimedJob], PublishError | None] | None = None,
        price: PublishPrice | None = None,
        confirm_seconds: float = 0.0,
        on_confirmed: Callable[[Sequence[ClaimedJob]], None] | None = None,
    ) -> None:
        self.clock, self.routes, self.outcome = clock, routes, outcome
        self.price, self.confirm_seconds, self.on_confirmed = price, confirm_seconds, on_confirmed
        self.declared: dict[str, str] = {}  # routing key -> queue
        self.sent = self.confirmed = self.unconfirmed = self.peak = 0
        self.sent_at: list[float] = []

    async def declare_destination(self, destination: str, queue: str) -> None:
        self.declared[destination] = queue
        if self.routes is not None:
            self.routes.add(destination)

    async def publish(self, job: ClaimedJob, headers: Mapping[str, str]) -> None:
        (error,) = await self.publish_many([job], [headers])
        if error is not None:
            raise error

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[PublishError | None]:
        n = len(jobs)
        if not n:
            return []
        self.sent += n
        self.unconfirmed += n
        self.peak = max(self.peak, self.unconfirmed)
        try:
            if self.clock is not None:
                self.sent_at.append(self.clock.monotonic())
            if self.price is not None:
                await self.price(n)
            if self.confirm_seconds > 0:
                assert self.clock is not None, "a confirm delay needs a clock"
                await self.clock.sleep(self.confirm_seconds)
        finally:
            self.unconfirmed -= n
        if self.routes is None and self.outcome is None:
            results: list[PublishError | None] = [None] * n
            confirmed: Sequence[ClaimedJob] = jobs
        else:
            results = [self._result(job) for job in jobs]
            confirmed = [job for job, error in zip(jobs, results, strict=True) if error is None]
        self.confirmed += len(confirmed)
        if self.on_confirmed is not None and confirmed:
            self.on_confirmed(confirmed)
        return results

    def _result(self, job: ClaimedJob) -> PublishError | None:
        if self.routes is not None and job.destination not in self.routes:
            return unroutable(job.destination)
        return None if self.outcome is None else self.outcome(job)
