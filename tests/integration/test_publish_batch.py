"""``publisher.write_batch``: a release slice written as one frame buffer on
aiormq's channel, its confirmations settled by the channel itself. Held to
the real broker case by case: large bodies, aiormq's tables left clean, other
publishes on the same channel, a timeout, a channel closed under the batch —
and, without a broker, the tags given back when the write never happens."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from collections import Counter
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiormq
import anyio
import anyio.lowlevel
import pytest
from support.proxy import FaultProxy

from pacerd.batching import SharedPublisher
from pacerd.errors import BrokerUnavailable, PublishTimeout
from pacerd.models import ClaimedJob
from pacerd.publisher import READY_EXCHANGE, Broker, ready_queue_name, write_batch


def _job(job_id: str, destination: str, payload: str = '{"n": 1}') -> ClaimedJob:
    return ClaimedJob(
        job_id=job_id, kind="k", destination=destination, attempt=1, revision=0,
        payload_json=payload, cursor_json=None,
        eligible_at=dt.datetime(2025, 1, 1, tzinfo=dt.UTC), live=False,
    )  # fmt: skip


async def _broker(amqp_url: str, *, publish_timeout: float = 10.0) -> tuple[Broker, str]:
    destination = f"batch-{uuid.uuid4().hex[:8]}"
    broker = Broker(url=amqp_url, publish_timeout_seconds=publish_timeout)
    await broker.connect()
    await broker.declare_destination(destination, ready_queue_name(destination))
    return broker, destination


async def _drain(amqp_url: str, destination: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(ready_queue_name(destination), ensure=False)
        got = []
        while (message := await queue.get(fail=False, no_ack=True)) is not None:
            got.append(message)
        await channel.queue_delete(ready_queue_name(destination))
        return got
    finally:
        await connection.close()


def _tables(broker: Broker) -> tuple[int, int]:
    underlay: Any = broker._underlay
    return len(underlay.confirmations), len(underlay.message_id_delivery_tag)


async def test_bodies_larger_than_a_frame_arrive_whole_and_the_tables_are_left_clean(
    amqp_url: str,
) -> None:
    broker, destination = await _broker(amqp_url)
    try:
        big = json.dumps({"blob": "x" * 300_000})  # over two frames of 128 KiB
        jobs = [_job(f"j{i}", destination, big if i % 2 else '{"n": 1}') for i in range(20)]
        jobs.append(_job("lost", "batch-nowhere"))  # returned: unroutable
        results = await broker.publish_many(jobs, [{}] * len(jobs))
        assert [r is None for r in results] == [True] * 20 + [False]
        await asyncio.sleep(0.1)  # the done callbacks run
        assert _tables(broker) == (0, 0)
        got = await _drain(amqp_url, destination)
        bodies = {m.message_id: json.loads(m.body) for m in got}
        assert len(bodies) == 20
        assert all(
            bodies[f"j{i}:1"]["payload"] == json.loads(jobs[i].payload_json) for i in range(20)
        )
    finally:
        await broker.close()


async def test_other_publishes_on_the_channel_keep_their_own_confirms(amqp_url: str) -> None:
    broker, destination = await _broker(amqp_url)
    try:
        batches = [[_job(f"b{b}-{i}", destination) for i in range(200)] for b in range(3)]

        async def raw(i: int) -> None:
            await broker.publish_raw(destination, b"{}", exchange=READY_EXCHANGE)

        results = await asyncio.gather(
            *(broker.publish_many(batch, [{}] * len(batch)) for batch in batches),
            *(raw(i) for i in range(50)),
        )
        assert all(r is None for batch in results[:3] for r in batch)  # type: ignore[union-attr]
        assert len(await _drain(amqp_url, destination)) == 3 * 200 + 50
        await asyncio.sleep(0.1)
        assert _tables(broker) == (0, 0)
    finally:
        await broker.close()


async def test_each_message_is_settled_once_however_the_broker_groups_its_acks(
    amqp_url: str,
) -> None:
    # Batches written at once are acknowledged in steps (acks with
    # ``multiple`` set, several in one read of the socket); unroutable
    # messages among them are returned before their ack, which moves their
    # entry in aiormq's table. Each message is settled exactly once.
    broker, destination = await _broker(amqp_url)
    try:
        underlay: Any = await broker._require_underlay()
        settled: Counter[int] = Counter()
        settle = underlay._confirm_delivery

        def counting(tag: int, frame: object) -> None:
            settled[tag] += 1
            settle(tag, frame)

        underlay._confirm_delivery = counting
        batches = [
            [_job(f"s{b}-{i}", "batch-nowhere" if i % 37 == 5 else destination) for i in range(100)]
            for b in range(20)
        ]
        results = await asyncio.gather(
            *(broker.publish_many(batch, [{}] * len(batch)) for batch in batches)
        )
        for batch, got in zip(batches, results, strict=True):
            for job, result in zip(batch, got, strict=True):
                assert (result is None) == (job.destination == destination), (job, result)
        await asyncio.sleep(0.1)  # the done callbacks run
        assert len(settled) == 2000
        assert max(settled.values()) == 1, settled.most_common(3)
        assert _tables(broker) == (0, 0)
        routable = sum(job.destination == destination for batch in batches for job in batch)
        assert len(await _drain(amqp_url, destination)) == routable
    finally:
        await broker.close()


async def test_a_timeout_fails_what_is_unconfirmed_and_the_channel_goes_on(amqp_url: str) -> None:
    broker, destination = await _broker(amqp_url, publish_timeout=1e-6)
    try:
        jobs = [_job(f"t{i}", destination) for i in range(300)]
        results = await broker.publish_many(jobs, [{}] * len(jobs))
        assert all(r is None or isinstance(r, PublishTimeout) for r in results)
        assert any(isinstance(r, PublishTimeout) for r in results)
        broker.publish_timeout_seconds = 10.0
        later = [_job(f"u{i}", destination) for i in range(100)]
        assert await broker.publish_many(later, [{}] * len(later)) == [None] * 100
        assert len(await _drain(amqp_url, destination)) == 400  # the broker took them all
    finally:
        await broker.close()


async def test_a_channel_closed_under_the_batch_fails_it_as_broker_unavailable(
    amqp_url: str,
) -> None:
    # The batch and the channel's close reach the broker back to back: the
    # proxy holds what the client writes until both are written, so the close
    # never waits behind a client descheduled on a busy machine (by then the
    # broker would have confirmed the whole batch).
    parts = urlsplit(amqp_url)
    async with FaultProxy(parts.port or 5672, target_host=parts.hostname or "127.0.0.1") as proxy:
        proxied = urlunsplit(parts._replace(netloc=f"{parts.username}:{parts.password}"
                                                   f"@127.0.0.1:{proxy.port}"))  # fmt: skip
        broker, destination = await _broker(proxied)
        try:
            jobs = [_job(f"c{i}", destination) for i in range(500)]
            proxy.stall(up=True, down=False)
            publishing = asyncio.ensure_future(broker.publish_many(jobs, [{}] * len(jobs)))
            await asyncio.sleep(0.05)  # the batch is written (held by the proxy)
            underlay: Any = broker._underlay
            closing = asyncio.ensure_future(underlay.close())
            await asyncio.sleep(0.05)  # the close is written behind it
            proxy.unstall()
            results = await asyncio.wait_for(publishing, 10)
            await asyncio.wait_for(closing, 10)
            assert all(r is None or isinstance(r, BrokerUnavailable) for r in results)
            assert any(isinstance(r, BrokerUnavailable) for r in results)
            await _drain(amqp_url, destination)
        finally:
            await broker.close()


class _BlockedChannel:
    """aiormq's channel as ``write_batch`` sees it, its frame queue full."""

    def __init__(self) -> None:
        self.max_content_size = 131_064
        self.delivery_tag = 41
        self.confirmations: dict[int, Any] = {}
        self.message_id_delivery_tag: dict[str, int] = {}
        self.number = 1
        self.write_queue: asyncio.Queue[object] = asyncio.Queue(maxsize=1)
        self.write_queue.put_nowait(object())
        self.lock = asyncio.Lock()
        self.publisher_confirms = True

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()


