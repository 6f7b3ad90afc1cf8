"""The daemon's structured records as the tests read them: a `pacerd run`
configured with ``log_format = "json"`` writes one JSON object per line, named
by its ``event``. The audits read the tick record (``tick_completed``, one per
tick of a destination this instance leads) and the supervisor's records; the
tick record has a fixed schema, checked on every read, so a renamed or
missing field fails the test that reads it instead of silently thinning an
audit."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

TICK_EVENT = "tick_completed"
TICK_FIELDS: dict[str, type | tuple[type, ...]] = {
    "timestamp": str,
    "destination": str,
    "rate": (int, float),
    "budget": int,
    "claimed": int,
    "offered": int,
    "released": int,
    "inflight": int,
    "accepted": int,
    "refused": int,
}


def records(text: str, event: str | None = None) -> Iterator[dict[str, Any]]:
    """The JSON records of a log's text (other lines skipped), ``event`` only if given;
    tick records are checked against their schema."""
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill -9
        if not isinstance(record, dict) or (event is not None and record.get("event") != event):
            continue
        if record.get("event") == TICK_EVENT:
            check_tick(record)
        yield record


def check_tick(record: dict[str, Any]) -> None:
    wrong = {
        name: record.get(name)
        for name, kind in TICK_FIELDS.items()
        if not isinstance(record.get(name), kind) or isinstance(record.get(name), bool)
    }
    assert not wrong, f"a tick record off its schema: {wrong} in {record}"
