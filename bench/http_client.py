"""The CPU a worker spends on one upstream call, by HTTP client: the demo
app's call (``pacerd_demo.app.call_upstream`` on its pooled aiohttp session)
beside the same call through a pooled ``httpx.AsyncClient`` (what the app
used before), against the model upstream in a process of its own (no
capacity limit, no latency), so that this process's CPU time
(``time.process_time``) is the client's alone; on uvloop, as ``pacerd
worker`` runs. Needs no services.

    .venv/bin/python -m bench.http_client                   # ~30 s
    .venv/bin/python -m bench.http_client --calls 4000 --concurrency 32 --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import httpx

from pacerd.worker import Job
from pacerd_demo.app import call_upstream, new_client

Call = Callable[[Job], Awaitable[Any]]


def job(n: int) -> Job:
    return Job(
        job_id=f"bench-{n}", kind="call", destination="bench", attempt=1, revision=1,
        payload={"n": n}, cursor=None, eligible_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    )  # fmt: skip


async def measure(call: Call, calls: int, concurrency: int, first: int) -> tuple[float, float]:
    """(CPU ms per call, calls per second) over ``calls`` calls, ``concurrency`` at once."""
    gate = asyncio.Semaphore(concurrency)

    async def one(n: int) -> None:
        async with gate:
            await call(job(n))

    await asyncio.gather(*(one(first - 1 - n) for n in range(min(200, calls))))  # warm up
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(first + n) for n in range(calls)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return 1000.0 * cpu / calls, calls / wall


async def with_aiohttp(url: str, calls: int, concurrency: int, first: int) -> tuple[float, float]:
    async with new_client(max_connections=concurrency) as client:
        return await measure(lambda j: call_upstream(client, url, j), calls, concurrency, first)


async def with_httpx(url: str, calls: int, concurrency: int, first: int) -> tuple[float, float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(10.0, connect=3.0)) as c:

        async def call(j: Job) -> Any:
            response = await c.post(
                f"{url}/v1/call",
                content=json.dumps(j.payload).encode(),
                headers={"Idempotency-Key": j.idempotency_key, "Content-Type": "application/json"},
            )
            return response.json()

        return await measure(call, calls, concurrency, first)


CLIENTS = {"aiohttp (the app's)": with_aiohttp, "httpx": with_httpx}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "pacerd.testing.upstream", "--port", "0",
         "--capacity-schedule", "0:1000000"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert upstream.stdout is not None
        url = upstream.stdout.readline().rsplit(" ", 1)[-1].strip()
        print(f"model upstream at {url}; {args.calls} calls, {args.concurrency} at once")
        print("| client | CPU ms per call | calls/s |\n|---|---|---|")
        first = 0
        for _ in range(args.repeat):
            for name, run in CLIENTS.items():
                measured = partial(run, url, args.calls, args.concurrency, first)
                cpu, rate = anyio.run(measured, backend_options={"use_uvloop": True})
                first += args.calls + 1000
                print(f"| {name} | {cpu:.3f} | {rate:,.0f} |", flush=True)
    finally:
        upstream.terminate()
        upstream.wait()


if __name__ == "__main__":
    main()
