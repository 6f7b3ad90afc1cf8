"""The systemd notify protocol from a real ``pacerd run``: READY after start-up,
STATUS, WATCHDOG from tick progress (and none while a tick is stuck),
STOPPING on SIGTERM."""

from __future__ import annotations

import datetime as dt
import signal
import socket
import uuid
from typing import TYPE_CHECKING

import anyio
import asyncpg
import httpx
import pytest
from support.daemon import Daemon, free_port

from pacerd import heap

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]
SPAN = dt.timedelta(seconds=2)  # twice the watchdog's interval (no WATCHDOG_USEC: 1 s)


class NotifySocket:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[tuple[float, str]] = []

    def drain(self) -> list[str]:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return [m for _, m in self.messages]
            now = anyio.current_time()
            self.messages.extend((now, line) for line in data.decode().splitlines())

    async def wait_for(self, prefix: str, *, within: float) -> float:
        with anyio.fail_after(within):
            while True:
                self.drain()
                for at, line in self.messages:
                    if line.startswith(prefix):
                        return at
                await anyio.sleep(0.05)

    def close(self) -> None:
        self.sock.close()


async def livez(port: int) -> int:
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(f"http://127.0.0.1:{port}/livez")
    return response.status_code


async def test_ready_status_watchdog_and_stopping(
    db_dsn: str, amqp_url: str, tmp_path: Path
) -> None:
    destination = f"notify-{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(db_dsn)
    await conn.execute(
        "SELECT pacerd.schedule($1 || g, 'k', $1, '{}'::jsonb) FROM generate_series(1, 50) g",
        destination,
    )
    port = free_port()
    config = tmp_path / "c.toml"
    config.write_text(
        f'[database]\ndsn = "{db_dsn}"\n[broker]\nurl = "{amqp_url}"\n'
        "publish_timeout_seconds = 1.0\n[pacing]\ntick_seconds = 0.2\n"
        "[daemon]\nshutdown_grace_seconds = 2.0\n"
        f'[telemetry]\nlog_format = "json"\nlog_level = "debug"\n'
        f'http_address = "127.0.0.1:{port}"\n'
    )
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        with Daemon(config, tmp_path / "log", env={"NOTIFY_SOCKET": str(notify.path)}) as daemon:
            ready_at = await notify.wait_for("READY=1", within=30)
            # started, a `pacerd run` process freezes its start-up heap (pacerd.heap)
            settled = await daemon.wait_event("heap_settled", within=10)
            assert settled["frozen"] > 0
            assert settled["thresholds"][0] == heap.YOUNG_THRESHOLD
            await notify.wait_for("WATCHDOG=1", within=10)
            lines = notify.drain()
            assert lines.index("READY=1") < next(
                i for i, line in enumerate(lines) if line == "WATCHDOG=1"
            )
            assert any(line.startswith("STATUS=") for line in lines)
            assert all(at >= ready_at for at, line in notify.messages if line == "WATCHDOG=1")

            # The destination's loop ticks (the watchdog follows it), and is live.
            await daemon.wait_event("tick_completed", destination=destination, within=30)
            assert await livez(port) == 200
            # Block the destination's tick: its per-tick state write waits on a row lock.
            blocker = await asyncpg.connect(db_dsn)
            transaction = blocker.transaction()
            await transaction.start()
            await blocker.execute(
                "SELECT 1 FROM pacerd.destinations WHERE destination = $1 FOR UPDATE", destination
            )
            # Past its limit (3 ticks + the publish timeout + 5 s), the daemon finds
            # the loop stuck: /livez fails, on the test that gates WATCHDOG=1.
            with anyio.fail_after(60):
                while await livez(port) != 503:
                    await anyio.sleep(0.1)
            notify.drain()  # what was sent before the stall was noticed
            notify.messages.clear()
            # Two seconds of the daemon's own supervisor passes (each may send
            # WATCHDOG=1, at most once a second): once a later pass is logged, what
            # the earlier ones sent is in the socket, and none may be a watchdog.
            passes = daemon.events("supervisor_pass")
            assert passes, "the daemon logs no `supervisor_pass` record (docs/ha.md)"
            since = passes[-1]["at"]
            with anyio.fail_after(30):
                while not [e for e in daemon.events("supervisor_pass") if e["at"] >= since + SPAN]:
                    assert daemon.alive, daemon.text()[-3000:]
                    await anyio.sleep(0.05)
            notify.drain()
            assert "WATCHDOG=1" not in [m for _, m in notify.messages], "watchdog while stuck"
            await transaction.rollback()
            await blocker.close()
            await notify.wait_for("WATCHDOG=1", within=10)

            daemon.send(signal.SIGTERM)
            await notify.wait_for("STOPPING=1", within=10)
            assert await daemon.wait_exit(within=20) == 0
    finally:
        notify.close()
        await conn.close()
