"""``pacerd`` as a child process (``run``, or another verb such as ``worker``):
the one launcher of the end-to-end tests, the fault harness and the
benchmarks that drive real daemons.

    daemon = Daemon(config, tmp_path / "pacerd.log", name="a")
    await daemon.wait_event("pacerd_ready")
    daemon.send(signal.SIGTERM)
    assert await daemon.wait_exit(within=20) == 0

The child gets the environment without any ``PACERD_*`` setting (its config
file decides), with OpenTelemetry's exporters off, unbuffered output (a
kill -9 loses no line written so far) and ``env`` on top. Its stdout and
stderr go to ``log`` (appended to); with ``log_format = "json"`` that is one
record per line, read with ``events`` (``support.records``). The AMQP,
asyncio and asyncpg libraries' own debug output is turned down, so a daemon
run with ``log_level = "debug"`` logs pacerd's debug events without a line
per AMQP frame."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio

from support.records import records

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

__all__ = ["Daemon", "free_port", "utcnow"]

# `python -m pacerd`, with the libraries' debug loggers turned down first.
QUIET_PACERD = """
import logging, sys
for name in ("aiormq", "aio_pika", "asyncio", "asyncpg"):
    logging.getLogger(name).setLevel(logging.INFO)
from pacerd.cli import main
sys.exit(main())
"""


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def free_port() -> int:
    """A loopback port free now (for a daemon's ``http_address``)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")}
    for exporter in ("TRACES", "METRICS", "LOGS"):
        env[f"OTEL_{exporter}_EXPORTER"] = "none"
    env["PYTHONUNBUFFERED"] = "1"
    return env | dict(extra)


class Daemon:
    """One ``pacerd <command> -c config`` child process and its log."""

    def __init__(
        self,
        config: Path,
        log: Path,
        *,
        name: str = "pacerd",
        command: Sequence[str] = ("run",),
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
    ) -> None:
        self.name, self.config, self.log = name, config, log
        self.killed_at: dt.datetime | None = None  # when it was sent SIGKILL
        self.stopped = False  # sent SIGTERM or SIGINT
        argv = [sys.executable, "-c", QUIET_PACERD, *command, "-c", str(config)]
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=child_env(env or {}),
                start_new_session=new_session,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def killed(self) -> bool:
        return self.killed_at is not None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, event: str | None = None, **match: object) -> list[dict[str, Any]]:
        """Its JSON records (``event`` only, if given) whose fields equal ``match``;
        each with its ``timestamp`` parsed as ``at``."""
        out = []
        for record in records(self.text(), event):
            if all(record.get(k) == v for k, v in match.items()):
                if "timestamp" in record:
                    record["at"] = dt.datetime.fromisoformat(record["timestamp"])
                out.append(record)
        return out

    async def wait_events(
        self, event: str, n: int, *, within: float = 20, **match: object
    ) -> list[dict[str, Any]]:
        """Waits until ``n`` such records are logged; fails if it exits first."""
        with anyio.fail_after(within):
            while len(found := self.events(event, **match)) < n:
                assert self.alive, f"{self.name} exited: {self.text()[-3000:]}"
                await anyio.sleep(0.05)
        return found

    async def wait_event(
        self, event: str, *, within: float = 20, **match: object
    ) -> dict[str, Any]:
        """The first such record, once it is logged; fails if it exits first."""
        return (await self.wait_events(event, 1, within=within, **match))[0]

    def send(self, sig: signal.Signals) -> None:
        if self.alive:
            self.stopped = self.stopped or sig in (signal.SIGTERM, signal.SIGINT)
            self.process.send_signal(sig)

    def kill9(self) -> dt.datetime:
        """SIGKILL (when it still runs), reaped; returns when it was sent."""
        at = utcnow()
        if self.alive:
            self.killed_at = at
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        return at

    async def wait_exit(self, *, within: float) -> int:
        """Its exit status, once it exits (within ``within`` seconds)."""
        with anyio.fail_after(within):
            while self.process.poll() is None:
                await anyio.sleep(0.05)
        return self.process.returncode

    async def stop(self, *, grace: float) -> int:
        """SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds;
        its exit status (-9 when it had to be killed)."""
        self.send(signal.SIGTERM)
        try:
            return await self.wait_exit(within=grace)
        except TimeoutError:
            self.kill9()
            return self.process.returncode

    def close(self) -> None:
        """Kills it if it still runs (a test's clean-up)."""
        if self.alive:
            self.process.kill()
        self.process.wait()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
