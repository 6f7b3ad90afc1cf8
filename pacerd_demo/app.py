"""The demo's worker program, and the example of how to write one: each job
calls the model upstream of its destination with its idempotency key, and the
upstream's answer becomes the outcome (2xx → ok with the token use as detail,
429 → refused with its Retry-After, 5xx or no answer → retry, other 4xx → fail).

The calls go through one pooled ``aiohttp.ClientSession`` per worker process,
its connections kept alive between calls (aiohttp's client costs a tenth of the
CPU a call that httpx's does: bench/RESULTS.md, "The demo's HTTP client"). The
upstreams come from ``DEMO_UPSTREAMS``, a JSON object mapping each destination
to its base URL; the app consumes exactly those destinations.

    DEMO_UPSTREAMS='{"llm": "http://127.0.0.1:8081"}' \\
        pacerd worker --app pacerd_demo.app:app -c demo.toml
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import math
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import aiohttp

from pacerd.clock import wall_clock_seconds
from pacerd.worker import Fail, Job, Refused, Retry, WorkerApp

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

ENV_UPSTREAMS = "DEMO_UPSTREAMS"

# Per phase (waiting for a pooled connection and connecting, each read of the
# answer): a call that stalls fails fast and is retried; the handler's deadline
# bounds the whole call.
CALL_TIMEOUT_SECONDS = 10.0


def call_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """A pooled connection within ``seconds`` (a connect 3 s), each read of the answer too."""
    return aiohttp.ClientTimeout(total=None, connect=seconds, sock_connect=3.0, sock_read=seconds)


TIMEOUT = call_timeout(CALL_TIMEOUT_SECONDS)


def new_client(
    max_connections: int, timeout: aiohttp.ClientTimeout = TIMEOUT
) -> aiohttp.ClientSession:
    """A client for the upstream calls: ``max_connections`` at once, all kept alive."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


class UpstreamClient:
    """The one pooled client of a worker process: opened by the app's
    ``lifespan`` when the worker starts, closed once it has stopped."""

    def __init__(self, max_connections: int, timeout: aiohttp.ClientTimeout = TIMEOUT) -> None:
        self.max_connections = max_connections
        self.timeout = timeout
        self._client: aiohttp.ClientSession | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        async with new_client(self.max_connections, self.timeout) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    @property
    def client(self) -> aiohttp.ClientSession:
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


class Answer(NamedTuple):
    """What the upstream answered a call, read whole."""

    status: int
    retry_after: str | None  # the ``Retry-After`` header, as sent
    body: bytes


async def post_call(
    client: aiohttp.ClientSession, base_url: str, payload: Any, idempotency_key: str
) -> Answer:
    """``POST {base_url}/v1/call`` with ``payload`` and the key; no answer
    (connect, timeout, a broken connection) raises ``Retry``."""
    headers = {"Idempotency-Key": idempotency_key, "Content-Type": "application/json"}
    try:
        async with client.post(
            f"{base_url}/v1/call", data=json.dumps(payload).encode(), headers=headers
        ) as response:
            body = await response.read()
            return Answer(response.status, response.headers.get("Retry-After"), body)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise Retry(f"upstream unreachable: {exc!r}") from None


def accepted(answer: Answer) -> dict[str, Any]:
    """The body of an accepted call; any other answer raises its outcome: 429
    → ``Refused`` with its Retry-After, 5xx → ``Retry``, other 4xx → ``Fail``."""
    status = answer.status
    if status == 429:  # the upstream's pace: pacerd slows the destination down
        raise Refused(retry_after_s=parse_retry_after(answer.retry_after))
    if status >= 500:
        raise Retry(f"upstream answered HTTP {status}")
    if status >= 400:  # the request itself is wrong: running it again would not help
        raise Fail(f"upstream answered HTTP {status}: {answer.body[:200]!r}")
    body = json.loads(answer.body) if answer.body else {}
    return body if isinstance(body, dict) else {}


async def call_upstream(client: aiohttp.ClientSession, base_url: str, job: Job) -> dict[str, Any]:
    """The job's one side effect, with its idempotency key; the token use as detail."""
    answer = accepted(await post_call(client, base_url, job.payload, job.idempotency_key))
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
