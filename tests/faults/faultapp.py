"""The worker program of the fault-injection suite (``pacerd worker --app faultapp:app``).

Each job makes one call to the model upstream with an ``Idempotency-Key`` of
``job.idempotency_key`` plus the job's revision (so the upstream's record shows
which revision executed), the way ``pacerd_demo.app`` does (its pooled
HTTP client, its call and its reading of the answer are reused), and the
upstream's answer becomes the outcome. Around the call it appends one JSON
line per event to ``FAULT_CALL_LOG`` (``start`` before the call, ``called``
after it, with the status), unbuffered, so a worker killed with SIGKILL
leaves an exact trace of the calls it made. ``FAULT_HOLD_MS`` holds every
handler that long between the upstream call and its return — the window in
which the harness kills workers "between the upstream call and the outcome
report".

Environment: ``FAULT_UPSTREAM`` (base URL), ``FAULT_DESTINATIONS`` (comma
separated), ``FAULT_CALL_LOG``, ``FAULT_HOLD_MS``, ``FAULT_PREFETCH``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from pacerd.worker import Job, Retry, WorkerApp
from pacerd_demo.app import UpstreamClient, accepted, post_call


def effect_key(job: Job) -> str:
    """The idempotency key the upstream sees: stable across offers of one revision."""
    return f"{job.idempotency_key}@r{job.revision}"


class CallLog:
    """Appends JSON lines with one ``write(2)`` each (atomic, nothing buffered)."""

    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def write(self, **fields: Any) -> None:
        if self._fd is not None:
            os.write(self._fd, (json.dumps(fields, separators=(",", ":")) + "\n").encode())


def build_app(
    upstream: str, destinations: list[str], *, log: CallLog, hold_ms: float, prefetch: int
) -> WorkerApp:
    http = UpstreamClient(max_connections=prefetch * max(1, len(destinations)))
    app = WorkerApp(
        destinations=destinations, prefetch=prefetch, handler_timeout_seconds=20.0,
        lifespan=http.lifespan,
    )  # fmt: skip
    pid = os.getpid()

    @app.handler()
    async def call(job: Job) -> dict[str, Any]:
        key = effect_key(job)
        base = {"job_id": job.job_id, "attempt": job.attempt, "revision": job.revision}
        base |= {"key": key, "pid": pid}
        log.write(ev="start", t=time.time(), **base)
        try:
            answer = await post_call(http.client, upstream, job.payload, key)
        except Retry:
            log.write(ev="called", t=time.time(), status=0, **base)
            raise
        body = json.loads(answer.body) if answer.status == 200 else {}
        duplicate = bool(body.get("duplicate"))
        log.write(ev="called", t=time.time(), status=answer.status, duplicate=duplicate, **base)
        if hold_ms > 0:
            await asyncio.sleep(hold_ms / 1000)
        if answer.status != 200:  # its body read above: any other answer raises its outcome
            accepted(answer)
        return {"pid": pid, "key": key, "duplicate": duplicate}

    return app


app = build_app(
    os.environ.get("FAULT_UPSTREAM", "http://127.0.0.1:9"),
    [d for d in os.environ.get("FAULT_DESTINATIONS", "faults").split(",") if d],
    log=CallLog(os.environ.get("FAULT_CALL_LOG")),
    hold_ms=float(os.environ.get("FAULT_HOLD_MS", "0")),
    prefetch=int(os.environ.get("FAULT_PREFETCH", "16")),
)
