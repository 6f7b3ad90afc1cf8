"""Thousands of destinations: the real daemon with N known destinations in one
group, against the targets of the issue "Thousands of destinations".

    .venv/bin/python -m bench.fanout --quick                  # 200 known / 20 active, < 2 min
    .venv/bin/python -m bench.fanout                          # 10,000 known / 1,000 active
    .venv/bin/python -m bench.fanout --destinations 1000 --active 200 --only drain,idle
    .venv/bin/python -m bench.fanout --quick --json /tmp/fanout.json
    BENCH_PACERD_ROOT=/other/checkout .venv/bin/python -m bench.fanout --only statements  # A/B
    .venv/bin/python -m bench.fanout --only statements --level-jobs 2000  # the same work a level

Every destination is ``tenant-NNNNN``, in one group ``[groups.tenants] match =
"tenant-*"`` (one shared ready queue, ``pacerd.ready.tenants``), paced at
``initial_rate = max_rate`` = ``--rate`` (default 2/s, held constant so that
the ideal time below is exact), ``tick_seconds = --tick`` (default 1 s).

**Known destinations.** A destination is known once ``pacerd.schedule`` has
seen it (it creates the ``pacerd.destinations`` row on first sight). N of them
are made with two statements of the public SQL API: one ``pacerd.schedule``
per destination, due tomorrow, over ``generate_series``, then
``pacerd.cancel`` of each of those jobs. The row stays, with nothing due,
nothing in flight and no history to drain: a known, idle destination, made in
seconds without waiting for a broker round trip.

Sections (``--only``), each on a database of its own (created, migrated with
``pacerd migrate -c``, dropped) and one RabbitMQ vhost of the run's own
(created and deleted with ``rabbitmqctl``):

* ``drain``: A of the N destinations (spread evenly over the names) get K
  overdue jobs each (``--jobs-per``, default 5). Everything is paused
  (``pacerd.pause()``) while the daemon and ``--workers`` processes of
  ``pacerd worker --app bench.fanout_app:app`` (a no-op handler consuming the
  group's queue) start; once the A destinations have a leader and one more
  tick has passed (a new leader's first claim waits one tick), ``pacerd.resume()``
  is the start. The drain time is the last ``completed`` event in
  ``pacerd.job_events`` minus the resume (database clock). **Ideal time**
  = K / rate: at a constant rate of r jobs/s per destination, K jobs are
  released in K / r seconds (5 jobs at 2/s: 2.5 s). Target: every job
  completed within ideal + 3 ticks (5.5 s by default).
* ``idle``: N known, nothing due, one daemon, no worker. After it leads every
  destination and ``--warmup`` seconds more, CPU over ``--idle-seconds``
  (default 30 s) of the pacerd process plus the PostgreSQL backends serving
  its database (``pg_stat_activity``, read from ``/proc``: utime+stime),
  in % of one core; target <= 3 %. The CPU of every PostgreSQL process of
  the machine is printed beside it: the services are shared, so that figure
  holds other people's work too and is not judged. pacerd's RSS (VmRSS) at
  the end: target <= 200 MB (at 10,000 known).
* ``statements``: the workers, and for each level L of ``--levels``
  (default 10, 1,000, 10,000, at most N) a daemon of its own; L destinations
  are kept active (a backlog that outlasts the window, the others' leftovers
  cancelled) and, once the level's daemon leads every partition and
  ``--settle`` seconds passed, the ledger transactions over ``--ticks``
  ticks are divided by the ticks. Each destination is paced at ``--rate``
  whatever the level: 10,000 at 2/s ask for 20,000 jobs a second, about ten
  times what one instance moves on two cores, so that level measures an
  overloaded instance (ticks of several seconds, fewer of them a second).
  ``--level-jobs J`` asks every level for the same work instead: J jobs a
  second in all, shared evenly by its destinations (``--level-jobs 2000``:
  10 at 200/s each, 1,000 at 2/s, 10,000 at 0.2/s). What is counted: the delta of
  ``pg_stat_database.xact_commit + xact_rollback`` of the benchmark's own
  database, which only pacerd uses during the window (the workers never ask
  the ledger, the benchmark reads the counters from another database): every
  transaction of the daemon — its ticks, its outcome consumer's
  ``report_many`` batches, the reconciler, the due-count summary, the
  leadership supervisor. A statement sent outside a transaction block is a
  transaction of its own, a transaction block of several statements counts
  once, and the reset asyncpg's pool sends when a connection goes back to it
  counts once: these are round trips that commit, comparable from one level
  to the next and from one tree to another, not SQL statements. PostgreSQL
  publishes a backend's counters at most once a second and an idle one's
  after up to 10 s, so a window is counted to within a few seconds' worth;
  ``--settle`` (12 s) lets the counters of the setup land first. When ``/metrics`` exports
  ``pacerd_ledger_statements_total`` its delta is printed and preferred.
  Target: the same count at every level. The same window gives the tick p99
  from the histogram ``pacerd_tick_duration_seconds`` (buckets summed over
  every series, p99 interpolated in its bucket as Prometheus'
  ``histogram_quantile`` does, and the bucket's bound): target <= 250 ms with
  1,000 active; "not exported" when the daemon records no such histogram.
* ``twins``: two instances (``fanout-a``, ``fanout-b``) over N known
  destinations, ``--twins-active`` of them with a backlog, both started at
  once while paused. The split: units (partitions when the ledger has a
  ``pacerd.partitions`` table with a leader column, else destinations, from
  ``pacerd.destinations.leader``) per instance once every unit is led and the
  split is even (max - min <= 1) or ``--balance-timeout`` ran out; ``pacerd
  status --json`` is kept in the JSON output. Then admission resumes for 3
  ticks and the instance leading more units gets ``kill -9``. Detection: the
  first poll (every 50 ms) at which its leadership session is gone from
  ``pg_stat_activity``. Takeover: the first poll at which every unit it led
  is led by the survivor (target <= 2 ticks after detection), and the
  survivor's first claim of each of its active destinations (after the
  one-tick settle of a new leader). Two instances at once: from the
  ``claimed`` events (their ``detail.by`` is the claiming instance), every
  destination's consecutive claims by different instances less than a tick
  apart (target: none); jobs still ``claimed`` by the dead instance at the
  end (``claimed_by``) wait for the claim lease and the reconciler.

Every figure is printed beside its target with PASS or FAIL; nothing is
asserted. The load average is printed at the start and end of each section:
the machine is shared. ``BENCH_ADMIN_DSN`` (see ``bench/common.py``) says
where PostgreSQL is; ``--amqp-url`` uses an existing vhost instead of
creating one (then only the queues this run created are deleted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import aiormq
import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from bench import common

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

GROUP = "tenants"
MATCH = "tenant-*"
GROUP_QUEUE = f"pacerd.ready.{GROUP}"
OWN_QUEUES = (GROUP_QUEUE, "pacerd.outcomes", "pacerd.outcomes.invalid")
PACERD = Path(sys.executable).with_name("pacerd")  # .venv/bin/pacerd
LEADER_APPLICATION_NAME = "pacerd:leader"
TICK_HISTOGRAM = "pacerd_tick_duration_seconds"
STATEMENTS_COUNTER = "pacerd_ledger_statements_total"
OUTCOMES_COUNTER = "pacerd_outcomes_total"
# The outcome consumer's statements: one per batch of reports, so their
# number follows the outcomes a second (the jobs completed), not the
# destinations; the others are the tick loop's, the reconciler's, the due
# summary's and the lock session's.
OUTCOME_STATEMENTS = frozenset({"apply_reports", "lock_reported"})
SECTIONS = ("drain", "idle", "statements", "twins")

# The targets.
DRAIN_SLACK_TICKS = 3
IDLE_CPU_PERCENT = 3.0
IDLE_RSS_MB = 200.0
TICK_P99_SECONDS = 0.25
TAKEOVER_TICKS = 2.0


# -- pure helpers (tests/unit/test_bench_fanout.py) ------------------------------------


def ideal_drain_seconds(jobs_per_destination: int, rate: float) -> float:
    """At a constant rate of ``rate`` jobs/s per destination, ``jobs_per_destination``
    jobs are released in ``jobs / rate`` seconds (5 jobs at 2/s: 2.5 s)."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    return jobs_per_destination / rate


