"""The protocol's JSON Schemas: valid draft 2020-12 with their $ids and exactly
docs/protocol.md's fields; what pacerd publishes and what the worker library sends
validate; and pacerd's outcome parser agrees with the outcome schema."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import jsonschema
import pytest

from pacerd.models import ClaimedJob, Outcome, Report
from pacerd.protocol import InvalidOutcome, parse_outcome
from pacerd.publisher import ready_body
from pacerd.worker import (
    Continue,
    Fail,
    Refused,
    Retry,
    decode_ready,
    load_schema,
    outcome_body,
    to_report,
)

READY = jsonschema.Draft202012Validator(load_schema("ready"))
OUTCOME = jsonschema.Draft202012Validator(load_schema("outcome"))


@pytest.mark.parametrize("name", ["ready", "outcome"])
def test_schemas_are_draft_2020_12_with_an_id(name: str) -> None:
    schema = load_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith(f"/{name}.schema.json")


def test_schemas_have_exactly_the_fields_of_design_md() -> None:
    ready, outcome = load_schema("ready"), load_schema("outcome")
    fields = ["job_id", "kind", "destination", "attempt", "revision", "payload", "cursor"]
    assert sorted(ready["properties"]) == sorted([*fields, "eligible_at"])
    assert sorted(ready["required"]) == sorted(ready["properties"])
    assert sorted(outcome["properties"]) == sorted(
        ["job_id", "attempt", "outcome", "retry_after_s", "error", "detail", "cursor"]
    )
    assert outcome["required"] == ["job_id", "attempt", "outcome"]
    assert outcome["properties"]["outcome"]["enum"] == [o.value for o in Outcome]


def claimed(**changes: Any) -> ClaimedJob:
    fields: dict[str, Any] = {
        "job_id": "job-1", "kind": "summarize", "destination": "llm.eu-1", "attempt": 1,
        "revision": 0, "payload_json": '{"doc": "x", "n": [1, 2]}', "cursor_json": None,
        "eligible_at": dt.datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=dt.UTC), "live": False,
    }  # fmt: skip
    return ClaimedJob(**(fields | changes))


@pytest.mark.parametrize(
    "job",
    [
        claimed(),
        claimed(attempt=17, revision=4, cursor_json='{"page": 3}'),
        claimed(job_id='quote " and \\ and ü', payload_json='"just a string"'),
        claimed(eligible_at=dt.datetime(2026, 3, 4, tzinfo=dt.timezone(dt.timedelta(hours=2)))),
    ],
)
def test_what_pacerd_publishes_follows_the_ready_schema(job: ClaimedJob) -> None:
    body = ready_body(job)
    READY.validate(json.loads(body))
    decoded = decode_ready(body)
    assert (decoded.job_id, decoded.attempt, decoded.eligible_at) == (
        job.job_id, job.attempt, job.eligible_at,
    )  # fmt: skip


@pytest.mark.parametrize(
    "raised",
    [None, Refused(), Refused(3), Retry("503"), Fail("bad"), Continue({"p": 1}), Continue(None),
     ValueError("surprise")],
)  # fmt: skip
def test_what_the_worker_sends_follows_the_outcome_schema(raised: Exception | None) -> None:
    body = outcome_body(to_report("job-1", 4, result={"tokens": 9}, raised=raised))
    OUTCOME.validate(json.loads(body))
    assert parse_outcome(body).attempt == 4


ACCEPTED: list[dict[str, Any]] = [
    {"job_id": "a", "attempt": 1, "outcome": "ok"},
    {"job_id": "a", "attempt": 2147483647, "outcome": "refused", "retry_after_s": 0},
    {"job_id": "a", "attempt": 3, "outcome": "refused", "retry_after_s": 2.5},
    {"job_id": "a", "attempt": 3, "outcome": "retry", "error": "x", "retry_after_s": None},
    {"job_id": "a", "attempt": 3, "outcome": "fail", "error": None, "detail": None},
    {"job_id": "a", "attempt": 3, "outcome": "ok", "detail": {"tokens": {"in": 1, "out": 2}}},
    {"job_id": "a", "attempt": 3, "outcome": "continue", "cursor": [1, "two"]},
    {"job_id": "a", "attempt": 3, "outcome": "continue", "cursor": None},
    {"job_id": "a", "attempt": 3, "outcome": "ok", "something_new": True},
]
REJECTED: list[Any] = [
    [],
    "ok",
    {"attempt": 1, "outcome": "ok"},
    {"job_id": "", "attempt": 1, "outcome": "ok"},
    {"job_id": " \t", "attempt": 1, "outcome": "ok"},
    {"job_id": 7, "attempt": 1, "outcome": "ok"},
    {"job_id": "a", "outcome": "ok"},
    {"job_id": "a", "attempt": 0, "outcome": "ok"},
    {"job_id": "a", "attempt": "1", "outcome": "ok"},
    {"job_id": "a", "attempt": True, "outcome": "ok"},
    {"job_id": "a", "attempt": 2147483648, "outcome": "ok"},
    {"job_id": "a", "attempt": 1},
    {"job_id": "a", "attempt": 1, "outcome": "OK"},
    {"job_id": "a", "attempt": 1, "outcome": "done"},
    {"job_id": "a", "attempt": 1, "outcome": "refused", "retry_after_s": -1},
    {"job_id": "a", "attempt": 1, "outcome": "refused", "retry_after_s": "5"},
    {"job_id": "a", "attempt": 1, "outcome": "refused", "retry_after_s": False},
    {"job_id": "a", "attempt": 1, "outcome": "retry", "error": 503},
    {"job_id": "a", "attempt": 1, "outcome": "ok", "detail": ["tokens"]},
    {"job_id": "a", "attempt": 1, "outcome": "ok", "detail": "tokens"},
]


@pytest.mark.parametrize("doc", ACCEPTED)
def test_pacerd_accepts_what_the_outcome_schema_accepts(doc: dict[str, Any]) -> None:
    OUTCOME.validate(doc)
    report = parse_outcome(json.dumps(doc).encode())
    assert isinstance(report, Report)
    assert report.job_id == doc["job_id"]


@pytest.mark.parametrize("doc", REJECTED)
def test_pacerd_rejects_what_the_outcome_schema_rejects(doc: Any) -> None:
    assert not OUTCOME.is_valid(doc)
    with pytest.raises(InvalidOutcome):
        parse_outcome(json.dumps(doc).encode())


def test_the_one_known_difference_is_an_integral_float_attempt() -> None:
    """JSON Schema counts 3.0 as an integer; pacerd's parser does not. The
    schema says to write attempt as an integer; every JSON encoder does."""
    doc = {"job_id": "a", "attempt": 3.0, "outcome": "ok"}
    assert OUTCOME.is_valid(doc)
    with pytest.raises(InvalidOutcome):
        parse_outcome(json.dumps(doc).encode())
