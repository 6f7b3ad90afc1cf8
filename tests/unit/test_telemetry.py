"""Spans, metrics and logs, read back from in-memory exporters and a string stream."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import platform
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

import aiormq.exceptions
import anyio
import pytest
import structlog
from aiormq.abc import DeliveredMessage
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import ObservableGauge

# The class MetricReader's preferred_temporality keys the synchronous gauge by.
from opentelemetry.sdk.metrics._internal.instrument import Gauge as SyncGauge
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pamqp.commands import Basic
from pamqp.header import ContentHeader
from prometheus_client import CollectorRegistry
from support.metrics import exercise_every_metric, grouped_series, histogram_points

from pacerd import __version__
from pacerd import telemetry as tm
from pacerd.admission import TickResult, rejection_reason
from pacerd.clock import ManualClock
from pacerd.config import Config
from pacerd.errors import PublishRejected
from pacerd.models import ClaimedJob, Outcome, Report
from pacerd.observer import OutcomeObserver, TelemetryObserver
from pacerd.publisher import Delivery, translate_errors
from pacerd.publisher import _outcome as publisher_outcome
from pacerd.telemetry import (
    SPAN_CLAIM,
    SPAN_MARK_OFFERED,
    SPAN_OUTCOME,
    SPAN_PUBLISH,
    SPAN_TICK,
    Telemetry,
    extract_context,
    inject_traceparent,
    redact,
    set_log_level,
    setup_telemetry,
)

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from opentelemetry.sdk.trace import ReadableSpan


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


class Harness:
    def __init__(self, log_format: str = "json") -> None:
        self.spans = InMemorySpanExporter()
        self.metrics = InMemoryMetricReader()
        self.stream = io.StringIO()
        self.telemetry = setup_telemetry(
            "pacerd-test", "debug", log_format,
            metric_readers=[self.metrics], span_exporter=self.spans, log_stream=self.stream,
        )  # fmt: skip

    def finished(self) -> dict[str, ReadableSpan]:
        return {span.name: span for span in self.spans.get_finished_spans()}

    def lines(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def points(self, name: str) -> dict[frozenset[tuple[str, object]], float]:
        data = self.metrics.get_metrics_data()
        assert data is not None
        found: dict[frozenset[tuple[str, object]], float] = {}
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        key = frozenset((point.attributes or {}).items())
                        if isinstance(point, NumberDataPoint):
                            found[key] = point.value
                        elif isinstance(point, HistogramDataPoint):
                            found[key] = point.count
        return found


@pytest.fixture
def harness() -> Iterator[Harness]:
    made = Harness()
    yield made
    made.telemetry.shutdown(timeout_seconds=2)


def record_a_tick(telemetry: Telemetry, *, shadow: bool = False) -> None:
    telemetry.record_tick(
        "mail", rate=2.5, budget=3, admitted=2, inflight=4, due=10,
        oldest_due_age_seconds=12.0, drain_eta_seconds=None, refused=1,
        duration_seconds=0.02, shadow=shadow,
    )  # fmt: skip


def test_tick_span_with_children_and_attributes(harness: Harness) -> None:
    tel = harness.telemetry
    with tel.tick_span("mail"):
        with tel.claim_span("mail", limit=3):
            pass
        with tel.publish_span("mail", messages=["job-1:3"]):
            headers = inject_traceparent({})
        with tel.mark_offered_span("mail", count=1):
            pass
        record_a_tick(tel)
    spans = harness.finished()
    tick, claim, publish = spans[SPAN_TICK], spans[SPAN_CLAIM], spans[SPAN_PUBLISH]
    assert tick.parent is None
    for child in (claim, publish, spans[SPAN_MARK_OFFERED]):
        assert child.parent is not None
        assert child.parent.span_id == tick.context.span_id
        assert child.context.trace_id == tick.context.trace_id
    assert dict(tick.attributes or {}) == {
        "pacerd.destination": "mail", "pacerd.shadow": False, "pacerd.rate": 2.5,
        "pacerd.budget": 3, "pacerd.admitted": 2, "pacerd.refused": 1, "pacerd.inflight": 4,
        "pacerd.due": 10, "pacerd.oldest_due_age_seconds": 12.0,
    }  # fmt: skip
    assert claim.kind is SpanKind.CLIENT
    assert claim.attributes is not None
    assert claim.attributes["db.system.name"] == "postgresql"
    assert publish.kind is SpanKind.PRODUCER
    assert publish.attributes is not None
    assert publish.attributes["messaging.system"] == "rabbitmq"
    assert publish.attributes["messaging.message.id"] == "job-1:3"
    assert publish.attributes["messaging.rabbitmq.destination.routing_key"] == "mail"
    version, trace_id, parent_id, _flags = headers["traceparent"].split("-")
    assert (version, trace_id, parent_id) == (
        "00",
        f"{publish.context.trace_id:032x}",
        f"{publish.context.span_id:016x}",
    )


def test_outcome_span_continues_the_trace_from_message_headers(harness: Harness) -> None:
    tel = harness.telemetry
    with tel.publish_span("mail", messages=["job-1:1"]):
        headers = {k: v.encode() for k, v in inject_traceparent({}).items()}  # AMQP bytes
    with tel.outcome_span(headers, job_id="job-1", attempt=1, outcome="ok"):
        tel.record_outcome("ok", "applied")
    spans = harness.finished()
    publish, outcome = spans[SPAN_PUBLISH], spans[SPAN_OUTCOME]
    assert outcome.kind is SpanKind.CONSUMER
    assert outcome.parent is not None
    assert outcome.parent.span_id == publish.context.span_id
    assert outcome.context.trace_id == publish.context.trace_id
    assert outcome.attributes is not None
    assert outcome.attributes["pacerd.result"] == "applied"
    assert not extract_context(None)  # no headers: an empty context, a new trace


def test_statements_by_name_are_summed_over_their_sources_as_they_grow(
    harness: Harness,
) -> None:
    tel = harness.telemetry
    ledger, locks = Counter({"claim_due": 3, "apply_reports": 5}), Counter({"try_acquire": 2})
    tel.count_statements(ledger, locks)
    ledger["claim_due"] += 1
    locks["claim_due"] += 1  # a name may come from several sources
    assert harness.points(tm.METRIC_LEDGER_STATEMENTS) == {
        frozenset({("statement", "claim_due")}): 5,
        frozenset({("statement", "apply_reports")}): 5,
        frozenset({("statement", "try_acquire")}): 2,
    }


def test_metric_values(harness: Harness) -> None:
    tel = harness.telemetry
    record_a_tick(tel)
    record_a_tick(tel, shadow=True)
    tel.record_reconcile(claims_released=2, offers_rescheduled=1, offers_dead=0)
    tel.record_outcome("refused", "applied")
    tel.record_invalid_outcome("not_json")
    mail = frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_RATE) == {mail: 2.5}
    assert harness.points(tm.METRIC_INFLIGHT) == {mail: 4}
    assert harness.points(tm.METRIC_DUE) == {mail: 10}
    assert harness.points(tm.METRIC_OLDEST_DUE_AGE) == {mail: 12.0}
    assert harness.points(tm.METRIC_DRAIN_ETA) == {}  # unknown: not reported
    assert harness.points(tm.METRIC_REFUSALS) == {mail: 2}
    assert harness.points(tm.METRIC_ADMITTED) == {
        mail | {("mode", "active")}: 2, mail | {("mode", "shadow")}: 2,
    }  # fmt: skip
    assert harness.points(tm.METRIC_TICK_DURATION) == {mail: 2}
    assert harness.points(tm.METRIC_LEASES_RECLAIMED) == {
        frozenset({("lease", "claim"), ("result", "released")}): 2,
        frozenset({("lease", "offer"), ("result", "rescheduled")}): 1,
    }
    assert harness.points(tm.METRIC_OUTCOMES_APPLIED) == {
        frozenset({("outcome", "refused"), ("result", "applied")}): 1
    }
    assert harness.points(tm.METRIC_OUTCOMES_INVALID) == {frozenset({("reason", "not_json")}): 1}


def test_outcomes_are_counted_by_result(harness: Harness) -> None:
    tel = harness.telemetry
    tel.record_outcome("ok", "stale")
    tel.record_outcome("refused", "unknown")
    tel.count_outcomes("ok", "applied", 5)
    assert harness.points(tm.METRIC_OUTCOMES) == {
        frozenset({("outcome", "ok"), ("result", "stale")}): 1,
        frozenset({("outcome", "refused"), ("result", "unknown")}): 1,
        frozenset({("outcome", "ok"), ("result", "applied")}): 5,
    }


def test_operational_gauges_and_publish_metrics(harness: Harness) -> None:
    tel = harness.telemetry
    tel.record_dead("mail", 3)
    tel.record_leadership({"mail": True, "sms": False})
    tel.record_admission_state("mail", paused=False, paused_locally=True, cooldown=False)
    tel.record_publish("mail", confirm_seconds=0.004)
    tel.record_publish("mail", nacked=2, returned=1, timeouts=0)
    mail = frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_DEAD) == {mail: 3}
    assert harness.points(tm.METRIC_LEADER) == {mail: 1, frozenset({("destination", "sms")}): 0}
    assert harness.points(tm.METRIC_PAUSED) == {
        mail | {("scope", "ledger")}: 0, mail | {("scope", "local")}: 1,
    }  # fmt: skip
    assert harness.points(tm.METRIC_COOLDOWN) == {mail: 0}
    assert harness.points(tm.METRIC_PUBLISH_CONFIRM) == {mail: 1}
    assert harness.points(tm.METRIC_PUBLISH_FAILURES) == {
        mail | {("reason", "nacked")}: 2, mail | {("reason", "returned")}: 1,
    }  # fmt: skip


def test_gauges_keep_their_value_between_delta_collections() -> None:
    """The SDK's synchronous gauge reports a value once per delta collection;
    pacerd's gauges report the latest value at every collection."""
    delta: dict[type, AggregationTemporality] = {
        ObservableGauge: AggregationTemporality.DELTA, SyncGauge: AggregationTemporality.DELTA,
    }  # fmt: skip
    reader = InMemoryMetricReader(preferred_temporality=delta)
    tel = setup_telemetry(
        "pacerd-test", "info", "json", metric_readers=[reader],
        span_exporter=InMemorySpanExporter(), log_stream=io.StringIO(),
    )  # fmt: skip
    try:
        sdk_gauge = tel.meter.create_gauge("sdk.gauge")
        sdk_gauge.set(7)
        record_a_tick(tel)
        tel.record_dead("mail", 3)
        first, second = _collected(reader), _collected(reader)
    finally:
        tel.shutdown(timeout_seconds=2)
    assert first["sdk.gauge"] == 7
    assert "sdk.gauge" not in second  # forgotten by the SDK after one collection
    for name in (tm.METRIC_RATE, tm.METRIC_DUE, tm.METRIC_DEAD, tm.METRIC_BUILD_INFO):
        assert second[name] == first[name], name


