"""Signals reach the daemon's target through the event loop.

The signals are real (``os.kill`` of this process) but only while the receiver
is open, so SIGTERM and SIGINT are caught by it and never reach the runner.
"""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from pacerd.signals import handle_signals


class RecordingTarget:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.changed = anyio.Event()

    def _record(self, name: str) -> None:
        self.calls.append(name)
        self.changed.set()
        self.changed = anyio.Event()

    def request_stop(self) -> None:
        self._record("request_stop")

    def force_stop(self) -> None:
        self._record("force_stop")

    def reload(self) -> None:
        self._record("reload")

    def pause_local(self) -> None:
        self._record("pause_local")

    def resume_local(self) -> None:
        self._record("resume_local")


async def _send_and_wait(target: RecordingTarget, signum: signal.Signals, count: int) -> None:
    os.kill(os.getpid(), signum)
    with anyio.fail_after(5):
        while len(target.calls) < count:
            await target.changed.wait()


@pytest.mark.parametrize(
    ("signum", "call"),
    [
        (signal.SIGHUP, "reload"),
        (signal.SIGUSR1, "pause_local"),
        (signal.SIGUSR2, "resume_local"),
    ],
)
async def test_signal_calls_target(signum: signal.Signals, call: str) -> None:
    target = RecordingTarget()
    async with anyio.create_task_group() as tg:
        await tg.start(handle_signals, target)
        await _send_and_wait(target, signum, 1)
        tg.cancel_scope.cancel()
    assert target.calls == [call]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_first_stop_signal_is_graceful_the_second_forces(signum: signal.Signals) -> None:
    target = RecordingTarget()
    async with anyio.create_task_group() as tg:
        await tg.start(handle_signals, target)
        await _send_and_wait(target, signum, 1)
        await _send_and_wait(target, signal.SIGUSR1, 2)
        await _send_and_wait(target, signal.SIGTERM, 3)
        tg.cancel_scope.cancel()
    assert target.calls == ["request_stop", "pause_local", "force_stop"]


async def test_pause_then_resume_in_order() -> None:
    target = RecordingTarget()
    async with anyio.create_task_group() as tg:
        await tg.start(handle_signals, target)
        await _send_and_wait(target, signal.SIGUSR1, 1)
        await _send_and_wait(target, signal.SIGUSR2, 2)
        await _send_and_wait(target, signal.SIGHUP, 3)
        tg.cancel_scope.cancel()
    assert target.calls == ["pause_local", "resume_local", "reload"]
