"""The model world of the deterministic simulation: everything but pacerd.

``simdriver.run`` drives pacerd's real admission (``DestinationAdmission`` and
``run_destination`` from ``pacerd.admission``, with the real pacer) in
virtual time over in-memory fakes; this module is what those fakes stand on,
synchronous and seeded:

- a model **upstream**: a token bucket refilled at a scripted capacity C(t)
  (piecewise constant, jobs/s) holding at most ``burst_seconds x C(t)``
  tokens; a call that finds no token is refused (429), optionally with a
  Retry-After: with ``retry_after`` every refusal advertises the wait for the
  next token in whole seconds, at least 1 (as ``pacerd.testing.upstream``
  does, the model the real runs and the demo call). In *penalty* mode an
  overshoot closes the upstream for ``penalty_seconds``: every call is
  refused, advertising the time left; the overshoot is the first refusal, or,
  with ``penalty_threshold``, more refusals within a second than that share
  of the capacity (at least 1), as the real model counts them;
- a **worker pool** per instance: a published job reaches the upstream after
  a small broker delay (when a worker is free), holds the worker for a seeded
  lognormal latency (median 200 ms) and its outcome reaches the ledger after a
  seeded lognormal report delay; a refusal takes the latency too, or, with
  ``refusal_latency`` off, is answered at once as the model upstream answers
  it (its worker is still held for the drawn latency: with 200 workers the
  pool is never what binds); with ``stall_every_s``, the delivery path
  *stalls* now and then (a Poisson process of that mean interval, each
  stall ``stall_seconds`` long): a job that would reach the upstream during
  a stall reaches it at the stall's end, with every other one held by it —
  the bunch a busy machine makes of the calls when a broker, a worker or
  its event loop stops for a moment and catches up;
- a **ledger** per destination (``SimLedger``): the jobs' states, the due
  backlog ordered by ``next_attempt_at`` (an endless or a finite overdue
  backlog, live jobs arriving as a Poisson process), the claim with its live
  and backlog lanes as ``claim_due`` in ``pacerd/sql/queries.sql`` makes it,
  the fenced mark-offered / release / report transitions of the SQL (a
  refused job goes back keeping its place, or no earlier than its
  Retry-After, which also closes the destination), the epoch stamped on each
  claim (a report is fresh when its job's epoch is at least the
  destination's), the monotonic outcome counters and the persisted pacer
  state. Leases are not modelled: nothing here outlives them;
- the **laws** the bench compares: pacerd's own (``pacer.plan_tick``) and the
  plain halving AIMD baseline, both with ``plan_tick``'s signature, so
  admission runs either one unchanged.

``World`` holds the model's event heap (upstream arrivals, outcome reports,
live arrivals) and advances it to a given time without awaiting anything.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pacerd import pacer
from pacerd.pacer import Demand, OutcomeWindow, PacerState, PacingParams, TickPlan

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from pacerd.models import JobRef

# ---------------------------------------------------------------------------
# laws


class Law(Protocol):
    """A control law with ``pacer.plan_tick``'s signature (admission's ``law``)."""

    name: str

    def __call__(
        self,
        state: PacerState,
        window: OutcomeWindow,
        demand: Demand | None,
        *,
        now: float,
        inflight: int,
        params: PacingParams,
        cooldown_remaining_s: float = 0.0,
        paused: bool = False,
        reopening: bool = False,
    ) -> tuple[PacerState, TickPlan]: ...


class PacerdLaw:
    """pacerd's own law: ``pacer.plan_tick`` itself."""

    name = "pacerd"
    __call__ = staticmethod(pacer.plan_tick)


class HalvingLaw:
    """The baseline: halve on refusal, +1 job/s on a clean tick with demand.

    The tick arithmetic is pacerd's (``pacer.tick_budget``) and admission
    does the rest (sub-tick spacing, lanes, Retry-After closure), so only the
    control law differs."""

    name = "halving"

    def __call__(
        self,
        state: PacerState,
        window: OutcomeWindow,
        demand: Demand | None,
        *,
        now: float,
        inflight: int,
        params: PacingParams,
        cooldown_remaining_s: float = 0.0,
        paused: bool = False,
        reopening: bool = False,
    ) -> tuple[PacerState, TickPlan]:
        rate = state.rate
        if window.refused > 0:
            rate = rate / 2.0
        elif (
            not paused
            and cooldown_remaining_s <= 0
            and demand is not None
            and demand.budget > 0
            and demand.admitted >= demand.budget
            and not demand.backlog_empty
        ):
            rate = rate + 1.0
        rate = min(params.max_rate, max(params.min_rate, rate))
        state = PacerState(
            rate=rate,
            credit=state.credit,
            last_tick=state.last_tick,
            deadline=state.deadline,
            epoch=state.epoch,
            prepaid=state.prepaid,
        )
        return pacer.tick_budget(
            state,
            now=now,
            inflight=inflight,
            params=params,
            cooldown_remaining_s=cooldown_remaining_s,
            paused=paused,
            reopening=reopening,
        )


