"""The tests' TCP fault proxy, loopback only (the fault-injection suite, the
high-availability tests and the fault benchmark all use this one).

One ``FaultProxy`` listens on a loopback port and forwards every connection to
one loopback service (PostgreSQL, RabbitMQ). Between the two it can inject the
network trouble a daemon must survive, without Docker or toxiproxy:

- ``latency_seconds``: every chunk is delivered that much later, in each
  direction, order and throughput kept (a chunk is timestamped on arrival);
- ``stall()`` / ``unstall()``: nothing is delivered (data is held, up to a
  bound, then the sender is back-pressured), as on a frozen path;
  ``stall(down=False)`` holds only what the client sends, as a broker that
  blocks a publishing connection does (it stops reading from it);
  ``unstall()`` delivers what was held, in order;
- ``partition()`` / ``heal()``: a network partition as both ends see it: a
  stall in both directions that also hides closes (a side that closes or dies
  is not seen by the other until the partition heals or ``reset()``) and
  holds new connections before they reach the service;
- ``reset()``: every open connection is aborted with a TCP RST on both sides
  (as when the far side's keepalives give up); a partition goes on;
- ``refuse``: new connections are accepted and reset at once (a service that
  is down);
- ``on_client_chunk``: an async hook awaited before each client→service chunk
  is forwarded (a trigger: "stall the ledger right after this publish").

Outside a partition, a side that closes (EOF, RST, a killed process) closes
the other side at once, stalled or not, so a killed client's server session ends (and its locks are
released) as it would without the proxy. The proxy only binds and connects to
loopback addresses.

    async with FaultProxy(5432) as proxy:
        dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/db"
        proxy.stall(); ...; proxy.unstall(); proxy.reset()
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["FaultProxy", "ProxyStats", "is_loopback"]

CHUNK_BYTES = 64 * 1024
HELD_CHUNKS = 256  # per direction, while stalled: then the sender is back-pressured


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(slots=True)
class ProxyStats:
    connections: int = 0  # accepted, in all
    refused: int = 0  # reset at once because ``refuse`` was set
    resets: int = 0  # connections aborted by ``reset()``
    bytes_up: int = 0  # client -> service
    bytes_down: int = 0  # service -> client
    stalls: int = 0


@dataclass(eq=False, slots=True)
class _Link:
    """One proxied connection: the client's and the service's streams."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closed: bool = False


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """A TCP proxy from ``listen_host:listen_port`` to ``target_host:target_port``."""

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        on_client_chunk: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> None:
        for host in (target_host, listen_host):
            if not is_loopback(host):
                raise ValueError(f"the fault proxy is loopback only, got {host!r}")
        self.target_host, self.target_port = target_host, target_port
        self.listen_host, self._port = listen_host, listen_port
        self.on_client_chunk = on_client_chunk
        self.latency_seconds = 0.0
        self.refuse = False
        self.stats = ProxyStats()
        self._up, self._down = asyncio.Event(), asyncio.Event()
        self._up.set()
        self._down.set()
        self._links: set[_Link] = set()
        self._healed = asyncio.Event()  # cleared while partitioned
        self._healed.set()
        self._held: set[asyncio.StreamWriter] = set()  # accepted during a partition
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def stalled(self) -> bool:
        return not (self._up.is_set() and self._down.is_set())

    @property
    def active(self) -> int:
        """Connections open through the proxy now."""
        return len(self._links)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self._port)
        self._port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.heal()
        for link in list(self._links):
            self._teardown(link, rst=False)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- faults ------------------------------------------------------------------

    def stall(self, *, up: bool = True, down: bool = True) -> None:
        """Stop delivering client→service (``up``) and service→client (``down``)
        data; connections stay open."""
        if not self.stalled:
            self.stats.stalls += 1
        if up:
            self._up.clear()
        if down:
            self._down.clear()

    def unstall(self) -> None:
        """Deliver what was held, and everything after it."""
        self._up.set()
        self._down.set()

    @property
    def partitioned(self) -> bool:
        return not self._healed.is_set()

    def partition(self) -> None:
        """Nothing gets through, no close is seen, new connections hang."""
        self.stall()
        self._healed.clear()

    def heal(self) -> None:
        """Ends a partition, a stall and refusing: forwards again."""
        self.refuse = False
        self._healed.set()
        self.unstall()

    def reset(self) -> int:
        """Aborts every open connection (and every connection held by a
        partition) with a TCP RST on both sides; returns how many."""
        links = list(self._links)
        for link in links:
            self._teardown(link, rst=True)
        for writer in list(self._held):
            _abort_with_rst(writer)
        self._held.clear()
        self.stats.resets += len(links)
        return len(links)

    # -- forwarding ----------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self.refuse:
            self.stats.refused += 1
            _abort_with_rst(writer)
            return
        if self.partitioned:
            self._held.add(writer)
            await self._healed.wait()
            if writer not in self._held:  # reset meanwhile
                return
            self._held.discard(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _abort_with_rst(writer)
            return
        link = _Link(client=writer, server=up_writer)
        self._links.add(link)
        link.tasks = [
            asyncio.create_task(self._pump(link, reader, up_writer, upstream=True)),
            asyncio.create_task(self._pump(link, up_reader, writer, upstream=False)),
        ]

    async def _pump(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        upstream: bool,
    ) -> None:
        """Reads one direction into a queue; a second task delivers it on time."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(HELD_CHUNKS)
        deliver = asyncio.create_task(self._deliver(link, queue, writer, upstream=upstream))
        try:
            failed = False
            try:
                while True:
                    chunk = await reader.read(CHUNK_BYTES)
                    if not chunk:
                        break
                    if upstream and self.on_client_chunk is not None:
                        await self.on_client_chunk(chunk)
                    await queue.put((time.monotonic() + self.latency_seconds, chunk))
            except (ConnectionError, OSError, asyncio.IncompleteReadError):
                failed = True
            if self.partitioned:
                await self._healed.wait()  # a partition hides the close from the other side
            if not failed and not self.stalled:
                await queue.join()  # a clean close: deliver what is in flight first
        except (ConnectionError, OSError):
            pass
        finally:
            deliver.cancel()
            self._teardown(link, rst=False)

    async def _deliver(
        self,
        link: _Link,
        queue: asyncio.Queue[tuple[float, bytes]],
        writer: asyncio.StreamWriter,
        *,
        upstream: bool,
    ) -> None:
        flowing = self._up if upstream else self._down
        try:
            while True:
                due, chunk = await queue.get()
                await flowing.wait()
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await flowing.wait()
                writer.write(chunk)
                await writer.drain()
                if upstream:
                    self.stats.bytes_up += len(chunk)
                else:
                    self.stats.bytes_down += len(chunk)
                queue.task_done()
        except (ConnectionError, OSError):
            self._teardown(link, rst=False)

    def _teardown(self, link: _Link, *, rst: bool) -> None:
        if link.closed:
            return
        link.closed = True
        self._links.discard(link)
        for writer in (link.client, link.server):
            if rst:
                _abort_with_rst(writer)
            else:
                writer.transport.abort() if self.stalled else writer.close()
        for task in link.tasks:
            if task is not asyncio.current_task():
                task.cancel()
