"""The fault scenarios, each one function of a ``Scale``: the fast tests run
them small, ``bench/faults/run.py`` runs them full (and, with ``real=True``,
with the real service faults: PostgreSQL and RabbitMQ restarts, the RabbitMQ
memory alarm). Each returns the ``Audit`` (see ``faultlib``) and never asserts:
the caller checks ``audit.violations()``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import aio_pika
import anyio
import anyio.to_thread
import asyncpg
from faultlib import (
    DB_DOWN,
    Audit,
    Bounds,
    Knobs,
    PacerdProc,
    Rig,
    Sample,
    concurrency,
    rabbitmqctl,
    rises,
    sample_every_tick,
    sample_forever,
    sample_once,
)

from pacerd.publisher import INVALID_QUEUE, OUTCOMES_EXCHANGE

if TYPE_CHECKING:
    from pathlib import Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Env:
    """Where a scenario runs: a migrated ledger, a vhost of its own, a work dir."""

    dsn: str
    amqp_url: str
    workdir: Path
    destination: str
    real: bool = False  # the benchmark's real service faults (restarts, memory alarm)
    seed: int = 1
    restart_seconds: float = 2.0  # how soon a crashed process is restarted (systemd: 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scale:
    jobs: int
    faults: int
    workers: int = 2
    settle_seconds: float = 30.0
    knobs: Knobs = field(default_factory=Knobs)


def _rig(env: Env, *, knobs: Knobs, **options: Any) -> Rig:
    return Rig(
        dsn=env.dsn, amqp_url=env.amqp_url, workdir=env.workdir, destination=env.destination,
        knobs=knobs, restart_seconds=env.restart_seconds, **options,
    )  # fmt: skip


def _capacity(knobs: Knobs) -> float:
    """The upstream's capacity: a quarter above the pacer's ceiling, so that in a
    fault-free drain it never refuses (with its burst of half a second, it absorbs
    the pacer's jitter), and any refusal means a fault made the upstream see more."""
    return knobs.max_rate * 1.25


def _progress_marks(jobs: int, faults: int) -> list[int]:
    """Completed counts at which to inject each fault, spread over the drain."""
    return [max(1, int(jobs * (i + 1) / (faults + 2))) for i in range(faults)]


async def _restart(rig: Rig) -> PacerdProc:
    return await rig.start_pacerd(wait_ready=False)


# -- 1. kill -9 of pacerd ------------------------------------------------------------------


async def pacerd_kill(env: Env, scale: Scale) -> Audit:
    """kill -9 of pacerd during a drain, restarting it each time; every third
    kill lands between claim and publish (the broker path stalled, killed once a
    claim made after the stall is seen in the ledger), every third between the
    publisher confirm and mark-offered (the ledger path stalled as a publish
    goes out, killed once a worker holds an offer whose claim is not yet marked
    offered), every third at a random moment. Each window is observed before
    the kill, so the kills hit it every time."""
    rng = random.Random(env.seed)
    async with _rig(
        env,
        knobs=scale.knobs,
        proxy_ledger=True,
        proxy_broker=True,
        capacity=_capacity(scale.knobs),
    ) as rig:
        assert rig.ledger_proxy is not None
        assert rig.broker_proxy is not None
        ledger_proxy, broker_proxy = rig.ledger_proxy, rig.broker_proxy
        await rig.schedule(scale.jobs)
        proc, _ = await rig.start(workers=scale.workers)
        kinds = itertools.cycle(["confirm→mark-offered", "claim→publish", "random moment"])
        # Per kill: its kind, and the claims the killed daemon held (never marked offered).
        held: list[tuple[str, set[tuple[str, int]]]] = []
        # Long enough for a publish in flight at the stall to time out and the next claim to come.
        window_within = scale.knobs.publish_timeout_seconds + 10 * scale.knobs.tick_seconds + 10
        for mark in _progress_marks(scale.jobs, scale.faults):
            await rig.wait_completed(mark, within=scale.settle_seconds + 60)
            kind = next(kinds)
            instance = rig.instance_of(proc)
            async with rig.fault(f"kill -9 pacerd ({kind})") as fault:
                if kind == "random moment":
                    await anyio.sleep(rng.uniform(0, scale.knobs.tick_seconds * 3))
                elif kind == "claim→publish":
                    broker_proxy.stall()
                    stalled_at = await rig.db().fetchval("SELECT clock_timestamp()")
                    # A claim whose transaction began after the stall can only be
                    # published into it: held by the proxy, dropped with the kill.
                    with anyio.fail_after(window_within):
                        while not await rig.claimed_since(instance, stalled_at):
                            await anyio.sleep(0.02)
                else:
                    went_out = anyio.Event()

                    async def stall_ledger(event: anyio.Event = went_out) -> None:
                        ledger_proxy.stall()
                        event.set()

                    rig.publish_trigger(stall_ledger)
                    with anyio.fail_after(window_within):
                        await went_out.wait()
                        # The publish reached a worker; mark-offered hangs on the stall.
                        while not set(await rig.stranded_claims(instance)) & rig.delivered():
                            await anyio.sleep(0.02)
                proc.kill9()
                # What was held in the stalled proxies dies with the daemon's
                # connections: wait until they are gone before letting data flow.
                with anyio.fail_after(10):
                    while broker_proxy.active or ledger_proxy.active:
                        await anyio.sleep(0.01)
                broker_proxy.on_client_chunk = None
                held.append((kind, set(await rig.stranded_claims(instance))))
                fault.detail["instance"] = instance
                ledger_proxy.unstall()
                broker_proxy.unstall()
            proc = await _restart(rig)
        audit = await rig.audit(
            "kill -9 pacerd",
            within=scale.settle_seconds,
            bounds=Bounds(dup_offers=scale.faults * _tick_budget(scale.knobs)),
        )
        delivered = rig.delivered()
        published = unpublished = 0
        for fault, (kind, claims) in zip(rig.faults, held, strict=True):
            p = len(claims & delivered)
            u = len(claims) - p
            fault.detail.update(published_not_marked=p, claimed_not_published=u)
            published, unpublished = published + p, unpublished + u
            if kind == "confirm→mark-offered" and not p:
                audit.notes.append(f"VIOLATION: the kill ({kind}) held no published claim")
            if kind == "claim→publish" and not u:
                audit.notes.append(f"VIOLATION: the kill ({kind}) held no unpublished claim")
        audit.notes.append(
            f"stranded claims at the kills: {unpublished} claimed but never published,"
            f" {published} published but not marked offered"
        )
        return audit


def _offer_bound(rig: Rig, scale: Scale) -> int:
    """Duplicate offers a scenario may cause (they are fenced by the attempt and
    skipped by the workers): per fault, what was in flight (every worker's
    prefetch, one tick's budget); and while the broker blocked or the broker
    path stalled for D seconds, a tick's budget per publish timeout: pacerd
    keeps claiming and publishing, each publish times out and is released and
    claimed again, and the broker delivers every held publish when it resumes."""
    budget = _tick_budget(scale.knobs)
    bound = 0
    for fault in rig.faults:
        bound += scale.workers * rig.prefetch + budget
        held = (fault.ended or fault.started) - fault.started
        if held > 0.5:
            bound += math.ceil(held / scale.knobs.publish_timeout_seconds) * budget
    return bound


def _tick_budget(knobs: Knobs) -> int:
    """The most one tick can claim: two ticks of the top rate (a late tick) plus credit."""
    return math.ceil(knobs.max_rate * 2 * knobs.tick_seconds) + 1


# -- 2. kill -9 of workers ------------------------------------------------------------------


async def worker_kill(env: Env, scale: Scale, *, hold_ms: float = 150.0) -> Audit:
    """kill -9 of workers between the upstream call and the outcome report: each
    handler holds ``hold_ms`` after its call, so a kill lands in that window for
    every call in flight; a replacement worker is started after each kill."""
    rng = random.Random(env.seed)
    prefetch = 8
    async with _rig(
        env,
        knobs=scale.knobs,
        capacity=_capacity(scale.knobs),
        hold_ms=hold_ms,
        prefetch=prefetch,
    ) as rig:
        await rig.schedule(scale.jobs)
        await rig.start(workers=scale.workers)
        for mark in _progress_marks(scale.jobs, scale.faults):
            await rig.wait_completed(mark, within=scale.settle_seconds + 60)
            victim = rng.choice([w for w in rig.workers if w.alive])
            async with rig.fault("kill -9 worker", pid=victim.pid):
                await anyio.sleep(rng.uniform(0, hold_ms / 1000))
                victim.kill9()
            await rig.start_worker()
        audit = await rig.audit(
            "kill -9 workers",
            within=scale.settle_seconds,
            bounds=Bounds(dup_offers=scale.faults * prefetch),
        )
        killed = {w.pid for w in rig.workers if w.killed}
        calls = rig.call_log()
        completed_by = await rig.db().fetch(
            "SELECT e.job_id, e.attempt, (e.detail->'detail'->>'pid')::int AS pid"
            " FROM pacerd.job_events e JOIN pacerd.jobs j USING (job_id)"
            " WHERE j.destination = $1 AND e.event = 'completed'",
            env.destination,
        )
        done = {(r["job_id"], r["attempt"], r["pid"]) for r in completed_by}
        cut = sum(
            1
            for c in calls
            if c.get("ev") == "called" and c["pid"] in killed
            and (c["job_id"], c["attempt"], c["pid"]) not in done
        )  # fmt: skip
        audit.notes.append(
            f"{cut} upstream calls were cut between the call and the outcome report;"
            f" {audit.replays} calls repeated a key (absorbed by the idempotency key)"
        )
        if scale.faults and not cut:
            audit.notes.append("VIOLATION: no kill landed between an upstream call and its report")
        return audit


# -- 3. the broker -----------------------------------------------------------------------------


async def broker_faults(env: Env, scale: Scale) -> Audit:
    """Broker trouble mid-drain. Fast (through the fault proxies): pacerd's and
    the workers' AMQP connections reset, and a blocked broker (publishes held
    past ``publish_timeout_seconds``, then delivered late) — a one-way stall,
    as RabbitMQ blocks a publishing connection by no longer reading from it.
    Real (``env.real``): RabbitMQ stopped and started (``rabbitmqctl stop_app``
    / ``start_app``), and the memory alarm raised and cleared
    (``set_vm_memory_high_watermark 0``)."""
    real = env.real
    async with _rig(
        env,
        knobs=scale.knobs,
        capacity=_capacity(scale.knobs),
        proxy_broker=not real,
        proxy_workers=not real,
    ) as rig:
        await rig.schedule(scale.jobs)
        await rig.start(workers=scale.workers)
        plan = (
            ["broker restart", "memory alarm"]
            if real
            else ["pacerd↔broker reset", "workers↔broker reset", "broker blocks publishers"]
        )
        faults = list(itertools.islice(itertools.cycle(plan), scale.faults))
        for kind, mark in zip(faults, _progress_marks(scale.jobs, len(faults)), strict=True):
            await rig.wait_completed(mark, within=scale.settle_seconds + 120)
            async with rig.fault(kind):
                if kind == "pacerd↔broker reset":
                    assert rig.broker_proxy is not None
                    rig.broker_proxy.reset()
                elif kind == "workers↔broker reset":
                    assert rig.worker_proxy is not None
                    rig.worker_proxy.reset()
                elif kind == "broker blocks publishers":
                    assert rig.broker_proxy is not None
                    assert rig.worker_proxy is not None
                    rig.broker_proxy.stall(down=False)
                    rig.worker_proxy.stall(down=False)
                    await anyio.sleep(scale.knobs.publish_timeout_seconds * 1.5)
                    rig.broker_proxy.unstall()
                    rig.worker_proxy.unstall()
                elif kind == "broker restart":
                    await _ctl("stop_app")
                    await anyio.sleep(5)
                    await _ctl("start_app")
                    await _ctl_wait_running()
                else:
                    await _memory_alarm(seconds=8)
        audit = await rig.audit(
            "broker faults" if not real else "RabbitMQ restart and memory alarm",
            within=scale.settle_seconds,
            bounds=Bounds(dup_offers=_offer_bound(rig, scale)),
        )
        return audit


async def _ctl(*args: str) -> None:
    done = await anyio.to_thread.run_sync(lambda: rabbitmqctl(*args))
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()}")