def _collected(reader: InMemoryMetricReader) -> dict[str, float]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: point.value
        for resource in data.resource_metrics for scope in resource.scope_metrics
        for metric in scope.metrics for point in metric.data.data_points
        if isinstance(point, NumberDataPoint)
    }  # fmt: skip


def test_a_destination_no_longer_led_stops_reporting_tick_gauges(harness: Harness) -> None:
    tel = harness.telemetry
    record_a_tick(tel)
    tel.record_dead("mail", 3)
    tel.record_leadership({"mail": True})
    tel.record_admission_state("mail", paused=True, paused_locally=False, cooldown=False)
    tel.forget_destination("mail")
    for name in (tm.METRIC_RATE, tm.METRIC_INFLIGHT, tm.METRIC_DUE, tm.METRIC_PAUSED):
        assert harness.points(name) == {}, name
    mail = frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_DEAD) == {mail: 3}
    assert harness.points(tm.METRIC_LEADER) == {mail: 1}


def test_instance_name_on_resource_build_info_and_every_log_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_otel_env(monkeypatch)
    reader, stream = InMemoryMetricReader(), io.StringIO()
    tel = setup_telemetry(
        "pacerd", "info", "json", metric_readers=[reader], log_stream=stream,
        instance="host-a:41",
    )  # fmt: skip
    try:
        structlog.get_logger("pacerd.daemon").info("pacerd_ready")
        logging.getLogger("aio_pika").warning("connection lost")
        assert tel.meter_provider._sdk_config.resource.attributes["service.instance.id"] == (
            "host-a:41"
        )
        data = reader.get_metrics_data()
        assert data is not None
        [info] = [
            point.attributes for resource in data.resource_metrics
            for scope in resource.scope_metrics for metric in scope.metrics
            if metric.name == tm.METRIC_BUILD_INFO for point in metric.data.data_points
        ]  # fmt: skip
        assert dict(info or {}) == {
            "version": __version__, "python_version": platform.python_version(),
            "instance_name": "host-a:41",
        }  # fmt: skip
    finally:
        tel.shutdown(timeout_seconds=2)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines
    assert {line.get("instance") for line in lines} == {"host-a:41"}


