"""The demo's worker program: each job calls the model upstream of its
destination with its idempotency key, and the upstream's answer becomes the
outcome (2xx → ok with the token use as detail, 429 → refused with its
Retry-After, 5xx or no answer → retry, other 4xx → fail).

The upstreams come from ``DEMO_UPSTREAMS``, a JSON object mapping each
destination to its base URL; the app consumes exactly those destinations. This
module also owns the small HTTP/1.1 client (asyncio streams) for those calls.

    DEMO_UPSTREAMS='{"llm": "http://127.0.0.1:8081"}' \\
        pacerd worker --app pacerd.testing.demo_app:app -c demo.toml
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio

from pacerd.clock import wall_clock_seconds
from pacerd.worker import Fail, Job, Refused, Retry, WorkerApp

if TYPE_CHECKING:
    from collections.abc import Mapping

ENV_UPSTREAMS = "DEMO_UPSTREAMS"


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body or b"null")


async def http_request(
    url: str,
    *,
    method: str = "POST",
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    timeout_seconds: float = 10.0,
) -> HttpResponse:
    """One HTTP/1.1 request on its own connection (``Connection: close``)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"Content-Length: {len(body)}")
    with anyio.fail_after(timeout_seconds):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            status_line = await reader.readline()
            _version, status, _reason = status_line.decode("latin-1").split(" ", 2)
            received: dict[str, str] = {}
            while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = raw.decode("latin-1").partition(":")
                received[name.strip().lower()] = value.strip()
            if "content-length" in received:
                content = await reader.readexactly(int(received["content-length"]))
            else:
                content = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    return HttpResponse(int(status), received, content)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After``: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - wall_clock_seconds()
        except (TypeError, ValueError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


async def call_upstream(base_url: str, job: Job) -> dict[str, Any]:
    """The job's one side effect: ``POST {base_url}/v1/call`` with its idempotency key."""
    try:
        response = await http_request(
            f"{base_url}/v1/call",
            body=json.dumps(job.payload).encode(),
            headers={"Idempotency-Key": job.idempotency_key, "Content-Type": "application/json"},
        )
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
        raise Retry(f"upstream unreachable: {exc!r}") from None
    if response.status == 429:
        raise Refused(retry_after_s=parse_retry_after(response.headers.get("retry-after")))
    if response.status >= 500:
        raise Retry(f"upstream answered HTTP {response.status}")
    if response.status >= 400:
        raise Fail(f"upstream answered HTTP {response.status}: {response.body[:200]!r}")
    answer = response.json()
    return {"tokens": answer.get("tokens"), "duplicate": bool(answer.get("duplicate"))}


def build_app(upstreams: Mapping[str, str], *, prefetch: int = 32) -> WorkerApp:
    """A worker app calling ``upstreams[job.destination]`` for every job."""
    app = WorkerApp(destinations=list(upstreams), prefetch=prefetch, handler_timeout_seconds=20.0)

    @app.handler()
    async def demo_call(job: Job) -> dict[str, Any]:
        base_url = upstreams.get(job.destination)
        if base_url is None:
            raise Fail(f"no upstream configured for destination {job.destination!r}")
        return await call_upstream(base_url, job)

    return app


def upstreams_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    raw = (os.environ if environ is None else environ).get(ENV_UPSTREAMS, "{}")
    try:
        upstreams = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV_UPSTREAMS} is not JSON: {exc}") from None
    if not isinstance(upstreams, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in upstreams.items()
    ):
        raise ValueError(f'{ENV_UPSTREAMS} must be a JSON object {{"destination": "http://..."}}')
    return upstreams


app = build_app(upstreams_from_env())
