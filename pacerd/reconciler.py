"""The reconciler: returns expired claims (no attempt spent) and expired
offers (an attempt spent; dead at the cap) to the ledger's due work, where
they re-enter through the pacer's budget like any other backlog — never as a
burst. It runs on every instance; ``FOR UPDATE SKIP LOCKED`` keeps concurrent
passes from touching the same rows, and each transition is fenced in SQL.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog

from pacerd.errors import PacerdError

if TYPE_CHECKING:
    from collections.abc import Callable

    from pacerd.clock import Clock
    from pacerd.ledger import Ledger
    from pacerd.telemetry import Telemetry

log = structlog.get_logger("pacerd.reconciler")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconcilerConfig:
    interval_seconds: float = 5.0
    batch_size: int = 1000

    def __post_init__(self) -> None:
        if self.interval_seconds <= 0:
            raise ValueError("interval_seconds must be > 0")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconcileResult:
    claims_returned: int = 0
    offers_returned: int = 0
    dead: int = 0
    per_destination: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.claims_returned + self.offers_returned + self.dead


class Reconciler:
    def __init__(
        self,
        *,
        ledger: Ledger,
        clock: Clock,
        config: ReconcilerConfig,
        on_result: Callable[[ReconcileResult], None] | None = None,
        telemetry: Telemetry | None = None,
        should_run: Callable[[], bool] = lambda: True,
    ) -> None:
        self.ledger = ledger
        self.clock = clock
        self.config = config
        self.on_result = on_result
        self.telemetry = telemetry
        self.should_run = should_run  # e.g. only on the instance holding the reconciler's lock

    async def run_once(self) -> ReconcileResult:
        """Reclaims expired leases in batches until a batch comes back short."""
        claims = offers = dead = 0
        per_destination: Counter[str] = Counter()
        while True:
            batch = await self.ledger.reclaim_expired(limit=self.config.batch_size)
            for job in batch:
                per_destination[job.destination] += 1
                if job.state == "dead":
                    dead += 1
                elif job.previous_state == "claimed":
                    claims += 1
                else:
                    offers += 1
            if len(batch) < self.config.batch_size:
                break
        result = ReconcileResult(
            claims_returned=claims,
            offers_returned=offers,
            dead=dead,
            per_destination=dict(per_destination),
        )
        if result.total:
            log.info(
                "leases_reclaimed",
                claims=claims,
                offers=offers,
                dead=dead,
                destinations=dict(per_destination),
            )
        if self.on_result is not None:
            self.on_result(result)
        return result

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """A pass every ``interval_seconds`` (when ``should_run``), in a
        ``reconcile`` span; a failed pass is logged and the next one runs."""
        task_status.started()
        deadline = self.clock.monotonic()
        while True:
            deadline += self.config.interval_seconds
            await self.clock.sleep_until(deadline)
            if not self.should_run():
                continue
            try:
                if self.telemetry is None:
                    await self.run_once()
                else:
                    with self.telemetry.reconcile_span():
                        await self.run_once()
            except PacerdError as exc:
                log.warning("reconcile_failed", error=str(exc))
            now = self.clock.monotonic()
            if now > deadline + self.config.interval_seconds:
                deadline = now  # missed passes are skipped, not replayed
