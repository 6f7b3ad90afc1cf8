"""How calls arrive at the upstream, from a ``bench.real_scenarios --calls
FILE``: for every scenario and run (pacerd, the simulation, botocore), over
the calls from ``--from`` seconds after the resume on (past slow start) to
the last one: the rate; the index of dispersion of the calls counted in bins
of 10 and 50 ms (variance / mean: 1 for a Poisson stream, under 1 for
calls spread evenly, over 1 for bunches); the gaps between consecutive calls
(p10 / p50 / p90); the refusals, and how many of them came within
``CLUSTER_S`` of another refusal (a bunch that a small bucket refused
together). The simulation is faithful to the real path's arrivals when its
figures sit beside pacerd's.

    .venv/bin/python -m bench.real_scenarios --only drain,deepcut --no-peer --calls /tmp/calls.json
    .venv/bin/python -m bench.arrivals /tmp/calls.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from bench import common

CLUSTER_S = 0.02
BINS_S = (0.01, 0.05)


def dispersion(times: list[float], start: float, end: float, width: float) -> float:
    """Variance / mean of the calls counted in bins of ``width`` seconds."""
    n = max(1, int((end - start) / width))
    counts = [0] * n
    for t in times:
        counts[min(n - 1, int((t - start) / width))] += 1
    mean = statistics.fmean(counts)
    return statistics.pvariance(counts) / mean if mean > 0 else float("nan")


def describe(calls: list[list[float]], start: float) -> list[object]:
    times = [t for t, _ in calls if t >= start]
    if len(times) < 3:
        return ["–"] * 8
    end = times[-1]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))

    def gap(q: float) -> float:
        return 1000.0 * gaps[round(q * (len(gaps) - 1))]

    refused = [t for t, ok in calls if t >= start and not ok]
    together = sum(
        1
        for i, t in enumerate(refused)
        if (i > 0 and t - refused[i - 1] < CLUSTER_S)
        or (i + 1 < len(refused) and refused[i + 1] - t < CLUSTER_S)
    )
    return [
        len(times) / max(1e-9, end - start),
        *(dispersion(times, start, end, w) for w in BINS_S),
        gap(0.1),
        gap(0.5),
        gap(0.9),
        len(refused),
        together,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calls", help="the file of bench.real_scenarios --calls")
    parser.add_argument(
        "--from", dest="start", type=float, default=5.0,
        help="seconds after the resume to start from (default 5: past slow start)",
    )  # fmt: skip
    args = parser.parse_args()
    data: dict[str, dict[str, list[list[float]]]] = json.loads(Path(args.calls).read_text())
    rows = [
        [scenario, who, *describe(calls, args.start)]
        for scenario, runs in data.items()
        for who, calls in runs.items()
    ]
    headers = ["scenario", "run", "calls/s", "dispersion 10 ms", "dispersion 50 ms",
               "gap p10 ms", "gap p50 ms", "gap p90 ms", "refused",
               f"refused within {CLUSTER_S * 1000:g} ms of another"]  # fmt: skip
    print(common.table(headers, rows))


if __name__ == "__main__":
    main()
