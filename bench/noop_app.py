"""The no-op ``WorkerApp`` that ``bench/worker.py`` runs through ``pacerd worker``:

    PYTHONPATH=bench pacerd worker --app noop_app:app

A top-level module (not ``bench.noop_app``), so that a worker started from
another tree (``BENCH_PACERD_ROOT``) finds it on ``PYTHONPATH`` while it
imports that tree's ``pacerd``. ``BENCH_WORKER_PREFETCH`` sets the prefetch
(default 500); ``pacerd.is_current`` is not asked (``check_current=False``)
unless ``BENCH_WORKER_CHECK_CURRENT=1`` (the library's default: asked for every offer).
"""

from __future__ import annotations

import os

from pacerd.worker import Job, WorkerApp

app = WorkerApp(
    destinations=[os.environ.get("BENCH_WORKER_DESTINATION", "bench")],
    prefetch=int(os.environ.get("BENCH_WORKER_PREFETCH", "500")),
    check_current=os.environ.get("BENCH_WORKER_CHECK_CURRENT") == "1",
)


@app.handler()
async def noop(job: Job) -> None:
    return None
