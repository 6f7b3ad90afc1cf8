"""`pacerd migrate`, `pacerd run` and `pacerd check-config` as processes,
against the real services: the first two store the `[retry]` limits in
`pacerd.settings`, where every caller's SQL function reads them (and
`migrate --partitions` the number of partitions, which `run` keeps); the
last changes nothing, in the ledger or on the broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import asyncpg
import pytest
from ha_helpers import Pacing, write_config
from support.daemon import Daemon

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

MIGRATE_LIMITS = {
    "max_attempts": 7,
    "backoff_base_seconds": 2.5,
    "backoff_cap_seconds": 99.0,
    "payload_max_bytes": 12345,
}
RUN_LIMITS = {
    "max_attempts": 4,
    "backoff_base_seconds": 0.5,
    "backoff_cap_seconds": 30.0,
    "payload_max_bytes": 2000,
}


def _config(path: Path, *, dsn: str, amqp_url: str, retry: dict[str, Any], extra: str = "") -> Path:
    write_config(path, dsn=dsn, amqp_url=amqp_url, instance=path.stem, pacing=Pacing())
    lines = "\n".join(f"{key} = {value}" for key, value in retry.items())
    with path.open("a") as out:
        out.write(f"\n[retry]\n{lines}\n{extra}")
    return path


def _pacerd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")}
    return subprocess.run(
        [sys.executable, "-m", "pacerd", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


async def _settings(dsn: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT key, value::text AS value FROM pacerd.settings")
    finally:
        await conn.close()
    return {r["key"]: json.loads(r["value"]) for r in rows}


async def _schedule(dsn: str, job_id: str, payload_bytes: int) -> str:
    """pacerd.schedule as any producer calls it: the result, or the SQL error."""
    conn = await asyncpg.connect(dsn)
    try:
        result: str = await conn.fetchval(
            "SELECT pacerd.schedule(job_id => $1, kind => 'k', destination => 'd',"
            " payload => jsonb_build_object('pad', repeat('x', $2)))",
            job_id,
            payload_bytes,
        )
        return result
    except asyncpg.PostgresError as exc:
        return f"error: {exc}"
    finally:
        await conn.close()


async def test_migrate_and_run_store_the_retry_limits(
    empty_db_dsn: str, amqp_url: str, tmp_path: Path
) -> None:
    first = _config(
        tmp_path / "migrate.toml", dsn=empty_db_dsn, amqp_url=amqp_url, retry=MIGRATE_LIMITS
    )
    done = _pacerd("migrate", "--partitions", "8", "-c", str(first))
    assert done.returncode == 0, done.stderr
    assert await _settings(empty_db_dsn) == {**MIGRATE_LIMITS, "partitions": 8}
    # The SQL functions enforce what was stored.
    assert "12345" in await _schedule(empty_db_dsn, "too-big", 13000)
    assert await _schedule(empty_db_dsn, "fits", 5000) == "scheduled"

    second = _config(tmp_path / "run.toml", dsn=empty_db_dsn, amqp_url=amqp_url, retry=RUN_LIMITS)
    with Daemon(second, tmp_path / "run.log", name="run") as instance:
        await instance.wait_event("pacerd_ready")
        stored = await _settings(empty_db_dsn)
        rejected = await _schedule(empty_db_dsn, "now-too-big", 5000)
        instance.send(signal.SIGTERM)
        assert await instance.wait_exit(within=30) == 0
    assert stored == {**RUN_LIMITS, "partitions": 8}  # run reads the partitions, never sets them
    assert "2000" in rejected
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        fits = await conn.fetchval("SELECT max_attempts FROM pacerd.jobs WHERE job_id = 'fits'")
        assert fits == MIGRATE_LIMITS["max_attempts"]
    finally:
        await conn.close()


# ---------------------------------------------------------------------------
# check-config
# ---------------------------------------------------------------------------


def _vhost(amqp_url: str) -> str:
    return unquote(urlsplit(amqp_url).path.lstrip("/")) or "/"


def _broker_listing(vhost: str) -> tuple[str, str, str]:
    def ctl(*args: str) -> str:
        return subprocess.run(
            ["rabbitmqctl", "-q", *args, "-p", vhost, "--no-table-headers"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout

    return (
        "".join(sorted(ctl("list_queues", "name", "messages", "arguments").splitlines(True))),
        "".join(sorted(ctl("list_exchanges", "name", "type").splitlines(True))),
        "".join(sorted(ctl("list_bindings").splitlines(True))),
    )


async def _ledger_dump(dsn: str) -> dict[str, list[str]]:
    """Every row of every pacerd table, as text."""
    conn = await asyncpg.connect(dsn)
    try:
        tables = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'pacerd'"
            " ORDER BY table_name"
        )
        dump = {}
        for t in tables:
            name = t["table_name"]
            rows = await conn.fetch(f'SELECT t::text AS row FROM pacerd."{name}" t')
            dump[name] = sorted(r["row"] for r in rows)
        return dump
    finally:
        await conn.close()


async def test_check_config_changes_nothing(db_dsn: str, amqp_url: str, tmp_path: Path) -> None:
    vhost = _vhost(amqp_url)
    if not vhost.startswith("pacerd-test-"):
        pytest.skip("needs this test session's own RabbitMQ virtual host (rabbitmqctl)")
    assert await _schedule(db_dsn, "job-1", 10) == "scheduled"
    # Limits other than the stored ones, and a destination the ledger and the
    # broker do not know: writing either would show.
    extra = "\n[destinations.unseen-a]\nmax_rate = 50.0\n"
    config = _config(
        tmp_path / "check.toml", dsn=db_dsn, amqp_url=amqp_url, retry=RUN_LIMITS, extra=extra
    )
    invalid = _config(
        tmp_path / "invalid.toml",
        dsn=db_dsn,
        amqp_url=amqp_url,
        retry={**RUN_LIMITS, "max_attempts": 0},
        extra=extra,
    )
    ledger_before, broker_before = await _ledger_dump(db_dsn), _broker_listing(vhost)

    valid = _pacerd("check-config", "-c", str(config))
    refused = _pacerd("check-config", "-c", str(invalid))

    assert valid.returncode == 0, valid.stderr
    assert refused.returncode == 78, refused.stderr
    assert "max_attempts" in refused.stderr + refused.stdout
    assert await _ledger_dump(db_dsn) == ledger_before
    assert _broker_listing(vhost) == broker_before
    assert ledger_before["settings"], "the dump must cover the settings"
