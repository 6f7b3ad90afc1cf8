"""The Python worker library (pacerd.worker) against the real RabbitMQ and
PostgreSQL: every outcome path, ack only after a confirmed outcome, the
is_current skip, continue-at-cursor, invalid envelopes, graceful stop, and the
`pacerd worker` process. Offers are made and outcomes applied with pacerd's own
code (``pacerd.testing.offer_due`` / ``apply_outcomes``)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import sys
import uuid
from typing import TYPE_CHECKING, Any

import aio_pika
import anyio
import jsonschema
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pacerd.client import Client
from pacerd.ledger import Ledger
from pacerd.models import ClaimedJob, JobState
from pacerd.publisher import (
    READY_EXCHANGE,
    Broker,
    ready_body,
    ready_queue_name,
)
from pacerd.testing import OutcomeTap, TappedOutcome, offer_due, take_parked
from pacerd.testing.upstream import CapacitySchedule, ModelUpstream, UpstreamParams
from pacerd.worker import (
    Continue,
    Fail,
    Job,
    Refused,
    Retry,
    Worker,
    WorkerApp,
    WorkerStats,
    load_schema,
)
from pacerd_demo.app import build_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from aio_pika.abc import AbstractChannel
    from anyio.abc import ByteReceiveStream

pytestmark = pytest.mark.services

OUTCOME_SCHEMA = jsonschema.Draft202012Validator(load_schema("outcome"))


class Rig:
    """One test's destination, ledger and broker, and a private tap on the outcomes."""

    def __init__(
        self, amqp_url: str, dsn: str, ledger: Ledger, broker: Broker, channel: AbstractChannel
    ) -> None:
        self.amqp_url, self.dsn, self.ledger, self.broker = amqp_url, dsn, ledger, broker
        self.channel = channel
        self.client = Client(ledger.pool)
        self.destination = f"t-worker-{uuid.uuid4().hex[:10]}"
        self.job_ids: set[str] = set()
        self.tap = OutcomeTap(amqp_url, ledger, accept=self.job_ids.__contains__)
        self.outcomes: list[TappedOutcome] = []  # every outcome applied so far

    async def schedule(self, job_id: str, kind: str = "ok", payload: Any = None) -> None:
        self.job_ids.add(job_id)
        await self.client.schedule(
            job_id, kind=kind, destination=self.destination, payload=payload or {}
        )

    async def offer(self, headers: dict[str, str] | None = None) -> list[ClaimedJob]:
        return await offer_due(self.ledger, self.broker, self.destination, headers=headers)

    async def apply(self, count: int) -> int:
        """Applies the next ``count`` outcomes of this test's jobs; all must be applied."""
        tapped = await self.tap.apply(count)
        assert [t.result for t in tapped] == ["applied"] * count, tapped
        self.outcomes += tapped
        return count

    def worker(self, app: WorkerApp, **kwargs: Any) -> Worker:
        return Worker(app, broker_url=self.amqp_url, dsn=self.dsn, **kwargs)

    async def ready_count(self) -> int:
        queue = await self.channel.declare_queue(ready_queue_name(self.destination), passive=True)
        count = queue.declaration_result.message_count
        assert count is not None
        return count

    async def returned_count(self) -> int:
        """The ready count once a closed channel's unacknowledged deliveries
        are back: the quorum queue returns them a moment after the close, so
        this waits for the first to show (under the caller's deadline); an
        acknowledged offer never shows, and the deadline fails the test."""
        while (ready := await self.ready_count()) == 0:
            await anyio.sleep(0.02)
        return ready

    async def state(self, job_id: str) -> Any:
        shown = await self.client.show(job_id)
        assert shown is not None
        return shown


@pytest.fixture
async def rig(db_dsn: str, amqp_url: str) -> AsyncIterator[Rig]:
    ledger = await Ledger.connect(db_dsn, max_size=4)
    broker = Broker(amqp_url)
    await broker.connect()
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    r = Rig(amqp_url, db_dsn, ledger, broker, channel)
    await broker.declare_destination(r.destination, ready_queue_name(r.destination))
    async with r.tap:
        yield r
    await channel.queue_delete(ready_queue_name(r.destination))
    await connection.close()
    await broker.close()
    await ledger.close()


