"""What the demo shows: per-second samples, the live terminal view (rich), the
closing summary and the PNG chart of rate vs capacity (matplotlib, Agg).

Owns presentation and the end-of-run checks (utilization, refusal %,
duplicate side effects from the upstreams' idempotency keys, jobs lost from
the ledger); it starts and stops nothing (``runner`` does), and imports
nothing of the runner: what it needs of a run is the plan (``plan``).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pacerd.statusview import human_seconds
from pacerd_demo.plan import backlog_prefix

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

    t: float
    destination: str
    capacity: float  # the upstream's capacity in that second
    accepted: int  # calls the upstream accepted in that second
    refused: int
    errors: int
    rate: float | None  # the pacer's rate, as its leader persisted it
    due: int
    inflight: int
    oldest_due_age_seconds: float | None
    drain_eta_seconds: float | None
    completed: int
    dead: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationSummary:
    destination: str
    utilization: float | None  # accepted / capacity while there was due work
    accepted: int
    refused: int
    errors: int
    completed: int
    due_left: int
    dead: int
    duplicates: int
    # seconds from a capacity step up to the first second accepting >= 90 % of
    # the new capacity (the worst step up; None: no step up while work was due)
    step_up_recovery_s: float | None = None

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


def step_up_recovery(schedule: CapacitySchedule, history: Sequence[Sample]) -> float | None:
    """Seconds from each capacity step up (for a ramp: from where it reaches its
    new level) to the first second that accepted >= ``STEP_UP_SHARE`` of the
    capacity, while work was due; the worst of the step ups (inf: never)."""
    worst: float | None = None
    for (_, r0), (t1, r1) in itertools.pairwise(schedule.points):
        if r1 <= r0:
            continue
        after = [s for s in history if s.t >= t1]
        if not after or after[0].due == 0:
            continue
        hit = next((s.t for s in after if s.accepted >= STEP_UP_SHARE * r1), math.inf)
        took = hit + 1.0 - t1  # the end of the first good second
        worst = took if worst is None else max(worst, took)
    return worst


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
        busy = [s for s in history if s.due > 0] or history
        capacity = sum(s.capacity for s in busy)
        stats = upstreams[d.name].stats() if d.name in upstreams else {}
        mine = [r for r in rows if r["destination"] == d.name]
        destinations.append(
            DestinationSummary(
                destination=d.name,
                utilization=sum(s.accepted for s in busy) / capacity if capacity else None,
                accepted=stats.get("accepted", 0),
                refused=stats.get("refused", 0),
                errors=stats.get("errors", 0),
                completed=sum(r["state"] == "completed" for r in mine),
                due_left=history[-1].due if history else 0,
                dead=sum(r["state"] == "dead" for r in mine),
                duplicates=stats.get("duplicates", 0),
                step_up_recovery_s=step_up_recovery(d.schedule, history),
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
        "accepted",
        "refused",
        "refusal %",
        "5xx",
        "90 % after step up",
        "completed",
        "still due",
        "dead",
        "duplicates",
    ):
        table.add_column(column, justify="left" if column == "destination" else "right")
    for d in summary.destinations:
        table.add_row(
            d.destination,
            "-" if d.utilization is None else f"{d.utilization:.0%}",
            f"{d.accepted:,}",
            f"{d.refused:,}",
            f"{d.refusal_ratio:.1%}",
            str(d.errors),
            _seconds(d.step_up_recovery_s),
            f"{d.completed:,}",
            f"{d.due_left:,}",
            str(d.dead),
            str(d.duplicates),
        )
    console.print(table)
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


def _seconds(value: float | None) -> str:
    return "-" if value is None else "never" if math.isinf(value) else f"{value:.0f} s"


def headline(d: DestinationSummary) -> str:
    """The figures the demo promises, in one line (the chart's panel titles)."""
    util = "-" if d.utilization is None else f"{d.utilization:.0%}"
    return (
        f"utilization {util} while due · refused {d.refusal_ratio:.1%}"
        f" · 90 % after step up {_seconds(d.step_up_recovery_s)}"
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
            t, [s.due for s in history], color="tab:gray", alpha=0.4, label="due backlog"
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
