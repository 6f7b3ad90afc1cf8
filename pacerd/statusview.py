"""How the CLI shows the ledger to a person: status tables, the live
``status --watch`` view, dead letters and a job's history.

Rendering only (rich); the data comes from ``client.py``, selected, ranked and
totalled per group by ``overview.py``. The live view reads the ledger, so it
works from any machine with database access. Job ids, kinds,
errors and details are user data: the console never reads markup or emoji codes
in them, so they print exactly as stored.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections import deque
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pacerd.clock import SystemClock
from pacerd.overview import UNGROUPED, Overview, Selection, overview

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from pacerd.client import DestinationStatus
    from pacerd.models import JobEvent, JobView
    from pacerd.overview import GroupTotals

_SPARKS = "▁▂▃▄▅▆▇█"


def _console() -> Console:
    options: dict[str, Any] = {"highlight": False, "markup": False, "emoji": False}
    console = Console(soft_wrap=True, **options)
    if not console.is_terminal:
        console = Console(soft_wrap=True, width=200, **options)
    return console


def human_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return "0s"
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if value >= size or (unit == "s" and not parts):
            parts.append(f"{int(value // size)}{unit}")
            value %= size
        if len(parts) == 2:
            break
    return "".join(parts)


def sparkline(values: Sequence[float]) -> str:
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(
        _SPARKS[min(len(_SPARKS) - 1, int(v / top * (len(_SPARKS) - 1)))] for v in values
    )


def _state(row: DestinationStatus) -> str:
    if row.paused_all:
        return "paused (all)"
    if row.paused:
        return "paused"
    if row.cooldown_remaining_seconds > 0:
        return f"cool-down {human_seconds(row.cooldown_remaining_seconds)}"
    return "active"


def status_dict(row: DestinationStatus, group: str | None = None) -> dict[str, Any]:
    doc = dataclasses.asdict(row)
    doc["state"] = _state(row)
    doc["group"] = group
    return doc


def overview_dict(view: Overview, group_of: Callable[[str], str | None]) -> dict[str, Any]:
    """``status --json --totals``: the group totals, the destinations listed,
    and how many selected destinations were left out (by ``--top``)."""
    return {
        "groups": [g.as_dict() for g in view.groups],
        "destinations": [status_dict(r, group_of(r.destination)) for r in view.destinations],
        "selected": view.selected,
        "left_out": view.left_out,
    }


def group_table(groups: Sequence[GroupTotals]) -> Table:
    """The totals per group (``-``: the destinations in no group)."""
    table = Table(title=None, header_style="bold", expand=False)
    for column in (
        "group",
        "destinations",
        "paused",
        "cool-down",
        "rate/s",
        "in flight",
        "due",
        "oldest due",
        "refused",
        "dead",
    ):
        table.add_column(column, justify="left" if column == "group" else "right")
    for g in groups:
        ratio = g.refusal_ratio
        table.add_row(
            g.group or UNGROUPED,
            f"{g.destinations:,}",
            f"{g.paused:,}",
            f"{g.cooldown:,}",
            f"{g.rate:,.1f}",
            f"{g.inflight:,}",
            f"{g.due:,}",
            human_seconds(g.oldest_due_age_seconds),
            "-" if ratio is None else f"{ratio:.1%}",
            f"{g.dead:,}",
        )
    return table


def status_table(
    rows: Sequence[DestinationStatus],
    *,
    rates: dict[str, deque[float]] | None = None,
    ratios: dict[str, float | None] | None = None,
) -> Table:
    table = Table(title=None, header_style="bold", expand=False)
    for column in (
        "destination",
        "state",
        "rate/s",
        "budget",
        "in flight",
        "due",
        "oldest due",
        "refused",
        "drain ETA",
        "dead",
        "leader",
    ):
        table.add_column(
            column, justify="left" if column in ("destination", "state", "leader") else "right"
        )
    for r in rows:
        rate = "-" if r.rate is None else f"{r.rate:,.1f}"
        if rates and rates.get(r.destination):
            rate = f"{sparkline(list(rates[r.destination]))} {rate}"
        ratio = ratios.get(r.destination) if ratios is not None else r.refusal_ratio
        table.add_row(
            r.destination,
            _state(r),
            rate,
            "-" if r.budget is None else str(r.budget),
            f"{r.inflight:,}",
            f"{r.due:,}",
            human_seconds(r.oldest_due_age_seconds),
            "-" if ratio is None else f"{ratio:.1%}",
            human_seconds(r.drain_eta_seconds),
            f"{r.dead:,}",
            r.leader or "-",
        )
    return table


def _no_group(_destination: str) -> str | None:
    return None


def render_overview(
    view: Overview,
    *,
    show_groups: bool,
    rates: dict[str, deque[float]] | None = None,
    ratios: dict[str, float | None] | None = None,
) -> list[RenderableType]:
    """The group totals (when ``show_groups``, or when destinations were left
    out), the destinations' table, and a line saying how many were left out."""
    parts: list[RenderableType] = []
    if show_groups or view.left_out:
        parts.append(group_table(view.groups))
    if view.destinations:
        parts.append(status_table(view.destinations, rates=rates, ratios=ratios))
    else:
        parts.append(Text("no destination matches"))
    if view.left_out:
        shown = len(view.destinations)
        parts.append(
            Text(
                f"{view.left_out:,} more destination(s) not shown: the {shown:,} listed have"
                " the oldest due work, then the most refusals"
                " (--top N, --group NAME or --destination GLOB to choose)",
                style="dim",
            )
        )
    return parts