def drain_target_seconds(
    jobs_per_destination: int, rate: float, tick: float, slack_ticks: int = DRAIN_SLACK_TICKS
) -> float:
    """The issue's bound: the ideal time plus ``slack_ticks`` ticks."""
    return ideal_drain_seconds(jobs_per_destination, rate) + slack_ticks * tick


def destination_name(index: int, width: int) -> str:
    """``tenant-00042``: the same name the SQL's ``lpad`` makes."""
    return f"tenant-{index:0{width}d}"


def name_width(n: int) -> int:
    return max(5, len(str(max(0, n - 1))))


def spread_indices(n: int, k: int) -> list[int]:
    """``k`` of ``range(n)`` spread evenly (every ``n / k``-th): the active ones
    are not all at one end of the name order. When ``k1`` divides ``k2`` and
    ``k2`` divides ``n``, the first set is inside the second."""
    if not 0 <= k <= n:
        raise ValueError(f"cannot pick {k} of {n}")
    return [i * n // k for i in range(k)]


def level_rate(level: int, level_jobs: float, rate: float) -> float:
    """The rate of each of ``level`` active destinations: ``level_jobs`` jobs
    a second shared evenly (every level asks the instance for the same work,
    so its statements per tick compare destinations, not throughput), or
    ``rate`` each when ``level_jobs`` is 0."""
    if level <= 0 or level_jobs < 0 or rate <= 0:
        raise ValueError("level and rate must be > 0, level_jobs >= 0")
    return level_jobs / level if level_jobs > 0 else rate


Sample = tuple[str, dict[str, str], float]


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition: (name, labels, value)."""
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def metric_sum(samples: Iterable[Sample], name: str) -> float | None:
    """The sum over every series of ``name``; None when it is not exported."""
    values = [v for n, _, v in samples if n == name]
    return sum(values) if values else None


def statements_by_name(samples: Iterable[Sample]) -> dict[str, float]:
    """``pacerd_ledger_statements_total`` by its ``statement`` label."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == STATEMENTS_COUNTER and "statement" in labels:
            out[labels["statement"]] = out.get(labels["statement"], 0.0) + value
    return out


def histogram_buckets(samples: Iterable[Sample], base: str) -> dict[float, float]:
    """The cumulative buckets of histogram ``base`` summed over all its series
    (every destination's, say): upper bound (``le``) -> count."""
    out: dict[float, float] = {}
    for name, labels, value in samples:
        if name == f"{base}_bucket" and "le" in labels:
            le = float(labels["le"])  # "+Inf" parses as inf
            out[le] = out.get(le, 0.0) + value
    return out


def bucket_delta(before: Mapping[float, float], after: Mapping[float, float]) -> dict[float, float]:
    """Observations between two readings of the same cumulative buckets."""
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q``-quantile (0..1) of cumulative buckets, as Prometheus'
    ``histogram_quantile``: linear inside the bucket that holds it (from 0 for
    the first bucket), the largest finite bound when it falls in ``+Inf``;
    None without observations."""
    if not 0 <= q <= 1:
        raise ValueError("q must be within [0, 1]")
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, cumulative in ordered:
        if cumulative >= rank and cumulative > below:
            if math.isinf(le):
                return lower
            if le <= 0:
                return le
            return lower + (le - lower) * (rank - below) / (cumulative - below)
        lower, below = le, cumulative
    return lower


def quantile_bucket(q: float, buckets: Mapping[float, float]) -> float | None:
    """The upper bound of the bucket that holds the ``q``-quantile (inf when
    past the largest finite bound); None without observations."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    return next(le for le, cumulative in ordered if cumulative >= rank)


def per_tick(count: float, seconds: float, tick: float) -> float:
    """``count`` over the ticks in ``seconds``."""
    return count / (seconds / tick) if seconds > 0 else math.nan


def split_counts(leaders: Mapping[str, str | None], instances: Sequence[str]) -> dict[str, int]:
    """Units per instance: every instance of ``instances`` (0 when it leads
    nothing), and any other leader seen; units without a leader are not counted."""
    counts = dict.fromkeys(instances, 0)
    for leader in leaders.values():
        if leader is not None:
            counts[leader] = counts.get(leader, 0) + 1
    return counts


def is_even(counts: Mapping[str, int]) -> bool:
    """An even split: the most and the fewest units of any instance differ by at most one."""
    return bool(counts) and max(counts.values()) - min(counts.values()) <= 1


def two_instance_windows(claims: Iterable[tuple[str, float, str]], tick: float) -> dict[str, int]:
    """Per destination, the consecutive claims (destination, at in s, instance)
    by two different instances less than ``tick`` apart: a tick-long window
    holding the admissions of two instances."""
    by_destination: dict[str, list[tuple[float, str]]] = {}
    for destination, at, by in claims:
        by_destination.setdefault(destination, []).append((at, by))
    out: dict[str, int] = {}
    for destination, rows in by_destination.items():
        rows.sort()
        n = sum(1 for (t0, a), (t1, b) in itertools.pairwise(rows) if a != b and t1 - t0 < tick)
        if n:
            out[destination] = n
    return out


def verdict(value: float | None, target: float) -> str:
    """PASS when ``value`` is at most ``target``; "n/a" when there is no value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return "PASS" if value <= target else "FAIL"


def percent_of_core(cpu_seconds: float, wall_seconds: float) -> float:
    return 100.0 * cpu_seconds / wall_seconds if wall_seconds > 0 else math.nan


# -- the run's services ---------------------------------------------------------------


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError:
        return 0, ""


@dataclass(slots=True)
class Run:
    """What every section shares: the options, the vhost, the temporary folder."""

    args: argparse.Namespace
    tag: str
    amqp_url: str
    tmp: Path
    own_vhost: str | None = None
    preexisting_queues: set[str] = field(default_factory=set)
    rows: list[list[object]] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def tick(self) -> float:
        return float(self.args.tick)

    @property
    def rate(self) -> float:
        return float(self.args.rate)

    def row(self, section: str, figure: str, value: object, target: str, judged: str) -> None:
        self.rows.append([section, figure, value, target, judged])
        print(f"  {section}: {figure} = {_cell(value)} (target {target}) {judged}", flush=True)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


async def queue_exists(url: str, name: str) -> bool:
    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel()
        try:
            await channel.queue_declare(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True
    finally:
        with contextlib.suppress(Exception):
            await connection.close()


async def purge_group_queue(url: str) -> None:
    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel()
        with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
            await channel.queue_purge(GROUP_QUEUE)
    finally:
        with contextlib.suppress(Exception):
            await connection.close()


async def delete_queues(url: str, names: Iterable[str]) -> None:
    for name in names:
        with contextlib.suppress(Exception):
            connection = await aiormq.connect(url)
            try:
                channel = await connection.channel()
                await channel.queue_delete(name)
            finally:
                await connection.close()


# -- one database per section ----------------------------------------------------------


def write_config(
    path: Path,
    run: Run,
    dsn: str,
    *,
    instance: str,
    port: int | None,
    log_level: str = "warning",
    rate: float | None = None,
) -> Path:
    """``rate``: the group's ``initial_rate = max_rate`` (default ``--rate``)."""
    http = f'http_address = "127.0.0.1:{port}"\n' if port is not None else ""
    rate = run.rate if rate is None else rate
    path.write_text(
        f'[database]\ndsn = "{dsn}"\n\n'
        f'[broker]\nurl = "{run.amqp_url}"\n\n'
        f"[pacing]\ntick_seconds = {run.tick}\n\n"
        f'[groups.{GROUP}]\nmatch = "{MATCH}"\n'
        f"initial_rate = {rate}\nmax_rate = {rate}\nmin_rate = {min(1.0, rate)}\n\n"
        f'[daemon]\ninstance_name = "{instance}"\nshutdown_grace_seconds = 5.0\n\n'
        f'[telemetry]\nlog_format = "json"\nlog_level = "{log_level}"\n{http}'
    )
    return path


def pacerd_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PACERD_", "OTEL_"))}
    env |= {
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",  # /metrics still works: http_address adds its reader
        "OTEL_LOGS_EXPORTER": "none",
        # that tree's pacerd first, then bench.fanout_app for the workers
        "PYTHONPATH": os.pathsep.join([str(common.PACERD_ROOT), str(common.ROOT)]),
    }
    return env


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(PACERD), *args],
            env=env or pacerd_env(),
            cwd=common.ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@dataclass(slots=True)