async def test_a_batch_cancelled_before_its_write_gives_its_tags_back() -> None:
    channel = _BlockedChannel()
    props = aiormq.spec.Basic.Properties(message_id="m:1", delivery_mode=2)
    writing = asyncio.ensure_future(write_batch(channel, [("x", "d", b"{}", props)] * 3))
    await asyncio.sleep(0.01)
    assert channel.delivery_tag == 44  # taken while waiting for room
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    await asyncio.sleep(0)
    assert (channel.delivery_tag, channel.confirmations, channel.message_id_delivery_tag) == (
        41,
        {},
        {},
    )


async def test_a_channel_without_confirms_is_refused() -> None:
    channel = _BlockedChannel()
    channel.publisher_confirms = False
    with pytest.raises(ValueError, match="confirm mode"):
        await write_batch(channel, [])


async def test_slices_released_together_are_written_once_and_confirmed_each(
    amqp_url: str,
) -> None:
    """``batching.SharedPublisher``: the release slices of many destinations
    that come in one round are one write; each slice gets its own results,
    and an unroutable message fails only its own slice. A caller cancelled
    once its slice is in the write leaves its confirms cancelled (aiormq's
    tables clean); its messages went out, as a slice cancelled while it
    awaited its confirms always did (the tick releases its jobs)."""
    broker, destination = await _broker(amqp_url)
    shared = SharedPublisher(broker)
    results: dict[int, list[Any]] = {}
    late = anyio.CancelScope()

    async def release(i: int) -> None:
        jobs = [_job(f"s{i}-{k}", destination) for k in range(3)]
        if i == 7:
            jobs.append(_job(f"s{i}-lost", "batch-nowhere"))
        results[i] = await shared.publish_many(jobs, [{}] * len(jobs))

    async def cancelled_release() -> None:
        with late:
            await shared.publish_many([_job("gone", destination)], [{}])
        results[-1] = []

    try:
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(release, i)
            tg.start_soon(cancelled_release)
            await anyio.lowlevel.checkpoint()  # every slice has asked
            late.cancel()  # delivered after the first slice's round: in the write
        assert shared.writes == 1
        assert all(results[i] == [None, None, None] for i in range(50) if i != 7)
        assert results[7][:3] == [None, None, None]
        assert results[7][3] is not None
        assert results[-1] == []  # cancelled
        await asyncio.sleep(0.1)  # the done callbacks run
        assert _tables(broker) == (0, 0)
        got = {m.message_id for m in await _drain(amqp_url, destination)}
        assert got == {f"s{i}-{k}:1" for i in range(50) for k in range(3)} | {"gone:1"}
    finally:
        await broker.close()


async def test_a_lone_slice_goes_out_at_once_and_the_first_caller_cancelled_still_writes_the_others(
    amqp_url: str,
) -> None:
    """The first slice of a round waits that round for the others; cancelled
    meanwhile, it is left out of the write (nothing of it is published) and
    the others still go."""
    broker, destination = await _broker(amqp_url)
    shared = SharedPublisher(broker)
    try:
        assert await shared.publish_many([_job("alone", destination)], [{}]) == [None]
        first = anyio.CancelScope()
        second: list[Any] = []

        async def leader() -> None:
            with first:
                await shared.publish_many([_job("first", destination)], [{}])

        async def follower() -> None:
            second.extend(await shared.publish_many([_job("second", destination)], [{}]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(leader)
            await anyio.lowlevel.checkpoint()
            tg.start_soon(follower)
            first.cancel()
        assert second == [None]
        assert shared.writes == 2
        got = {m.message_id for m in await _drain(amqp_url, destination)}
        assert got == {"alone:1", "second:1"}
    finally:
        await broker.close()
