"""pacerd's real daemon (``python -m pacerd run``, a subprocess) draining a
backlog of N due jobs, beside the raw limit measured in the same run.

    .venv/bin/python -m bench.dispatch                       # ~3 minutes
    .venv/bin/python -m bench.dispatch --jobs 30000 --repeat 3
    .venv/bin/python -m bench.dispatch --profile /tmp/pacerd-profile   # + py-spy

Each repeat runs, back to back on the same machine:

1. the raw end-to-end limit (``limits.raw_end_to_end``: claim 500 → publish
   with confirms → mark offered, no pacing) with the no-op acking consumer,
   twice: publishing each message with its own ``basic_publish`` (the issue's
   raw loop, "of raw limit") and writing each batch as one frame buffer as
   pacerd does (``one_write``, the stricter "of raw, one write");
2. **dispatch alone**: the daemon offers all N jobs, a no-op consumer acks
   them (no outcomes: every job ends ``offered``);
3. **full cycle**: the daemon offers all N jobs, no-op workers publish an
   ``ok`` outcome for each, and the daemon's outcome consumer applies them to
   the ledger (every job ends ``completed``).

Pacing is effectively unlimited: ``initial_rate = max_rate`` = 1.5 x the
faster raw limit measured just before (or ``--rate``), ``max_inflight`` above N,
``tick_seconds = --tick`` (default 1 s, the config's default; each tick pays
a fixed cost — the claim, the last slice's confirms, the final mark — so a
shorter tick measures lower; RESULTS.md has both). A rate above what the broker
absorbs is slowed by admission's cap on unconfirmed publishes (1,000), not by
confirm timeouts. The destination is
paused while the daemon starts and resumed when it leads it; jobs/s is N over
the time from the first claim to the last job's ``updated_at`` (database clock;
the raw loop too is timed from its first claim: the daemon sees the resume at
its next tick, up to ``tick_seconds`` later, and that wait is not throughput).
CPU s / 1,000 jobs and peak RSS (VmHWM) are the daemon process's own. The
daemon runs without trace or metric exporters (``OTEL_*_EXPORTER=none``); its
spans are still created. Then it measures the idle cost: the daemon with the
default pacing config and nothing due, for ``--idle-seconds``.

With ``--profile DIR`` (py-spy at ``$BENCH_PYSPY`` or
``/tmp/pacerd-prof/bin/py-spy``), the last full cycle is recorded
(``DIR/full_cycle.txt``, collapsed stacks) and summarised by
``bench.profile_summary``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from bench import common, limits

DB = "pacerd_bench_dispatch"
# The tree whose pacerd the daemon runs (a copy with a proposed change, say).
PYSPY = os.environ.get("BENCH_PYSPY", "/tmp/pacerd-prof/bin/py-spy")


@dataclass(frozen=True, slots=True)
class DaemonRun:
    jobs_per_second: float
    cpu_per_1000: float
    peak_rss_mb: float
    # CPU ms per job of each role on the machine (common.ROLES), over the drain
    cpu_ms_per_job: dict[str, float] = field(default_factory=dict)


def daemon_env(dsn: str, *, rate: float, tick: float, max_inflight: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PACERD_", "OTEL_"))}
    env.update(
        {
            "PACERD_DATABASE__DSN": dsn,
            "PACERD_BROKER__URL": common.AMQP_URL,
            "PACERD_PACING__TICK_SECONDS": str(tick),
            "PACERD_PACING__INITIAL_RATE": str(rate),
            "PACERD_PACING__MAX_RATE": str(rate),
            "PACERD_PACING__MAX_INFLIGHT": str(max_inflight),
            "PACERD_DAEMON__INSTANCE_NAME": "bench",
            "PACERD_TELEMETRY__LOG_LEVEL": "warning",
            "PACERD_TELEMETRY__LOG_FORMAT": "json",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
        }
    )
    return env


def start_daemon(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pacerd", "run"],
        env=env,
        cwd=common.PACERD_ROOT,
        stdout=subprocess.DEVNULL,
    )


def start_pyspy(pid: int, output: Path) -> subprocess.Popen[bytes]:
    """py-spy recording ``pid`` (200 Hz, collapsed stacks) until SIGINT."""
    output.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [PYSPY, "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
         "--output", str(output), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


async def drain(
    dsn: str,
    *,
    n: int,
    mode: str,
    rate: float,
    tick: float,
    profile: Path | None = None,
) -> DaemonRun:
    """One daemon run over N freshly seeded jobs. ``mode``: ``ack`` (dispatch
    alone) or ``report`` (full cycle)."""
    conn = await asyncpg.connect(dsn)
    await conn.execute("TRUNCATE pacerd.jobs, pacerd.job_events")
    await conn.execute("UPDATE pacerd.destinations SET leader = NULL, pacer_state = NULL")
    await common.seed(dsn, n)
    await conn.execute("SELECT pacerd.pause($1)", common.DESTINATION)
    await common.reset_queues()
    worker = common.start_worker(mode)
    proc = start_daemon(daemon_env(dsn, rate=rate, tick=tick, max_inflight=n + 10_000))
    spy: subprocess.Popen[bytes] | None = None
    final = "offered" if mode == "ack" else "completed"
    try:
        await common.wait_leader(conn, proc)
        await asyncio.sleep(0.5)
        if profile is not None:
            spy = start_pyspy(proc.pid, profile / "full_cycle.txt")
            await asyncio.sleep(1.0)
        before = common.proc_sample(proc.pid)
        machine_before = common.cpu_by_process()
        started_at = await conn.fetchval("SELECT clock_timestamp()")
        await conn.execute("SELECT pacerd.resume($1)", common.DESTINATION)
        deadline = time.monotonic() + max(120.0, n / 200)
        while True:
            left = await conn.fetchval("SELECT count(*) FROM pacerd.jobs WHERE state <> $1", final)
            if left == 0:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{left} jobs not {final} in time")
            await asyncio.sleep(0.1)
        after = common.proc_sample(proc.pid)
        split = common.cpu_split(machine_before, common.cpu_by_process())
        # Timed from the first claim, as the raw loop is: the daemon sees the
        # resume at its next tick (0 to tick_seconds later), which is not throughput.
        first_claim = await conn.fetchval(
            "SELECT min(at) FROM pacerd.job_events WHERE event = 'claimed'"
        )
        finished_at = await conn.fetchval("SELECT max(updated_at) FROM pacerd.jobs")
        seconds = (finished_at - max(started_at, first_claim)).total_seconds()
        return DaemonRun(
            jobs_per_second=n / seconds,
            cpu_per_1000=(after.cpu_seconds - before.cpu_seconds) / n * 1000,
            peak_rss_mb=after.hwm_mb,
            cpu_ms_per_job={role: cpu / n * 1000 for role, cpu in split.items()},
        )
    finally:
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        common.stop_process(proc)
        common.stop_process(worker)
        await conn.close()


async def idle_cost(dsn: str, seconds: float) -> tuple[float, float]:
    """(% of one core, RSS MB) of the daemon with default pacing and nothing due."""
    conn = await asyncpg.connect(dsn)
    await conn.execute("TRUNCATE pacerd.jobs, pacerd.job_events")
    await conn.execute("UPDATE pacerd.destinations SET leader = NULL, pacer_state = NULL")
    await conn.execute("SELECT pacerd.resume($1)", common.DESTINATION)
    env = daemon_env(dsn, rate=10.0, tick=1.0, max_inflight=2000)
    for key in ("PACERD_PACING__TICK_SECONDS", "PACERD_PACING__INITIAL_RATE",
                "PACERD_PACING__MAX_RATE", "PACERD_PACING__MAX_INFLIGHT"):  # fmt: skip
        env.pop(key)  # the defaults
    proc = start_daemon(env)
    try:
        await common.wait_leader(conn, proc)
        await asyncio.sleep(3.0)  # past start-up
        before = common.proc_sample(proc.pid)
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        after = common.proc_sample(proc.pid)
        elapsed = time.perf_counter() - t0
        return 100 * (after.cpu_seconds - before.cpu_seconds) / elapsed, after.rss_mb
    finally:
        common.stop_process(proc)
        await conn.close()


async def measure(args: argparse.Namespace) -> str:
    dsn = await common.fresh_ledger(DB)
    raw: list[limits.RawRun] = []
    raw_one: list[limits.RawRun] = []
    runs: dict[str, list[DaemonRun]] = {"ack": [], "report": []}
    try:
        for i in range(args.repeat):
            raw.append(await limits.raw_end_to_end(dsn, n=args.jobs, consumer=True))
            raw_one.append(
                await limits.raw_end_to_end(dsn, n=args.jobs, consumer=True, one_write=True)
            )
            print(
                f"  [{i + 1}] raw end to end: {raw[-1].jobs_per_second:,.0f} jobs/s, "
                f"{raw[-1].cpu_per_1000:.2f} CPU s/1000; one write per batch: "
                f"{raw_one[-1].jobs_per_second:,.0f} jobs/s, "
                f"{raw_one[-1].cpu_per_1000:.2f} CPU s/1000",
                flush=True,
            )
            fastest = max(raw[-1].jobs_per_second, raw_one[-1].jobs_per_second)
            rate = args.rate or round(1.5 * fastest)
            for mode in ("ack", "report"):
                last = i == args.repeat - 1
                profile = args.profile if (mode == "report" and last) else None
                run = await drain(
                    dsn, n=args.jobs, mode=mode, rate=rate, tick=args.tick, profile=profile
                )
                runs[mode].append(run)
                split = ", ".join(f"{k} {v:.3f}" for k, v in run.cpu_ms_per_job.items())
                print(
                    f"  [{i + 1}] {'dispatch alone' if mode == 'ack' else 'full cycle'} "
                    f"(rate {rate:,.0f}/s): "
                    f"{run.jobs_per_second:,.0f} jobs/s, {run.cpu_per_1000:.2f} CPU s/1000, "
                    f"peak RSS {run.peak_rss_mb:.0f} MB; machine CPU ms/job: {split}",
                    flush=True,
                )
        idle_pct, idle_rss = await idle_cost(dsn, args.idle_seconds)
        print(f"  idle: {idle_pct:.2f} % of a core, RSS {idle_rss:.0f} MB", flush=True)
    finally:
        await common.reset_queues()
        await common.drop_database(DB)

    limit = common.median(r.jobs_per_second for r in raw)
    limit_one = common.median(r.jobs_per_second for r in raw_one)
    rows: list[tuple[object, ...]] = [
        ("raw end to end (limits.py, no-op acking consumer)", limit, "100 %",
         f"{100 * limit / limit_one:.0f} %", common.median(r.cpu_per_1000 for r in raw), "–"),
        ("raw end to end, one write per batch", limit_one, f"{100 * limit_one / limit:.0f} %",
         "100 %", common.median(r.cpu_per_1000 for r in raw_one), "–"),
    ]  # fmt: skip
    for mode, label in (("ack", "pacerd dispatch alone"), ("report", "pacerd full cycle")):
        rate = common.median(r.jobs_per_second for r in runs[mode])
        rows.append((
            label,
            rate,
            f"{100 * rate / limit:.0f} %",
            f"{100 * rate / limit_one:.0f} %",
            common.median(r.cpu_per_1000 for r in runs[mode]),
            max(r.peak_rss_mb for r in runs[mode]),
        ))  # fmt: skip
    out = common.table(
        ["path", "jobs/s (median)", "of raw limit", "of raw, one write", "CPU s / 1,000 jobs",
         "peak RSS MB"],
        rows,
    )  # fmt: skip
    split_rows = [
        (label, *(common.median(r.cpu_ms_per_job[role] for r in runs[mode])
                  for role in common.ROLES))
        for mode, label in (("ack", "dispatch alone"), ("report", "full cycle"))
    ]  # fmt: skip
    out += "\n\nmachine CPU ms per job (median of the repeats; two cores = 2,000 ms/s):\n\n"
    out += common.table(["run", *common.ROLES], split_rows)
    out += f"\n\nidle (default pacing, nothing due, {args.idle_seconds:.0f} s): "
    out += f"{idle_pct:.2f} % of one core, RSS {idle_rss:.0f} MB"
    if args.profile is not None:
        from bench import profile_summary

        out += "\n\n" + profile_summary.summarize(args.profile / "full_cycle.txt")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=30_000, help="jobs per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    parser.add_argument(
        "--rate", type=float, default=None, help="initial_rate = max_rate (default 1.5 x raw)"
    )
    parser.add_argument("--tick", type=float, default=1.0, help="tick_seconds")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the last full cycle")
    args = parser.parse_args()
    print(f"# dispatch — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"# {common.machine_description()}")
    rate = f"{args.rate:,.0f}/s" if args.rate else "1.5 x the faster raw loop"
    tree = "this checkout" if common.PACERD_ROOT == common.ROOT else f"{common.PACERD_ROOT}"
    print(
        f"# N = {args.jobs:,} jobs, {args.repeat} repeats, rate {rate}, "
        f"tick {args.tick} s, pacerd from {tree}"
    )
    out = common.run(lambda: measure(args))
    print()
    print(out)


if __name__ == "__main__":
    main()