LAWS: dict[str, Law] = {"pacerd": PacerdLaw(), "halving": HalvingLaw()}

# ---------------------------------------------------------------------------
# scenario description


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceSpec:
    """One pacerd instance (leader of one destination's pacer)."""

    start: float = 0.0
    stop: float | None = None  # leadership lost at this time (graceful stop)
    ledger: int = 0  # index of the destination ledger it drives
    clock_offset: float = 1000.0  # its monotonic clock = sim time + offset


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerSpec:
    backlog: int | None = None  # overdue backlog jobs at t=0 (None: never runs dry)
    live_rate: float = 0.0  # live jobs arriving per second (Poisson)
    # paused until then (``pacerd.pause``), resumed with the ledger's notice,
    # which wakes the instances leading it (a reopening tick), as a real
    # daemon started on a paused destination sees the resume
    paused_until: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    duration: float
    phases: tuple[tuple[float, float], ...]  # (start second, capacity jobs/s)
    burst_seconds: float = 1.0
    retry_after: bool = False  # every 429 advertises the wait for a token (>= 1 s)
    penalty_seconds: float | None = None
    penalty_threshold: float | None = None  # None: the first refusal closes the box
    params: PacingParams = field(default_factory=PacingParams)
    ledgers: tuple[LedgerSpec, ...] = (LedgerSpec(),)
    instances: tuple[InstanceSpec, ...] = (InstanceSpec(),)
    workers: int = 200
    latency_median: float = 0.2
    latency_sigma: float = 0.5
    report_delay_median: float = 0.1
    report_delay_sigma: float = 0.5
    refusal_latency: bool = True  # a refused call takes the latency too (else: answered at once)
    broker_delay: float = 0.003
    stall_every_s: float | None = None  # mean time between stalls of the delivery path
    stall_seconds: float = 0.15

    def capacity_at(self, t: float) -> float:
        cap = self.phases[0][1]
        for start, c in self.phases:
            if t >= start:
                cap = c
        return cap

    def capacity_between(self, t0: float, t1: float) -> float:
        """Integral of C(t) over [t0, t1): the calls the upstream could accept."""
        total = 0.0
        bounds = [*self.phases[1:], (math.inf, 0.0)]
        for (start, c), (end, _) in zip(self.phases, bounds, strict=True):
            lo, hi = max(t0, start), min(t1, end)
            if hi > lo:
                total += c * (hi - lo)
        return total


# ---------------------------------------------------------------------------
# the model upstream


class Upstream:
    def __init__(self, sc: Scenario) -> None:
        self.phases = sc.phases
        self.burst = sc.burst_seconds
        self.penalty = sc.penalty_seconds
        self.threshold = sc.penalty_threshold
        self.retry_after = sc.retry_after
        self.recent: deque[float] = deque()  # refusals of the trailing second
        self.t = 0.0
        self.phase = 0
        self.cap = sc.phases[0][1]
        self.tokens = self.cap * self.burst
        self.closed_until = -math.inf

    def _advance(self, t: float) -> None:
        while self.phase + 1 < len(self.phases) and self.phases[self.phase + 1][0] <= t:
            start = self.phases[self.phase + 1][0]
            self.tokens = min(self.cap * self.burst, self.tokens + self.cap * (start - self.t))
            self.t = start
            self.phase += 1
            self.cap = self.phases[self.phase][1]
            self.tokens = min(self.tokens, self.cap * self.burst)
        self.tokens = min(self.cap * self.burst, self.tokens + self.cap * (t - self.t))
        self.t = t

    def call(self, t: float) -> tuple[bool, float | None]:
        """(accepted, retry_after_s) for a call arriving at ``t``."""
        self._advance(t)
        if t < self.closed_until:
            left = self.closed_until - t
            return False, float(math.ceil(left)) if self.retry_after else left
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True, None
        if self.penalty is not None and self.threshold is None:
            self.closed_until = t + self.penalty
            return False, self.penalty
        if self.penalty is not None and self._burst_of_refusals(t):
            self.closed_until = t + self.penalty  # this call still says when a token comes
        if self.retry_after:
            wait = (1.0 - self.tokens) / self.cap if self.cap > 0 else 1.0
            return False, float(max(1, math.ceil(wait)))
        return False, None

    def _burst_of_refusals(self, t: float) -> bool:
        recent, threshold = self.recent, self.threshold or 0.0
        recent.append(t)
        while recent[0] <= t - 1.0:
            recent.popleft()
        return len(recent) > max(1.0, threshold * self.cap)


