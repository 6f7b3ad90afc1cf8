"""The Node.js example worker (examples/node-worker) against the real RabbitMQ
and PostgreSQL: offers published the way pacerd publishes them, outcomes that
follow the schema and that pacerd's outcome consumer applies."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import aio_pika
import anyio
import jsonschema
import pytest

from pacerd.client import Client
from pacerd.ledger import Ledger
from pacerd.models import JobState
from pacerd.publisher import (
    READY_EXCHANGE,
    Broker,
    ready_queue_name,
)
from pacerd.testing import OutcomeTap, offer_due, take_parked
from pacerd.testing.upstream import CapacitySchedule, ModelUpstream, UpstreamParams
from pacerd.worker import load_schema

pytestmark = pytest.mark.services

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node-worker"
OUTCOME_SCHEMA = jsonschema.Draft202012Validator(load_schema("outcome"))


@pytest.fixture(scope="module")
def node_worker() -> Path:
    """The example with its dependency installed (in place: node_modules is gitignored)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("Node.js and npm are needed for the Node.js worker example")
    if not (EXAMPLE / "node_modules" / "amqplib" / "package.json").exists():
        install = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=EXAMPLE, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        if install.returncode != 0:
            pytest.skip(f"npm could not install amqplib (no registry?): {install.stderr[-500:]}")
    return EXAMPLE / "worker.js"


async def test_node_worker_outcomes_follow_the_schema_and_are_applied(
    node_worker: Path, db_dsn: str, amqp_url: str
) -> None:
    destination = f"t-node-{uuid.uuid4().hex[:10]}"
    queue = ready_queue_name(destination)
    ledger = await Ledger.connect(db_dsn, max_size=4)
    client = Client(ledger.pool)
    broker = Broker(amqp_url)
    await broker.connect()
    await broker.declare_destination(destination, queue)
    token = uuid.uuid4().hex[:8]
    tap = OutcomeTap(amqp_url, ledger, accept=lambda job_id: job_id.startswith(f"node-{token}-"))
    # three calls in the bucket, then one every two seconds: three ok, three refused
    params = UpstreamParams(
        schedule=CapacitySchedule.parse("0:0.5"), burst_seconds=6.0, retry_after=True
    )
    env = dict(os.environ) | {"AMQP_URL": amqp_url, "DESTINATION": destination}
    try:
        async with ModelUpstream(params) as upstream, tap:
            env["UPSTREAM_URL"] = upstream.url
            for n in range(6):
                await client.schedule(
                    f"node-{token}-{n}", kind="call", destination=destination, payload={"n": n}
                )
            process = await anyio.open_process(
                ["node", str(node_worker)], env=env, stdout=None, stderr=None
            )
            async with process:
                try:
                    with anyio.fail_after(15):
                        await offer_due(ledger, broker, destination)
                        first = await tap.apply(6)
                        upstream.model.set_rate(1000.0, upstream.clock.monotonic())
                        upstream.model.params = _with_errors(upstream.model.params)
                        for n in (6, 7):
                            await client.schedule(
                                f"node-{token}-{n}",
                                kind="call",
                                destination=destination,
                                payload={},
                            )
                        offered = await offer_due(ledger, broker, destination)
                        second = await tap.apply(len(offered))
                        await broker.publish_raw(destination, b"garbage", exchange=READY_EXCHANGE)
                        [parked] = await take_parked(amqp_url, queue, 1)
                        process.send_signal(signal.SIGTERM)
                        assert await process.wait() == 0
                finally:
                    if process.returncode is None:
                        process.kill()
    finally:
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            await (await connection.channel()).queue_delete(queue)
        await broker.close()
        await ledger.close()

    assert [t.result for t in first + second] == ["applied"] * (6 + len(offered))
    outcomes = [t.doc for t in first + second]
    for body in outcomes:
        OUTCOME_SCHEMA.validate(body)
    kinds = [b["outcome"] for b in outcomes]
    assert sorted(kinds[:6]) == ["ok"] * 3 + ["refused"] * 3
    assert kinds[6:] == ["retry"] * len(offered)
    refused = [b for b in outcomes[:6] if b["outcome"] == "refused"]
    assert all(b["retry_after_s"] >= 1 for b in refused)
    ok = [b for b in outcomes[:6] if b["outcome"] == "ok"]
    assert all(isinstance(b["detail"]["tokens"], int) for b in ok)
    assert b"not JSON" in bytes(str((parked.headers or {})["x-pacerd-invalid-reason"]), "utf-8")
    assert set(upstream.model.keys) == {b["job_id"] for b in ok}
    states = {}
    async with await Client.connect(db_dsn) as check:
        for n in range(8):
            shown = await check.show(f"node-{token}-{n}")
            assert shown is not None
            states[n] = shown[0].state
    assert sorted(states.values()).count(JobState.COMPLETED) == 3


def _with_errors(params: UpstreamParams) -> UpstreamParams:
    from dataclasses import replace

    return replace(params, error_rate=1.0)


def test_node_worker_takes_the_attempt_of_an_undecodable_offer_from_its_properties(
    node_worker: Path,
) -> None:
    script = """
const { decodeReady } = require(process.argv[1]);
const deep = '['.repeat(200000) + ']'.repeat(200000);
const cases = [
  [deep, { messageId: 'job:a:3', correlationId: 'job:a' }],
  ['{not json', { messageId: 'job-b:1' }],
  ['{not json', { messageId: 'job-c:1', correlationId: 'other' }],
  ['{not json', { messageId: 'job-d:0' }],
  ['{not json', {}],
];
console.log(JSON.stringify(cases.map(([body, props]) => {
  const d = decodeReady(Buffer.from(body), props);
  return [d.jobId ?? null, d.attempt ?? null, typeof d.error];
})));
"""
    done = subprocess.run(
        ["node", "-e", script, str(node_worker)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout) == [
        ["job:a", 3, "string"],
        ["job-b", 1, "string"],
        [None, None, "string"],
        [None, None, "string"],
        [None, None, "string"],
    ]
