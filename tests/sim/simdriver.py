"""Runs pacerd's real admission in the simulated world, in virtual time.

Each instance of a scenario is pacerd's own ``run_destination`` looping over a
``DestinationAdmission`` (``pacerd/admission.py``, with the law under test as
its ``law``), on a ``SimClock`` of its own, over two fakes:

- ``SimAdmissionLedger`` (``admission.AdmissionLedger``), a thin view of the
  destination's ``SimLedger``: the destination row with its monotonic
  outcome counters, cool-down and pacer state, the in-flight count, the
  two-lane claim of ``claim_due`` stamping the epoch, mark-offered, release
  and the saved pacer state. It never awaits: a statement takes no virtual
  time. It passes the ledger contract suite (``test_sim_contract.py``);
- the shared ``support.fakes.FakePublisher`` (``publisher.Publisher``):
  every publish is confirmed at once and the job goes to the instance's
  worker pool at that virtual time (then the broker delay). The pool takes
  it when the driver next runs, before time moves, in instance order: the
  draws from the run's one seeded RNG never depend on the order in which
  trio runs tasks, so a seed gives one result.

One trio run holds the instances and one driver task. The driver waits until
every task is blocked, hands what was published to the worker pools, takes
the earliest of the next sleeper, the next model event and the next instance
start or stop, processes the model's events up to it inline (no await per
event), and wakes the sleepers due. Tick records (budget, rate, the window's
refusals, the tick's span) come from a thin wrapper around the law, the
claimed count from the claims, less the claims given back unsent.
"""

from __future__ import annotations

import datetime as dt
import math
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import trio
import trio.testing
from simclock import EPOCH_AT, SimClock, SimTime
from simlib import LAWS, Law, RunResult, Scenario, SimLedger, TickRecord, World
from support.fakes import FakePublisher

from pacerd.admission import AdmissionConfig, DestinationAdmission, run_destination
from pacerd.models import ClaimedJob, DestinationRow

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from pacerd.models import JobRef
    from pacerd.pacer import Demand, OutcomeWindow, PacerState, TickPlan


START, STOP, RESUME = range(3)


def destination_name(ledger: int) -> str:
    return f"d{ledger}"


class TickProbe:
    """Wraps a law to record one ``TickRecord`` per tick of one instance."""

    def __init__(self, law: Law, instance: int, time: SimTime, ticks: list[TickRecord]) -> None:
        self.law = law
        self.instance = instance
        self.time = time
        self.ticks = ticks
        self.current: TickRecord | None = None

    def __call__(
        self,
        state: PacerState,
        window: OutcomeWindow,
        demand: Demand | None,
        *,
        now: float,
        **kwargs: Any,
    ) -> tuple[PacerState, TickPlan]:
        state, plan = self.law(state, window, demand, now=now, **kwargs)
        self.current = TickRecord(
            t=self.time.t,
            instance=self.instance,
            budget=plan.budget,
            rate=state.rate,
            claimed=0,
            refused_seen=window.refused,
            span=plan.next_deadline - now,
            clean_fresh=window.refused_fresh == 0 and window.accepted_fresh > 0,
        )
        self.ticks.append(self.current)
        return state, plan


class SimAdmissionLedger:
    """``AdmissionLedger`` over one destination's ``SimLedger`` (one instance's
    view); ``probe`` (if any) is told each tick's claimed count."""

    def __init__(
        self,
        ledger: SimLedger,
        time: SimTime,
        probe: TickProbe | None,
        *,
        destination: str,
        live_window_seconds: float,
    ) -> None:
        self.ledger = ledger
        self.time = time
        self.probe = probe
        self.destination = destination
        self.live_window_seconds = live_window_seconds

    async def read_destination(
        self, destination: str, *, inflight: bool = False
    ) -> DestinationRow | None:
        if destination != self.destination:
            return None
        led, t = self.ledger, self.time.t
        cooldown = led.cooldown_until
        return DestinationRow(
            destination=destination,
            paused=t < led.spec.paused_until,
            paused_all=False,
            cooldown_until=EPOCH_AT + dt.timedelta(seconds=cooldown)
            if cooldown > -math.inf
            else None,
            epoch=led.epoch,
            pacer_state=led.pacer_state,
            n_accepted=led.n_accepted,
            n_refused=led.n_refused,
            n_accepted_fresh=led.n_accepted_fresh,
            n_refused_fresh=led.n_refused_fresh,
            n_retry_after=led.n_retry_after,
            leader=None,
            leader_since=None,
            now=EPOCH_AT + dt.timedelta(seconds=t),
            inflight=led.inflight if inflight else None,
        )

    async def is_closed(self, destination: str) -> bool:
        row = await self.read_destination(destination)
        return row is not None and row.closed

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
        jobs = self.ledger.claim(
            self.time.t,
            live_limit=live_limit,
            limit=limit,
            epoch=epoch,
            live_window_seconds=live_window_seconds,
        )
        if self.probe is not None and self.probe.current is not None:
            self.probe.current.claimed += len(jobs)
        return [
            ClaimedJob(
                job_id=job.job_id,
                kind="sim",
                destination=destination,
                attempt=job.attempt,
                revision=0,
                payload_json="{}",
                cursor_json=None,
                eligible_at=EPOCH_AT + dt.timedelta(seconds=job.due),
                live=job.lane_live,
            )
            for job in jobs
        ]

    async def mark_offered(self, refs: Sequence[JobRef], *, offer_seconds: float) -> list[JobRef]:
        return self.ledger.mark_offered(refs)

    async def release_claims(self, refs: Sequence[JobRef], *, reason: str) -> list[JobRef]:
        released = self.ledger.release(refs)
        if self.probe is not None and self.probe.current is not None:
            # given back unsent (a mid-tick cut): claimed, not admitted
            self.probe.current.claimed -= len(released)
        return released

    async def save_pacer_state(
        self, destination: str, state: Mapping[str, Any], *, epoch: int
    ) -> None:
        self.ledger.save_pacer_state(state, epoch)

    async def has_due(self, destination: str, *, at_least: int = 1) -> int:
        live, backlog = self.ledger.due_counts(self.time.t, self.live_window_seconds)
        return int(min(at_least, live + backlog))