class Daemon:
    name: str
    config: Path
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = spawn(["run", "-c", str(self.config)], self.log)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> list[Sample] | None:
        status, body = http_get(self.port, "/metrics")
        return parse_metrics(body) if status == 200 else None


class Section:
    """A database of the section's own, the processes it started; all of it
    gone when the section ends, however it ends."""

    def __init__(self, run: Run, name: str) -> None:
        self.run, self.name = run, name
        self.database = f"pacerd_bench_fanout_{run.tag}_{name}"
        self.dsn = common.dsn_for(self.database)
        self.daemons: list[Daemon] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.folder = run.tmp / name
        self.folder.mkdir(parents=True, exist_ok=True)

    async def __aenter__(self) -> Section:
        await common.admin(f'CREATE DATABASE "{self.database}"')
        try:
            config = write_config(
                self.folder / "migrate.toml",
                self.run,
                self.dsn,
                instance="fanout-migrate",
                port=None,
            )
            done = await asyncio.to_thread(
                subprocess.run,
                [str(PACERD), "migrate", "-c", str(config)],
                env=pacerd_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                raise RuntimeError(f"pacerd migrate failed: {done.stderr.strip()}")
            await purge_group_queue(self.run.amqp_url)
        except BaseException:
            await common.drop_database(self.database)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await asyncio.gather(
                *(asyncio.to_thread(common.stop_process, d.proc) for d in self.daemons if d.proc),
                *(asyncio.to_thread(common.stop_process, w) for w in self.workers),
            )
        finally:
            await common.drop_database(self.database)

    def daemon(self, instance: str, rate: float | None = None) -> Daemon:
        port = free_port()
        config = write_config(
            self.folder / f"{instance}.toml",
            self.run,
            self.dsn,
            instance=instance,
            port=port,
            rate=rate,
        )
        d = Daemon(instance, config, port, self.folder / f"{instance}.log")
        self.daemons.append(d)
        return d

    async def start_daemon(
        self, instance: str, out: dict[str, Any], within: float, *, rate: float | None = None
    ) -> Daemon:
        """Starts ``instance`` and waits for its ``/readyz`` (the section's
        start-up row); ``out["ready_s"]`` is the time, or None."""
        daemon = self.daemon(instance, rate)
        daemon.start()
        out["ready_s"], said = await wait_ready(daemon, within)
        ready = out["ready_s"] if out["ready_s"] is not None else f"not ready ({said})"
        self.run.row(self.name, f"{instance} start-up: /readyz 200 after (s)", ready, "–", "")
        return daemon

    async def start_workers(self, count: int) -> None:
        config = write_config(
            self.folder / "worker.toml", self.run, self.dsn, instance="fanout-worker", port=None
        )
        env = pacerd_env() | {"BENCH_FANOUT_PREFETCH": str(self.run.args.prefetch)}
        for i in range(count):
            self.workers.append(
                spawn(
                    ["worker", "--app", "bench.fanout_app:app", "-c", str(config)],
                    self.folder / f"worker-{i}.log",
                    env,
                )
            )
        try:
            await common.wait_consumers(
                count, self.workers, url=self.run.amqp_url, queue=GROUP_QUEUE
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: see {self.folder}/worker-*.log") from None

    async def connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.dsn)


async def make_known(conn: asyncpg.Connection, n: int) -> float:
    """N known destinations through the public API: a job due tomorrow for
    each, then its cancellation; returns seconds taken."""
    t0 = time.perf_counter()
    width = name_width(n)
    await conn.execute(
        "SELECT count(*) FROM (SELECT pacerd.schedule('known-' || g, 'fanout',"
        " 'tenant-' || lpad(g::text, $2, '0'), '{}'::jsonb, now() + interval '1 day')"
        " FROM generate_series(0, $1 - 1) g) s",
        n,
        width,
    )
    await conn.execute(
        "SELECT count(*) FROM (SELECT pacerd.cancel('known-' || g,"
        " 'fanout bench: a known destination with nothing due')"
        " FROM generate_series(0, $1 - 1) g) s",
        n,
    )
    return time.perf_counter() - t0


async def schedule_backlog(
    conn: asyncpg.Connection, indices: Sequence[int], jobs_per: int, *, n: int, prefix: str
) -> float:
    """``jobs_per`` overdue jobs (due an hour ago: backlog lane) for each
    destination of ``indices``, in one statement; returns seconds taken."""
    t0 = time.perf_counter()
    await conn.execute(
        "SELECT count(*) FROM (SELECT pacerd.schedule($4 || '-' || d || '-' || k, 'fanout',"
        " 'tenant-' || lpad(d::text, $3, '0'), '{}'::jsonb, now() - interval '1 hour')"
        " FROM unnest($1::int[]) d, generate_series(1, $2) k) s",
        list(indices),
        jobs_per,
        name_width(n),
        prefix,
    )
    return time.perf_counter() - t0


# -- leadership, read defensively ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Leadership:
    kind: str  # "partitions" or "destinations"
    leaders: dict[str, str | None]


async def _partition_columns(conn: asyncpg.Connection) -> tuple[str, str] | None:
    """(id column, leader column) of ``pacerd.partitions`` when the ledger has
    one with recognisable columns; None otherwise."""
    rows = await conn.fetch(
        "SELECT column_name FROM information_schema.columns"
        " WHERE table_schema = 'pacerd' AND table_name = 'partitions'"
    )
    columns = [r["column_name"] for r in rows]
    key = next((c for c in ("partition", "partition_id", "id", "part") if c in columns), None)
    leader = next(
        (c for c in ("leader", "leader_instance", "held_by", "owner", "instance") if c in columns),
        None,
    )
    return (key, leader) if key and leader else None


async def leadership(conn: asyncpg.Connection) -> Leadership:
    cols = await _partition_columns(conn)
    if cols is not None:
        key, leader = cols
        rows = await conn.fetch(
            f'SELECT "{key}"::text AS unit, "{leader}"::text AS leader FROM pacerd.partitions'
        )
        if rows:
            return Leadership("partitions", {r["unit"]: r["leader"] for r in rows})
    rows = await conn.fetch("SELECT destination AS unit, leader FROM pacerd.destinations")
    return Leadership("destinations", {r["unit"]: r["leader"] for r in rows})


async def leader_sessions(conn: asyncpg.Connection, database: str) -> int:
    n: int = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND datname = $2",
        LEADER_APPLICATION_NAME,
        database,
    )
    return n