async def _ctl_wait_running(within: float = 120) -> None:
    with anyio.fail_after(within):
        while True:
            done = await anyio.to_thread.run_sync(
                lambda: subprocess.run(
                    ["rabbitmq-diagnostics", "-q", "check_running"],
                    capture_output=True,
                    check=False,
                )
            )
            if done.returncode == 0:
                return
            await anyio.sleep(1)


async def _memory_alarm(*, seconds: float) -> None:
    """Raises RabbitMQ's memory alarm (every publisher blocked) and restores the watermark."""
    done = await anyio.to_thread.run_sync(
        lambda: rabbitmqctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().")
    )
    previous = done.stdout.strip() or "0.4"
    try:
        float(previous)
    except ValueError:
        previous = "0.4"
    await _ctl("set_vm_memory_high_watermark", "0")
    try:
        await anyio.sleep(seconds)
    finally:
        with anyio.CancelScope(shield=True):
            await _ctl("set_vm_memory_high_watermark", previous)


# -- 4. PostgreSQL ------------------------------------------------------------------------------


async def ledger_faults(env: Env, scale: Scale, *, crashes_allowed: int = 0) -> Audit:
    """PostgreSQL trouble mid-drain: every backend of the ledger but the harness's
    terminated (``pg_terminate_backend``: the pool, the leadership session, the
    workers' ``is_current`` checks); real (``env.real``): also PostgreSQL
    restarted (``pg_ctlcluster 15 main restart``), every other fault."""
    async with _rig(env, knobs=scale.knobs, capacity=_capacity(scale.knobs)) as rig:
        rig.crashes_allowed = crashes_allowed
        rig.crash_loop_after = 1000  # supervised: a crash is restarted; see whether it drains
        await rig.schedule(scale.jobs)
        await rig.start(workers=scale.workers)
        for i, mark in enumerate(_progress_marks(scale.jobs, scale.faults)):
            await rig.wait_completed(mark, within=scale.settle_seconds + 120)
            if env.real and i % 2 == 1:
                async with rig.fault("PostgreSQL restart"):
                    await _pg_restart()
                await _pool_back(rig)
            else:
                async with rig.fault("pg_terminate_backend") as fault:
                    fault.detail["backends"] = await rig.terminate_backends()
        return await rig.audit(
            "PostgreSQL faults" if not env.real else "PostgreSQL terminate and restart",
            within=scale.settle_seconds,
            bounds=Bounds(
                dup_offers=_offer_bound(rig, scale),
                crashes_allowed=crashes_allowed,
            ),
        )


