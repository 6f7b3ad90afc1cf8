"""pacerd's pacing law against a plain halving AIMD, in the deterministic simulation.

    .venv/bin/python -m bench.sim_compare                 # all scenarios, 10 seeds
    .venv/bin/python -m bench.sim_compare --seeds 3 S1 S2 # a subset
    .venv/bin/python -m bench.sim_compare --first-seed 10 --seeds 20 S2
                                                          # seeds the tests do not use

Runs every scenario of ``tests/sim/scenarios.py`` (issue 3's S1..S7, the model
upstream and worker pool of ``tests/sim/simlib.py``) through pacerd's real
admission (``tests/sim/simdriver.py``: ``pacerd.admission`` over in-memory
fakes, in virtual time) with pacerd's law and with the baseline "halve on
refusal, +1 job/s on a clean tick" as admission's ``law`` (same budget
arithmetic, sub-tick spacing, lanes and Retry-After closure: only the law
differs), and prints one markdown table: per scenario and metric, the worst
value over the seeds for each law, and the target it is held to. Each
scenario of each law runs once per seed, in a pool of processes; the metrics
are defined in the docstring of ``tests/sim/scenarios.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SIM_DIR = Path(__file__).resolve().parent.parent / "tests" / "sim"
# the simulation's modules import each other flatly, and the shared fakes as ``support``
IMPORT_DIRS = (str(SIM_DIR.parent), str(SIM_DIR))


def _on_path() -> None:
    for folder in IMPORT_DIRS:
        if folder not in sys.path:
            sys.path.insert(0, folder)


LAWS = ("pacerd", "halving")


def _metrics(job: tuple[str, str, int]) -> tuple[str, str, int, dict[str, float]]:
    _on_path()
    import scenarios

    name, law, seed = job
    return name, law, seed, scenarios.measure(name, law, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", help="scenario names (default: all)")
    parser.add_argument("--seeds", type=int, default=10, help="how many seeds")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the first seed (default 0: the tests' seeds; 10 on: seeds they do not use)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    _on_path()
    import scenarios

    names = args.scenarios or list(scenarios.SCENARIOS)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(n, law, s) for n in names for law in LAWS for s in seeds]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(_metrics, jobs))
    elapsed = time.perf_counter() - started

    by: dict[tuple[str, str], list[dict[str, float]]] = {}
    for name, law, _, m in results:
        by.setdefault((name, law), []).append(m)
    print(
        f"Worst of {args.seeds} seeds ({seeds.start}..{seeds.stop - 1}) per metric"
        " (pacerd vs halving AIMD baseline; a miss says on how many seeds).\n"
    )
    print("| scenario | metric | target | pacerd | halving |")
    print("|---|---|---|---|---|")
    misses = 0
    for name in names:
        targets = {t.metric: t for t in scenarios.TARGETS[name]}
        extra = {
            (t.metric, t.op): t
            for t in scenarios.TARGETS[name]
            if targets[t.metric] is not t  # a second bound on the same metric
        }
        for metric in by[(name, "pacerd")][0]:
            bounds = [t for t in (targets.get(metric),) if t] + [
                t for (m, _), t in extra.items() if m == metric
            ]
            cells = []
            for law in LAWS:
                values = [m[metric] for m in by[(name, law)]]
                if bounds:
                    shown = [b.worst(values) for b in bounds]
                    text = " / ".join(_fmt(v) for v in dict.fromkeys(shown))
                    # the worst seed misses a bound exactly when some seed does
                    missed = sum(not all(b.ok(v) for b in bounds) for v in values)
                    verdict = f"MISS ({missed} of {len(values)})" if missed else "ok"
                    cells.append(f"{text} {verdict}")
                    misses += law == "pacerd" and missed > 0
                else:  # reported, not a target: the worst is the low end for rates
                    low = metric.startswith("util") or metric == "jain_min"
                    cells.append(_fmt(min(values) if low else max(values)))
            target = " and ".join(f"{b.op} {b.value:g}" for b in bounds) or "(reported)"
            print(f"| {name} | {metric} | {target} | {cells[0]} | {cells[1]} |")
    print(
        f"\n{len(jobs)} runs in {elapsed:.0f} s on {args.workers} worker(s); "
        f"pacerd misses {misses} target(s)."
    )
    return 0


def _fmt(v: float) -> str:
    if v != v or v in (float("inf"), float("-inf")):
        return str(v)
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
