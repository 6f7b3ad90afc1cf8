"""The producer and operator API: the ``pacerd.*`` SQL functions from Python,
plus the read-only views the CLI prints (show, dead, status).

Every write goes through the public SQL functions, exactly as a producer in
another language would call them; reads use the documented tables. The
statements are the client's named blocks of ``sql/queries.sql`` (the last
section), each named for the method that sends it.
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


def dead_statement(name: str, selection: DeadFilter, first_param: int) -> tuple[str, list[object]]:
    """The template block ``name`` of ``sql/queries.sql`` (dead, count_dead,
    replay_matching) with ``selection``'s conditions in its ``{where}``, their
    placeholders numbered from ``first_param``, and the placeholder after them
    in its ``{limit}``; and the conditions' arguments."""
    where, args = selection.where(first_param)
    sql = load_queries()[name].sql.format(where=where, limit=f"${first_param + len(args)}")
    return sql, args


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
        self.queries = load_queries()

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 4, stateless: bool = False) -> Client:
        """``stateless``: the caller changes no session state (see
        ``ledger.connect_pool``), so connections go back to the pool as they are."""
        return cls(await connect_pool(dsn, min_size=1, max_size=max_size, stateless=stateless))

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

    def _sql(self, name: str) -> str:
        return self.queries[name].sql

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
            self._sql("schedule"),
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
            self._sql("report"),
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
        result: str = await self._val(self._sql("cancel"), job_id, reason)
        return result

    async def replay(self, job_id: str, reason: str) -> str:
        result: str = await self._val(self._sql("replay"), job_id, reason)
        return result

    async def is_current(self, job_id: str, attempt: int) -> bool:
        result: bool = await self._val(self._sql("is_current"), job_id, attempt)
        return result

    async def are_current(self, offers: Sequence[tuple[str, int]]) -> list[bool]:
        """``is_current`` for many ``(job_id, attempt)`` at once, in their order: one statement."""
        if not offers:
            return []
        with translate_errors():
            rows = await self.pool.fetch(
                self._sql("are_current"),
                [job_id for job_id, _ in offers],
                [attempt for _, attempt in offers],
            )
        return [bool(row[0]) for row in rows]

    async def pause(self, destination: str | None = None) -> str:
        result: str = await self._val(self._sql("pause"), destination)
        return result

    async def resume(self, destination: str | None = None) -> str:
        result: str = await self._val(self._sql("resume"), destination)
        return result

    # -- operator views --------------------------------------------------------

    async def show(self, job_id: str) -> tuple[JobView, list[JobEvent]] | None:
        with translate_errors():
            row = await self.pool.fetchrow(self._sql("show_job"), job_id)
            if row is None:
                return None
            events = await self.pool.fetch(self._sql("show_events"), job_id)
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
        sql, args = dead_statement("dead", selection, 1)
        with translate_errors():
            rows = await self.pool.fetch(sql, *args, limit)
        return [_job_view(r) for r in rows]

    async def count_dead(self, selection: DeadFilter) -> int:
        sql, args = dead_statement("count_dead", selection, 1)
        result: int = await self._val(sql, *args)
        return result

    async def replay_matching(self, selection: DeadFilter, reason: str, *, limit: int) -> int:
        """Replays up to ``limit`` dead jobs matching ``selection``, each
        through ``pacerd.replay`` with ``reason``; returns how many."""
        sql, args = dead_statement("replay_matching", selection, 3)
        result: int = await self._val(sql, reason, limit, *args)
        return result

    async def status(self) -> list[DestinationStatus]:
        """Per destination: pause, due, oldest-due age, in flight, dead, and the
        pacer's last decision as its leader persisted it."""
        with translate_errors():
            now: dt.datetime = await self.pool.fetchval(self._sql("status_now"))
            rows = await self.pool.fetch(self._sql("status"))
            summary = await self.pool.fetch(self._sql("due_summary"), now, False)
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
