"""The worker library's batched reporting under faults, against the real
RabbitMQ and PostgreSQL: a ``pacerd worker`` process killed with SIGKILL in
the middle of its batches, and the broker closing a worker's connection with
offers in flight. Nothing is lost (what was not acknowledged is redelivered
and completed) and an idempotent handler's effect happens once per job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING

import anyio
import pytest
from test_worker import rig  # noqa: F401  (the fixture)

from pacerd.models import JobState
from pacerd.testing import offer_due
from pacerd.testing.upstream import CapacitySchedule, ModelUpstream, UpstreamParams
from pacerd.worker import Job, WorkerApp
from pacerd_demo.app import build_app

if TYPE_CHECKING:
    from pathlib import Path

    from test_worker import Rig

pytestmark = pytest.mark.services


async def apply_until_completed(r: Rig, jobs: int) -> dict[str, int]:
    """Applies outcomes until ``jobs`` were applied; a second outcome for an
    attempt already applied (its offer redelivered) is ``stale``."""
    results: dict[str, int] = {}
    while results.get("applied", 0) < jobs:
        [tapped] = await r.tap.apply(1)
        results[tapped.result] = results.get(tapped.result, 0) + 1
    assert set(results) <= {"applied", "stale"}, results
    return results


async def assert_each_completed_once(r: Rig, job_ids: list[str]) -> None:
    for job_id in job_ids:
        job, events = await r.state(job_id)
        assert job.state is JobState.COMPLETED, job_id
        assert [e.event for e in events].count("completed") == 1, job_id


async def test_a_worker_killed_mid_batch_loses_nothing_and_repeats_no_effect(
    rig: Rig,  # noqa: F811
    tmp_path: Path,
    amqp_url: str,
) -> None:
    jobs = 300
    job_ids = [f"kill-{i}" for i in range(jobs)]
    for i, job_id in enumerate(job_ids):
        await rig.schedule(job_id, "call", {"n": i})
    config = tmp_path / "worker.toml"
    config.write_text(
        f'[database]\ndsn = "{rig.dsn}"\n[broker]\nurl = "{amqp_url}"\n'
        '[telemetry]\nlog_format = "json"\nlog_level = "warning"\n'
    )
    params = UpstreamParams(schedule=CapacitySchedule.parse("0:1000000"), latency_median_ms=5)
    async with ModelUpstream(params) as upstream:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PACERD_", "OTEL_"))}
        env |= {"DEMO_UPSTREAMS": json.dumps({rig.destination: upstream.url})}
        env |= {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
        command = [sys.executable, "-m", "pacerd", "worker", "-c", str(config)]
        command += ["--app", "pacerd_demo.app:app"]
        with anyio.fail_after(60):
            offered = await offer_due(rig.ledger, rig.broker, rig.destination, limit=jobs)
            assert len(offered) == jobs
            process = await anyio.open_process(
                command, env=env, stdout=subprocess.DEVNULL, stderr=None
            )
            try:
                while len(upstream.model.keys) < jobs // 3:  # well into its batches
                    assert process.returncode is None
                    await anyio.sleep(0.005)
                process.send_signal(signal.SIGKILL)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            assert len(upstream.model.keys) < jobs  # killed mid-way: some offers never ran

            survivor = rig.worker(build_app({rig.destination: upstream.url}))
            async with anyio.create_task_group() as tg:
                await tg.start(survivor.run)
                results = await apply_until_completed(rig, jobs)
                await survivor.wait_until(lambda s: s.inflight == 0)
                survivor.request_stop()
    await assert_each_completed_once(rig, job_ids)
    assert set(upstream.model.keys) == set(job_ids)  # every effect, each under its own key
    # the survivor was offered again only what the killed worker had not
    # acknowledged; what that worker had run, it ran again under the same key
    assert survivor.stats.received < jobs
    assert results.get("stale", 0) <= sum(n - 1 for n in upstream.model.keys.values())
    assert await rig.ready_count() == 0


def close_broker_connections(name: str) -> int:
    """Closes, from the broker's side, every connection named ``name``."""
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    pids = [line.split("\t", 1)[0] for line in listed.splitlines() if f'"{name}"' in line]
    for pid in pids:
        subprocess.run(
            ["rabbitmqctl", "-q", "close_connection", pid, "test: the broker closes it"],
            capture_output=True, timeout=120, check=True,
        )  # fmt: skip
    return len(pids)


async def test_a_connection_lost_with_offers_in_flight_loses_nothing(
    rig: Rig,  # noqa: F811
) -> None:
    """The broker closes the worker's connection while handlers run and
    outcomes are on their way; the worker reconnects and every job completes
    once, its effect recorded once."""
    jobs, prefetch, before_loss = 200, 20, 60
    app = WorkerApp(destinations=[rig.destination], prefetch=prefetch, check_current=False)
    gate = anyio.Event()
    effects: dict[str, int] = {}

    @app.handler()
    async def handle(job: Job) -> None:
        if job.payload["n"] >= before_loss:
            await gate.wait()
        effects[job.idempotency_key] = effects.get(job.idempotency_key, 0) + 1

    job_ids = [f"loss-{i}" for i in range(jobs)]
    for i, job_id in enumerate(job_ids):
        await rig.schedule(job_id, "ok", {"n": i})
    name = f"pacerd-worker-{uuid.uuid4().hex[:8]}"
    worker = rig.worker(app, connection_name=name)
    with anyio.fail_after(90):
        assert len(await offer_due(rig.ledger, rig.broker, rig.destination, limit=jobs)) == jobs
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            await worker.wait_until(lambda s: s.reported >= before_loss and s.inflight == prefetch)
            first = worker._connection
            assert await anyio.to_thread.run_sync(close_broker_connections, name) == 1
            while worker._connection is first:  # the loss seen, a new session begun
                await anyio.sleep(0.01)
            assert worker.stats.abandoned == 0  # a lost session abandons; it is not a stop
            gate.set()
            results = await apply_until_completed(rig, jobs)
            await worker.wait_until(lambda s: s.inflight == 0)
            worker.request_stop()
    await assert_each_completed_once(rig, job_ids)
    assert set(effects) == set(job_ids)
    assert results.get("stale", 0) <= sum(n - 1 for n in effects.values())
    assert worker.stats.received >= jobs + prefetch  # the ones held at the loss, again
    assert await rig.ready_count() == 0
