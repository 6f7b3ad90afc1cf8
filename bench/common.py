"""Shared helpers for the benchmarks: where the services are, a fresh ledger
database, fast seeding with ``generate_series``, process CPU/RSS readings,
a no-op worker process, medians and table printing.

Nothing here is imported by pacerd or its tests.

Environment:
    BENCH_ADMIN_DSN   PostgreSQL admin DSN   (postgresql://postgres@127.0.0.1:5432/postgres)
    BENCH_AMQP_URL    RabbitMQ URL of a vhost of the benchmarks' own
                      (amqp://guest:guest@127.0.0.1:5672/pacerd-bench), created with
                      rabbitmqctl on first use when it does not exist yet
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import aiormq
import asyncpg

from pacerd import ledger

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Sequence

ADMIN_DSN = os.environ.get("BENCH_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/pacerd-bench")
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
SIM_DIR = ROOT / "tests" / "sim"
# the tree whose pacerd a benchmark runs: another checkout's for an A/B, else this one
PACERD_ROOT = Path(os.environ.get("BENCH_PACERD_ROOT", str(ROOT)))
DESTINATION = "bench"
READY_QUEUE = f"pacerd.ready.{DESTINATION}"
# ~200 B ready message body (the reference size).
PAD = "x" * 40


def dsn_for(database: str, admin_dsn: str = ADMIN_DSN) -> str:
    """``admin_dsn`` with its database replaced by ``database``."""
    return urlunsplit(urlsplit(admin_dsn)._replace(path=f"/{database}"))


async def admin(sql: str) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def fresh_ledger(name: str) -> str:
    """Drops and recreates database ``name``, migrates it; returns its DSN."""
    await admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin(f'CREATE DATABASE "{name}"')
    dsn = dsn_for(name)
    await ledger.migrate(dsn)
    return dsn


async def drop_database(name: str) -> None:
    await admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def seed(
    dsn: str,
    n: int,
    *,
    destination: str = DESTINATION,
    prefix: str = "j",
    due_seconds_ago: float = 3600.0,
    chunk: int = 500_000,
) -> float:
    """Inserts ``n`` due backlog jobs straight into ``pacerd.jobs`` (no history
    rows: the fast path for large backlogs); returns seconds taken."""
    t0 = time.perf_counter()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO pacerd.destinations (destination) VALUES ($1) ON CONFLICT DO NOTHING",
            destination,
        )
        for start in range(1, n + 1, chunk):
            stop = min(n, start + chunk - 1)
            await conn.execute(
                "INSERT INTO pacerd.jobs (job_id, kind, destination, max_attempts,"
                " next_attempt_at, payload)"
                " SELECT $1 || '-' || g, 'bench', $2, 10,"
                "  now() - make_interval(secs => $3) + g * interval '1 microsecond',"
                "  jsonb_build_object('n', g, 'pad', $6::text)"
                " FROM generate_series($4::bigint, $5::bigint) g",
                prefix,
                destination,
                due_seconds_ago,
                start,
                stop,
                PAD,
            )
        await conn.execute("ANALYZE pacerd.jobs")
    finally:
        await conn.close()
    return time.perf_counter() - t0


async def wait_leader(
    conn: asyncpg.Connection, proc: subprocess.Popen[Any], destination: str = DESTINATION
) -> None:
    """Until an instance leads ``destination``'s partition (the leader lives in
    ``pacerd.partitions``), or the daemon exits, or a minute passes."""
    deadline = time.monotonic() + 60
    while not await conn.fetchval(
        "SELECT p.leader IS NOT NULL FROM pacerd.destinations d"
        " JOIN pacerd.partitions p ON p.partition = d.partition WHERE d.destination = $1",
        destination,
    ):
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("the daemon did not take the lead")
        await asyncio.sleep(0.1)


async def state_counts(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT state, count(*) AS n FROM pacerd.jobs GROUP BY state")
        return {r["state"]: r["n"] for r in rows}
    finally:
        await conn.close()


def rabbitmqctl(*args: str) -> bool:
    """Runs ``rabbitmqctl -q ARGS``; whether it ran and succeeded."""
    try:
        done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def ensure_vhost(url: str) -> bool:
    """Creates the URL's virtual host (guest may use it) with rabbitmqctl;
    False when that is not possible here (a vhost that exists already is kept)."""
    vhost = urlsplit(url).path.lstrip("/")
    if not vhost:
        return False
    rabbitmqctl("add_vhost", vhost)  # fails when it exists: the permissions decide
    return rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")


def delete_vhost(url: str) -> None:
    """Deletes the URL's virtual host with rabbitmqctl, if it can (a cleanup)."""
    vhost = urlsplit(url).path.lstrip("/")
    if vhost:
        rabbitmqctl("delete_vhost", vhost)


@contextlib.asynccontextmanager
async def amqp_channel(url: str = AMQP_URL) -> AsyncIterator[aiormq.abc.AbstractChannel]:
    try:
        connection = await aiormq.connect(url)
    except aiormq.exceptions.AMQPError:  # a vhost that does not exist yet (Connection.Close)
        if not ensure_vhost(url):
            raise
        connection = await aiormq.connect(url)
    try:
        yield await connection.channel()
    finally:
        await connection.close()


