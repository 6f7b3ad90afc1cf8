"""Several `pacerd run` instances on one ledger (subprocesses, real services):
one leader per destination, destinations spread, one budget per destination
whatever happens to the instances — a drain by three instances, kill -9 of a
leader and of the reconciler's instance, a terminated lock session, and a
network partition through a proxy.

Leadership is by partition: each test sets the ledger's partitions to the
number of its destinations and names them one per partition
(``names_in_partitions``), so that leading, handing over and taking over a
partition is leading, handing over and taking over its one destination."""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import anyio
import asyncpg
import pytest
from ha_helpers import (
    Cluster,
    Pacing,
    acquisition,
    assert_claims_within_budgets,
    assert_completed_exactly_once,
    assert_one_leader_at_a_time,
    claim_groups,
    delete_queues,
    first_claim_after,
    leaders,
    lock_holder_pid,
    names_in_partitions,
    next_acquisition,
    ok_workers,
    partitions_of,
    passes_before,
    schedule_backlog,
    takeover_from,
    upstream_workers,
    wait_completed,
)
from support.daemon import utcnow
from support.proxy import FaultProxy
from support.services import with_port

from pacerd.leadership import partition_lock

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from support.daemon import Daemon

pytestmark = [pytest.mark.services, pytest.mark.timeout(60)]


async def _names(dsn: str, prefix: str, n: int) -> list[str]:
    """``n`` destinations, the i-th alone in partition i of ``n`` (set on the
    ledger before any instance starts)."""
    return await names_in_partitions(dsn, prefix, n)


async def _placed(dsn: str, destinations: list[str]) -> dict[str, int]:
    """The destinations' partitions as the ledger stored them: one each, in order."""
    placed = await partitions_of(dsn, destinations)
    assert placed == {d: i for i, d in enumerate(destinations)}, placed
    return placed


