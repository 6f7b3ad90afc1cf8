"""The demo's worker program, and the example of how to write one: each job
calls the model upstream of its destination with its idempotency key, and the
upstream's answer becomes the outcome (2xx → ok with the token use as detail,
429 → refused with its Retry-After, 5xx or no answer → retry, other 4xx → fail).

The calls go through one pooled ``httpx.AsyncClient`` per worker process, its
connections kept alive between calls. The upstreams come from
``DEMO_UPSTREAMS``, a JSON object mapping each destination to its base URL; the
app consumes exactly those destinations.

    DEMO_UPSTREAMS='{"llm": "http://127.0.0.1:8081"}' \\
        pacerd worker --app pacerd_demo.app:app -c demo.toml
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import math
import os
from typing import TYPE_CHECKING, Any

import httpx

from pacerd.clock import wall_clock_seconds
from pacerd.worker import Fail, Job, Refused, Retry, WorkerApp

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

ENV_UPSTREAMS = "DEMO_UPSTREAMS"

# Per phase (connect, write, read, waiting for a pooled connection): a call that
# stalls fails fast and is retried; the handler's deadline bounds the whole call.
CALL_TIMEOUT_SECONDS = 10.0


def call_timeout(seconds: float) -> httpx.Timeout:
    """Each phase of a call (write, read, a pooled connection) ``seconds``; a connect 3 s."""
    return httpx.Timeout(seconds, connect=3.0)


TIMEOUT = call_timeout(CALL_TIMEOUT_SECONDS)


def new_client(max_connections: int, timeout: httpx.Timeout = TIMEOUT) -> httpx.AsyncClient:
    """A client for the upstream calls: ``max_connections`` at once, all kept alive."""
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    return httpx.AsyncClient(limits=limits, timeout=timeout)


class UpstreamClient:
    """The one pooled client of a worker process: opened by the app's
    ``lifespan`` when the worker starts, closed once it has stopped."""

    def __init__(self, max_connections: int, timeout: httpx.Timeout = TIMEOUT) -> None:
        self.max_connections = max_connections
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        async with new_client(self.max_connections, self.timeout) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the upstream client is open only while the worker runs")
        return self._client


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


async def call_upstream(client: httpx.AsyncClient, base_url: str, job: Job) -> dict[str, Any]:
    """The job's one side effect: ``POST {base_url}/v1/call`` with its idempotency key."""
    try:
        response = await client.post(
            f"{base_url}/v1/call",
            content=json.dumps(job.payload).encode(),
            headers={"Idempotency-Key": job.idempotency_key, "Content-Type": "application/json"},
        )
    except (httpx.TransportError, httpx.InvalidURL) as exc:  # no answer: connect, timeout, ...
        raise Retry(f"upstream unreachable: {exc!r}") from None
    status = response.status_code
    if status == 429:  # the upstream's pace: pacerd slows the destination down
        raise Refused(retry_after_s=parse_retry_after(response.headers.get("retry-after")))
    if status >= 500:
        raise Retry(f"upstream answered HTTP {status}")
    if status >= 400:  # the request itself is wrong: running it again would not help
        raise Fail(f"upstream answered HTTP {status}: {response.content[:200]!r}")
    answer = response.json()
    return {"tokens": answer.get("tokens"), "duplicate": bool(answer.get("duplicate"))}


def build_app(
    upstreams: Mapping[str, str],
    *,
    prefetch: int = 32,
    call_timeout_seconds: float = CALL_TIMEOUT_SECONDS,
) -> WorkerApp:
    """A worker app calling ``upstreams[job.destination]`` for every job; a
    call's phases time out after ``call_timeout_seconds`` each (an upstream
    whose calls take seconds needs more than the default), the handler after
    twice that, 20 s at least."""
    # prefetch bounds the handlers running at once for each destination's queue:
    # one connection for each, so no call waits for the pool
    http = UpstreamClient(
        max_connections=prefetch * max(1, len(upstreams)),
        timeout=call_timeout(call_timeout_seconds),
    )
    app = WorkerApp(
        destinations=list(upstreams), prefetch=prefetch,
        handler_timeout_seconds=max(20.0, 2.0 * call_timeout_seconds), lifespan=http.lifespan,
    )  # fmt: skip

    @app.handler()
    async def demo_call(job: Job) -> dict[str, Any]:
        base_url = upstreams.get(job.destination)
        if base_url is None:
            raise Fail(f"no upstream configured for destination {job.destination!r}")
        return await call_upstream(http.client, base_url, job)

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
