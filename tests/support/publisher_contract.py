"""What admission relies on from its publisher (``publisher.Publisher``): one
body of cases, run against every implementation. A test module subclasses
``PublisherContract`` and gives a ``driver`` fixture: the publisher under
test, with one destination declared (``routed``) and one declared whose
queue refuses every message (``refusing``: the broker nacks them)."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Protocol

import pytest

from pacerd.admission import rejection_reason
from pacerd.errors import PublishError, PublishRejected
from pacerd.models import ClaimedJob

if TYPE_CHECKING:
    from pacerd.publisher import Publisher

UNROUTABLE = "contract-nowhere"  # no queue is ever bound for it


class PublisherDriver(Protocol):
    @property
    def publisher(self) -> Publisher: ...

    @property
    def routed(self) -> str: ...

    @property
    def refusing(self) -> str: ...


def job(job_id: str, destination: str) -> ClaimedJob:
    return ClaimedJob(
        job_id=job_id, kind="k", destination=destination, attempt=1, revision=0,
        payload_json='{"n": 1}', cursor_json=None,
        eligible_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), live=False,
    )  # fmt: skip


def reason(error: PublishError | None) -> str | None:
    """None for a confirm, else how admission counts the refusal."""
    if error is None:
        return None
    assert isinstance(error, PublishRejected), repr(error)
    return rejection_reason(error)


class PublisherContract:
    async def test_confirmed_publishes_return_no_error(self, driver: PublisherDriver) -> None:
        jobs = [job(f"ok{i}", driver.routed) for i in range(3)]
        assert await driver.publisher.publish_many(jobs, [{}] * 3) == [None] * 3
        await driver.publisher.publish(job("ok3", driver.routed), {"traceparent": "x"})

    async def test_an_unroutable_publish_is_returned(self, driver: PublisherDriver) -> None:
        (error,) = await driver.publisher.publish_many([job("lost", UNROUTABLE)], [{}])
        assert reason(error) == "returned"
        with pytest.raises(PublishRejected, match=r"^unroutable"):
            await driver.publisher.publish(job("lost2", UNROUTABLE), {})

    async def test_a_refused_publish_is_nacked(self, driver: PublisherDriver) -> None:
        (error,) = await driver.publisher.publish_many([job("no", driver.refusing)], [{}])
        assert reason(error) == "nacked"
        with pytest.raises(PublishRejected) as raised:
            await driver.publisher.publish(job("no2", driver.refusing), {})
        assert rejection_reason(raised.value) == "nacked"

    async def test_publish_many_answers_each_job_in_order(self, driver: PublisherDriver) -> None:
        destinations = [driver.routed, UNROUTABLE, driver.routed, driver.refusing, driver.routed]
        jobs = [job(f"mix{i}", d) for i, d in enumerate(destinations)]
        results = await driver.publisher.publish_many(jobs, [{}] * len(jobs))
        assert [reason(r) for r in results] == [None, "returned", None, "nacked", None]

    async def test_nothing_to_publish_is_an_empty_answer(self, driver: PublisherDriver) -> None:
        assert await driver.publisher.publish_many([], []) == []