# ---------------------------------------------------------------------------
# the ledger model

SCHEDULED, CLAIMED, OFFERED, COMPLETED = range(4)
VIRGIN_DUE = -100_000.0  # next_attempt_at of the initial backlog: long overdue


class Job:
    __slots__ = (
        "attempt",
        "due",
        "epoch",
        "first_dispatch",
        "job_id",
        "lane_live",
        "latency",
        "live",
        "orig",
        "state",
    )

    def __init__(self, job_id: str, due: float, *, live: bool, orig: bool) -> None:
        self.job_id = job_id
        self.due = due  # next_attempt_at
        self.live = live  # never offered (a live-lane candidate: not ever_offered)
        self.orig = orig  # part of the initial backlog
        self.state = SCHEDULED
        self.epoch = 0  # admit_epoch of its current claim
        self.attempt = 0
        self.first_dispatch: float | None = None
        self.lane_live = False  # claimed through the live lane
        self.latency = 0.0


class SimLedger:
    """One destination's jobs and shared state (``pacerd.jobs`` and
    ``pacerd.destinations``), with the SQL's transitions."""

    def __init__(self, spec: LedgerSpec) -> None:
        self.spec = spec
        self.seq = 0
        self.backlog: list[tuple[float, int, Job]] = []  # due, ordered by next_attempt_at
        self.future: list[tuple[float, int, Job]] = []  # not yet due (Retry-After)
        self.live: list[tuple[float, int, Job]] = []  # never offered, due recently
        self.virgin_left: float = math.inf if spec.backlog is None else spec.backlog
        self.virgin_i = 0
        self.claimed: dict[str, Job] = {}  # claimed or offered, by job_id
        self.inflight = 0
        self.epoch = 0
        self.cooldown_until = -math.inf
        self.pacer_state: dict[str, Any] | None = None
        self.n_accepted = self.n_refused = 0
        self.n_accepted_fresh = self.n_refused_fresh = 0
        self.n_retry_after = 0
        self.orig_done = 0
        self.drained_at: float | None = None

    def _push(self, heap: list[tuple[float, int, Job]], job: Job) -> None:
        self.seq += 1
        heapq.heappush(heap, (job.due, self.seq, job))

    def _virgin_due(self) -> float:
        return VIRGIN_DUE + self.virgin_i * 1e-3

    def add_live(self, t: float) -> None:
        self.seq += 1
        heapq.heappush(self.live, (t, self.seq, Job(f"l{self.seq}", t, live=True, orig=False)))

    def due_counts(self, t: float, live_window_seconds: float) -> tuple[int, float]:
        """(live, backlog) due at ``t``: moves what became due to its lane."""
        while self.future and self.future[0][0] <= t:
            heapq.heappush(self.backlog, heapq.heappop(self.future))
        horizon = t - live_window_seconds
        while self.live and self.live[0][0] <= horizon:
            heapq.heappush(self.backlog, heapq.heappop(self.live))
        return len(self.live), len(self.backlog) + self.virgin_left

    def claim(
        self, t: float, *, live_limit: int, limit: int, epoch: int, live_window_seconds: float
    ) -> list[Job]:
        """``claim_due``: up to ``limit`` due jobs, oldest first, ``live_limit``
        of them reserved for the live lane (work-conserving both ways); live
        jobs first, each lane in ``next_attempt_at`` order. Nothing while the
        destination cools down after a Retry-After, as the SQL claims."""
        if t < self.cooldown_until:
            return []
        live_due, backlog_due = self.due_counts(t, live_window_seconds)
        live_due, backlog_due = min(live_due, limit), int(min(backlog_due, limit))
        n_live = min(live_due, max(live_limit, limit - backlog_due))
        n_backlog = min(backlog_due, limit - n_live)
        jobs: list[Job] = []
        for _ in range(n_live):
            job = heapq.heappop(self.live)[2]
            job.lane_live = True
            jobs.append(job)
        for _ in range(n_backlog):
            if self.virgin_left > 0 and (
                not self.backlog or self._virgin_due() < self.backlog[0][0]
            ):
                job = Job(f"b{self.virgin_i}", self._virgin_due(), live=False, orig=True)
                self.virgin_i += 1
                self.virgin_left -= 1
            else:
                job = heapq.heappop(self.backlog)[2]
            job.lane_live = False
            jobs.append(job)
        claimed = self.claimed
        for job in jobs:
            job.state = CLAIMED
            job.epoch = epoch
            job.attempt += 1
            claimed[job.job_id] = job
        self.inflight += len(jobs)
        return jobs

    def _current(self, ref: JobRef, state: int) -> Job | None:
        job = self.claimed.get(ref.job_id)
        if job is None or job.attempt != ref.attempt or job.state != state:
            return None
        return job

    def mark_offered(self, refs: Iterable[JobRef]) -> list[JobRef]:
        """Confirmed publishes become offered (fenced by state and attempt)."""
        done = []
        for ref in refs:
            job = self._current(ref, CLAIMED)
            if job is not None:
                job.state = OFFERED
                job.live = False  # ever_offered
                done.append(ref)
        return done

    def release(self, refs: Iterable[JobRef]) -> list[JobRef]:
        """Unpublished claims go back where they were, no attempt spent."""
        done = []
        for ref in refs:
            job = self._current(ref, CLAIMED)
            if job is not None:
                job.state = SCHEDULED
                del self.claimed[job.job_id]
                self.inflight -= 1
                self._push(self.live if job.live else self.backlog, job)
                done.append(ref)
        return done

    def report(
        self, job: Job, attempt: int, t: float, accepted: bool, retry_after: float | None
    ) -> bool:
        """``pacerd.report`` of ``ok`` or ``refused``: False when stale."""
        if job.attempt != attempt or job.state not in (CLAIMED, OFFERED):
            return False
        del self.claimed[job.job_id]
        self.inflight -= 1
        job.live = False  # an applied report proves the offer
        fresh = job.epoch >= self.epoch
        if accepted:
            job.state = COMPLETED
            self.n_accepted += 1
            self.n_accepted_fresh += fresh
            if job.orig:
                self.orig_done += 1
                if self.orig_done == self.spec.backlog:
                    self.drained_at = t
            return True
        job.state = SCHEDULED
        self.n_refused += 1
        self.n_refused_fresh += fresh
        if retry_after is not None:
            self.n_retry_after += 1
            self.cooldown_until = max(self.cooldown_until, t + retry_after)
            if t + retry_after > job.due:
                job.due = t + retry_after
                self._push(self.future, job)
                return True
        self._push(self.backlog, job)
        return True

    def save_pacer_state(self, state: Mapping[str, Any], epoch: int) -> None:
        self.pacer_state = dict(state)
        self.epoch = max(self.epoch, epoch)


