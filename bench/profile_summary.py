"""Summarises a py-spy ``--format raw`` profile (collapsed stacks): the
functions with the most inclusive time, grouped where it helps to see where a
pacerd process spends its CPU.

    .venv/bin/python -m bench.profile_summary /tmp/pacerd-profile/full_cycle.txt [TOP]
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

# Buckets matched against the whole stack, first match wins (most specific first).
BUCKETS: tuple[tuple[str, str], ...] = (
    ("Telemetry.", "telemetry: spans and metrics (per message: publish, outcome)"),
    ("TelemetryObserver.", "telemetry: spans and metrics (per message: publish, outcome)"),
    ("Tracer.", "telemetry: spans and metrics (per message: publish, outcome)"),
    ("inject_traceparent", "telemetry: spans and metrics (per message: publish, outcome)"),
    ("structlog", "logging (structlog)"),
    ("BoundLogger", "logging (structlog)"),
    ("apply_reports", "outcomes: apply_reports (ledger)"),
    ("parse_outcome", "outcomes: parse"),
    ("OutcomeConsumer", "outcomes: consumer other (batches, ack)"),
    ("DeliveryBatches", "outcomes: consumer other (batches, ack)"),
    ("mark_offered", "admission: mark_offered"),
    ("claim_due", "admission: claim_due"),
    ("ready_body", "publisher: ready_body"),
    ("write_batch", "publisher: write_batch (frames of a slice, confirm futures)"),
    ("Broker.publish", "publisher: publish_many other (results, waiting)"),
    ("Connection.__writer", "AMQP socket writes (aiormq writer)"),
    ("Connection.__reader", "AMQP frame reading (confirms, deliveries)"),
    ("(aiormq/", "AMQP (aiormq) other"),
    ("(pamqp/", "AMQP (aiormq) other"),
    ("(aio_pika/", "AMQP (aio-pika) other"),
    ("(asyncpg/", "PostgreSQL driver (asyncpg) other"),
    ("TaskGroup", "anyio task groups (a task per message)"),
    ("(anyio/_core/_tasks", "anyio task groups (a task per message)"),
    ("admission.py", "admission other"),
)

_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match["file"]
    repo = str(Path(__file__).resolve().parent.parent) + "/"
    for marker in ("site-packages/", repo, "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{match['func']} ({path})"


def summarize(path: Path, top: int = 25) -> str:
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    buckets: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_short(f) for f in stack.split(";") if f.strip()]
        for f in set(frames):
            inclusive[f] += count
        if frames:
            own[frames[-1]] += count
        for needle, bucket in BUCKETS:
            if needle in stack:
                buckets[bucket] += count
                break
        else:
            idle = frames and ("select" in frames[-1] or "run_forever" in frames[-1])
            buckets["event loop idle / poll" if idle else "other"] += count
    if not total:
        return f"(no samples in {path})"
    lines = [f"py-spy: {total} samples in {path}", "", "where the samples fall (first match):"]
    lines += [f"  {100 * c / total:5.1f} %  {b}" for b, c in buckets.most_common()]
    lines += ["", f"top {top} by inclusive samples:"]
    lines += [f"  {100 * c / total:5.1f} %  {f}" for f, c in inclusive.most_common(top)]
    lines += ["", f"top {top} by own samples:"]
    lines += [f"  {100 * c / total:5.1f} %  {f}" for f, c in own.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 25))
