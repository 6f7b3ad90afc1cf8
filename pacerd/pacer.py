"""The pacing law (AIMD per destination) and the tick arithmetic.

Pure: no I/O, no asyncio, standard library only. Time arrives as arguments
(``Clock.monotonic()`` seconds); nothing here reads a clock or a random source.
``admission.py`` calls :func:`plan_tick` once per destination per tick and runs
the I/O; everything it decides — rate, budget, credit, lane split, publish
offsets, next deadline — is computed here.

The law, per destination:

- **Episodes.** A tick's window (outcomes reported since the previous tick) is a
  refusal episode when the *fresh* refusals — of jobs claimed at the current
  epoch, i.e. after the last cut — reach ``max(refusal_min_count,
  refusal_threshold * fresh outcomes)``. Refusals of jobs admitted before the
  last cut never cut again: one cut per round trip. A Retry-After is always an
  episode. Fresh refusals under that bound add up from tick to tick (decayed
  with a time constant of ``ACCUMULATE_S``): once they reach it over the
  outcomes they came among, that is an episode too (a rate held a little over
  the capacity refuses a few calls every tick, never enough in one).
- **Cut.** The capacity estimate is the accepted rate of what was sent,
  ``sent * (1 - excess/outcomes)``, where the excess is the refusals beyond
  those that called the episode (``max(refusal_min_count, refusal_threshold
  * outcomes)``: a trigger, not a measure; cut by them, every sender sharing
  an upstream would lose the same jobs/s and their shares would never meet);
  the rate is cut to ``estimate * (1 - decrease_margin)``, and so is the
  remembered *ceiling*: every cut has that proportional part, which is what
  brings senders sharing an upstream to equal shares (a larger sender hears
  the refusals that call an episode sooner, so it is cut more often). On a
  long round trip (not :func:`_short`), the refusals are a share of what was
  sent over the window when that is more than the outcomes heard
  (:func:`_outcomes_base`): a 429 comes back at once, an accepted call only
  after its latency, so the outcomes alone overstate the share. A mild
  cut never goes under what the upstream accepted, in the window and on
  average alike (``delivered``), nor above what was sent: while refusals occur
  that is a lower bound of a bucket's refill rate, and bursts of prefetched
  work refused by a small bucket below its rate do not compound cut after cut
  (the window alone may be a batch of outcomes; the average alone lags a
  drop; the smaller of the two is neither). A heavy
  episode (refusal ratio above ``HEAVY_RATIO``; never the end of slow start) means
  the window mixes outcomes from before and after a capacity change, so its
  estimate is only an upper bound: the rate drops to the floor and, while the
  stale outcomes of that round trip arrive, is raised back to just under what
  they measure (never compounding: it only moves up). A ladder's probe can
  make a window heavy too (its bursty refusals at a small bucket), with no
  capacity change in it: its bound is then near the capacity it found. When
  that bound is at least the rate its last step began from (what the
  ladder held clean a round trip before), the window measured the probe's
  overshoot, not a capacity that fell: the rate is cut just under the bound
  (never above the rate), as a mild cut would, not to the floor. When
  fewer than ``REFINE_MIN_OUTCOMES`` stale outcomes come before the first
  fresh ones (a round trip far shorter than the tick: the window already
  held them all), nothing refines such a floor: it regrows toward the bound
  by ``REGROW`` per round trip, not by the additive step (a drop's floor,
  whose bound mixes what came before the drop, climbs by the step). A
  regrowth's step is a probe too: refused heavily, its floor regrows again
  toward the new window's bound. The cut
  that ends a heavy one's episode (its first fresh outcomes) is never heavy:
  the floor it sent at is what their refusals measure (a capacity that fell
  under it, or a small bucket's noise), and a second floor would compound
  the first. No cut goes below ``decrease_factor * rate``.
- **Increase.** Only on a clean window of a tick that used its whole budget (an
  idle or app-limited destination does not grow), that admitted at least
  ``LOOP_SHARE`` of the rate over the time since the previous tick (a loop that
  runs late on a busy host skips ticks: what it released is not the rate, and
  growing on it runs the rate far ahead of what leaves), and while no more than
  ``INFLIGHT_RTTS`` round trips of the rate are in flight (work piled up before
  slow workers reaches the upstream later, whatever the rate) or, in slow
  start, the outcomes come back at ``HYSTART_SHARE`` of the rate or more
  (then what is in flight is the calls' latency: a measured round trip is
  its fastest outcome's); past slow start, not while the outcomes of a tick
  of ``HYSTART_MIN_OUTCOMES`` or more come back at under ``RETURN_SHARE``
  of the rate (they wait before workers slower than it):
  ``+increase_step`` jobs/s per round trip — the same absolute step on every
  instance, so instances sharing an upstream converge to equal shares. The round
  trip is measured (from a cut to its first fresh outcomes) and is at least one
  tick: like TCP's per-RTT increase, this keeps the cost of a probe (refusals
  per overshoot) independent of the tick length and of the upstream's latency.
  Before the first cut it is measured from a release whose outcomes no tick
  heard to the first tick that hears one (``FIRST_ROUND_TRIP_MAX_S`` at most):
  calls slower than a tick are many ticks of the rate in flight, and slow
  start would otherwise never grow past ``INFLIGHT_RTTS`` ticks of them.
  Before a destination's first episode it grows ``slow_start_factor`` per round
  trip and at most once per ``SLOW_START_PERIOD_S`` (per second, not per tick:
  a short tick does not compound the factor while refusals are on their way),
  never faster than that factor times the accepted rate; a tick that grew
  keeps ramping at that growth while it releases (its releases reach the rate
  the next tick would grow to: no jump of a whole factor at a tick's start,
  which a brake could only catch a round trip after it began), and slow start
  ends just under what that tick's ramp accepted, however far above the rate
  the ramp began at (its ceiling likewise). On the first sign of saturation
  (HyStart) it stops growing: it holds the rate on any refusal (under the
  episode threshold, or too few to end slow start; a ramping tick's rate is
  then lifted to what it accepted, never above what it sent nor where the same
  window without refusals would have grown it, and the next tick does not
  ramp), or on a window of at least ``HYSTART_MIN_OUTCOMES`` outcomes whose
  accepted rate is under ``HYSTART_SHARE`` of the rate and no higher than the
  average before it or than the window before grown by the square root of the
  rate's growth (the accepted rate stopped growing with the rate: not outcomes
  still on their way). Two such windows in a row, nothing refused, of ticks
  that released what the rate allowed (:func:`_pressed`), on a round
  trip within a tick (:func:`_short`), end slow start just under the accepted
  rate, its ceiling firm: the bottleneck is past the upstream (workers slower
  than the rate), and every tick held at the rate piles up more work before
  them, called later whatever the upstream's capacity by then. It ends on a
  window with enough evidence (``refusal_min_count / refusal_threshold``
  outcomes, or a heavy window with ``START_MIN_FACTOR * refusal_min_count``
  refusals: a few refusals in a small sample may be a burst, or another
  sender's probe), at the accepted rate measured (the window's or the average,
  never above ``sent * accepted share``: the rate grew while those outcomes
  were on their way), not at a quarter of the rate. A refusal below the
  episode threshold while at or above the ceiling holds the rate and voids the
  evidence of growth below (the upstream was empty just then).
- **Stale ceiling.** A token-bucket upstream can absorb, unrefused, what the
  destination left unused since the bucket was last seen empty (``saved``).
  When the volume sent above the ceiling (``surplus``) exceeds that by twice
  the slack (a round trip of outcomes on their way and the estimate's error;
  twice, so that another sender's brief cut is not taken for growth), the
  capacity has grown: the increase then doubles every round trip until the
  next episode. So it does after ``PROBE_RTTS`` clean round trips with
  demand at or above a firm ceiling (no refusal at all meanwhile): a firm
  ceiling set from a bursty window may sit well under the capacity (and a
  capacity that came back after a drop looks just the same), and the surplus
  test alone takes ten round trips or more to say so. A ladder's step never
  exceeds ``LADDER_MAX`` of the rate: a probe overshoots by about its last
  step, a round trip before its refusals come back.
- **Peak.** A heavy cut remembers the rate it fell from (``peak``, fading
  with a time constant of ``PEAK_S`` of real time). A ceiling well under it
  (under ``PEAK_GAP`` of it) is a capacity that fell and may come back at any
  moment: the ladder probes after ``PEAK_PROBE_RTTS`` clean round trips, with
  steps up to ``PEAK_LADDER_MAX`` of the rate while the rate is that far
  under the peak (CUBIC's idea: regain the last maximum fast, probe carefully
  near it). A probe down there costs little: its overshoot is of a small rate.
- **Retry-After.** The destination is closed until it passes (the ledger holds
  the deadline, ``cooldown_remaining_s``); the ceiling is remembered from the
  delivered rate; on reopening the rate is ``ceiling_resume_fraction`` of it and
  stays there for ``retry_after / decrease_margin`` seconds, so probing into a
  penalty box costs at most that margin of the time. A Retry-After of at most
  ``SHORT_RETRY_AFTER_RTTS`` round trips (an API that sends one with every
  429: it says when the next token comes, not that a box closed) holds only
  ``SHORT_HOLD_RTTS`` round trips, and its ceiling is firm (a step up is
  then probed as after a mild cut; a rate refused under a firm ceiling is a
  peak, as a heavy cut's). Refused again during that hold, at the rate it
  reopened at, the bucket was empty at both Retry-Afters: its refill rate
  lies between what it accepted since the first one over the time since
  (the closure included: exact if the bucket stored what refilled while
  the destination was closed) and the window's rate while open (exact if
  it stored nothing). The ceiling is their geometric mean: too high, the
  next reopening is refused again and narrows it; too low, the firm
  ceiling is soon probed. A Retry-After that ends slow start reopens under
  what the upstream accepted of its ramping tick, not under the rate the
  ramp began at. When such a Retry-After closed the destination while a
  tick released (``Demand.open_seconds``), the window's accepted rate
  counts the closed rest of the tick as delivering nothing: the rate is
  measured over the time it was open instead, from what the upstream
  accepted of the jobs the tick sent (``_open_rate``). Where in its tick a
  Retry-After falls is chance; this measure does not depend on it.
- **Brake.** A tick's outcomes come back within the tick (a round trip is
  tens of milliseconds, a tick a second), so a tick whose budget is at least
  ``BRAKE_MIN_BUDGET`` looks at its fresh outcomes while it releases
  (:func:`brake`). At least ``BRAKE_MIN_FACTOR * refusal_min_count`` fresh
  refusals making ``BRAKE_RATIO`` of them mean the rate is well over the
  capacity now: the rate is cut at once to ``rate * accepted share`` (never
  under ``decrease_factor * rate``), or to the accepted rate since the last
  reading without a fresh refusal when that is lower and measured (at least
  ``BRAKE_MIN_SPAN_S`` and ``BRAKE_MIN_ACCEPTED`` outcomes: while a bucket
  refuses, it accepts its refill rate, while ``rate`` is the ramp's by now,
  a round trip past the outcomes heard), and the rest of the tick is
  released at the new rate. In slow start its overshoot is of its own
  making, so the share measures the capacity; slow start ends there, a
  round trip after its overshoot began rather than a tick later. That
  estimate is rough (the ramp's outcomes heard first are of calls a
  bucket's burst still absorbed), so the ticks after it stay watched until
  a clean window (``exited``), whatever their round trip: on a long one,
  a tick at a rate the brake left over the capacity would otherwise
  release its whole budget before the next tick cut it. Such a tick
  releases evenly at the brake's rate, so a brake there cuts on the share
  of what it sent alone, and remembers no peak (an overshoot is no
  capacity that fell). Past slow start a tick is watched only when its
  round trip is short (:func:`watches`: what is in flight at its start is
  under ``BRAKE_LAG_TICKS`` of a tick's releases), and braked by a
  capacity that fell: ``BRAKE_DROP_RATIO`` of at least ``BRAKE_DROP_OUTCOMES``
  fresh outcomes refused, or ``BRAKE_SURE_RATIO`` of fewer, when they are
  twice the brake's least refusals. Such a brake remembers the rate it
  fell from as a peak. Or by a ladder's probe that overshot (the tick's
  rate stepped up by the ladder, refusals under a drop's share): the rate
  goes to just under (``decrease_margin``) the rung the step began from,
  whose window was clean, or just under the estimate when that is higher,
  firm there, with no peak and no drop: the capacity was found between
  the two rungs, a round trip into the overshoot rather than a tick (a
  probe at 123/s over 100/s: 4 refusals instead of 15). Not the rung
  itself: a clean window there may be the bucket's slack, and a ceiling a
  little over a capacity refuses a call now and then, each of which puts
  off the next probe (the capacity of a deep cut came back and was not
  found in the 15 s left of the run).
  Fewer refusals, or a drop's share among too few outcomes to tell, wait
  for more; other refusals past slow start (a burst against a small
  bucket, a rate climbing by its step) and any brake on outcomes a long
  round trip old would cut on too noisy an estimate (the simulation's
  oscillation and fairness targets say so): the tick's own step decides.
  An episode right after a brake is never heavy: its outcomes are of jobs
  claimed at the brake's rate; after a drop's brake,
  nor are the episodes that follow it back to back until a clean window
  (``dropped``): a brake's estimate a little over the capacity is refused
  again, and a heavy cut would then drop to a quarter of the capacity.
- **Budget.** ``floor(credit + rate * elapsed)`` (elapsed capped at two ticks:
  missed ticks are skipped, not replayed), capped by ``max_inflight -
  inflight``; the fraction carries over as credit. Publishes are spread over
  the tick, live jobs first and at a pace under the ceiling, so a probe's
  refusals land on backlog work; a ramping slow-start tick pays for its
  ramp (``rate x (g^T - 1) / ln g`` for T seconds at a growth of ``g`` a
  second) and spreads it at its rising rate. A claim short of the budget
  goes out at the rate's pace (the first of the budget's release points)
  and ends early: stretched over the tick, a drain's last jobs would finish
  up to a tick later than the rate allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Mapping

# Structural constants of the law (not tuning knobs; see the module docstring).
HEAVY_RATIO = 0.15  # refusal ratio above which a window's estimate is only a bound
HEAVY_MIN_FACTOR = 2  # ... and it needs this many times refusal_min_count refusals
REFINE_Z = 1.0  # a heavy cut is refined to one standard error under the measure
REFINE_MIN_OUTCOMES = 10  # a probe's heavy cut refined by fewer stale outcomes regrows
REGROW = 1.5  # growth per round trip back toward an unrefined heavy cut's bound
SOFT_FACTOR = 1.25  # an unconfirmed ceiling is taken as stale only this far above it
STALE_HORIZON_S = 30.0  # horizon of the ceiling's error when testing it for staleness
LIVE_PACE = 0.95  # live jobs are published at this fraction of the ceiling's pace
DELIVERED_TICKS = 2.0  # time constant of the delivered-rate average, in ticks
SLOW_START_PERIOD_S = 1.0  # slow start grows its factor per round trip, at most once a second
START_MIN_FACTOR = 4  # a heavy window ends slow start with this many x refusal_min_count
HYSTART_SHARE = 0.9  # slow start holds when the window accepted less than this share of the rate
HYSTART_MIN_OUTCOMES = 20  # ... over at least this many outcomes, and no more than the average
LADDER_MAX = 0.25  # the largest ladder step, as a share of the rate
RETURN_SHARE = 0.5  # past slow start: no growth while outcomes return under this share of rate
INFLIGHT_RTTS = 2.0  # in flight beyond this many round trips of the rate: no growth
LOOP_SHARE = 0.8  # a tick that admitted less than this share of rate x time since the last one
# (the loop ran late: ticks were skipped) is no evidence for growth
SHORT_RETRY_AFTER_RTTS = 3.0  # a Retry-After up to this many round trips: "a token is due", no box
SHORT_HOLD_RTTS = 3.0  # ... after which the rate holds only this many round trips
OPEN_MIN_TICKS = 0.1  # a tick closed mid-tick this soon says nothing of its open rate
PROBE_RTTS = 8.0  # clean round trips at or above a firm ceiling, then the ladder probes it
ACCUMULATE_S = 4.0  # time constant over which refusals under the threshold add up to an episode
BRAKE_MIN_FACTOR = 2  # a mid-tick brake needs this many x refusal_min_count fresh refusals
BRAKE_RATIO = 0.1  # ... making at least this share of the fresh outcomes heard mid-tick
BRAKE_LAG_TICKS = 0.1  # past slow start, a tick is watched when its round trip is this short
BRAKE_DROP_RATIO = 0.25  # ... and braked only by this share of refusals (a drop, not a probe)
BRAKE_DROP_OUTCOMES = 20  # ... among at least this many fresh outcomes
BRAKE_SURE_RATIO = 0.5  # ... or among fewer, this share refused (twice the brake's least)
BRAKE_MIN_BUDGET = 10  # ticks with a smaller budget are not watched mid-tick (too few outcomes)
BRAKE_MIN_SPAN_S = 0.1  # a brake's window measures the accepted rate over at least this long
BRAKE_MIN_ACCEPTED = 20  # ... and this many accepted outcomes
PEAK_S = 30.0  # time constant over which the rate before a heavy cut (the peak) is forgotten
PEAK_GAP = 0.7  # a firm ceiling under this share of the peak: the capacity may come back
PEAK_PROBE_RTTS = 2.0  # ... so the ladder probes after this many clean round trips
PEAK_LADDER_MAX = 0.5  # ... with steps up to this share of the rate while under the peak
FIRST_ROUND_TRIP_MAX_S = 30.0  # a first round trip measured longer is an outage: taken as this
SHORT_RTT_TICKS = 1.5  # a round trip up to this many ticks: outcomes heard by the next tick
SPARSE_MAX_TICKS = 10  # a tick with no whole job to release skips at most this many ticks
_MONOTONIC = ("last_tick", "deadline", "prepaid")  # never persisted


@dataclass(frozen=True, slots=True, kw_only=True)
class PacingParams:
    """The `[pacing]` keys of the config, as the law sees them."""

    tick_seconds: float = 1.0
    initial_rate: float = 10.0
    min_rate: float = 1.0
    max_rate: float = 10_000.0
    increase_step: float = 0.6  # jobs/s added per clean round trip (>= a tick)
    decrease_factor: float = 0.25  # deepest cut of one round trip
    decrease_margin: float = 0.04  # cut to this fraction under the measured rate
    refusal_threshold: float = 0.02
    max_inflight: int = 2000
    live_share: float = 0.4
    live_window_seconds: float = 60.0
    slow_start_factor: float = 3.0  # growth per round trip before the first episode
    refusal_min_count: int = 2
    ceiling_resume_fraction: float = 0.9


@dataclass(frozen=True, slots=True, kw_only=True)
class OutcomeWindow:
    """Outcomes reported for one destination since its previous tick.

    ``*_fresh`` count the outcomes of jobs claimed at an epoch >= the state's
    current epoch; ``retry_after_s`` is the largest Retry-After in the window;
    ``interval_seconds`` is how long the window lasted (None: the tick's)."""

    accepted: int = 0
    refused: int = 0
    accepted_fresh: int = 0
    refused_fresh: int = 0
    retry_after_s: float | None = None
    interval_seconds: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Demand:
    """What the previous tick did with its plan."""

    budget: int = 0  # the plan's budget (0 when skipped)
    admitted: int = 0  # jobs claimed for it
    backlog_empty: bool = False  # due work ran out before the budget did
    inflight_capped: bool = False  # max_inflight capped the budget
    # the destination closed mid-tick (a Retry-After or a pause heard while
    # releasing): the tick's releases stopped this long after its start,
    # having published ``sent`` jobs; None: it did not close mid-tick
    open_seconds: float | None = None
    sent: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class TickPlan:
    budget: int  # jobs to claim now (live lane first, see live_budget)
    live_budget: int  # reserved for the live lane; unused reservation flows on
    spacing_seconds: float  # even spacing of `budget` jobs over the tick
    live_spacing_seconds: float  # spacing of the live jobs at the head of the tick
    next_deadline: float  # monotonic time of the next tick
    rate: float
    cooldown: bool = False
    paused: bool = False
    inflight_capped: bool = False
    ramp: float = 1.0  # slow start: the release rate at the tick's end over its start


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneSplit:
    live: int
    backlog: int


class PacerState(NamedTuple):
    """A destination's pacer between ticks. Immutable: the law returns a new
    one (``_replace``). A named tuple rather than a frozen dataclass: a tick
    makes several, for every active destination, and ``_replace`` of 34
    fields costs a seventh of ``dataclasses.replace`` (``bench.tick_cost``)."""

    rate: float  # admissions per second
    credit: float = 0.0  # fractional budget carried to the next tick, in [0, 1)
    last_tick: float = 0.0  # monotonic seconds
    deadline: float = 0.0  # monotonic seconds: the tick being run was due then
    epoch: int = 0  # incremented at each cut
    ceiling: float | None = None  # capacity remembered at the last episode
    firm: bool = False  # the ceiling comes from a mild episode's precise estimate
    episode: bool = False  # a cut awaits its first fresh outcomes
    heavy: bool = False  # ... and it was heavy (being refined)
    cut_from: float = 0.0  # rate at which the now stale jobs were sent
    cut_bound: float = 0.0  # upper bound of capacity from the heavy window
    stale_accepted: int = 0
    stale_outcomes: int = 0
    saved: float = 0.0  # jobs left unsent under the ceiling since the last cut
    surplus: float = 0.0  # jobs sent above the ceiling since the last cut
    ladder: float = 0.0  # doubling increase while the ceiling is stale
    since_cut_s: float = 0.0
    round_trip_s: float = 0.0  # measured: from a cut to its first fresh outcomes
    waiting_s: float = 0.0  # no round trip measured yet: since a release whose outcomes are unheard
    hold_s: float = 0.0  # no growth for this long (after a Retry-After)
    clean_s: float = 0.0  # clean, full-demand time at or above a firm ceiling since a refusal
    cooling: bool = False  # closed by a Retry-After
    delivered: float = 0.0  # average accepted rate
    window_rate: float = 0.0  # the last window's accepted rate while open
    braked: bool = False  # the last cut was a brake's (mid-tick)
    acc_refused: float = 0.0  # fresh refusals under the threshold, decayed (ACCUMULATE_S)
    acc_outcomes: float = 0.0  # ... and the fresh outcomes they were among
    peak: float = 0.0  # the rate before the last heavy cut, fading (PEAK_S)
    regrow: bool = False  # a probe's heavy cut (no stale outcomes refined it: grow back)
    token_wait: bool = False  # the last cut was a short Retry-After's (a token is due)
    since_wait_accepted: int = 0  # ... and the outcomes accepted since it
    dropped: bool = False  # a brake past slow start, and the cuts right after it: none heavy
    exited: bool = False  # slow start ended at a brake, and no clean window since: watched
    prepaid: bool = False  # the tick before was a reopening: it paid up to this tick
    flat: bool = False  # slow start: the last window's accepted rate stopped growing with the rate

    def to_dict(self) -> dict[str, float | int | bool | None]:
        """JSON-able, without the monotonic timestamps (not portable across hosts)."""
        return {name: getattr(self, name) for name in _PERSISTED}

    @classmethod
    def from_dict(
        cls, d: Mapping[str, object], *, now: float, params: PacingParams | None = None
    ) -> PacerState:
        """Resume from :meth:`to_dict` at ``now`` (the new leader's clock): the
        next tick runs at once and may admit one tick's worth. A resumed
        ceiling is not firm: the upstream may have stored capacity meanwhile.
        Missing keys take their defaults; a malformed value raises
        ``TypeError`` or ``ValueError``."""
        values: dict[str, float | int | bool | None] = {}
        for name in cls._fields:
            if name in _MONOTONIC or name == "firm" or name not in d:
                continue
            v, default = d[name], cls._field_defaults.get(name)  # rate has none
            if isinstance(default, bool):
                if not isinstance(v, bool):
                    raise TypeError(f"pacer state {name!r}: expected a boolean, got {v!r}")
                values[name] = v
            elif v is None and name == "ceiling":
                values[name] = None
            elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise TypeError(f"pacer state {name!r}: expected a number, got {v!r}")
            elif v < 0 or (name == "rate" and v == 0):
                raise ValueError(f"pacer state {name!r}: out of range: {v!r}")
            else:
                values[name] = int(v) if isinstance(default, int) else float(v)
        rate = values.pop("rate", None)
        if rate is None:
            raise ValueError("pacer state: 'rate' is missing")
        state = cls(rate=float(rate), last_tick=now, deadline=now)
        state = state._replace(**values)  # type: ignore[arg-type]
        if params is not None:
            tick = params.tick_seconds
            state = state._replace(rate=_clamp(state.rate, params), last_tick=now - tick)
        return state._replace(credit=min(state.credit, 0.999_999))


_PERSISTED = tuple(name for name in PacerState._fields if name not in _MONOTONIC)


def initial_state(params: PacingParams, now: float) -> PacerState:
    """A destination never paced before: slow start from ``initial_rate``; the
    first tick runs at ``now`` and may admit one tick's worth."""
    return PacerState(
        rate=_clamp(params.initial_rate, params),
        last_tick=now - params.tick_seconds,
        deadline=now,
    )


def next_deadline(deadline: float, now: float, tick_seconds: float) -> float:
    """The first point of the schedule ``deadline + k * tick_seconds`` (k >= 1)
    after ``now``: missed ticks are skipped, not replayed."""
    k = max(1, math.floor((now - deadline) / tick_seconds) + 1)
    return deadline + k * tick_seconds


def join_schedule(anchor: float, now: float, tick_seconds: float) -> float:
    """The deadline to carry when a destination joins, at ``now``, the
    schedule ``anchor + k * tick_seconds``: its first tick then ends on the
    schedule, at least half a tick and less than a tick and a half from now
    (a first tick squeezed into the last milliseconds before a schedule point
    would have no budget, and neither would the one after it)."""
    last = anchor + math.floor((now - anchor) / tick_seconds) * tick_seconds
    return last if last + tick_seconds - now >= tick_seconds / 2 else last + tick_seconds


def split_lanes(budget: int, live_due: int, backlog_due: int, params: PacingParams) -> LaneSplit:
    """Work-conserving lane split: the live lane has ``live_share`` of the
    budget reserved; what one lane cannot use flows to the other. Due counts
    need only be exact up to ``budget``."""
    budget, live_due, backlog_due = max(0, budget), max(0, live_due), max(0, backlog_due)
    reserve = min(budget, math.ceil(params.live_share * budget))
    live = min(live_due, max(reserve, budget - backlog_due))
    return LaneSplit(live=live, backlog=min(backlog_due, budget - live))


def publish_offsets(plan: TickPlan, n_live: int, n: int) -> list[float]:
    """Seconds after the tick's start at which to publish ``n`` claimed jobs,
    the ``n_live`` live ones first: these at ``live_spacing_seconds`` (a pace
    under the ceiling, so probes do not refuse them), the rest at the plan's
    release points over what remains of the tick: evenly, or, in a
    slow-start tick (``plan.ramp`` > 1), at a rate growing steadily by that
    factor from the tick's start to its end. A claim short of the budget
    takes the first of the budget's points: it goes out at the rate's pace
    and ends early, not stretched over the tick at a pace under the rate
    (the last jobs of a drain would otherwise finish a tick later)."""
    if n <= 0:
        return []
    points = max(plan.budget, n)
    span = plan.spacing_seconds * max(plan.budget, 1)
    live_sp = max(span / points, plan.live_spacing_seconds)
    if n_live <= 0 or n_live >= n or n_live * live_sp >= span:
        return _spread(n, points, 0.0, span, plan.ramp, first=0)
    head = n_live * live_sp
    # the first live job waits one live spacing too: a token has come in meanwhile
    return [(i + 1) * live_sp for i in range(n_live)] + _spread(
        n - n_live, points - n_live, head, span - head, plan.ramp, first=1
    )


def _spread(
    n: int, points: int, start: float, span: float, ramp: float, *, first: int
) -> list[float]:
    """The first ``n`` of ``points`` points over ``[start, start + span]``:
    the k-th (from ``first``) where ``k / points`` of a rate growing
    exponentially by ``ramp`` over the span (constant when ``ramp`` is 1)
    has been released."""
    if ramp <= 1.0 + 1e-9:
        return [start + (i + first) * span / points for i in range(n)]
    g = math.log(ramp)
    return [start + span * math.log1p((i + first) / points * (ramp - 1.0)) / g for i in range(n)]


def ramp_rate(plan: TickPlan, elapsed: float) -> float:
    """The release rate ``elapsed`` seconds into a tick planned as ``plan``
    (its rate, grown along its ramp)."""
    span = plan.spacing_seconds * max(plan.budget, 1)
    share = min(1.0, max(0.0, elapsed / span)) if span > 0 else 1.0
    return plan.rate * float(plan.ramp**share)


def _clamp(rate: float, p: PacingParams) -> float:
    return min(p.max_rate, max(p.min_rate, rate))


def _elapsed(state: PacerState, now: float, p: PacingParams) -> float:
    """The time since the last tick, at most two ticks (missed ticks are
    skipped) beyond the ticks the last plan skipped on purpose (``_skipped``)."""
    return min(max(0.0, now - state.last_tick), 2.0 * p.tick_seconds + _skipped(state, p))


def _skipped(state: PacerState, p: PacingParams) -> float:
    """The schedule's ticks the last plan left out (a sparse tick, see
    :func:`tick_budget`): its deadline past the one tick after it ran; 0
    for a tick on the schedule."""
    return max(0.0, state.deadline - state.last_tick - p.tick_seconds)


def _pressed(demand: Demand | None) -> bool:
    """Whether the tick released what the rate allowed: its whole budget, or
    up to ``max_inflight``, with due work left (not app-limited)."""
    return (
        demand is not None
        and demand.budget > 0
        and not demand.backlog_empty
        and (demand.admitted >= demand.budget or demand.inflight_capped)
    )


def _has_demand(demand: Demand | None) -> bool:
    """Whether the tick used its whole budget, with due work left and room in flight."""
    return _pressed(demand) and demand is not None and not demand.inflight_capped


def _slow_start_period(state: PacerState, p: PacingParams) -> float:
    """What slow start grows ``slow_start_factor`` over: a round trip, at least
    a tick and ``SLOW_START_PERIOD_S``."""
    return max(p.tick_seconds, state.round_trip_s, SLOW_START_PERIOD_S)


def _may_grow(
    state: PacerState,
    demand: Demand | None,
    p: PacingParams,
    *,
    now: float,
    inflight: int,
    paused: bool,
    returning: float,
) -> bool:
    """Whether a clean window of this tick would be evidence for growth: the
    tick used its whole budget (``_has_demand``), was not paused, admitted
    at least ``LOOP_SHARE`` of the rate over the time since the last tick
    (a loop that ran late released less than the rate: no growth on it),
    and no more than ``INFLIGHT_RTTS`` round trips of the rate are in flight
    (work piling up before slow workers reaches the upstream later) unless,
    in slow start, the outcomes come back (``returning``, a second) at
    ``HYSTART_SHARE`` of the rate or more: nothing piles up then, the calls
    take longer than the round trip measured. Past slow start, a rate whose
    tick holds ``HYSTART_MIN_OUTCOMES`` or more does not grow while the
    outcomes come back at under ``RETURN_SHARE`` of it: what it sent waits
    before workers slower than the rate (a ladder over a stale ceiling ran
    on to three times what they call, nothing refused meanwhile), and the
    in-flight bound, which grows with the rate, says so too late."""
    if paused or not _has_demand(demand):
        return False
    assert demand is not None
    if demand.admitted + 1 < LOOP_SHARE * state.rate * max(0.0, now - state.last_tick):
        return False
    sampled = state.rate * p.tick_seconds >= HYSTART_MIN_OUTCOMES  # a tick says enough
    if state.ceiling is not None and sampled and returning < RETURN_SHARE * state.rate:
        return False  # past slow start, what was sent waits before slower workers
    if inflight <= INFLIGHT_RTTS * state.rate * max(p.tick_seconds, state.round_trip_s):
        return True
    # in slow start, more in flight while the outcomes come back as fast as
    # the rate sends: that is the calls' latency, longer than the round trip
    # measured (its fastest outcome), not work piling up before the workers
    return state.ceiling is None and returning >= HYSTART_SHARE * state.rate


def _lift(
    state: PacerState,
    dt: float,
    p: PacingParams,
    *,
    sent: float,
    accepted_rate: float,
    accepted: float | None = None,
) -> float:
    """In slow start, the rate a refused window may leave at most when its
    tick ramped past its starting rate: what the upstream accepted of it
    (``accepted``, by default the window's ``accepted_rate``; a
    Retry-After's estimate), never above what was sent, nor above where the
    same window without its refusals would have grown the rate (refusals
    never raise the rate)."""
    clean = _grow(state, dt, accepted_rate, p).rate
    return max(state.rate, min(sent, accepted_rate if accepted is None else accepted, clean))


def _open_rate(
    window: OutcomeWindow, demand: Demand | None, p: PacingParams, before: float
) -> float | None:
    """The upstream's accepted rate while the destination was open, when a
    Retry-After closed it mid-tick: what it accepted of the jobs the tick
    sent before closing over the time they were sent in (the rest of the
    window was closed time, which a rate over the whole window counts as
    delivering nothing). Closed too soon after its start to say
    (``OPEN_MIN_TICKS``), the refusal was of the tick before's calls: that
    window's accepted rate (``before``). None when the tick did not close
    mid-tick."""
    if demand is None or demand.open_seconds is None:
        return None
    if demand.open_seconds < OPEN_MIN_TICKS * p.tick_seconds:
        return before or None
    # outcomes of the tick before may be in the window too: never more than it sent
    accepted = min(window.accepted, max(0, demand.sent - window.refused))
    return accepted / demand.open_seconds


def _first_round_trip(
    state: PacerState, window: OutcomeWindow, demand: Demand | None, dt: float
) -> PacerState:
    """Before any cut has measured the round trip: a tick that released jobs
    and then heard no outcome at all starts a wait, and the first tick to
    hear one ends it; the wait is the round trip (to a tick over: the first
    of those jobs left at the start of its tick). A round trip within a tick
    is never measured here: it counts as the tick, as before. Without it,
    calls that take longer than ``INFLIGHT_RTTS`` ticks keep more than that
    many ticks of the rate in flight, and slow start never grows."""
    heard = window.accepted + window.refused > 0
    if heard and state.waiting_s > 0.0:
        measured = min(FIRST_ROUND_TRIP_MAX_S, state.waiting_s + dt)
        return state._replace(round_trip_s=measured, waiting_s=0.0)
    if state.waiting_s > 0.0 or (demand is not None and demand.admitted > 0 and not heard):
        return state._replace(waiting_s=state.waiting_s + dt)
    return state


def _flat(
    state: PacerState,
    p: PacingParams,
    accepted_rate: float,
    interval: float,
    *,
    delivered: float,
    previous: float,
) -> bool:
    """In slow start: whether a window's accepted rate stopped growing with
    the rate (saturation, not outcomes on their way): under ``HYSTART_SHARE``
    of the rate, and no higher than the average before it (``delivered``) or
    than the window before (``previous``) grown by half of slow start's growth
    over the window (in log terms: a rate that grew by its factor while what
    the upstream accepted grew by less than its square root)."""
    if accepted_rate >= HYSTART_SHARE * state.rate:
        return False
    half = p.slow_start_factor ** (interval / (2.0 * _slow_start_period(state, p)))
    return accepted_rate <= delivered or accepted_rate <= previous * half


def _short(state: PacerState, p: PacingParams) -> bool:
    """No round trip over ``SHORT_RTT_TICKS`` measured, none being measured:
    a tick's outcomes follow its releases within the next tick (a cut's round
    trip counts to the tick that hears its first fresh outcomes: a tick or a
    little more for calls of milliseconds; one measured before the first cut
    is two ticks at least)."""
    return state.round_trip_s <= SHORT_RTT_TICKS * p.tick_seconds and state.waiting_s <= 0.0


def _outcomes_base(state: PacerState, p: PacingParams, outcomes: int, sent: float) -> float:
    """What a window's fresh refusals are a share of: its ``outcomes``, or,
    on a long round trip (not :func:`_short`), the jobs ``sent`` over it when
    more. A 429 comes back at once and an accepted call only after its
    latency, so such a window hears the refusals of what was just sent and
    the acceptances of what went out a round trip before, at a lower rate:
    its outcomes alone overstate the refusals' share."""
    return float(outcomes) if _short(state, p) else max(float(outcomes), sent)


def update_rate(
    state: PacerState,
    window: OutcomeWindow,
    demand: Demand | None,
    *,
    now: float,
    params: PacingParams,
    cooldown_remaining_s: float = 0.0,
    paused: bool = False,
    inflight: int = 0,
) -> PacerState:
    """The law's step: the state after this tick's window (budget untouched)."""
    p, m = params, params.decrease_margin
    # the bounds hold on every path, also right after a reload moved them
    rate = _clamp(state.rate, p)
    if rate != state.rate:
        state = state._replace(rate=rate)
    dt = _elapsed(state, now, p)
    interval = window.interval_seconds or dt
    returning = (window.accepted + window.refused) / interval if interval > 1e-9 else 0.0
    may_grow = _may_grow(
        state, demand, p, now=now, inflight=inflight, paused=paused, returning=returning
    )
    accepted_rate = window.accepted / interval if interval > 1e-9 else 0.0
    delivered_before, window_before = state.delivered, state.window_rate
    delivered, window_rate = delivered_before, window_before
    if interval > 1e-9 and not state.cooling:  # a closed destination delivers nothing
        w = 1.0 - math.exp(-interval / (DELIVERED_TICKS * p.tick_seconds))
        delivered = state.delivered + w * (accepted_rate - state.delivered)
        window_rate = accepted_rate
    state = state._replace(  # the window heard and the time gone, in one new state
        delivered=delivered,
        window_rate=window_rate,
        since_wait_accepted=state.since_wait_accepted + window.accepted if state.token_wait else 0,
        # by the time really gone (a parked destination's drop is old news)
        peak=state.peak * math.exp(-max(0.0, now - state.last_tick) / PEAK_S),
        since_cut_s=state.since_cut_s + dt,
        hold_s=state.hold_s if state.cooling else max(0.0, state.hold_s - dt),
    )
    if state.round_trip_s <= 0.0:
        state = _first_round_trip(state, window, demand, dt)

    if window.retry_after_s is not None and window.refused_fresh > 0 and not state.cooling:
        retry_after = max(0.0, window.retry_after_s)
        rtt = max(p.tick_seconds, state.round_trip_s)
        token_wait = retry_after <= SHORT_RETRY_AFTER_RTTS * rtt
        if token_wait:
            # a Retry-After as short as a few round trips says when the next
            # token comes (an API that sends one with every 429), not a penalty
            # box: hold a few round trips, then probe as after any cut
            hold = min(retry_after / max(m, 0.01), SHORT_HOLD_RTTS * rtt)
        else:
            hold = retry_after / max(m, 0.01)
        est = max(delivered_before, accepted_rate) or state.rate
        opened = _open_rate(window, demand, p, window_before) if token_wait else None
        if opened is not None:
            est = max(est, opened)
        if state.ceiling is not None and est > state.ceiling:
            est = max(state.ceiling, est * (1.0 - m))
        if token_wait and state.token_wait and state.hold_s > 0 and state.since_cut_s > 0:
            # refused again at the rate it reopened at: the bucket was empty
            # at both Retry-Afters, so the refill rate lies between what it
            # let through over the whole cycle (all, if the bucket held what
            # refilled while closed) and the window's open rate (all, if it
            # held nothing): the geometric mean of the two (the **Retry-After** cycle)
            cycle = max(state.since_wait_accepted / state.since_cut_s, p.decrease_factor * est)
            est = min(est, math.sqrt(cycle * est))
        rate = state.rate
        # slow start's tick ramped past its rate, and used its budget or was
        # closed mid-tick: reopen under what the upstream accepted of it, not
        # under the rate the ramp began at
        ramped = demand is not None and dt > 0 and state.ceiling is None
        if ramped and (opened is not None or may_grow):
            assert demand is not None
            sent = demand.admitted / dt if opened is None else opened
            rate = _lift(state, dt, p, sent=sent, accepted=est, accepted_rate=accepted_rate)
        state = state._replace(
            rate=_clamp(rate, p),
            cooling=True,
            ceiling=max(p.min_rate, est),
            # a token's wait is no penalty box: probe as after a mild cut (an
            # estimate too high is refused again in the hold, and measured
            # over its cycle), and a rate refused under a firm ceiling is a
            # peak the capacity fell from, as a heavy cut's
            firm=token_wait,
            peak=max(state.peak, state.rate) if token_wait and state.firm else state.peak,
            epoch=state.epoch + 1,
            episode=False,
            dropped=False,
            exited=False,
            saved=0.0,
            surplus=0.0,
            ladder=0.0,
            since_cut_s=0.0,
            clean_s=0.0,
            hold_s=hold,
            token_wait=token_wait,
            since_wait_accepted=0,
        )
    if cooldown_remaining_s > 0:
        return state if state.cooling else state._replace(cooling=True)
    if state.cooling:  # reopened: resume just under the remembered ceiling
        base = min(state.rate, state.ceiling or state.rate)
        return state._replace(
            cooling=False, rate=_clamp(base * p.ceiling_resume_fraction, p), credit=0.0
        )

    sent = state.rate
    if demand is not None and (demand.backlog_empty or demand.inflight_capped) and dt > 0:
        sent = min(sent, demand.admitted / dt)
    elif demand is not None and state.ceiling is None and dt > 0:
        sent = max(sent, demand.admitted / dt)  # a slow-start tick ramps past its rate
    if state.ceiling is not None and dt > 0:  # what the upstream could have stored
        actual = demand.admitted / dt if demand is not None else 0.0
        span = dt if demand is not None else max(dt, interval)
        gap = state.ceiling * span - actual * dt
        state = state._replace(
            saved=state.saved + max(0.0, gap), surplus=state.surplus + max(0.0, -gap)
        )

    f_ref = window.refused_fresh
    f_n = window.accepted_fresh + window.refused_fresh
    if state.exited and f_n > 0 and f_ref == 0:
        state = state._replace(exited=False)  # a clean window: slow start's brake is past
    episode = f_ref > 0 and f_ref >= _calling(f_n, p)
    if state.episode or state.ceiling is None:
        state = state._replace(acc_refused=0.0, acc_outcomes=0.0)
    else:  # refusals under the threshold, tick after tick, add up (ACCUMULATE_S)
        keep = math.exp(-dt / ACCUMULATE_S)
        acc_ref = state.acc_refused * keep + f_ref
        acc_n = state.acc_outcomes * keep + f_n
        state = state._replace(acc_refused=acc_ref, acc_outcomes=acc_n)
        if not episode and f_ref > 0:
            episode = acc_ref >= _calling(acc_n, p)
            if episode:
                f_ref, f_n = max(1, round(acc_ref)), max(1, round(acc_n))
    # what the fresh refusals are a share of, for a cut's estimate
    base = f_n
    if episode:
        base = round(_outcomes_base(state, p, f_n, sent * min(interval, state.since_cut_s)))
    if state.episode:
        state = _refine(state, window, p)
        if episode:
            return _cut(state, f_ref, base, sent, p, accepted_rate)
        if f_n == 0:
            return state
        rtt, seen = state.round_trip_s, state.since_cut_s
        # a heavy cut whose window already held its round trip's outcomes
        # (a round trip shorter than the tick) has nothing left to refine it
        regrow = state.regrow and state.stale_outcomes < REFINE_MIN_OUTCOMES
        return state._replace(
            episode=False,
            round_trip_s=0.7 * rtt + 0.3 * seen if rtt else seen,
            regrow=regrow,
            dropped=False,
        )
    if episode and state.ceiling is None:
        # slow start ends on evidence, at what the upstream accepts: a couple of
        # refusals in a small sample may be a burst or another sender's probe
        # (the rate holds on them, below)
        if f_n * p.refusal_threshold >= p.refusal_min_count or (
            _heavy(f_ref, f_n, p) and f_ref >= START_MIN_FACTOR * p.refusal_min_count
        ):
            lift = state.rate
            if may_grow:
                lift = _lift(state, dt, p, sent=sent, accepted_rate=accepted_rate)
            return _end_slow_start(state, f_ref, base, sent, accepted_rate, p, lift=lift)
        episode = False
    if episode:
        state = _cut(state, f_ref, base, sent, p, accepted_rate)
        if demand is None:  # a leader's first tick: the bucket may have refilled
            state = state._replace(saved=(state.ceiling or 0.0) * interval)
        return state
    # slow start meets saturation (HyStart) when what the upstream accepts
    # stops growing with the rate: not outcomes still on their way, nor a
    # tick that had less to send than the rate (app-limited)
    flat = (
        state.ceiling is None
        and f_n >= HYSTART_MIN_OUTCOMES
        and _pressed(demand)
        and _flat(
            state, p, accepted_rate, interval, delivered=delivered_before, previous=window_before
        )
    )
    if flat and state.flat and f_ref == 0 and _short(state, p):
        # twice in a row on a short round trip: what holds it back is past the
        # upstream (workers that call slower than the rate), and every tick at
        # the rate piles up more work before them: end at what they pass
        low = max(p.min_rate, accepted_rate * (1.0 - p.decrease_margin))
        rate = _clamp(min(state.rate, low), p)
        return state._replace(rate=rate, ceiling=low, firm=True, flat=False)
    if flat != state.flat:
        state = state._replace(flat=flat)
    if not may_grow:
        return state
    if f_ref > 0 and state.ceiling is not None and state.rate >= state.ceiling:
        # refusals under the threshold: hold, do not grow into them
        return state._replace(ladder=0.0, saved=0.0, surplus=0.0, clean_s=0.0)
    if state.ceiling is None and (f_ref > 0 or flat):
        # slow start holds on a refusal under the threshold or a flat window
        # (a ramping tick at what it accepted, if more than the rate it began at)
        return state._replace(rate=_lift(state, dt, p, sent=sent, accepted_rate=accepted_rate))
    if f_ref > 0:  # any refusal: the upstream was empty just then, the ceiling not stale
        state = state._replace(clean_s=0.0)
    return _grow(state, dt, accepted_rate, p)


def watches(state: PacerState, params: PacingParams, *, inflight: int) -> bool:
    """Whether a tick in ``state`` may be braked mid-tick: while open, in slow
    start and until a clean window after a brake ended it (``exited``), and
    past it when the tick's outcomes come back within a small part of it
    (``inflight`` jobs at its start, released at ``state.rate``, are under
    ``BRAKE_LAG_TICKS`` of a tick's worth: a round trip that short)."""
    if state.cooling:
        return False
    if state.ceiling is None or state.exited:
        return True
    return inflight <= BRAKE_LAG_TICKS * params.tick_seconds * state.rate


def brake(
    state: PacerState, window: OutcomeWindow, params: PacingParams, *, sent: float | None = None
) -> PacerState | None:
    """Mid-tick: the state after the fresh outcomes heard since the tick
    began (``window``), or None when they do not call for a cut before the
    next tick (the module docstring's **Brake**). ``sent``: the rate the
    tick releases at by now (:func:`ramp_rate`; default the state's rate).
    The cut moves the epoch, so the outcomes of the jobs sent before it count as stale and never cut
    again; the next tick's fresh outcomes confirm or correct it."""
    p = params
    refused = window.refused_fresh
    outcomes = window.accepted_fresh + refused
    if state.cooling:
        return None
    least = max(1, BRAKE_MIN_FACTOR * p.refusal_min_count)
    if refused < least:
        return None
    if refused < BRAKE_RATIO * outcomes:
        return None
    drop_share = refused >= BRAKE_DROP_RATIO * outcomes
    # a drop once enough outcomes tell it; sooner when most of them are refused
    sure = refused >= BRAKE_SURE_RATIO * outcomes and refused >= 2 * least
    drop = drop_share and (outcomes >= BRAKE_DROP_OUTCOMES or sure)
    probe = state.ceiling is not None and state.ladder > 0 and not drop_share
    if state.ceiling is not None and not (drop or probe):
        return None  # past slow start, only a capacity that fell: not a probe's few refusals
    sent = max(state.rate, sent or 0.0)
    span = window.interval_seconds or 0.0
    n = _outcomes_base(state, params, outcomes, sent * span)
    share = (n - refused + 0.5) / (n + 1.0)
    est = sent * share
    # after slow start's brake, the tick releases evenly at the brake's rate:
    # the share of what it sent measures (the accepted rate since the last
    # clean reading counts the time before these outcomes began to come)
    exited = state.exited and state.ceiling is not None
    if span >= BRAKE_MIN_SPAN_S and window.accepted >= BRAKE_MIN_ACCEPTED and not exited:
        # the outcomes heard left a round trip ago, at a lower point of the
        # ramp than ``sent``; while the upstream refuses, what it accepts
        # per second is its refill rate, whatever was sent
        est = min(est, (window.accepted + 0.5) / span)
    est = max(p.min_rate, est)
    # a probe's overshoot: just under the rung it stepped from at least (its
    # window was clean); otherwise cut on the estimate
    rung = state.rate - state.ladder
    floor = rung * (1.0 - p.decrease_margin) if probe else p.decrease_factor * sent
    rate = _clamp(min(sent, max(est * (1.0 - p.decrease_margin), floor)), p)
    # past slow start (and its brake's overshoot): a capacity that fell
    fell = state.ceiling is not None and not probe and not exited
    return _new_episode(
        state,
        rate=rate,
        ceiling=rate if probe else est * (1.0 - p.decrease_margin),
        firm=True,
        heavy=False,
        cut_from=sent,
        cut_bound=est,
        hold_s=0.0,
        braked=True,
        # past slow start, a tick braked this hard met a capacity that fell:
        # the cuts that follow it, until a clean window, are of no mixed window
        peak=max(state.peak, sent) if fell else state.peak,
        dropped=fell,
        exited=exited or state.ceiling is None,
    )


def _new_episode(state: PacerState, **cut: float | bool) -> PacerState:
    """``state`` after a cut (``cut``: its rate, ceiling and kind): a new
    epoch awaiting its first fresh outcomes, the evidence gathered under the
    old one forgotten."""
    forgotten = {"regrow": False, "token_wait": False, "dropped": False}  # unless the cut says
    return state._replace(
        epoch=state.epoch + 1,
        episode=True,
        stale_accepted=0,
        stale_outcomes=0,
        saved=0.0,
        surplus=0.0,
        ladder=0.0,
        since_cut_s=0.0,
        clean_s=0.0,
        acc_refused=0.0,
        acc_outcomes=0.0,
        **(forgotten | cut),  # type: ignore[arg-type]
    )


def _calling(outcomes: float, p: PacingParams) -> float:
    """How many refusals among ``outcomes`` call a refusal episode."""
    return max(p.refusal_min_count, p.refusal_threshold * outcomes)


def _heavy(refused: int, outcomes: int, p: PacingParams) -> bool:
    return refused >= HEAVY_MIN_FACTOR * p.refusal_min_count and refused > HEAVY_RATIO * outcomes


def _cut(
    state: PacerState,
    refused: int,
    outcomes: int,
    sent: float,
    p: PacingParams,
    accepted_rate: float = 0.0,
) -> PacerState:
    # a window right after a brake is of jobs claimed at its rate: no mix of
    # outcomes from before and after a capacity change (the brake saw that);
    # nor is one while a heavy cut awaits its first fresh outcomes: the floor
    # it sent at is what their refusals measure (a floor over a capacity that
    # fell further, or a small bucket's noise); a second floor would compound
    # the first
    heavy = _heavy(refused, outcomes, p) and not (state.braked or state.dropped)
    heavy = heavy and not (state.heavy and state.episode)
    # a ladder's probe overshot, or a regrowth's step (a probe toward the
    # bound of a probe's cut): the capacity it found is near its bound,
    # unlike a drop's, whose window mixes what came before it
    probe = heavy and (state.ladder > 0 or state.regrow)
    if heavy:
        est = max(p.min_rate, sent * (1.0 - refused / outcomes))
    else:
        # only the refusals beyond those that called the episode are its
        # excess (the module docstring's **Cut**: shares of shared senders)
        excess = max(0.0, refused - _calling(outcomes, p))
        est = max(p.min_rate, sent * (1.0 - excess / outcomes))
        # what the upstream accepted, in this window and on average alike (the
        # window alone may be a batch, the average alone may lag a drop), never
        # above what was sent, is a lower bound of its refill rate: refusals of
        # bursts reaching a small bucket do not compound cut after cut under it
        est = max(est, min(sent, state.delivered, accepted_rate))
    # ... and when the window accepted at least the rate its last step began
    # from, it measured that step's overshoot: cut just under it, no floor
    overshoot = probe and est >= state.rate - state.ladder
    if overshoot:
        target = min(est, state.rate) * (1.0 - p.decrease_margin)
    else:
        target = p.decrease_factor * state.rate if heavy else est * (1.0 - p.decrease_margin)
    rate = min(state.rate, max(target, p.decrease_factor * state.rate))
    return _new_episode(
        state,
        peak=max(state.peak, sent) if heavy else state.peak,
        rate=_clamp(rate, p),
        ceiling=est if heavy else est * (1.0 - p.decrease_margin),
        firm=not heavy,
        heavy=heavy,
        cut_from=sent,
        cut_bound=est,
        braked=False,
        dropped=state.dropped,  # never heavy while it holds (above)
        regrow=probe,
    )


def _end_slow_start(
    state: PacerState,
    refused: int,
    outcomes: int,
    sent: float,
    accepted_rate: float,
    p: PacingParams,
    *,
    lift: float,
) -> PacerState:
    """The first episode of slow start: the rate was still growing while these
    outcomes were on their way, so ``sent * accepted share`` overstates the
    capacity by that growth; the rate drops to the accepted rate measured (the
    window's, or the average when outcomes came in a batch), never above that
    estimate. Never heavy: slow start ends before the capacity could change
    under a window's outcomes. ``lift``: how far a ramping tick may raise the
    rate it began at (:func:`_lift`)."""
    before = state.rate  # the rate the tick began at (a ramping tick sent more)
    state = _cut(state, refused, outcomes, sent, p)
    measured = max(accepted_rate, state.delivered)
    est = min(state.cut_bound, measured) if measured > 0 else state.cut_bound
    low = est * (1.0 - p.decrease_margin)
    # just under what was accepted (``low``), however far under it the ramp
    # began (back at its start, the capacity would go unused while the rate
    # climbed back), within the lift; a tick that began above ``low`` keeps
    # at most its rate, cut no deeper than decrease_factor of what was sent
    rate = min(max(before, min(low, lift)), sent, max(low, p.decrease_factor * sent))
    return state._replace(
        rate=_clamp(rate, p), ceiling=max(p.min_rate, low), firm=True, heavy=False
    )


def _refine(state: PacerState, window: OutcomeWindow, p: PacingParams) -> PacerState:
    """After a heavy cut, stale outcomes of the same round trip measure the
    capacity: raise the rate to just under it (never lower it)."""
    if not state.heavy:
        return state
    accepted = state.stale_accepted + window.accepted - window.accepted_fresh
    outcomes = accepted + state.stale_outcomes - state.stale_accepted
    outcomes += window.refused - window.refused_fresh
    if outcomes <= 0:
        return state
    share = (accepted + 0.5) / (outcomes + 1.0)  # never 0 or 1 on a small sample
    low = max(0.0, share - REFINE_Z * math.sqrt(share * (1.0 - share) / outcomes))
    est = max(p.min_rate, min(state.cut_bound, state.cut_from * share))
    floor_rate = min(est, state.cut_from * low) * (1.0 - p.decrease_margin)
    return state._replace(
        stale_accepted=accepted,
        stale_outcomes=outcomes,
        ceiling=est,
        rate=max(state.rate, _clamp(floor_rate, p)),
    )


def _grow(state: PacerState, dt: float, accepted_rate: float, p: PacingParams) -> PacerState:
    tick, rate = p.tick_seconds, state.rate
    rtt = max(tick, state.round_trip_s)  # growth is per round trip, at least a tick
    if state.ceiling is None:  # slow start, paced by what the upstream accepts
        grown = rate * p.slow_start_factor ** (dt / _slow_start_period(state, p))
        grown = min(grown, max(rate, p.slow_start_factor * accepted_rate))
        return state._replace(rate=_clamp(grown, p))
    c, m = state.ceiling, p.decrease_margin
    low = c * (1.0 - m)
    step = p.increase_step * dt / rtt
    slack = 0.5 * m * c * min(state.since_cut_s, STALE_HORIZON_S)
    slack += max(0.0, rate - c) * (rtt + 1.0)  # outcomes still on their way
    ladder, clean = state.ladder, state.clean_s
    if state.firm and rate >= c and state.hold_s <= 0:
        clean += dt
    # well under the rate of a recent drop, the capacity may come back at any
    # time: probe sooner and in larger steps (a probe there costs little); so
    # after a token's wait: its bucket refills while a probe's closure lasts
    soon = c < PEAK_GAP * state.peak or state.token_wait
    probe_rtts = PEAK_PROBE_RTTS if soon else PROBE_RTTS
    top = PEAK_LADDER_MAX if rate < PEAK_GAP * state.peak else LADDER_MAX
    if state.hold_s > 0:
        pass  # after a Retry-After: stay just under the remembered ceiling
    elif ladder > 0:  # capped: a probe overshoots by its last step
        ladder = min(ladder * 2.0 ** (dt / rtt), top * rate)
        rate += min(ladder * dt / rtt, top * rate)
    elif (state.firm and rate >= c and clean >= probe_rtts * rtt) or (
        state.surplus > state.saved + 2.0 * slack
        and rate > c * (1.0 if state.firm else SOFT_FACTOR)
    ):
        ladder = step  # the ceiling is stale: the upstream has grown
        rate += ladder
    elif rate < low and not state.firm:
        grown = rate * REGROW ** (dt / rtt) if state.regrow else rate
        rate = min(low, max(rate + 2.0 * step, grown))
    elif rate < low:
        rate = min(low, rate + max(step, (low - rate) * min(1.0, dt / (2.0 * rtt))))
    elif rate < c:
        rate = min(c, rate + step)
    else:
        rate += step
    return state._replace(rate=_clamp(rate, p), ladder=ladder, clean_s=clean)


CATCH_UP = 1.25  # the most a late tick's budget may exceed the rate over its span


def tick_budget(
    state: PacerState,
    *,
    now: float,
    inflight: int,
    params: PacingParams,
    cooldown_remaining_s: float = 0.0,
    paused: bool = False,
    reopening: bool = False,
    growth: float = 1.0,
) -> tuple[PacerState, TickPlan]:
    """The tick arithmetic: budget, credit, spacing and the next deadline.

    A tick pays for the time since the one before it (``rate x elapsed``).
    Its deadline is the schedule's next point at least half a tick away: a
    tick run late, less than half a tick before the next point (the one
    before it ended late), spans to the point after, rather than paying for
    a few milliseconds, sending nothing and leaving the next tick a few
    milliseconds to pay for too. So every tick but a reopening pays for at
    least half a tick, and at a rate of a job a tick or more no two ticks in
    a row send nothing.
    A *reopening* tick (``reopening``: run before its deadline because the
    destination opened since the last tick found it closed — its cool-down
    ran out, or it was resumed) keeps the schedule's next point as its
    deadline and pays for the time left until then; the tick after it pays
    for its own span, not for the time since the reopening (already paid).
    A slow-start tick (``growth`` > 1, the rate's growth per second) releases
    at a rate that keeps growing over what it pays for, from the rate on, as
    the next tick's step will have grown it (``TickPlan.ramp``): no jump
    of a whole factor at a tick's start, for a brake to catch a round trip
    after it began. A *sparse* plan, for a rate under a job a tick: when the
    next ticks of the schedule would have no whole job to send and could not
    grow the rate (this tick used no budget, or the rate is at ``max_rate``),
    the next deadline is the first point with a job (at most
    ``SPARSE_MAX_TICKS`` ahead), and that tick pays for the time it skipped
    (``_skipped``): one tick a job instead of one a ``tick_seconds``."""
    p = params
    elapsed = _elapsed(state, now, p)
    early = reopening and now < state.deadline
    if early:
        deadline = state.deadline
    else:  # a tick run late, near the next point, spans to the one after it
        deadline = next_deadline(state.deadline, now, p.tick_seconds)
        if deadline - now < p.tick_seconds / 2:
            deadline += p.tick_seconds
    span = max(deadline - now, 1e-9)
    room = max(0, p.max_inflight - inflight)
    cooldown = cooldown_remaining_s > 0
    budget, credit, capped, ramp = 0, 0.0, False, 1.0
    if not (cooldown or paused):
        # a late tick catches up on the time since the last one, but never
        # releases faster than CATCH_UP x the rate over what is left of it
        # (the ticks a sparse plan skipped on purpose are paid in full); under
        # a job a tick it pays it all: a job or two, not a burst, and a loop
        # running late would otherwise starve it of what it is owed
        if early or state.prepaid:
            pay = span
        elif state.rate * p.tick_seconds < 1.0:
            pay = elapsed
        else:
            pay = min(elapsed, CATCH_UP * span + _skipped(state, p))
        # the ramp stops at max_rate; none when nothing is paid for or no room is left
        ramp = min(growth**pay, p.max_rate / state.rate) if growth > 1.0 else 1.0
        if ramp > 1.0 + 1e-9:
            raw = state.credit + state.rate * pay * (ramp - 1.0) / math.log(ramp)
        else:
            ramp, raw = 1.0, state.credit + state.rate * pay
        whole = math.floor(raw)
        credit, capped = raw - whole, whole > room
        budget = min(whole, room)
        if ramp == 1.0 and not early and (whole == 0 or state.rate >= p.max_rate):
            # sparse: the next ticks of the schedule would have no whole job to
            # send, and could not grow the rate (growth needs a budget used, or
            # room under max_rate): the next tick is the one that has a job; the
            # outcomes heard meanwhile are read then, before it sends
            # (the rate is at least min_rate, which the config keeps positive)
            owed = credit + state.rate * (deadline - now)
            if owed < 1.0:
                more = math.ceil((1.0 - owed) / (state.rate * p.tick_seconds) - 1e-9)
                deadline += min(more, SPARSE_MAX_TICKS - 1) * p.tick_seconds
    live_pace = min(state.rate, state.ceiling or state.rate) * LIVE_PACE
    plan = TickPlan(
        budget=budget,
        live_budget=min(budget, math.ceil(p.live_share * budget)),
        spacing_seconds=span / budget if budget > 0 else span,
        live_spacing_seconds=1.0 / live_pace if live_pace > 0 else span,
        next_deadline=deadline,
        rate=state.rate,
        cooldown=cooldown,
        paused=paused,
        inflight_capped=capped,
        ramp=ramp,
    )
    return state._replace(credit=credit, last_tick=now, deadline=deadline, prepaid=early), plan


def plan_tick(
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
    """One tick of one destination: the law's step, then the tick arithmetic.

    ``demand`` is what the previous tick did (None on a leader's first tick);
    ``cooldown_remaining_s`` the Retry-After closure left (from the ledger);
    ``paused``: admit nothing and do not grow (outcomes still count);
    ``reopening``: run early, the destination closed at the last tick and
    open since (see :func:`tick_budget`). A tick whose step grew the rate in
    slow start ramps on at that growth (:func:`tick_budget`'s ``growth``)."""
    before = state.rate
    state = update_rate(
        state,
        window,
        demand,
        now=now,
        params=params,
        cooldown_remaining_s=cooldown_remaining_s,
        paused=paused,
        inflight=inflight,
    )
    growth = 1.0
    # (a hold on a few refusals may lift the rate to what a ramp accepted: no growth)
    grew = state.rate > before and window.refused_fresh == 0
    if state.ceiling is None and not state.episode and grew:
        growth = params.slow_start_factor ** (1.0 / _slow_start_period(state, params))
    return tick_budget(
        state,
        now=now,
        inflight=inflight,
        params=params,
        cooldown_remaining_s=cooldown_remaining_s,
        paused=paused,
        reopening=reopening,
        growth=growth,
    )
