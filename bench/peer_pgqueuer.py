"""PgQueuer's side of ``bench/peer.py``; runs in the peer's own virtualenv
(never the project's), started by ``peer.py``:

    /tmp/pacerd-peer-venv/bin/python bench/peer_pgqueuer.py DSN JOBS [CONSUMERS] [BATCH]

Installs PgQueuer's schema in DSN if absent, empties its queue, enqueues JOBS
no-op jobs in batches of 1,000 (timed: enqueue), then runs CONSUMERS queue
managers (one connection each, ``batch_size`` BATCH, drain mode) in this
process until the queue is empty (timed: the full cycle dequeue → no-op →
complete). Prints one JSON line with jobs/s and this process's CPU.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import asyncpg
import uvloop
from pgqueuer.db import AsyncpgDriver
from pgqueuer.qm import QueueManager
from pgqueuer.queries import Queries
from pgqueuer.types import QueueExecutionMode

ENTRYPOINT = "bench_noop"


async def main(dsn: str, jobs: int, consumers: int, batch: int) -> dict[str, float]:
    admin = await asyncpg.connect(dsn)
    queries = Queries(AsyncpgDriver(admin))
    if not await queries.schema_is_installed():
        await queries.install()
    await queries.clear_queue()
    await queries.clear_queue_log()
    payload = b'{"n": 1, "pad": "' + b"x" * 40 + b'"}'
    t0 = time.perf_counter()
    for start in range(0, jobs, 1000):
        n = min(1000, jobs - start)
        await queries.enqueue([ENTRYPOINT] * n, [payload] * n, [0] * n)
    enqueue = jobs / (time.perf_counter() - t0)
    await admin.execute("VACUUM ANALYZE")

    connections = [await asyncpg.connect(dsn) for _ in range(consumers)]
    managers = []
    for conn in connections:
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint(ENTRYPOINT)
        async def noop(job: object) -> None:
            return None

        managers.append(qm)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(
        *(qm.run(batch_size=batch, mode=QueueExecutionMode.drain) for qm in managers)
    )
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    left = await queries.queued_work([ENTRYPOINT])
    for conn in connections:
        await conn.close()
    await admin.close()
    return {
        "enqueue_per_second": enqueue,
        "full_cycle_per_second": jobs / seconds,
        "cpu_per_1000": cpu / jobs * 1000,
        "left": float(left),
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    result = uvloop.run(
        main(
            args[0],
            int(args[1]),
            int(args[2]) if len(args) > 2 else 5,
            int(args[3]) if len(args) > 3 else 10,
        )
    )
    print(json.dumps(result), flush=True)