async def advisory_locks_by_session(conn: asyncpg.Connection, database: str) -> dict[int, int]:
    rows = await conn.fetch(
        "SELECT l.pid, count(*) AS n FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
        " WHERE l.locktype = 'advisory' AND l.granted AND d.datname = $1 GROUP BY l.pid",
        database,
    )
    return {r["pid"]: r["n"] for r in rows}


def readyz_leading(daemon: Daemon) -> set[str] | None:
    """What the instance says it leads (``/readyz``: its leadership locks);
    None when it does not answer."""
    if not daemon.alive():
        return None
    status, body = http_get(daemon.port, "/readyz", 5.0)
    try:
        return set(json.loads(body)["checks"]["readiness"]["leading"]) if status else None
    except (ValueError, KeyError, TypeError):
        return None


def merge_leaders(
    ledger: Mapping[str, str | None], held: Mapping[str, Iterable[str]]
) -> dict[str, str | None]:
    """The ledger's leaders, overridden by what live instances say they hold
    (the ledger's column is written after the lock is taken, and keeps a
    dead instance's name until someone else writes it)."""
    out = dict(ledger)
    for instance, units in held.items():
        for unit in units:
            if unit in out:
                out[unit] = instance
    return out


async def observed(conn: asyncpg.Connection, daemons: Sequence[Daemon]) -> Leadership:
    seen = await leadership(conn)
    if seen.kind != "destinations":
        return seen
    held: dict[str, set[str]] = {}
    for d in daemons:
        units = await asyncio.to_thread(readyz_leading, d)
        if units is not None:
            held[d.name] = units - {"#reconciler"}
    return Leadership(seen.kind, merge_leaders(seen.leaders, held))


async def wait_ready(daemon: Daemon, within: float) -> tuple[float | None, str]:
    """Until ``/readyz`` answers 200 (pacerd's first supervisor pass is done):
    the seconds it took (None when it did not within ``within``) and what it said."""
    t0 = time.monotonic()
    while True:
        status, body = await asyncio.to_thread(http_get, daemon.port, "/readyz", 5.0)
        if status == 200:
            return time.monotonic() - t0, "ready"
        if not daemon.alive():
            raise RuntimeError(f"{daemon.name} exited: see {daemon.log}")
        if time.monotonic() - t0 > within:
            leading: object = "?"
            with contextlib.suppress(ValueError, KeyError, TypeError):
                leading = len(json.loads(body)["checks"]["readiness"]["leading"])
            said = f"/readyz {status} after {within:.0f} s, holding {leading} leadership locks"
            print(f"  {daemon.name}: {said}; going on", flush=True)
            return None, said
        await asyncio.sleep(0.5)


async def wait_led(
    conn: asyncpg.Connection,
    daemons: Sequence[Daemon],
    within: float,
    units: Iterable[str] | None = None,
    *,
    by: str | None = None,
) -> tuple[float, Leadership]:
    """Until every unit (or every one of ``units``) has a leader, or with
    ``by`` is led by that instance (one stopped before it left its name in
    the ledger's leader column); returns the seconds it took and the
    leadership seen. TimeoutError says how far it got."""
    t0 = time.monotonic()
    wanted = set(units) if units is not None else None
    while True:
        seen = await observed(conn, daemons)
        pick = (
            seen.leaders
            if wanted is None or seen.kind == "partitions"
            else {u: seen.leaders.get(u) for u in wanted}
        )
        led = sum(1 for v in pick.values() if v is not None and (by is None or v == by))
        if pick and led == len(pick):
            return time.monotonic() - t0, seen
        for d in daemons:
            if not d.alive():
                raise RuntimeError(f"{d.name} exited: see {d.log}")
        if time.monotonic() - t0 > within:
            whom = f" by {by}" if by is not None else ""
            raise TimeoutError(
                f"{led:,} of {len(pick):,} {seen.kind} led{whom} after {within:.0f} s"
            )
        await asyncio.sleep(0.25)


# -- CPU of pacerd and of the backends of its database ---------------------------------


async def backend_pids(database: str) -> set[int]:
    conn = await asyncpg.connect(common.ADMIN_DSN)
    try:
        rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE datname = $1", database)
        return {r["pid"] for r in rows}
    finally:
        await conn.close()


