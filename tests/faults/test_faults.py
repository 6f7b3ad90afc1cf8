"""The fault-injection scenarios in their fast form (seconds each, small
workloads) against the real PostgreSQL and RabbitMQ: pacerd, its workers and
the model upstream run as processes, faults are injected, then the ledger, the
workers' call logs, the daemons' tick logs and the upstream's record are
audited (``faultlib.Audit``). Service faults stay local to the test: backends
of the test's own database are terminated, and the broker and the network
misbehave through the TCP fault proxy; restarts of PostgreSQL and RabbitMQ and
the real memory alarm are in the full versions (``bench/faults/run.py``)."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

import asyncpg
import pytest
from fault_scenarios import (
    DRILL_KNOBS,
    Env,
    Scale,
    bad_input,
    broker_faults,
    ledger_faults,
    network_faults,
    pacerd_kill,
    poison,
    recovery_drill,
    worker_kill,
)
from faultlib import Knobs, Rig, rabbitmqctl
from support.services import ADMIN_DSN

from pacerd.errors import BrokerUnavailable, LedgerUnavailable
from pacerd.ledger import translate_errors
from pacerd.publisher import translate_errors as translate_amqp_errors

if TYPE_CHECKING:
    from pathlib import Path

    from faultlib import Audit

pytestmark = [pytest.mark.services, pytest.mark.timeout(90)]

KNOBS = Knobs()


@pytest.fixture
def env(db_dsn: str, amqp_url: str, tmp_path: Path) -> Env:
    return Env(
        dsn=db_dsn,
        amqp_url=amqp_url,
        workdir=tmp_path,
        destination=f"f-{uuid.uuid4().hex[:8]}",
        restart_seconds=1.0,
    )


def passed(audit: Audit) -> None:
    """Asserts the audit found nothing, showing the whole audit when it did."""
    report = "\n".join([*audit.violations(), *audit.notes, repr(audit.row())])
    assert audit.violations() == [], report
    # The daemon, the workers and the workload ran each on its own role and broker
    # user (the audit notes a party seen on another identity as a violation).
    assert audit.identities["ledger"], audit.identities
    assert audit.identities["broker"], audit.identities


async def test_each_party_runs_on_its_own_role_and_its_identities_are_dropped(env: Env) -> None:
    async with Rig(
        dsn=env.dsn, amqp_url=env.amqp_url, workdir=env.workdir, destination=env.destination,
        capacity=KNOBS.max_rate * 1.25, restart_seconds=env.restart_seconds,
    ) as rig:  # fmt: skip
        ids = rig.identities
        assert ids is not None
        owner = await rig.db().fetchval(
            "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pacerd'"
        )
        assert owner == ids.owner
        await rig.schedule(60)
        await rig.start(workers=1)
        audit = await rig.audit("roles", within=15)
        passed(audit)
        assert audit.identities == {
            "ledger": sorted([ids.owner, ids.worker]),
            "broker": sorted([ids.daemon_user, ids.worker_user]),
        }
        # A session of a party on the administrator's role is a violation.
        intruder = await asyncpg.connect(rig.dsn)
        try:
            again = await rig.audit("roles", within=15)
        finally:
            await intruder.close()
        assert any("ledger sessions as ['postgres']" in v for v in again.violations()), again
    admin = await asyncpg.connect(ADMIN_DSN)
    try:
        left = await admin.fetch(
            "SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[])", list(ids.roles)
        )
    finally:
        await admin.close()
    assert left == []
    users = rabbitmqctl("list_users", "--no-table-headers").stdout
    assert ids.daemon_user not in users
    assert ids.worker_user not in users


async def test_kill_9_pacerd_mid_drain_loses_nothing(env: Env) -> None:
    knobs = replace(KNOBS, claim_seconds=1.5)
    audit = await pacerd_kill(
        env, Scale(workers=1, jobs=400, faults=2, settle_seconds=15, knobs=knobs)
    )
    passed(audit)


async def test_kill_9_workers_between_call_and_report_repeats_no_completed_effect(
    env: Env,
) -> None:
    audit = await worker_kill(env, Scale(jobs=240, faults=2, settle_seconds=15))
    passed(audit)


async def test_broker_connection_resets_and_blocked_publishers(env: Env) -> None:
    audit = await broker_faults(env, Scale(workers=1, jobs=400, faults=3, settle_seconds=15))
    passed(audit)


async def test_ledger_backends_terminated_mid_drain(env: Env) -> None:
    # A terminated backend must end neither pacerd nor a worker (it once surfaced
    # as asyncpg's InternalClientError and did): no crash is allowed.
    audit = await ledger_faults(env, Scale(workers=1, jobs=400, faults=2, settle_seconds=15))
    passed(audit)


def test_a_terminated_backend_error_is_translated_to_ledger_unavailable() -> None:
    with pytest.raises(LedgerUnavailable), translate_errors():
        raise asyncpg.InternalClientError(
            "cannot switch to state 12; another operation (2) is in progress"
        )


def test_a_connection_dropped_during_the_amqp_handshake_is_broker_unavailable() -> None:
    # aiormq ends its frame reader with StopAsyncIteration when the peer closes
    # the socket mid-handshake (seen through a proxy refusing reconnects)
    with pytest.raises(BrokerUnavailable), translate_amqp_errors():
        raise StopAsyncIteration


async def test_latency_stalls_and_resets_on_every_path(env: Env) -> None:
    knobs = replace(KNOBS, publish_timeout_seconds=1.0)
    audit = await network_faults(
        env, Scale(workers=1, jobs=400, faults=3, settle_seconds=15, knobs=knobs)
    )
    passed(audit)


async def test_bad_input_is_parked_or_refused_and_changes_nothing(env: Env) -> None:
    audit = await bad_input(env, Scale(workers=1, jobs=240, faults=30, settle_seconds=15))
    passed(audit)


async def test_recovery_drill(env: Env) -> None:
    audit, report = await recovery_drill(
        env, Scale(jobs=120, faults=1, settle_seconds=20, knobs=DRILL_KNOBS)
    )
    passed(audit)
    assert report.first_claim_at is not None
    assert report.drained_at is not None
    assert len([s for s in report.samples if s.t >= report.first_claim_at]) >= 10


async def test_poison_outcome_with_a_nul_character_is_parked(env: Env) -> None:
    passed(await poison(env, Scale(workers=1, jobs=60, faults=1, settle_seconds=3), kind="nul"))


async def test_poison_outcome_nested_too_deep_is_parked(env: Env) -> None:
    passed(await poison(env, Scale(workers=1, jobs=80, faults=1, settle_seconds=5), kind="nested"))


async def test_poison_payload_nested_too_deep_ends_its_job_not_the_workers(env: Env) -> None:
    passed(await poison(env, Scale(workers=1, jobs=80, faults=1, settle_seconds=5), kind="payload"))
