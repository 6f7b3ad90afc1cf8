"""Two senders on one upstream, real processes: how fair, how soon.

    .venv/bin/python -m bench.real_pair            # ~3 minutes
    .venv/bin/python -m bench.real_pair --json FILE

Two pacerd deployments that know nothing of each other (each its own
ledger, its own RabbitMQ vhost, its own daemon and two ``pacerd worker``
processes with prefetch 200, the worker program of ``bench.real_scenarios``)
drain an overdue backlog into the same model upstream (a token bucket of
100 calls/s with a burst of 0.1 s, 10 to 40 ms per call). Sender A resumes
first, from 10/s; sender B resumes ``--gap`` seconds later, also from 10/s
(the simulation's S2, shortened: there B starts after 100 s).

Measured from each ledger's history (``completed`` events, one per accepted
call, stamped when the outcome was applied: within a second of the call):
the Jain index of the two senders' completions over sliding 30 s windows,
5 s apart, from B's resume on; ``fair_after_s``, from B's resume to the start
of the first window from which every later window has an index of at least
0.98 (the issue's target: within 120 s); the worst window starting 120 s or
more after B's resume; and utilization and refusals of the upstream over
the run. The issue's target: Jain >= 0.98 within 120 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from bench import common
from bench import real_scenarios as rs

if TYPE_CHECKING:
    import subprocess

CAPACITY = 100.0
INITIAL_RATE = 10.0
WINDOW_S, STEP_S, TARGET, WITHIN_S = 30.0, 5.0, 0.98, 120.0
SENDERS = ("a", "b")


def jain(xs: list[float]) -> float:
    s, q = sum(xs), sum(x * x for x in xs)
    return 1.0 if q == 0 else s * s / (len(xs) * q)


def fairness(per_second: list[list[int]], start: int) -> dict[str, float]:
    """The module docstring's figures from each sender's completions per second."""
    n = min(len(x) for x in per_second)
    starts = [t for t in range(start, n) if t + WINDOW_S <= n and (t - start) % STEP_S == 0]
    index = [jain([float(sum(x[t : t + int(WINDOW_S)])) for x in per_second]) for t in starts]
    fair_from = math.inf
    for t, j in zip(reversed(starts), reversed(index), strict=True):
        if j < TARGET:
            break
        fair_from = t
    late = [j for t, j in zip(starts, index, strict=True) if t >= start + WITHIN_S]
    return {
        "fair_after_s": fair_from - start,
        "jain_min_late": min(late, default=math.nan),
        "jain_last": index[-1] if index else math.nan,
    }


async def execute(dsn: str, query: str, *args: object) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(query, *args)
    finally:
        await conn.close()


async def completions(dsn: str, t0: float, seconds: int) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT floor(extract(epoch FROM at) - $1)::int AS s, count(*) AS n"
            " FROM pacerd.job_events WHERE event = 'completed' GROUP BY 1",
            t0,
        )
    finally:
        await conn.close()
    out = [0] * seconds
    for row in rows:
        if 0 <= row["s"] < seconds:
            out[row["s"]] = row["n"]
    return out


async def measure(gap: float, duration: float) -> dict[str, object]:
    plan = rs.Plan(name="pair", upstream="model", phases=((0, CAPACITY),), duration=duration,
                   initial_rate=INITIAL_RATE)  # fmt: skip
    urls = {s: urlunsplit(urlsplit(rs.AMQP_URL)._replace(path=f"/{rs.VHOST}-{s}")) for s in SENDERS}
    up = await asyncio.to_thread(rs.ModelProcess, CAPACITY)
    procs: list[subprocess.Popen[bytes]] = []
    dsns: dict[str, str] = {}
    try:
        for s in SENDERS:
            if not common.ensure_vhost(urls[s]):
                raise SystemExit(f"cannot create the RabbitMQ vhost for sender {s} (rabbitmqctl)")
            dsns[s] = dsn = await common.fresh_ledger(f"{rs.DB}_{s}")
            await common.reset_queues(urls[s])
            await common.seed(dsn, int(CAPACITY * duration), prefix=s)
            await execute(dsn, "SELECT pacerd.pause($1)", common.DESTINATION)
            conn = await asyncpg.connect(dsn)
            try:
                env = rs.pacerd_env(dsn, plan, up.url) | {
                    "PACERD_BROKER__URL": urls[s],
                    "PACERD_DAEMON__INSTANCE_NAME": f"bench-pair-{s}",
                }
                for _ in range(rs.WORKERS):
                    procs.append(rs.spawn(["worker", "--app", "bench.real_scenarios:app"], env))
                daemon = rs.spawn(["run"], env)
                procs.append(daemon)
                await common.wait_leader(conn, daemon)
            finally:
                await conn.close()
        await asyncio.sleep(1.5)  # the workers consume by now
        t0 = time.time()
        for s, delay in zip(SENDERS, (0.0, gap), strict=True):
            await asyncio.sleep(max(0.0, t0 + delay - time.time()))
            await execute(dsns[s], "SELECT pacerd.resume($1)", common.DESTINATION)
        await asyncio.sleep(max(0.0, t0 + duration - time.time()))
        seconds = int(duration)
        per_second = [await completions(dsns[s], t0, seconds) for s in SENDERS]
        tr = await asyncio.to_thread(rs.trace_from, up, t0, duration)
        m = rs.metrics(plan, tr)
        return {
            **fairness(per_second, int(gap)),
            "util": m["util"],
            "ref_pct": m["ref_pct"],
            "per_second": per_second,
        }
    finally:
        await asyncio.gather(*(asyncio.to_thread(common.stop_process, p) for p in procs))
        await asyncio.to_thread(up.close)
        for s in SENDERS:
            await common.drop_database(f"{rs.DB}_{s}")
            await asyncio.to_thread(common.delete_vhost, urls[s])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gap", type=float, default=20.0, help="B resumes this long after A")
    parser.add_argument("--duration", type=float, default=180.0, help="the whole run, s")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    if args.duration < args.gap + WITHIN_S + WINDOW_S:
        parser.error(f"--duration must be at least --gap + {WITHIN_S + WINDOW_S:.0f} s")
    started, load = time.time(), rs.uptime()
    got = asyncio.run(measure(args.gap, args.duration))
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    rows = [[k, got[k]] for k in ("fair_after_s", "jain_min_late", "jain_last", "util", "ref_pct")]
    print(common.table(["figure", "pacerd"], rows))
    print(f"\nload {load}; {time.time() - started:.0f} s; {common.machine_description()}")


if __name__ == "__main__":
    main()