async def _pg_restart() -> None:
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", "15", "main", "restart"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    )
    if done.returncode != 0:
        raise RuntimeError(f"pg_ctlcluster restart: {done.stderr.strip()}")


async def _pool_back(rig: Rig, within: float = 60) -> None:
    with anyio.fail_after(within):
        while True:
            try:
                await rig.db().fetchval("SELECT 1")
                return
            except DB_DOWN:
                await anyio.sleep(0.5)


# -- 5. the network ------------------------------------------------------------------------------


async def network_faults(env: Env, scale: Scale) -> Audit:
    """Network trouble between pacerd and each service, and between the workers
    and the broker, through the TCP fault proxy, in rounds: latency on every
    path; the ledger path stalled, then reset; the broker path stalled past the
    publish timeout, then pacerd's and the workers' broker connections reset."""
    stall = max(1.0, scale.knobs.publish_timeout_seconds * 1.5)
    async with _rig(
        env,
        knobs=scale.knobs,
        capacity=_capacity(scale.knobs),
        proxy_ledger=True,
        proxy_broker=True,
        proxy_workers=True,
    ) as rig:
        assert rig.ledger_proxy
        assert rig.broker_proxy
        assert rig.worker_proxy
        ledger, broker, workers = rig.ledger_proxy, rig.broker_proxy, rig.worker_proxy
        await rig.schedule(scale.jobs)
        await rig.start(workers=scale.workers)
        rounds = itertools.cycle(["latency", "ledger", "broker"])
        for mark in _progress_marks(scale.jobs, scale.faults):
            await rig.wait_completed(mark, within=scale.settle_seconds + 60)
            kind = next(rounds)
            if kind == "latency":
                async with rig.fault("latency 30 ms on every path"):
                    for proxy in (ledger, broker, workers):
                        proxy.latency_seconds = 0.03
                    await anyio.sleep(stall)
                    for proxy in (ledger, broker, workers):
                        proxy.latency_seconds = 0.0
            elif kind == "ledger":
                async with rig.fault("ledger path stalled"):
                    ledger.stall()
                    await anyio.sleep(stall)
                    ledger.unstall()
                async with rig.fault("ledger connections reset"):
                    ledger.reset()
            else:
                async with rig.fault("broker path stalled"):
                    broker.stall()
                    await anyio.sleep(stall)
                    broker.unstall()
                async with rig.fault("broker connections reset"):
                    broker.reset()
                    workers.reset()
        return await rig.audit(
            "network faults (proxy)",
            within=scale.settle_seconds,
            bounds=Bounds(dup_offers=_offer_bound(rig, scale)),
        )


