"""The live demo's components in a short, small run against the real
PostgreSQL and RabbitMQ: the plan, the overdue backlog, the model upstreams,
the demo worker app, the samples, the summary (no duplicates, no job lost), the
live view and the PNG chart — with admission cranked by hand
(``pacerd.testing.offer_due``), so it needs no daemon. A full ``--duration 8``
run of the orchestrator with ``pacerd run`` follows when the daemon exists."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import uuid
from typing import TYPE_CHECKING

import aio_pika
import anyio
import anyio.to_thread
import asyncpg
import httpx
import pytest
from rich.console import Console

from pacerd.client import Client
from pacerd.ledger import Ledger
from pacerd.publisher import Broker, ready_queue_name
from pacerd.testing import OutcomeTap, offer_due
from pacerd.worker import Worker
from pacerd_demo import report as demo_report
from pacerd_demo.app import build_app
from pacerd_demo.plan import make_plan
from pacerd_demo.runner import Demo, schedule_backlog

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.services

ADMIN_DSN = os.environ.get("PACERD_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def test_the_plan_scales_with_the_duration() -> None:
    full = make_plan()  # each backlog: its upstream's capacity over the whole run
    assert [d.backlog for d in full.destinations] == [13_428, 13_545]
    assert [d.name for d in full.destinations] == ["demo-llm", "demo-carrier"]
    llm, carrier = full.destinations
    assert [llm.schedule.rate_at(t) for t in (0, 70, 130)] == [100, 35, 90]  # steps down, up
    assert carrier.schedule.ramp
    assert carrier.schedule.rate_at(54) == 110
    quick = make_plan(duration_seconds=20, jobs=1200, prefix="x")
    assert [d.backlog for d in quick.destinations] == [600, 600]
    assert quick.destinations[0].schedule.rate_at(7) == 35
    assert [d.backlog for d in make_plan(duration_seconds=20).destinations] == [1492, 1505]
    assert make_plan(duration_seconds=90).destinations[0].backlog == 6714
    assert 'dsn = "postgresql://h/db"' in full.config_toml("postgresql://h/db", "amqp://x/")


async def test_the_backlog_is_overdue_and_scheduled_through_the_sql_api(db_dsn: str) -> None:
    plan = make_plan(duration_seconds=10, jobs=500, prefix="t")
    async with await Client.connect(db_dsn) as client:
        with anyio.fail_after(15):
            for d in plan.destinations:
                assert await schedule_backlog(client, plan, d) == 250
                assert await schedule_backlog(client, plan, d) == 0  # idempotent
        rows = await client.pool.fetch(
            "SELECT destination, count(*) AS n, max(next_attempt_at) < now() - interval '590 s'"
            " AS overdue, count(DISTINCT job_id) AS ids FROM pacerd.jobs GROUP BY destination"
        )
    assert {r["destination"]: (r["n"], r["overdue"], r["ids"]) for r in rows} == {
        "t-llm": (250, True, 250),
        "t-carrier": (250, True, 250),
    }


async def test_the_demo_parts_drain_a_small_backlog_without_loss_or_duplicates(
    db_dsn: str, amqp_url: str, tmp_path: Path
) -> None:
    plan = make_plan(duration_seconds=6, workers=1, jobs=160, prefix=f"t-{uuid.uuid4().hex[:8]}")
    ledger = await Ledger.connect(db_dsn, max_size=4)
    client = Client(ledger.pool)
    broker = Broker(amqp_url)
    await broker.connect()
    demo = Demo(plan, dsn=db_dsn, amqp_url=amqp_url, output=tmp_path)
    tap = OutcomeTap(amqp_url, ledger, accept=lambda job_id: job_id.startswith(plan.run_id))
    try:
        with anyio.fail_after(45):  # about 6 rounds of a second; guards only against a hang
            async with tap:
                for d in plan.destinations:
                    await schedule_backlog(client, plan, d)
                    await broker.declare_destination(d.name, ready_queue_name(d.name))
                await demo.start_upstreams()
                urls = {name: upstream.url for name, upstream in demo.upstreams.items()}
                async with httpx.AsyncClient(timeout=10.0) as http:
                    stats = await http.get(f"{urls[plan.destinations[0].name]}/stats")
                assert stats.status_code == 200
                assert stats.json()["capacity"] == 100
                worker = Worker(build_app(urls), broker_url=amqp_url, dsn=db_dsn)
                async with anyio.create_task_group() as tg:
                    await tg.start(worker.run)
                    # A hand-cranked tick per round, a second apart, each sampled
                    # before it offers: every round's sample then covers a whole
                    # upstream second that began and ended with backlog left (at
                    # 20 a round, 80 per destination take four rounds), however
                    # fast or slow the host runs the calls.
                    for second in range(1, 30):
                        demo.samples += await demo.sample(client, float(second))
                        done = demo_report.latest(demo.samples)  # retries included
                        if len(done) == 2 and sum(s.completed for s in done) == 160:
                            break
                        offered = 0
                        for d in plan.destinations:
                            offered += len(await offer_due(ledger, broker, d.name, limit=20))
                        if offered:
                            results = {t.result for t in await tap.apply(offered)}
                            assert results == {"applied"}
                        await anyio.sleep(1.0)
                    worker.request_stop()
                summary = await demo_report.summarize(
                    plan, client, demo.samples, demo.upstreams, demo.live_ids
                )
    finally:
        for upstream in demo.upstreams.values():
            await upstream.close()
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            for d in plan.destinations:
                await channel.queue_delete(ready_queue_name(d.name))
        await broker.close()
        await ledger.close()

    assert (summary.scheduled, summary.lost, summary.duplicates) == (160, 0, 0)
    assert sum(d.completed for d in summary.destinations) == 160
    assert all(d.utilization is not None for d in summary.destinations)
    chart = tmp_path / "pacing.png"
    await anyio.to_thread.run_sync(demo_report.write_chart, plan, demo.samples, chart)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert chart.stat().st_size > 20_000
    demo_report.write_samples(demo.samples, tmp_path / "samples.jsonl")
    first = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert set(first) >= {"t", "destination", "capacity", "accepted", "refused", "due"}
    console = Console(record=True, width=140)
    console.print(demo_report.live_view(plan, demo.samples, 6, demo.upstreams))
    demo_report.print_summary(console, plan, summary, chart, database="x")
    text = console.export_text()
    assert plan.destinations[0].name in text
    assert "drained" in text
    assert "duplicates = 0, jobs lost = 0" in text
    lines = (tmp_path / f"upstream-{plan.destinations[0].name}.jsonl").read_text().splitlines()
    assert all("capacity" in json.loads(line) for line in lines)


@pytest.mark.skipif(
    importlib.util.find_spec("pacerd.daemon") is None, reason="pacerd run (the daemon) is needed"
)
async def test_the_whole_demo_runs_and_cleans_up(amqp_url: str, tmp_path: Path) -> None:
    database = f"pacerd_demo_t_{uuid.uuid4().hex[:8]}"
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    command = [
        sys.executable, "-m", "pacerd_demo", "--duration", "6", "--jobs", "200",
        "--workers", "1", "--no-live", "--database", database, "--admin-dsn", ADMIN_DSN,
        "--amqp-url", amqp_url, "--vhost", "pacerd-test-demo", "--output", str(tmp_path),
        "--prefix", prefix,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")}
    worker_name = f"{database}_worker"  # its worker's login role and broker user
    try:
        # A 6 s demo; the bound only guards against a hang (process start-up
        # is slow on a loaded machine).
        with anyio.fail_after(90):
            result = await anyio.run_process(command, env=env, check=False)
    finally:
        conn = await asyncpg.connect(ADMIN_DSN)
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        left = await conn.fetchval("SELECT count(*) FROM pg_roles WHERE rolname = $1", worker_name)
        await conn.execute(f'DROP ROLE IF EXISTS "{worker_name}"')
        await conn.close()
    users = await anyio.run_process(["rabbitmqctl", "-q", "list_users", "--no-table-headers"])
    output = result.stdout.decode()
    assert result.returncode == 0, output + result.stderr.decode()
    assert "duplicates = 0, jobs lost = 0" in output
    assert (tmp_path / "pacing.png").stat().st_size > 20_000
    logs = {p.name for p in (tmp_path / "logs").iterdir()}
    assert logs == {"pacerd.log", "worker-1.log"}
    assert b"pacerd_stopped" in (tmp_path / "logs" / "pacerd.log").read_bytes()
    worker_log = (tmp_path / "logs" / "worker-1.log").read_bytes()
    assert b"worker_stopped" in worker_log
    # the worker ran on a broker user that may configure nothing, and a login
    # that may call is_current; both are gone afterwards
    assert b"worker_declares_nothing" in worker_log
    assert b"is_current_unavailable" not in worker_log
    assert left == 0
    assert worker_name not in [line.split("\t")[0] for line in users.stdout.decode().splitlines()]
