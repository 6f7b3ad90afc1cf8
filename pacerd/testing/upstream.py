"""A model of a rate-limited upstream API, for tests, benchmarks and the demo.

Owns a pure model (``UpstreamModel``: time is passed in, randomness comes from
a seeded ``random.Random``) and a small asyncio HTTP/1.1 server around it
(``ModelUpstream``). The model is a token bucket whose refill rate follows a
capacity schedule (steps, or linear ramps between the points), refuses with 429
(and ``Retry-After`` when asked, in seconds or as an HTTP date) once the bucket
is empty, optionally locks a hammering client out for ``penalty_seconds``, fails
a fraction of accepted calls with 500, draws a lognormal latency, counts
accepted/refused/errors per second and records each accepted call's
``Idempotency-Key``, so duplicate side effects can be counted. It is a testing
tool: the daemon never imports it.

    python -m pacerd.testing.upstream --port 8081 --capacity-schedule "0:100,60:30,120:80" \\
        [--ramp] [--burst-seconds 1] [--retry-after] [--penalty-seconds 10] \\
        [--error-rate 0.01] [--latency-median-ms 200] [--log FILE]

HTTP: ``POST /capacity {"rate": N}`` overrides the schedule (``null`` returns
to it; ``"error_rate"`` may be set too); ``GET /stats`` returns JSON totals and
per-second counts; ``GET /calls?from=K`` every API call from the K-th on as
``[wall-clock seconds, status, Retry-After or null, refused by the penalty]``;
any other request is an API call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email.utils
import json
import math
import random
import signal
import sys
import zlib
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pacerd.clock import SystemClock, wall_clock_seconds

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import TextIO

    from pacerd.clock import Clock

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large"}
_REASONS |= {429: "Too Many Requests", 500: "Internal Server Error"}
MAX_BODY_BYTES = 1 << 20
# In penalty mode, refusals within the trailing second above this share of
# the capacity (at least one) close the upstream for the penalty.
PENALTY_THRESHOLD = 0.1


@dataclass(frozen=True, slots=True)
class CapacitySchedule:
    """Requests per second over time: ``(second, rate)`` points, held (steps) or
    interpolated (``ramp``); before the first point, the first rate."""

    points: tuple[tuple[float, float], ...]
    ramp: bool = False

    @classmethod
    def parse(cls, text: str, *, ramp: bool = False) -> CapacitySchedule:
        """``"0:100,60:30,120:80"``: at 0 s 100/s, from 60 s 30/s, from 120 s 80/s."""
        points = []
        for part in text.split(","):
            at, sep, rate = part.strip().partition(":")
            try:
                point = (float(at), float(rate))
            except ValueError:
                point = (math.nan, math.nan)
            if not sep or not all(math.isfinite(v) and v >= 0 for v in point):
                raise ValueError(f"capacity schedule point {part.strip()!r} is not SECONDS:RATE")
            points.append(point)
        if not points or [p[0] for p in points] != sorted({p[0] for p in points}):
            raise ValueError(f"capacity schedule {text!r}: times must be distinct and increasing")
        return cls(tuple(points), ramp)

    def rate_at(self, t: float) -> float:
        """The capacity ``t`` seconds after the start."""
        for (t0, r0), (t1, r1) in zip(self.points, self.points[1:], strict=False):
            if t < t1:
                return r0 + (r1 - r0) * (t - t0) / (t1 - t0) if self.ramp and t > t0 else r0
        return self.points[-1][1]


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamParams:
    schedule: CapacitySchedule
    burst_seconds: float = 1.0  # bucket size in seconds of capacity (at least one call)
    retry_after: bool = False  # send Retry-After with 429s
    retry_after_date: bool = False  # ... as an HTTP date rather than delta-seconds
    penalty_seconds: float = 0.0  # lock-out after sustained over-capacity (0: off)
    penalty_threshold: float = PENALTY_THRESHOLD  # refusals in the trailing second / capacity
    error_rate: float = 0.0  # share of accepted calls failing with 500
    latency_median_ms: float = 0.0  # lognormal latency of accepted calls (0: none)
    latency_sigma: float = 0.5


@dataclass(frozen=True, slots=True)
class Decision:
    status: int  # 200, 429 or 500
    retry_after_s: int | None = None  # the Retry-After header, when sent
    latency_s: float = 0.0
    duplicate: bool = False  # this idempotency key was accepted before
    tokens: int = 0  # "token use" reported in the response body


@dataclass(slots=True)
class SecondStats:
    second: int
    capacity: float
    accepted: int = 0
    refused: int = 0
    errors: int = 0
    duplicates: int = 0
    penalty: bool = False


@dataclass(slots=True)
class UpstreamModel:
    """The upstream's behaviour, without I/O: every method takes ``now`` (seconds)."""

    params: UpstreamParams
    start: float
    rng: random.Random = field(default_factory=random.Random)
    rate_override: float | None = None
    keys: Counter[str] = field(default_factory=Counter)  # accepted calls per idempotency key
    penalty_until: float = -math.inf
    _tokens: float = -1.0
    _last: float = math.nan
    _seconds: dict[int, SecondStats] = field(default_factory=dict)
    _recent_refusals: deque[float] = field(default_factory=deque)
    _logged_upto: int = 0

    def capacity(self, now: float) -> float:
        if self.rate_override is not None:
            return self.rate_override
        return self.params.schedule.rate_at(now - self.start)

    def set_rate(self, rate: float | None, now: float) -> None:
        self._refill(now)
        self.rate_override = rate

    def _burst(self, now: float) -> float:
        capacity = self.capacity(now)
        return max(1.0, capacity * self.params.burst_seconds) if capacity > 0 else 0.0

    def _refill(self, now: float) -> None:
        if math.isnan(self._last):
            self._tokens, self._last = self._burst(now), now
        elapsed, self._last = max(0.0, now - self._last), max(self._last, now)
        self._tokens = min(self._burst(now), self._tokens + elapsed * self.capacity(now))

    def _second(self, now: float) -> SecondStats:
        second = max(0, int(now - self.start))
        stats = self._seconds.get(second)
        if stats is None:
            stats = self._seconds[second] = SecondStats(second, self.capacity(now))
        return stats

    def decide(self, now: float, key: str | None) -> Decision:
        """One API call arriving at ``now``."""
        self._refill(now)
        sec = self._second(now)
        if now < self.penalty_until:
            sec.refused, sec.penalty = sec.refused + 1, True
            return self._refuse(math.ceil(self.penalty_until - now))
        if self._tokens < 1.0:
            sec.refused += 1
            rate = self.capacity(now)
            refusals = self._recent_refusals
            refusals.append(now)
            while refusals and refusals[0] <= now - 1.0:
                refusals.popleft()
            if self.params.penalty_seconds > 0 and len(refusals) > max(
                1.0, self.params.penalty_threshold * rate
            ):
                self.penalty_until = now + self.params.penalty_seconds
                sec.penalty = True
            wait = (1.0 - self._tokens) / rate if rate > 0 else 1.0
            return self._refuse(max(1, math.ceil(wait)))
        self._tokens -= 1.0
        latency = 0.0
        if self.params.latency_median_ms > 0:
            median = math.log(self.params.latency_median_ms / 1000)
            latency = self.rng.lognormvariate(median, self.params.latency_sigma)
        if self.params.error_rate > 0 and self.rng.random() < self.params.error_rate:
            sec.errors += 1
            return Decision(500, latency_s=latency)
        sec.accepted += 1
        duplicate = False
        if key is not None:
            duplicate = key in self.keys
            self.keys[key] += 1
            sec.duplicates += duplicate
        tokens = 100 + zlib.crc32((key or "").encode()) % 900
        return Decision(200, latency_s=latency, duplicate=duplicate, tokens=tokens)

    def _refuse(self, retry_after_s: int) -> Decision:
        return Decision(429, retry_after_s if self.params.retry_after else None)

    @property
    def duplicates(self) -> int:
        """Accepted calls whose idempotency key had been accepted before."""
        return sum(n - 1 for n in self.keys.values())

    def seconds(self, now: float) -> list[SecondStats]:
        """Every whole second so far, including the current one (idle ones too)."""
        last = max(0, int(now - self.start))
        return [
            self._seconds.get(s) or SecondStats(s, self.capacity(self.start + s))
            for s in range(last + 1)
        ]

    def completed_seconds(self, now: float) -> list[SecondStats]:
        """The seconds that ended since the last call (for the per-second log)."""
        done = self.seconds(now)[self._logged_upto : max(0, int(now - self.start))]
        self._logged_upto += len(done)
        return done

    def snapshot(self, now: float) -> dict[str, Any]:
        seconds = self.seconds(now)
        return {
            "elapsed_s": round(now - self.start, 3),
            "capacity": self.capacity(now),
            "rate_override": self.rate_override,
            "error_rate": self.params.error_rate,
            "accepted": sum(s.accepted for s in seconds),
            "refused": sum(s.refused for s in seconds),
            "errors": sum(s.errors for s in seconds),
            "duplicates": self.duplicates,
            "distinct_keys": len(self.keys),
            "penalty_remaining_s": max(0.0, self.penalty_until - now),
            "seconds": [asdict(s) for s in seconds],
        }


