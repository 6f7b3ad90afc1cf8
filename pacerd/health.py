"""The operations HTTP endpoint: ``/livez``, ``/readyz``, ``/healthz``, ``/metrics``.

Owns a tiny HTTP/1.1 server (anyio streams, no framework) bound to
``[telemetry] http_address``; the daemon passes its checks (liveness: the
tick loop and every destination it runs passed recently):

    GET /livez     liveness only: 200 while the tick loop makes progress, 503 when it
                   is stuck (restart the process). A lost broker or ledger does not
                   fail it: the daemon reconnects by itself.
    GET /readyz    readiness only: 200 while the ledger and the broker are reachable,
                   503 otherwise (the instance cannot admit; do not restart it)
    GET /healthz   both: 200 {"status": "ok", "checks": {...}} when liveness and
                   readiness pass; 503 {"status": "unavailable", "checks": {...}}
    GET /metrics   Prometheus text exposition of a prometheus_client registry, which
                   the OpenTelemetry Prometheus reader feeds (telemetry.py)

Each health answer has the same JSON shape, with the checks it ran.

One request per connection (``Connection: close``), GET and HEAD only, small
bounded requests with a read timeout. It must not compute health itself: the
daemon passes the ``liveness`` and ``readiness`` callables, which must be cheap
and non-blocking. Rendering ``/metrics`` (SDK locks, a collection pass) runs in a
worker thread, never in the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["CheckResult", "HealthCheck", "parse_address", "serve_health"]

_log = structlog.get_logger(__name__)

_MAX_REQUEST_BYTES = 8192
_READ_TIMEOUT_SECONDS = 5.0
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One check's answer; ``data`` is merged into its JSON object."""

    ok: bool
    detail: str = ""
    data: Mapping[str, object] = field(default_factory=dict)


# A check returns a CheckResult, a bare bool, or (ok, data) with JSON-able data.
HealthCheck = Callable[[], "CheckResult | bool | tuple[bool, Mapping[str, object]]"]


def parse_address(address: str) -> tuple[str | None, int]:
    """``host:port``, ``[v6]:port`` or ``:port`` (all interfaces) -> (host, port)."""
    host, sep, port_text = address.strip().rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"http_address {address!r} is not host:port")
    host = host.removeprefix("[").removesuffix("]")
    return (host or None), int(port_text)


def _run_check(check: HealthCheck) -> CheckResult:
    try:
        result = check()
    except Exception as exc:  # a failing check is an unhealthy answer, not a crash
        return CheckResult(ok=False, detail=f"check failed: {type(exc).__name__}: {exc}")
    if isinstance(result, CheckResult):
        return result
    if isinstance(result, tuple):
        ok, data = result
        return CheckResult(ok=bool(ok), data=data)
    return CheckResult(ok=bool(result))


def _health_body(named: Mapping[str, HealthCheck]) -> tuple[int, bytes]:
    checks = {name: _run_check(check) for name, check in named.items()}
    healthy = all(c.ok for c in checks.values())
    body = {
        "status": "ok" if healthy else "unavailable",
        "checks": {name: {**c.data, "ok": c.ok, "detail": c.detail} for name, c in checks.items()},
    }
    return (200 if healthy else 503), json.dumps(body, default=str).encode() + b"\n"


def _response(status: int, body: bytes, content_type: str, *, head: bool = False) -> bytes:
    head_lines = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head_lines.encode("latin-1") + (b"" if head else body)


def _error(status: int, message: str) -> bytes:
    body = json.dumps({"status": "error", "error": message}).encode() + b"\n"
    return _response(status, body, "application/json")


async def _read_request_head(stream: SocketStream) -> bytes | None:
    buffer = b""
    with anyio.move_on_after(_READ_TIMEOUT_SECONDS):
        while b"\r\n\r\n" not in buffer and len(buffer) <= _MAX_REQUEST_BYTES:
            try:
                buffer += await stream.receive(4096)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                break
    return buffer if b"\r\n" in buffer else None


async def _respond(
    head: bytes, liveness: HealthCheck, readiness: HealthCheck, registry: CollectorRegistry
) -> bytes:
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _error(400, "malformed request line")
    method, target, _version = parts
    if method not in ("GET", "HEAD"):
        return _error(405, "only GET and HEAD")
    path = target.split("?", 1)[0]
    checks: dict[str, Mapping[str, HealthCheck]] = {
        "/livez": {"liveness": liveness},
        "/readyz": {"readiness": readiness},
        "/healthz": {"liveness": liveness, "readiness": readiness},
    }
    if path in checks:
        status, body = _health_body(checks[path])
        return _response(status, body, "application/json", head=method == "HEAD")
    if path == "/metrics":
        body = await anyio.to_thread.run_sync(generate_latest, registry)
        return _response(200, body, CONTENT_TYPE_LATEST, head=method == "HEAD")
    return _error(404, f"no such path {path!r}; try /livez, /readyz, /healthz or /metrics")


async def _handle(
    stream: SocketStream,
    liveness: HealthCheck,
    readiness: HealthCheck,
    registry: CollectorRegistry,
) -> None:
    """One connection; a failure here is logged, never allowed to stop the daemon."""
    async with stream:
        try:
            head = await _read_request_head(stream)
            if head is None:
                return
            response = await _respond(head, liveness, readiness, registry)
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(response)
        except Exception as exc:
            _log.warning("health_request_failed", error=f"{type(exc).__name__}: {exc}")


async def serve_health(
    address: str,
    *,
    liveness: HealthCheck,
    readiness: HealthCheck,
    registry: CollectorRegistry | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/livez``, ``/readyz``, ``/healthz`` and ``/metrics`` on ``address``
    until cancelled.

    ``task_status.started(port)`` reports the bound port (useful with port 0).
    ``registry`` defaults to prometheus_client's global ``REGISTRY``.
    """
    host, port = parse_address(address)
    metrics_registry = REGISTRY if registry is None else registry
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    async with listener:
        bound_port: int = listener.extra(SocketAttribute.local_port)
        _log.info("health_server_started", address=address, port=bound_port)
        task_status.started(bound_port)

        async def handler(stream: SocketStream) -> None:
            await _handle(stream, liveness, readiness, metrics_registry)

        await listener.serve(handler)
