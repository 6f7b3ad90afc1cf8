"""Bad input stays harmless (real PostgreSQL and RabbitMQ): ids, kinds and
destinations with control characters, very long strings and SQL
metacharacters are refused with a clear error or stored verbatim — never
interpreted — whether they come through the SQL API, the CLI or the outcome
consumer. The rules are in docs/security.md."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import anyio
import asyncpg
import pytest
from role_helpers import private_vhost
from support.cli import run_pacerd

from pacerd.publisher import OUTCOMES_QUEUE, Broker, ready_queue_name
from pacerd.testing import apply_outcomes, offer_due

if TYPE_CHECKING:
    from pacerd.ledger import Ledger

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

# Stored and given back exactly as written.
VERBATIM_IDS = [
    "'; DROP TABLE pacerd.jobs; --",
    '" OR 1=1 --',
    "%_*\\ $1 $$ :name ?",
    "a" * 200,
    "é" * 100,  # 200 bytes
    "日本語/ü ?#&",
]
# Refused by pacerd.schedule with SQLSTATE 22023, and the reason.
REFUSED_IDS = [
    ("", "job_id must not be empty"),
    ("   ", "job_id must not be empty"),
    ("a\nb", "control characters"),
    ("\x1b[2Jcleared", "control characters"),
    ("tab\there", "control characters"),
    ("del\x7f", "control characters"),
    ("c1\x85", "control characters"),
    ("a" * 201, "at most 200 bytes"),
    ("é" * 101, "at most 200 bytes"),
    ("a" * 100_000, "at most"),
]
REFUSED_KINDS = [
    ("", "kind must not be empty"),
    ("k\r\n", "control characters"),
    ("k" * 201, "at most 200 bytes"),
]
VERBATIM_KINDS = ["'; DELETE FROM pacerd.jobs; --", "ü-kind $$"]
REFUSED_DESTINATIONS = [
    "",
    "a b",
    "a\nb",
    "a;DROP TABLE x",
    "'quoted'",
    "-leading",
    "a/b",
    "é",
    "#",
    "a*",
    "a" * 201,
]


async def test_the_sql_api_refuses_or_stores_verbatim(ledger_: Ledger) -> None:
    pool = ledger_.pool
    schedule = "SELECT pacerd.schedule($1, $2, $3, '{}')"
    for job_id in VERBATIM_IDS:
        assert await pool.fetchval(schedule, job_id, "k", "bad-input") == "scheduled"
        assert await pool.fetchval("SELECT job_id FROM pacerd.jobs WHERE job_id = $1", job_id) == (
            job_id
        )
    for job_id, why in REFUSED_IDS:
        with pytest.raises(asyncpg.InvalidParameterValueError, match=why):
            await pool.fetchval(schedule, job_id, "k", "bad-input")
    # PostgreSQL's text holds no NUL: refused before any function runs.
    with pytest.raises(asyncpg.CharacterNotInRepertoireError):
        await pool.fetchval(schedule, "nul\x00id", "k", "bad-input")
    for n, kind in enumerate(VERBATIM_KINDS):
        assert await pool.fetchval(schedule, f"kind-{n}", kind, "bad-input") == "scheduled"
        stored = await pool.fetchval("SELECT kind FROM pacerd.jobs WHERE job_id = $1", f"kind-{n}")
        assert stored == kind
    for kind, why in REFUSED_KINDS:
        with pytest.raises(asyncpg.InvalidParameterValueError, match=why):
            await pool.fetchval(schedule, "kind-refused", kind, "bad-input")
    for destination in REFUSED_DESTINATIONS:
        with pytest.raises(asyncpg.InvalidParameterValueError, match="destination"):
            await pool.fetchval(schedule, "dest-refused", "k", destination)
        if destination:
            with pytest.raises(asyncpg.InvalidParameterValueError, match="destination"):
                await pool.fetchval("SELECT pacerd.pause($1)", destination)
            assert await pool.fetchval("SELECT pacerd.resume($1)", destination) == "unchanged"
    longest = "d" * 200
    assert await pool.fetchval(schedule, "longest-dest", "k", longest) == "scheduled"
    assert len(ready_queue_name(longest).encode()) <= 255  # RabbitMQ's limit on names

    # Lookups take any text as a plain value: nothing found, nothing changed.
    for job_id in ["x' OR '1'='1", "\x1b[31m", "a" * 100_000, "%"]:
        assert await pool.fetchval("SELECT pacerd.cancel($1, $2)", job_id, "r\n") == "unknown"
        assert await pool.fetchval("SELECT pacerd.replay($1, 'why')", job_id) == "unknown"
        assert await pool.fetchval("SELECT pacerd.report($1, 1, 'ok', error => $1)", job_id) == (
            "unknown"
        )
        assert await pool.fetchval("SELECT pacerd.is_current($1, 1)", job_id) is False
    with pytest.raises(asyncpg.InvalidParameterValueError, match="outcome must be one of"):
        await pool.fetchval("SELECT pacerd.report('x', 1, 'ok''; --')")
    # Free text is data: a cancel reason with quotes and newlines is kept as written.
    reason = "it's\nover; DROP TABLE pacerd.job_events; --"
    assert await pool.fetchval("SELECT pacerd.cancel($1, $2)", VERBATIM_IDS[0], reason) == (
        "cancelled"
    )
    detail = await pool.fetchval(
        "SELECT detail->>'reason' FROM pacerd.job_events WHERE job_id = $1 AND event = 'cancelled'",
        VERBATIM_IDS[0],
    )
    assert detail == reason
    assert await pool.fetchval("SELECT count(*) FROM pacerd.jobs") == len(VERBATIM_IDS) + 3


async def test_the_cli_refuses_with_one_clear_line_or_stores_verbatim(db_dsn: str) -> None:
    for job_id, kind, destination, why in [
        ("a\x1b[2Jb", "k", "cli-bad", "job_id must not contain control characters"),
        ("a" * 300, "k", "cli-bad", "job_id must be at most 200 bytes"),
        ("ok-id", "k\n", "cli-bad", "kind must not contain control characters"),
        ("ok-id", "k", "cli; DROP TABLE pacerd.jobs", "destination"),
        ("ok-id", "k", "a\nb", "destination"),
    ]:
        done = run_pacerd(db_dsn, "schedule", job_id, "--kind", kind, "--destination", destination)
        assert done.returncode == 1, done
        assert done.stderr.startswith("pacerd: error: ")
        assert why in done.stderr
        assert "Traceback" not in done.stderr
    bad_json = run_pacerd(
        db_dsn, "schedule", "j", "--kind", "k", "--destination", "d", "--payload", "{"
    )
    assert bad_json.returncode == 2
    assert "--payload is not valid JSON" in bad_json.stderr

    job_id = "'; DROP TABLE pacerd.jobs; --"
    done = run_pacerd(
        db_dsn, "schedule", job_id, "--kind", "$(rm -rf /)", "--destination", "cli-ok"
    )
    assert (done.returncode, done.stdout.strip()) == (0, f"{job_id}: scheduled"), done.stderr
    shown = run_pacerd(db_dsn, "show", job_id, "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert (doc["job_id"], doc["kind"]) == (job_id, "$(rm -rf /)")


async def test_the_outcome_consumer_parks_or_ignores_bad_reports(ledger_: Ledger) -> None:
    destination = "bad-outcomes"
    await ledger_.pool.fetchval("SELECT pacerd.schedule('good', 'k', $1, '{}')", destination)
    with private_vhost() as amqp_url:
        broker = Broker(amqp_url)
        await broker.connect()
        try:
            [offer] = await offer_due(ledger_, broker, destination)
            bodies: list[bytes] = [
                json.dumps({"job_id": job_id, "attempt": 1, "outcome": "ok"}).encode()
                for job_id in ["'; DROP TABLE pacerd.jobs; --", "\x1b[31m", "a" * 100_000]
            ] + [
                json.dumps({"job_id": "nul\u0000id", "attempt": 1, "outcome": "ok"}).encode(),
                json.dumps({"job_id": "good", "attempt": "1; DROP", "outcome": "ok"}).encode(),
                json.dumps({"job_id": "good", "attempt": 1, "outcome": "ok'; --"}).encode(),
                json.dumps(
                    {"job_id": "good", "attempt": 1, "outcome": "retry", "error": "\u0000"}
                ).encode(),
                b"\xff\xfe not utf-8",
                b"\x00" * 64,
                json.dumps(
                    {
                        "job_id": "good",
                        "attempt": offer.attempt,
                        "outcome": "ok",
                        "error": "it's\n; DROP TABLE x",
                    }
                ).encode(),
            ]
            for body in bodies:
                await broker.publish_raw(OUTCOMES_QUEUE, body)
            with anyio.fail_after(60):
                result = await apply_outcomes(ledger_, broker, count=len(bodies))
        finally:
            await broker.close()
    # Three unknown ids, one applied report, every other message parked.
    assert (result.unknown, result.applied, result.stale) == (3, 1, 0)
    assert result.invalid == len(bodies) - 4
    assert await ledger_.pool.fetchval("SELECT state FROM pacerd.jobs WHERE job_id = 'good'") == (
        "completed"
    )
    assert await ledger_.pool.fetchval("SELECT count(*) FROM pacerd.jobs") == 1