async def run_until(worker: Worker, predicate: Any) -> None:
    """Runs ``worker`` until ``predicate(stats)``, then stops it gracefully."""
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await worker.wait_until(predicate)
        worker.request_stop()


def reported(n: int) -> Any:
    return lambda s: s.reported >= n


async def test_each_outcome_becomes_a_report_that_pacerd_applies(rig: Rig) -> None:
    app = WorkerApp(destinations=[rig.destination], prefetch=8)

    @app.handler("ok")
    async def ok(job: Job) -> dict[str, int]:
        return {"tokens": 42}

    @app.handler("refused")
    async def refused(job: Job) -> None:
        raise Refused(retry_after_s=30)

    @app.handler("retry")
    async def retry(job: Job) -> None:
        raise Retry("upstream 503")

    @app.handler("fail")
    async def fail(job: Job) -> None:
        raise Fail("bad input")

    @app.handler("continue")
    async def cont(job: Job) -> None:
        raise Continue({"page": 2})

    @app.handler("crash")
    async def crash(job: Job) -> None:
        raise RuntimeError("boom")

    kinds = ["ok", "refused", "retry", "fail", "continue", "crash", "nobody-handles-this"]
    for kind in kinds:
        await rig.schedule(f"job-{kind}", kind)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    traceparent = f"00-{trace_id}-{parent_id}-01"
    before = dt.datetime.now(dt.UTC)
    with anyio.fail_after(15):
        assert len(await rig.offer(headers={"traceparent": traceparent})) == len(kinds)
        worker = rig.worker(app, tracer=provider.get_tracer("test"))
        await run_until(worker, reported(len(kinds)))
        assert await rig.apply(len(kinds)) == len(kinds)
    assert worker.stats.outcomes == {"ok": 1, "refused": 1, "retry": 2, "fail": 2, "continue": 1}

    expected = {
        "ok": (JobState.COMPLETED, 0, None),
        "refused": (JobState.SCHEDULED, 0, None),
        "retry": (JobState.SCHEDULED, 1, "upstream 503"),
        "fail": (JobState.DEAD, 0, "bad input"),
        "continue": (JobState.SCHEDULED, 0, None),
        "crash": (JobState.SCHEDULED, 1, "RuntimeError: boom"),
        "nobody-handles-this": (JobState.DEAD, 0, "no handler registered for kind"),
    }
    for kind, (state, failures, error) in expected.items():
        job, events = await rig.state(f"job-{kind}")
        assert (job.state, job.failures) == (state, failures), kind
        assert (error or "") in (job.last_error or ""), kind
        assert events[-1].detail["outcome"] in {"ok", "refused", "retry", "fail", "continue"}
    job, events = await rig.state("job-refused")
    assert job.next_attempt_at >= before + dt.timedelta(seconds=29)
    job, events = await rig.state("job-continue")
    assert job.cursor == {"page": 2}
    job, events = await rig.state("job-ok")
    assert events[-1].event == "completed"
    assert events[-1].detail["detail"] == {"tokens": 42}

    for tapped in rig.outcomes:  # what the worker sent follows the schema and the properties
        body = tapped.doc
        OUTCOME_SCHEMA.validate(body)
        assert tapped.message_id == f"{body['job_id']}:{body['attempt']}"
        assert tapped.correlation_id == body["job_id"]
        assert tapped.content_type == "application/json"
        assert str(tapped.headers["traceparent"]).split("-")[1] == trace_id
    spans = exporter.get_finished_spans()
    assert len(spans) == len(kinds)
    for span in spans:  # the trace continues from the offer's traceparent
        assert span.parent is not None
        assert f"{span.parent.span_id:016x}" == parent_id
        assert f"{span.context.trace_id:032x}" == trace_id


