"""The simulation runs of ``test_sim_targets.py``: every selected scenario
once per seed, in a pool of one process per core at the lowest CPU priority
(nice 19), started as soon as the selected tests are known.

At nice 19 the pool takes only the CPU that the other tests leave idle:
against a runnable process at nice 0 it weighs 15 to 1024 in the kernel's
scheduler, and a waking test process preempts it at once. So the runs fill
the time the I/O-bound tests spend waiting on PostgreSQL, RabbitMQ and
their daemons, and each target test then waits for its scenario's runs.

The pool lives in pytest's main process: with pytest-xdist that is the
controller, which runs no test, so each run is made once whichever worker
runs its tests. Each run's metrics (or its error) are written as a JSON file
into a directory that every worker is told of (``tests/conftest.py`` wires
the hooks); ``results`` waits for a scenario's files.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import structlog
from scenarios import measure

if TYPE_CHECKING:
    from collections.abc import Iterable

SEEDS = range(10)
TEST_FILE = "test_sim_targets.py"
WORKER_INPUT_KEY = "pacerd_sim_results"  # the results directory, as xdist hands it on
_STARTED = "started"  # written once the pool has been given every run
_DIR = pytest.StashKey[Path]()
_POOL = pytest.StashKey[ProcessPoolExecutor]()
_POLL_SECONDS = 0.2


def case_id(name: str, metric: str, op: str, value: float) -> str:
    """The id of a target test: the scenario's name comes first, before a colon."""
    return f"{name}:{metric}{op}{value:g}"


def scenario_of(nodeid: str) -> str | None:
    """The scenario a test node id of ``test_sim_targets.py`` asks for, else None."""
    path, _, rest = nodeid.partition("::")
    if Path(path).name != TEST_FILE or "[" not in rest:
        return None
    return rest.split("[", 1)[1].split(":", 1)[0]


def configure(config: pytest.Config) -> None:
    """The results directory: made by the main process, handed to workers."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None:
        config.stash[_DIR] = Path(workerinput[WORKER_INPUT_KEY])
    else:
        config.stash[_DIR] = Path(tempfile.mkdtemp(prefix="pacerd-sim-"))


def configure_node(config: pytest.Config, workerinput: dict[str, Any]) -> None:
    workerinput[WORKER_INPUT_KEY] = str(config.stash[_DIR])


def start(config: pytest.Config, nodeids: Iterable[str]) -> None:
    """In the main process: submits every run the selected target tests
    need (none: no pool), once."""
    if _POOL in config.stash:
        return
    names = dict.fromkeys(name for name in map(scenario_of, nodeids) if name is not None)
    if not names:
        return
    pool = ProcessPoolExecutor(
        max_workers=len(os.sched_getaffinity(0)),
        mp_context=multiprocessing.get_context("spawn"),  # never fork a process with threads
        initializer=_lowest_priority,
    )
    config.stash[_POOL] = pool
    directory = config.stash[_DIR]
    for name in names:
        for seed in SEEDS:
            future = pool.submit(measure, name, "pacerd", seed)
            future.add_done_callback(partial(_write, directory / _file_name(name, seed)))
    (directory / _STARTED).touch()


def results(config: pytest.Config, name: str) -> list[dict[str, float]]:
    """The metrics of scenario ``name`` for every seed, once all are in
    (the test's timeout bounds the wait)."""
    directory = config.stash[_DIR]
    if not (directory / _STARTED).exists():
        raise RuntimeError("the simulation pool was not started for this session")
    paths = [directory / _file_name(name, seed) for seed in SEEDS]
    while not all(path.exists() for path in paths):
        time.sleep(_POLL_SECONDS)
    runs = [json.loads(path.read_text()) for path in paths]
    errors = [run["error"] for run in runs if "error" in run]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} run(s) failed; the first:\n{errors[0]}")
    return [run["metrics"] for run in runs]


def stop(config: pytest.Config) -> None:
    """In the main process: ends the pool and removes the results."""
    if hasattr(config, "workerinput") or _DIR not in config.stash:
        return
    pool = config.stash.get(_POOL, None)
    if pool is not None:
        pool.shutdown(cancel_futures=True)
    shutil.rmtree(config.stash[_DIR], ignore_errors=True)


def _lowest_priority() -> None:
    """A pool process: niced, and the admission it runs logs warnings only
    (its debug events would fill the test run's output)."""
    os.nice(19)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _file_name(name: str, seed: int) -> str:
    return f"{name}.{seed}.json"


def _write(path: Path, future: Future[dict[str, float]]) -> None:
    """A run's result file, written whole (a reader never sees half of it)."""
    if future.cancelled():
        return
    error = future.exception()
    if error is None:
        body: dict[str, Any] = {"metrics": future.result()}
    else:
        body = {"error": "".join(traceback.format_exception(error))}
    partial_path = path.with_suffix(".part")
    partial_path.write_text(json.dumps(body))
    partial_path.replace(path)