def test_instance_id_from_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_otel_env(monkeypatch)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7")
    tel = setup_telemetry("pacerd", "info", "json", log_stream=io.StringIO(), instance="h:1")
    try:
        assert tel.tracer_provider.resource.attributes["service.instance.id"] == "pod-7"
    finally:
        tel.shutdown(timeout_seconds=2)


def test_prometheus_names_on_metrics(harness: Harness) -> None:
    """What Prometheus sees: the names dashboards and alert rules use."""
    registry = CollectorRegistry()
    tel = setup_telemetry(
        "pacerd", "info", "json", metric_readers=[], prometheus=True,
        prometheus_registry=registry, log_stream=io.StringIO(), instance="h:1",
        series=grouped_series,
    )  # fmt: skip
    try:
        exercise_every_metric(tel)
        samples = [sample for family in registry.collect() for sample in family.samples]
        names = {sample.name for sample in samples}
    finally:
        tel.shutdown(timeout_seconds=2)
    rates = {
        (sample.labels.get("group", ""), sample.labels.get("destination", ""))
        for sample in samples if sample.name == "pacerd_rate_per_second"
    }  # fmt: skip
    assert rates == {("", "mail"), ("tenants", "")}  # an empty label is no label
    assert {
        "pacerd_rate_per_second", "pacerd_admitted_total", "pacerd_refusals_total",
        "pacerd_inflight", "pacerd_due", "pacerd_oldest_due_age_seconds",
        "pacerd_drain_eta_seconds", "pacerd_leases_reclaimed_total", "pacerd_outcomes_total",
        "pacerd_dead", "pacerd_leader", "pacerd_paused", "pacerd_cooldown",
        "pacerd_publish_confirm_duration_seconds_bucket", "pacerd_publish_failures_total",
        "pacerd_build_info", "pacerd_destinations", "pacerd_ledger_statements_total",
        "pacerd_round_trip_seconds_bucket",
    } <= names  # fmt: skip


def test_log_line_inside_a_tick_carries_its_trace_id(harness: Harness) -> None:
    log = structlog.get_logger("pacerd.admission")
    with harness.telemetry.tick_span("mail") as span:
        log.info("tick_completed", destination="mail", admitted=2)
        logging.getLogger("aio_pika").warning("channel %s closed", 7)
    log.info("outside_any_span")
    ours, foreign, outside = [
        line for line in harness.lines() if line["event"] != "telemetry_configured"
    ]
    context = span.get_span_context()
    for line in (ours, foreign):
        assert line["trace_id"] == f"{context.trace_id:032x}"
        assert line["span_id"] == f"{context.span_id:016x}"
    assert ours["event"] == "tick_completed"
    assert ours["level"] == "info"
    assert ours["destination"] == "mail"
    assert foreign["event"] == "channel 7 closed"
    assert foreign["logger"] == "aio_pika"
    assert "trace_id" not in outside


