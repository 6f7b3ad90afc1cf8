"""A no-op worker process for the benchmarks (started by ``common.start_worker``).

    python bench/noop_worker.py ack|report AMQP_URL QUEUE PREFETCH

``ack``: acknowledges every ready message (the consumer of "dispatch alone").
``report``: for each message publishes ``{"job_id", "attempt", "outcome": "ok"}``
to the ``pacerd.outcomes`` exchange with publisher confirms, then acknowledges
it (what a worker does, minus the work). Acks are batched with ``multiple``.
Prints ``consuming`` once ready; stops on SIGTERM and prints the count.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiormq
import uvloop


async def main(mode: str, url: str, queue: str, prefetch: int) -> None:
    connection = await aiormq.connect(url)
    consume = await connection.channel()
    await consume.basic_qos(prefetch_count=prefetch)
    publish = await connection.channel(publisher_confirms=True) if mode == "report" else None
    done = 0
    pending_tag = 0
    acked_tag = 0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
        nonlocal done, pending_tag
        if publish is not None:
            job = json.loads(message.body)
            body = json.dumps(
                {"job_id": job["job_id"], "attempt": job["attempt"], "outcome": "ok"}
            ).encode()
            await publish.basic_publish(
                body,
                exchange="pacerd.outcomes",
                properties=aiormq.spec.Basic.Properties(delivery_mode=2),
            )
        done += 1
        tag = message.delivery_tag or 0
        if tag > pending_tag:
            pending_tag = tag

    async def acker() -> None:
        # Acks with `multiple` every few ms: cheap for the worker, so it steals
        # as little CPU as possible from what is measured. (A benchmark
        # shortcut: a real worker acks each message after its own confirm.)
        nonlocal acked_tag
        while not stop.is_set():
            await asyncio.sleep(0.005)
            tag = pending_tag
            if tag > acked_tag:
                await consume.basic_ack(tag, multiple=True)
                acked_tag = tag

    await consume.basic_consume(queue, on_message)
    print("consuming", flush=True)
    task = asyncio.create_task(acker())
    await stop.wait()
    await task
    print(f"handled {done}", flush=True)
    await connection.close()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
