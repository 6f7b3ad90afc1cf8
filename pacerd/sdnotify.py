"""The systemd notify protocol (``sd_notify(3)``), built in: no dependency.

Owns the datagram socket named by ``NOTIFY_SOCKET`` (a path, or ``@name`` for an
abstract socket) and the handful of messages pacerd sends: ``READY=1``,
``STATUS=``, ``WATCHDOG=1``, ``RELOADING=1`` (with ``MONOTONIC_USEC``) and
``STOPPING=1``; and reading the watchdog interval from ``WATCHDOG_USEC`` /
``WATCHDOG_PID``.

It must not decide *when* to send anything: ``daemon.py`` sends READY once every
service has started, and WATCHDOG from tick progress (never from a timer of its
own, so a stuck loop is noticed). It must never block or raise: the socket is
non-blocking, a message that cannot be sent is dropped, and the first failure is
logged once. Without ``NOTIFY_SOCKET`` (not under systemd) every method is a
no-op. Monotonic time is injected (``pacerd.clock`` is the only clock reader).
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import structlog

from pacerd.clock import SystemClock

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = ["Notifier", "watchdog_interval_seconds"]

_log = structlog.get_logger(__name__)


def _socket_address(value: str) -> str | None:
    """``NOTIFY_SOCKET`` as an address for ``sendto``; ``@name`` is abstract."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # vsock and other transports are not supported


def _one_line(text: str) -> str:
    """A field value is one line: newlines would start a new assignment."""
    return " ".join(text.splitlines()).strip()


class Notifier:
    """Sends notifications to the service manager, when there is one.

    Build it with ``Notifier.from_environment()``. ``monotonic`` returns
    CLOCK_MONOTONIC seconds (``SystemClock().monotonic`` by default); it is read
    only for ``RELOADING=1``, which systemd wants stamped with ``MONOTONIC_USEC``.
    """

    def __init__(
        self,
        notify_socket: str | None,
        *,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self._address = _socket_address(notify_socket or "")
        if notify_socket and self._address is None:
            _log.warning("sd_notify_socket_unsupported", notify_socket=notify_socket)
        self._monotonic = monotonic or SystemClock().monotonic
        self._sock: socket.socket | None = None
        self._failed_once = False

    @classmethod
    def from_environment(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        monotonic: Callable[[], float] | None = None,
    ) -> Notifier:
        env = os.environ if environ is None else environ
        return cls(env.get("NOTIFY_SOCKET"), monotonic=monotonic)

    @property
    def enabled(self) -> bool:
        """True when a notify socket was given (pacerd runs under systemd)."""
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` lines as one datagram; True when it was sent."""
        if self._address is None or not assignments:
            return False
        message = "\n".join(assignments).encode("utf-8")
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(message, self._address)
        except OSError as exc:  # includes BlockingIOError: a full queue drops the message
            if not self._failed_once:
                self._failed_once = True
                _log.warning(
                    "sd_notify_failed",
                    error=f"{type(exc).__name__}: {exc}",
                    message=assignments[0],
                )
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up (or a reload) is complete."""
        fields = ["READY=1"]
        if status is not None:
            fields.append(f"STATUS={_one_line(status)}")
        return self.notify(*fields)

    def status(self, text: str) -> bool:
        """``STATUS=``: the one-line summary ``systemctl status`` shows."""
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the tick loop made progress."""
        return self.notify("WATCHDOG=1")

    def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1`` stamped with ``MONOTONIC_USEC``; send ``ready()`` after."""
        usec = int(self._monotonic() * 1_000_000)
        fields = ["RELOADING=1", f"MONOTONIC_USEC={usec}"]
        if status is not None:
            fields.append(f"STATUS={_one_line(status)}")
        return self.notify(*fields)

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: graceful shutdown has begun."""
        fields = ["STOPPING=1"]
        if status is not None:
            fields.append(f"STATUS={_one_line(status)}")
        return self.notify(*fields)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_seconds(
    environ: Mapping[str, str] | None = None,
    *,
    pid: int | None = None,
) -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``WATCHDOG_USEC``, in seconds.

    None when the watchdog is off, the value is invalid, or ``WATCHDOG_PID``
    names another process (the variables were inherited, not meant for us).
    """
    env = os.environ if environ is None else environ
    raw_usec = env.get("WATCHDOG_USEC", "").strip()
    if not raw_usec:
        return None
    raw_pid = env.get("WATCHDOG_PID", "").strip()
    if raw_pid:
        try:
            if int(raw_pid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    try:
        usec = int(raw_usec)
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 2_000_000
