"""Round trips of released jobs: from a job's release (its publish confirmed)
to its outcome applied, for ``pacerd.round_trip_seconds``.

The instance that released a job remembers when, in memory, by job id and
attempt, for at most the offer lease (a report after it is stale). When its
own outcome consumer applies the job's report, the round trip is known.
Instances share ``pacerd.outcomes``, so the outcomes another instance
consumes are not measured here: the figures are a sample, not a census.
Memory is bounded by what is in flight: an entry leaves when its outcome is
heard, or once it is older than the lease.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pacerd.clock import Clock


class ReleaseTimes:
    """When each job in flight was released here, and to which destination."""

    def __init__(self, clock: Clock, *, horizon_seconds: float) -> None:
        self.clock = clock
        self.horizon_seconds = horizon_seconds
        # insertion order is release order: the oldest entries come first
        self._at: dict[tuple[str, int], tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def released(self, destination: str, job_id: str, attempt: int) -> None:
        """``job_id`` at ``attempt`` was released to ``destination`` just now."""
        now = self.clock.monotonic()
        at = self._at
        key = (job_id, attempt)
        at.pop(key, None)  # released again: it moves to the end
        at[key] = (destination, now)
        oldest = now - self.horizon_seconds
        while at:
            key = next(iter(at))
            if at[key][1] >= oldest:
                break
            del at[key]

    def heard(self, job_id: str, attempt: int) -> tuple[str, float] | None:
        """(destination, seconds since its release) of a job released here
        whose outcome was just applied; None when it was not released here
        (another instance, or before this one started) or too long ago."""
        entry = self._at.pop((job_id, attempt), None)
        if entry is None:
            return None
        destination, at = entry
        seconds = self.clock.monotonic() - at
        return (destination, seconds) if seconds <= self.horizon_seconds else None
