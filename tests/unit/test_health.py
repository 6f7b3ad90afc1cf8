"""/livez, /readyz, /healthz and /metrics over a real loopback socket (port 0: any free port)."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from pacerd.clock import ManualClock
from pacerd.config import load_config
from pacerd.daemon import Daemon
from pacerd.health import CheckResult, HealthCheck, parse_address, serve_health
from pacerd.telemetry import Telemetry

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator


@asynccontextmanager
async def running_server(
    liveness: HealthCheck,
    readiness: HealthCheck,
    registry: CollectorRegistry | None = None,
) -> AsyncIterator[int]:
    async with anyio.create_task_group() as tg:
        port: int = await tg.start(
            lambda task_status: serve_health(
                "127.0.0.1:0",
                liveness=liveness,
                readiness=readiness,
                registry=registry or CollectorRegistry(),
                task_status=task_status,
            )
        )
        yield port
        tg.cancel_scope.cancel()


async def request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with anyio.fail_after(10):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(raw)
            data = b""
            try:
                while True:
                    data += await stream.receive()
            except anyio.EndOfStream:
                pass
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


async def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    return await request(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


def always(ok: bool, detail: str = "") -> Callable[[], CheckResult]:
    return lambda: CheckResult(ok=ok, detail=detail)


async def test_healthz_ok() -> None:
    async with running_server(always(True, "ticked"), lambda: True) as port:
        status, headers, body = await get(port, "/healthz")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {
        "status": "ok",
        "checks": {
            "liveness": {"ok": True, "detail": "ticked"},
            "readiness": {"ok": True, "detail": ""},
        },
    }


@pytest.mark.parametrize(("alive", "ready"), [(False, True), (True, False), (False, False)])
async def test_healthz_unavailable_explains(alive: bool, ready: bool) -> None:
    async with running_server(always(alive, "stale"), always(ready, "broker down")) as port:
        status, _, body = await get(port, "/healthz")
    assert status == 503
    document = json.loads(body)
    assert document["status"] == "unavailable"
    assert document["checks"]["liveness"] == {"ok": alive, "detail": "stale"}
    assert document["checks"]["readiness"] == {"ok": ready, "detail": "broker down"}


async def test_a_failing_check_is_unhealthy_not_fatal() -> None:
    def broken() -> bool:
        raise RuntimeError("boom")

    async with running_server(broken, lambda: True) as port:
        status, _, body = await get(port, "/healthz")
        again, _, _ = await get(port, "/healthz")
    assert (status, again) == (503, 503)
    assert "RuntimeError: boom" in json.loads(body)["checks"]["liveness"]["detail"]


@pytest.fixture
def metrics_registry() -> Iterator[CollectorRegistry]:
    """A registry fed by the OpenTelemetry Prometheus reader, after one tick.

    Built outside the event loop: the SDK's resource detection waits on a thread.
    """
    registry = CollectorRegistry()
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader(registry=registry)], shutdown_on_exit=False
    )
    telemetry = Telemetry(TracerProvider(shutdown_on_exit=False), provider)
    telemetry.record_tick(
        "mail", rate=2.5, budget=3, admitted=3, inflight=4, due=10,
        oldest_due_age_seconds=7.0, drain_eta_seconds=4.0, refused=1,
    )  # fmt: skip
    yield registry
    provider.shutdown()


async def test_metrics_serves_the_opentelemetry_instruments(
    metrics_registry: CollectorRegistry,
) -> None:
    async with running_server(lambda: True, lambda: True, metrics_registry) as port:
        status, headers, body = await get(port, "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    for name in (
        "pacerd_rate", "pacerd_admitted_total", "pacerd_refusals_total", "pacerd_inflight",
        "pacerd_due", "pacerd_oldest_due_age_seconds", "pacerd_drain_eta_seconds",
    ):  # fmt: skip
        assert f"\n{name}" in text, name
    assert 'pacerd_due{destination="mail"' in text


async def test_other_paths_and_methods() -> None:
    async with running_server(lambda: True, lambda: True) as port:
        missing, _, _ = await get(port, "/nope")
        post, _, _ = await request(port, b"POST /healthz HTTP/1.1\r\n\r\n")
        garbage, _, _ = await request(port, b"hello\r\n\r\n")
        head_status, head_headers, head_body = await request(
            port, b"HEAD /healthz HTTP/1.1\r\n\r\n"
        )
    assert (missing, post, garbage, head_status) == (404, 405, 400, 200)
    assert int(head_headers["Content-Length"]) > 0
    assert head_body == b""


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:9464", ("127.0.0.1", 9464)), ("[::1]:80", ("::1", 80)), (":0", (None, 0))],
)
def test_parse_address(address: str, expected: tuple[str | None, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["9464", "host:", "host:port", "h:70000"])
def test_parse_address_rejects(address: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        parse_address(address)


async def test_checks_may_return_ok_and_data() -> None:
    def liveness() -> tuple[bool, dict[str, object]]:
        return True, {"instance": "host:1"}

    def readiness() -> tuple[bool, dict[str, object]]:
        return False, {"broker": False, "leading": ["mail"]}

    async with running_server(liveness, readiness) as port:
        status, _, body = await get(port, "/healthz")
    assert status == 503
    assert json.loads(body)["checks"] == {
        "liveness": {"ok": True, "detail": "", "instance": "host:1"},
        "readiness": {"ok": False, "detail": "", "broker": False, "leading": ["mail"]},
    }


@pytest.mark.parametrize(("alive", "ready"), [(True, False), (False, True), (True, True)])
async def test_livez_and_readyz_answer_apart(alive: bool, ready: bool) -> None:
    async with running_server(always(alive, "ticking"), always(ready, "broker down")) as port:
        live, _, live_body = await get(port, "/livez")
        readiness, _, ready_body = await get(port, "/readyz")
        health, _, _ = await get(port, "/healthz")
        head, _, head_body = await request(port, b"HEAD /livez HTTP/1.1\r\n\r\n")
    assert (live, head, head_body) == (200 if alive else 503, live, b"")
    assert json.loads(live_body) == {
        "status": "ok" if alive else "unavailable",
        "checks": {"liveness": {"ok": alive, "detail": "ticking"}},
    }
    assert readiness == (200 if ready else 503)
    assert json.loads(ready_body) == {
        "status": "ok" if ready else "unavailable",
        "checks": {"readiness": {"ok": ready, "detail": "broker down"}},
    }
    assert health == (200 if alive and ready else 503)


async def test_daemon_without_broker_or_ledger_is_live_but_not_ready() -> None:
    """What the daemon answers before it connects, or after losing both."""
    cfg = load_config(None, {})
    daemon = Daemon(cfg, config_path=None, clock=ManualClock(), signals=False)
    async with running_server(daemon.supervisor.liveness, daemon.supervisor.readiness) as port:
        live, _, _ = await get(port, "/livez")
        not_ready, _, body = await get(port, "/readyz")
        daemon.supervisor.ledger_error = "connection refused"
        _, _, with_error = await get(port, "/readyz")
    assert (live, not_ready) == (200, 503)
    assert json.loads(body)["checks"]["readiness"] == {
        "ok": False, "detail": "", "broker": False, "ledger": False, "leading": [],
        "partitions": [],
    }  # fmt: skip
    assert json.loads(with_error)["checks"]["readiness"]["ledger_error"] == "connection refused"