async def test_ack_only_after_the_outcome_is_confirmed(rig: Rig, amqp_url: str) -> None:
    """Worker A's outcome can never be confirmed (its exchange nacks every
    publish); A is killed; the offer comes back, worker B runs it again, and the
    upstream's idempotency key makes the side effect happen once."""
    nacking = f"t-nack-{uuid.uuid4().hex[:8]}"
    exchange = await rig.channel.declare_exchange(nacking, aio_pika.ExchangeType.FANOUT)
    full = await rig.channel.declare_queue(
        exclusive=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
    )
    await full.bind(exchange)
    params = UpstreamParams(schedule=CapacitySchedule.parse("0:1000"))
    async with ModelUpstream(params) as upstream:
        app = build_app({rig.destination: upstream.url})
        await rig.schedule("job-once", "call", {"n": 1})
        with anyio.fail_after(15):
            await rig.offer()
            worker_a = rig.worker(app, outcomes_exchange=nacking)
            async with anyio.create_task_group() as tg:
                await tg.start(worker_a.run)
                await worker_a.wait_until(lambda s: s.publish_failures >= 2)
                tg.cancel_scope.cancel()  # killed between handler return and outcome confirm
            assert worker_a.stats.reported == 0
            assert upstream.model.keys["job-once"] == 1
            job, _ = await rig.state("job-once")
            assert job.state is JobState.OFFERED
            assert await rig.returned_count() == 1  # never acknowledged: back in the queue

            worker_b = rig.worker(app)
            await run_until(worker_b, reported(1))
            assert await rig.apply(1) == 1
    job, events = await rig.state("job-once")
    assert job.state is JobState.COMPLETED
    assert [e.event for e in events].count("completed") == 1
    assert events[-1].detail["detail"]["duplicate"] is True  # the upstream saw the key again
    assert upstream.model.keys == {"job-once": 2}
    assert len(upstream.model.keys) == 1  # one side effect, keyed by the job id
    await rig.channel.exchange_delete(nacking)


async def test_an_offer_that_is_no_longer_current_never_reaches_the_handler(rig: Rig) -> None:
    app = WorkerApp(destinations=[rig.destination])
    called: list[str] = []

    @app.handler()
    async def handle(job: Job) -> None:
        called.append(job.job_id)

    for job_id in ("cancelled", "revised", "current"):
        await rig.schedule(job_id)
    with anyio.fail_after(15):
        await rig.offer()
        assert await rig.client.cancel("cancelled", "test") == "cancelled"
        await rig.client.schedule(
            "revised", kind="ok", destination=rig.destination, payload={"v": 2}, revision=1
        )
        worker = rig.worker(app)
        await run_until(worker, lambda s: s.skipped + s.reported >= 3)
        assert await rig.apply(1) == 1
    assert called == ["current"]
    assert worker.stats.skipped == 2
    assert await rig.ready_count() == 0  # the stale offers were acknowledged


async def test_continue_resumes_at_the_cursor_before_the_deadline(rig: Rig) -> None:
    app = WorkerApp(destinations=[rig.destination], handler_timeout_seconds=0.4)
    pages_done: list[int] = []
    keys: list[str] = []

    @app.handler("chunked")
    async def chunked(job: Job) -> dict[str, int]:
        keys.append(job.idempotency_key)
        page = job.cursor["next"] if job.cursor else 0
        while page < job.payload["pages"]:
            if job.checkpoint_due(reserve_seconds=0.15):
                raise Continue({"next": page})
            await anyio.sleep(0.05)
            pages_done.append(page)
            page += 1
        return {"pages": page}

    await rig.schedule("long", "chunked", {"pages": 12})
    worker = rig.worker(app)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            for attempt in range(1, 10):
                offered = await rig.offer()
                assert [j.attempt for j in offered] == [attempt]
                await worker.wait_until(reported(attempt))
                await rig.apply(1)
                if worker.stats.outcomes.get("ok"):
                    break
            worker.request_stop()
    assert pages_done == list(range(12))  # each page once: resumed, never restarted
    assert len(keys) >= 3
    assert keys[0] == "long"
    assert keys[1].startswith('long:{"next":')
    job, events = await rig.state("long")
    assert job.state is JobState.COMPLETED
    assert [e.event for e in events].count("continued") == len(keys) - 1


