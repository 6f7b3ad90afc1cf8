"""The demo's destinations in the simulation: each one's capacity schedule,
backlog and live trickle (``pacerd_demo.plan``), the demo's ``[pacing]``
(read from the demo's own configuration by pacerd's loader) and its workers
(3 workers x prefetch 32: 96 calls at once a destination), run by pacerd's
real admission in virtual time (``tests/sim/simdriver.py``). Refused calls
and the utilization of each seed, over the whole run and by phase (the
capacity schedule's points), so that a change of the law or of the demo's
plan can be tried on the demo's story before three real runs of it.

A ramp is simulated in steps of ``STEP_S``; calls take the destination's
median latency (lognormal), a 429 is answered at once, an outcome reaches
the ledger ~3 ms after its answer; no 5xx. Utilization here is accepted
calls over the capacity of the whole run (the demo's table counts only
the seconds with backlog due). Needs no services.

    .venv/bin/python -m bench.demo_sim                       # ~10 s
    .venv/bin/python -m bench.demo_sim --seeds 8 --duration 20   # quick mode's plan
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench import common
from pacerd.config import load_config
from pacerd_demo.plan import DemoPlan, DestinationPlan, capacity_calls, make_plan

if TYPE_CHECKING:
    from pacerd.pacer import PacingParams

STEP_S = 0.25  # a ramp's steps
PREFETCH = 32  # the demo app's, per destination and worker
REPORT_DELAY_S = 0.003


def demo_pacing(plan: DemoPlan, destination: str) -> PacingParams:
    """The law's parameters of ``destination`` in the demo's configuration."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "demo.toml"
        path.write_text(plan.config_toml("postgresql://localhost/unused", "amqp://localhost/"))
        return load_config(path, {}).pacing_for(destination)


def simulate(plan: DemoPlan, dest: DestinationPlan, seed: int) -> tuple[list[float], list[bool]]:
    """(arrival times, accepted) of every call of one simulated run."""
    common.simulation_importable()
    import simdriver
    import simlib

    d = plan.duration_seconds
    steps = range(int(d / STEP_S))
    phases = tuple((k * STEP_S, dest.schedule.rate_at((k + 0.5) * STEP_S)) for k in steps)
    sc = simlib.Scenario(
        name=dest.name,
        duration=d,
        phases=phases,
        burst_seconds=1.0,  # the demo's model upstreams' bucket
        retry_after=dest.retry_after,
        params=demo_pacing(plan, dest.name),
        ledgers=(simlib.LedgerSpec(backlog=dest.backlog, live_rate=dest.trickle_per_second),),
        workers=plan.workers * PREFETCH,
        latency_median=dest.latency_median_ms / 1000,
        report_delay_median=REPORT_DELAY_S,
        refusal_latency=False,
    )
    res = simdriver.run(sc, "pacerd", seed)
    return res.call_t, res.call_ok


def figures(dest: DestinationPlan, d: float, t: list[float], ok: list[bool]) -> list[object]:
    """Refused %, utilization, and refused calls in each phase of the schedule."""
    refused = len(ok) - sum(ok)
    cuts = sorted({0.0, d, *(p for p, _ in dest.schedule.points if 0 < p < d)})
    by_phase = [
        sum(1 for when, good in zip(t, ok, strict=True) if a <= when < b and not good)
        for a, b in itertools.pairwise(cuts)
    ]
    return [
        100.0 * refused / max(1, len(ok)),
        sum(ok) / capacity_calls(dest.schedule, 0.0, d),
        refused,
        " / ".join(map(str, by_phase)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0 to N-1 (default 4)")
    parser.add_argument(
        "--duration", type=float, default=None, help="the demo's run, seconds (default: its own)"
    )
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.duration is not None and args.duration <= 0:
        parser.error("--duration must be > 0")
    started = time.time()
    plan = make_plan() if args.duration is None else make_plan(duration_seconds=args.duration)
    d = plan.duration_seconds
    rows: list[list[object]] = []
    for dest in plan.destinations:
        got = [figures(dest, d, *simulate(plan, dest, seed)) for seed in range(args.seeds)]
        rows += [[dest.name, seed, *g] for seed, g in enumerate(got)]
        pct = [float(g[0]) for g in got]  # type: ignore[arg-type]
        util = [float(g[1]) for g in got]  # type: ignore[arg-type]
        rows.append([dest.name, "mean", statistics.mean(pct), statistics.mean(util), "", ""])
        rows.append([dest.name, "worst", max(pct), min(util), "", ""])
    headers = ["destination", "seed", "refused %", "utilization", "refused", "refused by phase"]
    print(f"the demo's plan of {d:g} s in the simulation, {args.seeds} seeds")
    print(common.table(headers, rows))
    print(f"\n{time.time() - started:.0f} s; {common.machine_description()}")


if __name__ == "__main__":
    main()
