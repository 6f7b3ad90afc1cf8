"""sd_notify through a fake NOTIFY_SOCKET: a unix datagram socket we read back."""

from __future__ import annotations

import os
import socket
import uuid
from typing import TYPE_CHECKING

import pytest

from pacerd.sdnotify import Notifier, watchdog_interval_seconds

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


class FakeManager:
    """Stands in for systemd: receives the notify datagrams."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(2.0)

    def receive(self) -> str:
        return self.sock.recv(4096).decode()

    def pending(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(4096)
        except BlockingIOError:
            return False
        finally:
            self.sock.settimeout(2.0)
        return True


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[FakeManager, str]]:
    path = str(tmp_path / "notify.sock")
    fake = FakeManager(path)
    yield fake, path
    fake.sock.close()


def test_messages_arrive_in_order(manager: tuple[FakeManager, str]) -> None:
    fake, path = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": path}, monotonic=lambda: 12.5)
    assert notifier.enabled
    assert notifier.ready("1 destination, rate 2.0/s")
    assert notifier.status("mail: rate 2.0/s due 10 oldest 3s\nsecond line")
    assert notifier.watchdog()
    assert notifier.reloading()
    assert notifier.ready()
    assert notifier.stopping("draining")
    notifier.close()
    assert [fake.receive() for _ in range(6)] == [
        "READY=1\nSTATUS=1 destination, rate 2.0/s",
        "STATUS=mail: rate 2.0/s due 10 oldest 3s second line",
        "WATCHDOG=1",
        "RELOADING=1\nMONOTONIC_USEC=12500000",
        "READY=1",
        "STOPPING=1\nSTATUS=draining",
    ]
    assert not fake.pending()


def test_abstract_socket() -> None:
    name = f"pacerd-test-{uuid.uuid4().hex}"
    fake = FakeManager("\0" + name)
    try:
        notifier = Notifier(f"@{name}")
        assert notifier.watchdog()
        assert fake.receive() == "WATCHDOG=1"
        notifier.close()
    finally:
        fake.sock.close()


def test_without_notify_socket_everything_is_a_no_op() -> None:
    notifier = Notifier.from_environment({})
    assert not notifier.enabled
    assert not notifier.ready("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()


def test_unreachable_socket_is_swallowed(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert notifier.enabled
    assert not notifier.ready()  # logged once, never raised
    assert not notifier.watchdog()
    notifier.close()


def test_relative_or_unsupported_socket_is_disabled() -> None:
    assert not Notifier("vsock:2:1234").enabled


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "OURS"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "OTHER"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], expected: float | None) -> None:
    pids = {"OURS": str(os.getpid()), "OTHER": str(os.getpid() + 1)}
    env = {k: pids.get(v, v) for k, v in environ.items()}
    assert watchdog_interval_seconds(env) == expected


def test_watchdog_interval_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_seconds() == 1.0