# -- 6. bad input --------------------------------------------------------------------------------


def malformed_outcomes(n: int) -> list[bytes]:
    """``n`` outcome messages that do not follow the protocol, of every kind."""
    shapes: list[bytes] = [
        b"not json",
        b"",
        b"[1, 2, 3]",
        json.dumps({"job_id": 42, "attempt": 1, "outcome": "ok"}).encode(),
        json.dumps({"job_id": "j", "attempt": "1", "outcome": "ok"}).encode(),
        json.dumps({"job_id": "j", "attempt": 0, "outcome": "ok"}).encode(),
        json.dumps({"job_id": "j", "attempt": 2**40, "outcome": "ok"}).encode(),
        json.dumps({"job_id": "j", "attempt": 1, "outcome": "maybe"}).encode(),
        json.dumps(
            {"job_id": "j", "attempt": 1, "outcome": "refused", "retry_after_s": -1}
        ).encode(),
        json.dumps({"job_id": "j", "attempt": 1, "outcome": "retry", "error": {"x": 1}}).encode(),
        json.dumps({"job_id": "j", "attempt": 1, "outcome": "ok", "detail": [1]}).encode(),
        json.dumps({"job_id": "  ", "attempt": 1, "outcome": "ok"}).encode(),
        b"\xff\xfe\x00garbage" * 10,
        b"x" * 1_000_000,  # a megabyte of garbage
    ]
    return [shapes[i % len(shapes)] for i in range(n)]


