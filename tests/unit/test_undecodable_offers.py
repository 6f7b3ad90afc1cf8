"""A ready message whose body cannot be decoded (PostgreSQL stores payloads
Python's ``json`` cannot read back) ends its job, not the worker: the attempt
named by the message's properties is reported ``fail`` (and the delivery
acknowledged once that is confirmed); only a message that names no attempt anywhere is parked."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from pacerd.protocol import (
    InvalidEnvelope,
    InvalidOutcome,
    attempt_from_properties,
    decode_ready,
    parse_outcome,
)
from pacerd.publisher import INVALID_QUEUE, OUTCOMES_EXCHANGE, message_id
from pacerd.worker import Job, Outgoing, Worker, WorkerApp

READY = {
    "job_id": "j-1", "kind": "k", "destination": "llm", "attempt": 3, "revision": 0,
    "payload": {}, "cursor": None, "eligible_at": "2026-01-02T03:04:05+00:00",
}  # fmt: skip
TOO_DEEP = 100_000  # past any recursion limit; jsonb accepts far deeper than Python's
UNDECODABLE = {
    "nested too deep": (
        b'{"job_id":"j-1","attempt":3,"payload":' + b"[" * TOO_DEEP + b"]" * TOO_DEEP + b"}"
    ),
    "huge integer": b'{"job_id":"j-1","attempt":3,"payload":' + b"7" * 5000 + b"}",
    "not UTF-8": b'{"job_id":"j-1","attempt":3,"payload":"\xff"}',
    "not JSON": b'{"job_id":"j-1","attempt":3,',
}


@pytest.mark.parametrize("raw", UNDECODABLE.values(), ids=UNDECODABLE.keys())
def test_an_undecodable_body_is_reported_against_the_attempt_its_properties_name(
    raw: bytes,
) -> None:
    with pytest.raises(InvalidEnvelope) as bare:
        decode_ready(raw)
    assert (bare.value.job_id, bare.value.attempt) == (None, None)
    with pytest.raises(InvalidEnvelope) as named:
        decode_ready(raw, message_id="j-1:3", correlation_id="j-1")
    assert (named.value.job_id, named.value.attempt) == ("j-1", 3)
    assert str(named.value) == str(bare.value)


def test_the_reason_says_why_the_body_could_not_be_decoded() -> None:
    reasons = {}
    for name, raw in UNDECODABLE.items():
        with pytest.raises(InvalidEnvelope) as caught:
            decode_ready(raw)
        reasons[name] = str(caught.value)
    assert reasons["nested too deep"].startswith("body could not be decoded: nested too deep")
    assert reasons["huge integer"].startswith("body could not be decoded: ")
    assert "digits" in reasons["huge integer"]
    assert reasons["not UTF-8"].startswith("body is not JSON: ")
    assert reasons["not JSON"].startswith("body is not JSON: ")


@pytest.mark.parametrize(
    ("mid", "cid", "expected"),
    [
        ("j-1:3", "j-1", ("j-1", 3)),
        ("j-1:3", None, ("j-1", 3)),
        ("a:b:12", "a:b", ("a:b", 12)),  # a job id may hold colons; the attempt cannot
        (message_id("x", 2147483647), "x", ("x", 2147483647)),
        (None, "j-1", None),  # no attempt to report
        ("j-1:3", "j-2", None),  # contradictory
        ("j-1:3", "", None),
        ("j-1", "j-1", None),
        (":3", None, None),
        (" :3", None, None),
        ("j-1:", None, None),
        ("j-1:0", None, None),
        ("j-1:03", None, None),
        ("j-1:+3", None, None),
        ("j-1: 3", None, None),
        ("j-1:3 ", None, None),
        ("j-1:3\n", None, None),
        ("j-1:3.0", None, None),
        ("j-1:\u0663", None, None),  # a non-ASCII digit
        ("j-1:2147483648", None, None),
        ("j-1:" + "9" * 50, None, None),
    ],
)
def test_properties_name_an_attempt_only_when_they_follow_the_protocol(
    mid: str | None, cid: str | None, expected: tuple[str, int] | None
) -> None:
    assert attempt_from_properties(mid, cid) == expected


def body(**changes: Any) -> bytes:
    doc = {**READY, **changes}
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    ("raw", "mid", "expected"),
    [
        (body(kind=...), "other:9", ("j-1", 3)),  # the body names the attempt: it wins
        (b"[1, 2]", "j-1:3", ("j-1", 3)),  # names nothing: the properties do
        (body(attempt="3"), "j-1:3", ("j-1", 3)),  # the properties fill in the attempt
        (body(job_id=...), "j-1:3", ("j-1", 3)),  # ... or the job id
        (body(attempt="3"), "j-2:3", ("j-1", None)),  # but never contradict the body
        (body(job_id=...), "j-1:4", (None, 3)),
    ],
)
def test_properties_fill_in_only_what_an_invalid_body_does_not_say(
    raw: bytes, mid: str, expected: tuple[str | None, int | None]
) -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        decode_ready(raw, message_id=mid, correlation_id=mid.rpartition(":")[0])
    assert (caught.value.job_id, caught.value.attempt) == expected


def test_a_valid_body_is_not_checked_against_the_properties() -> None:
    job = decode_ready(body(), message_id="garbage", correlation_id="other")
    assert (job.job_id, job.attempt) == ("j-1", 3)


def test_an_outcome_python_cannot_decode_is_invalid_not_an_error() -> None:
    doc = b'{"job_id":"a","attempt":1,"outcome":"ok","detail":{"n":' + b"7" * 5000 + b"}}"
    with pytest.raises(InvalidOutcome, match="digits"):
        parse_outcome(doc)


# -- the worker: report fail, or park -----------------------------------------------------------


@dataclass
class Delivery:
    """The parts of a delivery the worker reads."""

    body: bytes
    message_id: str | None = None
    correlation_id: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    content_type: str | None = "application/json"


async def process(delivery: Delivery) -> tuple[Outgoing | None, list[str]]:
    """What the worker would publish for ``delivery`` (and acknowledge it once confirmed)."""
    app = WorkerApp(destinations=["llm"], check_current=False)
    ran: list[str] = []

    @app.handler()
    async def handle(job: Job) -> None:
        ran.append(job.job_id)

    worker = Worker(app, broker_url="amqp://unused", outcomes_exchange="")
    out = await worker.process(
        "llm", delivery.body, message_id=delivery.message_id,
        correlation_id=delivery.correlation_id, headers=delivery.headers,
        content_type=delivery.content_type,
    )  # fmt: skip
    return out, ran


async def test_the_worker_reports_an_undecodable_offer_fail() -> None:
    delivery = Delivery(
        UNDECODABLE["nested too deep"], message_id=message_id("deep", 2), correlation_id="deep"
    )
    outcome, ran = await process(delivery)
    assert ran == []
    assert outcome is not None
    assert (outcome.exchange, outcome.routing_key, outcome.outcome) == (
        "",
        OUTCOMES_EXCHANGE,
        "fail",
    )
    properties = outcome.properties
    assert (properties.message_id, properties.correlation_id) == ("deep:2", "deep")
    report = parse_outcome(outcome.body)
    assert (report.job_id, report.attempt, str(report.outcome)) == ("deep", 2, "fail")
    assert (report.error or "").startswith("body could not be decoded: nested too deep")


async def test_the_worker_parks_an_undecodable_offer_that_names_no_attempt() -> None:
    delivery = Delivery(UNDECODABLE["nested too deep"], message_id="no attempt here")
    parked, ran = await process(delivery)
    assert ran == []
    assert parked is not None
    assert (parked.exchange, parked.routing_key, parked.outcome) == ("", INVALID_QUEUE, None)
    assert parked.body == delivery.body
    headers = parked.properties.headers or {}
    assert headers["x-pacerd-source-queue"] == "pacerd.ready.llm"
    assert "nested too deep" in str(headers["x-pacerd-invalid-reason"])
    assert parked.properties.message_id == "no attempt here"


async def test_the_worker_runs_a_valid_offer_whatever_its_properties_say() -> None:
    delivery = Delivery(body(), message_id="stale:1", correlation_id="stale")
    outcome, ran = await process(delivery)
    assert ran == ["j-1"]
    assert outcome is not None
    assert outcome.outcome == "ok"
    report = parse_outcome(outcome.body)
    assert (report.job_id, report.attempt, str(report.outcome)) == ("j-1", 3, "ok")
