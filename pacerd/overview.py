"""Many destinations at a glance, for ``pacerd status``: select them (by group,
by a glob over names), rank them, and total them per group.

Pure functions over ``DestinationStatus`` rows, no I/O. A destination's group
comes from the configuration (``Config.group_for``), not from the ledger.
Ranking puts first what needs a look: the oldest due work, then the highest
refusal ratio.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from pacerd.client import DestinationStatus

UNGROUPED = "-"  # --group -: the destinations in no group (no group can be named so)
DEFAULT_LIMIT = 50  # destinations shown when there are more and nothing was selected


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """What ``status`` was asked to show: ``group`` (a group's name, or
    ``UNGROUPED``), ``destination`` (an fnmatch glob over names), ``top`` (the
    first N by rank)."""

    group: str | None = None
    destination: str | None = None
    top: int | None = None

    @property
    def chosen(self) -> bool:
        """True when any filter was given (then no default limit applies)."""
        return self.group is not None or self.destination is not None or self.top is not None

    def problem(self, groups: Sequence[str]) -> str | None:
        """Why this selection is invalid with these configured ``groups``, or None."""
        if self.top is not None and self.top < 1:
            return f"--top must be at least 1, not {self.top}"
        if self.group is not None and self.group != UNGROUPED and self.group not in groups:
            known = ", ".join(groups) if groups else "none is configured"
            return (
                f"no group {self.group!r} in the configuration (groups: {known};"
                f" --group {UNGROUPED} selects the destinations in no group)"
            )
        if self.destination is not None and not self.destination.strip():
            return "--destination must not be empty"
        return None

    def admits(self, destination: str, group: str | None) -> bool:
        if self.group is not None and (group or UNGROUPED) != self.group:
            return False
        return self.destination is None or fnmatch.fnmatchcase(destination, self.destination)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GroupTotals:
    """A group's destinations taken together (``group`` None: those in no group).

    ``accepted`` and ``refused`` are the outcomes counted over the same window
    for every destination: since they were first seen (the ledger's counters),
    or since the last refresh of ``status --watch``."""

    group: str | None
    destinations: int
    paused: int
    cooldown: int
    rate: float
    inflight: int
    due: int
    oldest_due_age_seconds: float | None
    dead: int
    accepted: int
    refused: int

    @property
    def refusal_ratio(self) -> float | None:
        total = self.accepted + self.refused
        return self.refused / total if total else None

    def as_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["refusal_ratio"] = self.refusal_ratio
        return doc


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Overview:
    """What ``status`` shows: the totals of the selected destinations per group,
    the destinations listed, and how many selected ones were left out."""

    groups: list[GroupTotals]
    destinations: list[DestinationStatus]
    selected: int
    left_out: int


def rank_key(row: DestinationStatus, ratio: float | None) -> tuple[float, float]:
    """Higher first: oldest-due age, then refusal ratio (unknown: below any)."""
    age = row.oldest_due_age_seconds
    return (-1.0 if age is None else age, -1.0 if ratio is None else ratio)


def ranked(
    rows: Sequence[DestinationStatus], ratios: Mapping[str, float | None] | None = None
) -> list[DestinationStatus]:
    """``rows`` by rank, highest first; ties by name."""

    def ratio(row: DestinationStatus) -> float | None:
        return ratios.get(row.destination) if ratios is not None else row.refusal_ratio

    by_name = sorted(rows, key=lambda r: r.destination)
    return sorted(by_name, key=lambda r: rank_key(r, ratio(r)), reverse=True)


def totals(
    rows: Sequence[DestinationStatus],
    group_of: Callable[[str], str | None],
    *,
    order: Sequence[str] = (),
    counts: Mapping[str, tuple[int, int]] | None = None,
) -> list[GroupTotals]:
    """One ``GroupTotals`` per group that has a destination in ``rows``: in
    ``order`` (the configuration's), then any other, then the destinations in
    no group. ``counts``: destination -> (accepted, refused) over the window
    the refusal ratio is about (default: the ledger's counters)."""
    members: dict[str | None, list[DestinationStatus]] = {}
    for row in rows:
        members.setdefault(group_of(row.destination), []).append(row)
    position = {name: n for n, name in enumerate(order)}
    keys = sorted(
        members, key=lambda g: (g is None, position.get(g, len(position)) if g else 0, g or "")
    )
    out = []
    for group in keys:
        mine = members[group]
        window = [
            counts.get(r.destination, (0, 0)) if counts is not None else (r.n_accepted, r.n_refused)
            for r in mine
        ]
        ages = [r.oldest_due_age_seconds for r in mine if r.oldest_due_age_seconds is not None]
        out.append(
            GroupTotals(
                group=group,
                destinations=len(mine),
                paused=sum(1 for r in mine if r.paused or r.paused_all),
                cooldown=sum(1 for r in mine if r.cooldown_remaining_seconds > 0),
                rate=sum(r.rate or 0.0 for r in mine),
                inflight=sum(r.inflight for r in mine),
                due=sum(r.due for r in mine),
                oldest_due_age_seconds=max(ages) if ages else None,
                dead=sum(r.dead for r in mine),
                accepted=sum(a for a, _ in window),
                refused=sum(r for _, r in window),
            )
        )
    return out


def overview(
    rows: Sequence[DestinationStatus],
    group_of: Callable[[str], str | None],
    selection: Selection | None = None,
    *,
    order: Sequence[str] = (),
    ratios: Mapping[str, float | None] | None = None,
    counts: Mapping[str, tuple[int, int]] | None = None,
    limit: int | None = DEFAULT_LIMIT,
) -> Overview:
    """The selected destinations totalled per group, and those to list: the
    ``top`` by rank; else, when nothing was selected and there are more than
    ``limit``, the first ``limit`` by rank; else all, by name (as stored).
    ``ratios`` replaces each row's refusal ratio for ranking (``--watch``)."""
    selection = selection or Selection()
    chosen = [r for r in rows if selection.admits(r.destination, group_of(r.destination))]
    cap = selection.top
    if cap is None and not selection.chosen and limit is not None and len(chosen) > limit:
        cap = limit
    listed = chosen if cap is None else ranked(chosen, ratios)[:cap]
    return Overview(
        groups=totals(chosen, group_of, order=order, counts=counts),
        destinations=listed,
        selected=len(chosen),
        left_out=len(chosen) - len(listed),
    )
