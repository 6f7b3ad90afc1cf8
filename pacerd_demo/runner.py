"""The live demo (``bash scripts/demo.sh``): pacerd drains a backlog of overdue
jobs (about 27,000; 3,000 with ``--quick``: what each upstream accepts at
capacity over the whole run) into two rate-limited model upstreams whose
capacity steps down and up.

Owns the orchestration only: a fresh database, a config file in a temp dir, the
overdue backlog and a live trickle, one in-process ``ModelUpstream`` per
destination, N ``pacerd worker`` processes running the demo's worker (``app``) and one
``pacerd run``; a live terminal view per destination (capacity, pacer rate,
sent, refused, in flight, due, oldest-due age, drain ETA); at the end a summary
(utilization while backlog was due, refusal %, time to 90 % of the capacity
after a step up, duplicate side effects counted from the upstreams'
idempotency keys, jobs lost checked against the ledger) and a PNG chart of rate
vs capacity, both drawn by ``report``. It stops every process it started, also
on Ctrl-C. It drives the daemon the way an operator would (CLI, config, SQL
API) and reaches into nothing.

    python -m pacerd_demo [--duration 180] [--quick] [--workers 3]
        [--jobs N] [--database pacerd_demo] [--output demo-output] [--no-live]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import anyio
import anyio.to_thread
import asyncpg
from rich.console import Console
from rich.live import Live

from pacerd.cli import count, positive_seconds
from pacerd.client import Client
from pacerd.clock import SystemClock
from pacerd.publisher import ready_queue_name
from pacerd.roles import RoleNames, worker_broker_permissions
from pacerd.testing.upstream import ModelUpstream, UpstreamParams
from pacerd_demo import report
from pacerd_demo.plan import DEFAULT_DURATION, DemoPlan, DestinationPlan, backlog_prefix, make_plan

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from anyio.abc import Process

ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


def dsn_for(admin_dsn: str, database: str) -> str:
    base, _, _ = admin_dsn.rpartition("/")
    return f"{base}/{database}"


async def recreate_database(admin_dsn: str, database: str) -> str:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{database}"')
    finally:
        await conn.close()
    return dsn_for(admin_dsn, database)


async def schedule_backlog(client: Client, plan: DemoPlan, destination: DestinationPlan) -> int:
    """``backlog`` jobs that fell due between an hour and ten minutes ago, in one statement."""
    scheduled: int = await client.pool.fetchval(
        "SELECT count(*) FILTER (WHERE pacerd.schedule(job_id => $1 || g, kind => 'demo.call',"
        " destination => $2, payload => jsonb_build_object('n', g),"
        " eligible_at => now() - make_interval(secs => 600 + 3000 * (1 - g::float8 / $3)))"
        " = 'scheduled') FROM generate_series(1, $3) g",
        backlog_prefix(plan, destination.name),
        destination.name,
        destination.backlog,
    )
    return scheduled


class Demo:
    """One run: its processes, its upstreams, its samples."""

    def __init__(self, plan: DemoPlan, *, dsn: str, amqp_url: str, output: Path) -> None:
        self.plan, self.dsn, self.amqp_url, self.output = plan, dsn, amqp_url, output
        self.clock = SystemClock()
        self.upstreams: dict[str, ModelUpstream] = {}
        self.processes: list[tuple[str, Process]] = []
        self.live_ids: list[str] = []
        self.samples: list[report.Sample] = []
        self.sampled_upto: dict[str, int] = {}  # per destination: upstream seconds sampled
        self.stop = anyio.Event()
        self.failure: str | None = None

    async def start_upstreams(self) -> None:
        for d in self.plan.destinations:
            params = UpstreamParams(
                schedule=d.schedule,
                retry_after=d.retry_after,
                error_rate=d.error_rate,
                latency_median_ms=d.latency_median_ms,
            )
            upstream = ModelUpstream(params, log_path=str(self.output / f"upstream-{d.name}.jsonl"))
            await upstream.start()
            self.upstreams[d.name] = upstream

    def child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")}
        upstreams = {name: u.url for name, u in self.upstreams.items()}
        return env | {
            "DEMO_UPSTREAMS": report.json_dumps(upstreams),
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
            "PYTHONUNBUFFERED": "1",
        }

    async def spawn(self, name: str, args: Sequence[str], config: Path) -> None:
        # a quick open at start-up; the child process owns the file afterwards
        log = open(self.output / "logs" / f"{name}.log", "wb")  # noqa: ASYNC230, SIM115
        command = [sys.executable, "-m", "pacerd", *args, "-c", str(config)]
        process = await anyio.open_process(
            command, env=self.child_env(), stdout=log, stderr=log, start_new_session=True
        )
        log.close()
        self.processes.append((name, process))

    async def stop_processes(self) -> None:
        """The daemon first (stop admitting), then the workers; SIGKILL after 15 s."""
        with anyio.CancelScope(shield=True):
            for group in ("pacerd", "worker"):
                procs = [p for n, p in self.processes if n.startswith(group)]
                for p in procs:
                    if p.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            p.send_signal(signal.SIGTERM)
                with anyio.move_on_after(15):
                    for p in procs:
                        await p.wait()
                for p in procs:
                    if p.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            p.kill()
                        await p.wait()
            for _, p in self.processes:
                await p.aclose()

    async def trickle(self, client: Client, started: float) -> None:
        """Live work: new jobs due now, a few a second per destination."""
        count = 0
        interval = 1.0 / sum(d.trickle_per_second for d in self.plan.destinations)
        while not self.stop.is_set():
            for d in self.plan.destinations:
                count += 1
                job_id = f"{self.plan.run_id}-live-{d.name}-{count}"
                await client.schedule(job_id, kind="demo.call", destination=d.name, payload={})
                self.live_ids.append(job_id)
                await self.clock.sleep_until(started + count * interval)

    async def sample(self, client: Client, t: float) -> list[report.Sample]:
        """A sample per destination and whole upstream second since the last
        call (none when no second ended); the ledger's figures are read now,
        for each of them."""
        status = {s.destination: s for s in await client.status()}
        # the backlog's own due jobs (retries included), apart from the live trickle's
        rows = await client.pool.fetch(
            "SELECT destination, count(*) FILTER (WHERE state = 'completed') AS completed,"
            " count(*) FILTER (WHERE state = 'scheduled' AND next_attempt_at <= now()"
            " AND starts_with(job_id, $1 || '-backlog-')) AS backlog_due"
            " FROM pacerd.jobs GROUP BY destination",
            self.plan.run_id,
        )
        completed = {r["destination"]: r["completed"] for r in rows}
        backlog_due = {r["destination"]: r["backlog_due"] for r in rows}
        rates = await self.pacer_rates(client)
        samples: list[report.Sample] = []
        for d in self.plan.destinations:
            # every whole second of the upstream once, also when this sample
            # comes late: a busy host does not drop or repeat a second's calls
            whole = self.upstreams[d.name].model.seconds(self.clock.monotonic())[:-1]
            new = whole[self.sampled_upto.get(d.name, 0) :]
            self.sampled_upto[d.name] = len(whole)
            s = status.get(d.name)
            samples.extend(
                report.Sample(
                    t=t,
                    second=second.second,
                    destination=d.name,
                    capacity=second.capacity,
                    accepted=second.accepted,
                    refused=second.refused,
                    errors=second.errors,
                    rate=s.rate if s and s.rate is not None else rates.get(d.name),
                    due=s.due if s else d.backlog,
                    backlog_due=backlog_due.get(d.name, 0),
                    inflight=s.inflight if s else 0,
                    oldest_due_age_seconds=s.oldest_due_age_seconds if s else None,
                    drain_eta_seconds=s.drain_eta_seconds if s else None,
                    completed=completed.get(d.name, 0),
                    dead=s.dead if s else 0,
                )
                for second in new
            )
        return samples

    @staticmethod
    async def pacer_rates(client: Client) -> dict[str, float]:
        """The rate each leader persisted (tolerating a JSON document stored as a JSON string)."""
        rates = {}
        for r in await client.pool.fetch(
            "SELECT destination, pacer_state FROM pacerd.destinations"
        ):
            state = r["pacer_state"]
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                state = json.loads(state) if isinstance(state, str) else state
                rates[r["destination"]] = float(state["tick"]["rate"])
        return rates

    async def watch(self, client: Client, live: Live | None, started: float) -> None:
        for k in range(1, int(self.plan.duration_seconds) + 1):
            await self.clock.sleep_until(started + k)
            self.samples += await self.sample(client, float(k))
            view = report.live_view(self.plan, self.samples, k, self.upstreams)
            if live is not None:
                live.update(view)
            elif k % 5 == 0:
                report.print_progress(report.latest(self.samples), k)
            if self.stop.is_set():
                break

    async def run(
        self, config: Path, *, live: bool, worker_config: Path | None = None
    ) -> report.DemoSummary:
        client = await Client.connect(self.dsn)
        try:
            for d in self.plan.destinations:
                await schedule_backlog(client, self.plan, d)
            await self.start_upstreams()
            for i in range(self.plan.workers):
                await self.spawn(
                    f"worker-{i + 1}",
                    ["worker", "--app", "pacerd_demo.app:app"],
                    worker_config or config,
                )
            await self.spawn("pacerd", ["run"], config)
            started = self.clock.monotonic()
            console = Console()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.trickle, client, started)
                tg.start_soon(self.on_signals, tg.cancel_scope)
                for name, process in self.processes:
                    tg.start_soon(self.watch_child, name, process)
                with (
                    Live(console=console, refresh_per_second=4)
                    if live
                    else contextlib.nullcontext() as view
                ):
                    await self.watch(client, view, started)
                self.stop.set()
                tg.cancel_scope.cancel()
            await self.stop_processes()
            return await report.summarize(
                self.plan, client, self.samples, self.upstreams, self.live_ids
            )
        finally:
            await self.stop_processes()
            for upstream in self.upstreams.values():
                await upstream.close()
            await client.close()

    async def watch_child(self, name: str, process: Process) -> None:
        """A child that exits on its own ends the demo early, and says where to look."""
        code = await process.wait()
        if not self.stop.is_set():
            log = self.output / "logs" / f"{name}.log"
            self.failure = f"{name} exited on its own (status {code}): see {log}"
            self.stop.set()

    async def on_signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if self.stop.is_set():
                    scope.cancel()
                self.stop.set()  # finish early: stop, summarize, chart


async def migrate(config: Path, env: dict[str, str]) -> None:
    result = await anyio.run_process(
        [sys.executable, "-m", "pacerd", "migrate", "-c", str(config)], env=env, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"pacerd migrate failed: {result.stderr.decode()[-2000:]}")


async def delete_demo_queues(amqp_url: str, plan: DemoPlan) -> None:
    import aio_pika

    connection = await aio_pika.connect(amqp_url)
    async with connection:
        for d in plan.destinations:
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(ready_queue_name(d.name))


async def isolated_amqp_url(amqp_url: str, vhost: str) -> str:
    """``amqp_url`` on a vhost of the demo's own (made with ``rabbitmqctl``), so no other
    pacerd on the broker consumes its outcomes; ``amqp_url`` itself when that fails."""
    rabbitmqctl = shutil.which("rabbitmqctl")
    if not vhost or rabbitmqctl is None:
        return amqp_url
    parts = urlsplit(amqp_url)
    user = parts.username or "guest"
    for args in (["add_vhost", vhost], ["set_permissions", "-p", vhost, user, ".*", ".*", ".*"]):
        result = await anyio.run_process([rabbitmqctl, "-q", *args], check=False)
        if result.returncode != 0:
            return amqp_url
    return urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))


@contextlib.asynccontextmanager
async def worker_identity(
    admin_dsn: str, dsn: str, amqp_url: str, name: str
) -> AsyncIterator[tuple[str, str]]:
    """The workers' (DSN, AMQP URL), each party on the least it needs
    (docs/security.md): a LOGIN member of pacerd_worker (made after the migrate
    that makes that role) and, where rabbitmqctl can make one, a broker user
    with ``worker_broker_permissions()`` in the demo's vhost. Both are named
    ``name`` and dropped at the end."""
    password = secrets.token_hex(16)
    role = '"' + name.replace('"', '""') + '"'
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f"DROP ROLE IF EXISTS {role}")
        await conn.execute(
            f"CREATE ROLE {role} LOGIN PASSWORD '{password}' IN ROLE {RoleNames().worker}"
        )
    finally:
        await conn.close()
    worker_url, rabbitmqctl = amqp_url, shutil.which("rabbitmqctl")
    vhost = unquote(urlsplit(amqp_url).path.lstrip("/")) or "/"
    if rabbitmqctl is not None:
        await anyio.run_process([rabbitmqctl, "-q", "delete_user", name], check=False)
        for args in (
            ["add_user", name, password],
            worker_broker_permissions().rabbitmqctl(vhost, name),
        ):
            if (await anyio.run_process([rabbitmqctl, "-q", *args], check=False)).returncode:
                break
        else:
            worker_url = with_credentials(amqp_url, name, password)
    try:
        yield with_credentials(dsn, name, password), worker_url
    finally:
        with anyio.CancelScope(shield=True):
            if rabbitmqctl is not None:
                await anyio.run_process([rabbitmqctl, "-q", "delete_user", name], check=False)
            conn = await asyncpg.connect(admin_dsn)
            try:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
                    name,
                )
                await conn.execute(f"DROP ROLE IF EXISTS {role}")
            finally:
                await conn.close()


def with_credentials(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(
        parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}")
    )


async def amain(args: argparse.Namespace, plan: DemoPlan, workdir: Path, output: Path) -> int:
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    backlog = sum(d.backlog for d in plan.destinations)
    console.print(
        f"[bold]pacerd demo[/]: {backlog:,} overdue jobs over {len(plan.destinations)}"
        f" destinations, {plan.workers} workers, {plan.duration_seconds:.0f} s"
    )
    amqp_url = await isolated_amqp_url(args.amqp_url, args.vhost)
    dsn = await recreate_database(args.admin_dsn, args.database)
    config = workdir / "demo.toml"
    for path in (config, output / "demo.toml"):  # the second is kept, for `pacerd status -c`
        await anyio.Path(path).write_text(plan.config_toml(dsn, amqp_url))
    demo = Demo(plan, dsn=dsn, amqp_url=amqp_url, output=output)
    await migrate(config, demo.child_env())
    await delete_demo_queues(amqp_url, plan)
    try:
        # The daemon runs on the administrator; the workers on a worker role and user.
        async with worker_identity(args.admin_dsn, dsn, amqp_url, f"{args.database}_worker") as (
            worker_dsn,
            worker_amqp_url,
        ):
            worker_config = workdir / "worker.toml"
            await anyio.Path(worker_config).write_text(
                plan.config_toml(worker_dsn, worker_amqp_url)
            )
            live = not args.no_live and console.is_terminal
            summary = await demo.run(config, live=live, worker_config=worker_config)
    finally:
        await delete_demo_queues(amqp_url, plan)
    chart = output / "pacing.png"
    await anyio.to_thread.run_sync(report.write_chart, plan, demo.samples, chart, summary)
    await anyio.to_thread.run_sync(report.write_samples, demo.samples, output / "samples.jsonl")
    report.print_summary(console, plan, summary, chart, database=args.database)
    if demo.failure is not None:
        console.print(f"[red]the demo stopped early: {demo.failure}[/]")
        return 1
    return 0 if summary.lost == 0 and summary.duplicates == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pacerd_demo", description=__doc__)
    p.add_argument("--duration", type=positive_seconds, default=None, help="seconds (default 180)")
    p.add_argument("--quick", action="store_true", help="about 20 s and 3,000 jobs")
    p.add_argument("--workers", type=count, default=3, help="pacerd worker processes")
    p.add_argument(
        "--jobs",
        type=count,
        default=None,
        help="overdue jobs in all (default: the run at capacity)",
    )
    p.add_argument("--database", default="pacerd_demo", help="dropped and recreated")
    p.add_argument("--admin-dsn", default=ADMIN_DSN)
    p.add_argument("--amqp-url", default=AMQP_URL)
    p.add_argument("--vhost", default="pacerd-demo", help="made if possible; '' for the URL's")
    p.add_argument("--output", default="demo-output")
    p.add_argument("--prefix", default="demo", help="destinations: PREFIX-llm, PREFIX-carrier")
    p.add_argument("--no-live", action="store_true", help="progress lines, no live view")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    duration = args.duration or (20.0 if args.quick else DEFAULT_DURATION)
    plan = make_plan(
        duration_seconds=duration, workers=args.workers, jobs=args.jobs, prefix=args.prefix
    )
    output = Path(args.output).resolve()
    (output / "logs").mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pacerd-demo-"))
    try:
        code: int = anyio.run(amain, args, plan, workdir, output)
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
