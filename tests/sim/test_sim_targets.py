"""Issue 3's simulation targets, asserted for the worst of ten seeds.

Each scenario runs once per seed (cached for the session); every target is its
own test, so a report names exactly what missed and by how much.
"""

from __future__ import annotations

import functools

import pytest
from scenarios import METRICS, SCENARIOS, TARGETS, Target
from simlib import run

SEEDS = range(10)


@functools.cache
def metrics(name: str) -> tuple[dict[str, float], ...]:
    return tuple(METRICS[name](run(SCENARIOS[name], "pacerd", seed)) for seed in SEEDS)


# Known misses: the target stays as written and the test fails loudly (strict)
# the day the law meets it.
KNOWN_MISSES = {
    ("S2", "jain_min"): "two instances reach a fair share in 155 s on the worst seed (Jain 0.963"
    " at 120 s), not within the 120 s the target asks: a larger increase step converges"
    " faster but breaks S1's refusal and oscillation targets",
}

CASES = [
    pytest.param(
        name,
        target,
        id=f"{name}:{target.metric}{target.op}{target.value:g}",
        marks=[pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[name, target.metric])]
        if (name, target.metric) in KNOWN_MISSES
        else [],
    )
    for name, targets in TARGETS.items()
    for target in targets
]


@pytest.mark.parametrize(("name", "target"), CASES)
def test_target_holds_for_the_worst_seed(name: str, target: Target) -> None:
    values = [m[target.metric] for m in metrics(name)]
    worst = target.worst(values)
    assert target.ok(worst), (
        f"{name}: {target.metric} = {worst:.4g} for the worst of {len(values)} seeds, "
        f"target {target.op} {target.value:g}; per seed: {[round(v, 4) for v in values]}"
    )