def sim_publisher(world: World, instance: int, ledger: SimLedger) -> FakePublisher:
    """The shared fake publisher: every message is confirmed at once and its
    job handed to ``instance``'s worker pool."""
    publish, claimed = world.publish, ledger.claimed

    def dispatch(jobs: Sequence[ClaimedJob]) -> None:
        for job in jobs:
            publish(instance, claimed[job.job_id])

    return FakePublisher(on_confirmed=dispatch)


def run(sc: Scenario, law: Law | str, seed: int) -> RunResult:
    """Runs one scenario with one law and one seed; deterministic."""
    law = LAWS[law] if isinstance(law, str) else law
    return trio.run(_run, sc, law, seed)


async def _run(sc: Scenario, law: Law, seed: int) -> RunResult:
    world = World(sc, law.name, seed)
    time = SimTime()
    # instance starts and stops and resumes of paused ledgers, in time order:
    # (t, START / STOP / RESUME, instance or ledger)
    controls = sorted(
        [(spec.start, START, i) for i, spec in enumerate(sc.instances)]
        + [(spec.stop, STOP, i) for i, spec in enumerate(sc.instances) if spec.stop is not None]
        + [(spec.paused_until, RESUME, j) for j, spec in enumerate(sc.ledgers) if spec.paused_until]
    )
    stops = [anyio.Event() for _ in sc.instances]
    admissions: dict[int, DestinationAdmission] = {}  # each started instance's
    duration = sc.duration
    blocked = trio.testing.wait_all_tasks_blocked
    flush, advance, next_wake, wake = world.flush, world.advance, time.next_wake, time.wake
    async with trio.open_nursery() as nursery:
        k = 0
        control = controls[0][0]
        while True:
            await blocked()
            flush(time.t)
            until = next_wake()
            if control <= until:
                until = control
            if until > duration:
                advance(duration)
                break
            advance(until)
            if until < control:
                wake(until)
                continue
            time.t = control
            _, kind, i = controls[k]
            k += 1
            control = controls[k][0] if k < len(controls) else math.inf
            if kind == STOP:
                stops[i].set()
            elif kind == RESUME:  # the ledger's notice: its leaders reopen now
                for n, admission in admissions.items():
                    if sc.instances[n].ledger == i:
                        admission.wake()
            else:
                admissions[i] = _admission(sc, law, i, world, time)
                nursery.start_soon(partial(run_destination, admissions[i], stop=stops[i]))
        nursery.cancel_scope.cancel()
    return world.finish()


def _admission(sc: Scenario, law: Law, i: int, world: World, time: SimTime) -> DestinationAdmission:
    spec = sc.instances[i]
    ledger = world.ledgers[spec.ledger]
    probe = TickProbe(law, i, time, world.res.ticks)
    destination = destination_name(spec.ledger)
    admission = DestinationAdmission(
        ledger=SimAdmissionLedger(
            ledger,
            time,
            probe,
            destination=destination,
            live_window_seconds=sc.params.live_window_seconds,
        ),
        publisher=sim_publisher(world, i, ledger),
        clock=SimClock(time, offset=spec.clock_offset),
        config=AdmissionConfig(
            destination=destination,
            queue=f"pacerd.ready.{destination}",
            params=sc.params,
            instance=f"sim-{i}",
        ),
        law=probe,
    )
    return admission
