"""What the demo shows: per-second samples, the live terminal view (rich), the
closing summary and the PNG chart of rate vs capacity (matplotlib, Agg).

Owns presentation and the end-of-run checks (utilization while backlog was
due, refusal %, time to 90 % of the capacity after a step up, duplicate side
effects from the upstreams' idempotency keys, jobs lost from the ledger); it
starts and stops nothing (``runner`` does), and imports nothing of the runner:
what it needs of a run is the plan (``plan``).

What the figures measure (``backlog_seconds``, ``utilization``,
``step_up_recoveries``): a destination is judged only on the seconds when it
had backlog it could have sent. Its backlog is the overdue jobs the run
scheduled at the start (their retries included), not the live trickle, which
keeps "due" above zero after the backlog is gone and would count seconds in
which no pacer could have filled the capacity. A second counts when backlog
jobs were due and unclaimed both when it began and when it ended, from the
first second in which the upstream saw a call (before it, the processes are
starting: reported apart as start-up, not counted).
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pacerd.statusview import human_seconds
from pacerd_demo.plan import backlog_prefix, capacity_calls

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

    from rich.console import Console, RenderableType

    from pacerd.client import Client
    from pacerd.testing.upstream import CapacitySchedule, ModelUpstream
    from pacerd_demo.plan import DemoPlan

_SPARKS = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One destination at one second of the run."""

    t: float  # seconds since the run started, when the sample was taken
    # the upstream's last whole second before t: [second, second + 1) after it started
    second: int
    destination: str
    capacity: float  # the upstream's capacity in that second
    accepted: int  # calls the upstream accepted in that second
    refused: int
    errors: int
    rate: float | None  # the pacer's rate, as its leader persisted it
    due: int  # due and unclaimed at t, live jobs included
    backlog_due: int  # of those, the run's backlog (its overdue jobs, retries included)
    inflight: int
    oldest_due_age_seconds: float | None
    drain_eta_seconds: float | None
    completed: int
    dead: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationSummary:
    destination: str
    utilization: float | None  # accepted / capacity over the backlog seconds (None: none)
    backlog_seconds: int  # the seconds that count (``backlog_seconds``)
    startup_seconds: float | None  # from the start to the end of the first second with a call
    accepted: int
    refused: int
    errors: int
    completed: int
    due_left: int
    dead: int
    duplicates: int
    step_ups: tuple[StepUpRecovery, ...] = ()  # each capacity step up within the run

    @property
    def refusal_ratio(self) -> float:
        calls = self.accepted + self.refused + self.errors
        return self.refused / calls if calls else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoSummary:
    destinations: list[DestinationSummary]
    scheduled: int
    missing: int  # scheduled jobs the ledger does not know
    completed_without_effect: int  # completed, but the upstream never accepted the call
    live_wait_p50: float | None  # seconds from due to completed, live jobs
    live_wait_p95: float | None

    @property
    def duplicates(self) -> int:
        return sum(d.duplicates for d in self.destinations)

    @property
    def lost(self) -> int:
        return self.missing + self.completed_without_effect


STEP_UP_SHARE = 0.9  # a step up is caught up once a second accepts this share of it


def second_capacity(schedule: CapacitySchedule, sample: Sample) -> float:
    """The calls the upstream could accept in the sample's second (its
    schedule's integral over it: a step inside the second counts pro rata)."""
    return capacity_calls(schedule, float(sample.second), sample.second + 1.0)


def startup_seconds(history: Sequence[Sample]) -> float | None:
    """From the start to the end of the first second in which the upstream saw
    a call (None: it saw none)."""
    first = next((s for s in history if s.accepted + s.refused + s.errors), None)
    return None if first is None else first.second + 1.0


def counts(history: Sequence[Sample]) -> list[bool]:
    """Whether each sample's second counts: from the first second with a call
    on, those whose backlog had jobs due and unclaimed when the second began
    (the sample before; the first sample: its own) and when it ended."""
    started, flags = False, []
    for i, s in enumerate(history):
        started = started or s.accepted + s.refused + s.errors > 0
        before = history[i - 1].backlog_due if i else s.backlog_due
        flags.append(started and before > 0 and s.backlog_due > 0)
    return flags


def backlog_seconds(history: Sequence[Sample]) -> list[Sample]:
    """The samples of the seconds that count (``counts``)."""
    return [s for s, c in zip(history, counts(history), strict=True) if c]


def utilization(schedule: CapacitySchedule, history: Sequence[Sample]) -> float | None:
    """Accepted calls / the upstream's capacity, over ``backlog_seconds``
    (None: no second counts)."""
    counted = backlog_seconds(history)
    capacity = sum(second_capacity(schedule, s) for s in counted)
    return sum(s.accepted for s in counted) / capacity if capacity else None


