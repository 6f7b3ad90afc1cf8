"""pacerd's full cycle beside PgQueuer's on the same PostgreSQL database, same
machine, same run.

    python3.11 -m venv /tmp/pacerd-peer-venv                   # once: the peer's
    /tmp/pacerd-peer-venv/bin/pip install "pgqueuer==1.6.*" asyncpg uvloop   # own venv
    .venv/bin/python -m bench.peer                             # ~3 minutes
    .venv/bin/python -m bench.peer --jobs 20000 --repeat 3 --peer-python /path/to/python

Each repeat, on one database (PgQueuer's tables in ``public``, pacerd's in
``pacerd``):

* **PgQueuer 1.6** (``peer_pgqueuer.py`` in the peer's venv): enqueue N no-op
  jobs in batches of 1,000, then 5 queue managers x ``batch_size`` 10 drain
  them (dequeue → no-op → complete). No broker hop.
* **pacerd** (``dispatch.drain``): the daemon offers N seeded jobs to
  RabbitMQ, no-op workers publish an ``ok`` outcome each, the daemon applies
  them (claim → publish → mark offered → worker → outcome → report): two
  broker hops.

Enqueue is timed apart for both (pacerd's is ``pacerd.schedule`` per job
from SQL, in batches of 1,000 through ``generate_series``); the full-cycle
figure is the drain of N already-enqueued jobs for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import asyncpg

from bench import common, dispatch, limits

DB = "pacerd_bench_peer"
PEER_PYTHON = os.environ.get("BENCH_PEER_PYTHON", "/tmp/pacerd-peer-venv/bin/python")


async def pgqueuer_run(python: str, dsn: str, jobs: int) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        python, str(common.BENCH_DIR / "peer_pgqueuer.py"), dsn, str(jobs), "5", "10",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, _ = await asyncio.wait_for(proc.communicate(), 600)
    if proc.returncode:
        raise RuntimeError(f"the PgQueuer run failed ({proc.returncode})")
    result: dict[str, float] = json.loads(stdout.decode().strip().splitlines()[-1])
    return result


async def pacerd_enqueue(dsn: str, jobs: int) -> float:
    """Jobs/s scheduling through the public SQL API (``pacerd.schedule``)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("TRUNCATE pacerd.jobs, pacerd.job_events")
        t0 = time.perf_counter()
        for start in range(0, jobs, 1000):
            await conn.execute(
                "SELECT pacerd.schedule(job_id => 'e-' || g, kind => 'bench',"
                " destination => $1, payload => jsonb_build_object('n', g, 'pad', $4::text))"
                " FROM generate_series($2::bigint, $3::bigint) g",
                common.DESTINATION,
                start,
                min(jobs, start + 1000) - 1,
                common.PAD,
            )
        return jobs / (time.perf_counter() - t0)
    finally:
        await conn.close()


async def measure(args: argparse.Namespace) -> str:
    dsn = await common.fresh_ledger(DB)
    peer: list[dict[str, float]] = []
    ours: list[dispatch.DaemonRun] = []
    enqueue: list[float] = []
    try:
        for i in range(args.repeat):
            peer.append(await pgqueuer_run(args.peer_python, dsn, args.jobs))
            print(f"  [{i + 1}] PgQueuer: {peer[-1]}", flush=True)
            enqueue.append(await pacerd_enqueue(dsn, args.jobs))
            rate = args.rate
            if rate is None:  # effectively unlimited: 1.5 x this machine's raw limit, now
                raw = await limits.raw_end_to_end(dsn, n=min(args.jobs, 10_000))
                rate = round(1.5 * raw.jobs_per_second)
            run = await dispatch.drain(dsn, n=args.jobs, mode="report", rate=rate, tick=args.tick)
            ours.append(run)
            print(f"  [{i + 1}] pacerd: enqueue {enqueue[-1]:,.0f}/s, {run}", flush=True)
    finally:
        await common.reset_queues()
        await common.drop_database(DB)
    peer_cycle = common.median(p["full_cycle_per_second"] for p in peer)
    ours_cycle = common.median(r.jobs_per_second for r in ours)
    rows = [
        (
            "PgQueuer 1.6 (5 consumers × batch 10, no broker)",
            common.median(p["enqueue_per_second"] for p in peer),
            peer_cycle,
            common.median(p["cpu_per_1000"] for p in peer),
            "100 %",
        ),
        (
            "pacerd (daemon + no-op workers, 2 broker hops)",
            common.median(enqueue),
            ours_cycle,
            common.median(r.cpu_per_1000 for r in ours),
            f"{100 * ours_cycle / peer_cycle:.0f} %",
        ),
    ]
    return common.table(
        ["system", "enqueue jobs/s", "full cycle jobs/s", "CPU s / 1,000 (its process)",
         "of PgQueuer"],
        rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--rate", type=float, default=None, help="pacerd initial = max rate (1.5 x raw limit)"
    )
    parser.add_argument("--tick", type=float, default=1.0, help="pacerd tick_seconds")
    parser.add_argument("--peer-python", default=PEER_PYTHON, help="python of the peer's venv")
    args = parser.parse_args()
    if not os.path.exists(args.peer_python):
        sys.exit(f"no peer venv at {args.peer_python}: see the docstring of bench/peer.py")
    print(f"# peer — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"# {common.machine_description()}")
    print(f"# N = {args.jobs:,} jobs, {args.repeat} repeats")
    print(common.run(lambda: measure(args)))


if __name__ == "__main__":
    main()
