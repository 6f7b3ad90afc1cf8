"""The full cycle through the worker library (``pacerd worker --app``) beside
PgQueuer 1.6 and the benchmark's own batched no-op worker, same database,
same machine, same run.

    python3.11 -m venv /tmp/pacerd-peer-venv                   # once: the peer's
    /tmp/pacerd-peer-venv/bin/pip install "pgqueuer==1.6.*" asyncpg uvloop   # own venv
    .venv/bin/python -m bench.worker                           # ~4 minutes
    .venv/bin/python -m bench.worker --jobs 30000 --repeat 3 --workers 2 --prefetch 500
    BENCH_PACERD_ROOT=/path/to/other/checkout .venv/bin/python -m bench.worker   # A/B

Each repeat, back to back on one database:

* **PgQueuer 1.6** (``peer_pgqueuer.py`` in the peer's venv): N no-op jobs
  drained by 5 queue managers x ``batch_size`` 10 (``bench/peer.py``'s run);
* **pacerd, bench no-op worker**: the daemon (``pacerd run``) offers N seeded
  jobs, ``bench/noop_worker.py report`` (one process, the batch-at-a-time
  reference) publishes an ``ok`` outcome for each, the daemon applies them;
* **pacerd, worker library**: the same, with ``--workers`` processes of
  ``pacerd worker --app noop_app:app`` (``bench/noop_app.py``: a no-op
  handler, ``--prefetch``, ``check_current=False`` unless ``--check-current``:
  the library's default, ``pacerd.is_current`` asked for every offer) — what
  users run;
* with ``--node-workers K``, **pacerd, Node.js example**: K processes of
  ``examples/node-worker/worker.js``, each job one HTTP call to a model
  upstream (``pacerd.testing.upstream``, unlimited capacity, no latency) run
  by this process.

Pacing is effectively unlimited (``initial_rate = max_rate`` = ``--rate``,
default 20,000/s, far above what this path carries: admission's cap on
unconfirmed publishes is what slows the daemon, as in ``bench/dispatch.py``). jobs/s is
N over the time from the first claim to the last job's ``updated_at`` (every
job ``completed``), as ``bench/dispatch.py`` times it. CPU ms per job is each
process's own utime+stime (``/proc``) over the drain: the worker processes'
summed, and the daemon's. The daemon and the ``pacerd worker`` processes run
``pacerd`` from ``BENCH_PACERD_ROOT`` (default: this checkout), so two trees
can be compared by two runs. The machine is shared: each line carries the
1-minute load average, and ratios are taken within one repeat. Each repeat's
line also splits the machine's CPU over the drain by role (``common.cpu_split``:
broker, daemon, workers, PostgreSQL, kernel, other — "other" is whatever else
ran meanwhile) and counts the transactions committed on the database
(``pg_stat_database``) per 1,000 jobs; when the drain is CPU-bound, the total
CPU per job is what sets its rate. ``--profile DIR`` records the daemon and
the first worker of the last library repeat with py-spy (``$BENCH_PYSPY``, as
``bench/dispatch.py``) and appends ``bench.profile_summary`` of both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from bench import common, dispatch, peer
from pacerd.testing.upstream import CapacitySchedule, ModelUpstream, UpstreamParams

DB = "pacerd_bench_worker"
NODE_WORKER = common.ROOT / "examples" / "node-worker" / "worker.js"


@dataclass(frozen=True, slots=True)
class CycleRun:
    jobs_per_second: float
    worker_cpu_ms_per_job: float
    daemon_cpu_ms_per_job: float
    load: float
    machine_ms_per_job: dict[str, float]  # every process's CPU over the drain, by role
    transactions_per_job: float  # committed on the database over the drain (pg_stat_database)


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def start_library_workers(
    dsn: str, count: int, prefetch: int, *, check_current: bool = False
) -> list[subprocess.Popen[bytes]]:
    env = dispatch.daemon_env(dsn, rate=1.0, tick=1.0, max_inflight=1)
    env["BENCH_WORKER_CHECK_CURRENT"] = "1" if check_current else "0"
    env["PYTHONPATH"] = str(common.BENCH_DIR)
    env["BENCH_WORKER_PREFETCH"] = str(prefetch)
    env["BENCH_WORKER_DESTINATION"] = common.DESTINATION
    return [
        subprocess.Popen(
            [sys.executable, "-m", "pacerd", "worker", "--app", "noop_app:app"],
            env=env,
            cwd=common.PACERD_ROOT,
            stdout=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]


async def transactions(conn: asyncpg.Connection) -> int:
    """Transactions committed on this database so far (every statement sent
    outside a transaction is one); the statistics are flushed at most once a
    second, so over a drain of several seconds the count is close."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    count: int = await conn.fetchval(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    )
    return count


