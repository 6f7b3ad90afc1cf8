"""The producer and operator API: the ``pacerd.*`` SQL functions from Python,
plus the read-only views the CLI prints (show, dead, status).

Every write goes through the public SQL functions, exactly as a producer in
another language would call them; reads use the documented tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from pacerd.ledger import connect_pool, load_queries, translate_errors
from pacerd.models import DueSummary, JobEvent, JobState, JobView, Outcome

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Mapping, Sequence
    from types import TracebackType

    import asyncpg

_JOB_COLUMNS = (
    "job_id, kind, destination, state, attempt, failures, max_attempts, next_attempt_at,"
    " revision, payload, cursor, last_error, lease_expires_at, created_at, updated_at"
)


def _job_view(r: asyncpg.Record) -> JobView:
    return JobView(
        job_id=r["job_id"],
        kind=r["kind"],
        destination=r["destination"],
        state=JobState(r["state"]),
        attempt=r["attempt"],
        failures=r["failures"],
        max_attempts=r["max_attempts"],
        next_attempt_at=r["next_attempt_at"],
        revision=r["revision"],
        payload=r["payload"],
        cursor=r["cursor"],
        last_error=r["last_error"],
        lease_expires_at=r["lease_expires_at"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadFilter:
    """Which dead jobs a bulk replay or `pacerd dead` selects (all given must match)."""

    destination: str | None = None
    kind: str | None = None
    error_contains: str | None = None
    dead_since: dt.datetime | None = None

    def where(self, first_param: int) -> tuple[str, list[object]]:
        clauses, args = ["state = 'dead'"], list[object]()
        if self.destination is not None:
            args.append(self.destination)
            clauses.append(f"destination = ${first_param + len(args) - 1}")
        if self.kind is not None:
            args.append(self.kind)
            clauses.append(f"kind = ${first_param + len(args) - 1}")
        if self.error_contains is not None:
            args.append(self.error_contains)
            clauses.append(f"strpos(coalesce(last_error, ''), ${first_param + len(args) - 1}) > 0")
        if self.dead_since is not None:
            args.append(self.dead_since)
            clauses.append(f"updated_at >= ${first_param + len(args) - 1}")
        return " AND ".join(clauses), args


@dataclass(frozen=True, slots=True, kw_only=True)
class DestinationStatus:
    """One destination as `pacerd status` shows it."""

    destination: str
    paused: bool
    paused_all: bool
    cooldown_remaining_seconds: float
    due: int
    oldest_due_age_seconds: float | None
    inflight: int
    dead: int
    rate: float | None
    budget: int | None
    refusal_ratio: float | None
    drain_eta_seconds: float | None
    leader: str | None
    leader_since: dt.datetime | None
    n_accepted: int
    n_refused: int


class Client:
    """An asyncpg-based client for producers, workers and operators."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 4) -> Client:
        return cls(await connect_pool(dsn, min_size=1, max_size=max_size))

    async def close(self) -> None:
        await self.pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _val(self, sql: str, *args: object) -> Any:
        with translate_errors():
            return await self.pool.fetchval(sql, *args)

    # -- the SQL API ---------------------------------------------------------

    async def schedule(
        self,
        job_id: str,
        *,
        kind: str,
        destination: str,
        payload: Any,
        eligible_at: dt.datetime | None = None,
        revision: int = 0,
        max_attempts: int | None = None,
    ) -> str:
        """'scheduled', 'revised' or 'unchanged' (see docs/protocol.md)."""
        result: str = await self._val(
            "SELECT pacerd.schedule(job_id => $1, kind => $2, destination => $3, payload => $4,"
            " eligible_at => coalesce($5, now()), revision => $6, max_attempts => $7)",
            job_id,
            kind,
            destination,
            payload,
            eligible_at,
            revision,
            max_attempts,
        )
        return result

    async def report(
        self,
        job_id: str,
        attempt: int,
        outcome: Outcome | str,
        *,
        retry_after_s: float | None = None,
        error: str | None = None,
        detail: Mapping[str, Any] | None = None,
        cursor: Any = None,
    ) -> str:
        """'applied', 'stale' or 'unknown'."""
        result: str = await self._val(
            "SELECT pacerd.report(job_id => $1, attempt => $2, outcome => $3,"
            " retry_after_s => $4, error => $5, detail => $6, cursor => $7)",
            job_id,
            attempt,
            str(outcome),
            retry_after_s,
            error,
            dict(detail) if detail is not None else None,
            cursor,
        )
        return result

    async def cancel(self, job_id: str, reason: str | None = None) -> str:
        result: str = await self._val("SELECT pacerd.cancel($1, $2)", job_id, reason)
        return result

    async def replay(self, job_id: str, reason: str) -> str:
        result: str = await self._val("SELECT pacerd.replay($1, $2)", job_id, reason)
        return result

    async def is_current(self, job_id: str, attempt: int) -> bool:
        result: bool = await self._val("SELECT pacerd.is_current($1, $2)", job_id, attempt)
        return result

    async def are_current(self, offers: Sequence[tuple[str, int]]) -> list[bool]:
        """``is_current`` for many ``(job_id, attempt)`` at once, in their order: one statement."""
        if not offers:
            return []
        with translate_errors():
            rows = await self.pool.fetch(
                "SELECT pacerd.is_current(j, a) FROM unnest($1::text[], $2::int[])"
                " WITH ORDINALITY AS t(j, a, n) ORDER BY n",
                [job_id for job_id, _ in offers],
                [attempt for _, attempt in offers],
            )
        return [bool(row[0]) for row in rows]

    async def pause(self, destination: str | None = None) -> str:
        result: str = await self._val("SELECT pacerd.pause($1)", destination)
        return result

    async def resume(self, destination: str | None = None) -> str:
        result: str = await self._val("SELECT pacerd.resume($1)", destination)
        return result

    # -- operator views --------------------------------------------------------

    async def show(self, job_id: str) -> tuple[JobView, list[JobEvent]] | None:
        with translate_errors():
            row = await self.pool.fetchrow(
                f"SELECT {_JOB_COLUMNS} FROM pacerd.jobs WHERE job_id = $1", job_id
            )
            if row is None:
                return None
            events = await self.pool.fetch(
                "SELECT id, job_id, attempt, event, at, detail FROM pacerd.job_events"
                " WHERE job_id = $1 ORDER BY id",
                job_id,
            )
        return _job_view(row), [
            JobEvent(
                id=e["id"],
                job_id=e["job_id"],
                attempt=e["attempt"],
                event=e["event"],
                at=e["at"],
                detail=e["detail"],
            )
            for e in events
        ]

    async def dead(self, selection: DeadFilter, *, limit: int = 100) -> list[JobView]:
        where, args = selection.where(1)
        with translate_errors():
            rows = await self.pool.fetch(
                f"SELECT {_JOB_COLUMNS} FROM pacerd.jobs WHERE {where}"
                f" ORDER BY updated_at DESC, job_id LIMIT ${len(args) + 1}",
                *args,
                limit,
            )
        return [_job_view(r) for r in rows]

    async def count_dead(self, selection: DeadFilter) -> int:
        where, args = selection.where(1)
        result: int = await self._val(f"SELECT count(*) FROM pacerd.jobs WHERE {where}", *args)
        return result

    async def replay_matching(self, selection: DeadFilter, reason: str, *, limit: int) -> int:
        """Replays up to ``limit`` dead jobs matching ``selection``, each
        through ``pacerd.replay`` with ``reason``; returns how many."""
        where, args = selection.where(3)
        result: int = await self._val(
            "SELECT count(*) FILTER (WHERE pacerd.replay(job_id, $1) = 'replayed') FROM ("
            f" SELECT job_id FROM pacerd.jobs WHERE {where} ORDER BY updated_at, job_id"
            " LIMIT $2 FOR UPDATE SKIP LOCKED) s",
            reason,
            limit,
            *args,
        )
        return result

    async def status(self) -> list[DestinationStatus]:
        """Per destination: pause, due, oldest-due age, in flight, dead, and the
        pacer's last decision as its leader persisted it."""
        with translate_errors():
            now: dt.datetime = await self.pool.fetchval("SELECT now()")
            rows = await self.pool.fetch(
                "SELECT d.destination, d.paused, c.paused_all, d.cooldown_until,"
                " d.pacer_state::text AS pacer_state, p.leader, p.leader_since,"
                " d.n_accepted, d.n_refused"
                " FROM pacerd.destinations d CROSS JOIN pacerd.control c"
                " LEFT JOIN pacerd.partitions p ON p.partition = d.partition"
                " ORDER BY d.destination"
            )
            summary = await self.pool.fetch(load_queries()["due_summary"].sql, now, False)
        dues = {
            s["destination"]: DueSummary(
                destination=s["destination"],
                due=s["due"],
                oldest_scheduled_at=s["oldest_due_at"],
                inflight=s["inflight"],
                dead=s["dead"],
            )
            for s in summary
        }
        out = []
        for r in rows:
            due = dues[r["destination"]]
            persisted = json.loads(r["pacer_state"]) if r["pacer_state"] else {}
            tick = persisted.get("tick", {}) if isinstance(persisted, dict) else {}
            rate = tick.get("rate")
            cooldown = r["cooldown_until"]
            out.append(
                DestinationStatus(
                    destination=r["destination"],
                    paused=r["paused"],
                    paused_all=r["paused_all"],
                    cooldown_remaining_seconds=max(0.0, (cooldown - now).total_seconds())
                    if cooldown
                    else 0.0,
                    due=due.due,
                    oldest_due_age_seconds=(now - due.oldest_scheduled_at).total_seconds()
                    if due.oldest_scheduled_at
                    else None,
                    inflight=due.inflight,
                    dead=due.dead,
                    rate=rate,
                    budget=tick.get("budget"),
                    refusal_ratio=tick.get("refusal_ratio"),
                    drain_eta_seconds=due.due / rate if rate and due.due else None,
                    leader=r["leader"],
                    leader_since=r["leader_since"],
                    n_accepted=r["n_accepted"],
                    n_refused=r["n_refused"],
                )
            )
        return out