@dataclass(frozen=True, slots=True, kw_only=True)
class StepUpRecovery:
    """One capacity step up: how long until a second accepted ``STEP_UP_SHARE``
    of its capacity, measured only while backlog remained."""

    at: float  # seconds after the upstream started (a ramp: where it reaches the new level)
    capacity: float  # the new level
    seconds: float | None  # step up → end of the first such second; None: not seen
    watched: float  # seconds watched after the step up with backlog left
    ended_by: str  # "caught up", "backlog ran out" or "run ended"

    def text(self) -> str:
        if self.seconds is not None:
            return f"{self.seconds:.1f} s"
        if self.ended_by == "run ended":
            return f"> {self.watched:.1f} s (run ended)"
        if self.watched < 1.0:
            return "n/a (backlog ran out)"
        return f"n/a (backlog ran out after {self.watched:.1f} s)"


def step_up_recoveries(
    schedule: CapacitySchedule, history: Sequence[Sample]
) -> tuple[StepUpRecovery, ...]:
    """Each capacity step up the run saw: from the step up to the end of the
    first whole second after it that accepted >= ``STEP_UP_SHARE`` of that
    second's capacity, provided every second before it still had backlog
    (``backlog_seconds``); else how long it was watched, and why it stopped.
    A step up is to a level the capacity holds: a ramp's peak, which falls
    again at once, is none (the falling capacity would meet the rate, not the
    rate the capacity)."""
    flags = counts(history)
    found = []
    points = schedule.points
    for i, ((_, r0), (t1, r1)) in enumerate(itertools.pairwise(points)):
        if r1 <= r0 or (schedule.ramp and i + 2 < len(points) and points[i + 2][1] < r1):
            continue
        after = [(s, c) for s, c in zip(history, flags, strict=True) if s.second >= t1]
        if not after:
            continue  # after the run
        seconds, ended_by, watched = None, "run ended", after[-1][0].second + 1.0 - t1
        for s, counted in after:
            if s.accepted >= STEP_UP_SHARE * second_capacity(schedule, s):
                seconds, ended_by = s.second + 1.0 - t1, "caught up"
                break
            if not counted:
                ended_by, watched = "backlog ran out", max(0.0, s.second - t1)
                break
        found.append(
            StepUpRecovery(at=t1, capacity=r1, seconds=seconds, watched=watched, ended_by=ended_by)
        )
    return tuple(found)


def json_dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def spark(values: Sequence[float], top: float) -> str:
    top = top or 1.0
    scale = len(_SPARKS) - 1
    return "".join(_SPARKS[max(0, min(scale, round(v / top * scale)))] for v in values)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def live_view(
    plan: DemoPlan, samples: Sequence[Sample], second: int, upstreams: Mapping[str, ModelUpstream]
) -> RenderableType:
    title = (
        f"pacerd demo · {human_seconds(second)} of {human_seconds(plan.duration_seconds)}"
        f" · {plan.workers} workers"
    )
    table = Table(title=title, title_justify="left", expand=False)
    for column in (
        "destination",
        "capacity/s",
        "pacer rate/s",
        "sent/s",
        "refused/s",
        "in flight",
        "due",
        "oldest due",
        "drain ETA",
        "done",
    ):
        table.add_column(column, justify="left" if column == "destination" else "right")
    lines: list[RenderableType] = []
    width = 60
    for d in plan.destinations:
        history = [s for s in samples if s.destination == d.name]
        if not history:
            continue
        s = history[-1]
        sent = s.accepted + s.refused + s.errors
        refused = f"{s.refused}" + (f" ({s.refused / sent:.0%})" if sent else "")
        table.add_row(
            d.name,
            f"{s.capacity:.0f}",
            _rate(s.rate),
            str(sent),
            refused,
            str(s.inflight),
            f"{s.due:,}",
            human_seconds(s.oldest_due_age_seconds),
            human_seconds(drain_eta(history)) if s.due else "drained",
            f"{s.completed:,}",
        )
        recent = history[-width:]
        top = max(max(x.capacity for x in recent), max(x.accepted + x.refused for x in recent))
        lines.append(Text(f"{d.name:>13} capacity {spark([x.capacity for x in recent], top)}"))
        lines.append(
            Text(f"{'':>13} accepted {spark([x.accepted for x in recent], top)}", style="green")
        )
        lines.append(
            Text(f"{'':>13}  refused {spark([x.refused for x in recent], top)}", style="red")
        )
    dups = sum(u.model.duplicates for u in upstreams.values())
    footer = Text(f"duplicate side effects so far: {dups}", style="bold" if dups else "dim")
    return Group(table, *lines, footer)


