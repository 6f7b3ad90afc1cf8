"""The cyclic garbage collector's settings for a long-running pacerd process.

CPython collects its youngest generation after 700 net allocations of
container objects, and a survivor of two collections moves to the oldest
generation; once the objects moved there since the last full collection
reach a quarter of what it holds, the next collection is a full one, which
walks the whole heap (imported modules included) with the event loop
stopped. A busy daemon allocates 700 containers in a millisecond or two, so
everything that lives a fraction of a second (a job in flight, its future,
its span, a destination's tick) is promoted. At 1,000 active destinations
that made about one full collection a second, 80-300 ms each: the tail of
the tick's planning time (``bench/RESULTS.md``, "The collector's pauses").

:func:`settle`, once a process has started, collects once and freezes what
survived (:func:`gc.freeze`: modules, configuration, connections, never
walked again), and collects the young generation after ``YOUNG_THRESHOLD``
net allocations: far fewer short-lived objects are promoted, and the oldest
generation stays small. A young collection walks about as many objects as
its threshold (10 ms at 20,000 on the benchmark's machine, 40 ms at
50,000), which bounds the pause it adds. Reference counting still frees at
once whatever is not in a cycle; cycles are still collected, less often.
Only the processes' entry points (``pacerd run``, ``pacerd worker``) settle:
an application embedding the worker library keeps its own settings.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, TypeVar

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable

T = TypeVar("T")

YOUNG_THRESHOLD = 20_000  # net container allocations between two young collections


def settle() -> None:
    """After start-up: collect once, freeze what survived, and raise the young
    generation's threshold (the older generations' stay as they are)."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)


async def settled(main: Awaitable[T], *, started: anyio.Event) -> T:
    """``pacerd run``: awaits ``main``, and :func:`settle` once ``started`` is
    set (the daemon is ready)."""
    async with anyio.create_task_group() as tg:

        async def settle_once_started() -> None:
            await started.wait()
            settle()

        tg.start_soon(settle_once_started)
        result = await main
        tg.cancel_scope.cancel()
    return result


class SettleOnStart:
    """A task status for a process's main task: :func:`settle` once it has
    started (``pacerd worker``: once it consumes)."""

    def started(self, value: object = None) -> None:
        settle()
