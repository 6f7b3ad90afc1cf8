"""The no-op ``WorkerApp`` that ``bench/fanout.py`` runs through ``pacerd worker``:

    PYTHONPATH=. pacerd worker --app bench.fanout_app:app -c CONFIG

It consumes the shared ready queue of the group ``BENCH_FANOUT_GROUP``
(default ``tenants``: ``pacerd.ready.tenants``, resolved from the
configuration's ``[groups.tenants]``) and reports ``ok`` for every offer of
any kind and destination, without calling anything. ``BENCH_FANOUT_PREFETCH``
sets the prefetch (default 500); ``pacerd.is_current`` is not asked
(``check_current=False``), so the worker never touches the ledger and the
benchmark's count of ledger transactions is the daemon's alone.
"""

from __future__ import annotations

import os

from pacerd.worker import Job, WorkerApp

app = WorkerApp(
    groups=[os.environ.get("BENCH_FANOUT_GROUP", "tenants")],
    prefetch=int(os.environ.get("BENCH_FANOUT_PREFETCH", "500")),
    check_current=False,
)


@app.handler()
async def noop(job: Job) -> None:
    return None