async def wait_consumers(
    count: int,
    procs: Sequence[subprocess.Popen[Any]],
    *,
    url: str = AMQP_URL,
    queue: str = READY_QUEUE,
) -> None:
    """Until ``queue`` has ``count`` consumers (the workers of ``procs``
    consume; a queue not declared yet has none), or one of them exits, or a
    minute passes."""
    deadline = time.monotonic() + 60
    while True:
        consumers = 0
        async with amqp_channel(url) as ch:
            with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
                declared = await ch.queue_declare(queue, passive=True)
                consumers = declared.consumer_count or 0
        if consumers >= count:
            return
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker process exited before consuming")
        if time.monotonic() > deadline:
            raise TimeoutError("the workers did not start consuming")
        await asyncio.sleep(0.1)


async def reset_queues(url: str = AMQP_URL) -> None:
    """Deletes the benchmark's queues and exchanges: every run starts empty."""
    async with amqp_channel(url) as ch:
        for queue in (READY_QUEUE, "pacerd.outcomes", "pacerd.outcomes.invalid", "bench.raw"):
            with contextlib.suppress(Exception):
                await ch.queue_delete(queue)
    async with amqp_channel(url) as ch:
        await ch.exchange_declare("pacerd.ready", exchange_type="direct", durable=True)
        await ch.exchange_declare("pacerd.outcomes", exchange_type="fanout", durable=True)
        args: dict[str, Any] = {"x-queue-type": "quorum"}
        await ch.queue_declare(READY_QUEUE, durable=True, arguments=args)
        await ch.queue_bind(READY_QUEUE, "pacerd.ready", routing_key=DESTINATION)
        await ch.queue_declare("pacerd.outcomes", durable=True, arguments=args)
        await ch.queue_bind("pacerd.outcomes", "pacerd.outcomes", routing_key="")
        await ch.queue_declare("pacerd.outcomes.invalid", durable=True, arguments=args)


# -- process readings ------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcSample:
    cpu_seconds: float
    rss_mb: float
    hwm_mb: float


def proc_sample(pid: int) -> ProcSample:
    """utime+stime (s), VmRSS and VmHWM (peak RSS, MB) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICKS
    rss = hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return ProcSample(cpu, rss, hwm)


ROLES = ("broker", "daemon", "worker", "postgres", "kernel", "other")


def _role(name: str, cmdline: str) -> str:
    if name.startswith("beam") or name in ("erl_child_setup", "epmd", "inet_gethost"):
        return "broker"
    if name == "postgres" or cmdline.startswith("postgres"):
        return "postgres"
    if "noop_worker.py" in cmdline or "-m pacerd worker" in cmdline or "worker.js" in cmdline:
        return "worker"
    if "-m pacerd run" in cmdline:
        return "daemon"
    return "other" if cmdline else "kernel"  # kernel threads have no command line


def cpu_by_process() -> dict[tuple[int, str], float]:
    """utime+stime (s) of every process of the machine, keyed by (pid, role):
    the broker, the pacerd daemon, the workers (the no-op one, ``pacerd
    worker``, the Node.js example), PostgreSQL, kernel
    threads (the block layer and writeback among them) and the rest."""
    out: dict[tuple[int, str], float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICKS
        out[(int(entry.name), _role(name, cmdline.strip()))] = cpu
    return out


def cpu_split(
    before: dict[tuple[int, str], float], after: dict[tuple[int, str], float]
) -> dict[str, float]:
    """CPU seconds per role between two ``cpu_by_process`` readings (a process
    started in between counts whole)."""
    split = dict.fromkeys(ROLES, 0.0)
    for key, cpu in after.items():
        split[key[1]] += cpu - before.get(key, 0.0)
    return split


def machine_description() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30

    def version(cmd: list[str]) -> str:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return "?"
        return out.strip().splitlines()[0] if out.strip() else "?"

    pg = version(["psql", ADMIN_DSN, "-Atc", "SHOW server_version"])
    rmq = version(["rabbitmqctl", "-q", "version"])
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem_gb:.0f} GiB, {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}; PostgreSQL {pg}; "
        f"RabbitMQ {rmq}; shared with other workloads"
    )


# -- no-op worker subprocess ---------------------------------------------------------


def start_worker(mode: str, *, prefetch: int = 1000, url: str = AMQP_URL) -> subprocess.Popen[str]:
    """Starts ``bench/noop_worker.py`` consuming the ready queue: ``ack`` only
    acknowledges (dispatch alone); ``report`` publishes an ``ok`` outcome with
    confirms, then acknowledges (full cycle). Returns once it consumes."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH_DIR / "noop_worker.py"), mode, url, READY_QUEUE, str(prefetch)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "consuming" not in line:
        proc.kill()
        raise RuntimeError(f"worker did not start: {line!r}")
    return proc


def stop_process(proc: subprocess.Popen[Any], *, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- statistics and tables -------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table (prints well in a terminal and pastes into RESULTS.md)."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            if value != value:  # NaN
                return "–"
            return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| "
        + " | ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        + " |"
        for r in body
    ]
    return "\n".join(lines)


def run(main: Any) -> Any:
    """Runs a coroutine function on uvloop (as the daemon does)."""
    import uvloop

    return uvloop.run(main())


def simulation_importable() -> None:
    """Makes the simulation of ``tests/sim`` importable (its modules import
    each other flatly, and the shared fakes as ``support``), its simulated
    admission logging only its warnings (it logs as the daemon does)."""
    import logging

    import structlog

    for folder in (str(SIM_DIR.parent), str(SIM_DIR)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
