"""A no-op worker process for the benchmarks (started by ``common.start_worker``).

    python bench/noop_worker.py ack|report AMQP_URL QUEUE PREFETCH

Takes what the broker has delivered as one batch (up to the prefetch), then:

``ack``: acknowledges the batch (the consumer of "dispatch alone").
``report``: publishes one ``{"job_id", "attempt", "outcome": "ok"}`` message
per job to the ``pacerd.outcomes`` exchange — persistent, ``mandatory``, the
batch written as one frame buffer (``pacerd.publisher.write_batch``) — awaits
every publisher confirm, then acknowledges the batch (what an at-least-once
worker does, minus the work). One acknowledgement (``multiple``) per batch.
Prints ``consuming`` once ready; stops on SIGTERM and prints the count.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiormq
import uvloop
from pamqp.commands import Basic

from pacerd.models import Outcome, Report
from pacerd.protocol import outcome_body
from pacerd.publisher import OUTCOMES_EXCHANGE, write_batch


def outcome_message(body: bytes) -> tuple[str, str, bytes, aiormq.spec.Basic.Properties]:
    job = json.loads(body)
    report = Report(job_id=job["job_id"], attempt=job["attempt"], outcome=Outcome.OK)
    properties = aiormq.spec.Basic.Properties(
        delivery_mode=2, message_id=f"{job['job_id']}:{job['attempt']}:ok"
    )
    return OUTCOMES_EXCHANGE, "", outcome_body(report), properties


async def main(mode: str, url: str, queue: str, prefetch: int) -> None:
    connection = await aiormq.connect(url)
    consume = await connection.channel()
    await consume.basic_qos(prefetch_count=prefetch)
    publish = await connection.channel(publisher_confirms=True) if mode == "report" else None
    inbox: asyncio.Queue[aiormq.abc.DeliveredMessage] = asyncio.Queue()
    done = 0

    async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
        inbox.put_nowait(message)

    async def handle() -> None:
        nonlocal done
        while True:
            batch = [await inbox.get()]
            while not inbox.empty():
                batch.append(inbox.get_nowait())
            if publish is not None:
                confirms = await write_batch(publish, [outcome_message(m.body) for m in batch])
                for confirm in await asyncio.gather(*confirms):
                    if not isinstance(confirm, Basic.Ack):
                        raise RuntimeError(f"outcome not confirmed: {confirm!r}")
            await consume.basic_ack(max(m.delivery_tag or 0 for m in batch), multiple=True)
            done += len(batch)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await consume.basic_consume(queue, on_message)
    print("consuming", flush=True)
    handler = asyncio.create_task(handle())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([handler, stopping], return_when=asyncio.FIRST_COMPLETED)
    if handler.done():
        handler.result()  # a failure ends the worker, loudly
    handler.cancel()
    await asyncio.gather(handler, return_exceptions=True)
    print(f"handled {done}", flush=True)
    await connection.close()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