def drain_eta(history: Sequence[Sample], window: int = 10) -> float | None:
    """Due work over the pacer's rate, or over the recent completion rate without one."""
    last = history[-1]
    if last.drain_eta_seconds is not None:
        return last.drain_eta_seconds
    recent = history[-window:]
    done = (recent[-1].completed - recent[0].completed) / max(1, len(recent) - 1)
    return last.due / done if done > 0 else None


def latest(samples: Sequence[Sample]) -> list[Sample]:
    """Each destination's newest sample, in the order they first appear."""
    return list({s.destination: s for s in samples}.values())


def print_progress(latest: Sequence[Sample], second: int) -> None:
    parts = [
        f"{s.destination}: cap {s.capacity:.0f}/s rate {_rate(s.rate)}/s sent "
        f"{s.accepted + s.refused + s.errors}/s refused {s.refused} due {s.due} done {s.completed}"
        for s in latest
    ]
    print(f"[{second:>4}s] " + " | ".join(parts), flush=True)


async def summarize(
    plan: DemoPlan,
    client: Client,
    samples: Sequence[Sample],
    upstreams: Mapping[str, ModelUpstream],
    live_ids: Sequence[str],
) -> DemoSummary:
    """The end-of-run checks, against the ledger and the upstreams' records."""
    expected = [
        f"{backlog_prefix(plan, d.name)}{n}"
        for d in plan.destinations
        for n in range(1, d.backlog + 1)
    ]
    expected += live_ids
    rows = await client.pool.fetch(
        "SELECT job_id, destination, state FROM pacerd.jobs WHERE job_id = ANY($1::text[])",
        expected,
    )
    effects = {k for u in upstreams.values() for k in u.model.keys}
    completed = [r for r in rows if r["state"] == "completed"]
    waits = await client.pool.fetch(
        "SELECT extract(epoch FROM e.at - j.created_at)::float8 AS wait FROM pacerd.jobs j"
        " JOIN pacerd.job_events e ON e.job_id = j.job_id AND e.event = 'completed'"
        " WHERE j.job_id = ANY($1::text[])",
        list(live_ids),
    )
    live_waits = sorted(r["wait"] for r in waits)
    destinations = []
    for d in plan.destinations:
        history = [s for s in samples if s.destination == d.name]
        stats = upstreams[d.name].stats() if d.name in upstreams else {}
        mine = [r for r in rows if r["destination"] == d.name]
        destinations.append(
            DestinationSummary(
                destination=d.name,
                utilization=utilization(d.schedule, history),
                backlog_seconds=len(backlog_seconds(history)),
                startup_seconds=startup_seconds(history),
                accepted=stats.get("accepted", 0),
                refused=stats.get("refused", 0),
                errors=stats.get("errors", 0),
                completed=sum(r["state"] == "completed" for r in mine),
                due_left=history[-1].due if history else 0,
                dead=sum(r["state"] == "dead" for r in mine),
                duplicates=stats.get("duplicates", 0),
                step_ups=step_up_recoveries(d.schedule, history),
            )
        )
    return DemoSummary(
        destinations=destinations,
        scheduled=len(expected),
        missing=len(expected) - len(rows),
        completed_without_effect=sum(r["job_id"] not in effects for r in completed),
        live_wait_p50=statistics.median(live_waits) if live_waits else None,
        live_wait_p95=live_waits[int(0.95 * (len(live_waits) - 1))] if live_waits else None,
    )