def test_secrets_are_redacted_in_logs_and_spans(harness: Harness) -> None:
    log = structlog.get_logger("pacerd.daemon")
    log.info(
        "connecting", dsn="postgresql://pacerd:s3cret@db:5432/pacerd",
        nested={"urls": ["amqp://guest:hunter2@mq:5672/"], "password": "plain"},
        api_token="abc",
    )  # fmt: skip
    logging.getLogger("asyncpg").error("cannot connect to postgres://u:pw%40x@h/db")
    with pytest.raises(ConnectionError), harness.telemetry.tick_span("mail"):
        raise ConnectionError("amqp://pacerd:topsecret@mq/ refused")
    output = harness.stream.getvalue()
    for secret in ("s3cret", "hunter2", "plain", "abc", "pw%40x", "topsecret"):
        assert secret not in output
    lines = {line["event"]: line for line in harness.lines()}
    assert lines["connecting"]["dsn"] == "postgresql://pacerd:***@db:5432/pacerd"
    assert lines["cannot connect to postgres://u:***@h/db"]["logger"] == "asyncpg"
    tick = harness.finished()[SPAN_TICK]
    assert tick.status.status_code is StatusCode.ERROR
    assert "topsecret" not in (tick.status.description or "")
    assert tick.events[0].attributes is not None
    assert tick.events[0].attributes["exception.message"] == "amqp://pacerd:***@mq/ refused"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://user:pw@host/db", "postgresql://user:***@host/db"),
        ("amqp://u:p@rabbit:5672/vhost", "amqp://u:***@rabbit:5672/vhost"),
        ("amqps://:onlypw@h", "amqps://:***@h"),
        (
            "dsn=postgresql://a:b@h1 and amqp://c:d@h2",
            "dsn=postgresql://a:***@h1 and amqp://c:***@h2",
        ),
        (
            "host=db user=pacerd password=secret dbname=x",
            "host=db user=pacerd password=*** dbname=x",
        ),
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        ("http://host:8080/path", "http://host:8080/path"),
        ("no secrets here", "no secrets here"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_repeated_exporter_errors_are_logged_once(harness: Harness) -> None:
    otlp_log = logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    for attempt in range(3):
        otlp_log.warning("Transient error %s encountered, retrying", attempt)
    events = [line["event"] for line in harness.lines()]
    assert events.count("Transient error 0 encountered, retrying") == 1
    assert not any("error 1" in str(event) or "error 2" in str(event) for event in events)


def test_log_level_changes_at_run_time(harness: Harness) -> None:
    log = structlog.get_logger("pacerd.daemon")
    set_log_level("warning")
    log.info("hidden")
    log.warning("shown")
    set_log_level("DEBUG")
    log.debug("shown_again")
    events = [line["event"] for line in harness.lines()]
    assert "hidden" not in events
    assert events[-2:] == ["shown", "shown_again"]
    with pytest.raises(ValueError, match="unknown log level"):
        set_log_level("chatty")


def test_console_format() -> None:
    made = Harness(log_format="console")
    try:
        structlog.get_logger("pacerd").info("tick_completed", destination="mail")
    finally:
        made.telemetry.shutdown(timeout_seconds=2)
    line = made.stream.getvalue().splitlines()[-1]
    assert "tick_completed" in line
    assert "destination=mail" in line
    assert not line.startswith("{")


def _env_telemetry(monkeypatch: pytest.MonkeyPatch, **env: str) -> Telemetry:
    for key in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return setup_telemetry(
        "pacerd", "info", "json", log_stream=io.StringIO(), prometheus_registry=CollectorRegistry()
    )


def _names(items: Sequence[object]) -> list[str]:
    return [type(item).__name__ for item in items]


def _without_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)


def test_no_endpoint_configured_exports_nothing_and_logs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_otel_env(monkeypatch)
    stream = io.StringIO()
    tel = setup_telemetry(
        "pacerd", "debug", "json", log_stream=stream, prometheus_registry=CollectorRegistry()
    )
    for _ in range(3):
        with tel.tick_span("mail"):
            record_a_tick(tel)
    assert (tel.span_exporters, tel.metric_exporters, tel.metric_readers) == ((), (), ())
    tel.shutdown(timeout_seconds=2)
    otel_lines = [line for line in stream.getvalue().splitlines() if "opentelemetry" in line]
    assert otel_lines == []
    assert "4318" not in stream.getvalue()


def test_without_an_exporter_spans_carry_their_context_unrecorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing would read a recorded span: each is a NonRecordingSpan, and the
    trace context still reaches the log lines, the published messages and the
    spans continuing them, as a recorded one's would."""
    _without_otel_env(monkeypatch)
    stream = io.StringIO()
    tel = setup_telemetry(
        "pacerd", "info", "json", log_stream=stream, prometheus_registry=CollectorRegistry()
    )
    try:
        assert not tel.record_spans
        with tel.tick_span("mail") as tick:
            structlog.get_logger("pacerd.admission").info("tick_completed", destination="mail")
            with tel.publish_span("mail", messages=["job-1:1"]) as publish:
                headers = inject_traceparent({})
            record_a_tick(tel)
        with tel.outcome_span(headers, job_id="job-1", attempt=1, outcome="ok") as outcome:
            pass
        with tel.tick_span("mail") as second:
            pass
    finally:
        tel.shutdown(timeout_seconds=2)
    for span in (tick, publish, outcome, second):
        assert not span.is_recording()
        assert span.get_span_context().is_valid
    tick_ctx, publish_ctx = tick.get_span_context(), publish.get_span_context()
    assert publish_ctx.trace_id == tick_ctx.trace_id
    assert publish_ctx.span_id != tick_ctx.span_id
    assert headers["traceparent"] == (
        f"00-{publish_ctx.trace_id:032x}-{publish_ctx.span_id:016x}-01"  # sampled, as before
    )
    assert outcome.get_span_context().trace_id == publish_ctx.trace_id
    assert second.get_span_context().trace_id != tick_ctx.trace_id  # a root: a new trace
    [line] = [json.loads(x) for x in stream.getvalue().splitlines() if "tick_completed" in x]
    assert line["trace_id"] == f"{tick_ctx.trace_id:032x}"
    assert line["span_id"] == f"{tick_ctx.span_id:016x}"