async def test_invalid_envelopes_are_reported_or_parked_never_a_crash(rig: Rig) -> None:
    app = WorkerApp(destinations=[rig.destination])

    @app.handler()
    async def handle(job: Job) -> None:
        return None

    await rig.schedule("broken")
    await rig.schedule("fine")
    claimed = await rig.ledger.claim_due(
        rig.destination, live_limit=0, limit=1, claim_seconds=30, epoch=0,
        live_window_seconds=0, instance="test",
    )  # fmt: skip
    await rig.ledger.mark_offered([claimed[0].ref], offer_seconds=60)
    broken = json.loads(ready_body(claimed[0]))
    broken["revision"] = "seven"
    rig.job_ids.add(claimed[0].job_id)
    for body in (b"not json", b'{"job_id": "nameless"}', json.dumps(broken).encode()):
        await rig.broker.publish_raw(rig.destination, body, exchange=READY_EXCHANGE)
    with anyio.fail_after(15):
        await rig.offer()  # "fine", after the broken ones
        worker = rig.worker(app)
        await run_until(worker, lambda s: s.parked + s.reported >= 4)
        assert await rig.apply(2) == 2
        parked = await take_parked(rig.amqp_url, ready_queue_name(rig.destination), 2)
    assert worker.stats.parked == 2
    assert worker.stats.outcomes == {"fail": 1, "ok": 1}
    assert [m.body for m in parked] == [b"not json", b'{"job_id": "nameless"}']
    reasons = [str((m.headers or {})["x-pacerd-invalid-reason"]) for m in parked]
    assert "not JSON" in reasons[0]
    assert "attempt" in reasons[1]
    job, _ = await rig.state(claimed[0].job_id)
    assert job.state is JobState.DEAD
    assert "revision" in (job.last_error or "")
    assert (await rig.state("fine"))[0].state is JobState.COMPLETED


async def test_graceful_stop_finishes_within_grace_and_returns_the_rest(rig: Rig) -> None:
    app = WorkerApp(destinations=[rig.destination], shutdown_grace_seconds=0.5)
    stuck, release = anyio.Event(), anyio.Event()

    @app.handler("quick")
    async def quick(job: Job) -> None:
        await release.wait()

    @app.handler("stuck")
    async def never(job: Job) -> None:
        await stuck.wait()

    await rig.schedule("quick", "quick")
    await rig.schedule("stuck", "stuck")
    worker = rig.worker(app)
    with anyio.fail_after(15):
        await rig.offer()
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            await worker.wait_until(lambda s: s.inflight == 2)
            worker.request_stop()
            release.set()  # "quick" ends within the grace period, "stuck" never does
        assert await rig.apply(1) == 1
        assert await rig.returned_count() == 1  # the abandoned offer, unacknowledged, is back
    stats: WorkerStats = worker.stats
    assert (stats.outcomes, stats.abandoned) == ({"ok": 1}, 1)
    assert (await rig.state("stuck"))[0].state is JobState.OFFERED


