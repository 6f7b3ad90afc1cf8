"""The worker's ``pacerd.is_current`` checks, batched.

Offers arrive in bursts (a prefetch's worth at a time): asked one query per
offer, the check cost a round trip and a pool acquisition each, queued behind
a two-connection pool. ``CurrentCheck`` gathers the checks asked while a
statement is on its way and sends them as the next one
(``Client.are_current``: ``pacerd.is_current`` over ``unnest``, so the worker
role needs no right but EXECUTE on the function), so the batches grow with the
database's round trip; a statement starts at least ``MIN_INTERVAL_SECONDS``
after the one before it (an idle worker's first check goes at once), so that a
busy worker's batches do not shrink to what arrives in one fast round trip:
each statement has a fixed cost in the worker and the database, whatever its
size. The check only saves a costly call: it fails open — with no database,
or when a statement fails, every offer it was asked about is current (the
handler runs; the ledger's attempt fencing still drops a stale report).
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import structlog

from pacerd.errors import LedgerError

if TYPE_CHECKING:
    from pacerd.client import Client
    from pacerd.clock import Clock

log = structlog.get_logger("pacerd.worker")

RECONNECT_SECONDS = 5.0  # after a failed connection, the checks fail open this long
MAX_BATCH = 1000  # offers per statement
# Between the starts of two statements (bench/RESULTS.md, worker library,
# 2026-12-02 afternoon: fewer, bigger statements, less CPU per offer in the
# worker and the database); it delays a busy worker's checks by at most this,
# next to a handler's seconds.
MIN_INTERVAL_SECONDS = 0.01


class CurrentCheck:
    """``pacerd.is_current`` for the offers of one worker, many per statement."""

    def __init__(self, dsn: str, clock: Clock, *, pool_size: int = 2) -> None:
        self.dsn, self.clock, self.pool_size = dsn, clock, pool_size
        self.statements = 0  # sent so far (tests read it)
        self._client: Client | None = None
        self._retry_at = -math.inf
        self._asked: list[tuple[str, int, asyncio.Future[bool]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._last_sent = -math.inf  # loop time the last statement started

    async def is_current(self, job_id: str, attempt: int) -> bool:
        """Whether the attempt still holds the job; True when it cannot be told."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._asked.append((job_id, attempt, future))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send())
        return await future

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        for *_, future in self._asked:
            future.cancel()
        self._asked = []
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def _send(self) -> None:
        try:
            await asyncio.sleep(0)  # the offers decoded in the same turn join the first
            loop = asyncio.get_running_loop()
            while self._asked:
                wait = self._last_sent + MIN_INTERVAL_SECONDS - loop.time()
                if wait > 0 and len(self._asked) < MAX_BATCH:
                    await asyncio.sleep(wait)  # the checks asked meanwhile join this one
                self._last_sent = loop.time()
                batch, self._asked = self._asked[:MAX_BATCH], self._asked[MAX_BATCH:]
                try:
                    answers = await self._answers([(j, a) for j, a, _ in batch])
                except BaseException as exc:  # a bug, or the worker stopping: the askers learn
                    for *_, future in batch:
                        if future.done():
                            continue
                        if isinstance(exc, Exception):
                            future.set_exception(exc)
                        else:
                            future.cancel()
                    raise
                for (*_, future), current in zip(batch, answers, strict=True):
                    if not future.done():  # (its delivery may have been abandoned meanwhile)
                        future.set_result(current)
        finally:
            self._sender = None

    async def _answers(self, offers: list[tuple[str, int]]) -> list[bool]:
        client = await self._connected()
        if client is None:
            return [True] * len(offers)
        try:
            self.statements += 1
            return await client.are_current(offers)
        except LedgerError as exc:
            log.warning("is_current_unavailable", error=str(exc), offers=len(offers))
            return [True] * len(offers)

    async def _connected(self) -> Client | None:
        if self._client is None and self.clock.monotonic() >= self._retry_at:
            from pacerd.client import Client

            try:
                # only is_current's SELECT: no session state to reset between statements
                self._client = await Client.connect(
                    self.dsn, max_size=self.pool_size, stateless=True
                )
            except LedgerError as exc:
                self._retry_at = self.clock.monotonic() + RECONNECT_SECONDS
                log.warning("is_current_unavailable", error=str(exc))
        return self._client
