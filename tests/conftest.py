"""Shared fixtures.

Integration tests use the real PostgreSQL and RabbitMQ (never mocks): a
migrated template database is built once per session, and each test that needs
commits or several connections gets a fresh clone of it.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import uuid
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest
import simpool
from blockbuster import blockbuster_ctx
from support.services import ADMIN_DSN, AMQP_URL, amqp_url_for, dsn_for

from pacerd import ledger

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

TEMPLATE = f"pacerd_template_{os.getpid()}"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("PACERD_") and not key.startswith("PACERD_TEST_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _no_blocking_call_on_the_event_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """An async test fails when pacerd's code (or the test's) makes a blocking
    call on the event loop: file or socket I/O, ``time.sleep``, a lock wait
    (blockbuster). The tests that drive daemons as subprocesses and read their
    log files are left out: blocking there is the harness's, not pacerd's."""
    if not inspect.iscoroutinefunction(request.function) or _runs_daemons(request.node):
        yield
        return
    # pacerd.testing holds the tests' own helpers and pacerd_demo the demo, not the
    # daemon's code (blockbuster matches path prefixes: "pacerd" covers pacerd_demo too)
    excluded = ["pacerd.testing", "pacerd_demo"]
    with blockbuster_ctx("pacerd", excluded_modules=excluded) as detector:
        for function in detector.functions.values():
            # asyncpg reads ~/.pgpass and looks for client certificates on connect
            function.can_block_in("asyncpg/connect_utils.py", "_parse_connect_dsn_and_args")
            # pacerd reads its packaged SQL and schemas (a few kB) once, at start-up
            function.can_block_in("pacerd/ledger.py", {"load_queries", "migration_files"})
            function.can_block_in("pacerd/protocol.py", "load_schema")
            # the development console renderer reads source lines to show a traceback
            function.can_block_in("structlog/dev.py", "__call__")
        yield


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
async def template_db() -> AsyncIterator[str]:
    await _admin(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
    await _admin(f'CREATE DATABASE "{TEMPLATE}"')
    await ledger.migrate(dsn_for(TEMPLATE))
    yield TEMPLATE
    await _admin(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')


@pytest.fixture
async def db_dsn(template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test; dropped afterwards."""
    name = f"pacerd_t_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield dsn_for(name)
    await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def empty_db_dsn() -> AsyncIterator[str]:
    """A fresh database with nothing in it (for migration tests)."""
    name = f"pacerd_e_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE DATABASE "{name}"')
    yield dsn_for(name)
    await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def ledger_(db_dsn: str) -> AsyncIterator[ledger.Ledger]:
    led = await ledger.Ledger.connect(db_dsn, max_size=6)
    yield led
    await led.close()


def _rabbitmqctl(*args: str) -> bool:
    try:
        done = subprocess.run(
            ["rabbitmqctl", "-q", *args], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    """A RabbitMQ virtual host of this test session's own, so that concurrent
    runs (and the demo) never consume each other's `pacerd.outcomes`. Falls
    back to the configured URL where rabbitmqctl is not available."""
    vhost = f"pacerd-test-{os.getpid()}"
    if "PACERD_TEST_AMQP_URL" in os.environ or not _rabbitmqctl("add_vhost", vhost):
        yield AMQP_URL
        return
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield amqp_url_for(vhost)
    finally:
        _rabbitmqctl("delete_vhost", vhost)


# -- the simulation pool (tests/sim/simpool.py) and the split over workers ---------------


def pytest_configure(config: pytest.Config) -> None:
    simpool.configure(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist, in the controller: each worker learns where the runs land."""
    simpool.configure_node(node.config, node.workerinput)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """pytest-xdist, in the controller: starts the runs once a worker has
    collected (every worker collects the same tests)."""
    simpool.start(node.config, ids)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without pytest-xdist: starts the runs as soon as collection ends."""
    if not hasattr(session.config, "workerinput"):
        simpool.start(session.config, (item.nodeid for item in session.items))


def pytest_unconfigure(config: pytest.Config) -> None:
    simpool.stop(config)


# Tests that run daemons as processes and read their records (the harness's
# blocking calls are its own). Under pytest-xdist they are spread over the
# workers like every other test: each worker has its own template database and
# RabbitMQ virtual host, and each test its own destinations.
DAEMON_TEST_DIRS = frozenset({"e2e", "faults"})


def _runs_daemons(item: pytest.Item | None) -> bool:
    return item is not None and item.path.parent.name in DAEMON_TEST_DIRS
