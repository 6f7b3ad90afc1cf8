"""The demo's worker app against the model upstream over loopback HTTP: each
answer becomes the outcome the worker reports (200 → ok, 429 → refused with
its Retry-After in either form, 5xx or no answer → retry, other 4xx → fail),
every call of an app goes through one pooled client, open only while the
worker runs (the app's lifespan)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import anyio
import pytest

from pacerd.testing.upstream import CapacitySchedule, ModelUpstream, UpstreamParams
from pacerd.worker import Fail, Job, Refused, Retry
from pacerd_demo.app import (
    Answer,
    UpstreamClient,
    accepted,
    build_app,
    call_upstream,
    new_client,
    parse_retry_after,
)

DESTINATION = "llm"


def job(job_id: str = "job-1", destination: str = DESTINATION) -> Job:
    return Job(
        job_id=job_id, kind="call", destination=destination, attempt=1, revision=1,
        payload={"n": 1}, cursor=None, eligible_at=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    )  # fmt: skip


def upstream(schedule: str = "0:10000", **params: Any) -> ModelUpstream:
    return ModelUpstream(UpstreamParams(schedule=CapacitySchedule.parse(schedule), **params))


async def test_200_is_ok_with_the_token_use_and_the_idempotency_key_is_sent() -> None:
    async with upstream() as server, new_client(max_connections=1) as client:
        first = await call_upstream(client, server.url, job())
        again = await call_upstream(client, server.url, job())
    assert isinstance(first["tokens"], int)
    assert first == {"tokens": first["tokens"], "duplicate": False}
    assert again == {"tokens": first["tokens"], "duplicate": True}
    assert server.model.keys == {"job-1": 2}


@pytest.mark.parametrize(
    ("date", "low", "high"),
    [(False, 2.0, 2.0), (True, 1.0, 3.0)],  # an HTTP date has whole seconds
    ids=["delta-seconds", "http-date"],
)
async def test_429_is_refused_with_its_retry_after(date: bool, low: float, high: float) -> None:
    # half a call per second, a bucket of one: the second call waits 2 s for a token
    async with (
        upstream("0:0.5", retry_after=True, retry_after_date=date) as server,
        new_client(max_connections=1) as client,
    ):
        await call_upstream(client, server.url, job("first"))
        with pytest.raises(Refused) as refused:
            await call_upstream(client, server.url, job("second"))
    assert [status for _, status, _, _ in server.calls] == [200, 429]
    assert refused.value.retry_after_s is not None
    assert low <= refused.value.retry_after_s <= high


async def test_429_without_retry_after_is_refused_without_one() -> None:
    async with upstream("0:0") as server, new_client(max_connections=1) as client:
        with pytest.raises(Refused) as refused:
            await call_upstream(client, server.url, job())
    assert refused.value.retry_after_s is None


async def test_500_is_retried() -> None:
    async with upstream(error_rate=1.0) as server, new_client(max_connections=1) as client:
        with pytest.raises(Retry, match="HTTP 500"):
            await call_upstream(client, server.url, job())


async def test_no_answer_is_retried() -> None:
    async with upstream() as server:
        pass  # closed: its port refuses connections
    async with new_client(max_connections=1) as client:
        with pytest.raises(Retry, match="unreachable"):
            await call_upstream(client, server.url, job())


@pytest.mark.parametrize(
    ("status", "retry_after", "raised"),
    [
        (400, None, Fail),
        (404, None, Fail),
        (422, None, Fail),
        (503, None, Retry),
        (429, "soon", Refused),  # unreadable: refused, no Retry-After
    ],
)
def test_other_statuses(status: int, retry_after: str | None, raised: type[Exception]) -> None:
    """Statuses the model never answers a call with: the answer read as a call's."""
    with pytest.raises(raised) as caught:
        accepted(Answer(status, retry_after, b"no"))
    if isinstance(caught.value, Fail):
        assert caught.value.error == f"upstream answered HTTP {status}: b'no'"
    if isinstance(caught.value, Refused):
        assert caught.value.retry_after_s is None


def test_an_accepted_call_without_a_body_has_no_detail() -> None:
    assert accepted(Answer(204, None, b"")) == {}
    assert accepted(Answer(200, None, b'{"tokens": 3}')) == {"tokens": 3}


def test_retry_after_parses_seconds_and_http_dates() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert parse_retry_after(None) is None
    assert parse_retry_after("later") is None
    assert parse_retry_after("nan") is None


async def test_the_app_reuses_one_pooled_client_for_all_its_calls() -> None:
    prefetch = 4
    async with upstream() as server:
        app = build_app({DESTINATION: server.url}, prefetch=prefetch)
        handler = app.handler_for("call", DESTINATION)
        assert handler is not None
        assert app.lifespan is not None
        async with app.lifespan():  # as a worker runs the app
            for i in range(20):  # one after the other: one kept-alive connection
                await handler(job(f"seq-{i}"))
            assert server.connections == 1

            async def call(i: int) -> None:
                await handler(job(f"par-{i}"))

            async with anyio.create_task_group() as tg:  # 40 at once: <= `prefetch` connections
                for i in range(40):
                    tg.start_soon(call, i)
    assert server.stats()["accepted"] == 60
    assert server.connections <= prefetch


async def test_an_unknown_destination_fails() -> None:
    app = build_app({DESTINATION: "http://127.0.0.1:9"})
    handler = app.handler_for("call", "elsewhere")
    assert handler is not None
    with pytest.raises(Fail, match="no upstream configured"):
        await handler(job(destination="elsewhere"))


async def test_the_upstream_client_is_open_only_within_the_apps_lifespan() -> None:
    http = UpstreamClient(max_connections=2)
    with pytest.raises(RuntimeError, match="only while the worker runs"):
        _ = http.client
    async with upstream() as server:
        async with http.lifespan():
            client = http.client
            for i in range(3):
                await call_upstream(http.client, server.url, job(f"j{i}"))
            assert not client.closed
        assert server.connections == 1
    assert client.closed
    with pytest.raises(RuntimeError, match="only while the worker runs"):
        _ = http.client


async def test_the_call_timeout_is_the_apps_and_bounds_the_handler() -> None:
    # calls of 0.3 s: a timeout of 0.1 s retries them, one of 2 s lets them answer
    async with upstream(latency_median_ms=300.0, latency_sigma=0.01) as server:
        for timeout, expect_retry in ((0.1, True), (2.0, False)):
            app = build_app({DESTINATION: server.url}, call_timeout_seconds=timeout)
            assert app.handler_timeout_seconds == 20.0  # twice the call's, 20 s at least
            handler = app.handler_for("call", DESTINATION)
            assert handler is not None
            assert app.lifespan is not None
            async with app.lifespan():
                if expect_retry:
                    with pytest.raises(Retry, match=r"unreachable: .*Timeout"):
                        await handler(job("slow"))
                else:
                    answer = await handler(job("fast"))
                    assert isinstance(answer, dict)
                    assert answer["duplicate"] is False
    assert (
        build_app({DESTINATION: server.url}, call_timeout_seconds=30.0).handler_timeout_seconds
        == 60.0
    )
