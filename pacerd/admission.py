"""Admission: the per-destination tick. It runs the I/O in order — read the
destination's shared state, ask the pacer (pure) for a plan, claim up to the
budget, publish across the tick, mark confirmed publishes offered, release the
rest — and persists the pacer so that any instance can continue it.

It decides nothing itself: the rate, the budget, the lane split and the
spacing come from ``pacer.py``. It depends on the small ``AdmissionLedger``
and ``Publisher`` protocols, so the simulation drives this very code over
in-memory fakes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog

from pacerd import pacer
from pacerd.errors import BrokerUnavailable, LedgerError, PacerdError, PublishTimeout

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
    from contextlib import AbstractContextManager

    from pacerd.clock import Clock
    from pacerd.errors import PublishError
    from pacerd.models import ClaimedJob, DestinationRow, JobRef
    from pacerd.publisher import Publisher
    from pacerd.releases import ReleaseSchedule

    PlanFn = Callable[..., tuple[pacer.PacerState, pacer.TickPlan]]
    """A control law: ``pacer.plan_tick``'s signature (the bench swaps in a baseline)."""

log = structlog.get_logger("pacerd.admission")

MAX_SLICES_PER_TICK = 50  # sub-tick pacing granularity: at most 50 release points a tick
MARKS_PER_TICK = 5  # mark-offered statements a tick, off the release schedule
# A tick's release points lie on a grid shifted by up to PHASE_SPAN_SECONDS (at
# most one spacing), by an amount that changes every tick (a golden-ratio
# sequence seeded by instance and destination): senders sharing an upstream do
# not release in lockstep, so which of them finds the upstream's bucket empty
# does not depend on a fixed phase between their ticks. (Two instances with the
# same tick released at the same instants, and the one that came second took
# most refusals for tens of seconds: shares stuck near 60/40.)
PHASE_STEP = (math.sqrt(5.0) - 1.0) / 2.0
PHASE_SPAN_SECONDS = 0.02  # enough to interleave senders, small against a tick
# Publishes awaiting their confirm, at most: enough for the broker's full
# confirm throughput (it is reached near 1,000 in flight), and a release that
# finds no room waits for confirms instead of piling up publishes whose
# confirms then outlast the publish timeout.
MAX_UNCONFIRMED = 1000
# A tick's claim is taken in chunks of at most CLAIM_CHUNK jobs: the first
# release goes out once the first chunk is in, and each next chunk is claimed
# while the jobs before it publish, staying about one chunk ahead. (One
# statement for a 10,000-job budget held every release of the tick back by
# ~200 ms.) A budget within one chunk is one statement, as it always was.
CLAIM_CHUNK = 1000
# The destination's pause and cool-down are looked at again before each
# release slice (at most ~50 PK reads a second while the tick publishes): a
# Retry-After reported mid-tick stops the releases at the next slice.
CLOSED_CHECK_SECONDS = 0.019
# A slow-start tick whose budget is at least pacer.BRAKE_MIN_BUDGET reads its
# own fresh outcome counters at most this often while it releases
# (pacer.brake): its overshoot is cut within the tick, not a tick later.
BRAKE_CHECK_SECONDS = 0.05
# After a tick lost the broker or timed out on confirms, admission skips ticks
# for a backoff (doubling up to the maximum), then probes with one job: a
# blocked or restarting broker is not fed a tick's budget every tick.
BROKER_BACKOFF_MIN_SECONDS = 0.5
BROKER_BACKOFF_MAX_SECONDS = 8.0
# A tick skipped for a cool-down that ends before the next tick is due is
# followed by a reopening tick when it ends (pacer.tick_budget), this long
# after the end the ledger gave (its clock, read a round trip earlier): the
# destination does not stay closed until the next tick after its window.
REOPEN_MARGIN_SECONDS = 0.005
# The skips of a destination that is closed: a reopening may follow them.
CLOSED_SKIPS = frozenset({"paused", "paused_local", "cooldown"})


class AdmissionLedger(Protocol):
    """The ledger operations a tick needs (``ledger.Ledger`` and fakes)."""

    async def read_destination(
        self, destination: str, *, inflight: bool = False
    ) -> DestinationRow | None:
        """The destination's shared state and counters (None: unknown); with
        ``inflight``, its claimed and offered jobs counted with them (the
        row's ``inflight``), as a tick's plan needs both."""
        ...

    async def is_closed(self, destination: str) -> bool:
        """Paused or in a cool-down now (a release slice's check)."""
        ...

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
    ) -> list[ClaimedJob]: ...

    async def mark_offered(
        self, refs: Sequence[JobRef], *, offer_seconds: float
    ) -> list[JobRef]: ...

    async def release_claims(self, refs: Sequence[JobRef], *, reason: str) -> list[JobRef]: ...

    async def save_pacer_state(
        self, destination: str, state: Mapping[str, Any], *, epoch: int
    ) -> None: ...

    async def has_due(self, destination: str, *, at_least: int = 1) -> int:
        """Counts due jobs, up to ``at_least`` (shadow mode's would-admit)."""
        ...


