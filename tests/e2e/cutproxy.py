"""A small asyncio TCP proxy for fault tests: it forwards, stalls (a network
partition as both ends see it: nothing gets through, no connection closes,
new connections hang), cuts (every connection is reset at once, as when the
far side's keepalives finally give up), refuses (new connections are reset
at once, as by a host whose service is down) and heals."""

from __future__ import annotations

import asyncio
import contextlib


class CutProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refusing = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def close(self) -> None:
        self.cut()
        self.heal()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def stall(self) -> None:
        """Stops forwarding in both directions (closes included); new
        connections are accepted but never reach the upstream."""
        self._flowing.clear()

    def cut(self) -> None:
        """Resets every connection (a stall goes on for new ones)."""
        for writer in list(self._writers):
            transport = writer.transport
            with contextlib.suppress(Exception):
                transport.abort()
        self._writers.clear()

    def refuse(self) -> None:
        """Resets new connections at once (until healed)."""
        self._refusing = True

    def heal(self) -> None:
        """Forwards again."""
        self._refusing = False
        self._flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        self._writers.add(writer)
        await self._flowing.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError:
            writer.transport.abort()
            return
        self._writers.add(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self._flowing.wait()
                if sink.transport.is_closing():
                    return
                sink.write(data)
                await sink.drain()
            await self._flowing.wait()
            if not sink.transport.is_closing():
                sink.close()
        except (ConnectionError, OSError):
            sink.transport.abort()
