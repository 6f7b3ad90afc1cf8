"""The simulation's pacing scenarios against the real thing, beside the
simulation and beside botocore's adaptive client rate limiter, in one run.

    apt-get install -y nginx-light                     # once: the limiter we did not write
    .venv/bin/python -m bench.real_scenarios           # ~9.5 minutes
    .venv/bin/python -m bench.real_scenarios --only drain,deepcut --no-peer
    .venv/bin/python -m bench.real_scenarios --only S5 --pacing slow_start_factor=2
    .venv/bin/python -m bench.real_scenarios --sim-seeds 10   # the simulation alone, ~1 minute
    .venv/bin/python -m bench.real_scenarios --sim-seeds 10 --sim-stalls 60   # with stalls
    .venv/bin/python -m bench.real_scenarios --only drain --no-peer --latency-ms 3000  # slow calls
    .venv/bin/python -m bench.real_scenarios --only drain --calls F   # then: bench.arrivals F

Each scenario runs three ways, one after the other:

* **pacerd**: the real daemon (``python -m pacerd run``, tick 1 s, the
  default law, or with the ``[pacing]`` keys given by ``--pacing``, which
  the simulation takes too) over a fresh ledger in PostgreSQL, two real worker processes
  (``python -m pacerd worker --app bench.real_scenarios:app``: the worker
  library, prefetch 200, one HTTP call per job, 429 → ``Refused`` with its
  Retry-After) and RabbitMQ, calling an upstream over HTTP;
* **sim**: the same scenario (capacity steps, bucket, penalty, starting rate,
  backlog, seed) in the deterministic simulation of ``tests/sim``, started
  as the real run starts (ticks on the paused destination, then the
  resume's notice at a phase of the ticks drawn from the seed), with the
  real path's report delay and 429s answered at once;
* **botocore**: ``botocore.retries.adaptive.ClientRateLimiter`` (CUBIC, as
  botocore's ``retry_mode = "adaptive"`` builds it) gating 16 threads that
  call the same upstream with the same backlog (a refused job goes back in
  line), started at pacerd's starting rate so both begin from the same place.

Upstreams: the model upstream (``pacerd.testing.upstream``, a token bucket
with a burst of 0.1 s of capacity, lognormal latency of median 20 ms: 10 to
40 ms per call) in its own process, and nginx's ``limit_req`` (a leaky
bucket: ``rate=120r/s burst=10 nodelay``, ``limit_req_status 429``, no
Retry-After; behind it the model upstream with unbounded capacity supplies
the latency), run as a process of this script on a loopback port with its own
configuration in a temporary directory. A capacity step is a ``POST
/capacity`` to the model, a reload with a new ``rate`` for nginx.

Scenarios (times from the resume; the backlog never runs dry unless said):

* ``S1``: 100 → 30 → 80 /s at 0, 20 and 40 s, 60 s, starting at 10/s;
* ``S3``: 80/s, Retry-After on every 429, a refusal burst (over 10 % of the
  capacity within a second) closes the upstream for 10 s, 30 s, from 10/s;
* ``S5``: 100/s from 1/s, 30 s;
* ``drain``: an overdue backlog of 20 s of capacity (2,000 jobs at 100/s;
  2,400 at nginx's 120/s), from 40 % of capacity, until the last job;
* ``deepcut``: 100/s (nginx 120/s), 70 % less from 15 s to 35 s, 50 s, from
  40 % of capacity.

Metrics, from the upstream's own log of calls (the model's ``GET /calls``,
nginx's access log) — the simulation's definitions (``tests/sim/scenarios.py``):
utilization = accepted calls / the integral of capacity (for ``drain`` up to
the last accepted call); refused % of all calls, overall and after the first
3 s; ``t90``: first second by which the last 5 s accepted 90 % of capacity;
``peak``: the highest 1 s call rate before the first capacity change / the
capacity (slow start's overshoot); ``rec85``: from the first refusal, how long
until every later second of the first phase accepts >= 85 % of capacity;
``rise90``: from the capacity's return to the first second accepting >= 90 %
of it; ``drop ref%``: refused % while the capacity is cut; ``in RA``: releases
inside an advertised Retry-After window (pacerd: claims in the ledger between
a refusal with Retry-After reaching it and the window's end; botocore: calls
sent between receiving such a 429 and its end); ``pen``: calls refused while
the penalty box was closed; ``lag_ms``: the median time from a call reaching
the upstream to its outcome in the ledger (the k-th outcome against the k-th
call; pacerd and the simulation). The load of the machine (``uptime``) is printed
with the results: on shared cores, compare pacerd with botocore within a run.

Environment: ``BENCH_ADMIN_DSN`` (see ``bench/common.py``); the RabbitMQ
vhost ``pacerd-bench-real`` and the database ``pacerd_bench_real`` are
created for the run and deleted after it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from bench import common
from pacerd.config import ConfigError, load_config
from pacerd.testing.upstream import PENALTY_THRESHOLD
from pacerd_demo.app import build_app, upstreams_from_env

if TYPE_CHECKING:
    from pacerd.pacer import PacingParams

# The worker program of the pacerd runs (prefetch 200, like the workers).
# Its calls time out well past the tail of the upstream's latency (lognormal,
# LATENCY_SIGMA): at the demo's 10 s, calls of 3 s timed out about once a run,
# and a drain, judged to its last job, then ended on a retry 10 s later.
PREFETCH = 200
ENV_LATENCY_MS = "BENCH_LATENCY_MS"  # the plan's median call, for the workers
CALL_TIMEOUT_MEDIANS = 6.0  # the call timeout, in median calls (10 s at least)
app = build_app(
    upstreams_from_env(),
    prefetch=PREFETCH,
    call_timeout_seconds=max(
        10.0, CALL_TIMEOUT_MEDIANS * float(os.environ.get(ENV_LATENCY_MS, "0")) / 1000.0
    ),
)

DB = "pacerd_bench_real"
VHOST = "pacerd-bench-real"
AMQP_URL = urlunsplit(urlsplit(common.AMQP_URL)._replace(path=f"/{VHOST}"))
LATENCY_MS, LATENCY_SIGMA = 20.0, 0.35  # 10 to 40 ms per call
# From a call's answer to its outcome in the ledger through the worker library,
# the broker and the outcome consumer: ~3 ms on a quiet machine (the runs'
# ``lag_ms`` is this plus the latency); the simulation's default is 100 ms
REPORT_DELAY_MS = 3.0
PAUSED_TICKS = 2  # the simulated daemon's ticks on the paused destination before the resume
SETTLE_SECONDS = 1.5  # the real daemon's time leading the paused destination before it
WORKERS = 2
PEER_THREADS = 16
SIM_STALL_SECONDS = 0.15  # each stall of the simulation's delivery path (``--sim-stalls``)
NGINX_RATE, NGINX_BURST = 120.0, 10


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    name: str
    upstream: str  # "model" or "nginx"
    phases: tuple[tuple[float, float], ...]  # (second after the resume, capacity /s)
    duration: float  # seconds (drain: the most it may take)
    initial_rate: float
    backlog: int | None = None  # None: never runs dry
    penalty_seconds: float = 0.0  # model upstream: Retry-After and a penalty box
    pacing: tuple[tuple[str, str], ...] = ()  # ``--pacing`` KEY=VALUE, both pacerd and sim
    latency_ms: float = LATENCY_MS  # the median call (``--latency-ms``), both pacerd and sim
    sim_stall_every: float | None = None  # the simulation's stalls (``--sim-stalls``)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.upstream}"

    def capacity_at(self, t: float) -> float:
        return [c for s, c in self.phases if s <= t][-1] if t >= 0 else self.phases[0][1]

    def capacity_between(self, t0: float, t1: float) -> float:
        total, bounds = 0.0, [s for s, _ in self.phases[1:]] + [math.inf]
        for (s, c), e in zip(self.phases, bounds, strict=True):
            lo, hi = max(t0, s), min(t1, e)
            total += c * max(0.0, hi - lo)
        return total

    def jobs(self) -> int:
        if self.backlog is not None:
            return self.backlog
        return int(max(c for _, c in self.phases) * self.duration * 1.3) + 500


def plans(nginx: bool) -> list[Plan]:
    out = [
        Plan(name="S1", upstream="model", phases=((0, 100), (20, 30), (40, 80)), duration=60,
             initial_rate=10),
        Plan(name="S3", upstream="model", phases=((0, 80),), duration=30, initial_rate=10,
             penalty_seconds=10),
        Plan(name="S5", upstream="model", phases=((0, 100),), duration=30, initial_rate=1),
        Plan(name="drain", upstream="model", phases=((0, 100),), duration=90, initial_rate=40,
             backlog=2000),
        Plan(name="deepcut", upstream="model", phases=((0, 100), (15, 30), (35, 100)),
             duration=50, initial_rate=40),
    ]  # fmt: skip
    if nginx:
        r = NGINX_RATE
        out += [
            Plan(name="drain", upstream="nginx", phases=((0, r),), duration=90,
                 initial_rate=0.4 * r, backlog=int(20 * r)),
            Plan(name="deepcut", upstream="nginx", phases=((0, r), (15, 0.3 * r), (35, r)),
                 duration=50, initial_rate=0.4 * r),
        ]  # fmt: skip
    return out


# -- what a run leaves: the upstream's calls, and a few times --------------------------


@dataclass(slots=True)
class Trace:
    t: list[float] = field(default_factory=list)  # arrival at the upstream, s after the start
    ok: list[bool] = field(default_factory=list)
    penalty: int = 0  # calls refused while the penalty box was closed
    end: float = 0.0  # when the run ended (drain: the last accepted call)
    in_ra: float = math.nan  # releases inside an advertised Retry-After window
    # pacerd's persisted pacer state every 0.25 s: (s after the start, rate, ceiling, epoch)
    pacer: list[tuple[float, float, float | None, int]] = field(default_factory=list)
    # ... and every field of it, as persisted, at the same times (what a cut was made of)
    pacer_states: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    # when the ledger applied each outcome, s after the start (pacerd and the simulation)
    outcome_t: list[float] = field(default_factory=list)


def per_second(tr: Trace) -> list[tuple[int, int]]:
    """(accepted, refused) calls in each second of the run."""
    n = max(1, math.ceil(max(tr.t, default=0.0)) + 1)
    out = [[0, 0] for _ in range(n)]
    for t, ok in zip(tr.t, tr.ok, strict=True):
        if t >= 0:
            out[int(t)][0 if ok else 1] += 1
    return [(a, r) for a, r in out]


def metrics(plan: Plan, tr: Trace) -> dict[str, float]:
    """The module docstring's metrics of one trace."""
    calls = sorted(zip(tr.t, tr.ok, strict=True))
    end = tr.end
    if plan.backlog is not None:
        end = max((t for t, ok in calls if ok), default=end)

    def count(a: float, b: float) -> tuple[int, int]:
        ok = sum(1 for t, k in calls if a <= t < b and k)
        n = sum(1 for t, _ in calls if a <= t < b)
        return ok, n - ok

    ok_all, ref_all = count(0.0, end)
    ok_st, ref_st = count(3.0, end)
    out = {
        "util": ok_all / max(1e-9, plan.capacity_between(0.0, end)),
        "ref_pct": 100.0 * ref_all / max(1, ok_all + ref_all),
        "steady_ref_pct": 100.0 * ref_st / max(1, ok_st + ref_st),
    }
    c0 = plan.phases[0][1]
    first_end = min(end, plan.phases[1][0] if len(plan.phases) > 1 else end)
    seconds = math.floor(first_end)
    ok_per_s = [0] * (int(end) + 2)
    all_per_s = [0] * (int(end) + 2)
    for t, k in calls:
        if 0 <= t < len(ok_per_s):
            ok_per_s[int(t)] += k
            all_per_s[int(t)] += 1
    t90 = math.inf
    for s in range(5, seconds + 1):
        if sum(ok_per_s[s - 5 : s]) >= 0.9 * c0 * 5:
            t90 = float(s)
            break
    out["t90_s"] = t90
    out["peak"] = max(all_per_s[:seconds] or [0]) / c0
    first_ref = next((t for t, k in calls if not k), math.inf)
    rec = math.inf
    if first_ref < first_end - 1:
        last_bad = max(
            (s for s in range(int(first_ref), seconds) if ok_per_s[s] < 0.85 * c0),
            default=int(first_ref) - 1,
        )
        rec = max(0.0, last_bad + 1 - first_ref) if last_bad + 1 < seconds else math.inf
    out["rec85_s"] = rec if first_ref < math.inf else 0.0
    if plan.name in ("deepcut", "S1") and len(plan.phases) > 1:
        t_drop, t_rise = plan.phases[1][0], plan.phases[-1][0]
        ok_d, ref_d = count(t_drop, t_rise)
        out["drop_ref_pct"] = 100.0 * ref_d / max(1, ok_d + ref_d)
        c_rise = plan.phases[-1][1]
        rise = next(
            (s - t_rise for s in range(int(t_rise), int(end)) if ok_per_s[s] >= 0.9 * c_rise),
            math.inf,
        )
        out["rise90_s"] = float(rise) + 1.0  # the end of the first good second
    out["in_ra"] = tr.in_ra
    out["pen"] = float(tr.penalty) if plan.penalty_seconds else math.nan
    out["lag_ms"] = outcome_lag(tr)
    return out


