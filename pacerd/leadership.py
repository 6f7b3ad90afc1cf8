"""Leadership: which instance admits for which destinations.

Destinations hash into a fixed number of partitions (a property of the
ledger, set by ``pacerd migrate --partitions``); an instance leads
partitions, one PostgreSQL session advisory lock each, all held on one
dedicated connection (``LeaderLocks``). ``Leadership`` runs one pass of the
policy each supervisor pass: lead a fair share of the partitions
(ceil(partitions / live instances)), hand the excess over while leading
more than that, take the reconciler's lock when it is free, and give
everything up while the broker is unreachable. A partition taken here is
usable one tick later (``usable``): whoever led it before claimed last
before its lock was free, so two leaders never publish at once.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
import structlog

from pacerd.clock import SystemClock
from pacerd.errors import LedgerUnavailable, PacerdError
from pacerd.ledger import LEADER_APPLICATION_NAME, load_queries, translate_errors

if TYPE_CHECKING:
    from pacerd.clock import Clock
    from pacerd.ledger import Conn, Ledger

log = structlog.get_logger("pacerd.leadership")

LEADER_NAMESPACE = 0x70616365  # advisory-lock class id for leadership
RECONCILER_LOCK = "#reconciler"  # "#" is not allowed in a destination name
PARTITION_LOCK = "partition:{}"
DEFAULT_LEASE_SECONDS = 5.0


def partition_lock(partition: int) -> str:
    """The lock name of one partition."""
    return PARTITION_LOCK.format(partition)


class LeaderLocks:
    """Leadership locks by name (a partition, the reconciler): PostgreSQL
    session advisory locks held on one dedicated connection
    (application_name ``pacerd:leader``).

    Two clocks bound who may act as a leader, and they are ordered:

    - PostgreSQL releases the locks the moment the session ends: at once when
      the process dies or the socket closes, and after ``2 * lease_seconds``
      of silence when the network is cut (the session's TCP keepalives and
      ``tcp_user_timeout`` are set from ``lease_seconds``).
    - This side trusts a lock for at most ``lease_seconds`` after the last
      round trip that proved the session alive (measured from when that
      probe was *sent*), and drops every lock at once when the connection
      reports its end (asyncpg's termination listener).

    So an instance cut off from the database stops acting as leader before
    PostgreSQL lets anyone else take its locks. ``wait_lost()`` renews the
    lease while it waits, so a leader does not depend on the supervisor's
    cadence to keep it.

    A partition being handed over (``begin_release``) is still locked but
    no longer led: its destinations finish their ticks, then ``release()``
    unlocks it. ``try_acquire`` never locks a name twice (advisory locks are
    re-entrant within a session, and a second lock would outlive one unlock).
    """

    def __init__(
        self,
        dsn: str,
        *,
        instance: str,
        clock: Clock | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        self.dsn = dsn
        self.instance = instance
        self.clock: Clock = clock or SystemClock()
        self.lease_seconds = lease_seconds
        self._conn: asyncpg.Connection | None = None
        self._held: set[str] = set()
        self._releasing: set[str] = set()
        self._usable_at: dict[str, float] = {}
        self._confirmed_at = -math.inf
        self._io: anyio.Lock | None = None
        self._changed: anyio.Event | None = None
        self.statements: Counter[str] = Counter()  # sent on the lock session, by name
        self._queries = load_queries()

    # -- local view (no I/O) ---------------------------------------------------

    @property
    def probe_timeout_seconds(self) -> float:
        return self.lease_seconds / 2

    @property
    def backend_pid(self) -> int | None:
        """The lock session's server process id (for logs and fault tests)."""
        conn = self._conn
        return None if conn is None or conn.is_closed() else conn.get_server_pid()

    def _session_ok(self) -> bool:
        conn = self._conn
        if conn is None or conn.is_closed():
            return False
        return self.clock.monotonic() - self._confirmed_at <= self.lease_seconds

    @property
    def held(self) -> frozenset[str]:
        """The names this instance may act as leader of now."""
        if not self._session_ok():
            return frozenset()
        return frozenset(self._held - self._releasing)

    def holds(self, name: str) -> bool:
        return name in self.held

    def has_lock(self, name: str) -> bool:
        """Whether the lock of ``name`` is ours (led or being handed over)."""
        return name in self._held and self._session_ok()

    def releasing(self, name: str) -> bool:
        return name in self._releasing and name in self._held

    def usable_at(self, name: str) -> float | None:
        """When this instance may start admitting for ``name`` (monotonic), or
        None when it does not lead it."""
        return self._usable_at.get(name) if self.holds(name) else None

    def changed(self) -> anyio.Event:
        """An event set at the next change of what is held."""
        if self._changed is None:
            self._changed = anyio.Event()
        return self._changed

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _forget(self) -> None:
        self._held.clear()
        self._releasing.clear()
        self._usable_at.clear()
        self._notify()

    def _lock(self) -> anyio.Lock:
        if self._io is None:
            self._io = anyio.Lock()
        return self._io

    def _drop(self) -> None:
        """Gives the session up: every lock is lost here now, and PostgreSQL
        releases them when the socket closes (or the keepalives expire)."""
        conn, self._conn = self._conn, None
        self._forget()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.terminate()

    # -- the session ------------------------------------------------------------

    async def connect(self) -> None:
        await self.close()
        lease = self.lease_seconds
        settings = {
            "application_name": LEADER_APPLICATION_NAME,
            # A cut network ends the session server-side after 2 * lease of
            # silence: later than this side stops trusting it (1 * lease).
            "tcp_keepalives_idle": str(max(1, math.ceil(lease))),
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": str(max(1, math.ceil(lease))),
            "tcp_user_timeout": str(math.ceil(2000 * lease)),
        }
        sent = self.clock.monotonic()
        with translate_errors():
            conn = await asyncpg.connect(self.dsn, timeout=10, server_settings=settings)
        self._conn = conn
        self._confirmed_at = sent
        conn.add_termination_listener(self._on_terminated)

    def _on_terminated(self, conn: Conn) -> None:
        if conn is self._conn:
            self._forget()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self._forget()
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close(timeout=2)

    async def _query(self, name: str, *args: Any) -> Any:
        """The named statement on the lock session, serialised, bounded in
        time and shielded (a cancelled query must not disturb the session); a
        session that does not answer in time is given up."""
        conn = self._conn
        if conn is None:
            raise LedgerUnavailable("the leadership session is not connected")
        self.statements[name] += 1
        sql = self._queries[name].sql
        try:
            with anyio.CancelScope(shield=True):
                return await conn.fetchval(sql, *args, timeout=self.probe_timeout_seconds)
        except (
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,
            OSError,
            TimeoutError,
            asyncpg.PostgresError,
        ) as exc:
            if conn is self._conn:
                self._drop()
            raise LedgerUnavailable(f"the leadership session failed: {exc}") from exc

    async def alive(self, *, timeout_seconds: float | None = None) -> bool:
        """Checks the lock session answers and renews the lease; on failure,
        drops every lock (and the session)."""
        conn = self._conn
        if conn is None or conn.is_closed():
            if self._held:
                self._forget()
            return False
        async with self._lock():
            if conn is not self._conn:
                return self._conn is not None
            sent = self.clock.monotonic()
            try:
                await self._query("probe_session")
            except LedgerUnavailable:
                return False
            self._confirmed_at = max(self._confirmed_at, sent)
        return True

    async def renew(self) -> bool:
        """Renews the lease unless a probe did so recently."""
        if self.clock.monotonic() - self._confirmed_at < self.lease_seconds / 4:
            return self._session_ok()
        return await self.alive()

    async def wait_lost(self, name: str) -> None:
        """Returns once the lock of ``name`` may no longer be ours (the session
        ended, or its lease lapsed); renews the lease meanwhile. A handover
        does not count: it ends between ticks (see ``begin_release``)."""
        while self.has_lock(name):
            await self.keep()

    async def keep(self) -> None:
        """One step of keeping the locks: renews the lease once a quarter of
        it has passed (within what is left of it, so a lapse is seen when it
        happens), else waits for that time or a change of what is held."""
        now = self.clock.monotonic()
        renew_at = self._confirmed_at + self.lease_seconds / 4
        if now >= renew_at and self._conn is not None:
            with anyio.move_on_after(max(0.0, self._confirmed_at + self.lease_seconds - now)):
                await self.renew()
            return
        changed = self.changed()
        with anyio.move_on_after(max(renew_at - now, 0.0) or self.lease_seconds / 4):
            await changed.wait()

    # -- locks ---------------------------------------------------------------------

    async def try_acquire(self, name: str, *, settle_seconds: float = 0.0) -> bool:
        """Takes the lock of ``name`` if free; the new leader may admit after
        ``settle_seconds`` (``usable_at``)."""
        if name in self._held:
            return self.holds(name)
        if self._conn is None:
            return False
        async with self._lock():
            sent = self.clock.monotonic()
            got = bool(await self._query("try_acquire", LEADER_NAMESPACE, name))
            self._confirmed_at = max(self._confirmed_at, sent)
        if got:
            self._held.add(name)
            self._usable_at[name] = self.clock.monotonic() + settle_seconds
            self._notify()
        return got

    def begin_release(self, name: str) -> None:
        """Stops leading ``name`` but keeps its lock until ``release()``."""
        if name in self._held:
            self._releasing.add(name)
            self._notify()

    async def release(self, name: str) -> None:
        """Unlocks ``name`` (this side forgets it first). If the unlock fails,
        the whole session is given up so the lock cannot linger."""
        self._releasing.discard(name)
        self._usable_at.pop(name, None)
        if name not in self._held:
            return
        self._held.discard(name)
        self._notify()
        if self._conn is None:
            return
        async with self._lock():
            await self._query("release", LEADER_NAMESPACE, name)

    async def count_instances(self) -> int:
        """Live pacerd instances on this ledger: leadership sessions connected
        to this database (other databases of the cluster do not count)."""
        if self._conn is None:
            return 1
        async with self._lock():
            n = await self._query("count_instances", LEADER_APPLICATION_NAME)
        return max(1, int(n or 0))


class Leadership:
    """The partitions this instance leads, kept to its fair share."""

    def __init__(
        self,
        locks: LeaderLocks,
        *,
        partitions: int,
        instance: str,
        clock: Clock,
        broker_grace_seconds: float,
        reconciler: bool = True,
    ) -> None:
        """``reconciler``: whether this instance competes for the reconciler
        lock (a shadow instance, which claims and reschedules nothing, does not:
        holding it, it would stop the other instances' reconciling)."""
        self.locks = locks
        self.reconciler = reconciler
        self.partitions = partitions
        self.instance = instance
        self.clock = clock
        self.broker_grace_seconds = broker_grace_seconds
        self._names = {partition_lock(p): p for p in range(partitions)}
        self._unrecorded: set[int] = set()  # led, `set_leader` not yet written
        self._broker_down_since: float | None = None
        self._retry_at = 0.0
        self.passes = 0

    # -- the local view (no I/O) ----------------------------------------------------

    def held(self) -> set[int]:
        """Partitions this instance leads now (settled or not; not being handed over)."""
        return {self._names[n] for n in self.locks.held if n in self._names}

    def usable(self, partition: int) -> bool:
        """Whether this instance may admit for ``partition`` now."""
        at = self.locks.usable_at(partition_lock(partition))
        return at is not None and self.clock.monotonic() >= at

    def usable_partitions(self) -> list[int]:
        now = self.clock.monotonic()
        return sorted(
            p for p in self.held()
            if (at := self.locks.usable_at(partition_lock(p))) is not None and now >= at
        )  # fmt: skip

    def next_usable_at(self) -> float | None:
        """The earliest time a partition taken but not yet settled becomes usable."""
        now = self.clock.monotonic()
        times = [
            at for p in self.held()
            if (at := self.locks.usable_at(partition_lock(p))) is not None and at > now
        ]  # fmt: skip
        return min(times) if times else None

    def releasing(self) -> set[int]:
        return {p for n, p in self._names.items() if self.locks.releasing(n)}

    def has_lock(self, partition: int) -> bool:
        return self.locks.has_lock(partition_lock(partition))

    def reconciles(self) -> bool:
        return self.locks.holds(RECONCILER_LOCK)

    # -- one pass ---------------------------------------------------------------------

    async def supervise(
        self, ledger: Ledger, *, broker_connected: bool, settle_seconds: float
    ) -> None:
        """One pass of the policy (see the module's docstring)."""
        self.passes += 1
        log.debug("supervisor_pass", supervisor_pass=self.passes)
        now = self.clock.monotonic()
        if broker_connected:
            self._broker_down_since = None
        else:
            self._broker_down_since = self._broker_down_since or now
            if now - self._broker_down_since >= self.broker_grace_seconds:
                if self.locks.backend_pid is not None:
                    log.warning("leadership_session_closed", reason="broker_unavailable")
                    await self.give_up(ledger)
                return
        if not await self.locks.alive():
            if now < self._retry_at:
                return
            try:
                await self.locks.connect()
                log.info("leadership_session_connected", backend_pid=self.locks.backend_pid)
            except PacerdError as exc:
                self._retry_at = now + 2.0
                log.warning("leadership_session_unavailable", error=str(exc))
                return
        instances = await self.locks.count_instances()
        fair_share = math.ceil(self.partitions / instances)
        held = sorted(self.held())
        # Above its share, it hands over the excess at once (its highest
        # partitions), once the previous handover has ended: another instance
        # takes them on its next pass.
        handing_over = bool(self.releasing())
        while not handing_over and len(held) > max(fair_share, 1):
            give_up = held.pop()
            self.locks.begin_release(partition_lock(give_up))  # released once its ticks end
            log.info(
                "leadership_handover_started", partition=give_up, fair_share=fair_share,
                instances=instances,
            )  # fmt: skip
        # a new instance starts at a different place, so that instances
        # joining together do not contend for the same partitions
        start = zlib_offset(self.instance, self.partitions)
        for i in range(self.partitions):
            if len(held) >= fair_share:
                break
            partition = (start + i) % self.partitions
            name = partition_lock(partition)
            if partition in held or self.locks.has_lock(name):
                continue
            if await self.locks.try_acquire(name, settle_seconds=settle_seconds):
                held.append(partition)
                self._unrecorded.add(partition)
                log.info(
                    "leadership_acquired", partition=partition,
                    admitting_in_seconds=settle_seconds, fair_share=fair_share,
                    instances=instances, supervisor_pass=self.passes,
                )  # fmt: skip
        for partition in sorted(self._unrecorded):
            if self.has_lock(partition):
                await ledger.set_leader(partition, self.instance)
            self._unrecorded.discard(partition)
        if (
            self.reconciler
            and not self.locks.has_lock(RECONCILER_LOCK)
            and await self.locks.try_acquire(RECONCILER_LOCK)
        ):
            log.info("leadership_acquired", role="reconciler", supervisor_pass=self.passes)

    async def hand_over(self, ledger: Ledger, partition: int) -> None:
        """Unlocks a partition whose destinations' ticks have ended (rebalancing)."""
        try:
            await ledger.set_leader(partition, None)
        except PacerdError as exc:
            log.warning("set_leader_failed", partition=partition, error=str(exc))
        try:
            await self.locks.release(partition_lock(partition))
        except PacerdError as exc:  # the session was given up: released all the same
            log.warning("leadership_release_failed", partition=partition, error=str(exc))
        log.info("leadership_released", partition=partition)

    async def give_up(self, ledger: Ledger | None) -> None:
        """Leads nothing any more: records it, and closes the lock session."""
        if ledger is not None:
            for partition in sorted(self.held() | self.releasing()):
                with contextlib.suppress(PacerdError):
                    await ledger.set_leader(partition, None)
        await self.locks.close()


def zlib_offset(instance: str, partitions: int) -> int:
    """Where ``instance`` starts looking for free partitions (stable per name)."""
    return zlib.crc32(instance.encode()) % max(1, partitions)