def cpu_of(pids: Iterable[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            out[pid] = common.proc_sample(pid).cpu_seconds
    return out


def postgres_cpu_total() -> float:
    """utime+stime of every PostgreSQL process of the machine (shared: others' too)."""
    return sum(cpu for (_, role), cpu in common.cpu_by_process().items() if role == "postgres")


async def xacts(database: str) -> int:
    conn = await asyncpg.connect(common.ADMIN_DSN)
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        n: int = await conn.fetchval(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1",
            database,
        )
        return n
    finally:
        await conn.close()


# -- sections -----------------------------------------------------------------------------


async def section_drain(run: Run) -> dict[str, Any]:
    args = run.args
    n, a, k = args.destinations, args.active, args.jobs_per
    ideal = ideal_drain_seconds(k, run.rate)
    target = drain_target_seconds(k, run.rate, run.tick)
    out: dict[str, Any] = {
        "known": n,
        "active": a,
        "jobs_per": k,
        "ideal_s": ideal,
        "target_s": target,
        "load_start": load_average(),
    }
    print(
        f"drain: {n:,} known, {a:,} active x {k} jobs, ideal = {k} / {run.rate:g} per s"
        f" = {ideal:.2f} s, target <= ideal + {DRAIN_SLACK_TICKS} ticks = {target:.2f} s"
        f" (load {out['load_start']})",
        flush=True,
    )
    async with Section(run, "drain") as sec:
        conn = await sec.connect()
        try:
            out["known_setup_s"] = await make_known(conn, n)
            active = spread_indices(n, a)
            out["backlog_setup_s"] = await schedule_backlog(conn, active, k, n=n, prefix="drain")
            await conn.execute("SELECT pacerd.pause()")
            await sec.start_workers(args.workers)
            daemon = await sec.start_daemon("fanout-a", out, args.ready_timeout)
            width = name_width(n)
            try:
                out["lead_s"], _ = await wait_led(
                    conn,
                    [daemon],
                    args.ready_timeout,
                    units=[destination_name(i, width) for i in active],
                )
            except TimeoutError as exc:
                out["error"] = f"not led: {exc}"
                run.row("drain", "every job completed (s)", "not led", f"<= {target:.2f}", "FAIL")
                return out
            await asyncio.sleep(2 * run.tick)  # a new leader claims one tick after its lock
            t0 = await conn.fetchval("SELECT now() FROM pacerd.resume() r")
            total = a * k
            deadline = time.monotonic() + max(60.0, 10 * target)
            done = 0
            while time.monotonic() < deadline:
                done = await conn.fetchval(
                    "SELECT count(*) FROM pacerd.jobs WHERE state = 'completed'"
                    " AND job_id LIKE 'drain-%'"
                )
                if done >= total or not daemon.alive():
                    break
                await asyncio.sleep(0.25)
            rows = await conn.fetch(
                "SELECT j.destination, extract(epoch FROM max(e.at) - $1) AS s"
                " FROM pacerd.job_events e JOIN pacerd.jobs j USING (job_id)"
                " WHERE e.event = 'completed' AND j.job_id LIKE 'drain-%' GROUP BY 1",
                t0,
            )
            first = await conn.fetchval(
                "SELECT extract(epoch FROM min(at) - $1) FROM pacerd.job_events"
                " WHERE event = 'claimed' AND at >= $1",
                t0,
            )
        finally:
            await conn.close()
    per_destination = sorted(float(r["s"]) for r in rows)
    out |= {
        "completed": done,
        "jobs": total,
        "first_claim_s": _f(first),
        "load_end": load_average(),
    }
    if per_destination:
        out["last_completion_s"] = per_destination[-1]
        out["destination_p50_s"] = common.percentile(per_destination, 50)
        out["destination_p99_s"] = common.percentile(per_destination, 99)
        out["destinations_within_target"] = sum(1 for s in per_destination if s <= target)
    finished = done >= total
    last = out.get("last_completion_s", math.nan) if finished else math.nan
    run.row(
        "drain",
        f"all {total:,} jobs completed after resume (s)",
        last if finished else f"{done:,}/{total:,} completed",
        f"<= {target:.2f} (ideal {ideal:.2f} + {DRAIN_SLACK_TICKS} ticks)",
        verdict(last, target) if finished else "FAIL",
    )
    if per_destination:
        run.row(
            "drain",
            "destinations done within target",
            f"{out['destinations_within_target']:,}/{a:,}",
            f"{a:,}/{a:,}",
            "PASS" if out["destinations_within_target"] == a else "FAIL",
        )
        run.row(
            "drain",
            "per-destination last completion p50 / p99 (s)",
            f"{out['destination_p50_s']:.2f} / {out['destination_p99_s']:.2f}",
            "–",
            "",
        )
    run.row("drain", "first claim after resume (s)", _f(first), "–", "")
    return out


def _f(value: object) -> float:
    return float(value) if value is not None else math.nan  # type: ignore[arg-type]


async def section_idle(run: Run) -> dict[str, Any]:
    args = run.args
    n = args.destinations
    out: dict[str, Any] = {"known": n, "window_s": args.idle_seconds, "load_start": load_average()}
    print(
        f"idle: {n:,} known, nothing due, {args.idle_seconds:g} s window after"
        f" {args.warmup:g} s warm-up (load {out['load_start']})",
        flush=True,
    )
    async with Section(run, "idle") as sec:
        conn = await sec.connect()
        try:
            out["known_setup_s"] = await make_known(conn, n)
            daemon = await sec.start_daemon("fanout-a", out, args.ready_timeout)
            try:
                out["lead_s"], _ = await wait_led(conn, [daemon], args.ready_timeout)
            except TimeoutError as exc:
                out["error"] = f"not led: {exc}"
                print(f"  idle: {exc}; measuring anyway", flush=True)
        finally:
            await conn.close()  # the window's transactions are pacerd's alone
        await asyncio.sleep(args.warmup)
        pids0 = await backend_pids(sec.database)
        cpu0 = cpu_of([daemon.pid, *pids0])
        pg0 = postgres_cpu_total()
        x0 = await xacts(sec.database)
        t0 = time.monotonic()
        await asyncio.sleep(args.idle_seconds)
        pids1 = await backend_pids(sec.database)
        cpu1 = cpu_of([daemon.pid, *pids0, *pids1])
        pg1 = postgres_cpu_total()
        x1 = await xacts(sec.database)
        wall = time.monotonic() - t0
        sample = common.proc_sample(daemon.pid) if daemon.alive() else None
    pacerd_cpu = cpu1.get(daemon.pid, math.nan) - cpu0.get(daemon.pid, math.nan)
    backends = sum(cpu1[p] - cpu0.get(p, 0.0) for p in cpu1 if p != daemon.pid)
    together = percent_of_core(pacerd_cpu + backends, wall)
    out |= {
        "pacerd_cpu_pct": percent_of_core(pacerd_cpu, wall),
        "backends_cpu_pct": percent_of_core(backends, wall),
        "together_cpu_pct": together,
        "all_postgres_cpu_pct": percent_of_core(pg1 - pg0, wall),
        "backends": len(pids0 | pids1),
        "rss_mb": sample.rss_mb if sample else math.nan,
        "hwm_mb": sample.hwm_mb if sample else math.nan,
        "xacts_per_tick": per_tick(x1 - x0, wall, run.tick),
        "load_end": load_average(),
    }
    run.row(
        "idle",
        "CPU pacerd + its PG backends (% of a core)",
        together,
        f"<= {IDLE_CPU_PERCENT:g}",
        verdict(together, IDLE_CPU_PERCENT),
    )
    run.row(
        "idle",
        "  of which pacerd / backends (%)",
        f"{out['pacerd_cpu_pct']:.2f} / {out['backends_cpu_pct']:.2f} ({out['backends']} backends)",
        "–",
        "",
    )
    run.row(
        "idle",
        "  every PG process of the machine, shared (%)",
        out["all_postgres_cpu_pct"],
        "not judged",
        "",
    )
    run.row(
        "idle",
        f"pacerd RSS with {n:,} known (MB)",
        out["rss_mb"],
        f"<= {IDLE_RSS_MB:g}",
        verdict(out["rss_mb"], IDLE_RSS_MB),
    )
    run.row("idle", "ledger transactions per tick, nothing due", out["xacts_per_tick"], "–", "")
    return out


async def section_statements(run: Run) -> dict[str, Any]:
    args = run.args
    n = args.destinations
    levels = [lv for lv in args.levels if lv <= n]
    out: dict[str, Any] = {
        "known": n,
        "levels": {},
        "level_jobs": args.level_jobs,
        "load_start": load_average(),
    }
    asked = (
        f"{args.level_jobs:g} jobs/s in all at every level"
        if args.level_jobs > 0
        else f"{run.rate:g} jobs/s per destination at every level"
    )
    print(
        f"statements: {n:,} known, levels {levels} ({asked}), {args.ticks} ticks each after"
        f" {args.settle:g} s settle (load {out['load_start']})",
        flush=True,
    )
    width = name_width(n)
    async with Section(run, "statements") as sec:
        conn = await sec.connect()
        try:
            out["known_setup_s"] = await make_known(conn, n)
        finally:
            await conn.close()
        await sec.start_workers(args.workers)
        for level in levels:
            rate = level_rate(level, args.level_jobs, run.rate)
            active = spread_indices(n, level)
            names = [destination_name(i, width) for i in active]
            window = args.ticks * run.tick
            jobs_per = math.ceil(rate * (args.settle + window) * 1.2) + 2
            conn = await sec.connect()
            try:
                await conn.execute(
                    "SELECT count(*) FROM (SELECT pacerd.cancel(job_id, 'fanout bench: next level')"
                    " FROM pacerd.jobs WHERE state = 'scheduled' AND NOT destination = ANY($1)) s",
                    names,
                )
                setup = await schedule_backlog(conn, active, jobs_per, n=n, prefix=f"s{level}")
                print(
                    f"  level {level:,}: {rate:g} jobs/s each, {jobs_per} jobs each scheduled"
                    f" in {setup:.1f} s",
                    flush=True,
                )
                # a daemon of the level's own: its group is paced at the level's rate
                measured: dict[str, Any] = {"rate_per_destination": rate}
                daemon = await sec.start_daemon(
                    f"fanout-l{level}", measured, args.ready_timeout, rate=rate
                )
                try:
                    measured["lead_s"], _ = await wait_led(
                        conn, [daemon], args.ready_timeout, by=daemon.name
                    )
                except TimeoutError as exc:
                    measured["error"] = f"not led: {exc}"
                    print(f"  statements: {exc}; measuring anyway", flush=True)
            finally:
                await conn.close()
            await asyncio.sleep(args.settle)
            m0 = await asyncio.to_thread(daemon.metrics)
            x0 = await xacts(sec.database)
            c0 = cpu_of([daemon.pid])
            t0 = time.monotonic()
            await asyncio.sleep(window)
            wall = time.monotonic() - t0
            x1 = await xacts(sec.database)
            c1 = cpu_of([daemon.pid])
            m1 = await asyncio.to_thread(daemon.metrics)
            conn = await sec.connect()
            try:
                still = await conn.fetchval(
                    "SELECT count(DISTINCT destination) FROM pacerd.jobs"
                    " WHERE state = 'scheduled' AND next_attempt_at <= now()"
                    " AND destination = ANY($1)",
                    names,
                )
            finally:
                await conn.close()
            measured |= _statement_figures(
                run, x1 - x0, wall, m0, m1, c0.get(daemon.pid), c1.get(daemon.pid)
            )
            out["levels"][level] = measured
            measured["still_active_at_end"] = still
            measured["load"] = load_average()
            alive = daemon.alive()
            if daemon.proc is not None:
                await asyncio.to_thread(common.stop_process, daemon.proc)
            _statement_rows(run, level, measured, args)
            if not alive:
                out["error"] = f"the daemon exited: see {daemon.log}"
                break
    out["load_end"] = load_average()
    per = [v["xacts_per_tick"] for v in out["levels"].values()]
    if len(per) > 1:
        spread = max(per) / min(per) if min(per) > 0 else math.inf
        out["max_over_min"] = spread
        run.row(
            "statements",
            "most / fewest transactions per tick over the levels",
            spread,
            "the same (within 25 %)",
            "PASS" if spread <= 1.25 else "FAIL",
        )
        other = [v.get("other_statements_per_tick", 0.0) for v in out["levels"].values()]
        if min(other) > 0:
            spread = max(other) / min(other)
            out["other_max_over_min"] = spread
            run.row(
                "statements",
                "most / fewest statements per tick besides the outcome consumer's",
                spread,
                "the same (within 25 %)",
                "PASS" if spread <= 1.25 else "FAIL",
            )
    return out


def _statement_figures(
    run: Run,
    xact_delta: int,
    wall: float,
    m0: list[Sample] | None,
    m1: list[Sample] | None,
    cpu0: float | None,
    cpu1: float | None,
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "window_s": wall,
        "ticks": wall / run.tick,
        "xacts_per_tick": per_tick(xact_delta, wall, run.tick),
        "pacerd_cpu_pct": (
            percent_of_core(cpu1 - cpu0, wall)
            if cpu0 is not None and cpu1 is not None
            else math.nan
        ),
        "metrics": m1 is not None,
    }
    if m0 is not None and m1 is not None:
        s0, s1 = metric_sum(m0, STATEMENTS_COUNTER), metric_sum(m1, STATEMENTS_COUNTER)
        if s0 is not None and s1 is not None:
            figures["statements_per_tick"] = per_tick(s1 - s0, wall, run.tick)
            n0, n1 = statements_by_name(m0), statements_by_name(m1)
            by_name = {k: per_tick(v - n0.get(k, 0.0), wall, run.tick) for k, v in n1.items()}
            figures["statements_by_name"] = by_name
            outcome = sum(v for k, v in by_name.items() if k in OUTCOME_STATEMENTS)
            figures["outcome_statements_per_tick"] = outcome
            figures["other_statements_per_tick"] = sum(by_name.values()) - outcome
            o0, o1 = metric_sum(m0, OUTCOMES_COUNTER), metric_sum(m1, OUTCOMES_COUNTER)
            if o1 is not None:  # a counter first exported inside the window started at 0
                figures["outcomes_per_tick"] = per_tick(o1 - (o0 or 0.0), wall, run.tick)
        buckets = bucket_delta(
            histogram_buckets(m0, TICK_HISTOGRAM), histogram_buckets(m1, TICK_HISTOGRAM)
        )
        p99 = histogram_quantile(0.99, buckets) if buckets else None
        if p99 is not None:
            figures["tick_p99_s"] = p99
            figures["tick_p99_bucket_s"] = quantile_bucket(0.99, buckets)
            figures["tick_p50_s"] = histogram_quantile(0.5, buckets)
            figures["ticks_observed"] = total = max(buckets.values())
            # the target is a bucket bound: the share of ticks that kept it
            figures["ticks_within_target"] = buckets.get(TICK_P99_SECONDS, math.nan) / total
    return figures


def _statement_rows(run: Run, level: int, m: dict[str, Any], args: argparse.Namespace) -> None:
    what = (
        "pacerd_ledger_statements_total" if "statements_per_tick" in m else "xact_commit+rollback"
    )
    value = m.get("statements_per_tick", m["xacts_per_tick"])
    run.row(
        "statements",
        f"{level:,} active: ledger statements per tick ({what})",
        value,
        "the same at every level",
        "",
    )
    if "statements_per_tick" in m:
        run.row(
            "statements",
            f"{level:,} active: transactions per tick (xact_commit+rollback)",
            m["xacts_per_tick"],
            "–",
            "",
        )
    if "statements_by_name" in m:
        outcomes = m.get("outcomes_per_tick", math.nan)
        run.row(
            "statements",
            f"{level:,} active: the outcome consumer's statements per tick (outcomes per tick)",
            f"{m['outcome_statements_per_tick']:.1f} ({outcomes:,.0f})",
            "–",
            "",
        )
        run.row(
            "statements",
            f"{level:,} active: every other statement per tick (tick loop, reconciler, leadership)",
            m["other_statements_per_tick"],
            "the same at every level",
            "",
        )
        busiest = sorted(m["statements_by_name"].items(), key=lambda kv: -kv[1])
        run.row(
            "statements",
            f"{level:,} active: per tick by name",
            ", ".join(f"{k} {v:.1f}" for k, v in busiest if v >= 0.05),
            "–",
            "",
        )
    run.row(
        "statements",
        f"{level:,} active: still due at the window's end",
        f"{m['still_active_at_end']:,}/{level:,}",
        f"{level:,}/{level:,}",
        "",
    )
    run.row(
        "statements", f"{level:,} active: pacerd CPU (% of a core)", m["pacerd_cpu_pct"], "–", ""
    )
    reference = 1000 if 1000 in args.levels and args.destinations >= 1000 else max(args.levels)
    judged = level == min(reference, args.destinations)
    label = f"{level:,} active: tick p99 (s)"
    if not m["metrics"]:
        run.row("statements", label, "no /metrics", f"<= {TICK_P99_SECONDS}", "n/a")
    elif "tick_p99_s" not in m:
        run.row("statements", label, "not exported", f"<= {TICK_P99_SECONDS}", "n/a")
    else:
        shown = (
            f"{m['tick_p99_s']:.3f} (bucket <= {m['tick_p99_bucket_s']:g}; p50"
            f" {m['tick_p50_s']:.3f}; {m['ticks_within_target']:.1%} <= {TICK_P99_SECONDS})"
        )
        run.row(
            "statements",
            label,
            shown,
            f"<= {TICK_P99_SECONDS}" + ("" if judged else " at 1,000"),
            verdict(m["tick_p99_s"], TICK_P99_SECONDS) if judged else "",
        )


async def status_json(config: Path) -> Any:
    done = await asyncio.to_thread(
        subprocess.run,
        [str(PACERD), "status", "--json", "-c", str(config)],
        env=pacerd_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip()}
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {"error": "not JSON", "stdout": done.stdout[:2000]}


def status_split(doc: Any) -> dict[str, int] | None:
    """Units per leader from ``pacerd status --json``: its partitions when it
    lists them, else its destinations."""
    rows: Any = doc
    if isinstance(doc, dict):
        rows = doc.get("partitions") or doc.get("destinations")
    if not isinstance(rows, list):
        return None
    counts: dict[str, int] = {}
    for row in rows:
        if isinstance(row, dict):
            leader = row.get("leader")
            key = leader if isinstance(leader, str) else "(none)"
            counts[key] = counts.get(key, 0) + 1
    return counts


async def section_twins(run: Run) -> dict[str, Any]:
    args = run.args
    n = args.destinations
    a = min(args.twins_active, n)
    names = ("fanout-a", "fanout-b")
    out: dict[str, Any] = {"known": n, "active": a, "load_start": load_average()}
    print(
        f"twins: {n:,} known, {a:,} active, two instances, kill -9 of one"
        f" (load {out['load_start']})",
        flush=True,
    )
    width = name_width(n)
    active = [destination_name(i, width) for i in spread_indices(n, a)]
    async with Section(run, "twins") as sec:
        conn = await sec.connect()
        try:
            out["known_setup_s"] = await make_known(conn, n)
            jobs_per = math.ceil(run.rate * run.tick * (args.takeover_timeout + 10)) + 2
            await schedule_backlog(conn, spread_indices(n, a), jobs_per, n=n, prefix="twins")
            await conn.execute("SELECT pacerd.pause()")
            await sec.start_workers(args.workers)
            daemons = {name: sec.daemon(name) for name in names}
            for d in daemons.values():
                d.start()
            for d in daemons.values():
                took, said = await wait_ready(d, args.ready_timeout)
                ready = took if took is not None else f"not ready ({said})"
                run.row("twins", f"start-up of {d.name}: /readyz 200 after (s)", ready, "–", "")
            try:
                await wait_led(conn, list(daemons.values()), args.ready_timeout)
            except TimeoutError as exc:
                out["error"] = f"not led: {exc}"
                run.row("twins", "split", "not led", "even", "FAIL")
                return out
            t_bal = time.monotonic()
            while True:
                seen = await observed(conn, list(daemons.values()))
                counts = split_counts(seen.leaders, names)
                if is_even(counts) or time.monotonic() - t_bal > args.balance_timeout:
                    break
                await asyncio.sleep(0.5)
            out["unit"] = seen.kind
            out["split"] = counts
            unled = sum(1 for leader in seen.leaders.values() if leader is None)
            out["unled_at_split"] = unled
            out["balanced_after_s"] = time.monotonic() - t_bal if is_even(counts) else None
            out["status_json"] = await status_json(daemons["fanout-a"].config)
            out["status_split"] = status_split(out["status_json"])
            out["advisory_locks_before"] = list(
                (await advisory_locks_by_session(conn, sec.database)).values()
            )
            run.row(
                "twins",
                f"{seen.kind} per instance (a / b)",
                f"{counts['fanout-a']:,} / {counts['fanout-b']:,}"
                + (f" ({unled:,} unled at that moment)" if unled else ""),
                "even (differ by <= 1)",
                "PASS" if is_even(counts) else "FAIL",
            )
            if out["balanced_after_s"] is None:
                print(f"  twins: not even after {args.balance_timeout:g} s", flush=True)
            await conn.execute("SELECT pacerd.resume()")
            await asyncio.sleep(3 * run.tick)
            seen = await observed(conn, list(daemons.values()))
            counts = split_counts(seen.leaders, names)
            victim = max(names, key=lambda v: counts[v])
            survivor = next(v for v in names if v != victim)
            victim_units = [u for u, leader in seen.leaders.items() if leader == victim]
            victim_active = (
                [d for d in active if d in set(victim_units)]
                if seen.kind == "destinations"
                else list(active)
            )
            os.kill(daemons[victim].pid, signal.SIGKILL)
            killed_at = float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())"))
            detected = taken = None
            taken_seen_in = "-"
            deadline = time.monotonic() + args.takeover_timeout
            query = (
                "SELECT count(*) FROM pacerd.destinations WHERE destination = ANY($1)"
                " AND leader IS DISTINCT FROM $2"
            )
            while time.monotonic() < deadline and (detected is None or taken is None):
                now = float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())"))
                if detected is None and await leader_sessions(conn, sec.database) <= 1:
                    detected = now
                if detected is not None and taken is None:
                    if seen.kind == "destinations":
                        left = await conn.fetchval(query, victim_units, survivor)
                        if left == 0:
                            taken, taken_seen_in = now, "pacerd.destinations.leader"
                        else:
                            held = await asyncio.to_thread(readyz_leading, daemons[survivor])
                            if held is not None and set(victim_units) <= held:
                                taken, taken_seen_in = now, f"/readyz of {survivor} (its locks)"
                    else:
                        now_seen = await leadership(conn)
                        left = sum(1 for u in victim_units if now_seen.leaders.get(u) != survivor)
                        if left == 0:
                            taken, taken_seen_in = now, "pacerd.partitions"
                await asyncio.sleep(0.05)
            out["advisory_locks_after"] = list(
                (await advisory_locks_by_session(conn, sec.database)).values()
            )
            await asyncio.sleep(3 * run.tick)
            survivor_proc = daemons[survivor].proc
            if survivor_proc is not None:  # its graceful stop: the claims it made are all in
                await asyncio.to_thread(common.stop_process, survivor_proc)
            claims = await conn.fetch(
                "SELECT j.destination, extract(epoch FROM e.at)::float8 AS at,"
                " e.detail->>'by' AS by FROM pacerd.job_events e JOIN pacerd.jobs j USING (job_id)"
                " WHERE e.event = 'claimed'"
            )
            orphans = await conn.fetchval(
                "SELECT count(*) FROM pacerd.jobs WHERE claimed_by = $1 AND state = 'claimed'",
                victim,
            )
            mismatched = await conn.fetchval(
                "SELECT count(*) FROM pacerd.jobs j WHERE j.state IN ('claimed', 'offered')"
                " AND j.claimed_by IS DISTINCT FROM (SELECT e.detail->>'by'"
                "  FROM pacerd.job_events e WHERE e.job_id = j.job_id AND e.event = 'claimed'"
                "  ORDER BY e.id DESC LIMIT 1)"
            )
        finally:
            await conn.close()
    tick = run.tick
    rows = [(r["destination"], float(r["at"]), r["by"] or "?") for r in claims]
    overlaps = two_instance_windows(rows, tick)
    first_by_survivor: dict[str, float] = {}
    for dest, at, by in rows:
        if by == survivor and at > killed_at and dest in set(victim_active):
            first_by_survivor[dest] = min(at, first_by_survivor.get(dest, math.inf))
    around = [r for r in rows if killed_at - 2 * tick <= r[1] <= killed_at + 10 * tick]
    detection_s = detected - killed_at if detected is not None else math.nan
    takeover_ticks = (taken - detected) / tick if taken is not None and detected else math.nan
    admit_ticks = (
        (max(first_by_survivor.values()) - detected) / tick
        if first_by_survivor
        and detected is not None
        and len(first_by_survivor) == len(victim_active)
        else math.nan
    )
    out |= {
        "victim": victim,
        "takeover_seen_in": taken_seen_in,
        "survivor": survivor,
        "victim_units": len(victim_units),
        "victim_active": len(victim_active),
        "detection_s": detection_s,
        "takeover_ticks_after_detection": takeover_ticks,
        "first_claims_ticks_after_detection": admit_ticks,
        "victim_active_claimed_by_survivor": len(first_by_survivor),
        "claims": len(rows),
        "claims_around_kill": len(around),
        "two_instance_windows": sum(overlaps.values()),
        "destinations_admitted_twice": len(overlaps),
        "orphaned_claims": orphans,
        "claimed_by_mismatches": mismatched,
        "load_end": load_average(),
    }
    run.row("twins", f"kill -9 {victim}: detected after (s)", detection_s, "–", "")
    run.row(
        "twins",
        f"its {len(victim_units):,} {out['unit']} led by {survivor} (ticks after detection;"
        f" seen in {taken_seen_in})",
        takeover_ticks if taken else f"not after {args.takeover_timeout:g} s",
        f"<= {TAKEOVER_TICKS:g}",
        verdict(takeover_ticks, TAKEOVER_TICKS) if taken else "FAIL",
    )
    run.row(
        "twins",
        f"its {len(victim_active):,} active destinations claimed again (ticks after detection)",
        admit_ticks
        if not math.isnan(admit_ticks)
        else f"{len(first_by_survivor):,}/{len(victim_active):,}",
        "–",
        "",
    )
    run.row(
        "twins",
        "destinations with claims of two instances < 1 tick apart",
        len(overlaps),
        "0",
        "PASS" if not overlaps else "FAIL",
    )
    run.row(
        "twins",
        "claims from 2 ticks before to 10 after the kill",
        len(around),
        "> 0",
        "" if around else "(vacuous)",
    )
    run.row("twins", f"jobs left claimed by {victim} (await the claim lease)", orphans, "–", "")
    run.row(
        "twins",
        "in-flight jobs whose claimed_by is not their last claim's instance",
        mismatched,
        "0",
        "PASS" if not mismatched else "FAIL",
    )
    return out