def print_status(
    rows: Sequence[DestinationStatus],
    group_of: Callable[[str], str | None] | None = None,
    *,
    selection: Selection | None = None,
    order: Sequence[str] = (),
    totals: bool = False,
) -> None:
    """``pacerd status``: ``order`` lists the configured groups (whose totals
    are shown whenever there are any, or with ``totals``)."""
    console = _console()
    if not rows:
        console.print("no destinations yet (schedule a job or configure [destinations.NAME])")
        return
    view = overview(rows, group_of or _no_group, selection, order=order)
    for part in render_overview(view, show_groups=totals or bool(order)):
        console.print(part)


class WatchState:
    """What ``status --watch`` remembers between refreshes, per destination
    selected: its recent rates and outcome counters. A destination no longer
    selected (or gone) is forgotten."""

    def __init__(self) -> None:
        self.rates: dict[str, deque[float]] = {}
        self.previous: dict[str, tuple[int, int]] = {}
        self.ratios: dict[str, float | None] = {}
        self.counts: dict[str, tuple[int, int]] = {}

    def update(self, rows: Sequence[DestinationStatus]) -> None:
        present = {r.destination for r in rows}
        for memory in (self.rates, self.previous, self.ratios, self.counts):
            for gone in [d for d in memory if d not in present]:
                del memory[gone]
        for r in rows:
            self.rates.setdefault(r.destination, deque(maxlen=30)).append(r.rate or 0.0)
            before = self.previous.get(r.destination)
            if before is not None:
                accepted, refused = r.n_accepted - before[0], r.n_refused - before[1]
                total = accepted + refused
                self.ratios[r.destination] = refused / total if total else None
                self.counts[r.destination] = (accepted, refused)
            self.previous[r.destination] = (r.n_accepted, r.n_refused)

    def view(
        self,
        rows: Sequence[DestinationStatus],
        group_of: Callable[[str], str | None],
        selection: Selection,
        order: Sequence[str],
    ) -> Overview:
        """Refusal ratios over the last refresh interval, for the groups too."""
        chosen = [r for r in rows if selection.admits(r.destination, group_of(r.destination))]
        self.update(chosen)
        counts: Mapping[str, tuple[int, int]] = self.counts
        return overview(chosen, group_of, selection, order=order, ratios=self.ratios, counts=counts)


async def watch(
    dsn: str,
    interval: float,
    *,
    group_of: Callable[[str], str | None] | None = None,
    selection: Selection | None = None,
    order: Sequence[str] = (),
    totals: bool = False,
) -> int:
    """``pacerd status --watch``: refreshes until interrupted, with the filters
    of ``pacerd status``. The refusal ratios (a destination's, a group's) are
    computed from the ledger's outcome counters between refreshes."""
    from pacerd.client import Client

    clock = SystemClock()
    state = WatchState()
    group_of = group_of or _no_group
    selection = selection or Selection()
    client = await Client.connect(dsn, max_size=1)
    try:
        with Live(Text("reading the ledger…"), console=_console(), auto_refresh=False) as live:
            while True:
                rows = await client.status()
                view = state.view(rows, group_of, selection, order)
                stamp = Text(
                    f"pacerd status — {clock.now():%Y-%m-%d %H:%M:%S} UTC"
                    f" — every {interval:g}s, Ctrl-C to stop",
                    style="dim",
                )
                parts = render_overview(
                    view,
                    show_groups=totals or bool(order),
                    rates=state.rates,
                    ratios=state.ratios,
                )
                live.update(Group(stamp, *parts), refresh=True)
                await clock.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        await client.close()


def job_dict(job: JobView) -> dict[str, Any]:
    doc = dataclasses.asdict(job)
    doc["state"] = str(job.state)
    return doc


def event_dict(event: JobEvent) -> dict[str, Any]:
    return dataclasses.asdict(event)


def _when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def print_job(job: JobView, events: Sequence[JobEvent]) -> None:
    console = _console()
    console.print(
        Text.assemble(
            (job.job_id, "bold"), f"  {job.kind} → {job.destination}  ", (str(job.state), "bold")
        )
    )
    console.print(
        f"  attempt {job.attempt}, failures {job.failures}/{job.max_attempts},"
        f" revision {job.revision}"
    )
    console.print(
        f"  next attempt at {_when(job.next_attempt_at)}, lease until {_when(job.lease_expires_at)}"
    )
    if job.last_error:
        console.print(f"  last error: {job.last_error}")
    if job.cursor is not None:
        console.print(f"  cursor: {job.cursor}")
    table = Table(header_style="bold")
    for column in ("at (UTC)", "attempt", "event", "detail"):
        table.add_column(column)
    for e in events:
        table.add_row(
            _when(e.at), str(e.attempt), e.event, "" if e.detail is None else str(e.detail)
        )
    console.print(table)


def print_dead(jobs: Sequence[JobView]) -> None:
    console = _console()
    if not jobs:
        console.print("no dead jobs match")
        return
    table = Table(header_style="bold")
    for column in ("job", "kind", "destination", "dead since", "failures", "last error"):
        table.add_column(column)
    for j in jobs:
        table.add_row(
            j.job_id,
            j.kind,
            j.destination,
            _when(j.updated_at),
            f"{j.failures}/{j.max_attempts}",
            j.last_error or "",
        )
    console.print(table)
