"""``pacerd run`` as a subprocess with its HTTP endpoint, the broker behind a proxy
that can refuse: a broker outage makes the instance unready (``/readyz`` 503), never
unlive (``/livez`` stays 200, so a container runtime does not restart a daemon that
reconnects by itself); ``/metrics`` shows who leads and what runs; every log line
names the instance."""

from __future__ import annotations

import json
import signal
import uuid
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import anyio
import pytest
from ha_helpers import schedule_backlog
from support.daemon import Daemon, free_port
from support.proxy import FaultProxy
from support.services import with_port

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]
INSTANCE = "probe-1"


async def http_get(port: int, path: str) -> tuple[int, str]:
    with anyio.fail_after(10):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = b""
            try:
                while True:
                    data += await stream.receive()
            except anyio.EndOfStream:
                pass
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


async def until_status(port: int, path: str, status: int) -> None:
    """Polls ``path`` until it answers ``status`` (the listener may not be up yet)."""
    with anyio.fail_after(30):
        while True:
            try:
                if (await http_get(port, path))[0] == status:
                    return
            except OSError:
                pass
            await anyio.sleep(0.1)


def sample(metrics: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name`` whose labels include ``labels``."""
    for line in metrics.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "{") and all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return None


async def test_broker_outage_fails_readiness_not_liveness(
    db_dsn: str, amqp_url: str, tmp_path: Path
) -> None:
    destination = f"e2e-{uuid.uuid4().hex[:8]}"
    await schedule_backlog(db_dsn, destination, 10)
    broker = urlsplit(amqp_url)
    proxy = FaultProxy(broker.port or 5672, target_host=broker.hostname or "127.0.0.1")
    await proxy.start()
    proxied = with_port(amqp_url, proxy.port)
    port = free_port()
    config = tmp_path / "pacerd.toml"
    config.write_text(
        f'[database]\ndsn = "{db_dsn}"\n\n[broker]\nurl = "{proxied}"\n\n'
        "[pacing]\ntick_seconds = 0.2\n\n[daemon]\nshutdown_grace_seconds = 5.0\n"
        f'instance_name = "{INSTANCE}"\n\n'
        f'[telemetry]\nlog_format = "json"\nhttp_address = "127.0.0.1:{port}"\n'
    )
    log = tmp_path / "log"
    try:
        with Daemon(config, log) as process:
            await until_status(port, "/readyz", 200)
            with anyio.fail_after(30):  # leadership is taken one tick after the lock
                while sample((await http_get(port, "/metrics"))[1], "pacerd_leader",
                             destination=destination) != 1:  # fmt: skip
                    await anyio.sleep(0.1)
            _, metrics = await http_get(port, "/metrics")
            assert sample(metrics, "pacerd_build_info", instance_name=INSTANCE) == 1
            # the statements sent so far, by name: the lock session's and the ledger's
            for statement in ("try_acquire", "wake_destinations"):
                counted = sample(metrics, "pacerd_ledger_statements_total", statement=statement)
                assert (counted or 0) >= 1, statement
            assert (await http_get(port, "/livez"))[0] == 200

            proxy.refuse = True
            proxy.reset()
            await until_status(port, "/readyz", 503)
            assert (await http_get(port, "/livez"))[0] == 200
            # past the broker grace, leadership is given up
            await process.wait_event("leadership_session_closed", within=30)
            status, body = await http_get(port, "/livez")
            assert status == 200, body
            _, health = await http_get(port, "/healthz")
            assert json.loads(health)["checks"]["readiness"]["broker"] is False

            proxy.heal()
            await until_status(port, "/readyz", 200)
            process.send(signal.SIGTERM)
            assert await process.wait_exit(within=30) == 0
    finally:
        await proxy.close()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert lines
    assert {line.get("instance") for line in lines} == {INSTANCE}