def test_an_exporter_records_every_span(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_otel_env(monkeypatch)
    exporter = InMemorySpanExporter()
    tel = setup_telemetry(
        "pacerd", "info", "json", log_stream=io.StringIO(), span_exporter=exporter
    )
    try:
        assert tel.record_spans
        with tel.tick_span("mail") as tick:
            assert tick.is_recording()
    finally:
        tel.shutdown(timeout_seconds=2)
    assert [span.name for span in exporter.get_finished_spans()] == [SPAN_TICK]


def test_forgetting_a_destination_keeps_the_others_and_the_kept_gauges() -> None:
    latest = tm.LatestValues()
    for destination in ("a", "b"):
        latest.set(tm.METRIC_RATE, 1.0, {"destination": destination})
        latest.set(tm.METRIC_PAUSED, 0, {"destination": destination, "scope": "ledger"})
        latest.set(tm.METRIC_DEAD, 2, {"destination": destination})
    latest.set(tm.METRIC_BUILD_INFO, 1, {"version": "x"})
    latest.discard(tm.METRIC_RATE, {"destination": "a"})
    latest.forget("a", keep=[tm.METRIC_DEAD])
    assert latest.collect(tm.METRIC_RATE) == {(("destination", "b"),): 1.0}
    assert latest.collect(tm.METRIC_PAUSED) == {(("destination", "b"), ("scope", "ledger")): 0}
    assert latest.collect(tm.METRIC_DEAD) == {
        (("destination", "a"),): 2,
        (("destination", "b"),): 2,
    }
    assert latest.destinations() == 2  # a still has a kept series
    latest.forget("a")
    assert latest.collect(tm.METRIC_DEAD) == {(("destination", "b"),): 2}
    assert latest.collect(tm.METRIC_BUILD_INFO) == {(("version", "x"),): 1}
    assert latest.destinations() == 1


def test_explicit_otlp_exporter_is_kept_without_an_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_otel_env(monkeypatch)
    tel = _env_telemetry(monkeypatch, OTEL_TRACES_EXPORTER="otlp")
    try:
        assert _names(tel.span_exporters) == [OTLPSpanExporter.__name__]
        assert tel.metric_readers == ()
    finally:
        tel.shutdown(timeout_seconds=0.5)


def test_a_signal_endpoint_selects_otlp_for_that_signal_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_otel_env(monkeypatch)
    tel = _env_telemetry(monkeypatch, OTEL_EXPORTER_OTLP_METRICS_ENDPOINT="http://127.0.0.1:9")
    try:
        assert tel.span_exporters == ()
        assert _names(tel.metric_exporters) == [OTLPMetricExporter.__name__]
    finally:
        tel.shutdown(timeout_seconds=0.5)


def test_none_exporters(monkeypatch: pytest.MonkeyPatch) -> None:
    tel = _env_telemetry(monkeypatch, OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    with tel.tick_span("mail"):
        record_a_tick(tel)
    assert (tel.span_exporters, tel.metric_readers) == ((), ())
    tel.shutdown(timeout_seconds=2)


def test_otlp_over_http_by_default_with_env_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    tel = _env_telemetry(
        monkeypatch, OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_SERVICE_NAME="pacerd-eu",
        OTEL_TRACES_SAMPLER="always_off",
    )  # fmt: skip
    try:
        [exporter] = tel.span_exporters
        assert isinstance(exporter, OTLPSpanExporter)
        assert [type(r) for r in tel.metric_readers] == [PrometheusMetricReader]
        assert tel.tracer_provider.resource.attributes["service.name"] == "pacerd-eu"
        with tel.tick_span("mail") as span:
            assert not span.get_span_context().trace_flags.sampled
    finally:
        tel.shutdown(timeout_seconds=2)


def test_console_exporters_and_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    tel = _env_telemetry(monkeypatch, OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none")
    assert _names(tel.span_exporters) == [ConsoleSpanExporter.__name__]
    assert tel.tracer_provider.resource.attributes["service.name"] == "pacerd"
    tel.shutdown(timeout_seconds=2)


class StuckExporter(SpanExporter):
    """An exporter whose collector never answers: export waits until shutdown."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.exporting = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exporting.set()
        self.aborted.wait(30)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.aborted.set()


def test_shutdown_is_bounded_when_the_collector_does_not_answer() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    stuck = StuckExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(stuck, schedule_delay_millis=1))
    tel = Telemetry(provider, MeterProvider(shutdown_on_exit=False), span_exporters=[stuck])
    with tel.tick_span("mail"):
        pass
    assert stuck.exporting.wait(5)
    started = time.monotonic()
    tel.shutdown(timeout_seconds=0.2)
    assert time.monotonic() - started < 2
    assert stuck.aborted.is_set()


class GatedProcessor(SpanProcessor):
    """A span processor whose shutdown waits until the test lets it finish."""

    def __init__(self) -> None:
        self.shutting_down = threading.Event()
        self.release = threading.Event()
        self.released = False

    def shutdown(self) -> None:
        self.shutting_down.set()
        self.released = self.release.wait(10)


async def test_aclose_runs_off_the_event_loop() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    gate = GatedProcessor()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(gate)
    tel = Telemetry(provider, MeterProvider(shutdown_on_exit=False))
    closed = anyio.Event()
    seen_in_progress = False

    async def close() -> None:
        await tel.aclose(timeout_seconds=10)
        closed.set()

    # The loop must keep running while the shutdown is in progress: this task
    # sees it under way and lets it finish. Were aclose to block the loop, the
    # task would only run again once the shutdown had returned.
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            while not closed.is_set():
                if gate.shutting_down.is_set():
                    seen_in_progress = True
                    gate.release.set()
                await anyio.sleep(0.01)
    assert seen_in_progress, "aclose blocked the event loop"
    assert gate.released
    tel.shutdown()  # idempotent


# -- the daemon's wiring -----------------------------------------------------------


async def test_publisher_rejections_are_told_apart() -> None:
    returned = DeliveredMessage(
        delivery=Basic.Return(reply_code=312, reply_text="NO_ROUTE", routing_key="mail"),
        header=ContentHeader(), body=b"", channel=None,  # type: ignore[arg-type]
    )  # fmt: skip
    errors = {}
    for name, driver_error in (
        ("return", aiormq.exceptions.PublishError(returned, Basic.Return())),
        ("delivery", aiormq.exceptions.DeliveryError(None, Basic.Nack())),
    ):
        with pytest.raises(PublishRejected) as caught, translate_errors():
            raise driver_error
        errors[name] = caught.value
    assert rejection_reason(errors["return"]) == "returned"
    assert rejection_reason(errors["delivery"]) == "nacked"
    nack: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    nack.set_result(Basic.Nack())
    nacked = publisher_outcome(nack, timed_out=False)
    assert isinstance(nacked, PublishRejected)
    assert rejection_reason(nacked) == "nacked"


def test_observer_records_confirm_time_state_and_failures(harness: Harness) -> None:
    clock = ManualClock()
    observer = TelemetryObserver(harness.telemetry, clock)
    job = ClaimedJob(
        job_id="j1", kind="k", destination="mail", attempt=1, revision=0, payload_json="{}",
        cursor_json=None, eligible_at=clock.now(), live=True,
    )  # fmt: skip
    with observer.publish_span("mail", [job]) as headers:
        assert "traceparent" in headers
        clock.advance(0.25)
    observer.tick_completed(
        TickResult(destination="mail", skipped="cooldown", nacked=2, returned=1, confirm_timeouts=3)
    )
    mail = frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_PUBLISH_CONFIRM) == {mail: 1}
    assert harness.points(tm.METRIC_COOLDOWN) == {mail: 1}
    assert harness.points(tm.METRIC_PAUSED) == {
        mail | {("scope", "ledger")}: 0, mail | {("scope", "local")}: 0,
    }  # fmt: skip
    assert harness.points(tm.METRIC_PUBLISH_FAILURES) == {
        mail | {("reason", "nacked")}: 2, mail | {("reason", "returned")}: 1,
        mail | {("reason", "timeout")}: 3,
    }  # fmt: skip
    [point] = histogram_points(harness.metrics, tm.METRIC_PUBLISH_CONFIRM)
    assert point.sum == 0.25


def test_a_job_released_here_has_its_round_trip_timed_when_its_outcome_is_applied(
    harness: Harness,
) -> None:
    clock = ManualClock()
    observer = TelemetryObserver(harness.telemetry, clock, 60.0)
    outcomes = OutcomeObserver(harness.telemetry, observer.releases)
    jobs = [
        ClaimedJob(
            job_id=name,
            kind="k",
            destination="mail",
            attempt=1,
            revision=0,
            payload_json="{}",
            cursor_json=None,
            eligible_at=clock.now(),
            live=False,
        )
        for name in ("j1", "j2", "j3")
    ]
    for job in jobs:  # three release slices
        with observer.publish_span("mail", [job]):
            clock.advance(0.01)  # the confirms: the release is when they are back
    clock.advance(2.0)
    delivery = Delivery(body=b"{}", message_id=None, headers={}, delivery_tag=1)
    outcomes.on_report(delivery, Report(job_id="j1", attempt=1, outcome=Outcome.OK), "applied")
    outcomes.on_report(delivery, Report(job_id="j2", attempt=1, outcome=Outcome.REFUSED), "applied")
    outcomes.on_report(delivery, Report(job_id="j3", attempt=1, outcome=Outcome.OK), "stale")
    outcomes.on_report(delivery, Report(job_id="x", attempt=1, outcome=Outcome.OK), "applied")
    mail = frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_ROUND_TRIP) == {mail: 2}  # j1 and j2
    [point] = histogram_points(harness.metrics, tm.METRIC_ROUND_TRIP)
    assert point.sum == pytest.approx(2.02 + 2.01)  # from the end of each one's slice
    assert len(observer.releases) == 1  # j3, stale here: it ages out
    # a slice of several jobs is timed by its first: a sample that costs
    # nothing per job at thousands a second
    with observer.publish_span("mail", jobs):
        pass
    assert observer.releases.heard("j1", 1) is not None
    assert observer.releases.heard("j2", 1) is None


# -- series per group ------------------------------------------------------------------

TENANTS = frozenset({("group", "tenants")})


def grouped_config() -> Config:
    return Config.model_validate({
        "groups": {"tenants": {"match": "tenant-*"}},
        "telemetry": {"destination_series": ["tenant-vip"]},
    })  # fmt: skip


def tick(tel: Telemetry, destination: str, **figures: float | None) -> None:
    values: dict[str, float | None] = {
        "rate": 1.0, "budget": 1, "admitted": 0, "inflight": 0, "due": 0,
        "oldest_due_age_seconds": None, "drain_eta_seconds": None, "refused": 0,
    }  # fmt: skip
    values.update(figures)
    tel.record_tick(destination, **values)  # type: ignore[arg-type]


def test_a_group_reports_one_series_summed_and_its_ages_at_their_maximum(
    harness: Harness,
) -> None:
    tel = harness.telemetry
    tel.set_series(grouped_config().series_for)
    tick(
        tel,
        "tenant-1",
        rate=2.0,
        admitted=3,
        inflight=1,
        due=10,
        oldest_due_age_seconds=5.0,
        drain_eta_seconds=5.0,
        refused=1,
        duration_seconds=0.01,
    )
    tick(
        tel,
        "tenant-2",
        rate=3.0,
        admitted=4,
        inflight=2,
        due=4,
        oldest_due_age_seconds=50.0,
        drain_eta_seconds=1.5,
        refused=2,
        duration_seconds=0.02,
    )
    tick(tel, "tenant-vip", rate=7.0, due=1, oldest_due_age_seconds=9.0, drain_eta_seconds=0.5)
    tick(tel, "mail", rate=2.5, due=2, oldest_due_age_seconds=1.0, drain_eta_seconds=2.0)
    vip, mail = frozenset({("destination", "tenant-vip")}), frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_RATE) == {TENANTS: 5.0, vip: 7.0, mail: 2.5}
    assert harness.points(tm.METRIC_DUE) == {TENANTS: 14, vip: 1, mail: 2}
    assert harness.points(tm.METRIC_INFLIGHT) == {TENANTS: 3, vip: 0, mail: 0}
    assert harness.points(tm.METRIC_OLDEST_DUE_AGE) == {TENANTS: 50.0, vip: 9.0, mail: 1.0}
    assert harness.points(tm.METRIC_DRAIN_ETA) == {TENANTS: 5.0, vip: 0.5, mail: 2.0}
    assert harness.points(tm.METRIC_ADMITTED) == {TENANTS | {("mode", "active")}: 7}
    assert harness.points(tm.METRIC_REFUSALS) == {TENANTS: 3}
    assert harness.points(tm.METRIC_TICK_DURATION) == {TENANTS: 2}


def test_a_group_counts_its_paused_cooling_led_and_known_destinations(
    harness: Harness,
) -> None:
    tel = harness.telemetry
    tel.set_series(grouped_config().series_for)
    tel.record_admission_state("tenant-1", paused=True, paused_locally=False, cooldown=False)
    tel.record_admission_state("tenant-2", paused=True, paused_locally=True, cooldown=True)
    tel.record_admission_state("tenant-3", paused=False, paused_locally=False, cooldown=True)
    tel.record_admission_state("mail", paused=False, paused_locally=False, cooldown=True)
    tel.record_leadership({"tenant-1": True, "tenant-2": False, "tenant-3": True, "mail": True})
    for destination, dead in (("tenant-1", 2), ("tenant-2", 5), ("mail", 1)):
        tel.record_dead(destination, dead)
    tel.record_publish("tenant-1", confirm_seconds=0.01, nacked=1)
    tel.record_publish("tenant-2", confirm_seconds=0.02, nacked=2, timeouts=1)
    mail = frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_PAUSED) == {
        TENANTS | {("scope", "ledger")}: 2, TENANTS | {("scope", "local")}: 1,
        mail | {("scope", "ledger")}: 0, mail | {("scope", "local")}: 0,
    }  # fmt: skip
    assert harness.points(tm.METRIC_COOLDOWN) == {TENANTS: 2, mail: 1}
    assert harness.points(tm.METRIC_LEADER) == {TENANTS: 2, mail: 1}
    assert harness.points(tm.METRIC_DESTINATIONS) == {TENANTS: 3}  # a group's only
    assert harness.points(tm.METRIC_DEAD) == {TENANTS: 7, mail: 1}
    assert harness.points(tm.METRIC_PUBLISH_CONFIRM) == {TENANTS: 2}
    assert harness.points(tm.METRIC_PUBLISH_FAILURES) == {
        TENANTS | {("reason", "nacked")}: 3, TENANTS | {("reason", "timeout")}: 1,
    }  # fmt: skip


def test_the_series_rule_is_a_setup_argument() -> None:
    reader = InMemoryMetricReader()
    tel = setup_telemetry(
        "pacerd-test", "info", "json", metric_readers=[reader],
        span_exporter=InMemorySpanExporter(), log_stream=io.StringIO(),
        series=grouped_config().series_for,
    )  # fmt: skip
    try:
        tick(tel, "tenant-1", rate=2.0)
        tick(tel, "tenant-2", rate=3.0)
        assert tel.latest.collect(tm.METRIC_RATE) == {(("group", "tenants"),): 5.0}
    finally:
        tel.shutdown(timeout_seconds=2)


def test_a_new_series_rule_applies_to_what_was_recorded(harness: Harness) -> None:
    tel = harness.telemetry
    tick(tel, "tenant-1", rate=2.0)
    tick(tel, "tenant-2", rate=3.0)
    assert len(harness.points(tm.METRIC_RATE)) == 2  # the default: a series each
    tel.set_series(grouped_config().series_for)
    assert harness.points(tm.METRIC_RATE) == {TENANTS: 5.0}


def test_group_gauges_keep_their_value_between_delta_collections() -> None:
    delta: dict[type, AggregationTemporality] = {
        ObservableGauge: AggregationTemporality.DELTA, SyncGauge: AggregationTemporality.DELTA,
    }  # fmt: skip
    reader = InMemoryMetricReader(preferred_temporality=delta)
    tel = setup_telemetry(
        "pacerd-test", "info", "json", metric_readers=[reader],
        span_exporter=InMemorySpanExporter(), log_stream=io.StringIO(),
        series=grouped_config().series_for,
    )  # fmt: skip
    try:
        tick(tel, "tenant-1", rate=2.0, due=3, oldest_due_age_seconds=4.0)
        tick(tel, "tenant-2", rate=1.0, due=1, oldest_due_age_seconds=8.0)
        tel.record_dead("tenant-1", 3)
        first, second = _collected(reader), _collected(reader)
    finally:
        tel.shutdown(timeout_seconds=2)
    assert first[tm.METRIC_RATE] == 3.0
    assert first[tm.METRIC_OLDEST_DUE_AGE] == 8.0
    for name in (tm.METRIC_RATE, tm.METRIC_DUE, tm.METRIC_OLDEST_DUE_AGE, tm.METRIC_DEAD):
        assert second[name] == first[name], name


def test_a_forgotten_destination_leaves_its_group_and_no_memory(harness: Harness) -> None:
    tel = harness.telemetry
    tel.set_series(grouped_config().series_for)
    names = [f"tenant-{n:05}" for n in range(2000)]
    for n, destination in enumerate(names):
        tick(tel, destination, rate=1.0, due=1, oldest_due_age_seconds=float(n))
        tel.record_dead(destination, 1)
    tel.record_leadership(dict.fromkeys(names, True))
    assert harness.points(tm.METRIC_RATE) == {TENANTS: 2000.0}
    assert harness.points(tm.METRIC_OLDEST_DUE_AGE) == {TENANTS: 1999.0}
    for destination in names[1000:]:
        tel.forget_destination(destination)  # no longer led: the ledger's counts stay
    assert harness.points(tm.METRIC_RATE) == {TENANTS: 1000.0}
    assert harness.points(tm.METRIC_OLDEST_DUE_AGE) == {TENANTS: 999.0}
    assert harness.points(tm.METRIC_DEAD) == {TENANTS: 2000}
    assert harness.points(tm.METRIC_LEADER) == {TENANTS: 2000}
    assert tel.latest.destinations() == 2000
    for destination in names:
        tel.forget_destination(destination, everything=True)
    assert tel.latest.destinations() == 0
    for name in (tm.METRIC_RATE, tm.METRIC_DEAD, tm.METRIC_LEADER, tm.METRIC_DESTINATIONS):
        assert harness.points(name) == {}, name


def test_a_drain_eta_no_longer_known_is_no_longer_reported(harness: Harness) -> None:
    tel = harness.telemetry
    tick(tel, "mail", due=10, drain_eta_seconds=4.0)
    assert harness.points(tm.METRIC_DRAIN_ETA) == {frozenset({("destination", "mail")}): 4.0}
    tick(tel, "mail", due=0, drain_eta_seconds=None)  # drained
    assert harness.points(tm.METRIC_DRAIN_ETA) == {}


def test_observer_records_each_ticks_planning_time(harness: Harness) -> None:
    clock = ManualClock()
    observer = TelemetryObserver(harness.telemetry, clock)
    for _ in range(3):
        with observer.tick_span("mail", shadow=False):
            result = TickResult(destination="mail", rate=1.0, budget=1, planning_seconds=0.02)
            observer.tick_completed(result)
    observer.tick_completed(TickResult(destination="mail"))  # failed early: no duration
    mail = frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_TICK_DURATION) == {mail: 3}


async def test_the_reconciler_runs_when_told_in_a_reconcile_span(harness: Harness) -> None:
    from pacerd.reconciler import Reconciler, ReconcilerConfig

    clock = ManualClock(autojump=True)
    allowed = [False, True, True]
    runs: list[int] = []
    scope = anyio.CancelScope()

    class Ledger:  # the one statement a pass makes
        async def reclaim_expired(self, *, limit: int) -> list[object]:
            runs.append(limit)
            if len(runs) == 2:
                scope.cancel()
            return []

    reconciler = Reconciler(
        ledger=Ledger(), clock=clock,  # type: ignore[arg-type]
        config=ReconcilerConfig(interval_seconds=1.0, batch_size=7),
        telemetry=harness.telemetry, should_run=lambda: allowed.pop(0) if allowed else True,
    )  # fmt: skip
    with scope:
        await reconciler.run()
    assert runs == [7, 7]  # the first pass was skipped: should_run said no
    assert tm.SPAN_RECONCILE in harness.finished()


def test_admitted_and_refused_count_on_across_collections_and_sum_a_groups_destinations(
    harness: Harness,
) -> None:
    tel = harness.telemetry
    tel.set_series(grouped_config().series_for)
    record_a_tick(tel)
    mail = frozenset({("destination", "mail")})
    assert harness.points(tm.METRIC_ADMITTED) == {mail | {("mode", "active")}: 2}
    record_a_tick(tel)
    for tenant in ("tenant-1", "tenant-2"):
        tel.record_tick(
            tenant, rate=1.0, budget=1, admitted=3, inflight=0, due=0,
            oldest_due_age_seconds=None, drain_eta_seconds=None, refused=2,
        )  # fmt: skip
    assert harness.points(tm.METRIC_ADMITTED) == {
        mail | {("mode", "active")}: 4, TENANTS | {("mode", "active")}: 6,
    }  # fmt: skip
    assert harness.points(tm.METRIC_REFUSALS) == {mail: 2, TENANTS: 4}
    tel.forget_destination("mail", everything=True)  # a counter never goes back
    assert harness.points(tm.METRIC_ADMITTED)[mail | {("mode", "active")}] == 4


def test_the_observer_sets_the_closed_gauges_as_they_change_and_again_after_forgetting(
    harness: Harness,
) -> None:
    observer = TelemetryObserver(harness.telemetry, ManualClock())
    mail = frozenset({("destination", "mail")})

    def closed() -> tuple[dict[frozenset[tuple[str, object]], float], ...]:
        return harness.points(tm.METRIC_PAUSED), harness.points(tm.METRIC_COOLDOWN)

    def gauges(ledger: int, local: int, cooldown: int) -> tuple[object, ...]:
        paused = {mail | {("scope", "ledger")}: ledger, mail | {("scope", "local")}: local}
        return paused, {mail: cooldown}

    observer.tick_completed(TickResult(destination="mail", skipped="paused"))
    assert closed() == gauges(1, 0, 0)
    observer.tick_completed(TickResult(destination="mail", skipped="paused"))
    assert closed() == gauges(1, 0, 0)
    observer.tick_completed(TickResult(destination="mail", rate=2.0, budget=2))
    assert closed() == gauges(0, 0, 0)
    observer.tick_completed(TickResult(destination="mail", skipped="cooldown"))
    assert closed() == gauges(0, 0, 1)
    observer.forget("mail")
    assert closed() == ({}, {})
    observer.tick_completed(TickResult(destination="mail", skipped="cooldown"))
    assert closed() == gauges(0, 0, 1)  # set again, though it did not change meanwhile
    harness.telemetry.forget_destination("mail")  # however it is forgotten
    assert closed() == ({}, {})
    harness.telemetry.record_admission_state(
        "mail", paused=False, paused_locally=False, cooldown=True
    )
    assert closed() == gauges(0, 0, 1)
