"""The pacing law (AIMD per destination) and the tick arithmetic. Pure: no I/O,
no asyncio, standard library only; time arrives as arguments.

(Skeleton: the parameters are fixed here so that config.py can mirror them.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class PacingParams:
    """The `[pacing]` keys of the config, as the law sees them."""

    tick_seconds: float = 1.0
    initial_rate: float = 10.0
    min_rate: float = 1.0
    max_rate: float = 10_000.0
    increase_step: float = 2.0
    decrease_factor: float = 0.5
    decrease_margin: float = 0.05
    refusal_threshold: float = 0.02
    max_inflight: int = 2000
    live_share: float = 0.2
    live_window_seconds: float = 60.0
    slow_start_factor: float = 2.0
    refusal_min_count: int = 2
    ceiling_resume_fraction: float = 0.9