# -- the run ------------------------------------------------------------------------


def _commit() -> str:
    done = subprocess.run(
        ["git", "-C", str(common.PACERD_ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    dirty = subprocess.run(
        ["git", "-C", str(common.PACERD_ROOT), "status", "--porcelain", "pacerd"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() + (" (pacerd/ modified)" if dirty.stdout.strip() else "")


async def measure(args: argparse.Namespace) -> Run:
    task = asyncio.current_task()
    if task is not None:  # SIGTERM (timeout(1), say) ends the run like Ctrl-C: cleanup runs
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    tag = uuid.uuid4().hex[:8]
    vhost: str | None = None
    url = args.amqp_url
    if url is None:
        vhost = f"pacerd-bench-fanout-{tag}"
        if not (
            common.rabbitmqctl("add_vhost", vhost)
            and common.rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        ):
            common.rabbitmqctl("delete_vhost", vhost)
            raise SystemExit(
                f"cannot create the RabbitMQ vhost {vhost} (rabbitmqctl);"
                " pass --amqp-url with a vhost of your own"
            )
        url = urlunsplit(urlsplit(common.AMQP_URL)._replace(path=f"/{vhost}"))
    with tempfile.TemporaryDirectory(prefix="pacerd-bench-fanout-") as tmp:
        run = Run(args=args, tag=tag, amqp_url=url, tmp=Path(tmp), own_vhost=vhost)
        try:
            if vhost is None:
                run.preexisting_queues = {q for q in OWN_QUEUES if await queue_exists(url, q)}
            sections = {
                "drain": section_drain,
                "idle": section_idle,
                "statements": section_statements,
                "twins": section_twins,
            }
            for name in args.only:
                try:
                    run.results[name] = await sections[name](run)
                except Exception as exc:  # one section's failure does not hide the others'
                    run.results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                    run.row(name, "section", f"failed: {type(exc).__name__}: {exc}", "–", "FAIL")
        finally:
            if vhost is not None:
                await delete_queues(url, OWN_QUEUES)
                common.rabbitmqctl("delete_vhost", vhost)
            else:
                await delete_queues(url, [q for q in OWN_QUEUES if q not in run.preexisting_queues])
        return run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="200 known / 20 active, short windows: under 2 minutes"
    )
    parser.add_argument("--destinations", type=int, default=None, help="known (default 10,000)")
    parser.add_argument("--active", type=int, default=None, help="drain: active (default 1,000)")
    parser.add_argument("--jobs-per", type=int, default=5, help="drain: jobs per active (5)")
    parser.add_argument("--ticks", type=int, default=None, help="statements: ticks measured (30)")
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--rate", type=float, default=2.0, help="initial_rate = max_rate (2/s)")
    parser.add_argument("--tick", type=float, default=1.0, help="tick_seconds (1)")
    parser.add_argument("--workers", type=int, default=2, help="pacerd worker processes (2)")
    parser.add_argument("--prefetch", type=int, default=500, help="the workers' prefetch (500)")
    parser.add_argument("--levels", default=None, help="statements: active levels (10,1000,10000)")
    parser.add_argument("--settle", type=float, default=None, help="statements: settle s (12)")
    parser.add_argument(
        "--level-jobs",
        type=float,
        default=0.0,
        help="statements: jobs/s asked in all at every level, shared by its active destinations"
        " (default 0: --rate each, whatever the level)",
    )
    parser.add_argument("--idle-seconds", type=float, default=None, help="idle: window s (30)")
    parser.add_argument("--warmup", type=float, default=None, help="idle: warm-up s (10)")
    parser.add_argument("--twins-active", type=int, default=None, help="twins: active (100)")
    parser.add_argument("--balance-timeout", type=float, default=None, help="twins: s (60)")
    parser.add_argument("--takeover-timeout", type=float, default=None, help="twins: s (60)")
    parser.add_argument("--ready-timeout", type=float, default=None, help="start-up s (180)")
    parser.add_argument("--amqp-url", default=None, help="an existing vhost instead of a new one")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults: dict[str, object] = {
        "destinations": 200 if quick else 10_000,
        "active": 20 if quick else 1_000,
        "ticks": 8 if quick else 30,
        "settle": 4.0 if quick else 12.0,
        "idle_seconds": 10.0 if quick else 30.0,
        "warmup": 3.0 if quick else 10.0,
        "twins_active": 20 if quick else 100,
        "balance_timeout": 15.0 if quick else 60.0,
        "takeover_timeout": 20.0 if quick else 60.0,
        "ready_timeout": 60.0 if quick else 180.0,
        "levels": "10,20" if quick else "10,1000,10000",
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.levels = sorted({int(v) for v in str(args.levels).split(",") if v.strip()})
    if args.level_jobs < 0:
        parser.error("--level-jobs must be >= 0")
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if not 0 < args.active <= args.destinations:
        parser.error("--active must be within 1..--destinations")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    header = (
        f"# fanout — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, pacerd at {_commit()}\n"
        f"# {common.machine_description()}\n"
        f'# {args.destinations:,} known in [groups.{GROUP}] match = "{MATCH}", rate'
        f" {args.rate:g}/s (initial = max), tick {args.tick:g} s, {args.workers} workers"
        f" (prefetch {args.prefetch}); load {load_average()}"
    )
    print(header, flush=True)
    try:
        run = common.run(lambda: measure(args))
    except asyncio.CancelledError:
        print("stopped (SIGTERM); its databases, vhost and processes are gone", file=sys.stderr)
        return 143
    print()
    print(common.table(["section", "figure", "measured", "target", "verdict"], run.rows))
    print(f"\n{time.time() - started:.0f} s; load at the end {load_average()}")
    if args.json:
        doc = {"header": header, "args": vars(args), "results": run.results, "rows": run.rows}
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