class TickObserver(Protocol):
    """Where a tick's spans and figures go (telemetry; tests record them)."""

    def tick_span(self, destination: str, *, shadow: bool) -> AbstractContextManager[Any]: ...

    def claim_span(self, destination: str, *, limit: int) -> AbstractContextManager[Any]: ...

    def publish_span(
        self, destination: str, jobs: Sequence[ClaimedJob]
    ) -> AbstractContextManager[dict[str, str]]:
        """Around the publish of one release slice; yields the headers carrying
        its trace context (every message of the slice carries them)."""
        ...

    def mark_offered_span(self, destination: str, *, count: int) -> AbstractContextManager[Any]: ...

    def tick_completed(self, result: TickResult) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionConfig:
    destination: str
    queue: str
    params: pacer.PacingParams
    claim_seconds: float = 30.0
    offer_seconds: float = 300.0
    instance: str = "pacerd"
    shadow: bool = False

    def __post_init__(self) -> None:
        if self.claim_seconds <= 0 or self.offer_seconds <= 0:
            raise ValueError("lease durations must be > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class TickResult:
    """What one pass did, for one destination."""

    destination: str
    skipped: str | None = None  # "paused", "paused_local", "cooldown", "broker_down"
    rate: float = 0.0
    budget: int = 0
    live_budget: int = 0
    claimed: int = 0  # in shadow mode: what the tick would have claimed
    offered: int = 0
    released: int = 0
    inflight: int = 0
    accepted: int = 0
    refused: int = 0
    shadow: bool = False
    oldest_due_at: dt.datetime | None = None
    nacked: int = 0  # publishes the broker refused
    returned: int = 0  # publishes the broker returned unroutable
    confirm_timeouts: int = 0  # publishes not confirmed within publish_timeout_seconds
    # From the tick's start until its first release could go: the destination
    # read, the plan and the first claim (the rest of a tick is its releases,
    # spread across it on purpose).
    planning_seconds: float | None = None

    @property
    def refusal_ratio(self) -> float | None:
        total = self.accepted + self.refused
        return self.refused / total if total else None


def rejection_reason(error: PublishError) -> str:
    """``returned`` for a message the broker returned unroutable (the publisher
    words those "unroutable: ..."), ``nacked`` for any other refusal."""
    return "returned" if str(error).startswith("unroutable") else "nacked"


@dataclass(slots=True)
class _Publishing:
    confirmed: list[JobRef] = field(default_factory=list)
    failed: list[JobRef] = field(default_factory=list)
    marked: int = 0
    nacked: int = 0
    returned: int = 0
    timeouts: int = 0
    broker_down: bool = False
    timed_out: bool = False
    stopped: bool = False
    closed: bool = False
    closed_after: float = 0.0  # when closed: seconds after the tick's start it was heard
    claimed: int = 0  # every job the tick claimed (a mid-tick cut claims again)
    cut_released: int = 0  # claims a mid-tick cut gave back unsent
    marking: bool = False  # a mark statement in flight (one at a time)
    mark_at: float = 0.0  # no mark from a slice before this (MARKS_PER_TICK a tick)


@dataclass(frozen=True, slots=True, kw_only=True)
class Begun:
    """A tick planned (``DestinationAdmission.begin``), before its claim."""

    now: float  # the tick's start, when its row was asked for
    window: pacer.OutcomeWindow
    plan: pacer.TickPlan
    skipped: str | None
    inflight: int
    epoch_state: Mapping[str, Any] | None  # a cut: the state to save before the claim
    limit: int  # jobs to claim (0: none)


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """A tick a ``TickPlanner`` read, planned and first claimed together with
    others, for its destination's task to go on with (``ready``)."""

    begun: Begun | None = None  # None: the destination is unknown
    jobs: list[ClaimedJob] | None = None  # the first chunk (None: not claimed)
    planning_seconds: float | None = None
    error: PacerdError | None = None  # the shared statements failed: the tick fails


class _Room:
    """How many more publishes may await their confirm (a weighted semaphore;
    a slice larger than the whole room goes alone)."""

    def __init__(self, size: int) -> None:
        self.size, self.used = size, 0
        self._freed = anyio.Event()

    async def take(self, n: int) -> None:
        while self.used and self.used + n > self.size:
            await self._freed.wait()
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n
        self._freed.set()
        self._freed = anyio.Event()


class _Slices:
    """Publishes a tick's release slices, each in a task of the tick's task
    group, but a task that has published its slice and had its confirms
    serves the next one: a new task starts only when every task is still
    awaiting confirms. A tick whose confirms come back before its next
    slice (the common case) publishes all of its slices in one task, and
    the release schedule never waits for a confirm."""

    def __init__(self, publish: Callable[[Sequence[ClaimedJob]], Awaitable[None]]) -> None:
        self._publish = publish
        self._queue: deque[Sequence[ClaimedJob]] = deque()
        self._idle = 0  # tasks waiting for a slice
        self._more = anyio.Event()
        self._closed = False

    def start(self, tg: anyio.abc.TaskGroup, group: Sequence[ClaimedJob]) -> None:
        """Publishes ``group`` in a task of ``tg``: a waiting one, else a new one."""
        self._queue.append(group)
        if len(self._queue) > self._idle:
            tg.start_soon(self._serve)
        self._wake()

    def close(self) -> None:
        """No more slices: each task ends once the queue is empty."""
        self._closed = True
        self._wake()

    def unsent(self) -> list[JobRef]:
        """The jobs of slices no task took (the tick was cancelled first)."""
        return [job.ref for group in self._queue for job in group]

    def _wake(self) -> None:
        if self._idle:
            self._more.set()
            self._more = anyio.Event()

    async def _serve(self) -> None:
        while True:
            if self._queue:
                await self._publish(self._queue.popleft())
            elif self._closed:
                return
            else:
                self._idle += 1
                try:
                    await self._more.wait()
                finally:
                    self._idle -= 1


class ScheduledTick:
    """A tick whose release slices ``ReleaseSchedule`` publishes
    (``releases.py``): each slice's stop and closed checks, its span, its
    confirms sorted and marked, as the tick's own loop would do them.
    ``done`` is set once every slice is settled: published and sorted, or
    not sent (the tick stopped or closed meanwhile, or lost the broker:
    every slice after that is not sent either)."""

    def __init__(
        self,
        admission: DestinationAdmission,
        outcome: _Publishing,
        slices: Sequence[Sequence[ClaimedJob]],
        *,
        started: float,
    ) -> None:
        self.admission, self.outcome, self.started = admission, outcome, started
        self.pending = dict(enumerate(slices))  # not yet taken by a release
        self.flying: dict[int, Sequence[ClaimedJob]] = {}  # published, awaiting confirms
        self.done = anyio.Event()
        self.next_check = started  # the first release looks: the claim took time
        # the tick's task's context (its tick span): each slice's publish span
        # is a child of it, as when the tick's own tasks published
        self.context = contextvars.copy_context()
        self._mark: anyio.Event | None = None  # set when the last mark started here ended
        if not self.pending:
            self.done.set()

    async def may_release(self, index: int) -> bool:
        if index not in self.pending:
            return False  # ended early, or the tick's task left
        admission, outcome = self.admission, self.outcome
        now = admission.clock.monotonic()
        if now >= self.next_check and not outcome.broker_down:
            self.next_check = now + CLOSED_CHECK_SECONDS
            outcome.closed = await admission._closed_meanwhile()
            if index not in self.pending:
                return False
        stopped = admission.stop is not None and admission.stop.is_set()
        if outcome.closed or stopped or outcome.broker_down:
            if not outcome.broker_down:
                outcome.closed_after = admission.clock.monotonic() - self.started
                outcome.stopped = not outcome.closed
            self._send_no_more()  # this slice and every later one
            return False
        self.flying[index] = self.pending.pop(index)
        return True

    @contextlib.contextmanager
    def publish_span(self, index: int) -> Iterator[Mapping[str, str]]:
        span = self.admission._publish_context(self.flying[index])
        headers = self.context.run(span.__enter__)
        try:
            yield headers
        except BaseException as exc:
            if not self.context.run(span.__exit__, type(exc), exc, exc.__traceback__):
                raise
        else:
            self.context.run(span.__exit__, None, None, None)

    def published(self, index: int, results: Sequence[PublishError | None]) -> None:
        group = self.flying.pop(index, None)
        if group is None:
            return  # the tick's task left meanwhile: its jobs were released
        self.admission._sort_results(group, results, self.outcome)
        outcome = self.outcome
        if outcome.broker_down:
            self._send_no_more()
        idle = self._mark is None or self._mark.is_set()
        if idle and self.admission.clock.monotonic() >= outcome.mark_at:
            releases = self.admission.releases
            assert releases is not None
            self._mark = anyio.Event()
            releases.start_soon(partial(self._mark_offered, self._mark))
        self._check_done()

    async def _mark_offered(self, ended: anyio.Event) -> None:
        """A mark after a slice's confirms, in the schedule's task group
        (off the release schedule, as a slice task's own mark)."""
        try:
            await self.admission._mark_when_due(self.outcome)
        finally:
            ended.set()

    async def marks_settled(self) -> None:
        """Until the mark started after a slice, if one runs, has ended: the
        tick's last mark then takes what is left, never the same jobs twice."""
        if self._mark is not None:
            await self._mark.wait()

    def lost(self, index: int) -> None:
        group = self.flying.pop(index, None)
        if group is not None:
            self.outcome.failed.extend(job.ref for job in group)
        self._check_done()

    def leave(self) -> None:
        """The tick's task leaves (cancelled: its leadership lost, or the
        grace ended): every slice not settled is not sent, or is sent and
        released anyway, as a cancelled slice task's; none goes out later."""
        for group in (*self.pending.values(), *self.flying.values()):
            self.outcome.failed.extend(job.ref for job in group)
        self.pending.clear()
        self.flying.clear()
        self.done.set()

    def _send_no_more(self) -> None:
        for group in self.pending.values():
            self.outcome.failed.extend(job.ref for job in group)
        self.pending.clear()
        self._check_done()

    def _check_done(self) -> None:
        if not self.pending and not self.flying:
            self.done.set()


class _Claims:
    """A tick's claim, in chunks of at most ``CLAIM_CHUNK`` jobs (live ones
    first within each). ``jobs`` grows as chunks come in; ``done`` once the
    limit is reached, a chunk comes short (the backlog ran out), a later
    chunk failed (the tick publishes what it has) or the tick stopped
    claiming."""

    def __init__(
        self,
        claim: Callable[[int, int], Awaitable[list[ClaimedJob]]],
        *,
        limit: int,
        live_limit: int,
    ) -> None:
        self._claim = claim  # (live_limit, limit) -> jobs
        self.limit = limit
        self.live_left = live_limit
        self.jobs: list[ClaimedJob] = []
        self.done = limit <= 0
        self.claiming = False
        self._changed = anyio.Event()

    def take(self, jobs: list[ClaimedJob], *, size: int) -> None:
        """The first chunk, claimed elsewhere (a ``TickPlanner``) for ``size`` jobs."""
        self._took(jobs, size)

    async def next_chunk(self) -> None:
        """Claims the next chunk (the tick's first: a failure fails the tick)."""
        self.claiming = True
        await self._chunk()

    def claim_ahead(self, tg: anyio.abc.TaskGroup, end: int) -> None:
        """Starts claiming the next chunk in ``tg`` if less than one chunk is
        claimed beyond the slice ending at ``end`` and none is in flight."""
        if self.done or self.claiming or len(self.jobs) >= end + CLAIM_CHUNK:
            return
        self.claiming = True  # now, so that no second chunk starts meanwhile
        tg.start_soon(self._later_chunk)

    async def wait_for(self, end: int) -> None:
        """Until ``jobs`` reaches ``end`` or no more will come."""
        while len(self.jobs) < end and not self.done:
            if self.claiming:
                await self._changed.wait()
            else:
                self.claiming = True
                await self._later_chunk()

    async def _later_chunk(self) -> None:
        """A chunk after the first: a ledger failure ends the claim, not the
        tick (what was claimed is published; the next tick meets the ledger)."""
        try:
            await self._chunk()
        except LedgerError as exc:
            log.warning("claim_stopped", claimed=len(self.jobs), error=str(exc))
            self.done = True

    async def _chunk(self) -> None:
        size = min(CLAIM_CHUNK, self.limit - len(self.jobs))
        try:
            self._took(await self._claim(min(self.live_left, size), size), size)
        finally:
            self.claiming = False
            self._changed.set()
            self._changed = anyio.Event()

    def _took(self, got: list[ClaimedJob], size: int) -> None:
        got.sort(key=lambda job: not job.live)  # live first, order kept
        self.jobs.extend(got)
        self.live_left -= sum(job.live for job in got)
        if len(got) < size or len(self.jobs) >= self.limit:
            self.done = True

    def stop(self) -> None:
        """No more chunks (one in flight completes)."""
        self.done = True

    async def settle(self) -> None:
        """No more chunks, and none in flight: ``jobs`` is final."""
        self.done = True
        while self.claiming:
            await self._changed.wait()


def counters_window(
    row: DestinationRow, previous: DestinationRow | None, *, interval_seconds: float
) -> pacer.OutcomeWindow:
    """The outcomes reported since the previous tick, from the ledger's
    monotonic per-destination counters (reports from any instance or SQL)."""
    if previous is None:
        return pacer.OutcomeWindow(interval_seconds=interval_seconds)
    retry_after = None
    if row.n_retry_after > previous.n_retry_after:
        retry_after = row.cooldown_remaining_seconds
    return pacer.OutcomeWindow(
        accepted=max(0, row.n_accepted - previous.n_accepted),
        refused=max(0, row.n_refused - previous.n_refused),
        accepted_fresh=max(0, row.n_accepted_fresh - previous.n_accepted_fresh),
        refused_fresh=max(0, row.n_refused_fresh - previous.n_refused_fresh),
        retry_after_s=retry_after,
        interval_seconds=interval_seconds,
    )


class DestinationAdmission:
    """The tick of one destination, on the instance that leads it."""

    def __init__(
        self,
        *,
        ledger: AdmissionLedger,
        publisher: Publisher,
        clock: Clock,
        config: AdmissionConfig,
        observer: TickObserver | None = None,
        is_paused_locally: Callable[[], bool] = lambda: False,
        law: PlanFn = pacer.plan_tick,
        anchor: float | None = None,
        releases: ReleaseSchedule | None = None,
    ) -> None:
        self.ledger = ledger
        self.publisher = publisher
        self.clock = clock
        self.config = config
        self.observer = observer
        self.is_paused_locally = is_paused_locally
        self.law = law
        # Ticks fall on ``anchor + k * tick_seconds`` (the tick loop's schedule,
        # shared by every destination) rather than on the first tick's time.
        self.anchor = anchor
        # Where the slices of a tick planned whole at its start are published
        # (the tick loop's; None: every tick publishes its own)
        self.releases = releases
        self.state: pacer.PacerState | None = None
        self.next_deadline: float | None = None  # the last plan's, for run_destination
        self._previous_row: DestinationRow | None = None
        self._window_since = 0.0  # when _previous_row was read (the next window's start)
        self._demand: pacer.Demand | None = None
        self._broker_backoff = 0.0
        self._broker_retry_at: float | None = None
        self.stop: anyio.Event | None = None
        self._reset_requested = False
        # The last tick found the destination closed (paused or cooling down):
        # ``reopens_at`` is when its cool-down ends (monotonic; None when
        # paused), ``woken`` that it opened since and the next tick reopens.
        self.closed = False
        self.reopens_at: float | None = None
        self.woken = False
        self.sleeping: anyio.CancelScope | None = None  # run_destination's, between ticks
        self.ready: Planned | None = None  # the next tick, prepared by a TickPlanner
        seed = zlib.crc32(f"{config.instance}/{config.destination}".encode())
        self._phase = seed / 2**32

    def reset(self) -> None:
        """Forget local state (on losing leadership): the next leader, or this
        instance later, resumes from what the ledger holds. Takes effect at
        the start of the next tick, never in the middle of one."""
        self._reset_requested = True
        self.next_deadline = None

    def wake(self) -> bool:
        """The destination opened since its last tick found it closed (a
        resume): its next tick runs at once, as a reopening. Whether it was
        closed (else nothing changes)."""
        if self.closed:
            self.woken = True
            self.interrupt()
        return self.closed

    def interrupt(self) -> None:
        """Ends ``run_destination``'s sleep between ticks now (if it sleeps)."""
        if self.sleeping is not None:
            self.sleeping.cancel()

    def forget_window(self) -> None:
        """After a failed tick: keep the pacer (its rate and cut stand; what
        the tick claimed and published is still charged to it), but measure
        the next window afresh and claim no demand for the failed tick."""
        self._previous_row, self._demand, self.next_deadline = None, None, None

    def update_config(self, config: AdmissionConfig) -> None:
        self.config = config

    def _load_state(self, row: DestinationRow, now: float) -> pacer.PacerState:
        params = self.config.params
        persisted = (row.pacer_state or {}).get("pacer")
        if isinstance(persisted, dict):
            try:
                return pacer.PacerState.from_dict(persisted, now=now, params=params)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("pacer_state_unreadable", destination=row.destination, error=str(exc))
        return pacer.initial_state(params, now=now)

    async def run_once(self) -> TickResult:
        """One tick of this destination (inside the observer's tick span): the
        one a ``TickPlanner`` prepared for it (``ready``), else one that reads
        and claims for itself."""
        if self.observer is None:
            return await self._tick()
        with self.observer.tick_span(self.config.destination, shadow=self.config.shadow):
            return await self._tick()

    def begin(self, row: DestinationRow | None, now: float) -> Begun | None:
        """A tick's plan from its destination's ``row`` read at ``now`` (None:
        the destination is unknown); pure but for this admission's own state,
        which it moves on. The caller then saves ``epoch_state`` (a cut) and
        claims ``limit`` jobs, before ``_finish``."""
        cfg = self.config
        if self._reset_requested:
            self._reset_requested = False
            self.state, self._previous_row, self._demand = None, None, None
            self._broker_backoff, self._broker_retry_at = 0.0, None
        self.next_deadline = None
        reopening, self.woken = self.woken and self.state is not None, False
        if row is None:
            return None
        if row.inflight is None:
            raise LedgerError(f"{cfg.destination}: the ledger read no in-flight count")
        inflight = row.inflight
        if self.state is not None:
            state = self.state
        else:
            state = self._load_state(row, now)
            if self.anchor is not None:
                tick = cfg.params.tick_seconds
                state = state._replace(deadline=pacer.join_schedule(self.anchor, now, tick))
        previous, self._previous_row = self._previous_row, row
        since = self._window_since if previous is not None else state.last_tick
        self._window_since = now
        window = counters_window(row, previous, interval_seconds=max(0.0, now - since))
        skipped = None
        if self.is_paused_locally():
            skipped = "paused_local"
        elif row.effectively_paused:
            skipped = "paused"
        elif self._broker_retry_at is not None and now < self._broker_retry_at:
            skipped = "broker_down"
        state, plan = self.law(
            state,
            window,
            self._demand,
            now=now,
            inflight=inflight,
            params=cfg.params,
            cooldown_remaining_s=row.cooldown_remaining_seconds,
            paused=skipped is not None,
            reopening=reopening,
        )
        self.state = state
        self.next_deadline = plan.next_deadline
        epoch_state = None
        if state.epoch > row.epoch:
            # A cut: the ledger's epoch moves now, not at the end of the tick, so
            # that reports arriving meanwhile for jobs claimed before it count
            # as stale and do not cut again.
            epoch_state = {**(row.pacer_state or {}), "pacer": state.to_dict()}
        if skipped is None and plan.cooldown:
            skipped = "cooldown"
        self.closed = skipped in CLOSED_SKIPS
        self.reopens_at = None
        if skipped == "cooldown" and row.cooldown_remaining_seconds > 0:
            read = self.clock.monotonic()  # the ledger's clock said so after this
            self.reopens_at = read + row.cooldown_remaining_seconds + REOPEN_MARGIN_SECONDS
        limit = 0
        if skipped is None and plan.budget > 0 and not cfg.shadow:
            probing = self._broker_retry_at is not None  # one job, to see the broker take it
            limit = 1 if probing else plan.budget
        return Begun(
            now=now, window=window, plan=plan, skipped=skipped, inflight=inflight,
            epoch_state=epoch_state, limit=limit,
        )  # fmt: skip

    @property
    def epoch(self) -> int:
        """The pacer's epoch (once a tick has begun)."""
        assert self.state is not None
        return self.state.epoch

    async def drop_ready(self) -> None:
        """Releases what a planned tick that will not run had claimed (its
        task is leaving, or no longer leads)."""
        ready, self.ready = self.ready, None
        if ready is None or not ready.jobs:
            return
        with anyio.CancelScope(shield=True):
            try:
                await self.ledger.release_claims([job.ref for job in ready.jobs], reason="shutdown")
            except LedgerError as exc:  # the claim lease returns them
                log.warning("release_failed", count=len(ready.jobs), error=str(exc))

    def first_chunk(self, begun: Begun) -> tuple[int, int]:
        """(live limit, limit) of the first claim statement of ``begun``."""
        size = min(CLAIM_CHUNK, begun.limit)
        return min(begun.plan.live_budget, size), size

    async def _tick(self) -> TickResult:
        cfg = self.config
        dest = cfg.destination
        ready, self.ready = self.ready, None
        if ready is not None:  # read, planned and first claimed with others
            if ready.error is not None:
                self.next_deadline = None
                raise ready.error
            if ready.begun is None:
                return TickResult(destination=dest, skipped="unknown")
            begun = ready.begun
        else:
            now = self.clock.monotonic()
            self.next_deadline = None  # a failed read: the next tick on the schedule
            row = await self.ledger.read_destination(dest, inflight=True)
            maybe = self.begin(row, now)
            if maybe is None:
                return TickResult(destination=dest, skipped="unknown")
            begun = maybe
            if begun.epoch_state is not None:
                await self.ledger.save_pacer_state(dest, begun.epoch_state, epoch=self.epoch)
        return await self._finish(begun, ready)

    async def _finish(self, begun: Begun, ready: Planned | None) -> TickResult:
        cfg = self.config
        dest = cfg.destination
        now, plan, skipped = begun.now, begun.plan, begun.skipped
        claimed: list[ClaimedJob] = []
        outcome = _Publishing()
        would_admit = 0
        planned = self.clock.monotonic() - now if ready is None else ready.planning_seconds
        if skipped is None and plan.budget > 0 and cfg.shadow:
            # Shadow mode: every decision is computed and reported; nothing is claimed.
            would_admit = await self.ledger.has_due(dest, at_least=plan.budget)
        elif begun.limit > 0:
            claims = _Claims(self._claim_chunk, limit=begun.limit, live_limit=plan.live_budget)
            if ready is not None and ready.jobs is not None:
                claims.take(ready.jobs, size=self.first_chunk(begun)[1])
            else:
                await claims.next_chunk()  # a failure here fails the tick; later ones end the claim
                planned = self.clock.monotonic() - now
            claimed = claims.jobs
            if claimed:
                outcome = await self._publish_spread(
                    claims, plan, started=now, inflight=begun.inflight
                )
                self._after_publishing(outcome)
        state = self.state  # a brake may have cut the rate mid-tick
        assert state is not None
        admitted = would_admit if cfg.shadow else max(len(claimed), outcome.claimed)
        self._demand = pacer.Demand(
            budget=plan.budget if skipped is None else 0,
            admitted=admitted,
            backlog_empty=admitted < plan.budget,
            inflight_capped=plan.inflight_capped,
            open_seconds=outcome.closed_after if outcome.closed else None,
            sent=len(outcome.confirmed),
        )
        result = TickResult(
            destination=dest,
            skipped=skipped or ("broker_down" if outcome.broker_down else None),
            rate=state.rate,
            budget=plan.budget,
            live_budget=plan.live_budget,
            claimed=admitted,
            offered=len(outcome.confirmed),
            released=len(outcome.failed) + outcome.cut_released,
            inflight=begun.inflight,
            accepted=begun.window.accepted,
            refused=begun.window.refused,
            shadow=cfg.shadow,
            nacked=outcome.nacked,
            returned=outcome.returned,
            confirm_timeouts=outcome.timeouts,
            planning_seconds=planned,
        )
        await self.ledger.save_pacer_state(
            dest,
            {
                "pacer": state.to_dict(),
                "tick": {
                    "rate": state.rate,
                    "budget": plan.budget,
                    "admitted": len(outcome.confirmed),
                    "inflight": begun.inflight,
                    "refusal_ratio": result.refusal_ratio,
                    "skipped": result.skipped,
                    "by": cfg.instance,
                },
            },
            epoch=state.epoch,
        )
        if self.observer is not None:
            self.observer.tick_completed(result)
        return result

    async def _claim_chunk(self, live_limit: int, limit: int) -> list[ClaimedJob]:
        """One claim statement of the tick (``_Claims`` sizes it)."""
        cfg = self.config
        assert self.state is not None
        with self._span("claim", cfg.destination, limit=limit):
            return await self.ledger.claim_due(
                cfg.destination,
                live_limit=min(live_limit, limit),
                limit=limit,
                claim_seconds=cfg.claim_seconds,
                epoch=self.state.epoch,
                live_window_seconds=cfg.params.live_window_seconds,
                instance=cfg.instance,
            )

    def _span(self, name: str, destination: str, **attributes: int) -> AbstractContextManager[Any]:
        if self.observer is None:
            return nullcontext()
        if name == "claim":
            return self.observer.claim_span(destination, limit=attributes["limit"])
        return self.observer.mark_offered_span(destination, count=attributes["count"])

    async def _publish_spread(
        self, claims: _Claims, plan: pacer.TickPlan, *, started: float, inflight: int
    ) -> _Publishing:
        """Publishes the tick's claimed jobs across the tick at the pacer's
        offsets from the tick's start (live ones first), in at most
        ``MAX_SLICES_PER_TICK`` release slices, each one ``publish_many`` with
        its confirms pipelined, in a task that a slice settled before the
        next one's release point hands on (``_Slices``); a slice due while
        the claim ran goes at once.
        ``claims`` holds the first chunk; the next ones are claimed as the
        slices go out (``CLAIM_CHUNK``), and the offsets are laid out for
        the whole limit while chunks keep coming full. The release points lie
        on a grid shifted every tick (``PHASE_STEP``). Confirmed jobs are
        marked offered up to ``MARKS_PER_TICK`` times a tick, off the release
        schedule (a slow mark never delays a release): after a slice's
        confirms when the last mark is old enough, and at the tick's end
        (no task or timer of their own). Stops early on
        shutdown or when the destination closes mid-tick (a Retry-After or a
        pause reported meanwhile), and releases every claimed job it did not
        publish (cancelled too: the tick's leadership lost)."""
        outcome = _Publishing()
        first = claims.jobs
        expected = len(first) if claims.done else claims.limit
        offsets = pacer.publish_offsets(plan, sum(job.live for job in first), expected)
        tick = self.config.params.tick_seconds
        grain = tick / MAX_SLICES_PER_TICK
        self._phase = (self._phase + PHASE_STEP) % 1.0
        shift = self._phase * min(grain, PHASE_SPAN_SECONDS)

        def on_grid(offsets: Sequence[float], first: int) -> list[tuple[float, int]]:
            """(release point, end index) of each slice: the points on the tick's
            shifted grid, never before the pacer's offset of their jobs."""
            out: list[tuple[float, int]] = []
            for index, offset in enumerate(offsets, start=first):
                at = shift + math.ceil((offset - shift) / grain - 1e-9) * grain
                if out and out[-1][0] == at:
                    out[-1] = (at, index + 1)
                else:
                    out.append((at, index + 1))
            return out

        slices = on_grid(offsets, 0)
        span = plan.spacing_seconds * max(plan.budget, 1)  # the tick's releases end by then
        # the last reading before any fresh refusal of the tick (None: not
        # watched: a long round trip past slow start, or a budget too small)
        assert self.state is not None
        params = self.config.params
        watched = plan.budget >= pacer.BRAKE_MIN_BUDGET and pacer.watches(
            self.state, params, inflight=inflight
        )
        clean = self._previous_row if watched else None
        outcome.mark_at = self.clock.monotonic() + tick / MARKS_PER_TICK
        releases = self.releases
        if (
            releases is not None
            and releases.running
            and clean is None
            and claims.done
            and len(claims.jobs) <= MAX_UNCONFIRMED
        ):  # its slices are known now, and no brake reshapes them
            return await self._publish_scheduled(releases, claims, slices, outcome, started)
        clean_at = self._window_since  # when ``clean`` was read
        next_brake = started + BRAKE_CHECK_SECONDS
        next_check = started  # the first release looks: the claim and the shift took time
        room = _Room(MAX_UNCONFIRMED)
        sent = 0  # claims.jobs[:sent] went to a slice (which settles them)
        earlier = 0  # jobs claimed before a mid-tick cut claimed again
        publishing = _Slices(partial(self._publish_slice, outcome=outcome, room=room))

        try:
            async with anyio.create_task_group() as tg:
                i = 0
                while i < len(slices):
                    at, end = slices[i]
                    i += 1
                    claims.claim_ahead(tg, end)
                    await self.clock.sleep_until(started + at)
                    await claims.wait_for(end)
                    group = claims.jobs[sent:end]
                    if not group:
                        break  # the claim came short: the backlog ran out
                    if self.clock.monotonic() >= next_check:
                        next_check = self.clock.monotonic() + CLOSED_CHECK_SECONDS
                        outcome.closed = await self._closed_meanwhile()
                    if outcome.closed or (self.stop is not None and self.stop.is_set()):
                        outcome.closed_after = self.clock.monotonic() - started
                        outcome.stopped = not outcome.closed
                        break
                    if clean is not None and self.clock.monotonic() >= next_brake:
                        next_brake = self.clock.monotonic() + BRAKE_CHECK_SECONDS
                        # the outcomes heard left about a check's interval ago
                        heard = self.clock.monotonic() - started - BRAKE_CHECK_SECONDS
                        clean, clean_at, cut = await self._brake(
                            clean, since=clean_at, sent=pacer.ramp_rate(plan, heard)
                        )
                        if cut:
                            # The claims not yet sent go back and the rest of the
                            # tick is claimed afresh at the cut's epoch, evenly
                            # over what is left at the new rate: their outcomes
                            # are the evidence of the new rate (a later brake
                            # needs them: one cut per round trip).
                            done = self.clock.monotonic() - started
                            assert self.state is not None
                            n = max(0, math.floor(self.state.rate * max(0.0, span - done)))
                            live = min(n, math.ceil(self.config.params.live_share * n))
                            await claims.settle()  # no chunk in flight: jobs is final
                            earlier += len(claims.jobs)
                            outcome.cut_released += len(claims.jobs) - sent
                            claims = await self._claim_again(claims, sent, n, live)
                            sent, i = 0, 0
                            slices = on_grid([done + k * (span - done) / n for k in range(n)], 0)
                            # released evenly at the cut's rate from now on: the
                            # next brake measures that rate, not the plan's ramp
                            plan = replace(plan, rate=self.state.rate, ramp=1.0)
                            if not pacer.watches(self.state, params, inflight=inflight):
                                clean = None  # past slow start, on a long round trip
                            continue
                    await room.take(len(group))
                    sent += len(group)
                    publishing.start(tg, group)
                publishing.close()  # its tasks end once their slices are settled
        finally:
            # a chunk in flight when the loop ended completed inside the task
            # group: its jobs, and every other one not sent, are released below
            claims.stop()
            outcome.claimed = earlier + len(claims.jobs)
            outcome.failed.extend(job.ref for job in claims.jobs[sent:])
            outcome.failed.extend(publishing.unsent())
            await self._end_releases(outcome)
        return outcome

    async def _publish_scheduled(
        self,
        releases: ReleaseSchedule,
        claims: _Claims,
        slices: Sequence[tuple[float, int]],
        outcome: _Publishing,
        started: float,
    ) -> _Publishing:
        """``_publish_spread`` for a tick claimed whole and not watched by a
        brake: its slices go to the tick loop's release schedule, and this
        task wakes once, when they are all settled (``ScheduledTick``)."""
        points: list[tuple[float, Sequence[ClaimedJob]]] = []
        begin = 0
        for at, end in slices:
            points.append((started + at, claims.jobs[begin:end]))
            begin = end
        tick = ScheduledTick(self, outcome, [group for _, group in points], started=started)
        releases.add(tick, points)
        try:
            await tick.done.wait()
        finally:
            tick.leave()  # cancelled: nothing of it goes out later
            outcome.claimed = len(claims.jobs)
            with anyio.CancelScope(shield=True):
                await tick.marks_settled()
            await self._end_releases(outcome)
        return outcome

    async def _end_releases(self, outcome: _Publishing) -> None:
        """A tick's releases are over: marks what was confirmed and releases
        what was not sent (shielded: a cancelled tick too)."""
        with anyio.CancelScope(shield=True):
            await self._flush_confirmed(outcome, final=True)
            if outcome.failed:
                reason = (
                    "broker_unavailable"
                    if outcome.broker_down
                    else "shutdown"
                    if outcome.stopped
                    else "destination_closed"
                    if outcome.closed
                    else "publish_failed"
                )
                await self.ledger.release_claims(outcome.failed, reason=reason)

    async def _claim_again(
        self, claims: _Claims, sent: int, limit: int, live_limit: int
    ) -> _Claims:
        """After a mid-tick cut: releases the claims of ``claims`` (settled)
        not yet sent and claims up to ``limit`` jobs anew (at the cut's epoch). A
        ledger failure ends the tick's releases; what could not be released
        returns at its claim lease's end."""
        rest = [job.ref for job in claims.jobs[sent:]]
        fresh = _Claims(self._claim_chunk, limit=limit, live_limit=live_limit)
        try:
            if rest:
                await self.ledger.release_claims(rest, reason="rate_cut")
            if limit > 0:
                await fresh.next_chunk()
        except LedgerError as exc:
            log.warning("claim_stopped", destination=self.config.destination, error=str(exc))
            fresh.stop()
        return fresh

    async def _brake(
        self, clean: DestinationRow, *, since: float, sent: float
    ) -> tuple[DestinationRow, float, bool]:
        """Mid-tick: whether the fresh outcomes heard since ``clean`` (the
        last reading before any fresh refusal since the tick began or the last
        cut, read at ``since``, so that they measure the upstream since it
        began refusing) made the pacer cut the rate (``pacer.brake``, ``sent``
        the rate the tick released them at), with the reading to count from
        next time and when it was read. A cut is persisted at once, with its
        epoch, as at a tick's start; the next tick's window starts there. A
        ledger that cannot answer changes nothing."""
        cfg = self.config
        assert self.state is not None
        try:
            row = await self.ledger.read_destination(cfg.destination)
        except LedgerError:
            return clean, since, False
        now = self.clock.monotonic()
        if row is None:
            return clean, since, False
        if row.n_refused_fresh == clean.n_refused_fresh:
            return row, now, False
        window = counters_window(row, clean, interval_seconds=now - since)
        cut = pacer.brake(self.state, window, cfg.params, sent=sent)
        if cut is None:
            return clean, since, False
        self.state = cut
        self._previous_row, self._window_since = row, now
        persisted = {**(row.pacer_state or {}), "pacer": cut.to_dict()}
        try:
            await self.ledger.save_pacer_state(cfg.destination, persisted, epoch=cut.epoch)
        except LedgerError as exc:
            log.warning("brake_not_saved", destination=cfg.destination, error=str(exc))
        log.debug(
            "rate_braked",
            destination=cfg.destination,
            rate=round(cut.rate, 3),
            refused=window.refused_fresh,
            outcomes=window.accepted_fresh + window.refused_fresh,
        )
        return row, now, True

    async def _closed_meanwhile(self) -> bool:
        """Whether the destination closed since the claim (a pause, or a
        Retry-After reported meanwhile), or the ledger cannot say: with the
        ledger gone, publishes could not be marked offered, so the tick stops
        releasing (what it cannot release returns at the claim lease's end)."""
        try:
            return await self.ledger.is_closed(self.config.destination)
        except LedgerError as exc:
            log.warning("tick_stopped", destination=self.config.destination, error=str(exc))
            return True

    async def _publish_slice(
        self, group: Sequence[ClaimedJob], outcome: _Publishing, room: _Room
    ) -> None:
        """Publishes one release slice and sorts its jobs into confirmed and
        failed (cancelled: all failed, released by the caller)."""
        try:
            if outcome.broker_down:
                outcome.failed.extend(job.ref for job in group)
                return
            with self._publish_context(group) as headers:
                results = await self.publisher.publish_many(group, [headers] * len(group))
        except BaseException:
            outcome.failed.extend(job.ref for job in group)
            raise
        finally:
            room.give(len(group))
        self._sort_results(group, results, outcome)
        await self._mark_when_due(outcome)

    def _publish_context(
        self, group: Sequence[ClaimedJob]
    ) -> AbstractContextManager[Mapping[str, str]]:
        """Around the publish of one release slice: the headers its messages carry."""
        if self.observer is None:
            return nullcontext({})
        return self.observer.publish_span(self.config.destination, group)

    def _sort_results(
        self,
        group: Sequence[ClaimedJob],
        results: Sequence[PublishError | None],
        outcome: _Publishing,
    ) -> None:
        """Sorts one release slice's jobs into confirmed and failed."""
        first_error: PublishError | None = None
        rejected = 0
        for job, error in zip(group, results, strict=True):
            if error is None:
                outcome.confirmed.append(job.ref)
                continue
            outcome.failed.append(job.ref)
            if isinstance(error, BrokerUnavailable):
                outcome.broker_down = True
            elif isinstance(error, PublishTimeout):
                outcome.timed_out = True
                outcome.timeouts += 1
            else:
                rejected += 1
                if rejection_reason(error) == "returned":
                    outcome.returned += 1
                else:
                    outcome.nacked += 1
                first_error = first_error or error
        if first_error is not None:
            log.warning(
                "publish_failed",
                destination=self.config.destination,
                count=rejected,
                error=str(first_error),
            )

    async def _mark_when_due(self, outcome: _Publishing) -> None:
        """After a slice's confirms: marks what is confirmed and not yet
        marked, unless a mark is in flight or the last one was less than
        ``tick / MARKS_PER_TICK`` ago (the tick's end marks the rest). It
        runs in the slice's task, off the release schedule: a slow mark never
        delays a release."""
        if outcome.marking or self.clock.monotonic() < outcome.mark_at:
            return
        outcome.marking = True
        try:
            await self._flush_confirmed(outcome)
        finally:
            outcome.marking = False
            tick = self.config.params.tick_seconds
            outcome.mark_at = self.clock.monotonic() + tick / MARKS_PER_TICK

    def _after_publishing(self, outcome: _Publishing) -> None:
        """Backs off the broker after a tick that lost it or timed out on its
        confirms (the next ticks are skipped, then one job probes it); a tick
        whose publishes were all confirmed ends the backoff."""
        if outcome.broker_down or outcome.timed_out:
            self._broker_backoff = min(
                BROKER_BACKOFF_MAX_SECONDS,
                max(BROKER_BACKOFF_MIN_SECONDS, 2 * self._broker_backoff),
            )
            self._broker_retry_at = self.clock.monotonic() + self._broker_backoff
            log.warning(
                "broker_backoff",
                destination=self.config.destination,
                seconds=self._broker_backoff,
                cause="unavailable" if outcome.broker_down else "confirm_timeout",
            )
        elif outcome.confirmed and self._broker_retry_at is not None:
            self._broker_backoff, self._broker_retry_at = 0.0, None
            log.info("broker_recovered", destination=self.config.destination)

    async def _flush_confirmed(self, outcome: _Publishing, *, final: bool = False) -> None:
        """Marks the confirmations received since the last flush offered. If
        the ledger fails here, the claims stay leased and the reconciler
        returns them when the claim lease expires, without spending an attempt."""
        fresh = outcome.confirmed[outcome.marked :]
        if not fresh:
            return
        try:
            with self._span("mark_offered", self.config.destination, count=len(fresh)):
                await self.ledger.mark_offered(fresh, offer_seconds=self.config.offer_seconds)
        except LedgerError as exc:
            log.warning("mark_offered_failed", count=len(fresh), error=str(exc))
            if final:
                raise
            return
        outcome.marked += len(fresh)


async def run_destination(
    admission: DestinationAdmission,
    *,
    leads: Callable[[], bool] = lambda: True,
    stop: anyio.Event | None = None,
    on_pass: Callable[[], None] | None = None,
    until: Callable[[TickResult | None], Awaitable[bool]] | None = None,
    sleep_until: Callable[[float], Awaitable[None]] | None = None,
    wait_planned: Callable[[float], Awaitable[None]] | None = None,
) -> None:
    """Runs ticks on the pacer's schedule (each plan's ``next_deadline``: a
    tick that ends late is followed at once by the next, whose budget and
    spacing the pacer sizes for the time to the schedule's next point at
    least half a tick away; ticks missed entirely are skipped, not
    replayed). A ``PacerdError`` in a pass is logged, the pacer is kept and
    the loop continues; anything else ends the process. ``stop`` ends the
    loop after the current tick (whose unpublished claims are released).
    ``until`` gets each pass's result (None when the pass did not tick, or
    failed) and ends the loop by returning True. ``sleep_until`` sleeps
    between ticks and returns early once ``stop`` is set (by default
    ``sleep_until_or_stop``; the tick loop cuts all of its destinations'
    sleeps short itself, with no task per sleep, through
    ``admission.interrupt``). ``admission.wake`` ends a sleep too.
    ``wait_planned`` (a ``TickPlanner``'s) replaces the sleep until each
    next tick on the schedule: the tick comes back read, planned and first
    claimed (``admission.ready``); the first tick, a reopening and a tick
    woken early read and claim for themselves."""
    clock = admission.clock
    stop = stop or anyio.Event()
    admission.stop = stop
    if sleep_until is None:

        async def sleep_until(deadline: float) -> None:
            await sleep_until_or_stop(clock, deadline, stop)

    async def sleep(deadline: float, *, planned: bool = False) -> None:
        if admission.woken or stop.is_set():
            return
        with anyio.CancelScope() as scope:
            admission.sleeping = scope
            try:
                if planned and wait_planned is not None:
                    await wait_planned(deadline)
                else:
                    await sleep_until(deadline)
            finally:
                admission.sleeping = None

    deadline = clock.monotonic()
    while not stop.is_set():
        result: TickResult | None = None
        if leads():
            try:
                result = await admission.run_once()
            except* PacerdError as failed:  # raised by the tick, or by a task inside it
                errors = "; ".join(str(exc) for exc in failed.exceptions)
                log.warning("tick_failed", destination=admission.config.destination, error=errors)
                admission.forget_window()
        else:
            await admission.drop_ready()
            admission.reset()
        if on_pass is not None:
            on_pass()
        if until is not None and await until(result):
            return
        tick = admission.config.params.tick_seconds
        if admission.next_deadline is not None:
            deadline = admission.next_deadline
        else:
            deadline = pacer.next_deadline(deadline, clock.monotonic(), tick)
        reopens = admission.reopens_at
        if reopens is not None and reopens < deadline:
            # a cool-down that ends before the next tick: reopen when it ends
            await sleep(reopens)
            if clock.monotonic() < deadline:
                admission.wake()
            continue
        await sleep(deadline, planned=True)


async def sleep_until_or_stop(clock: Clock, deadline: float, stop: anyio.Event) -> None:
    """Sleeps until ``deadline`` on ``clock``, or until ``stop`` is set."""
    if stop.is_set():
        return
    async with anyio.create_task_group() as tg:

        async def stopper() -> None:
            await stop.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(stopper)
        await clock.sleep_until(deadline)
        tg.cancel_scope.cancel()
