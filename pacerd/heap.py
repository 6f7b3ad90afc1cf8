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
Only the processes' entry points settle (``pacerd run`` through the
daemon's ``on_ready``, ``pacerd worker`` through :class:`SettleOnStart`):
an application embedding the worker library, or a daemon built in-process,
keeps its own settings. It logs ``heap_settled`` with what it froze.
"""

from __future__ import annotations

import gc

import structlog

log = structlog.get_logger("pacerd.heap")

YOUNG_THRESHOLD = 20_000  # net container allocations between two young collections


def settle() -> None:
    """After start-up: collect once, freeze what survived, and raise the young
    generation's threshold (the older generations' stay as they are)."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
    log.info("heap_settled", frozen=gc.get_freeze_count(), thresholds=list(gc.get_threshold()))


class SettleOnStart:
    """A task status for a process's main task: :func:`settle` once it has
    started (``pacerd worker``: once it consumes)."""

    def started(self, value: object = None) -> None:
        settle()