def outcome_lag(tr: Trace) -> float:
    """The median time from a call's arrival at the upstream to its outcome
    in the ledger, in ms: the k-th outcome applied against the k-th call (the
    horizontal gap between the two cumulative counts; no job is followed).
    NaN when the trace has no outcome times (botocore)."""
    if not tr.outcome_t:
        return math.nan
    gaps = sorted(o - c for c, o in zip(sorted(tr.t), sorted(tr.outcome_t), strict=False))
    return 1000.0 * gaps[len(gaps) // 2]


# -- upstreams ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_json(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> Any:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), payload)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


class ModelProcess:
    """``python -m pacerd.testing.upstream`` in its own process."""

    def __init__(
        self, capacity: float, *, penalty_seconds: float = 0.0, latency_ms: float = LATENCY_MS
    ) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "pacerd.testing.upstream", "--port", str(self.port),
                "--capacity-schedule", f"0:{capacity}", "--burst-seconds", "0.1",
                "--latency-median-ms", str(latency_ms), "--latency-sigma", str(LATENCY_SIGMA),
                "--seed", "1"]  # fmt: skip
        if penalty_seconds:
            args += ["--retry-after", "--penalty-seconds", str(penalty_seconds)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=common.ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening" not in line:
            self.proc.kill()
            raise RuntimeError(f"the model upstream did not start: {line!r}")
        self.url = f"http://127.0.0.1:{self.port}"

    def set_capacity(self, rate: float) -> None:
        http_json(f"{self.url}/capacity", "POST", {"rate": rate})

    def calls(self) -> list[tuple[float, int, int | None, bool]]:
        return [tuple(c) for c in http_json(f"{self.url}/calls")["calls"]]  # type: ignore[misc]

    def close(self) -> None:
        common.stop_process(self.proc)


NGINX_CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp-body;
    proxy_temp_path {dir}/tmp-proxy;
    fastcgi_temp_path {dir}/tmp-fastcgi;
    uwsgi_temp_path {dir}/tmp-uwsgi;
    scgi_temp_path {dir}/tmp-scgi;
    log_format calls '$msec $request_time $status';
    limit_req_zone $server_name zone=bench:1m rate={rate}r/s;
    server {{
        listen 127.0.0.1:{port};
        server_name bench;
        location /v1/call {{
            limit_req zone=bench burst={burst} nodelay;
            limit_req_status 429;
            access_log {dir}/calls.log calls;
            proxy_pass http://127.0.0.1:{backend};
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


class NginxProcess:
    """nginx with ``limit_req`` (leaky bucket, 429 when over) in front of an
    unlimited model upstream that supplies the latency."""

    def __init__(self, rate: float, *, latency_ms: float = LATENCY_MS) -> None:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed: apt-get install -y nginx-light")
        self.binary = binary
        self.backend = ModelProcess(1_000_000.0, latency_ms=latency_ms)
        self.dir = Path(tempfile.mkdtemp(prefix="pacerd-bench-nginx-"))
        self.port = free_port()
        self.conf = self.dir / "nginx.conf"
        self._write(rate)
        self.proc = subprocess.Popen(
            [binary, "-p", str(self.dir), "-c", str(self.conf), "-g", "daemon off;"],
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: see {self.dir}/error.log")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def _write(self, rate: float) -> None:
        self.conf.write_text(
            NGINX_CONF.format(
                dir=self.dir, rate=round(rate), burst=NGINX_BURST, port=self.port,
                backend=self.backend.port,
            )
        )  # fmt: skip

    def set_capacity(self, rate: float) -> None:
        self._write(rate)
        subprocess.run(
            [self.binary, "-p", str(self.dir), "-c", str(self.conf), "-s", "reload"],
            check=True, capture_output=True,
        )  # fmt: skip

    def calls(self) -> list[tuple[float, int, int | None, bool]]:
        out: list[tuple[float, int, int | None, bool]] = []
        with contextlib.suppress(FileNotFoundError):
            for line in (self.dir / "calls.log").read_text().splitlines():
                msec, took, status = line.split()
                out.append((float(msec) - float(took), int(status), None, False))
        return out

    def close(self) -> None:
        common.stop_process(self.proc)
        self.backend.close()
        shutil.rmtree(self.dir, ignore_errors=True)


Upstream = ModelProcess | NginxProcess


def start_upstream(plan: Plan) -> Upstream:
    if plan.upstream == "nginx":
        return NginxProcess(plan.phases[0][1], latency_ms=plan.latency_ms)
    return ModelProcess(
        plan.phases[0][1], penalty_seconds=plan.penalty_seconds, latency_ms=plan.latency_ms
    )


def trace_from(up: Upstream, t0: float, end: float) -> Trace:
    tr = Trace(end=end)
    for at, status, _ra, penalty in up.calls():
        if status not in (200, 429) or at < t0 - 0.5:
            continue
        tr.t.append(at - t0)
        tr.ok.append(status == 200)
        tr.penalty += penalty
    return tr


async def drive_capacity(plan: Plan, up: Upstream, t0: float, done: asyncio.Event) -> float:
    """Steps the upstream's capacity on schedule until the plan's end or ``done``;
    returns the end (seconds after ``t0``)."""
    for start, rate in plan.phases[1:]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), max(0.0, t0 + start - time.time()))
        if done.is_set():
            return time.time() - t0
        await asyncio.to_thread(up.set_capacity, rate)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), max(0.0, t0 + plan.duration - time.time()))
    return min(plan.duration, time.time() - t0)


# -- pacerd -------------------------------------------------------------------------


def pacerd_env(dsn: str, plan: Plan, upstream_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PACERD_", "OTEL_"))}
    return (
        env
        | {
            "PACERD_DATABASE__DSN": dsn,
            "PACERD_BROKER__URL": AMQP_URL,
            "PACERD_PACING__TICK_SECONDS": "1.0",
            "PACERD_PACING__INITIAL_RATE": str(plan.initial_rate),
            "PACERD_DAEMON__INSTANCE_NAME": "bench-real",
            "PACERD_DAEMON__SHUTDOWN_GRACE_SECONDS": "2",
            "PACERD_TELEMETRY__LOG_LEVEL": "warning",
            "PACERD_TELEMETRY__LOG_FORMAT": "json",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "DEMO_UPSTREAMS": json.dumps({common.DESTINATION: upstream_url}),
            ENV_LATENCY_MS: str(plan.latency_ms),
        }
        | {f"PACERD_PACING__{key.upper()}": value for key, value in plan.pacing}
    )


def spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pacerd", *args], env=env, cwd=common.ROOT,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def run_pacerd(dsn: str, plan: Plan) -> Trace:
    conn = await asyncpg.connect(dsn)
    up = await asyncio.to_thread(start_upstream, plan)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await conn.execute("TRUNCATE pacerd.jobs, pacerd.job_events")
        await conn.execute("DELETE FROM pacerd.destinations")
        await common.reset_queues(AMQP_URL)
        await common.seed(dsn, plan.jobs())
        await conn.execute("SELECT pacerd.pause($1)", common.DESTINATION)
        env = pacerd_env(dsn, plan, up.url)
        for _ in range(WORKERS):
            procs.append(spawn(["worker", "--app", "bench.real_scenarios:app"], env))
        daemon = spawn(["run"], env)
        procs.append(daemon)
        await common.wait_leader(conn, daemon)
        await common.wait_consumers(WORKERS, procs, url=AMQP_URL)
        # the daemon ticks on the paused destination a while, as the
        # simulation starts: the resume reopens a destination it already
        # paces, not its first tick as a leader (no slow-start ramp there)
        await asyncio.sleep(SETTLE_SECONDS)
        t0 = time.time()
        await conn.execute("SELECT pacerd.resume($1)", common.DESTINATION)
        done = asyncio.Event()
        driver = asyncio.create_task(drive_capacity(plan, up, t0, done))
        states: list[tuple[float, dict[str, Any]]] = []
        while not driver.done():
            raw = await conn.fetchval(
                "SELECT pacer_state FROM pacerd.destinations WHERE destination = $1",
                common.DESTINATION,
            )
            st = (json.loads(raw) if isinstance(raw, str) else raw or {}).get("pacer")
            if st:
                states.append((round(time.time() - t0, 2), st))
            if plan.backlog is not None and not await conn.fetchval(
                "SELECT count(*) FROM pacerd.jobs WHERE state <> 'completed'"
            ):
                done.set()
            if daemon.poll() is not None:
                raise RuntimeError(f"the daemon exited with {daemon.returncode}")
            await asyncio.sleep(0.25)
        end = await driver
        tr = await asyncio.to_thread(trace_from, up, t0, end)
        tr.pacer_states = states
        tr.pacer = [
            (t, round(st["rate"], 1), _rounded(st.get("ceiling")), st.get("epoch", 0))
            for t, st in states
        ]
        tr.in_ra = float(await releases_in_retry_after(conn))
        tr.outcome_t = await outcomes_applied(conn, t0)
        return tr
    finally:
        await asyncio.gather(*(asyncio.to_thread(common.stop_process, p) for p in procs))
        await asyncio.to_thread(up.close)
        await conn.close()


async def outcomes_applied(conn: asyncpg.Connection, t0: float) -> list[float]:
    """When the ledger applied each outcome (its event's commit), s after ``t0``."""
    rows = await conn.fetch(
        "SELECT extract(epoch FROM at)::float8 AS at FROM pacerd.job_events"
        " WHERE event IN ('completed', 'refused', 'retry', 'dead', 'stale_report')"
        " ORDER BY at"
    )
    return [r["at"] - t0 for r in rows]


async def releases_in_retry_after(conn: asyncpg.Connection) -> int:
    """Claims made while a Retry-After reported to the ledger had not run out."""
    n: int = await conn.fetchval(
        "WITH w AS (SELECT at AS a, at + make_interval(secs => (detail->>'retry_after_s')::float8)"
        "  AS b FROM pacerd.job_events WHERE event = 'refused' AND detail ? 'retry_after_s')"
        " SELECT count(*) FROM pacerd.job_events e WHERE e.event = 'claimed'"
        "  AND EXISTS (SELECT 1 FROM w WHERE e.at > w.a AND e.at < w.b)"
    )
    return n


# -- botocore's adaptive client rate limiter ------------------------------------------


class _Is429:
    """The throttling detector: botocore's own maps AWS error codes; here a 429 is one."""

    def is_throttling_error(self, **kwargs: Any) -> bool:
        return bool(kwargs.get("status") == 429)


def run_botocore(plan: Plan) -> Trace:
    """16 threads, one HTTP call per job, gated by botocore's adaptive limiter."""
    from botocore.retries import adaptive, bucket, throttling

    up = start_upstream(plan)
    try:
        clock = bucket.Clock()
        limiter = adaptive.ClientRateLimiter(
            rate_adjustor=throttling.CubicCalculator(
                starting_max_rate=plan.initial_rate, start_time=clock.current_time()
            ),
            rate_clocker=adaptive.RateClocker(clock),
            token_bucket=bucket.TokenBucket(max_rate=plan.initial_rate, clock=clock),
            throttling_detector=_Is429(),
            clock=clock,
        )
        limiter._enabled = True  # start at the same rate as pacerd, not unlimited
        jobs: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(plan.jobs()):
            jobs.put(i)
        remaining = [plan.jobs()]
        lock = threading.Lock()
        windows: list[tuple[float, float]] = []
        sends: list[float] = []
        stop = threading.Event()
        host, port = "127.0.0.1", urlsplit(up.url).port
        t0 = time.time()

        def worker() -> None:
            while not stop.is_set():
                try:
                    job = jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                limiter.on_sending_request(request=None)
                if stop.is_set():
                    return
                sent = time.time()
                status, retry_after = 599, None
                conn = http.client.HTTPConnection(host, port, timeout=10)
                try:
                    conn.request("POST", "/v1/call", b"{}", {"Idempotency-Key": f"b-{job}"})
                    resp = conn.getresponse()
                    status, retry_after = resp.status, resp.getheader("Retry-After")
                    resp.read()
                except OSError:
                    pass
                finally:
                    conn.close()
                limiter.on_receiving_response(status=status)
                with lock:
                    sends.append(sent)
                    if status == 200:
                        remaining[0] -= 1
                        if remaining[0] == 0:
                            stop.set()
                    else:
                        jobs.put(job)
                        if retry_after is not None:
                            now = time.time()
                            windows.append((now, now + float(retry_after)))

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(PEER_THREADS)]
        for th in threads:
            th.start()
        for start, rate in plan.phases[1:]:
            if stop.wait(max(0.0, t0 + start - time.time())):
                break
            up.set_capacity(rate)
        stop.wait(max(0.0, t0 + plan.duration - time.time()))
        stop.set()
        end = min(plan.duration, time.time() - t0)
        for th in threads:
            th.join(15)
        tr = trace_from(up, t0, end)
        tr.in_ra = float(sum(1 for s in sends if any(a < s < b for a, b in windows)))
        return tr
    finally:
        up.close()


# -- the simulation of the same scenario ----------------------------------------------


def pacing_params(plan: Plan) -> PacingParams:
    """The law's parameters the daemon of ``plan`` runs with: its environment
    through pacerd's own loader (``--pacing`` validated as pacerd validates
    it; raises ``ConfigError``)."""
    env = pacerd_env("postgresql://localhost/unused", plan, "http://127.0.0.1:1")
    return load_config(None, env).pacing_for(common.DESTINATION)


def run_sim(plan: Plan, seed: int) -> Trace:
    common.simulation_importable()
    import simdriver
    import simlib

    burst = (NGINX_BURST + 1) / plan.phases[0][1] if plan.upstream == "nginx" else 0.1
    penalty = plan.penalty_seconds or None
    # As the real run starts: the daemon ticks on a paused destination, which
    # the resume's notice reopens at a phase of its ticks that no run
    # chooses (drawn from the seed); times are then counted from the resume.
    resume = PAUSED_TICKS + random.Random(f"resume/{seed}").random()
    sc = simlib.Scenario(
        name=plan.key,
        duration=resume + plan.duration,
        phases=tuple((resume * (s > 0) + s, float(c)) for s, c in plan.phases),
        burst_seconds=burst,
        # as the model upstream of ``ModelProcess`` does: a Retry-After on
        # every 429, and its box closed by a burst of refusals, not the first
        penalty_seconds=penalty,
        retry_after=penalty is not None,
        penalty_threshold=PENALTY_THRESHOLD if penalty else None,
        params=pacing_params(plan),
        ledgers=(simlib.LedgerSpec(backlog=plan.backlog, paused_until=resume),),
        workers=WORKERS * PREFETCH,  # the calls the real workers make at once
        latency_median=plan.latency_ms / 1000,
        latency_sigma=LATENCY_SIGMA,
        report_delay_median=REPORT_DELAY_MS / 1000,
        refusal_latency=False,  # the model upstream and nginx answer a 429 at once
        stall_every_s=plan.sim_stall_every,
        stall_seconds=SIM_STALL_SECONDS,
    )
    res = simdriver.run(sc, "pacerd", seed)
    tr = Trace(t=[t - resume for t in res.call_t], ok=list(res.call_ok), end=plan.duration)
    tr.outcome_t = [t - resume for t in res.report_t]
    windows = sorted(res.ra_windows)  # the count needs no shift
    tr.in_ra = float(sum(1 for t in res.dispatch_t if any(a < t < b for a, b in windows)))
    if plan.penalty_seconds:
        tr.penalty = sum(1 for t, ok in zip(tr.t, tr.ok, strict=True) if not ok) - sum(
            1 for a, _ in windows
        )
    return tr


# -- the run --------------------------------------------------------------------------

COLUMNS = ("util", "ref_pct", "steady_ref_pct", "t90_s", "peak", "rec85_s", "rise90_s",
           "drop_ref_pct", "in_ra", "pen", "lag_ms")  # fmt: skip


def uptime() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def selected(known: list[Plan], only: str) -> list[Plan]:
    """The plans ``--only`` names (comma-separated; empty: all); a name that is
    no scenario stops the run."""
    wanted = [name for name in only.split(",") if name]
    unknown = sorted(set(wanted) - {p.name for p in known})
    if unknown:
        names = ", ".join(dict.fromkeys(p.name for p in known))
        raise SystemExit(f"--only: no scenario {', '.join(unknown)} (there are: {names})")
    return [p for p in known if not wanted or p.name in wanted]


async def measure(args: argparse.Namespace) -> str:
    nginx = not args.no_nginx
    if nginx and not args.sim_seeds and nginx_binary() is None:
        raise SystemExit(
            "nginx is not installed: apt-get install -y nginx-light (or run with --no-nginx)"
        )
    chosen = [
        replace(p, pacing=args.pacing, latency_ms=args.latency_ms, sim_stall_every=args.sim_stalls)
        for p in selected(plans(nginx), args.only)
    ]
    for plan in chosen:  # a bad --pacing stops the run before anything starts
        try:
            pacing_params(plan)
        except ConfigError as exc:
            raise SystemExit(f"--pacing: {exc}") from None
    if args.sim_seeds:
        return await asyncio.to_thread(simulate_seeds, chosen, args.sim_seeds)
    if not common.ensure_vhost(AMQP_URL):
        raise SystemExit(f"cannot create the RabbitMQ vhost {VHOST} (rabbitmqctl)")
    dsn = await common.fresh_ledger(DB)
    rows: list[list[object]] = []
    results: dict[str, dict[str, Any]] = {}
    calls: dict[str, dict[str, list[list[float]]]] = {}
    try:
        for plan in chosen:
            load = uptime()
            print(f"{plan.key}: pacerd (load {load})", file=sys.stderr, flush=True)
            began = time.monotonic()
            traces = {"pacerd": await run_pacerd(dsn, plan)}
            traces["sim"] = await asyncio.to_thread(run_sim, plan, args.seed)
            took = f"pacerd and sim {time.monotonic() - began:.0f} s"
            if not args.no_peer:
                print(f"{plan.key}: botocore", file=sys.stderr, flush=True)
                began = time.monotonic()
                traces["botocore"] = await asyncio.to_thread(run_botocore, plan)
                took += f", botocore {time.monotonic() - began:.0f} s"
            print(f"{plan.key}: {took}", file=sys.stderr, flush=True)
            got = {who: metrics(plan, tr) for who, tr in traces.items()}
            results[plan.key] = {"load": load, "metrics": got}
            results[plan.key]["per_second"] = {who: per_second(tr) for who, tr in traces.items()}
            results[plan.key]["pacer"] = traces["pacerd"].pacer
            results[plan.key]["pacer_states"] = traces["pacerd"].pacer_states
            calls[plan.key] = {who: arrivals(tr) for who, tr in traces.items()}
            for who, m in got.items():
                rows.append([plan.key, who, *(m.get(c, math.nan) for c in COLUMNS), load])
    finally:
        await common.drop_database(DB)
        await asyncio.to_thread(common.delete_vhost, AMQP_URL)
    if args.json:
        text = json.dumps(results, indent=1, default=str)
        await asyncio.to_thread(Path(args.json).write_text, text)
    if args.calls:
        await asyncio.to_thread(Path(args.calls).write_text, json.dumps(calls))
    return common.table(["scenario", "run", *COLUMNS, "load (1/5/15 min)"], rows)


def arrivals(tr: Trace) -> list[list[float]]:
    """Every call of a trace as [arrival, accepted (1) or refused (0)], in
    arrival order: seconds after the resume, to 0.1 ms."""
    return [[round(t, 4), float(ok)] for t, ok in sorted(zip(tr.t, tr.ok, strict=True))]


def simulate_seeds(chosen: list[Plan], seeds: int) -> str:
    """The simulation alone, seeds 0 to ``seeds - 1`` of every plan: each
    seed's figures, then the worst and the mean of each column."""
    rows: list[list[object]] = []
    for plan in chosen:
        got = [metrics(plan, run_sim(plan, seed)) for seed in range(seeds)]
        for seed, m in enumerate(got):
            rows.append([plan.key, seed, *(m.get(c, math.nan) for c in COLUMNS)])
        for label in ("worst", "mean"):
            summary: list[object] = []
            for c in COLUMNS:
                values = [m.get(c, math.nan) for m in got]
                if label == "mean":
                    summary.append(sum(values) / len(values))
                else:  # the lowest utilization, the highest of everything else
                    summary.append(min(values) if c == "util" else max(values))
            rows.append([plan.key, label, *summary])
    return common.table(["scenario", "seed", *COLUMNS], rows)


def pacing_override(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--pacing`` (the key and value are checked by pacerd's loader)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="scenario names, comma-separated")
    parser.add_argument("--no-nginx", action="store_true", help="the model upstream only")
    parser.add_argument("--no-peer", action="store_true", help="skip botocore")
    parser.add_argument("--seed", type=int, default=0, help="the simulation's seed")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument(
        "--calls", default=None, metavar="FILE",
        help="write every call of every run (arrival, accepted) to this file, as JSON",
    )  # fmt: skip
    parser.add_argument(
        "--sim-seeds", type=int, default=0, metavar="N",
        help="the simulation alone, seeds 0 to N-1 (no services needed)",
    )  # fmt: skip
    parser.add_argument(
        "--pacing", type=pacing_override, action="append", default=[], metavar="KEY=VALUE",
        help="a [pacing] key for pacerd and the simulation alike, e.g. slow_start_factor=2",
    )  # fmt: skip
    parser.add_argument(
        "--sim-stalls", type=float, default=None, metavar="S",
        help=f"the simulation's delivery path stalls {SIM_STALL_SECONDS:g} s every S s on average",
    )  # fmt: skip
    parser.add_argument(
        "--latency-ms", type=float, default=LATENCY_MS, metavar="MS",
        help=f"the upstream's median call, for pacerd and the simulation (default {LATENCY_MS:g})",
    )  # fmt: skip
    args = parser.parse_args()
    if args.latency_ms <= 0:
        parser.error("--latency-ms must be > 0")
    if args.sim_stalls is not None and args.sim_stalls <= 0:
        parser.error("--sim-stalls must be > 0")
    args.pacing = tuple(args.pacing)
    started = time.time()
    text = asyncio.run(measure(args))
    print(text)
    print(f"\n{time.time() - started:.0f} s; {common.machine_description()}")


if __name__ == "__main__":
    main()
