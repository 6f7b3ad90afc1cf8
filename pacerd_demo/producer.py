"""A steady producer for the container demo: schedules jobs through the public
SQL API (``pacerd.schedule``) at a fixed rate, plus a burst of overdue jobs at a
fixed interval so a backlog forms and drains. It is part of the demo: the daemon
never imports it.

The ledger's DSN comes from the configuration, like every pacerd program
(``-c FILE``, ``PACERD_CONFIG``, ``PACERD_DATABASE__DSN``).

    python -m pacerd_demo.producer --destination llm --rate 40 \\
        [--burst 3000 --burst-every 300] [--kind demo.call]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import secrets
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pacerd import config as config_module
from pacerd.client import Client
from pacerd.clock import Clock, SystemClock
from pacerd.errors import PacerdError

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True, slots=True, kw_only=True)
class ProducerParams:
    destinations: tuple[str, ...]
    rate: float  # jobs per second, over all destinations
    burst: int  # overdue jobs scheduled at once every burst_every seconds (0: none)
    burst_every_seconds: float
    kind: str

    def __post_init__(self) -> None:
        if not self.destinations:
            raise ValueError("at least one --destination")
        if self.rate < 0 or self.burst < 0 or self.burst_every_seconds <= 0:
            raise ValueError("--rate and --burst must be >= 0, --burst-every > 0")


BACKLOG_AGE = dt.timedelta(minutes=10)  # a burst is overdue: backlog, not the live lane


def jobs_for_second(params: ProducerParams, second: int, carry: float) -> tuple[int, int, float]:
    """(live jobs, burst jobs, fraction carried on) for whole second ``second``."""
    due = params.rate + carry
    every = max(1, round(params.burst_every_seconds))
    burst = params.burst if params.burst and second % every == 0 else 0
    return int(due), burst, due - int(due)


async def produce(client: Client, params: ProducerParams, *, clock: Clock) -> None:
    """Schedules jobs until cancelled; each second's jobs go out together."""
    run = secrets.token_hex(3)
    second, carry, serial = 0, 0.0, 0
    started = clock.monotonic()
    while True:
        live, burst, carry = jobs_for_second(params, second, carry)
        overdue = clock.now() - BACKLOG_AGE
        calls = []
        for n in range(live + burst):
            serial += 1
            calls.append(
                client.schedule(
                    f"demo-{run}-{serial}", kind=params.kind,
                    destination=params.destinations[serial % len(params.destinations)],
                    payload={"n": serial}, eligible_at=overdue if n >= live else None,
                )
            )  # fmt: skip
        try:
            await asyncio.gather(*calls)
        except PacerdError as exc:
            print(f"producer: {exc}", file=sys.stderr, flush=True)
        second += 1
        await clock.sleep_until(started + second)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pacerd_demo.producer", description=__doc__)
    p.add_argument("-c", "--config", default=None, help="pacerd config file (for the DSN)")
    p.add_argument("--destination", action="append", required=True, help="repeatable")
    p.add_argument("--rate", type=float, default=20.0, help="jobs per second")
    p.add_argument("--burst", type=int, default=0, help="overdue jobs per burst")
    p.add_argument("--burst-every", type=float, default=300.0, help="seconds between bursts")
    p.add_argument("--kind", default="demo.call")
    return p


def params_from_args(args: argparse.Namespace) -> ProducerParams:
    return ProducerParams(
        destinations=tuple(args.destination), rate=args.rate, burst=args.burst,
        burst_every_seconds=args.burst_every, kind=args.kind,
    )  # fmt: skip


async def _main(dsn: str, params: ProducerParams) -> None:
    clock = SystemClock()
    while True:
        try:
            client = await Client.connect(dsn, max_size=8)
            break
        except PacerdError as exc:
            print(f"producer: ledger unavailable ({exc}); retrying", file=sys.stderr, flush=True)
            await clock.sleep(2.0)
    async with client:
        await produce(client, params, clock=clock)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params = params_from_args(args)
        path = args.config or os.environ.get("PACERD_CONFIG")
        cfg = config_module.load_config(path if path and os.path.exists(path) else None)
    except (ValueError, PacerdError) as exc:
        print(f"producer: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_main(cfg.database.dsn, params))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
