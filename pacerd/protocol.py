"""The message protocol between pacerd and its workers (docs/protocol.md, "Messages"),
in both directions: the ready message a worker decodes, and the outcome
message pacerd parses; the exceptions a handler raises to choose its outcome.
The JSON Schemas in ``pacerd/schemas`` describe the same messages.

Values and pure functions only: no I/O.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jsonschema
import jsonschema_rs

from pacerd.clock import Clock, SystemClock
from pacerd.models import Outcome, Report

MAX_ERROR_CHARS = 4096
_MAX_ATTEMPT = 2**31 - 1
_OUTCOMES = {o.value for o in Outcome}


def load_schema(name: str) -> dict[str, Any]:
    """``ready`` or ``outcome``: the protocol's JSON Schema shipped in ``pacerd/schemas``."""
    text = resources.files("pacerd.schemas").joinpath(f"{name}.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


_READY = jsonschema.Draft202012Validator(load_schema("ready"))
# The same schema compiled by jsonschema-rs: ~1 µs per valid message where
# jsonschema takes ~90 µs. It only lets a valid message through at once;
# jsonschema still decides the rest, and says why.
_READY_FAST = jsonschema_rs.validator_for(load_schema("ready"))


class Refused(Exception):
    """The upstream refused for capacity (HTTP 429): the job goes back in line
    without spending an attempt, and the destination slows down."""

    def __init__(self, retry_after_s: float | None = None) -> None:
        if retry_after_s is not None and not (math.isfinite(retry_after_s) and retry_after_s >= 0):
            raise ValueError(f"retry_after_s must be a finite number >= 0, got {retry_after_s!r}")
        super().__init__("refused" + (f" (retry after {retry_after_s} s)" if retry_after_s else ""))
        self.retry_after_s = retry_after_s


class Retry(Exception):
    """A transient error: spends an attempt; retried with backoff, dead at the cap."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class Fail(Exception):
    """A permanent error: the job is dead at once (an operator may replay it)."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class Continue(Exception):
    """A checkpoint: the job is eligible again at once and resumes at ``cursor``."""

    def __init__(self, cursor: Any) -> None:
        super().__init__("continue")
        self.cursor = cursor


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One offer of one job, as a handler sees it."""

    job_id: str
    kind: str
    destination: str
    attempt: int
    revision: int
    payload: Any
    cursor: Any
    eligible_at: dt.datetime
    deadline: float | None = None  # clock.monotonic() by which the handler must return
    clock: Clock = field(default_factory=SystemClock, repr=False, compare=False)

    @property
    def idempotency_key(self) -> str:
        """Stable across redeliveries and attempts: ``job_id``, or ``job_id:<cursor
        JSON>`` for a chunk of a checkpointed job. (Add ``revision`` yourself if a
        revised job must repeat its side effect.)"""
        if self.cursor is None:
            return self.job_id
        return f"{self.job_id}:{json.dumps(self.cursor, sort_keys=True, separators=(',', ':'))}"

    def time_left(self) -> float:
        """Seconds until ``deadline`` (infinite without one)."""
        if self.deadline is None:
            return math.inf
        return max(0.0, self.deadline - self.clock.monotonic())

    def checkpoint_due(self, reserve_seconds: float = 0.0) -> bool:
        """True when a long handler should stop and ``raise Continue(cursor)``."""
        return self.time_left() <= reserve_seconds


class InvalidEnvelope(ValueError):
    """The ready message does not follow the protocol; ``job_id`` and
    ``attempt`` are set when it still names an attempt that can be reported."""

    def __init__(self, reason: str, *, job_id: str | None = None, attempt: int | None = None):
        super().__init__(reason)
        self.job_id, self.attempt = job_id, attempt


def decode_ready(
    body: bytes,
    *,
    clock: Clock | None = None,
    message_id: str | None = None,
    correlation_id: str | None = None,
) -> Job:
    """Decodes and validates a ready message; raises ``InvalidEnvelope``.

    ``message_id`` and ``correlation_id`` are the delivery's AMQP properties.
    They are read only when the body is invalid: what the body does not say of
    the attempt (all of it when the body cannot be decoded at all), they fill in,
    so that the attempt can still be reported ``fail``."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # bytes or JSON Python cannot decode
        reason = _undecodable(exc)
        raise _invalid(reason, None, None, message_id, correlation_id) from None
    job_id, attempt = None, None
    if isinstance(doc, dict):
        raw_id, raw_attempt = doc.get("job_id"), doc.get("attempt")
        if isinstance(raw_id, str) and raw_id.strip():
            job_id = raw_id
        if type(raw_attempt) is int and 1 <= raw_attempt <= _MAX_ATTEMPT:
            attempt = raw_attempt
    errors = (
        []
        if _READY_FAST.is_valid(doc)
        else sorted(_READY.iter_errors(doc), key=jsonschema.exceptions.relevance)
    )
    try:
        if errors:
            raise ValueError("; ".join(_describe(e) for e in errors[:5]))
        eligible_at = dt.datetime.fromisoformat(doc["eligible_at"])
    except ValueError as exc:
        reason = f"ready message does not follow ready.schema.json: {exc}"
        raise _invalid(reason, job_id, attempt, message_id, correlation_id) from None
    return Job(
        job_id=doc["job_id"], kind=doc["kind"], destination=doc["destination"],
        attempt=doc["attempt"], revision=doc["revision"], payload=doc["payload"],
        cursor=doc["cursor"], eligible_at=eligible_at, clock=clock or SystemClock(),
    )  # fmt: skip


def _undecodable(exc: ValueError | RecursionError) -> str:
    if isinstance(exc, RecursionError):
        return f"body could not be decoded: nested too deep ({exc})"
    if isinstance(exc, UnicodeDecodeError | json.JSONDecodeError):
        return f"body is not JSON: {exc}"
    return f"body could not be decoded: {exc}"  # e.g. an integer past int_max_str_digits


def _invalid(
    reason: str,
    job_id: str | None,
    attempt: int | None,
    message_id: str | None,
    correlation_id: str | None,
) -> InvalidEnvelope:
    """The body's own ``job_id``/``attempt`` first; the properties fill in what
    it lacks when they name one attempt that the body does not contradict."""
    if job_id is None or attempt is None:
        named = attempt_from_properties(message_id, correlation_id)
        if named is not None and job_id in (None, named[0]) and attempt in (None, named[1]):
            job_id, attempt = named
    return InvalidEnvelope(reason, job_id=job_id, attempt=attempt)


_ATTEMPT_DIGITS = re.compile(r"[1-9][0-9]{0,9}")


def attempt_from_properties(
    message_id: str | None, correlation_id: str | None
) -> tuple[str, int] | None:
    """``(job_id, attempt)`` from a ready message's properties (docs/protocol.md,
    "Messages": ``message_id`` = ``<job_id>:<attempt>``, ``correlation_id`` =
    job_id); ``None`` unless they name one attempt consistently."""
    if not isinstance(message_id, str):
        return None
    job_id, colon, digits = message_id.rpartition(":")
    if not colon or not job_id.strip() or _ATTEMPT_DIGITS.fullmatch(digits) is None:
        return None
    if correlation_id is not None and correlation_id != job_id:
        return None
    attempt = int(digits)
    return (job_id, attempt) if attempt <= _MAX_ATTEMPT else None


def _describe(error: jsonschema.ValidationError) -> str:
    where = "/".join(str(p) for p in error.absolute_path) or "(message)"
    return f"{where}: {error.message[:300]}"


def to_report(
    job_id: str, attempt: int, *, result: object = None, raised: Exception | None = None
) -> Report:
    """The outcome of one attempt from what its handler returned or raised."""
    match raised:
        case None:
            detail = dict(result) if isinstance(result, Mapping) else {"result": result}
            return Report(
                job_id=job_id, attempt=attempt, outcome=Outcome.OK,
                detail=None if result is None else detail,
            )  # fmt: skip
        case Refused(retry_after_s=retry_after_s):
            return Report(
                job_id=job_id, attempt=attempt, outcome=Outcome.REFUSED, retry_after_s=retry_after_s
            )
        case Retry(error=error) | Fail(error=error):
            outcome = Outcome.RETRY if isinstance(raised, Retry) else Outcome.FAIL
            return Report(job_id=job_id, attempt=attempt, outcome=outcome, error=error)
        case Continue(cursor=cursor):
            return Report(job_id=job_id, attempt=attempt, outcome=Outcome.CONTINUE, cursor=cursor)
        case _:
            error = f"{type(raised).__name__}: {raised}"
            return Report(job_id=job_id, attempt=attempt, outcome=Outcome.RETRY, error=error)


def outcome_body(report: Report) -> bytes:
    """The outcome message (``schemas/outcome.schema.json``); optional fields only when set."""
    doc: dict[str, Any] = {"job_id": report.job_id, "attempt": report.attempt}
    doc["outcome"] = str(report.outcome)
    if report.retry_after_s is not None:
        doc["retry_after_s"] = report.retry_after_s
    if report.error is not None:
        doc["error"] = report.error[:MAX_ERROR_CHARS]
    if report.detail is not None:
        doc["detail"] = report.detail
    if report.outcome is Outcome.CONTINUE or report.cursor is not None:
        doc["cursor"] = report.cursor
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


class InvalidOutcome(ValueError):
    """The outcome message does not follow the protocol."""


def parse_outcome(body: bytes) -> Report:
    """Decodes and validates an outcome message (docs/protocol.md, "Messages")."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # also an integer past int_max_str_digits
        raise InvalidOutcome(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidOutcome(f"body must be a JSON object, got {type(doc).__name__}")
    job_id = doc.get("job_id")
    if not isinstance(job_id, str) or not job_id.strip():
        raise InvalidOutcome("job_id must be a non-empty string")
    attempt = doc.get("attempt")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        raise InvalidOutcome(f"attempt must be an integer >= 1, got {attempt!r}")
    if attempt > 2**31 - 1:
        raise InvalidOutcome(f"attempt is out of range: {attempt}")
    outcome = doc.get("outcome")
    if outcome not in _OUTCOMES:
        raise InvalidOutcome(f"outcome must be one of {sorted(_OUTCOMES)}, got {outcome!r}")
    retry_after = doc.get("retry_after_s")
    if retry_after is not None:
        if (
            not isinstance(retry_after, int | float)
            or isinstance(retry_after, bool)
            or not math.isfinite(retry_after)
            or retry_after < 0
        ):
            raise InvalidOutcome(f"retry_after_s must be a number >= 0, got {retry_after!r}")
        retry_after = float(retry_after)
    error = doc.get("error")
    if error is not None and not isinstance(error, str):
        raise InvalidOutcome(f"error must be a string, got {type(error).__name__}")
    detail = doc.get("detail")
    if detail is not None and not isinstance(detail, dict):
        raise InvalidOutcome(f"detail must be a JSON object, got {type(detail).__name__}")
    return Report(
        job_id=job_id,
        attempt=attempt,
        outcome=Outcome(outcome),
        retry_after_s=retry_after,
        error=error[:MAX_ERROR_CHARS] if error else error,
        detail=detail,
        cursor=doc.get("cursor"),
    )
