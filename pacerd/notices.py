"""Notices from the ledger: a destination paused, resumed or cooling down,
heard as it commits rather than at the next tick.

The ledger notifies the channel ``pacerd_control`` (migration 0006) whenever
a destination's pause or cool-down changes, and when every destination is
paused or resumed; the payload is ``open NAME`` or ``closed NAME``, with
``*`` for every destination. One session per instance listens
(application_name ``pacerd:notices``) and hands each notice to the tick loop,
which reopens a resumed destination at once and has its release slices look
at the closed destinations again.

Every tick reads its destination's state whatever the notices say. While
the session listens (``connected``), the release slices trust their
snapshot of the closed destinations until a notice comes, reading it again
at least once a second should the session have died without a word; while
it does not, they poll the snapshot every few milliseconds
(``batching.ClosedSnapshot``). The session is opened again after a loss,
with a backoff, and everything is read again once it listens.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
import structlog

from pacerd.errors import PacerdError
from pacerd.ledger import translate_errors

if TYPE_CHECKING:
    from collections.abc import Callable

    from pacerd.clock import Clock

log = structlog.get_logger("pacerd.notices")

CHANNEL = "pacerd_control"
APPLICATION_NAME = "pacerd:notices"
RETRY_MIN_SECONDS = 0.5
RETRY_MAX_SECONDS = 10.0
# A cut network ends the session within about idle + interval * count seconds.
KEEPALIVE = {
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "1",
    "tcp_keepalives_count": "5",
}

Notice = tuple[bool, str | None]
"""(open, destination): ``open`` False when it closed; ``None``: every destination."""


def parse(payload: str) -> Notice | None:
    """``open NAME`` / ``closed NAME`` / ``... *``; None for anything else."""
    kind, _, name = payload.partition(" ")
    if kind not in ("open", "closed") or not name:
        return None
    return kind == "open", None if name == "*" else name


def _set(event: anyio.Event, _conn: object) -> None:
    event.set()


class ControlNotices:
    """The listening session; ``run`` keeps it open until cancelled."""

    def __init__(
        self, dsn: str, *, clock: Clock, on_notice: Callable[[Notice], None] | None = None
    ) -> None:
        self.dsn = dsn
        self.clock = clock
        self.on_notice = on_notice
        self.connected = False
        self.received = 0

    def _deliver(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        notice = parse(payload) if isinstance(payload, str) else None
        if notice is None:
            log.warning("notice_unreadable", payload=str(payload)[:200])
            return
        self.received += 1
        if self.on_notice is not None:
            self.on_notice(notice)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        backoff = RETRY_MIN_SECONDS
        while True:
            lost = anyio.Event()
            conn: asyncpg.Connection | None = None
            try:
                with translate_errors():
                    conn = await asyncpg.connect(
                        self.dsn, timeout=10,
                        server_settings={"application_name": APPLICATION_NAME, **KEEPALIVE},
                    )  # fmt: skip
                    conn.add_termination_listener(partial(_set, lost))
                    await conn.add_listener(CHANNEL, self._deliver)
                self.connected, backoff = True, RETRY_MIN_SECONDS
                log.debug("notices_listening", channel=CHANNEL)
                if self.on_notice is not None:
                    # whatever changed while nobody listened is read again
                    self.on_notice((False, None))
                await lost.wait()
                log.warning("notices_lost")
            except PacerdError as exc:
                log.warning("notices_unavailable", error=str(exc), retry_seconds=backoff)
            finally:
                self.connected = False
                if conn is not None:
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await conn.close(timeout=2)
            await self.clock.sleep(backoff)
            backoff = min(RETRY_MAX_SECONDS, 2 * backoff)