async def test_pacerd_worker_process_stops_on_sigterm(
    rig: Rig, tmp_path: Any, amqp_url: str
) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(
        f'[database]\ndsn = "{rig.dsn}"\n[broker]\nurl = "{amqp_url}"\n'
        '[telemetry]\nlog_format = "json"\n[daemon]\ninstance_name = "worker-7"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")}
    env |= {"DEMO_UPSTREAMS": json.dumps({rig.destination: "http://127.0.0.1:9"})}
    env |= {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    command = [sys.executable, "-m", "pacerd", "worker", "-c", str(config)]
    command += ["--app", "pacerd_demo.app:app"]
    lines: list[bytes] = []
    async with await anyio.open_process(command, env=env, stdout=None) as process:
        assert process.stderr is not None
        try:
            with anyio.fail_after(15):
                async for line in TextLines(process.stderr):
                    lines.append(line)
                    if b"worker_started" in line:
                        process.send_signal(signal.SIGTERM)
                    if b"worker_stopped" in line:
                        break
                assert await process.wait() == 0, b"".join(lines).decode()
        finally:
            if process.returncode is None:
                process.kill()
    assert any(b"worker_signal" in line and b"SIGTERM" in line for line in lines)
    # once consuming, the `pacerd worker` process froze its start-up heap (pacerd.heap)
    assert any(b"heap_settled" in line for line in lines), b"".join(lines).decode()
    # every line names the instance, as the daemon's do
    logged = [json.loads(line) for line in lines if line.startswith(b"{")]
    assert logged
    assert {entry.get("instance") for entry in logged} == {"worker-7"}


class TextLines:
    """Lines of a byte stream."""

    def __init__(self, stream: ByteReceiveStream) -> None:
        self.stream, self.buffer = stream, b""

    def __aiter__(self) -> TextLines:
        return self

    async def __anext__(self) -> bytes:
        while b"\n" not in self.buffer:
            try:
                self.buffer += await self.stream.receive()
            except anyio.EndOfStream:
                raise StopAsyncIteration from None
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line + b"\n"


async def test_the_worker_reconnects_after_losing_the_broker(rig: Rig) -> None:
    app = WorkerApp(destinations=[rig.destination])

    @app.handler()
    async def handle(job: Job) -> None:
        return None

    await rig.schedule("before")
    worker = rig.worker(app)
    with anyio.fail_after(15):
        await rig.offer()
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            await worker.wait_until(reported(1))
            assert worker._connection is not None
            await worker._connection.close()  # the broker went away
            await rig.schedule("after")
            await rig.offer()
            await worker.wait_until(reported(2))  # consuming again, on a new connection
            worker.request_stop()
        assert await rig.apply(2) == 2
    assert (await rig.state("after"))[0].state is JobState.COMPLETED


async def test_handlers_running_at_once_are_bounded_by_the_prefetch(rig: Rig) -> None:
    prefetch = 4
    app = WorkerApp(destinations=[rig.destination], prefetch=prefetch, check_current=False)
    running, most, release = 0, 0, anyio.Event()

    @app.handler()
    async def slow(job: Job) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await release.wait()
        finally:
            running -= 1

    jobs = 3 * prefetch
    for i in range(jobs):
        await rig.schedule(f"slow-{i}")
    worker = rig.worker(app)
    with anyio.fail_after(30):
        assert len(await rig.offer()) == jobs
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            await worker.wait_until(lambda s: s.received >= prefetch)
            assert await rig.ready_count() == jobs - prefetch  # the broker holds the rest back
            assert (running, worker.stats.inflight) == (prefetch, prefetch)
            release.set()
            await worker.wait_until(reported(jobs))
            worker.request_stop()
        assert await rig.apply(jobs) == jobs
    assert most == prefetch
    assert worker.stats.received == jobs


async def test_a_slow_handler_holds_back_neither_the_reports_nor_the_acks_of_others(
    rig: Rig,
) -> None:
    """The slow offer has the lowest delivery tag; the others are acknowledged
    past it (a multiple ack up to it would acknowledge it unreported, and
    waiting for it would stop the broker delivering past the prefetch)."""
    prefetch, quick = 3, 8
    app = WorkerApp(destinations=[rig.destination], prefetch=prefetch, check_current=False)
    release = anyio.Event()

    @app.handler("slow")
    async def slow(job: Job) -> None:
        await release.wait()

    @app.handler("quick")
    async def fast(job: Job) -> None:
        return None

    await rig.schedule("slow", "slow")
    for i in range(quick):
        await rig.schedule(f"quick-{i}", "quick")
    worker = rig.worker(app)
    with anyio.fail_after(30):
        offered = await rig.offer()
        assert offered[0].job_id == "slow"
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            # more quick offers than the prefetch leaves room for: each one
            # delivered after the first two proves an acknowledgement past "slow"
            await worker.wait_until(lambda s: s.outcomes.get("ok", 0) == quick)
            assert worker.stats.inflight == 1
            assert await rig.apply(quick) == quick
            tg.cancel_scope.cancel()  # killed while "slow" runs
        assert await rig.returned_count() == 1  # "slow" alone, never acknowledged, comes back
        assert (await rig.state("slow"))[0].state is JobState.OFFERED
        release.set()
        await run_until(rig.worker(app), reported(1))
        assert await rig.apply(1) == 1
    assert (await rig.state("slow"))[0].state is JobState.COMPLETED
    assert await rig.ready_count() == 0


async def test_the_apps_lifespan_is_open_for_every_handler_and_closed_after_the_stop(
    rig: Rig,
) -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        events.append("open")
        try:
            yield
        finally:
            events.append("closed")

    app = WorkerApp(destinations=[rig.destination], lifespan=lifespan)

    @app.handler()
    async def handle(job: Job) -> None:
        events.append(f"handled {job.job_id}")

    for job_id in ("l-1", "l-2"):
        await rig.schedule(job_id)
    with anyio.fail_after(15):
        await rig.offer()
        worker = rig.worker(app)
        await run_until(worker, reported(2))
        assert await rig.apply(2) == 2
    assert events[0] == "open"
    assert sorted(events[1:3]) == ["handled l-1", "handled l-2"]
    assert events[3:] == ["closed"]
