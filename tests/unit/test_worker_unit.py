"""pacerd.worker without sockets: envelope decoding, outcome mapping and
encoding, handler registration, the job's helpers, and `main`'s usage errors."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pacerd.clock import ManualClock
from pacerd.config import Config
from pacerd.models import Outcome, Report
from pacerd.worker import (
    Continue,
    Fail,
    InvalidEnvelope,
    Job,
    Refused,
    Retry,
    Worker,
    WorkerApp,
    acknowledgements,
    decode_ready,
    load_app,
    main,
    outcome_body,
    to_report,
)

READY = {
    "job_id": "j-1",
    "kind": "summarize",
    "destination": "llm",
    "attempt": 3,
    "revision": 7,
    "payload": {"doc": 1},
    "cursor": None,
    "eligible_at": "2026-01-02T03:04:05.123456+00:00",
}


def body(**changes: Any) -> bytes:
    doc = {**READY, **changes}
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


def test_decode_ready_gives_a_typed_job() -> None:
    job = decode_ready(body())
    assert (job.job_id, job.kind, job.destination, job.attempt, job.revision) == (
        "j-1", "summarize", "llm", 3, 7,
    )  # fmt: skip
    assert job.payload == {"doc": 1}
    assert job.cursor is None
    assert job.eligible_at == dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("raw", "ref", "mentions"),
    [
        (b"\xff not json", (None, None), "not JSON"),
        (b"[1, 2]", (None, None), "object"),
        (body(job_id=...), (None, 3), "job_id"),
        (body(attempt="3"), ("j-1", None), "attempt"),
        (body(attempt=0), ("j-1", None), "attempt"),
        (body(kind=...), ("j-1", 3), "kind"),
        (body(revision=-1), ("j-1", 3), "revision"),
        (body(destination="no spaces"), ("j-1", 3), "destination"),
        (body(eligible_at="yesterday"), ("j-1", 3), "eligible_at"),
        (body(eligible_at="2026-13-02T03:04:05+00:00"), ("j-1", 3), "month"),
        (body(cursor=...), ("j-1", 3), "cursor"),
    ],
)
def test_decode_ready_rejects_what_the_schema_rejects(
    raw: bytes, ref: tuple[str | None, int | None], mentions: str
) -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        decode_ready(raw)
    assert (caught.value.job_id, caught.value.attempt) == ref
    assert mentions in str(caught.value)


def test_decode_ready_ignores_properties_it_does_not_know() -> None:
    assert decode_ready(body(deadline_at="later")).job_id == "j-1"


def test_idempotency_key_is_the_job_id_or_the_job_and_its_cursor() -> None:
    job = decode_ready(body())
    assert job.idempotency_key == "j-1"
    chunk = decode_ready(body(cursor={"page": 2, "at": "b"}))
    assert chunk.idempotency_key == 'j-1:{"at":"b","page":2}'


def test_deadline_helpers_follow_the_clock() -> None:
    clock = ManualClock(start=100.0)
    job = Job(
        job_id="j", kind="k", destination="d", attempt=1, revision=0, payload={}, cursor=None,
        eligible_at=clock.now(), deadline=110.0, clock=clock,
    )  # fmt: skip
    assert job.time_left() == 10.0
    assert not job.checkpoint_due(reserve_seconds=2)
    clock.advance(8.5)
    assert job.checkpoint_due(reserve_seconds=2)
    assert not job.checkpoint_due()
    clock.advance(5)
    assert job.time_left() == 0.0
    assert job.checkpoint_due()
    assert Job(
        job_id="j", kind="k", destination="d", attempt=1, revision=0, payload={}, cursor=None,
        eligible_at=clock.now(),
    ).time_left() == float("inf")  # fmt: skip


@pytest.mark.parametrize(
    ("result", "raised", "expected"),
    [
        (None, None, Report(job_id="j", attempt=2, outcome=Outcome.OK)),
        (
            {"tokens": 5},
            None,
            Report(job_id="j", attempt=2, outcome=Outcome.OK, detail={"tokens": 5}),
        ),
        (
            "done",
            None,
            Report(job_id="j", attempt=2, outcome=Outcome.OK, detail={"result": "done"}),
        ),
        (None, Refused(), Report(job_id="j", attempt=2, outcome=Outcome.REFUSED)),
        (
            None,
            Refused(12.5),
            Report(job_id="j", attempt=2, outcome=Outcome.REFUSED, retry_after_s=12.5),
        ),
        (None, Retry("503"), Report(job_id="j", attempt=2, outcome=Outcome.RETRY, error="503")),
        (None, Fail("bad"), Report(job_id="j", attempt=2, outcome=Outcome.FAIL, error="bad")),
        (
            None,
            Continue({"p": 3}),
            Report(job_id="j", attempt=2, outcome=Outcome.CONTINUE, cursor={"p": 3}),
        ),
        (
            None,
            KeyError("x"),
            Report(job_id="j", attempt=2, outcome=Outcome.RETRY, error="KeyError: 'x'"),
        ),
    ],
)
def test_what_a_handler_does_becomes_an_outcome(
    result: object, raised: Exception | None, expected: Report
) -> None:
    assert to_report("j", 2, result=result, raised=raised) == expected


def test_refused_rejects_a_meaningless_retry_after() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="retry_after_s"):
            Refused(bad)


def test_outcome_body_carries_only_what_is_set() -> None:
    ok = Report(job_id="j", attempt=1, outcome=Outcome.OK, detail={"tokens": 3})
    assert json.loads(outcome_body(ok)) == {
        "job_id": "j", "attempt": 1, "outcome": "ok", "detail": {"tokens": 3},
    }  # fmt: skip
    cont = Report(job_id="j", attempt=1, outcome=Outcome.CONTINUE)
    assert json.loads(outcome_body(cont)) == {
        "job_id": "j", "attempt": 1, "outcome": "continue", "cursor": None,
    }  # fmt: skip
    long = Report(job_id="j", attempt=1, outcome=Outcome.RETRY, error="x" * 10_000)
    assert len(json.loads(outcome_body(long))["error"]) == 4096
    with pytest.raises(TypeError):
        outcome_body(Report(job_id="j", attempt=1, outcome=Outcome.OK, detail={"x": object()}))


def test_handlers_resolve_from_the_most_specific() -> None:
    app = WorkerApp(destinations=["a"])

    async def h1(job: Job) -> None: ...
    async def h2(job: Job) -> None: ...
    async def h3(job: Job) -> None: ...
    async def h4(job: Job) -> None: ...

    app.handler("k", destination="b")(h1)
    app.handler("k")(h2)
    app.handler(destination="c")(h3)
    assert app.handler_for("k", "b") is h1
    assert app.handler_for("k", "a") is h2
    assert app.handler_for("other", "c") is h3
    assert app.handler_for("other", "a") is None
    app.handler()(h4)
    assert app.handler_for("other", "a") is h4
    assert app.destinations == ("a", "b", "c")
    with pytest.raises(ValueError, match="already registered"):
        app.handler("k")(h4)


def test_app_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="prefetch"):
        WorkerApp(prefetch=0)
    with pytest.raises(ValueError, match="handler_timeout_seconds"):
        WorkerApp(handler_timeout_seconds=0)
    with pytest.raises(ValueError, match="no destination"):
        Worker(WorkerApp(), broker_url="amqp://x")


def test_worker_from_config_keeps_handler_deadlines_inside_the_offer_lease() -> None:
    cfg = Config.model_validate(
        {"leases": {"offer_seconds": 30.0}, "destinations": {"llm": {"queue": "custom.q"}}}
    )
    worker = Worker.from_config(WorkerApp(destinations=["llm", "other"]), cfg)
    assert worker.handler_timeout_seconds == 24.0
    assert worker.queues == {"llm": "custom.q", "other": "pacerd.ready.other"}
    assert worker.dsn == cfg.database.dsn
    assert worker.broker_url == cfg.broker.url


app_for_tests = WorkerApp(destinations=["x"])
not_an_app = object()


def test_load_app_finds_the_app_or_says_why() -> None:
    assert load_app(f"{__name__}:app_for_tests") is app_for_tests
    with pytest.raises(ValueError, match="module:attribute"):
        load_app("no_colon")
    with pytest.raises(ImportError):
        load_app("no_such_module_anywhere:app")
    with pytest.raises(AttributeError):
        load_app(f"{__name__}:missing")
    with pytest.raises(TypeError, match=r"not a pacerd\.worker\.WorkerApp"):
        load_app(f"{__name__}:not_an_app")


def test_main_refuses_a_bad_app_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(Config(), app_ref=f"{__name__}:not_an_app") == 2
    assert "not a pacerd.worker.WorkerApp" in capsys.readouterr().err
    assert main(Config(), app_ref=f"{__name__}:empty_app") == 2


empty_app = WorkerApp()


@settings(max_examples=300, deadline=None)
@given(delivered=st.integers(1, 40), data=st.data())
def test_acknowledgements_cover_exactly_the_settled_deliveries(
    delivered: int, data: st.DataObject
) -> None:
    """Whatever settled first, the acks the worker writes (one ``multiple`` up
    to the lowest unsettled delivery, individual ones above it) acknowledge
    every settled delivery and no other."""
    tags = range(1, delivered + 1)
    settled = data.draw(st.lists(st.sampled_from(tags), unique=True))
    unsettled = set(tags) - set(settled)
    up_to, each = acknowledgements(settled, unsettled)
    acked = {t for t in tags if up_to is not None and t <= up_to} | set(each)
    assert acked == set(settled)
    assert len(each) == len(set(each))
    if settled and not unsettled:
        assert (up_to, each) == (max(settled), [])  # one frame when nothing is held back