# ---------------------------------------------------------------------------
# results


@dataclass(slots=True)
class TickRecord:
    t: float
    instance: int
    budget: int
    rate: float
    claimed: int
    refused_seen: int
    span: float
    clean_fresh: bool  # its window had fresh outcomes and no fresh refusal


@dataclass(slots=True)
class RunResult:
    scenario: Scenario
    law: str
    seed: int
    # one row per upstream call: arrival time, instance, accepted, live lane
    call_t: list[float] = field(default_factory=list)
    call_inst: list[int] = field(default_factory=list)
    call_ok: list[bool] = field(default_factory=list)
    call_live: list[bool] = field(default_factory=list)
    ticks: list[TickRecord] = field(default_factory=list)
    dispatch_t: list[float] = field(default_factory=list)
    ra_windows: list[tuple[float, float]] = field(default_factory=list)
    report_t: list[float] = field(default_factory=list)  # when each outcome reached the ledger
    live_waits: list[float] = field(default_factory=list)
    drained_at: float | None = None


# ---------------------------------------------------------------------------
# the world: upstream, worker pools and ledgers on one event heap

ARR, REP, LIVE = range(3)


class World:
    """The model's events in time order, advanced by the driver between the
    moments admission wakes up; published jobs enter it through
    :meth:`publish` and are handed to the instance's worker pool when the
    driver next runs (in instance order: deterministic)."""

    def __init__(self, sc: Scenario, law: str, seed: int) -> None:
        self.sc = sc
        self.rng = rng = random.Random(f"{sc.name}/{seed}")
        self.upstream = Upstream(sc)
        self.ledgers = [SimLedger(spec) for spec in sc.ledgers]
        self.pools = [[0.0] * sc.workers for _ in sc.instances]  # when each worker is free
        self.pending: list[list[Job]] = [[] for _ in sc.instances]
        self.published = False
        self.res = RunResult(scenario=sc, law=law, seed=seed)
        self.events: list[tuple[float, int, int, int, Any]] = []
        self.counter = itertools.count()
        for i, led in enumerate(self.ledgers):
            if led.spec.live_rate > 0:
                self._push(rng.expovariate(led.spec.live_rate), LIVE, i, None)
        self.stalls = self._stalls(sc, seed)

    @staticmethod
    def _stalls(sc: Scenario, seed: int) -> list[tuple[float, float]]:
        """The delivery path's stalls, (start, end), drawn from a generator
        of their own: a scenario without stalls draws exactly what it drew
        before they existed."""
        if sc.stall_every_s is None:
            return []
        draw = random.Random(f"{sc.name}/{seed}/stalls")
        out, t = [], draw.expovariate(1.0 / sc.stall_every_s)
        while t < sc.duration:
            out.append((t, t + sc.stall_seconds))
            t += sc.stall_seconds + draw.expovariate(1.0 / sc.stall_every_s)
        return out

    def _after_stall(self, t: float) -> float:
        """``t``, or the end of the stall that holds it."""
        k = bisect.bisect_right(self.stalls, (t, math.inf)) - 1
        if k >= 0 and t < self.stalls[k][1]:
            return self.stalls[k][1]
        return t

    def _push(self, t: float, kind: int, a: int, b: Any) -> None:
        heapq.heappush(self.events, (t, next(self.counter), kind, a, b))

    def publish(self, instance: int, job: Job) -> None:
        """A confirmed publish by ``instance`` (dispatched at :meth:`flush`)."""
        self.pending[instance].append(job)
        self.published = True

    def flush(self, t: float) -> None:
        """Hands the jobs published at ``t`` to their worker pools."""
        if not self.published:
            return
        self.published = False
        sc, res = self.sc, self.res
        uniform, gauss, exp = self.rng.random, self.rng.gauss, math.exp
        lat_mu, lat_sig = math.log(sc.latency_median), sc.latency_sigma
        broker, stalls = sc.broker_delay, self.stalls
        heappush, heappop = heapq.heappush, heapq.heappop
        events, counter = self.events, self.counter
        for inst, jobs in enumerate(self.pending):
            if not jobs:
                continue
            pool = self.pools[inst]
            for job in jobs:
                res.dispatch_t.append(t)
                if job.first_dispatch is None:
                    job.first_dispatch = t
                    if job.lane_live:
                        res.live_waits.append(t - job.due)
                start = max(t + broker * (0.5 + uniform()), heappop(pool))
                if stalls:
                    start = self._after_stall(start)
                job.latency = exp(lat_mu + lat_sig * gauss(0.0, 1.0))
                heappush(pool, start + job.latency)
                heappush(events, (start, next(counter), ARR, inst, job))
            jobs.clear()

    def next_event(self) -> float:
        return self.events[0][0] if self.events else math.inf

    def advance(self, until: float) -> None:
        """Processes every model event at or before ``until``."""
        events = self.events
        if not events or events[0][0] > until:
            return
        sc, res, rng = self.sc, self.res, self.rng
        gauss, exp = rng.gauss, math.exp
        rep_mu, rep_sig = math.log(sc.report_delay_median), sc.report_delay_sigma
        upcall = self.upstream.call
        heappush, heappop, counter = heapq.heappush, heapq.heappop, self.counter
        call_t, call_inst, call_ok, call_live = (
            res.call_t,
            res.call_inst,
            res.call_ok,
            res.call_live,
        )
        instances, ledgers, report_t = sc.instances, self.ledgers, res.report_t
        while events and events[0][0] <= until:
            t, _, kind, a, b = heappop(events)
            if kind == ARR:
                ok, ra = upcall(t)
                call_t.append(t)
                call_inst.append(a)
                call_ok.append(ok)
                call_live.append(b.lane_live)
                answered = t + b.latency if ok or sc.refusal_latency else t
                rep = answered + exp(rep_mu + rep_sig * gauss(0.0, 1.0))
                heappush(events, (rep, next(counter), REP, a, (b, b.attempt, ok, ra, t)))
            elif kind == REP:
                job, attempt, ok, ra, called = b
                report_t.append(t)
                led = ledgers[instances[a].ledger]
                if led.report(job, attempt, t, ok, ra) and ra is not None:
                    res.ra_windows.append((t, called + ra))  # visible .. advertised end
            else:  # LIVE
                led = ledgers[a]
                led.add_live(t)
                t_next = t + rng.expovariate(led.spec.live_rate)
                heappush(events, (t_next, next(counter), LIVE, a, None))

    def finish(self) -> RunResult:
        for led in self.ledgers:
            if led.drained_at is not None:
                self.res.drained_at = led.drained_at
        return self.res