def start_node_workers(count: int, prefetch: int, upstream: str) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PACERD_", "OTEL_"))}
    env |= {"AMQP_URL": common.AMQP_URL, "DESTINATION": common.DESTINATION}
    env |= {"UPSTREAM_URL": upstream, "PREFETCH": str(prefetch)}
    return [
        subprocess.Popen(
            ["node", str(NODE_WORKER)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]


async def cycle(
    dsn: str, *, n: int, rate: float, tick: float, kind: str, workers: int, prefetch: int,
    check_current: bool = False, profile: Path | None = None,
) -> CycleRun:  # fmt: skip
    """One daemon run over N freshly seeded jobs, with ``workers`` worker
    processes of ``kind``: ``library`` (``pacerd worker --app``), ``noop``
    (the bench's batched no-op worker, one process) or ``node`` (the Node.js
    example, calling a model upstream in this process for every job);
    ``check_current`` for the library's; with ``profile``, py-spy records the
    daemon and the first worker over the drain (``daemon.txt``, ``worker.txt``)."""
    if kind == "node":
        params = UpstreamParams(schedule=CapacitySchedule.parse("0:10000000"))
        async with ModelUpstream(params) as upstream:
            return await _cycle(
                dsn, n=n, rate=rate, tick=tick, kind=kind, workers=workers, prefetch=prefetch,
                upstream=upstream.url,
            )  # fmt: skip
    return await _cycle(
        dsn, n=n, rate=rate, tick=tick, kind=kind, workers=workers, prefetch=prefetch,
        check_current=check_current, profile=profile,
    )  # fmt: skip


async def _cycle(
    dsn: str, *, n: int, rate: float, tick: float, kind: str, workers: int, prefetch: int,
    upstream: str = "", check_current: bool = False, profile: Path | None = None,
) -> CycleRun:  # fmt: skip
    conn = await asyncpg.connect(dsn)
    await conn.execute("TRUNCATE pacerd.jobs, pacerd.job_events")
    await conn.execute("UPDATE pacerd.destinations SET leader = NULL, pacer_state = NULL")
    await common.seed(dsn, n)
    await conn.execute("SELECT pacerd.pause($1)", common.DESTINATION)
    await common.reset_queues()
    if kind == "library":
        procs: list[subprocess.Popen[bytes]] = start_library_workers(
            dsn, workers, prefetch, check_current=check_current
        )
    elif kind == "node":
        procs = start_node_workers(workers, prefetch, upstream)
    else:
        procs = [common.start_worker("report", prefetch=prefetch)]  # type: ignore[list-item]
    daemon = dispatch.start_daemon(
        dispatch.daemon_env(dsn, rate=rate, tick=tick, max_inflight=n + 10_000)
    )
    spies: list[subprocess.Popen[bytes]] = []
    try:
        await common.wait_consumers(len(procs), procs)
        await common.wait_leader(conn, daemon)
        await asyncio.sleep(0.5)
        if profile is not None:
            spies.append(dispatch.start_pyspy(daemon.pid, profile / "daemon.txt"))
            spies.append(dispatch.start_pyspy(procs[0].pid, profile / "worker.txt"))
            await asyncio.sleep(1.0)
        machine_before = common.cpu_by_process()
        xacts_before = await transactions(conn)
        before = [common.proc_sample(p.pid).cpu_seconds for p in procs]
        daemon_before = common.proc_sample(daemon.pid).cpu_seconds
        started_at = await conn.fetchval("SELECT clock_timestamp()")
        await conn.execute("SELECT pacerd.resume($1)", common.DESTINATION)
        deadline = time.monotonic() + max(120.0, n / 100)
        while True:
            left = await conn.fetchval(
                "SELECT count(*) FROM pacerd.jobs WHERE state <> 'completed'"
            )
            if left == 0:
                break
            if daemon.poll() is not None or any(p.poll() is not None for p in procs):
                raise RuntimeError("the daemon or a worker exited during the drain")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{left} jobs not completed in time")
            await asyncio.sleep(0.1)
        after = [common.proc_sample(p.pid).cpu_seconds for p in procs]
        daemon_after = common.proc_sample(daemon.pid).cpu_seconds
        split = common.cpu_split(machine_before, common.cpu_by_process())
        xacts = await transactions(conn) - xacts_before
        first_claim = await conn.fetchval(
            "SELECT min(at) FROM pacerd.job_events WHERE event = 'claimed'"
        )
        finished_at = await conn.fetchval("SELECT max(updated_at) FROM pacerd.jobs")
        seconds = (finished_at - max(started_at, first_claim)).total_seconds()
        return CycleRun(
            jobs_per_second=n / seconds,
            worker_cpu_ms_per_job=(sum(after) - sum(before)) / n * 1000,
            daemon_cpu_ms_per_job=(daemon_after - daemon_before) / n * 1000,
            load=load_average(),
            machine_ms_per_job={role: cpu / n * 1000 for role, cpu in split.items()},
            transactions_per_job=xacts / n,
        )
    finally:
        for spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        common.stop_process(daemon)
        for proc in procs:
            common.stop_process(proc)
        await conn.close()


async def measure(args: argparse.Namespace) -> str:
    dsn = await common.fresh_ledger(DB)
    pgq: list[dict[str, float]] = []
    runs: dict[str, list[CycleRun]] = {"noop": [], "library": [], "node": []}
    try:
        rate = args.rate
        print(f"  rate {rate:,.0f}/s", flush=True)
        for i in range(args.repeat):
            pgq.append(await peer.pgqueuer_run(args.peer_python, dsn, args.jobs))
            peer_rate, peer_load = pgq[-1]["full_cycle_per_second"], load_average()
            print(
                f"  [{i + 1}] PgQueuer: {peer_rate:,.0f} jobs/s (load {peer_load:.2f})", flush=True
            )
            kinds = [("noop", 1), ("library", args.workers), ("node", args.node_workers)]
            for kind, workers in kinds:
                if (kind == "noop" and args.skip_noop) or not workers:
                    continue
                profile = args.profile if kind == "library" and i == args.repeat - 1 else None
                run = await cycle(
                    dsn, n=args.jobs, rate=rate, tick=args.tick, kind=kind, workers=workers,
                    prefetch=args.prefetch, check_current=args.check_current, profile=profile,
                )  # fmt: skip
                runs[kind].append(run)
                label = {"noop": "bench no-op worker", "library": "pacerd worker --app"}.get(
                    kind, "Node.js example"
                )
                print(
                    f"  [{i + 1}] {label}: {run.jobs_per_second:,.0f} jobs/s "
                    f"({run.jobs_per_second / peer_rate:.2f} of PgQueuer), worker CPU "
                    f"{run.worker_cpu_ms_per_job:.3f} ms/job, daemon CPU "
                    f"{run.daemon_cpu_ms_per_job:.3f} ms/job (load {run.load:.2f}); machine CPU "
                    + ", ".join(f"{r} {ms:.3f}" for r, ms in run.machine_ms_per_job.items())
                    + f" ms/job (total {sum(run.machine_ms_per_job.values()):.3f}); "
                    f"{run.transactions_per_job * 1000:,.0f} transactions per 1,000 jobs",
                    flush=True,
                )
    finally:
        await common.reset_queues()
        await common.drop_database(DB)
    peer_cycle = common.median(p["full_cycle_per_second"] for p in pgq)
    rows: list[tuple[object, ...]] = [
        ("PgQueuer 1.6 (5 consumers × batch 10, no broker)", peer_cycle, "1.00", "–",
         common.median(p["cpu_per_1000"] for p in pgq), "–"),
    ]  # fmt: skip
    labels = {
        "noop": "pacerd + bench no-op worker (1 process, batched)",
        "library": f"pacerd + pacerd worker --app ({args.workers} processes, "
        f"prefetch {args.prefetch}{', is_current per offer' if args.check_current else ''})",
        "node": f"pacerd + examples/node-worker ({args.node_workers} processes, prefetch "
        f"{args.prefetch}, an HTTP call to a model upstream per job)",
    }
    for kind, label in labels.items():
        if not runs[kind]:
            continue
        # the ratio of each repeat to the PgQueuer run just before it, then the median
        ratios = [
            r.jobs_per_second / p["full_cycle_per_second"]
            for r, p in zip(runs[kind], pgq, strict=False)
        ]
        rows.append((
            label,
            common.median(r.jobs_per_second for r in runs[kind]),
            f"{common.median(ratios):.2f}",
            f"{common.median(r.worker_cpu_ms_per_job for r in runs[kind]):.3f}",
            f"{common.median(r.daemon_cpu_ms_per_job for r in runs[kind]):.3f}",
            f"{common.median(r.load for r in runs[kind]):.2f}",
        ))  # fmt: skip
    return common.table(
        ["full cycle", "jobs/s (median)", "of PgQueuer (median of per-repeat ratios)",
         "worker CPU ms/job", "daemon (PgQueuer: its process) CPU ms/job", "load 1 min"],
        rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=30_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="pacerd worker processes")
    parser.add_argument("--prefetch", type=int, default=500, help="the workers' prefetch")
    parser.add_argument(
        "--rate", type=float, default=20_000.0, help="initial_rate = max_rate (jobs/s)"
    )
    parser.add_argument("--tick", type=float, default=1.0, help="pacerd tick_seconds")
    parser.add_argument("--skip-noop", action="store_true", help="no bench no-op worker runs")
    parser.add_argument(
        "--check-current", action="store_true",
        help="the library's workers ask pacerd.is_current for every offer (the default of apps)",
    )  # fmt: skip
    parser.add_argument(
        "--node-workers", type=int, default=0,
        help="also run the Node.js example (npm ci in examples/node-worker first)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=Path, default=None,
        help="py-spy the daemon and a worker of the last library repeat into this directory",
    )  # fmt: skip
    parser.add_argument("--peer-python", default=peer.PEER_PYTHON, help="python of the peer's venv")
    args = parser.parse_args()
    if not os.path.exists(args.peer_python):
        sys.exit(f"no peer venv at {args.peer_python}: see the docstring of bench/worker.py")
    print(f"# worker — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"# {common.machine_description()}")
    tree = "this checkout" if common.PACERD_ROOT == common.ROOT else f"{common.PACERD_ROOT}"
    print(
        f"# N = {args.jobs:,} jobs, {args.repeat} repeats, {args.workers} worker processes, "
        f"prefetch {args.prefetch}, pacerd from {tree}; uptime: "
        + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    )
    out = common.run(lambda: measure(args))
    if args.profile is not None:
        from bench import profile_summary

        for name in ("worker", "daemon"):
            summary = profile_summary.summarize(args.profile / f"{name}.txt")
            out += f"\n\n## py-spy, {name}\n" + summary
    print()
    print(out)
    print(
        "\n# uptime at the end: "
        + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    )


if __name__ == "__main__":
    main()