async def _publish(amqp_url: str, bodies: list[bytes]) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(OUTCOMES_EXCHANGE)
        for body in bodies:
            await exchange.publish(aio_pika.Message(body, delivery_mode=2), routing_key="")


async def _invalid_count(amqp_url: str, *, purge: bool = False) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            INVALID_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
        )
        if purge:
            await queue.purge()
            return 0
        return int(queue.declaration_result.message_count or 0)


async def bad_input(env: Env, scale: Scale) -> Audit:
    """Bad input mid-drain: a flood of malformed outcome messages (not JSON,
    wrong types, out-of-range values, a megabyte of garbage), outcomes for
    unknown jobs (one with a 2 MB detail) and for stale attempts, producer calls
    the SQL API must refuse (an oversized payload, an empty id, a bad
    destination, max_attempts 0), and a config file reloaded with errors."""
    n_bad = max(15, scale.faults)
    async with _rig(env, knobs=scale.knobs, capacity=_capacity(scale.knobs)) as rig:
        await rig.schedule(scale.jobs)
        await _invalid_count(env.amqp_url, purge=True)
        proc, _ = await rig.start(workers=scale.workers)
        await rig.wait_completed(scale.jobs // 3, within=scale.settle_seconds + 60)
        async with rig.fault("malformed outcomes", count=n_bad):
            await _publish(env.amqp_url, malformed_outcomes(n_bad))
        async with rig.fault("outcomes for unknown jobs", count=n_bad // 3 + 1):
            unknown = [
                {"job_id": f"nobody-{i}", "attempt": 1, "outcome": "ok"} for i in range(n_bad // 3)
            ]
            unknown.append(
                {
                    "job_id": "nobody-big",
                    "attempt": 1,
                    "outcome": "ok",
                    "detail": {"x": "y" * 2**21},
                }
            )
            await _publish(env.amqp_url, [json.dumps(u).encode() for u in unknown])
        done = await rig.db().fetch(
            "SELECT job_id, attempt FROM pacerd.jobs WHERE destination = $1 AND state = 'completed'"
            " ORDER BY job_id LIMIT $2",
            env.destination,
            n_bad // 3,
        )
        waiting = await rig.db().fetch(
            "SELECT job_id FROM pacerd.jobs WHERE destination = $1 AND state = 'scheduled'"
            " ORDER BY job_id LIMIT $2",
            env.destination,
            n_bad // 3,
        )
        stale = [{"job_id": r["job_id"], "attempt": r["attempt"], "outcome": "retry"} for r in done]
        stale += [{"job_id": r["job_id"], "attempt": 1000, "outcome": "fail"} for r in waiting]
        async with rig.fault("outcomes for stale attempts", count=len(stale)):
            await _publish(env.amqp_url, [json.dumps(s).encode() for s in stale])
        rejected = 0
        async with rig.fault("SQL API calls it must refuse", count=4) as fault:
            for args in (
                ("big", env.destination, json.dumps({"x": "y" * 300_000}), 10),
                ("", env.destination, "{}", 10),
                ("bad-dest", "no spaces allowed", "{}", 10),
                ("zero", env.destination, "{}", 0),
            ):
                try:
                    await rig.producer().fetchval(
                        "SELECT pacerd.schedule(job_id => $1, kind => 'fault.call',"
                        " destination => $2, payload => $3::jsonb, max_attempts => $4)",
                        *args,
                    )
                except asyncpg.PostgresError as exc:
                    rejected += exc.sqlstate == "22023"
            fault.detail["rejected_22023"] = rejected
        async with rig.fault("config reloaded with errors"):
            config = rig.workdir / f"{proc.name}.toml"
            good = config.read_text()
            config.write_text(good + "\n[pacing]\ntick_second = -1\n")
            proc.send(signal.SIGHUP)
            await proc.wait_event("reload_rejected", within=10)
            config.write_text(good)
            proc.send(signal.SIGHUP)
            await proc.wait_event("config_reloaded", within=10)
        expected_parked = n_bad
        with anyio.move_on_after(20):
            while await _invalid_count(env.amqp_url) < expected_parked:
                await anyio.sleep(0.1)
        audit = await rig.audit("bad input", within=scale.settle_seconds)
        parked = await _invalid_count(env.amqp_url)
        stale_events = await rig.db().fetchval(
            "SELECT count(*) FROM pacerd.job_events WHERE event = 'stale_report'"
        )
        big = await rig.db().fetchval("SELECT count(*) FROM pacerd.jobs WHERE job_id = 'big'")
        audit.notes.append(
            f"{parked} of {expected_parked} malformed outcomes parked in {INVALID_QUEUE};"
            f" {stale_events} stale reports recorded and ignored; {rejected} of 4 bad"
            f" producer calls refused with SQLSTATE 22023; invalid config rejected on SIGHUP"
        )
        if parked != expected_parked:
            audit.notes.append(f"VIOLATION: parked {parked}, expected {expected_parked}")
        if stale_events < len(stale):
            audit.notes.append(f"VIOLATION: {stale_events} stale reports recorded of {len(stale)}")
        if rejected != 4 or big:
            audit.notes.append("VIOLATION: the SQL API accepted bad producer input")
        return audit


POISONS = {
    "nul": "an outcome whose error holds a NUL character (valid JSON, text PostgreSQL rejects)",
    "nested": "an outcome nested 100,000 deep (JSON the decoder cannot recurse into)",
    "payload": "a job whose payload is nested 1,500 deep (PostgreSQL stores it; workers decode it)",
}


async def poison(env: Env, scale: Scale, *, kind: str) -> Audit:
    """One poison message among a drain's normal traffic (see ``POISONS``): it
    must be parked (or its job closed with a reason) while everything else
    completes and every process keeps running."""
    async with _rig(env, knobs=scale.knobs, capacity=_capacity(scale.knobs)) as rig:
        rig.crash_loop_after = 0  # a crash is the failure under test: no need to wait on
        await rig.schedule(scale.jobs)
        await _invalid_count(env.amqp_url, purge=True)
        proc, _workers = await rig.start(workers=scale.workers)
        await rig.wait_completed(scale.jobs // 4, within=scale.settle_seconds + 60)
        async with rig.fault(f"poison: {kind}"):
            if kind == "nul":
                doc = {"job_id": "nobody", "attempt": 1, "outcome": "retry", "error": "a\u0000b"}
                await _publish(env.amqp_url, [json.dumps(doc).encode()])
            elif kind == "nested":
                await _publish(env.amqp_url, [b"[" * 100_000])
            else:
                depth = 1500
                await rig.producer().fetchval(
                    "SELECT pacerd.schedule(job_id => 'deep', kind => 'fault.call',"
                    " destination => $1, payload => (repeat('[', $2) || repeat(']', $2))::jsonb,"
                    " max_attempts => 2)",
                    env.destination,
                    depth,
                )
                rig.jobs += 1
        bounds = Bounds(dup_offers=4, must_complete=kind != "payload")
        audit = await rig.audit(
            f"poison {kind}", within=scale.settle_seconds, bounds=bounds,
            expect_healthy=[proc],
        )  # fmt: skip
        if kind == "payload":
            row = await rig.db().fetchrow(
                "SELECT state, last_error FROM pacerd.jobs WHERE job_id = 'deep'"
            )
            audit.notes.append(f"the poison job: {dict(row) if row else None}")
            if row is None or row["state"] != "dead":
                audit.notes.append("VIOLATION: the poison job was not closed (dead with a reason)")
        else:
            parked = await _invalid_count(env.amqp_url)
            audit.notes.append(f"{parked} of 1 poison outcome parked")
            if parked != 1:
                audit.notes.append("VIOLATION: the poison outcome was not parked")
        return audit


# -- 7. the recovery drill (seed 000) ----------------------------------------------------------


# "Resume with a small budget": a few jobs a tick, growing slowly.
DRILL_KNOBS = Knobs(claim_seconds=4.0, initial_rate=6.0, min_rate=6.0, max_rate=30.0)


@dataclass(slots=True)
class DrillReport:
    samples: list[Sample]
    resumed_at: float
    first_claim_at: float | None
    drained_at: float | None
    max_inflight_seen: int
    max_concurrent_calls: int
    saturation_bound: int
    age_rises: list[tuple[float, float]]
    failover_seconds: float | None
    interrupted: dict[str, Any]
    wall_rises: list[tuple[float, float]]


async def recovery_drill(env: Env, scale: Scale) -> tuple[Audit, DrillReport]:
    """The recovery drill: pause dispatch, accumulate due records,
    supersede one job's revision while it waits, resume with a small budget with
    two dispatchers running at once, interrupt the leading one once between
    enqueue and mark-offered (kill -9 right after the last publish of a tick,
    its ledger path stalled so mark-offered cannot happen first).

    Pass: the oldest-due age falls monotonically after resume (sampled every
    tick), the worker pool stays under its saturation bound (``max_inflight`` =
    workers x prefetch, and never more calls at once), completed effects do not
    repeat, the superseded revision never executes."""
    workers, prefetch = 2, 8
    bound = workers * prefetch
    knobs = replace(scale.knobs, max_inflight=bound)
    async with _rig(
        env,
        knobs=knobs,
        capacity=_capacity(knobs),
        prefetch=prefetch,
        proxy_ledger=True,
        proxy_broker=True,
    ) as rig:
        assert rig.ledger_proxy is not None
        assert rig.broker_proxy is not None
        db = rig.db()
        # 1. Pause dispatch, durably (every instance sees it).
        await rig.operator().fetchval("SELECT pacerd.pause($1)", env.destination)
        leader = await rig.start_pacerd(wait_ready=False)  # proxied: the one we interrupt
        pool = [await rig.start_worker() for _ in range(workers)]
        await leader.wait_event("leadership_acquired", partition=rig.partition, within=60)
        standby = await rig.start_pacerd(wait_ready=False, proxied=False)
        for w in pool:
            await w.wait_event("worker_started", within=60)
        await standby.wait_event("pacerd_ready", within=60)
        # 2. Accumulate due records (and a few that are not due yet).
        await rig.schedule(scale.jobs, prefix="due")
        await rig.schedule(5, prefix="later", overdue_from_seconds=-3600, overdue_to_seconds=-3000)
        # 3. Supersede one job's revision while it waits.
        victim = f"due-{scale.jobs // 2}"
        revised = await rig.producer().fetchval(
            "SELECT pacerd.schedule(job_id => $1, kind => 'fault.call', destination => $2,"
            " payload => '{\"revision\": 1}'::jsonb, eligible_at => now() - interval '30 min',"
            " revision => 1)",
            victim,
            env.destination,
        )
        assert revised == "revised", revised
        # 4. Interrupt the leader right after the last publish of a tick.
        instance = rig.instance_of(leader)
        interrupted = anyio.Event()
        state: dict[str, Any] = {"at": None, "published": 0}

        async def after_last_publish(chunk: bytes) -> None:
            from faultlib import PUBLISH_FRAME

            n = chunk.count(PUBLISH_FRAME)
            if not n or interrupted.is_set():
                return
            row = await db.fetchrow(
                "SELECT at, count(*) AS n FROM pacerd.job_events WHERE event = 'claimed'"
                " AND detail->>'by' = $1 GROUP BY at ORDER BY at DESC LIMIT 1",
                instance,
            )
            if row is None:
                return
            if row["at"] != state["at"]:
                state.update(at=row["at"], published=0)
            state["published"] += n
            if (
                state["published"] >= row["n"] >= 2
                and await rig.counts_completed() >= scale.jobs // 4
            ):
                assert rig.ledger_proxy is not None
                rig.ledger_proxy.stall()  # mark-offered cannot reach the ledger
                state["tick_claims"] = row["n"]
                interrupted.set()

        rig.broker_proxy.on_client_chunk = after_last_publish
        samples: list[Sample] = []
        wall: list[Sample] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample_every_tick, rig, samples)
            tg.start_soon(sample_forever, rig, wall, knobs.tick_seconds)
            # 5. Resume with a small budget.
            resumed_at = time.time()
            await rig.operator().fetchval("SELECT pacerd.resume($1)", env.destination)
            with anyio.fail_after(scale.settle_seconds + 30):
                await interrupted.wait()
            async with rig.fault("kill -9 dispatcher between enqueue and mark-offered"):
                await anyio.sleep(0.05)  # the last publish reaches the broker
                leader.kill9()
            rig.broker_proxy.on_client_chunk = None
            rig.ledger_proxy.unstall()
            killed_at = time.time()
            took_over = await standby.wait_event(
                "leadership_acquired", partition=rig.partition, within=30
            )
            drained = await rig.settle(within=scale.settle_seconds)
            tg.cancel_scope.cancel()
        # the samples follow tick records, read every 10 ms: the last tick's may
        # not have been read when the settle saw the last job completed
        await sample_once(rig, samples, "after the settle")
        audit = await rig.audit(
            "recovery drill",
            within=scale.settle_seconds,
            bounds=Bounds(dup_offers=0),
            superseded_keys=[f"{victim}@r0"],
            expect_healthy=[standby],
        )
        calls = rig.call_log()
        first_claim = await db.fetchval(
            "SELECT extract(epoch FROM min(at))::float8 FROM pacerd.job_events"
            " WHERE event = 'claimed'"
        )
        after = [s for s in samples if first_claim is not None and s.t >= first_claim]
        drained_at = next((s.t for s in after if s.due == 0), None)
        during = [s for s in after if drained_at is None or s.t <= drained_at]
        takeover_at = _ts(took_over)
        published, unpublished = await rig.claim_windows(instance)
        wall_after = [s for s in wall if first_claim is not None and s.t >= first_claim]
        wall_during = [s for s in wall_after if drained_at is None or s.t <= drained_at]
        report = DrillReport(
            samples=samples,
            resumed_at=resumed_at,
            first_claim_at=first_claim,
            drained_at=drained_at,
            max_inflight_seen=max((s.inflight for s in samples), default=0),
            max_concurrent_calls=concurrency(calls),
            saturation_bound=bound,
            age_rises=rises(during),
            failover_seconds=None if takeover_at is None else takeover_at - killed_at,
            interrupted={
                "tick_claims": state.get("tick_claims"),
                "published_not_marked": published,
                "claimed_not_published": unpublished,
            },
            wall_rises=rises(wall_during),
        )
        audit.notes.append(
            f"interrupted a tick of {report.interrupted['tick_claims']} claims after its last"
            f" publish: {published} enqueued but never marked offered (completed through the"
            f" worker's report), {unpublished} never published;"
            f" the standby took over in {report.failover_seconds or 0:.2f} s"
        )
        with (rig.workdir / "logs" / "drill-samples.jsonl").open("w") as out:
            for sample in samples:
                out.write(json.dumps(asdict(sample)) + "\n")
        audit.notes.append(
            f"oldest-due age: {len(during)} samples (one per tick) after the first claim, rises:"
            f" {[round(r, 2) for _t, r in report.age_rises]}; sampled every"
            f" {knobs.tick_seconds} s of wall time instead: {len(report.wall_rises)} rises of"
            f" {len(wall_during)} samples;"
            f" in flight at most {report.max_inflight_seen}, calls at once at most"
            f" {report.max_concurrent_calls} (saturation bound {bound})"
        )
        if not drained:
            audit.notes.append("VIOLATION: the backlog did not drain")
        if report.age_rises:
            audit.notes.append("VIOLATION: the oldest-due age rose after resume")
        if report.max_inflight_seen > bound or report.max_concurrent_calls > bound:
            audit.notes.append("VIOLATION: the worker pool went past its saturation bound")
        if not published or unpublished:
            audit.notes.append(
                "VIOLATION: the interrupt did not land between enqueue and mark-offered"
            )
        return audit, report


def _ts(event: dict[str, Any] | None) -> float | None:
    if not event or "timestamp" not in event:
        return None
    import datetime as dt

    return dt.datetime.fromisoformat(event["timestamp"]).timestamp()


# -- the baseline: a drain without faults ----------------------------------------------------


async def steady_drain(env: Env, scale: Scale) -> tuple[Audit, float | None, float | None]:
    """No fault at all: the baseline drain, and how the tick loop keeps its
    schedule when every tick has dozens of jobs to release. Returns the audit,
    the median time between two busy ticks, and the share of the pacer's rate
    that was actually admitted."""
    async with _rig(env, knobs=scale.knobs, capacity=_capacity(scale.knobs)) as rig:
        await rig.schedule(scale.jobs)
        await rig.start(workers=scale.workers)
        audit = await rig.audit("no fault (baseline)", within=scale.settle_seconds)
        busy = [t for t in rig.tick_logs() if int(t.get("claimed") or 0) > 0]
        share = None
        if len(busy) >= 3:
            stamps = [_ts(t) or 0.0 for t in busy]
            admitted = sum(int(t["claimed"]) for t in busy[1:]) / (max(stamps) - min(stamps))
            rates = sorted(float(t["rate"]) for t in busy)
            share = admitted / rates[len(rates) // 2]
        return audit, rig.tick_cadence(), share
