"""``python -m pacerd run`` as a subprocess against the real services:
SIGTERM mid-drain, a second SIGTERM, SIGUSR1/SIGUSR2, SIGHUP."""

from __future__ import annotations

import json
import signal
import uuid
from typing import TYPE_CHECKING

import aiormq
import anyio
import asyncpg
import pytest
from ha_helpers import schedule_backlog, state_counts
from support.daemon import Daemon

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def _config(path: Path, dsn: str, *, rate: float, amqp_url: str) -> Path:
    path.write_text(
        f"""
[database]
dsn = "{dsn}"

[broker]
url = "{amqp_url}"

[pacing]
tick_seconds = 0.2
initial_rate = {rate}
min_rate = 1.0
max_rate = 100000.0
max_inflight = 100000

[leases]
claim_seconds = 30.0
offer_seconds = 300.0

[daemon]
shutdown_grace_seconds = 5.0

[telemetry]
log_format = "json"
log_level = "debug"
"""
    )
    return path


@pytest.fixture
def pacerd_proc() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for proc in started:
        proc.close()


async def test_sigterm_mid_drain_exits_0_with_no_job_left_claimed(
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Daemon]
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 5000)
    proc = Daemon(
        _config(tmp_path / "c.toml", db_dsn, rate=2000, amqp_url=amqp_url), tmp_path / "log"
    )
    pacerd_proc.append(proc)
    await proc.wait_event("pacerd_ready")
    with anyio.fail_after(20):
        while (await state_counts(db_dsn)).get("offered", 0) < 200:
            await anyio.sleep(0.05)
    proc.send(signal.SIGTERM)
    assert await proc.wait_exit(within=20) == 0
    counts = await state_counts(db_dsn)
    assert counts.get("claimed", 0) == 0, counts
    assert sum(counts.values()) == 5000
    assert 0 < counts.get("offered", 0) < 5000


async def test_second_sigterm_exits_promptly(
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Daemon]
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 200)
    proc = Daemon(
        _config(tmp_path / "c.toml", db_dsn, rate=50, amqp_url=amqp_url), tmp_path / "log"
    )
    pacerd_proc.append(proc)
    await proc.wait_event("pacerd_ready")
    proc.send(signal.SIGTERM)
    proc.send(signal.SIGTERM)
    assert await proc.wait_exit(within=5) == 0
    assert (await state_counts(db_dsn)).get("claimed", 0) == 0


async def test_sigusr1_pauses_admission_and_sigusr2_resumes_it(
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Daemon]
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 3000)
    proc = Daemon(
        _config(tmp_path / "c.toml", db_dsn, rate=100, amqp_url=amqp_url), tmp_path / "log"
    )
    pacerd_proc.append(proc)
    await proc.wait_event("pacerd_ready")
    with anyio.fail_after(20):
        while (await state_counts(db_dsn)).get("offered", 0) < 20:
            await anyio.sleep(0.05)
    proc.send(signal.SIGUSR1)
    await proc.wait_event("admission_paused_locally")
    # Ticks run one after another: once a tick has seen the pause, the tick
    # that was in flight when it came has ended.
    await proc.wait_events("tick_completed", 1, skipped="paused_local")
    paused_at = (await state_counts(db_dsn)).get("offered", 0)
    await proc.wait_events("tick_completed", 8, skipped="paused_local")
    assert (await state_counts(db_dsn)).get("offered", 0) == paused_at, (
        "offers continued while paused"
    )
    proc.send(signal.SIGUSR2)
    await proc.wait_event("admission_resumed_locally")
    with anyio.fail_after(10):
        while (await state_counts(db_dsn)).get("offered", 0) <= paused_at:
            await anyio.sleep(0.05)
    proc.send(signal.SIGTERM)
    assert await proc.wait_exit(within=20) == 0


async def test_sighup_applies_a_new_rate_and_keeps_running_on_an_invalid_file(
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Daemon]
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 20000)
    config = _config(tmp_path / "c.toml", db_dsn, rate=20, amqp_url=amqp_url)
    proc = Daemon(config, tmp_path / "log")
    pacerd_proc.append(proc)
    await proc.wait_event("pacerd_ready")

    # The daemon's tick records: the rate it paced at before and after the reload.
    await proc.wait_events("tick_completed", 5, destination=destination)
    slow = proc.events("tick_completed", destination=destination)
    assert all(t["rate"] < 60 for t in slow), slow
    config.write_text(
        config.read_text()
        .replace("initial_rate = 20", "initial_rate = 500")
        .replace("min_rate = 1.0", "min_rate = 500.0")
    )
    proc.send(signal.SIGHUP)
    await proc.wait_event("config_reloaded")
    reloaded = len(proc.events("tick_completed", destination=destination))
    await proc.wait_events("tick_completed", reloaded + 5, destination=destination)
    after = proc.events("tick_completed", destination=destination)[reloaded + 1 :]
    assert after, after
    assert all(t["rate"] >= 500 for t in after), after
    assert all(t["claimed"] > 4 * max(s["claimed"] for s in slow) for t in after), (slow, after)

    config.write_text("[pacing]\ntick_seconds = -1\n")
    proc.send(signal.SIGHUP)
    await proc.wait_event("reload_rejected")
    assert proc.alive
    proc.send(signal.SIGTERM)
    assert await proc.wait_exit(within=20) == 0


async def test_sighup_stores_retry_limits_registers_new_destinations_and_binds_their_queues(
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Daemon]
) -> None:
    """What a reload changes outside the process is applied too: the SQL
    API's retry limits, a destination it adds (registered in the ledger) and
    the queues of its destinations and groups (bound before any publish);
    what it cannot apply is logged as needing a restart."""
    suffix = uuid.uuid4().hex[:8]
    added, group = f"e2e-added-{suffix}", f"e2e-group-{suffix}"
    config = _config(tmp_path / "c.toml", db_dsn, rate=20, amqp_url=amqp_url)
    proc = Daemon(config, tmp_path / "log")
    pacerd_proc.append(proc)
    await proc.wait_event("pacerd_ready")
    config.write_text(
        config.read_text()
        + "\n[retry]\nmax_attempts = 3\n\n[reconcile]\ninterval_seconds = 7.0\n"
        + f'\n[destinations."{added}"]\nmax_rate = 50.0\n'
        + f'\n[groups."{group}"]\nmatch = "{group}-*"\n'
    )
    proc.send(signal.SIGHUP)
    reloaded = await proc.wait_event("config_reloaded")
    assert "reconcile.interval_seconds" in reloaded["needs_restart"]
    assert "retry.max_attempts" not in reloaded["needs_restart"]
    conn = await asyncpg.connect(db_dsn)
    try:
        limit = await conn.fetchval("SELECT value FROM pacerd.settings WHERE key = 'max_attempts'")
        known = await conn.fetchval(
            "SELECT count(*) FROM pacerd.destinations WHERE destination = $1", added
        )
    finally:
        await conn.close()
    assert json.loads(limit) == 3
    assert known == 1
    connection = await aiormq.connect(amqp_url)
    try:
        channel = await connection.channel()
        for queue in (f"pacerd.ready.{added}", f"pacerd.ready.{group}"):
            await channel.queue_declare(queue, passive=True)  # fails if not declared
            await channel.queue_delete(queue)
    finally:
        await connection.close()
    proc.send(signal.SIGTERM)
    assert await proc.wait_exit(within=20) == 0
