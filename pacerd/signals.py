"""Unix signals, turned into calls on the daemon, in the event loop.

Owns the mapping from signals to intents (docs/protocol.md, "Signals"):

    SIGTERM, SIGINT  first: request_stop()  (graceful: stop admitting, drain, exit 0)
                     again: force_stop()    (exit at once, releasing what it can)
    SIGHUP           reload()               (validate the config file, swap it in)
    SIGUSR1          pause_local()          (pause admission on this instance)
    SIGUSR2          resume_local()         (resume admission on this instance)

Signals are read by iterating ``anyio.open_signal_receiver``: nothing runs in
signal context. This module must not do the work itself (no draining, no config
parsing, no I/O): the target's methods are plain synchronous calls that set
events or flags for the daemon's tasks, and must return quickly.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Protocol

import anyio
import structlog

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

__all__ = ["HANDLED_SIGNALS", "SignalTarget", "handle_signals"]

_log = structlog.get_logger(__name__)

HANDLED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


class SignalTarget(Protocol):
    """What the daemon does on each signal; every method returns quickly."""

    def request_stop(self) -> None: ...

    def force_stop(self) -> None: ...

    def reload(self) -> None: ...

    def pause_local(self) -> None: ...

    def resume_local(self) -> None: ...


async def handle_signals(
    target: SignalTarget,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Dispatch signals to ``target`` until cancelled.

    ``task_status.started()`` is called once the receiver is open, so from then
    on the handled signals no longer have their default action (a SIGTERM sent
    after ``await tg.start(handle_signals, target)`` is seen here).
    """
    stop_requested = False
    with anyio.open_signal_receiver(*HANDLED_SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum in (signal.SIGTERM, signal.SIGINT):
                if stop_requested:
                    _log.warning("signal_received", signal=name, action="force_stop")
                    target.force_stop()
                else:
                    stop_requested = True
                    _log.info("signal_received", signal=name, action="request_stop")
                    target.request_stop()
            elif signum == signal.SIGHUP:
                _log.info("signal_received", signal=name, action="reload")
                target.reload()
            elif signum == signal.SIGUSR1:
                _log.info("signal_received", signal=name, action="pause_local")
                target.pause_local()
            elif signum == signal.SIGUSR2:
                _log.info("signal_received", signal=name, action="resume_local")
                target.resume_local()