class ModelUpstream:
    """``UpstreamModel`` behind an HTTP/1.1 server on loopback (keep-alive, JSON)."""

    def __init__(
        self,
        params: UpstreamParams,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | None = None,
        clock: Clock | None = None,
        seed: int | None = None,
    ) -> None:
        self.clock: Clock = clock or SystemClock()
        self.model = UpstreamModel(params, self.clock.monotonic(), random.Random(seed))
        self.host, self._port, self.log_path = host, port, log_path
        self._server: asyncio.Server | None = None
        self._log_task: asyncio.Task[None] | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted so far (a pooling client reuses a few)
        # every API call: (wall-clock seconds, status, Retry-After, penalty refusal)
        self.calls: list[tuple[float, int, int | None, bool]] = []

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    async def start(self) -> None:
        self.model.start = self.clock.monotonic()
        self._server = await asyncio.start_server(self._serve, self.host, self._port)
        self._port = self._server.sockets[0].getsockname()[1]
        if self.log_path is not None:
            self._log_task = asyncio.create_task(self._write_log(self.log_path))

    async def close(self) -> None:
        if self._log_task is not None:
            self._log_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._log_task
        if self._server is not None:
            self._server.close()
            for writer in list(self._clients):
                writer.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> ModelUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        return self.model.snapshot(self.clock.monotonic())

    def set_rate(self, rate: float | None) -> None:
        self.model.set_rate(rate, self.clock.monotonic())

    async def _write_log(self, path: str) -> None:
        """One JSON line per completed second; file I/O in a thread, off the event loop."""
        out = await asyncio.to_thread(open, path, "a", encoding="utf-8")
        try:
            while True:
                await self.clock.sleep(1.0)
                done = self.model.completed_seconds(self.clock.monotonic())
                lines = "".join(json.dumps(asdict(second)) + "\n" for second in done)
                await asyncio.to_thread(_append, out, lines)
        finally:
            out.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        self.connections += 1
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                method, path, headers, body = request
                status, extra, payload = await self._route(method, path, headers, body)
                keep_alive = headers.get("connection", "").lower() != "close"
                writer.write(_response(status, extra, payload, keep_alive=keep_alive))
                await writer.drain()
                if not keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # a client that went away or spoke garbage: drop the connection
        finally:
            self._clients.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _route(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        route = path.split("?", 1)[0]
        if route == "/stats" and method == "GET":
            return 200, {}, self.stats()
        if route == "/calls" and method == "GET":
            query = dict(p.partition("=")[::2] for p in path.partition("?")[2].split("&") if p)
            try:
                start = max(0, int(query.get("from", "0")))
            except ValueError:
                return 400, {}, {"error": "from must be an integer"}
            return 200, {}, {"calls": self.calls[start:]}
        if route == "/capacity" and method == "POST":
            try:
                control = json.loads(body or b"{}")
                rate, error_rate = control.get("rate"), control.get("error_rate")
                if rate is not None and not (isinstance(rate, int | float) and rate >= 0):
                    raise ValueError("rate must be a number >= 0 or null")
                if error_rate is not None and not 0 <= float(error_rate) <= 1:
                    raise ValueError("error_rate must be in [0, 1]")
            except (ValueError, TypeError, AttributeError) as exc:
                return 400, {}, {"error": str(exc)}
            if "rate" in control:
                self.set_rate(None if rate is None else float(rate))
            if error_rate is not None:
                self.model.params = replace(self.model.params, error_rate=float(error_rate))
            return 200, {}, {"capacity": self.model.capacity(self.clock.monotonic())}
        now = self.clock.monotonic()
        penalty = now < self.model.penalty_until  # refused because the penalty box is closed
        decision = self.model.decide(now, headers.get("idempotency-key"))
        self.calls.append((wall_clock_seconds(), decision.status, decision.retry_after_s, penalty))
        if decision.latency_s > 0:
            await self.clock.sleep(decision.latency_s)
        if decision.status == 429:
            wait = decision.retry_after_s
            retry_after = None if wait is None else str(wait)
            if wait is not None and self.model.params.retry_after_date:
                # an HTTP date has whole seconds: the first one at or after the wait
                later = math.ceil(wall_clock_seconds() + wait)
                retry_after = email.utils.formatdate(later, usegmt=True)
            extra = {} if retry_after is None else {"Retry-After": retry_after}
            return 429, extra, {"error": "rate limited"}
        if decision.status == 500:
            return 500, {}, {"error": "internal error (injected)"}
        return 200, {}, {"ok": True, "tokens": decision.tokens, "duplicate": decision.duplicate}


def _append(out: TextIO, lines: str) -> None:
    out.write(lines)
    out.flush()


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, dict[str, str], bytes] | None:
    line = await reader.readline()
    if not line.strip():
        return None
    method, path, _version = line.decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    if not 0 <= length <= MAX_BODY_BYTES:
        raise ValueError("body too large")
    return method, path, headers, await reader.readexactly(length) if length else b""


