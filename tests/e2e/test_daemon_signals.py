"""``python -m pacerd run`` as a subprocess against the real services:
SIGTERM mid-drain, a second SIGTERM, SIGUSR1/SIGUSR2, SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from ha_helpers import schedule_backlog, state_counts

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


class Pacerd:
    """A `pacerd run` subprocess with its log."""

    def __init__(self, config: Path, log: Path) -> None:
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
        env = {k: v for k, v in env.items() if not k.startswith("PACERD_") or "TEST" in k}
        self.log = log
        self._out = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pacerd", "run", "-c", str(config)],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def events(self, name: str, **match: object) -> list[dict[str, Any]]:
        """The daemon's JSON log records named ``name`` (its tick records among them)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("event") == name and all(
                    record.get(k) == v for k, v in match.items()
                ):
                    out.append(record)
        return out

    async def wait_events(self, name: str, n: int, *, within: float = 20, **match: object) -> None:
        with anyio.fail_after(within):
            while len(self.events(name, **match)) < n:
                assert self.process.poll() is None, self.log.read_text()[-3000:]
                await anyio.sleep(0.05)

    def send(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    async def wait_log(self, needle: str, *, within: float = 20) -> None:
        with anyio.fail_after(within):
            while needle not in self.log.read_text():
                assert self.process.poll() is None, self.log.read_text()[-3000:]
                await anyio.sleep(0.1)

    async def wait_exit(self, *, within: float) -> int:
        with anyio.fail_after(within):
            while self.process.poll() is None:
                await anyio.sleep(0.05)
        self._out.close()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._out.close()


@pytest.fixture
def pacerd_proc(tmp_path: Path) -> Iterator[list[Pacerd]]:
    started: list[Pacerd] = []
    yield started
    for proc in started:
        proc.kill()


async def test_sigterm_mid_drain_exits_0_with_no_job_left_claimed(
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Pacerd]
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 5000)
    proc = Pacerd(
        _config(tmp_path / "c.toml", db_dsn, rate=2000, amqp_url=amqp_url), tmp_path / "log"
    )
    pacerd_proc.append(proc)
    await proc.wait_log('"pacerd_ready"')
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
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Pacerd]
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 200)
    proc = Pacerd(
        _config(tmp_path / "c.toml", db_dsn, rate=50, amqp_url=amqp_url), tmp_path / "log"
    )
    pacerd_proc.append(proc)
    await proc.wait_log('"pacerd_ready"')
    proc.send(signal.SIGTERM)
    proc.send(signal.SIGTERM)
    assert await proc.wait_exit(within=5) == 0
    assert (await state_counts(db_dsn)).get("claimed", 0) == 0


async def test_sigusr1_pauses_admission_and_sigusr2_resumes_it(
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Pacerd]
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 3000)
    proc = Pacerd(
        _config(tmp_path / "c.toml", db_dsn, rate=100, amqp_url=amqp_url), tmp_path / "log"
    )
    pacerd_proc.append(proc)
    await proc.wait_log('"pacerd_ready"')
    with anyio.fail_after(20):
        while (await state_counts(db_dsn)).get("offered", 0) < 20:
            await anyio.sleep(0.05)
    proc.send(signal.SIGUSR1)
    await proc.wait_log('"admission_paused_locally"')
    # Ticks run one after another: once a tick has seen the pause, the tick
    # that was in flight when it came has ended.
    await proc.wait_events("tick_completed", 1, skipped="paused_local")
    paused_at = (await state_counts(db_dsn)).get("offered", 0)
    await proc.wait_events("tick_completed", 8, skipped="paused_local")
    assert (await state_counts(db_dsn)).get("offered", 0) == paused_at, (
        "offers continued while paused"
    )
    proc.send(signal.SIGUSR2)
    await proc.wait_log('"admission_resumed_locally"')
    with anyio.fail_after(10):
        while (await state_counts(db_dsn)).get("offered", 0) <= paused_at:
            await anyio.sleep(0.05)
    proc.send(signal.SIGTERM)
    assert await proc.wait_exit(within=20) == 0


async def test_sighup_applies_a_new_rate_and_keeps_running_on_an_invalid_file(
    db_dsn: str, amqp_url: str, tmp_path: Path, pacerd_proc: list[Pacerd]
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 20000)
    config = _config(tmp_path / "c.toml", db_dsn, rate=20, amqp_url=amqp_url)
    proc = Pacerd(config, tmp_path / "log")
    pacerd_proc.append(proc)
    await proc.wait_log('"pacerd_ready"')

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
    await proc.wait_log('"config_reloaded"')
    reloaded = len(proc.events("tick_completed", destination=destination))
    await proc.wait_events("tick_completed", reloaded + 5, destination=destination)
    after = proc.events("tick_completed", destination=destination)[reloaded + 1 :]
    assert after, after
    assert all(t["rate"] >= 500 for t in after), after
    assert all(t["claimed"] > 4 * max(s["claimed"] for s in slow) for t in after), (slow, after)

    config.write_text("[pacing]\ntick_seconds = -1\n")
    proc.send(signal.SIGHUP)
    await proc.wait_log('"reload_rejected"')
    assert proc.process.poll() is None
    proc.send(signal.SIGTERM)
    assert await proc.wait_exit(within=20) == 0
