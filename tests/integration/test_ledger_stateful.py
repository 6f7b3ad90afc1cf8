"""A Hypothesis state machine against the real PostgreSQL ledger.

Rules drive what producers, the tick loop, workers, operators and the
reconciler do (schedule, claim, confirm, release, report every outcome with
current and stale attempts, cancel, replay, lease expiry, time passing); a
plain Python model predicts every result. After every step the whole ledger is
read back and compared with the model: no job lost or duplicated, states and
counters equal, every transition in the history, nothing but due work
claimable (never a dead or a future job).

Time. The daemon's statements take ``now=``: the model keeps a virtual clock
``V``, two days ahead of the wall clock, so claims, confirms and expiry are
exact. The SQL API reads the database's ``now()`` (the wall clock ``W``): where
the ledger derives a time from it (a retry's jittered backoff, Retry-After, a
continuation, a replay), the model accepts any value within the promised
bounds around the call, then adopts the value the ledger chose.

The machine is synchronous; it drives asyncpg on an event loop of its own,
and the whole run uses one fresh database (``db_dsn``), emptied between
examples.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pacerd import ledger
from pacerd.models import JobRef

if TYPE_CHECKING:
    from collections.abc import Coroutine

pytestmark = pytest.mark.services

T = TypeVar("T")

JOB_IDS = ("j0", "j1", "j2", "j3", "j4")
GHOST = "ghost"  # never scheduled: 'unknown'
DESTINATIONS = ("a", "b")
CLAIM_SECONDS = 30.0
OFFER_SECONDS = 60.0
LIVE_WINDOW_SECONDS = 600.0
DEFAULT_MAX_ATTEMPTS = 3
BACKOFF_BASE_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 4.0
SLACK = dt.timedelta(milliseconds=500)  # Python's clock against PostgreSQL's now()
CLOSED = ("completed", "dead", "cancelled")
# docs/protocol.md puts reclaimed leases in the backlog lane (test_ledger.py::
# test_a_reclaimed_claim_is_backlog).
RECLAIMED_CLAIM_IS_BACKLOG = True
IN_FLIGHT = ("claimed", "offered")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def secs(n: float) -> dt.timedelta:
    return dt.timedelta(seconds=n)


@dataclass
class ModelJob:
    destination: str
    state: str
    attempt: int
    failures: int
    max_attempts: int
    revision: int
    next_lo: dt.datetime  # next_attempt_at is known to lie in [next_lo, next_hi]
    next_hi: dt.datetime
    lease: dt.datetime | None = None
    ever_offered: bool = False
    cursor: Any = None
    events: list[str] = field(default_factory=list)

    @property
    def next_at(self) -> dt.datetime:
        assert self.next_lo == self.next_hi, "next_attempt_at not pinned yet"
        return self.next_lo


@dataclass
class Harness:
    """One event loop, one database, shared by every example of the run."""

    loop: asyncio.AbstractEventLoop
    led: ledger.Ledger
    conn: asyncpg.Connection  # a producer's plain connection: no codecs
    wall_start: dt.datetime

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self, harness: Harness) -> None:
        super().__init__()
        self.h = harness
        self.h.run(
            self.h.conn.execute(
                "TRUNCATE pacerd.jobs, pacerd.job_events, pacerd.destinations;"
                " UPDATE pacerd.control SET paused_all = false, paused_at = NULL"
            )
        )
        self.model: dict[str, ModelJob] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.now = harness.wall_start + dt.timedelta(days=2)  # V, the daemon's pinned clock
        # Per destination, bounds on the Retry-After cool-down's end: no claim before it.
        self.cooldown: dict[str, tuple[dt.datetime, dt.datetime]] = {}
        self.serial = 0

    # -- helpers ---------------------------------------------------------------

    def _fetchval(self, query: str, *args: object) -> Any:
        return self.h.run(self.h.conn.fetchval(query, *args))

    def _count(self, destination: str, key: str) -> None:
        per = self.counts.setdefault(destination, {"accepted": 0, "refused": 0, "retry_after": 0})
        per[key] += 1

    def _closed(self, destination: str) -> bool:
        """Whether a Retry-After still closes the destination at V."""
        lo, hi = self.cooldown.get(destination, (self.now, self.now))
        assert lo > self.now or hi <= self.now, "ambiguous cool-down"
        return lo > self.now

    def _due(self, destination: str) -> list[tuple[str, ModelJob]]:
        if self._closed(destination):
            return []
        return [
            (job_id, m)
            for job_id, m in self.model.items()
            if m.destination == destination and m.state == "scheduled" and m.next_at <= self.now
        ]

    def _is_live(self, m: ModelJob) -> bool:
        return not m.ever_offered and m.next_at > self.now - secs(LIVE_WINDOW_SECONDS)

    def _ids(self, *states: str) -> list[str]:
        return sorted(j for j, m in self.model.items() if not states or m.state in states)

    def _pick(self, data: st.DataObject, preferred: list[str], *, others: bool = True) -> str:
        """Mostly a job in ``preferred``; sometimes any job or one never scheduled."""
        if preferred and (not others or data.draw(st.integers(0, 3), label="prefer") > 0):
            return data.draw(st.sampled_from(preferred), label="job_id")
        return data.draw(st.sampled_from([*self._ids(), GHOST]), label="job_id")

    # -- producers ---------------------------------------------------------------

    @initialize(n=st.integers(1, len(JOB_IDS)), when=st.sampled_from(["backlog", "live"]))
    def populate(self, n: int, when: str) -> None:
        for i in range(n):
            self._schedule(JOB_IDS[i], DESTINATIONS[i % 2], 0, when, None)

    @rule(data=st.data())
    def produce(self, data: st.DataObject) -> None:
        """A producer: a new job, a revision, a repeat; sometimes a cancel."""
        if data.draw(st.integers(0, 4), label="cancel?") == 0:
            self._cancel(self._pick(data, self._ids("scheduled", *IN_FLIGHT)))
        else:
            self._schedule(
                data.draw(st.sampled_from(JOB_IDS), label="job_id"),
                data.draw(st.sampled_from(DESTINATIONS), label="destination"),
                data.draw(st.sampled_from([1, 1, 0, -1]), label="revision_step"),
                data.draw(
                    st.sampled_from(["backlog", "backlog", "live", "live", "future", "far"]),
                    label="when",
                ),
                data.draw(st.sampled_from([None, None, 1, 2]), label="max_attempts"),
            )

    def _schedule(
        self,
        job_id: str,
        destination: str,
        revision_step: int,
        when: str,
        max_attempts: int | None,
    ) -> None:
        """A new job, a revision (higher) or a repeat (same or lower revision)."""
        self.serial += 1
        offset = {
            "backlog": -secs(7200),
            "live": -secs(60),
            "future": dt.timedelta(hours=6),
            "far": dt.timedelta(days=400),
        }[when]
        eligible_at = self.now + offset + dt.timedelta(milliseconds=self.serial)  # no ties
        old = self.model.get(job_id)
        revision = max(0, (old.revision if old else 0) + revision_step)
        result = self._fetchval(
            "SELECT pacerd.schedule(job_id => $1, kind => 'k', destination => $2,"
            " payload => $3::jsonb, eligible_at => $4, revision => $5, max_attempts => $6)",
            job_id,
            destination,
            json.dumps({"serial": self.serial}),
            eligible_at,
            revision,
            max_attempts,
        )
        if old is not None and revision <= old.revision:
            assert result == "unchanged"
            return
        fresh = ModelJob(
            destination=destination,
            state="scheduled",
            attempt=old.attempt if old else 0,  # never decreased
            failures=0,
            max_attempts=max_attempts or DEFAULT_MAX_ATTEMPTS,
            revision=revision,
            next_lo=eligible_at,
            next_hi=eligible_at,
            events=old.events if old else [],
        )
        if old is None or old.state in CLOSED:
            assert result == "scheduled"
            fresh.events.append("scheduled")
        else:
            assert result == "revised"  # an in-flight attempt becomes stale
            fresh.events.append("revised")
        self.model[job_id] = fresh

    def _cancel(self, job_id: str) -> None:
        result = self._fetchval("SELECT pacerd.cancel(job_id => $1, reason => 'test')", job_id)
        m = self.model.get(job_id)
        if m is None:
            assert result == "unknown"
        elif m.state in CLOSED:
            assert result == "unchanged"
        else:
            assert result == "cancelled"
            m.state, m.lease = "cancelled", None
            m.events.append("cancelled")

    @precondition(lambda self: any(m.state == "dead" for m in self.model.values()))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """An operator replays a dead job (sometimes one that is not dead)."""
        job_id = self._pick(data, self._ids("dead"))
        before = utcnow()
        result = self._fetchval("SELECT pacerd.replay(job_id => $1, reason => 'test')", job_id)
        after = utcnow()
        m = self.model.get(job_id)
        if m is None:
            assert result == "unknown"
        elif m.state != "dead":
            assert result == "unchanged"
        else:
            assert result == "replayed"
            m.state, m.failures, m.ever_offered = "scheduled", 0, True  # backlog, eligible now
            m.next_lo, m.next_hi = before - SLACK, after + SLACK
            m.events.append("replayed")

    # -- the tick loop -------------------------------------------------------------

    @precondition(lambda self: any(m.state == "scheduled" for m in self.model.values()))
    @rule(
        data=st.data(),
        limit=st.integers(1, 4),
        live_limit=st.integers(0, 3),
        advance_hours=st.sampled_from([0, 0, 0, 1, 24]),
        confirm=st.sampled_from(["now", "now", "late", "no"]),
    )
    def claim(
        self,
        data: st.DataObject,
        limit: int,
        live_limit: int,
        advance_hours: int,
        confirm: str,
    ) -> None:
        """A tick: time passes, a batch is claimed and (mostly) confirmed at once;
        a late confirm arrives after its offer lease is over."""
        self.now += dt.timedelta(hours=advance_hours)
        busy = [d for d in DESTINATIONS if self._due(d)]
        destination = data.draw(st.sampled_from(busy or list(DESTINATIONS)), label="destination")
        due = self._due(destination)
        live = sorted((m.next_at, j) for j, m in due if self._is_live(m))
        backlog = sorted((m.next_at, j) for j, m in due if not self._is_live(m))
        got = self.h.run(
            self.h.led.claim_due(
                destination,
                live_limit=live_limit,
                limit=limit,
                claim_seconds=CLAIM_SECONDS,
                epoch=0,
                live_window_seconds=LIVE_WINDOW_SECONDS,
                instance="machine",
                now=self.now,
            )
        )
        ids = [c.job_id for c in got]
        assert len(ids) == len(set(ids)), "a job claimed twice in one batch"
        due_ids = {j for j, _ in due}
        for c in got:
            # Only due work: never a dead, closed, in-flight or future job.
            assert c.job_id in due_ids, (c.job_id, self.model.get(c.job_id))
        assert len(got) == min(limit, len(due))
        # Each lane oldest first; the live share reserved, unused share flowing over.
        n_live = min(len(live), limit, max(live_limit, limit - min(len(backlog), limit)))
        assert {c.job_id for c in got if c.live} == {j for _, j in live[:n_live]}
        assert {c.job_id for c in got if not c.live} == {j for _, j in backlog[: limit - n_live]}
        for c in got:
            m = self.model[c.job_id]
            assert c.attempt == m.attempt + 1  # a new message id, never reused
            m.state, m.attempt = "claimed", m.attempt + 1
            m.lease = self.now + secs(CLAIM_SECONDS)
            m.events.append("claimed")
        if confirm != "no" and got:
            # The batch's confirms, with stale references mixed in: only the batch is offered.
            at = self.h.wall_start - dt.timedelta(days=1) if confirm == "late" else self.now
            stale = [JobRef(job_id=j, attempt=m.attempt - 1) for j, m in self.model.items()]
            refs = [c.ref for c in got]
            offered = self.h.run(
                self.h.led.mark_offered(stale + refs, offer_seconds=OFFER_SECONDS, now=at)
            )
            assert set(offered) == set(refs)
            assert len(offered) == len(refs)
            for c in got:
                self._confirmed(c.job_id, at)

    def _confirmed(self, job_id: str, at: dt.datetime) -> None:
        m = self.model[job_id]
        m.state, m.ever_offered, m.lease = "offered", True, at + secs(OFFER_SECONDS)
        m.events.append("offered")

    @precondition(lambda self: any(m.state == "claimed" for m in self.model.values()))
    @rule(
        data=st.data(),
        attempt_delta=st.sampled_from([0, 0, 0, -1]),
        late=st.sampled_from([False, False, False, True]),
    )
    def confirm(self, data: st.DataObject, attempt_delta: int, late: bool) -> None:
        """One publisher confirm; a late one arrives after its offer lease is over."""
        job_id = self._pick(data, self._ids("claimed"))
        m = self.model.get(job_id)
        attempt = (m.attempt if m else 1) + attempt_delta
        at = self.h.wall_start - dt.timedelta(days=1) if late else self.now
        ref = JobRef(job_id=job_id, attempt=attempt)
        got = self.h.run(self.h.led.mark_offered([ref], offer_seconds=OFFER_SECONDS, now=at))
        if m is not None and m.state == "claimed" and attempt_delta == 0:
            assert got == [ref]
            self._confirmed(job_id, at)
        else:
            assert got == []

    @precondition(lambda self: any(m.state == "claimed" for m in self.model.values()))
    @rule(data=st.data(), attempt_delta=st.sampled_from([0, 0, 0, -1]))
    def release(self, data: st.DataObject, attempt_delta: int) -> None:
        """A nack, a return or a publish timeout."""
        job_id = self._pick(data, self._ids("claimed"))
        m = self.model.get(job_id)
        ref = JobRef(job_id=job_id, attempt=(m.attempt if m else 1) + attempt_delta)
        got = self.h.run(self.h.led.release_claims([ref], reason="nack"))
        if m is not None and m.state == "claimed" and attempt_delta == 0:
            assert got == [ref]
            m.state, m.lease = "scheduled", None  # attempt kept: a failed publish spends nothing
            m.events.append("released")
        else:
            assert got == []

    # -- workers ---------------------------------------------------------------------

    @precondition(lambda self: any(m.state in IN_FLIGHT for m in self.model.values()))
    @rule(
        data=st.data(),
        attempt_delta=st.sampled_from([0, 0, 0, 0, -1, 1]),
        outcome=st.sampled_from(["ok", "refused", "refused", "retry", "retry", "fail", "continue"]),
        retry_after_s=st.sampled_from([None, 5.0, 30 * 86400.0]),
        cursor=st.sampled_from([None, {"page": 2}]),
    )
    def report(
        self,
        data: st.DataObject,
        attempt_delta: int,
        outcome: str,
        retry_after_s: float | None,
        cursor: Any,
    ) -> None:
        job_id = self._pick(data, self._ids(*IN_FLIGHT))
        m = self.model.get(job_id)
        attempt = max(1, (m.attempt if m else 1) + attempt_delta)
        before = utcnow()
        result = self._fetchval(
            "SELECT pacerd.report(job_id => $1, attempt => $2, outcome => $3,"
            " retry_after_s => $4, error => $5, cursor => $6::jsonb)",
            job_id,
            attempt,
            outcome,
            retry_after_s,
            f"error {outcome}",
            None if cursor is None else json.dumps(cursor),
        )
        after = utcnow()
        if m is None:
            assert result == "unknown"
            return
        expired = m.lease is not None and m.lease < before - SLACK
        assert m.lease is None or expired or m.lease > after + SLACK, "ambiguous lease"
        if attempt != m.attempt or m.state not in IN_FLIGHT or expired:
            assert result == "stale", (result, m)  # changes nothing but the history
            m.events.append("stale_report")
            return
        assert result == "applied", (result, m)
        m.lease, m.ever_offered = None, True
        self._count(m.destination, "refused" if outcome == "refused" else "accepted")
        if outcome == "ok":
            m.state = "completed"
            m.cursor = cursor if cursor is not None else m.cursor
            m.events.append("completed")
        elif outcome == "refused":  # keeps its place in line, spends nothing
            m.state = "scheduled"
            if retry_after_s is not None:
                self._count(m.destination, "retry_after")
                m.next_lo = max(m.next_lo, before - SLACK + secs(retry_after_s))
                m.next_hi = max(m.next_hi, after + SLACK + secs(retry_after_s))
                lo, hi = self.cooldown.get(m.destination, (before - SLACK, before - SLACK))
                self.cooldown[m.destination] = (
                    max(lo, before - SLACK + secs(retry_after_s)),
                    max(hi, after + SLACK + secs(retry_after_s)),
                )
            m.events.append("refused")
        elif outcome == "retry":
            m.failures += 1
            if m.failures >= m.max_attempts:
                m.state = "dead"
                m.events.append("dead")
            else:
                m.state = "scheduled"
                bound = min(BACKOFF_CAP_SECONDS, BACKOFF_BASE_SECONDS * 2 ** (m.failures - 1))
                m.next_lo, m.next_hi = before - SLACK, after + SLACK + secs(bound)
                m.events.append("rescheduled")
        elif outcome == "fail":
            m.state = "dead"
            m.events.append("dead")
        else:  # continue: a checkpoint, eligible again at once, spends nothing
            m.state, m.cursor = "scheduled", cursor
            m.next_lo = min(m.next_lo, before - SLACK)
            m.next_hi = min(m.next_hi, after + SLACK)
            m.events.append("continued")

    # -- the reconciler and time ------------------------------------------------------

    @precondition(lambda self: any(m.state in IN_FLIGHT for m in self.model.values()))
    @rule(cutoff=st.sampled_from([45.0, 3600.0]))
    def expire(self, cutoff: float) -> None:
        at = self.now + secs(cutoff)
        got = self.h.run(self.h.led.reclaim_expired(limit=100, now=at))
        expected = {
            j
            for j, m in self.model.items()
            if m.state in IN_FLIGHT and m.lease is not None and m.lease < at
        }
        assert {r.job_id for r in got} == expected
        for r in got:
            m = self.model[r.job_id]
            assert (str(r.previous_state), r.attempt) == (m.state, m.attempt)
            if m.state == "offered":
                m.failures += 1  # an expired offer spends an attempt
                m.state = "dead" if m.failures >= m.max_attempts else "scheduled"
            else:
                m.state = "scheduled"  # an expired claim does not
                m.ever_offered = m.ever_offered or RECLAIMED_CLAIM_IS_BACKLOG
            m.lease = None
            m.events.append("dead" if m.state == "dead" else "lease_expired")
            assert str(r.state) == m.state

    # -- invariants --------------------------------------------------------------

    @invariant()
    def ledger_agrees_with_the_model(self) -> None:
        self._jobs_match()  # first: it pins the times the ledger chose
        self._history_is_complete()
        self._outcome_counters_match()
        self._exactly_the_due_jobs_are_claimable()

    def _jobs_match(self) -> None:
        rows = self.h.run(
            self.h.conn.fetch(
                "SELECT job_id, destination, state, attempt, failures, max_attempts, revision,"
                " next_attempt_at, lease_expires_at, ever_offered, cursor::text AS cursor"
                " FROM pacerd.jobs"
            )
        )
        ids = [r["job_id"] for r in rows]
        assert sorted(ids) == sorted(self.model), "a job was lost or duplicated"
        for r in rows:
            m = self.model[r["job_id"]]
            actual = (
                r["destination"],
                r["state"],
                r["attempt"],
                r["failures"],
                r["max_attempts"],
                r["revision"],
                r["lease_expires_at"],
                r["ever_offered"],
                json.loads(r["cursor"]) if r["cursor"] else None,
            )
            expected = (
                m.destination,
                m.state,
                m.attempt,
                m.failures,
                m.max_attempts,
                m.revision,
                m.lease,
                m.ever_offered,
                m.cursor,
            )
            assert actual == expected, (r["job_id"], actual, expected)
            assert m.next_lo <= r["next_attempt_at"] <= m.next_hi, (r["job_id"], r, m)
            m.next_lo = m.next_hi = r["next_attempt_at"]  # adopt the ledger's choice

    def _history_is_complete(self) -> None:
        rows = self.h.run(
            self.h.conn.fetch(
                "SELECT job_id, array_agg(event ORDER BY id) AS events"
                " FROM pacerd.job_events GROUP BY job_id"
            )
        )
        history = {r["job_id"]: list(r["events"]) for r in rows}
        expected = {j: m.events for j, m in self.model.items() if m.events}
        assert history == expected

    def _outcome_counters_match(self) -> None:
        rows = self.h.run(
            self.h.conn.fetch(
                "SELECT destination, n_accepted, n_refused, n_retry_after FROM pacerd.destinations"
            )
        )
        for r in rows:
            per = self.counts.get(r["destination"], {"accepted": 0, "refused": 0, "retry_after": 0})
            assert (r["n_accepted"], r["n_refused"], r["n_retry_after"]) == (
                per["accepted"],
                per["refused"],
                per["retry_after"],
            )

    def _exactly_the_due_jobs_are_claimable(self) -> None:
        """Runs the claim itself in a transaction that is rolled back: what it
        would take is exactly the model's due work (no dead, no future job)."""
        sql = self.h.led.queries["claim_due"].sql

        async def probe(destination: str) -> set[str]:
            tx = self.h.conn.transaction()
            await tx.start()
            try:
                rows = await self.h.conn.fetch(
                    sql,
                    [destination],
                    [0],
                    [1000],
                    [CLAIM_SECONDS],
                    [0],
                    [LIVE_WINDOW_SECONDS],
                    self.now,
                    "probe",
                )
            finally:
                await tx.rollback()
            return {r["job_id"] for r in rows}

        for destination in DESTINATIONS:
            expected = {j for j, _ in self._due(destination)}
            assert self.h.run(probe(destination)) == expected


def test_ledger_state_machine(db_dsn: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        led = loop.run_until_complete(ledger.Ledger.connect(db_dsn, max_size=2))
        conn = loop.run_until_complete(asyncpg.connect(db_dsn))
        try:
            loop.run_until_complete(
                led.write_settings(
                    {
                        "max_attempts": DEFAULT_MAX_ATTEMPTS,
                        "backoff_base_seconds": BACKOFF_BASE_SECONDS,
                        "backoff_cap_seconds": BACKOFF_CAP_SECONDS,
                    }
                )
            )
            harness = Harness(loop=loop, led=led, conn=conn, wall_start=utcnow())

            class BoundMachine(LedgerMachine):
                def __init__(self) -> None:
                    super().__init__(harness)

            run_state_machine_as_test(
                BoundMachine,
                settings=settings(
                    max_examples=60,
                    stateful_step_count=40,
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow],
                ),
            )
        finally:
            loop.run_until_complete(conn.close())
            loop.run_until_complete(led.close())
    finally:
        loop.close()
