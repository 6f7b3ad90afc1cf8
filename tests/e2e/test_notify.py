"""The systemd notify protocol from a real ``pacerd run``: READY after start-up,
STATUS, WATCHDOG from tick progress (and none while a tick is stuck),
STOPPING on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING

import anyio
import asyncpg
import pytest

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


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


async def test_ready_status_watchdog_and_stopping(
    db_dsn: str, amqp_url: str, tmp_path: Path
) -> None:
    destination = f"notify-{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(db_dsn)
    await conn.execute(
        "SELECT pacerd.schedule($1 || g, 'k', $1, '{}'::jsonb) FROM generate_series(1, 50) g",
        destination,
    )
    config = tmp_path / "c.toml"
    config.write_text(
        f'[database]\ndsn = "{db_dsn}"\n[broker]\nurl = "{amqp_url}"\n'
        "publish_timeout_seconds = 1.0\n[pacing]\ntick_seconds = 0.2\n"
        "[daemon]\nshutdown_grace_seconds = 2.0\n"
    )
    notify = NotifySocket(tmp_path / "notify.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")}
    env |= {
        "NOTIFY_SOCKET": str(notify.path),
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
    }
    log = (tmp_path / "log").open("wb")
    process = subprocess.Popen(  # noqa: ASYNC220 - a daemon that outlives this call
        [sys.executable, "-m", "pacerd", "run", "-c", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        ready_at = await notify.wait_for("READY=1", within=30)
        await notify.wait_for("WATCHDOG=1", within=10)
        lines = notify.drain()
        assert lines.index("READY=1") < next(
            i for i, line in enumerate(lines) if line == "WATCHDOG=1"
        )
        assert any(line.startswith("STATUS=") for line in lines)
        assert all(at >= ready_at for at, line in notify.messages if line == "WATCHDOG=1")

        # Block the destination's tick: its per-tick state write waits on a row lock.
        blocker = await asyncpg.connect(db_dsn)
        transaction = blocker.transaction()
        await transaction.start()
        await blocker.execute(
            "SELECT 1 FROM pacerd.destinations WHERE destination = $1 FOR UPDATE", destination
        )
        # The loop is stuck; after 3 ticks + the publish timeout + 5 s the
        # watchdog must go quiet (the limit is 6.6 s here).
        await anyio.sleep(8)
        notify.drain()  # what was sent before the stall was noticed
        notify.messages.clear()
        await anyio.sleep(3)
        notify.drain()
        assert "WATCHDOG=1" not in [m for _, m in notify.messages], "watchdog while stuck"
        await transaction.rollback()
        await blocker.close()
        await notify.wait_for("WATCHDOG=1", within=10)

        process.send_signal(signal.SIGTERM)
        await notify.wait_for("STOPPING=1", within=10)
        with anyio.fail_after(20):
            while process.poll() is None:
                await anyio.sleep(0.05)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        notify.close()
        log.close()
        await conn.close()