@pytest.fixture
async def cluster(db_dsn: str, amqp_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    made = Cluster(tmp_path, dsn=db_dsn, amqp_url=amqp_url, pacing=Pacing())
    try:
        yield made
    finally:
        made.kill_all()


async def test_three_instances_drain_four_destinations_one_budget_each(
    cluster: Cluster, db_dsn: str, amqp_url: str
) -> None:
    destinations = await _names(db_dsn, "ha", 4)
    cluster.pacing = Pacing(tick_seconds=0.25, initial_rate=10, max_rate=200)
    per_destination = 60
    for d in destinations:
        await schedule_backlog(db_dsn, d, per_destination)
    await _placed(db_dsn, destinations)
    total = per_destination * len(destinations)
    try:
        async with upstream_workers(amqp_url, destinations, capacity=30) as ups:
            instances = [cluster.start(name) for name in ("ha-a", "ha-b", "ha-c")]
            for instance in instances:
                await instance.wait_event("pacerd_ready", within=30)
            await wait_completed(db_dsn, total, within=45)
            final_leaders = await leaders(db_dsn)
            done = await anyio.run_process(
                [sys.executable, "-m", "pacerd", "status", "--json", "-c", str(instances[0].config)]
            )
            status = {row["destination"]: row for row in json.loads(done.stdout)}
            duplicates = ups.duplicates()
        stopping = utcnow()
        assert await cluster.stop() == {"ha-a": 0, "ha-b": 0, "ha-c": 0}
    finally:
        await delete_queues(amqp_url, destinations)

    await assert_completed_exactly_once(db_dsn, total)
    assert duplicates == 0, "an accepted side effect ran twice"
    groups = await claim_groups(db_dsn)
    assert_one_leader_at_a_time(groups, cluster.pacing.tick_seconds)
    for d in destinations:
        assert_claims_within_budgets(groups, cluster, d)
    # `pacerd status` shows which instance leads each destination, and since when.
    for d in destinations:
        leader, since = final_leaders[d]
        assert leader in {"ha-a", "ha-b", "ha-c"}
        assert since is not None
        assert status[d]["leader"] == leader
        assert dt.datetime.fromisoformat(status[d]["leader_since"]) == since
    # Spread: no instance leads more than its fair share, ceil(4 / 3).
    led = [leader for leader, _since in final_leaders.values()]
    assert max(led.count(i) for i in set(led)) <= 2, final_leaders
    assert len({g.by for g in groups}) >= 2
    # No flapping: leadership moved only while the instances were joining —
    # the first one may take all four partitions (one destination each), then
    # sheds to its fair share (two handovers at most), and each handover is one
    # acquisition elsewhere. Counted until the stop: the three SIGTERMs go out
    # together, but one instance may release its partitions before another
    # has handled its own, and that one then takes them over on its next
    # pass, as a survivor should (the signal's delivery is the machine's).
    events = {
        name: [e for i in instances for e in i.events(name) if e["at"] < stopping]
        for name in ("leadership_acquired", "leadership_handover_started", "leadership_lost")
    }
    acquired = [e for e in events["leadership_acquired"] if e.get("role") != "reconciler"]
    handovers = events["leadership_handover_started"]
    timeline = _leadership_timeline(instances, stopping)  # said in full when one fails
    assert not events["leadership_lost"], timeline
    assert len(handovers) <= 2, timeline
    assert all(e["instances"] > 1 for e in handovers), timeline
    assert len(acquired) == len(destinations) + len(handovers), timeline
    assert {e["partition"] for e in acquired} == set(range(len(destinations))), timeline


LEADERSHIP_EVENTS = (
    "leadership_acquired", "leadership_handover_started", "leadership_lost",
    "leadership_session_connected", "leadership_session_closed",
    "leadership_session_unavailable", "broker_connected", "broker_unavailable",
)  # fmt: skip


def _leadership_timeline(instances: list[Daemon], stopping: dt.datetime) -> str:
    """Every instance's leadership and broker events in time order, one a
    line, and when the stop was sent (what a failure of the no-flapping
    checks needs to be read)."""
    rows = sorted(
        [
            (e["at"], e.get("instance", "?"), e["event"], e.get("partition"), e.get("fair_share"))
            for i in instances
            for name in LEADERSHIP_EVENTS
            for e in i.events(name)
        ]
        + [(stopping, "test", "SIGTERM sent to every instance", None, None)]
    )
    return "\n".join(
        f"{at:%H:%M:%S.%f} {who} {event} partition={p} fair_share={share}"
        for at, who, event, p, share in rows
    )


async def test_kill_9_of_a_leader_then_of_the_reconciler_instance(
    cluster: Cluster, db_dsn: str, amqp_url: str
) -> None:
    d1, d2 = await _names(db_dsn, "kill", 2)
    tick = 0.5
    cluster.pacing = Pacing(tick_seconds=tick, initial_rate=5, max_rate=50, claim_seconds=2)
    n = 500
    for d in (d1, d2):
        await schedule_backlog(db_dsn, d, n)
    partition = await _placed(db_dsn, [d1, d2])
    try:
        async with ok_workers(amqp_url, [d1, d2]):
            first = cluster.start("k-1")
            await first.wait_event("leadership_acquired", role="reconciler")
            for d in (d1, d2):
                await first.wait_event("destination_active", destination=d)
            others = [cluster.start("k-2"), cluster.start("k-3")]
            for o in others:
                await o.wait_event("leadership_session_connected", within=30)
            # Fair share is now ceil(2 / 3) = 1: k-1 hands over its last partition, d2's.
            await first.wait_event("leadership_released", partition=partition[d2])
            with anyio.fail_after(10):
                while (leader := (await leaders(db_dsn))[d2][0]) in (None, "k-1"):
                    await anyio.sleep(0.05)
            victim = cluster.instances[leader]
            await victim.wait_event("destination_active", destination=d2)
            # busy, its rate grown past twice initial_rate (a handover may have
            # come after a single tick at initial_rate), then two ticks more
            with anyio.fail_after(30):
                while not any(
                    e["rate"] >= 2 * cluster.pacing.initial_rate
                    for e in victim.events("tick_completed", destination=d2)
                ):
                    await anyio.sleep(0.05)
            await anyio.sleep(2 * tick)

            killed_1 = victim.kill9()
            dead_1 = utcnow()  # reaped: no claim of the victim starts after this
            took_2, saved_2 = await takeover_from(db_dsn, d2, dead_1, old=victim.name, within=10)
            await anyio.sleep(4 * tick)

            # The reconciler's instance, which also leads d1.
            assert first.events("leadership_acquired", role="reconciler")
            killed_2 = first.kill9()
            dead_2 = utcnow()
            took_1, saved_1 = await takeover_from(db_dsn, d1, dead_2, old="k-1", within=10)
            survivor = next(i for i in cluster.instances.values() if i.alive)
            reconciler = await survivor.wait_event(
                "leadership_acquired", role="reconciler", within=10
            )
            await wait_completed(db_dsn, 2 * n, within=40)
        assert await cluster.stop() == {survivor.name: 0}
    finally:
        await delete_queues(amqp_url, [d1, d2])

    await assert_completed_exactly_once(db_dsn, 2 * n)
    # The takeover bound, 2 x tick after detection, counted in the standby's own
    # supervisor passes (a tick apart) rather than seconds: it takes the freed
    # lock on its next pass, and admits one tick (the settle) later.
    for killed, took in ((killed_1, took_2), (killed_2, took_1)):
        assert took.at > killed
        taker = cluster.instances[took.by]
        acquired = acquisition(taker, partition[took.destination], after=killed)
        assert passes_before(taker, acquired, after=killed) <= 1, (killed, acquired)
        assert took.at >= acquired["at"] + dt.timedelta(seconds=tick - 0.005), (acquired, took)
    assert reconciler["at"] > killed_2
    assert passes_before(survivor, reconciler, after=killed_2) <= 1, (killed_2, reconciler)
    groups = await claim_groups(db_dsn)
    assert_one_leader_at_a_time(groups, tick)
    cut_short = {victim.name: [dead_1], "k-1": [dead_2]}
    for d, old, took, saved in ((d2, victim.name, took_2, saved_2), (d1, "k-1", took_1, saved_1)):
        pairs = assert_claims_within_budgets(groups, cluster, d, cut_short=cut_short)
        before = [t for g, t in pairs if g.by == old and t is not None]
        after = [t for g, t in pairs if g == took]
        assert before, pairs
        assert after, pairs
        assert after[0] is not None, "the new leader's first tick was not logged"
        # Resumes at the persisted rate, which has grown well past initial_rate...
        assert after[0].rate == round(saved, 3), (saved, before[-1], after[0])  # logged to 3 places
        assert saved >= 2 * cluster.pacing.initial_rate, saved
        assert before[-1].rate >= 2 * cluster.pacing.initial_rate, before[-1]
        # ...with a first budget of one tick at that rate (plus carried credit): no burst.
        assert after[0].claimed <= after[0].budget <= after[0].rate * tick + 1, after[0]
    # What the reconciler's instance had claimed and never published came back
    # through the survivor's reconciler (after the claim lease), and completed.
    conn = await asyncpg.connect(db_dsn)
    try:
        stranded = await conn.fetch(
            "SELECT c.job_id, c.attempt, bool_or(e.event = 'lease_expired' AND e.at > $2)"
            " AS returned FROM pacerd.job_events c JOIN pacerd.job_events e"
            " ON e.job_id = c.job_id AND e.attempt = c.attempt AND e.id > c.id"
            " WHERE c.event = 'claimed' AND c.detail->>'by' = $1"
            " GROUP BY c.job_id, c.attempt"
            " HAVING NOT bool_or(e.event IN ('offered', 'released', 'completed'))",
            "k-1",
            killed_2,
        )
    finally:
        await conn.close()
    assert all(r["returned"] for r in stranded), [dict(r) for r in stranded]


async def test_a_leader_whose_lock_session_ends_stops_before_anyone_starts(
    cluster: Cluster, db_dsn: str, amqp_url: str
) -> None:
    (d,) = await _names(db_dsn, "term", 1)
    tick = 0.5
    cluster.pacing = Pacing(tick_seconds=tick, initial_rate=5, max_rate=60, claim_seconds=2)
    n = 500
    await schedule_backlog(db_dsn, d, n)
    partition = (await _placed(db_dsn, [d]))[d]
    try:
        async with ok_workers(amqp_url, [d]) as ups:
            a = cluster.start("t-a")
            await a.wait_event("destination_active", destination=d, within=30)
            b = cluster.start("t-b")
            await b.wait_event("leadership_session_connected", within=30)
            await anyio.sleep(4 * tick)
            pid = await lock_holder_pid(db_dsn, partition_lock(partition))
            assert pid is not None
            assert pid == a.events("leadership_session_connected")[-1]["backend_pid"]
            conn = await asyncpg.connect(db_dsn)
            try:
                cut_at: dt.datetime = await conn.fetchval(
                    "SELECT clock_timestamp() FROM pg_terminate_backend($1)", pid
                )
            finally:
                await conn.close()
            lost = await a.wait_event("leadership_lost", destination=d, within=5)
            assert lost["partition"] == partition, lost
            # The next leader (either instance) and its first claim; a claim of the
            # old leader's tick in flight at the cut is not a new leader's.
            taker, acquired = await next_acquisition([a, b], partition, after=cut_at, within=10)
            took = await first_claim_after(db_dsn, d, acquired["at"], within=10, by=taker.name)
            await wait_completed(db_dsn, n, within=40)
            received = dict(ups.received)
        assert await cluster.stop() == {"t-a": 0, "t-b": 0}
    finally:
        await delete_queues(amqp_url, [d])

    await assert_completed_exactly_once(db_dsn, n)
    # The old leader stopped before anyone started: it logged the loss before the
    # next leader's first claim, and after the loss it claimed nothing and
    # completed no tick (its tick in flight at the cut was cancelled)...
    assert lost["at"] < took.at, (cut_at, lost["at"], took)
    groups = await claim_groups(db_dsn, d)
    assert not [g for g in groups if g.by == "t-a" and lost["at"] < g.at < took.at], groups
    assert not [t for t in cluster.ticks(d) if t.by == "t-a" and lost["at"] < t.at < took.at]
    # ...and whoever leads next (either instance) took the lock on its next
    # supervisor pass and waited a tick after taking it.
    assert passes_before(taker, acquired, after=cut_at) <= 1, (cut_at, acquired)
    assert took.at >= acquired["at"] + dt.timedelta(seconds=tick - 0.005), (acquired, took)
    assert (took.at - cut_at).total_seconds() >= tick - 0.005, (cut_at, took)
    assert_one_leader_at_a_time(groups, tick)
    assert_claims_within_budgets(groups, cluster, d, cut_short={"t-a": [lost["at"]]})
    # Nothing the old leader claimed before the new leader's first claim reached
    # a worker after it: the old leader had stopped publishing.
    pre_cut = await _refs_claimed_before(db_dsn, "t-a", d, took.at)
    assert pre_cut
    assert not [ref for ref in pre_cut if received.get(ref, took.at) > took.at]


async def _refs_claimed_before(
    dsn: str, instance: str, destination: str, before: dt.datetime
) -> list[tuple[str, int]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT e.job_id, e.attempt FROM pacerd.job_events e JOIN pacerd.jobs j USING (job_id)"
            " WHERE e.event = 'claimed' AND e.detail->>'by' = $1 AND j.destination = $2"
            " AND e.at < $3",
            instance,
            destination,
            before,
        )
    finally:
        await conn.close()
    return [(r["job_id"], r["attempt"]) for r in rows]


async def test_a_partitioned_leader_stops_before_the_database_frees_its_lock(
    cluster: Cluster, db_dsn: str, amqp_url: str
) -> None:
    """All of the leader's database traffic goes through a proxy. Stalled, the
    proxy is a partition: the leader's lease lapses (5 s) and it stops; the
    server still holds its lock (its keepalives would end the session after
    2 x lease). The proxy then resets the server's connections, as those
    keepalives would, while the leader stays cut off: only then can the
    standby take over. Healed, the old leader rejoins as a standby."""
    (d,) = await _names(db_dsn, "part", 1)
    tick = 0.5
    cluster.pacing = Pacing(tick_seconds=tick, initial_rate=5, max_rate=60, claim_seconds=2)
    n = 400
    await schedule_backlog(db_dsn, d, n)
    partition = (await _placed(db_dsn, [d]))[d]
    parts = urlsplit(db_dsn)
    proxy = FaultProxy(parts.port or 5432, target_host=parts.hostname or "127.0.0.1")
    await proxy.start()
    try:
        async with ok_workers(amqp_url, [d]) as ups:
            a = cluster.start("p-a", dsn=with_port(db_dsn, proxy.port))
            await a.wait_event("destination_active", destination=d, within=30)
            b = cluster.start("p-b")
            await b.wait_event("leadership_session_connected", within=30)
            await anyio.sleep(4 * tick)
            stalled_at = utcnow()
            proxy.partition()
            lost = await a.wait_event("leadership_lost", destination=d, within=10)
            assert lost["partition"] == partition, lost
            # the server still holds it
            assert await lock_holder_pid(db_dsn, partition_lock(partition)) is not None
            with anyio.fail_after(15):
                while utcnow() < stalled_at + dt.timedelta(seconds=10):
                    await anyio.sleep(0.1)
            cut_at = utcnow()
            proxy.reset()
            took = await first_claim_after(db_dsn, d, stalled_at, within=10, not_by="p-a")
            proxy.heal()
            await wait_completed(db_dsn, n, within=40)
            received = dict(ups.received)
        assert await cluster.stop() == {"p-a": 0, "p-b": 0}
    finally:
        await delete_queues(amqp_url, [d])
        await proxy.close()

    await assert_completed_exactly_once(db_dsn, n)
    # The lease lapsed (the leader stopped) while the server still held the lock.
    assert stalled_at < lost["at"] < cut_at, (stalled_at, lost, cut_at)
    assert took.by == "p-b"
    assert not [g for g in await claim_groups(db_dsn, d) if g.by == "p-a" and cut_at < g.at]
    assert took.at >= cut_at + dt.timedelta(seconds=tick - 0.005), (cut_at, took)
    # Once the server freed it, the standby took it on its next supervisor pass.
    acquired = acquisition(b, partition, after=cut_at)
    assert passes_before(b, acquired, after=cut_at) <= 1, (cut_at, acquired)
    assert took.at >= acquired["at"] + dt.timedelta(seconds=tick - 0.005), (acquired, took)
    groups = await claim_groups(db_dsn, d)
    assert_one_leader_at_a_time(groups, tick)
    pre = await _refs_claimed_before(db_dsn, "p-a", d, cut_at)
    assert pre
    assert not [ref for ref in pre if received.get(ref, lost["at"]) > lost["at"]]


async def test_a_leader_cut_off_from_the_broker_gives_its_destinations_up(
    cluster: Cluster, db_dsn: str, amqp_url: str
) -> None:
    """A leader that cannot publish cannot admit: after max(5 s, 3 x tick)
    without the broker it closes its lock session — it no longer counts as an
    instance — and the standby takes the destination over."""
    (d,) = await _names(db_dsn, "amqp", 1)
    tick = 0.5
    cluster.pacing = Pacing(
        tick_seconds=tick, initial_rate=5, max_rate=60, claim_seconds=2, publish_timeout_seconds=2
    )
    n = 250
    await schedule_backlog(db_dsn, d, n)
    await _placed(db_dsn, [d])
    parts = urlsplit(amqp_url)
    proxy = FaultProxy(parts.port or 5672, target_host=parts.hostname or "127.0.0.1")
    await proxy.start()
    try:
        async with ok_workers(amqp_url, [d]):
            via = with_port(amqp_url, proxy.port)
            a = cluster.start("b-a", amqp_url=via)
            await a.wait_event("destination_active", destination=d, within=30)
            b = cluster.start("b-b")
            await b.wait_event("leadership_session_connected", within=30)
            await anyio.sleep(4 * tick)
            cut_at = utcnow()
            proxy.refuse = True
            proxy.reset()  # the broker connection is reset, and reconnecting is refused
            closed = await a.wait_event("leadership_session_closed", within=20)
            assert (closed["at"] - cut_at).total_seconds() >= 5.0
            took = await first_claim_after(db_dsn, d, cut_at, within=10, not_by="b-a")
            proxy.heal()
            await wait_completed(db_dsn, n, within=40)
        assert await cluster.stop() == {"b-a": 0, "b-b": 0}
    finally:
        await delete_queues(amqp_url, [d])
        await proxy.close()

    await assert_completed_exactly_once(db_dsn, n)
    assert took.by == "b-b"
    assert took.at >= closed["at"] + dt.timedelta(seconds=tick - 0.005), (closed, took)
    assert_one_leader_at_a_time(await claim_groups(db_dsn, d), tick)