def _response(
    status: int, headers: dict[str, str], payload: dict[str, Any], *, keep_alive: bool
) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pacerd.testing.upstream", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081, help="0 picks a free port")
    p.add_argument("--capacity-schedule", default="0:100", help='"SECONDS:RATE,..."')
    p.add_argument("--ramp", action="store_true", help="interpolate between schedule points")
    p.add_argument("--burst-seconds", type=float, default=1.0)
    p.add_argument("--retry-after", action="store_true", help="send Retry-After with 429s")
    p.add_argument("--penalty-seconds", type=float, default=0.0)
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--latency-median-ms", type=float, default=0.0)
    p.add_argument("--latency-sigma", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--log", default=None, help="append one JSON line per second to FILE")
    return p


def params_from_args(args: argparse.Namespace) -> UpstreamParams:
    return UpstreamParams(
        schedule=CapacitySchedule.parse(args.capacity_schedule, ramp=args.ramp),
        burst_seconds=args.burst_seconds, retry_after=args.retry_after,
        penalty_seconds=args.penalty_seconds, error_rate=args.error_rate,
        latency_median_ms=args.latency_median_ms, latency_sigma=args.latency_sigma,
    )  # fmt: skip


async def serve(args: argparse.Namespace) -> None:
    upstream = ModelUpstream(
        params_from_args(args), host=args.host, port=args.port, log_path=args.log, seed=args.seed
    )
    await upstream.start()
    print(f"model upstream listening on {upstream.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await upstream.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params_from_args(args)
    except ValueError as exc:
        print(f"upstream: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
