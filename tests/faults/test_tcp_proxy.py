"""The fault proxy itself, against a loopback echo server: forwarding, latency,
stalls, partitions, resets, refusals, close propagation, the client-chunk hook, loopback only."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import anyio
import pytest
from support.proxy import FaultProxy, is_loopback

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[tuple[int, list[asyncio.StreamWriter]]]:
    """Echoes every chunk; yields its port and its open server-side writers."""
    peers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer)
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], peers
    finally:
        server.close()
        for writer in peers:
            writer.close()


@contextlib.asynccontextmanager
async def proxied() -> AsyncIterator[tuple[FaultProxy, list[asyncio.StreamWriter]]]:
    async with echo_server() as (port, peers), FaultProxy(port) as proxy:
        yield proxy, peers


async def _roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> bytes:
    writer.write(data)
    await writer.drain()
    return await reader.readexactly(len(data))


async def test_forwards_both_ways_and_counts_bytes() -> None:
    async with proxied() as (proxy, _peers):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            assert await _roundtrip(reader, writer, b"hello" * 1000) == b"hello" * 1000
        writer.close()
        assert (proxy.stats.connections, proxy.stats.bytes_up, proxy.stats.bytes_down) == (
            1,
            5000,
            5000,
        )


async def test_latency_delays_each_direction_without_reordering() -> None:
    async with proxied() as (proxy, _peers):
        latency = 0.5
        proxy.latency_seconds = latency
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        started = time.monotonic()
        # Delayed there and back (a sleep never ends early); chunks in flight
        # together are delayed together, so five of them take well under the
        # ten latencies they would take one after the other.
        with anyio.fail_after(5 * 2 * latency):
            for i in range(5):
                writer.write(f"{i};".encode())
                await writer.drain()
                await asyncio.sleep(0)
            echoed = await reader.readexactly(10)
        assert echoed == b"0;1;2;3;4;"
        assert time.monotonic() - started >= 2 * latency
        writer.close()


async def test_stall_holds_data_until_unstall_then_delivers_it_in_order() -> None:
    async with proxied() as (proxy, _peers):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            assert await _roundtrip(reader, writer, b"before") == b"before"
        proxy.stall()
        writer.write(b"held-1;held-2")
        await writer.drain()
        with anyio.move_on_after(0.3) as scope:
            await reader.readexactly(1)
        assert scope.cancelled_caught, "data went through a stalled proxy"
        assert proxy.stalled
        assert proxy.stats.stalls == 1
        proxy.unstall()
        with anyio.fail_after(5):
            assert await reader.readexactly(13) == b"held-1;held-2"
        writer.close()


async def test_a_one_way_stall_holds_what_the_client_sends_only() -> None:
    async with echo_server() as (port, peers), FaultProxy(port) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            assert await _roundtrip(reader, writer, b"a") == b"a"
        proxy.stall(down=False)  # as a broker blocking a publisher
        peers[0].write(b"pushed")  # the service still reaches the client
        with anyio.fail_after(5):
            assert await reader.readexactly(6) == b"pushed"
        writer.write(b"held")
        await writer.drain()
        with anyio.move_on_after(0.3) as scope:
            await reader.readexactly(1)
        assert scope.cancelled_caught
        proxy.unstall()
        with anyio.fail_after(5):
            assert await reader.readexactly(4) == b"held"
        writer.close()


async def test_reset_aborts_every_connection_with_rst() -> None:
    async with proxied() as (proxy, _peers):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            await _roundtrip(reader, writer, b"x")
        assert proxy.active == 1
        assert proxy.reset() == 1
        with (
            anyio.fail_after(5),
            pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)),
        ):
            await reader.readexactly(1)
        assert proxy.active == 0
        assert proxy.stats.resets == 1
        # The proxy still serves new connections after a reset.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            assert await _roundtrip(reader, writer, b"again") == b"again"
        writer.close()


async def test_refuse_resets_new_connections_at_once() -> None:
    async with proxied() as (proxy, _peers):
        proxy.refuse = True
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"x")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        with (
            anyio.fail_after(5),
            pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)),
        ):
            await reader.readexactly(1)
        assert proxy.stats.refused == 1
        proxy.refuse = False
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            assert await _roundtrip(reader, writer, b"ok") == b"ok"
        writer.close()


async def test_a_closing_client_closes_the_service_side_even_while_stalled() -> None:
    async with proxied() as (proxy, peers):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            await _roundtrip(reader, writer, b"x")
        proxy.stall()
        writer.transport.abort()  # as a killed process's socket would
        with anyio.fail_after(5):
            while not peers[0].is_closing():
                await asyncio.sleep(0.02)
        assert proxy.active == 0


async def test_a_partition_hides_closes_and_holds_new_connections_until_reset() -> None:
    async with proxied() as (proxy, peers):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            await _roundtrip(reader, writer, b"x")
        proxy.partition()
        writer.transport.abort()  # the client dies; the service must not see it
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        late_writer.write(b"late")
        await late_writer.drain()
        with anyio.move_on_after(0.3):
            while not peers[0].is_closing():
                await asyncio.sleep(0.02)
        assert not peers[0].is_closing(), "a close went through a partition"
        assert len(peers) == 1, "a new connection reached the service through a partition"
        # A reset ends what the partition held, as the server's keepalives would.
        proxy.reset()
        with anyio.fail_after(5):
            while not peers[0].is_closing():
                await asyncio.sleep(0.02)
            with contextlib.suppress(ConnectionError):
                assert await late_reader.read(10) == b""
        assert len(peers) == 1
        proxy.heal()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with anyio.fail_after(5):
            assert await _roundtrip(reader, writer, b"healed") == b"healed"
        writer.close()


async def test_the_hook_sees_client_chunks_before_they_are_forwarded() -> None:
    seen: list[bytes] = []
    async with echo_server() as (port, _peers):

        async def hook(chunk: bytes) -> None:
            seen.append(chunk)
            if b"stop" in chunk:
                proxy.stall()

        async with FaultProxy(port, on_client_chunk=hook) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            with anyio.fail_after(5):
                assert await _roundtrip(reader, writer, b"go") == b"go"
            writer.write(b"stop")
            await writer.drain()
            with anyio.move_on_after(0.3) as scope:
                await reader.readexactly(4)
            assert scope.cancelled_caught, "the chunk that triggered the stall went through"
            proxy.unstall()
            with anyio.fail_after(5):
                assert await reader.readexactly(4) == b"stop"
            writer.close()
    assert seen == [b"go", b"stop"]


def test_loopback_only() -> None:
    assert is_loopback("127.0.0.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")
    with pytest.raises(ValueError, match="loopback only"):
        FaultProxy(5432, target_host="10.1.2.3")
    with pytest.raises(ValueError, match="loopback only"):
        FaultProxy(5432, listen_host="0.0.0.0")
