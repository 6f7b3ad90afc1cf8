"""The CPU a destination's tick costs the daemon outside its I/O, per
destination-tick, for the parts that run once per tick of every active
destination: the tick's telemetry (``TelemetryObserver.tick_completed`` with
Prometheus metrics, spans not recorded, logs at ``info``), reading its row
(``pacer_state`` as the ledger returns it, text), and its state saved
(``PacerState.to_dict`` and the JSON the save sends).

    .venv/bin/python -m bench.tick_cost                 # ~10 s
    cd TREE && PYTHONPATH=TREE /path/to/.venv/bin/python -m bench.tick_cost   # another tree

No database, no broker: each part runs ``--destinations`` times (one tick of
each), ``--rounds`` times; the best round is printed, in microseconds per
destination-tick. The daemon's whole cost per tick (publishing, confirms,
outcomes, statements) is ``bench.fanout``'s to measure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pacerd import ledger
from pacerd.admission import TickResult
from pacerd.clock import SystemClock
from pacerd.observer import TelemetryObserver
from pacerd.pacer import Demand, OutcomeWindow, PacerState, PacingParams, initial_state, plan_tick
from pacerd.telemetry import setup_telemetry

if TYPE_CHECKING:
    from collections.abc import Callable


def best_us(run: Callable[[], None], count: int, rounds: int) -> float:
    """The fastest of ``rounds`` runs of ``run`` (``count`` ticks), in µs a tick."""
    run()  # warm
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--destinations", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    names = [f"tenant-{i:05d}" for i in range(args.destinations)]

    telemetry = setup_telemetry(
        log_level="info", log_format="json", prometheus=True,
        prometheus_registry=CollectorRegistry(), log_stream=io.StringIO(),
    )  # fmt: skip
    observer = TelemetryObserver(telemetry, SystemClock())
    results = [
        TickResult(
            destination=name,
            rate=2.0,
            budget=2,
            claimed=2,
            offered=2,
            inflight=3,
            accepted=2,
            planning_seconds=0.1,
        )
        for name in names
    ]
    for name in names:
        observer.due[name] = (5, 3.0)

    def telemetry_ticks() -> None:
        for result in results:
            observer.tick_completed(result)

    params = PacingParams(initial_rate=2.0, max_rate=2.0, tick_seconds=1.0)
    window, demand = OutcomeWindow(accepted=2, accepted_fresh=2), Demand(budget=2, admitted=2)
    states = [initial_state(params, now=0.0) for _ in names]
    clock = [0.0]

    def plans() -> None:
        clock[0] += 1.0
        for i, before in enumerate(states):
            states[i], _ = plan_tick(
                before, window, demand, now=clock[0], inflight=2, params=params
            )

    state = PacerState(rate=2.0, ceiling=2.5, delivered=1.9, round_trip_s=0.3)
    saved = json.dumps({"pacer": state.to_dict(), "tick": {"rate": 2.0, "budget": 2}})
    now = dt.datetime.now(dt.UTC)
    record = {
        "destination": "d", "paused": False, "paused_all": False, "cooldown_until": None,
        "epoch": 3, "pacer_state": saved, "n_accepted": 10, "n_refused": 1,
        "n_accepted_fresh": 10, "n_refused_fresh": 1, "n_retry_after": 0, "leader": "a",
        "leader_since": now, "now": now, "inflight": 2,
    }  # fmt: skip
    read = ledger._destination_row  # the ledger's own mapping of a row

    def reads() -> None:
        for _ in names:
            read(record)  # type: ignore[arg-type]  # a dict reads as the record does

    def saves() -> None:
        for _ in names:
            json.dumps({"pacer": state.to_dict(), "tick": {"rate": state.rate, "budget": 2}})

    for label, run in (
        ("pacer's plan (plan_tick)", plans),
        ("tick telemetry (tick_completed)", telemetry_ticks),
        ("row read (as the tick's read returns it)", reads),
        ("state saved (to_dict + JSON)", saves),
    ):
        print(f"{label:45s} {best_us(run, len(names), args.rounds):7.1f} µs per destination-tick")
    telemetry.shutdown()


if __name__ == "__main__":
    main()