def print_summary(
    console: Console, plan: DemoPlan, summary: DemoSummary, chart: Path, *, database: str
) -> None:
    table = Table(title=f"pacerd demo summary · {human_seconds(plan.duration_seconds)}")
    for column in (
        "destination",
        "utilization",
        "backlog s",
        "accepted",
        "refused",
        "refusal %",
        "5xx",
        "completed",
        "still due",
        "dead",
        "duplicates",
    ):
        table.add_column(column, justify="left" if column == "destination" else "right")
    for d in summary.destinations:
        table.add_row(
            d.destination,
            "n/a" if d.utilization is None else f"{d.utilization:.0%}",
            str(d.backlog_seconds),
            f"{d.accepted:,}",
            f"{d.refused:,}",
            f"{d.refusal_ratio:.1%}",
            str(d.errors),
            f"{d.completed:,}",
            f"{d.due_left:,}",
            str(d.dead),
            str(d.duplicates),
        )
    console.print(table)
    startup = [d.startup_seconds for d in summary.destinations if d.startup_seconds is not None]
    console.print(
        "[dim]utilization: accepted calls / the upstream's capacity over the seconds with"
        " backlog (backlog s): the run's overdue jobs, not the live trickle, due and"
        " unclaimed when the second began and when it ended, from the first call on"
        + (f" (start-up: first call within {max(startup):.0f} s, not counted)" if startup else "")
        + ".[/]"
    )
    steps = Table(title="capacity step ups")
    for column in ("destination", "step up at", "to", f"{STEP_UP_SHARE:.0%} after step up"):
        steps.add_column(column, justify="left" if column == "destination" else "right")
    for d in summary.destinations:
        for u in d.step_ups:
            steps.add_row(d.destination, f"{u.at:.1f} s", f"{u.capacity:.0f}/s", u.text())
    if steps.row_count:
        console.print(steps)
        console.print(
            f"[dim]{STEP_UP_SHARE:.0%} after step up: from the step up (a ramp: where it"
            f" reaches its new level) to the end of the first whole second accepting"
            f" {STEP_UP_SHARE:.0%} of that second's capacity, while backlog remained;"
            " n/a when the backlog ran out first.[/]"
        )
    verdict = "[green]" if summary.lost == 0 and summary.duplicates == 0 else "[red]"
    console.print(
        f"{verdict}duplicates = {summary.duplicates}, jobs lost = {summary.lost}[/]"
        f" (of {summary.scheduled:,} scheduled; {summary.missing} missing from the"
        f" ledger, {summary.completed_without_effect} completed without a side effect)"
    )
    if summary.live_wait_p50 is not None:
        console.print(
            f"live jobs, due to completed: p50 {summary.live_wait_p50:.1f} s,"
            f" p95 {summary.live_wait_p95:.1f} s"
        )
    console.print(f"chart: {chart}   ledger: database {database!r} (kept for `pacerd show`)")


def step_ups_text(d: DestinationSummary, sep: str = " · ") -> str:
    """Each step up as "@T s: RESULT" ("-": none within the run)."""
    return sep.join(f"@{u.at:.0f} s: {u.text()}" for u in d.step_ups) or "-"


def headline(d: DestinationSummary) -> str:
    """The figures the demo promises, in one line (the chart's panel titles)."""
    util = "n/a" if d.utilization is None else f"{d.utilization:.0%}"
    return (
        f"utilization {util} while backlog due · refused {d.refusal_ratio:.1%}"
        f"\n90 % after step up {step_ups_text(d)}"
    )


def write_samples(samples: Sequence[Sample], path: Path) -> None:
    path.write_text("".join(json_dumps(asdict(s)) + "\n" for s in samples))


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def write_chart(
    plan: DemoPlan,
    samples: Sequence[Sample],
    path: Path,
    summary: DemoSummary | None = None,
) -> None:
    """Per destination: capacity, pacer rate, accepted and refused per second
    (top, titled with the summary's figures), due backlog and oldest-due age
    (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [d.name for d in plan.destinations]
    fig, axes = plt.subplots(2, len(names), figsize=(7 * len(names), 8), sharex=True, squeeze=False)
    for col, name in enumerate(names):
        history = [s for s in samples if s.destination == name]
        t = [s.t for s in history]
        top: Any = axes[0][col]
        top.step(
            t,
            [s.capacity for s in history],
            where="post",
            color="black",
            ls="--",
            label="upstream capacity",
        )
        top.plot(
            t,
            [s.rate if s.rate is not None else float("nan") for s in history],
            color="tab:blue",
            label="pacer rate",
        )
        accepted = [float(s.accepted) for s in history]
        top.plot(t, accepted, color="tab:green", alpha=0.25, lw=0.8)
        top.plot(t, rolling_mean(accepted, 5), color="tab:green", label="accepted/s (5 s mean)")
        top.bar(t, [s.refused for s in history], color="tab:red", alpha=0.6, label="refused/s")
        figures = {d.destination: d for d in summary.destinations} if summary else {}
        top.set_title(f"{name}\n{headline(figures[name])}" if name in figures else name)
        top.set_ylabel("calls per second")
        top.legend(loc="upper right", fontsize="small")
        bottom: Any = axes[1][col]
        bottom.fill_between(
            t, [s.due for s in history], color="tab:gray", alpha=0.4, label="due (live included)"
        )
        bottom.plot(
            t, [s.backlog_due for s in history], color="tab:gray", lw=1.2, label="due backlog"
        )
        bottom.set_ylabel("due jobs")
        bottom.set_xlabel("seconds")
        age = bottom.twinx()
        age.plot(
            t,
            [s.oldest_due_age_seconds or 0.0 for s in history],
            color="tab:orange",
            label="oldest-due age (s)",
        )
        age.set_ylabel("oldest-due age (s)")
        bottom.legend(loc="upper right", fontsize="small")
        age.legend(loc="center right", fontsize="small")
    fig.suptitle("pacerd: admitted rate vs upstream capacity")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
