"""The ledger's vocabulary as Python values: job states, outcomes and the rows
the ledger hands to its callers (frozen dataclasses, never driver records).

Values only: no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Mapping


class JobState(enum.StrEnum):
    """A job's state; the values are the SQL values."""

    SCHEDULED = "scheduled"
    CLAIMED = "claimed"
    OFFERED = "offered"
    COMPLETED = "completed"
    DEAD = "dead"
    CANCELLED = "cancelled"

    @property
    def closed(self) -> bool:
        return self in (JobState.COMPLETED, JobState.DEAD, JobState.CANCELLED)


class Outcome(enum.StrEnum):
    """A worker's report on one attempt (docs/protocol.md, `pacerd.report`)."""

    OK = "ok"
    REFUSED = "refused"
    RETRY = "retry"
    FAIL = "fail"
    CONTINUE = "continue"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRef:
    """One attempt of one job: the fencing pair."""

    job_id: str
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimRequest:
    """What a tick claims for one destination (one statement serves many)."""

    destination: str
    live_limit: int
    limit: int
    claim_seconds: float
    epoch: int
    live_window_seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimedJob:
    """A job claimed by a tick, ready to publish. JSON fields stay encoded."""

    job_id: str
    kind: str
    destination: str
    attempt: int
    revision: int
    payload_json: str
    cursor_json: str | None
    eligible_at: dt.datetime
    live: bool

    @property
    def ref(self) -> JobRef:
        return JobRef(job_id=self.job_id, attempt=self.attempt)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReclaimedJob:
    """A job whose claim or offer lease expired and that the reconciler returned."""

    job_id: str
    attempt: int
    destination: str
    previous_state: JobState
    state: JobState


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """An outcome report, as `pacerd.report` takes it."""

    job_id: str
    attempt: int
    outcome: Outcome
    retry_after_s: float | None = None
    error: str | None = None
    detail: dict[str, Any] | None = None
    cursor: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationRow:
    """One destination's shared state and outcome counters."""

    destination: str
    paused: bool
    paused_all: bool
    cooldown_until: dt.datetime | None
    epoch: int
    pacer_state: Mapping[str, Any] | None  # the persisted JSON object
    n_accepted: int
    n_refused: int
    n_accepted_fresh: int
    n_refused_fresh: int
    n_retry_after: int
    leader: str | None
    leader_since: dt.datetime | None
    now: dt.datetime
    # Its claimed and offered jobs, when read with the row (the top of a
    # tick: ``read_destination(..., inflight=True)``); None when not asked for.
    inflight: int | None = None

    @property
    def effectively_paused(self) -> bool:
        return self.paused or self.paused_all

    @property
    def cooldown_remaining_seconds(self) -> float:
        if self.cooldown_until is None:
            return 0.0
        return max(0.0, (self.cooldown_until - self.now).total_seconds())

    @property
    def closed(self) -> bool:
        """Paused, or in a Retry-After cool-down: nothing may be released."""
        return self.effectively_paused or self.cooldown_remaining_seconds > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class DueSummary:
    """Per-destination counts for status and metrics (counts rows: slow cadence)."""

    destination: str
    due: int
    oldest_scheduled_at: dt.datetime | None
    inflight: int
    dead: int


@dataclass(frozen=True, slots=True, kw_only=True)
class JobView:
    """A job as `pacerd show` prints it."""

    job_id: str
    kind: str
    destination: str
    state: JobState
    attempt: int
    failures: int
    max_attempts: int
    next_attempt_at: dt.datetime
    revision: int
    payload: Any
    cursor: Any
    last_error: str | None
    lease_expires_at: dt.datetime | None
    created_at: dt.datetime
    updated_at: dt.datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent:
    """One row of a job's history (`pacerd.job_events`)."""

    id: int
    job_id: str
    attempt: int
    event: str
    at: dt.datetime
    detail: Any
