"""One statement for many destinations: the ledger as the tick loop shares it.

Every destination this instance leads runs its tick on one schedule (the
tick loop anchors them all to the same instants), so their reads, in-flight
counts, claims, marks and saves are asked for together. ``SharedLedger``
serves each kind of request through a ``Coalescer``: the calls made while
the event loop runs its ready tasks (and, for the requests that are not on
a release's critical path and the brakes' reads while several destinations
brake, within a few milliseconds more) become one statement whose rows are
handed back to each caller. The number of
statements a tick costs therefore does not grow with the number of
destinations. The release slices' closed checks are served from one small
snapshot (paused or cooling-down destinations, ``ClosedSnapshot``), begun
at most ``CLOSED_CHECK_SECONDS`` before each check, or, while the ledger's
notices are heard (``notices.py``), after the last notice and at most
``NOTICED_CHECK_SECONDS`` before.

It implements ``admission.AdmissionLedger``: the tick code is the same over
this, over the plain ``Ledger`` and over the simulation's fakes.

``SharedPublisher`` does the same for the broker: the release slices of
every destination that come due in one round of the event loop are written
in one ``write_batch`` (one acquisition of the channel's lock, one socket
write), and each slice then awaits its own confirms.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import structlog

from pacerd.admission import BRAKE_CHECK_SECONDS, CLOSED_CHECK_SECONDS
from pacerd.errors import BrokerUnavailable, LedgerError, PublishError
from pacerd.models import ClaimRequest

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from pacerd.clock import Clock
    from pacerd.ledger import Ledger
    from pacerd.models import ClaimedJob, DestinationRow, JobRef
    from pacerd.publisher import Broker

log = structlog.get_logger("pacerd.batching")

_K = TypeVar("_K")
_R = TypeVar("_R")

# Yield rounds a batch waits, at most, for more callers to join it: the ticks
# released by one timer all ask within a round or two.
MAX_ROUNDS = 8
# How long a batch of marks, releases or saves waits for more (they are off
# the release schedule: a few milliseconds later changes nothing).
LAZY_WINDOW_SECONDS = 0.01
# How long a brake's read of its destination's row (mid-tick, every
# BRAKE_CHECK_SECONDS while a tick releases) waits for the brakes of other
# destinations, when another one read within the last two checks. Each
# destination checks at its own phase of the release grid, so reads asked
# for only as the loop runs its ready tasks hardly ever met: every busy
# destination cost 20 statements a second. With the window they cost at
# most one statement per window between them; a brake hears its outcomes
# this much later at most (a check's interval is five times as long). A
# destination braking alone waits for nobody.
BRAKE_WINDOW_SECONDS = 0.01
# While the ledger's notices are heard, every pause, resume and cool-down is
# noticed as it commits, so a closed-destinations snapshot stands until the
# next notice (a cool-down's end is known in advance: it ends in the
# snapshot); it is read again at least this often all the same, should the
# listening session have died without a word (a cut network).
NOTICED_CHECK_SECONDS = 1.0


@dataclass(slots=True)
class _Batch(Generic[_K, _R]):
    keys: list[_K] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    results: list[_R] | None = None
    error: BaseException | None = None
    abandoned: list[int] = field(default_factory=list)  # callers gone before the results
    withdrawn: set[int] = field(default_factory=set)  # callers gone before the statement
    started: bool = False  # its statement was sent


class Coalescer(Generic[_K, _R]):
    """Calls ``run(keys)`` once for every key asked for together; each
    caller gets its own result (``run`` returns one per key, in order).

    The first caller of a batch runs it: it yields while others keep
    joining (up to ``MAX_ROUNDS`` rounds, then ``window_seconds`` more, and
    until the statement of the batch before has ended: one statement of a
    kind at a time, so that callers slowed by a busy loop still share one),
    then runs the statement shielded, so that a caller cancelled meanwhile
    (its leadership lost) does not fail the others. ``on_abandoned`` gets
    the result of a caller that was cancelled while the statement ran (a
    claim's jobs, to be released); where it is set, a caller cancelled
    before the statement was sent is left out of it, and a batch left with
    no caller sends none (a tick cancelled on losing its leadership claims
    nothing more)."""

    def __init__(
        self,
        name: str,
        run: Callable[[list[_K]], Awaitable[list[_R]]],
        *,
        clock: Clock,
        window_seconds: float = 0.0,
        on_abandoned: Callable[[_K, _R], Awaitable[None]] | None = None,
        counts: Counter[str] | None = None,
    ) -> None:
        self.name = name
        self._run = run
        self.clock = clock
        self.window_seconds = window_seconds
        self._on_abandoned = on_abandoned
        self._open: _Batch[_K, _R] | None = None
        self._running: anyio.Event | None = None  # set when this kind's statement ends
        self.statements = counts if counts is not None else Counter()

    async def __call__(self, key: _K) -> _R:
        batch = self._open
        if batch is not None:
            index = len(batch.keys)
            batch.keys.append(key)
            try:
                await batch.done.wait()
            except BaseException:
                if not batch.started and self._on_abandoned is not None:
                    batch.withdrawn.add(index)  # left out of the statement
                elif batch.results is None:
                    batch.abandoned.append(index)  # the runner hands its result back
                elif self._on_abandoned is not None:
                    with anyio.CancelScope(shield=True):
                        await self._on_abandoned(key, batch.results[index])
                raise
            return self._result(batch, index)
        batch = self._open = _Batch([key])
        cancelled: BaseException | None = None
        try:
            await self._gather(batch)
            while self._running is not None:  # callers meanwhile join this batch
                await self._running.wait()
        except BaseException as exc:  # cancelled: the batch still runs, for the others
            cancelled = exc
            if self._on_abandoned is not None:
                batch.withdrawn.add(0)
        finally:
            if self._open is batch:
                self._open = None
        with anyio.CancelScope(shield=True):
            while self._running is not None:  # one statement of a kind at a time
                await self._running.wait()
            running = self._running = anyio.Event()
            try:
                batch.results = await self._run_batch(batch)
            except Exception as exc:  # every caller of the batch gets it
                batch.error = exc
            finally:
                batch.done.set()
                self._running = None
                running.set()
            if batch.results is not None and self._on_abandoned is not None:
                for index in batch.abandoned:
                    await self._on_abandoned(batch.keys[index], batch.results[index])
        if cancelled is None:
            try:  # cancelled while the statement ran: as if it had waited
                await anyio.lowlevel.checkpoint()
            except BaseException as exc:
                cancelled = exc
        if cancelled is not None:
            if (
                batch.results is not None
                and self._on_abandoned is not None
                and 0 not in batch.withdrawn
            ):
                with anyio.CancelScope(shield=True):
                    await self._on_abandoned(key, batch.results[0])
            raise cancelled
        return self._result(batch, 0)

    async def _run_batch(self, batch: _Batch[_K, _R]) -> list[_R]:
        """The statement for the keys not withdrawn (none: no statement); the
        results in the batch's order (a withdrawn key's is never read)."""
        batch.started = True
        if not batch.withdrawn:
            self.statements[self.name] += 1
            return await self._run(batch.keys)
        kept = [i for i in range(len(batch.keys)) if i not in batch.withdrawn]
        if not kept:
            return []
        self.statements[self.name] += 1
        got = await self._run([batch.keys[i] for i in kept])
        results: list[_R] = [got[0]] * len(batch.keys)  # placeholders at the withdrawn
        for i, result in zip(kept, got, strict=True):
            results[i] = result
        return results

    async def _gather(self, batch: _Batch[_K, _R]) -> None:
        seen = 0
        for _ in range(MAX_ROUNDS):
            await anyio.lowlevel.checkpoint()
            if len(batch.keys) == seen:
                break
            seen = len(batch.keys)
        if self.window_seconds > 0:
            await self.clock.sleep_until(self.clock.monotonic() + self.window_seconds)

    @staticmethod
    def _result(batch: _Batch[_K, _R], index: int) -> _R:
        if batch.error is not None:
            raise batch.error
        assert batch.results is not None
        return batch.results[index]


@dataclass(slots=True)
class _Snapshot:
    began: float  # when its statement was sent (Clock.monotonic)
    done: anyio.Event = field(default_factory=anyio.Event)
    until: dict[str, float] = field(default_factory=dict)  # closed until (monotonic; inf: paused)
    error: Exception | None = None

    def closed(self, now: float) -> frozenset[str]:
        """The destinations it says are closed at ``now`` (a cool-down ends in it)."""
        return frozenset(name for name, until in self.until.items() if until > now)

    def closes(self, destination: str, now: float) -> bool:
        """Whether it says ``destination`` is closed at ``now`` (a slice's
        check: a lookup, whatever the number of closed destinations)."""
        until = self.until
        return until.get("*", -math.inf) > now or until.get(destination, -math.inf) > now


class ClosedSnapshot:
    """The paused and cooling-down destinations, read by one statement for
    every release slice that checks at about the same time.

    A check asked at time t is answered from a snapshot whose statement
    began at or after t - ``max_age_seconds`` (while ``noticed()`` says the
    ledger's notices are heard: t - ``noticed_age_seconds``) and after the
    last notice of a change (``changed``): the last one if it is that
    recent, else the one in flight if it began that recently, else the next
    one. What a caller waited for answers it, however long the event loop
    took to wake it (re-judging its age at wake-up sent a busy loop's
    waiters round again, each wake-up of a thousand of them for nothing).
    A snapshot holds when each cool-down in it ends, so an old one never
    holds a destination closed past its cool-down (it ends a moment after
    the ledger's end: counted from when the read returned). A failed read
    fails the checks that waited for it."""

    def __init__(
        self,
        read: Callable[[], Awaitable[Mapping[str, float | None]]],
        *,
        clock: Clock,
        max_age_seconds: float,
        noticed_age_seconds: float = NOTICED_CHECK_SECONDS,
        noticed: Callable[[], bool] = lambda: False,
        counts: Counter[str] | None = None,
    ) -> None:
        self._read = read
        self.clock = clock
        self.max_age_seconds = max_age_seconds
        self.noticed_age_seconds = noticed_age_seconds
        self.noticed = noticed
        self.statements = counts if counts is not None else Counter()
        self._last: _Snapshot | None = None  # the last one read without error
        self._reading: _Snapshot | None = None
        self._changed_at = -math.inf  # the last notice of a change (``changed``)

    def changed(self) -> None:
        """A pause, resume or cool-down was committed (a notice): checks
        asked from now on are answered by a snapshot begun after it."""
        self._changed_at = self.clock.monotonic()

    async def __call__(self) -> frozenset[str]:
        """The destinations closed now ("*": every one)."""
        return (await self._snapshot()).closed(self.clock.monotonic())

    async def closes(self, destination: str) -> bool:
        """Whether ``destination`` is closed now (paused, every destination
        paused, or cooling down)."""
        return (await self._snapshot()).closes(destination, self.clock.monotonic())

    async def _snapshot(self) -> _Snapshot:
        age = self.noticed_age_seconds if self.noticed() else self.max_age_seconds
        oldest = max(self.clock.monotonic() - age, self._changed_at)
        while True:
            last = self._last
            if last is not None and last.began >= oldest:
                return last
            snapshot = self._reading
            if snapshot is None:
                snapshot = self._reading = _Snapshot(began=self.clock.monotonic())
                with anyio.CancelScope(shield=True):  # for the others, if this caller goes
                    try:
                        self.statements["closed_destinations"] += 1
                        closed = await self._read()
                        read = self.clock.monotonic()
                        snapshot.until = {
                            name: math.inf if left is None else read + left
                            for name, left in closed.items()
                        }
                        self._last = snapshot
                    except Exception as exc:
                        snapshot.error = exc
                    finally:
                        self._reading = None
                        snapshot.done.set()
            else:
                await snapshot.done.wait()
            if snapshot.began >= oldest:  # else it began too early for this check: the next
                if snapshot.error is not None:
                    raise snapshot.error
                return snapshot


@dataclass(frozen=True, slots=True)
class _Claim:
    request: ClaimRequest
    instance: str


class SharedLedger:
    """The admission ledger of the tick loop: one ``Ledger``, its statements
    shared by every destination ticking at the same time."""

    def __init__(
        self, ledger: Ledger, *, clock: Clock, noticed: Callable[[], bool] = lambda: False
    ) -> None:
        self.ledger = ledger
        self.clock = clock
        self.statements: Counter[str] = Counter()  # statements run, by name (for the bench)

        def shared(
            name: str,
            run: Callable[[list[_K]], Awaitable[list[_R]]],
            *,
            window: float = 0.0,
            on_abandoned: Callable[[_K, _R], Awaitable[None]] | None = None,
        ) -> Coalescer[_K, _R]:
            return Coalescer(
                name, run, clock=clock, window_seconds=window, counts=self.statements,
                on_abandoned=on_abandoned,
            )  # fmt: skip

        # A tick's read (its row and in-flight count together) and its claim
        # are on the way to its first release: they go as soon as everyone
        # ready has asked; the rest may wait a little. A brake reads the row
        # alone, mid-tick, and waits for other destinations' brakes.
        self._read_tick = shared(
            "read_destination_inflight", functools.partial(self._read_many, inflight=True)
        )
        self._read = shared("read_destination", self._read_many)
        self._read_gathered = shared(
            "read_destination", self._read_many, window=BRAKE_WINDOW_SECONDS
        )
        self._last_brake: tuple[str, float] = ("", -math.inf)  # who read last, and when
        self._other_brake_at = -math.inf  # the last read of another destination than it
        self._claim = shared("claim_due", self._claim_many, on_abandoned=self._release_abandoned)
        lazy = LAZY_WINDOW_SECONDS
        self._mark = shared("mark_offered", self._mark_many, window=lazy)
        self._release = shared("release_claims", self._release_many, window=lazy)
        self._save = shared("save_pacer_state", self._save_many, window=lazy)
        self._park = shared("park_destinations", self._park_many, window=lazy)
        self._has_due = shared("has_due", self.ledger.has_due_many)  # shadow ticks
        self._closed = ClosedSnapshot(
            ledger.closed_destinations, clock=clock, max_age_seconds=CLOSED_CHECK_SECONDS,
            noticed=noticed, counts=self.statements,
        )  # fmt: skip

    # -- AdmissionLedger -----------------------------------------------------------

    async def read_destination(
        self, destination: str, *, inflight: bool = False
    ) -> DestinationRow | None:
        if inflight:
            return await self._read_tick(destination)
        # a brake's read: gathered with the others' when another destination
        # braked within the last two checks (``BRAKE_WINDOW_SECONDS``)
        now = self.clock.monotonic()
        last, at = self._last_brake
        if last != destination:
            self._other_brake_at = at
        self._last_brake = (destination, now)
        others = now - self._other_brake_at <= 2.0 * BRAKE_CHECK_SECONDS
        return await (self._read_gathered if others else self._read)(destination)

    async def claim_due(
        self,
        destination: str,
        *,
        live_limit: int,
        limit: int,
        claim_seconds: float,
        epoch: int,
        live_window_seconds: float,
        instance: str,
    ) -> list[ClaimedJob]:
        if limit <= 0:
            return []
        request = ClaimRequest(
            destination=destination, live_limit=live_limit, limit=limit,
            claim_seconds=claim_seconds, epoch=epoch, live_window_seconds=live_window_seconds,
        )  # fmt: skip
        return await self._claim(_Claim(request, instance))

    async def mark_offered(self, refs: Sequence[JobRef], *, offer_seconds: float) -> list[JobRef]:
        if not refs:
            return []
        return await self._mark((tuple(refs), offer_seconds))

    async def release_claims(self, refs: Sequence[JobRef], *, reason: str) -> list[JobRef]:
        if not refs:
            return []
        return await self._release((tuple(refs), reason))

    async def save_pacer_state(
        self, destination: str, state: Mapping[str, Any], *, epoch: int
    ) -> None:
        await self._save((destination, state, epoch))

    async def has_due(self, destination: str, *, at_least: int = 1) -> int:
        return await self._has_due((destination, at_least))

    async def is_closed(self, destination: str) -> bool:
        """Paused or cooling down, as of a snapshot begun at most
        ``CLOSED_CHECK_SECONDS`` before the check, or, while the ledger's
        notices are heard, after the last one and at most
        ``NOTICED_CHECK_SECONDS`` before (one small statement for everyone,
        ``ClosedSnapshot``)."""
        return await self._closed.closes(destination)

    def closed_changed(self) -> None:
        """A notice that some destination opened or closed (``ClosedSnapshot.changed``)."""
        self._closed.changed()

    async def park(self, destination: str) -> bool:
        """Parks ``destination`` if it has nothing due and nothing in flight
        (``Ledger.park_destinations``); whether it was parked."""
        return await self._park(destination)

    # -- a tick planner's statements (``planner.py``: one each, for every due tick) -----

    async def read_rows(self, names: Sequence[str]) -> dict[str, DestinationRow]:
        """The rows of ``names``, each with its in-flight count."""
        self.statements["read_destination_inflight"] += 1
        return await self.ledger.read_destinations(sorted(set(names)), inflight=True)

    async def save_states(self, saves: Sequence[tuple[str, Mapping[str, Any], int]]) -> None:
        self.statements["save_pacer_state"] += 1
        await self.ledger.save_pacer_states(saves)

    async def claim_many(
        self, claims: Sequence[tuple[ClaimRequest, str]]
    ) -> dict[str, list[ClaimedJob]]:
        """(request, instance) each: the jobs claimed, by destination."""
        self.statements["claim_due"] += 1
        got = await self._claim_many([_Claim(request, instance) for request, instance in claims])
        return {request.destination: jobs for (request, _), jobs in zip(claims, got, strict=True)}

    # -- the shared statements -------------------------------------------------------

    async def _park_many(self, names: list[str]) -> list[bool]:
        parked = await self.ledger.park_destinations(names)
        return [n in parked for n in names]

    async def _read_many(
        self, names: list[str], *, inflight: bool = False
    ) -> list[DestinationRow | None]:
        rows = await self.ledger.read_destinations(sorted(set(names)), inflight=inflight)
        return [rows.get(n) for n in names]

    async def _claim_many(self, claims: list[_Claim]) -> list[list[ClaimedJob]]:
        by_instance: dict[str, list[ClaimRequest]] = {}
        for claim in claims:
            by_instance.setdefault(claim.instance, []).append(claim.request)
        got: dict[str, list[ClaimedJob]] = {}
        for instance, requests in by_instance.items():
            got |= await self.ledger.claim_due_many(requests, instance=instance)
        return [got.get(c.request.destination, []) for c in claims]

    async def _release_abandoned(self, claim: _Claim, jobs: list[ClaimedJob]) -> None:
        await self.release_abandoned(jobs)

    async def release_abandoned(self, jobs: Sequence[ClaimedJob]) -> None:
        """Releases claims whose tick will not run (its caller left): at once,
        not at their lease's end; a ledger that cannot is left to the lease."""
        if not jobs:
            return
        try:
            await self.ledger.release_claims([job.ref for job in jobs], reason="shutdown")
        except LedgerError as exc:  # the claim lease returns them
            log.warning("release_failed", count=len(jobs), error=str(exc))

    async def _mark_many(self, asks: list[tuple[tuple[JobRef, ...], float]]) -> list[list[JobRef]]:
        by_lease: dict[float, list[JobRef]] = {}
        for refs, offer_seconds in asks:
            by_lease.setdefault(offer_seconds, []).extend(refs)
        marked: set[JobRef] = set()
        for offer_seconds, lease_refs in by_lease.items():
            marked.update(await self.ledger.mark_offered(lease_refs, offer_seconds=offer_seconds))
        return [[r for r in refs if r in marked] for refs, _ in asks]

    async def _release_many(self, asks: list[tuple[tuple[JobRef, ...], str]]) -> list[list[JobRef]]:
        by_reason: dict[str, list[JobRef]] = {}
        for refs, reason in asks:
            by_reason.setdefault(reason, []).extend(refs)
        released: set[JobRef] = set()
        for reason, reason_refs in by_reason.items():
            released.update(await self.ledger.release_claims(reason_refs, reason=reason))
        return [[r for r in refs if r in released] for refs, _ in asks]

    async def _save_many(self, saves: list[tuple[str, Mapping[str, Any], int]]) -> list[None]:
        await self.ledger.save_pacer_states(saves)
        return [None] * len(saves)


@dataclass(eq=False, slots=True)
class _Slice:
    jobs: Sequence[ClaimedJob]
    headers: Sequence[Mapping[str, str]]
    taken: bool = False  # in a write: its messages go out
    abandoned: bool = False  # its caller left once it was taken
    written: anyio.Event = field(default_factory=anyio.Event)
    confirms: Sequence[asyncio.Future[Any]] = ()
    error: PublishError | None = None


class SharedPublisher:
    """The broker as the tick loop shares it (``publisher.Publisher``).

    Each release slice was one ``write_batch``: with a thousand destinations
    releasing at once they queued on the channel's lock and on the
    connection's bounded frame queue, one a round of the event loop, and a
    slice's write waited seconds for those before it while the broker
    confirmed in milliseconds; the ticks then ended late and their next
    budgets shrank. Here the first slice of a round waits that one round, so
    that the others released meanwhile join it, and writes them all at once;
    each slice then awaits its own confirms (``Broker.settle``), as
    ``publish_many`` did. A slice whose caller is cancelled before the write
    is left out of it (nothing of it is published); cancelled after, its
    confirms are cancelled and the caller releases its jobs, as before."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._pending: list[_Slice] | None = None
        self.writes = 0  # write_batch calls made (tests, the bench)

    async def declare_destination(self, destination: str, queue: str) -> None:
        await self.broker.declare_destination(destination, queue)

    async def publish(self, job: ClaimedJob, headers: Mapping[str, str]) -> None:
        await self.broker.publish(job, headers)

    async def publish_many(
        self, jobs: Sequence[ClaimedJob], headers: Sequence[Mapping[str, str]]
    ) -> list[PublishError | None]:
        if not jobs:
            return []
        mine = _Slice(jobs, headers)
        pending = self._pending
        if pending is None:
            await self._lead(mine)
        else:
            pending.append(mine)
            try:
                await mine.written.wait()
            except BaseException:
                if not mine.taken:
                    pending.remove(mine)  # withdrawn: not written
                elif mine.written.is_set():
                    for confirm in mine.confirms:
                        confirm.cancel()
                else:
                    mine.abandoned = True  # the write cancels its confirms
                raise
        if mine.error is not None:
            return [mine.error] * len(jobs)
        return await self.broker.settle(mine.confirms)

    async def _lead(self, mine: _Slice) -> None:
        """Gathers the slices of this round, then writes them (shielded, for
        the others, if this caller is cancelled meanwhile)."""
        pending = self._pending = [mine]
        cancelled: BaseException | None = None
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException as exc:
            cancelled = exc
            pending.remove(mine)
        finally:
            self._pending = None
        if pending:
            with anyio.CancelScope(shield=True):
                await self._write(pending)
        if cancelled is not None:
            raise cancelled

    async def _write(self, slices: list[_Slice]) -> None:
        for piece in slices:
            piece.taken = True
        try:
            self.writes += 1
            written = await self.broker.write_many(
                [job for piece in slices for job in piece.jobs],
                [h for piece in slices for h in piece.headers],
            )
            start = 0
            for piece in slices:
                if isinstance(written, PublishError):
                    piece.error = written
                else:
                    piece.confirms = written[start : start + len(piece.jobs)]
                    if piece.abandoned:
                        for confirm in piece.confirms:
                            confirm.cancel()
                start += len(piece.jobs)
        finally:
            for piece in slices:
                if piece.error is None and not piece.confirms:  # the write itself broke
                    piece.error = BrokerUnavailable("the publish failed")
                piece.written.set()
