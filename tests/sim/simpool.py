"""The simulation runs of ``test_sim_targets.py``, started as soon as
collection ends (by ``tests/conftest.py``) in a pool of one process per core
at the lowest CPU priority (nice 19): they use the CPU that the
I/O-bound tests before them leave idle, and each target test then awaits its
scenario's runs, submitted in the order the tests need them.

The pool never competes with a test that runs daemons as processes (the
end-to-end and fault tests): ``tests/conftest.py`` pauses its processes
(SIGSTOP) for the duration of each such test and resumes them (SIGCONT)
after it."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from concurrent.futures import Future, ProcessPoolExecutor

import pytest
from scenarios import measure

SEEDS = range(10)
TEST_FILE = "test_sim_targets.py"
Runs = dict[str, list[Future[dict[str, float]]]]
_POOL = pytest.StashKey[ProcessPoolExecutor]()
_RUNS = pytest.StashKey[Runs]()


def _lowest_priority() -> None:
    os.nice(19)


def _signal_workers(session: pytest.Session, sig: signal.Signals) -> None:
    pool = session.config.stash.get(_POOL, None)
    if pool is None:
        return
    for process in list((pool._processes or {}).values()):
        if process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, sig)


def pause(session: pytest.Session) -> None:
    """Stops the pool's processes (until ``resume``)."""
    _signal_workers(session, signal.SIGSTOP)


def resume(session: pytest.Session) -> None:
    _signal_workers(session, signal.SIGCONT)


def start(session: pytest.Session) -> None:
    """Submits every run the selected target tests need (none: no pool)."""
    names = dict.fromkeys(
        str(item.callspec.params["name"])
        for item in session.items
        if isinstance(item, pytest.Function)
        and item.path.name == TEST_FILE
        and hasattr(item, "callspec")
    )
    if not names:
        return
    pool = ProcessPoolExecutor(
        max_workers=len(os.sched_getaffinity(0)),
        mp_context=multiprocessing.get_context("spawn"),  # never fork a process with threads
        initializer=_lowest_priority,
    )
    session.config.stash[_POOL] = pool
    session.config.stash[_RUNS] = {
        name: [pool.submit(measure, name, "pacerd", seed) for seed in SEEDS] for name in names
    }


def stop(session: pytest.Session) -> None:
    pool = session.config.stash.get(_POOL, None)
    if pool is not None:
        resume(session)
        pool.shutdown(cancel_futures=True)


def runs(config: pytest.Config) -> Runs:
    """Every selected scenario's runs, one future per seed."""
    return config.stash[_RUNS]
