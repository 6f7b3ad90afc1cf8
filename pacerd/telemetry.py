"""Logs, traces and metrics: structlog + OpenTelemetry, set up once.

Owns the names operators and dashboards rely on (docs/protocol.md, "Telemetry"), the
exporter selection from the standard ``OTEL_*`` variables, the structlog chain
(JSON lines, or console on a TTY; trace and span ids on every line inside a
span; stdlib logging routed through it) and secret redaction. It must not
decide what to measure or when: services call the small ``Telemetry`` methods.
It must never block the event loop (exporters run in SDK threads; ``aclose``
shuts down in a worker thread) and never put a secret in a log line or a span.

Metrics (attributes are plain keys). On Prometheus ``/metrics`` dots become
underscores, counters end in ``_total`` and units are appended: ``pacerd_rate_per_second``,
``pacerd_admitted_total``, ``pacerd_oldest_due_age_seconds``, ...

    pacerd.rate                    gauge      {job}/s   destination
    pacerd.admitted                counter    {job}     destination, mode (active|shadow)
    pacerd.refusals                counter    {job}     destination
    pacerd.inflight                gauge      {job}     destination
    pacerd.due                     gauge      {job}     destination
    pacerd.oldest_due_age_seconds  gauge      s         destination
    pacerd.drain_eta_seconds       gauge      s         destination (not set when unknown)
    pacerd.leases_reclaimed        counter    {lease}   lease (claim|offer), result
    pacerd.outcomes                counter    {report}  outcome, result (applied|stale|unknown)
    pacerd.outcomes.applied        counter    {report}  outcome, result (kept for old
                                                        dashboards: it counts every result)
    pacerd.outcomes.invalid        counter    {message} reason
    pacerd.tick.duration_seconds   histogram  s         destination
    pacerd.dead                    gauge      {job}     destination (jobs in state dead)
    pacerd.leader                  gauge      1         destination (1: this instance leads it)
    pacerd.paused                  gauge      1         destination, scope (ledger|local)
    pacerd.cooldown                gauge      1         destination (1: in a Retry-After cool-down)
    pacerd.publish.confirm_duration_seconds
                                   histogram  s         destination (a release slice's
                                                        publish until its last confirm)
    pacerd.publish.failures        counter    {message} destination, reason
                                                        (nacked|returned|timeout)
    pacerd.round_trip_seconds      histogram  s         destination (the first job of a release
                                                        slice this instance published, from its
                                                        publish confirmed to its outcome applied,
                                                        when this instance's consumer applied it)
    pacerd.build_info              gauge      1         version, python_version, instance_name
    pacerd.destinations            gauge      {destination} group (how many destinations of
                                                        the group this instance knows)

``destination`` above stands for the series attribute of a destination, which a
``SeriesRule`` chooses (``setup_telemetry(series=...)``, ``set_series``; the
daemon's is ``Config.series_for``): ``destination=NAME``, a series of its own,
or ``group=GROUP``, shared by the group's destinations so that thousands of
them make one series. A group's gauges sum its destinations' values (rate,
in flight, due, dead, leader, and paused and cooldown as counts of
destinations) but for the ages in ``MAXIMUM_GAUGES`` (the maximum), and its
counters and histograms count for all of them.

Gauges are observable: each collection reads the latest value recorded here,
whatever the exporter's temporality, and a destination this instance stops
leading is dropped (``forget_destination``) instead of repeating its last value;
``forget_destination(everything=True)`` drops all it left here.
The resource carries ``service.instance.id`` (the instance name, unless
``OTEL_RESOURCE_ATTRIBUTES`` sets one), and every log line an ``instance`` key.

Spans (span attributes are namespaced ``pacerd.*`` or semantic conventions):

    pacerd.tick          internal  pacerd.destination, pacerd.shadow, pacerd.rate,
                                   pacerd.budget, pacerd.admitted, pacerd.refused,
                                   pacerd.inflight, pacerd.due,
                                   pacerd.oldest_due_age_seconds, pacerd.drain_eta_seconds
    pacerd.claim         client    db.system.name=postgresql, db.operation.name=claim_due,
                                   pacerd.destination, pacerd.limit
    pacerd.publish       producer  messaging.system=rabbitmq, messaging.operation.type=send,
                                   messaging.destination.name=pacerd.ready,
                                   messaging.rabbitmq.destination.routing_key,
                                   messaging.message.id, messaging.message.conversation_id,
                                   pacerd.destination, pacerd.job_id, pacerd.attempt
    pacerd.mark_offered  client    db.system.name, db.operation.name=mark_offered,
                                   pacerd.destination, pacerd.count
    pacerd.reconcile     internal  pacerd.claims_released, pacerd.offers_rescheduled,
                                   pacerd.offers_dead
    pacerd.outcome       consumer  messaging.system, messaging.operation.type=process,
                                   messaging.destination.name=pacerd.outcomes,
                                   pacerd.job_id, pacerd.attempt, pacerd.outcome, pacerd.result

A span that ends by an exception gets status ERROR and an ``exception`` event
with the redacted message (never the raw text, which could hold a DSN).
"""

from __future__ import annotations

import logging
import os
import platform
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, TextIO

import anyio.to_thread
import structlog
from opentelemetry import propagate, trace
from opentelemetry.metrics import CallbackOptions, ObservableGauge, Observation
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from pacerd import __version__

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.util.types import AttributeValue
    from prometheus_client import CollectorRegistry
    from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = [
    "METRICS", "METRIC_ADMITTED", "METRIC_BUILD_INFO", "METRIC_COOLDOWN", "METRIC_DEAD",
    "METRIC_DESTINATIONS", "METRIC_DRAIN_ETA", "METRIC_DUE", "METRIC_INFLIGHT", "METRIC_LEADER",
    "METRIC_LEASES_RECLAIMED", "METRIC_LEDGER_STATEMENTS", "METRIC_OLDEST_DUE_AGE",
    "METRIC_OUTCOMES", "METRIC_OUTCOMES_APPLIED", "METRIC_OUTCOMES_INVALID", "METRIC_PAUSED",
    "METRIC_PUBLISH_CONFIRM", "METRIC_PUBLISH_FAILURES", "METRIC_RATE", "METRIC_REFUSALS",
    "METRIC_ROUND_TRIP", "METRIC_TICK_DURATION",
    "SPAN_CLAIM", "SPAN_MARK_OFFERED", "SPAN_OUTCOME", "SPAN_PUBLISH", "SPAN_RECONCILE",
    "SPAN_TICK", "LatestValues", "SeriesRule", "Telemetry", "bind_log_context", "configure_logging",
    "extract_context", "inject_traceparent",
    "per_destination", "redact", "set_log_level", "setup_telemetry",
]  # fmt: skip

METRIC_RATE = "pacerd.rate"
METRIC_ADMITTED = "pacerd.admitted"
METRIC_REFUSALS = "pacerd.refusals"
METRIC_INFLIGHT = "pacerd.inflight"
METRIC_DUE = "pacerd.due"
METRIC_OLDEST_DUE_AGE = "pacerd.oldest_due_age_seconds"
METRIC_DRAIN_ETA = "pacerd.drain_eta_seconds"
METRIC_LEASES_RECLAIMED = "pacerd.leases_reclaimed"
METRIC_OUTCOMES_APPLIED = "pacerd.outcomes.applied"
METRIC_OUTCOMES_INVALID = "pacerd.outcomes.invalid"
METRIC_TICK_DURATION = "pacerd.tick.duration_seconds"
METRIC_ROUND_TRIP = "pacerd.round_trip_seconds"
METRIC_OUTCOMES = "pacerd.outcomes"
METRIC_DEAD = "pacerd.dead"
METRIC_LEADER = "pacerd.leader"
METRIC_PAUSED = "pacerd.paused"
METRIC_COOLDOWN = "pacerd.cooldown"
METRIC_PUBLISH_CONFIRM = "pacerd.publish.confirm_duration_seconds"
METRIC_PUBLISH_FAILURES = "pacerd.publish.failures"
METRIC_BUILD_INFO = "pacerd.build_info"
METRIC_DESTINATIONS = "pacerd.destinations"
METRIC_LEDGER_STATEMENTS = "pacerd.ledger.statements"
METRICS = (
    METRIC_RATE, METRIC_ADMITTED, METRIC_REFUSALS, METRIC_INFLIGHT, METRIC_DUE,
    METRIC_OLDEST_DUE_AGE, METRIC_DRAIN_ETA, METRIC_LEASES_RECLAIMED, METRIC_OUTCOMES,
    METRIC_OUTCOMES_APPLIED, METRIC_OUTCOMES_INVALID, METRIC_TICK_DURATION, METRIC_DEAD,
    METRIC_LEADER, METRIC_PAUSED, METRIC_COOLDOWN, METRIC_PUBLISH_CONFIRM,
    METRIC_PUBLISH_FAILURES, METRIC_BUILD_INFO, METRIC_DESTINATIONS, METRIC_LEDGER_STATEMENTS,
    METRIC_ROUND_TRIP,
)  # fmt: skip
# A group's series report the maximum of its destinations' values for these
# gauges, and the sum for every other one.
MAXIMUM_GAUGES = (METRIC_OLDEST_DUE_AGE, METRIC_DRAIN_ETA)

SPAN_TICK = "pacerd.tick"
SPAN_CLAIM = "pacerd.claim"
SPAN_PUBLISH = "pacerd.publish"
SPAN_MARK_OFFERED = "pacerd.mark_offered"
SPAN_RECONCILE = "pacerd.reconcile"
SPAN_OUTCOME = "pacerd.outcome"

READY_EXCHANGE = "pacerd.ready"
OUTCOMES_QUEUE = "pacerd.outcomes"
_TICK_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_CONFIRM_BUCKETS_SECONDS = (*_TICK_BUCKETS_SECONDS, 10.0, 30.0)
_ROUND_TRIP_BUCKETS_SECONDS = (*_CONFIRM_BUCKETS_SECONDS, 60.0, 120.0, 300.0)

_log = structlog.get_logger(__name__)

# -- redaction -------------------------------------------------------------------------

_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^:/?#@\s]*):([^@\s]+)@")
_KV_PASSWORD = re.compile(r"(?i)\b(password|passwd|pwd)=([^\s&;,'\"]+)")
_SECRET_KEY = re.compile(r"(?i)(^|[_.\-])(password|passwd|secret|token|api_key|authorization)$")
_MASK = "***"


def redact(text: str) -> str:
    """``text`` with URL passwords and ``password=`` values replaced by ``***``."""
    if "@" not in text and "=" not in text:  # neither pattern can match: the common case
        return text
    text = _URL_PASSWORD.sub(rf"\1:{_MASK}@", text)
    return _KV_PASSWORD.sub(rf"\1={_MASK}", text)


def _redact_value(value: object) -> object:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {k: _MASK if _is_secret_key(k) else _redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_value(v) for v in value]
    return value


def _is_secret_key(key: object) -> bool:
    return isinstance(key, str) and _SECRET_KEY.search(key) is not None


def _redact_processor(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    for key, value in list(event_dict.items()):
        event_dict[key] = _MASK if _is_secret_key(key) else _redact_value(value)
    return event_dict


# -- logging ---------------------------------------------------------------------------


_LOG_CONTEXT: dict[str, str] = {}


def bind_log_context(**values: str) -> None:
    """The keys every log line of the process carries from now on (``instance``),
    also lines logged from other threads and by other libraries; replaces the last."""
    _LOG_CONTEXT.clear()
    _LOG_CONTEXT.update(values)


def _add_log_context(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    for key, value in _LOG_CONTEXT.items():
        event_dict.setdefault(key, value)
    return event_dict


def _add_trace_context(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", format(context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(context.span_id, "016x"))
    return event_dict


class _QuietRepeats(logging.Filter):
    """Lets one record per OpenTelemetry message template through every few minutes.

    With no collector listening, the OTLP exporters would log a warning per
    retry and an error per batch; one line now and then says the same thing.
    """

    def __init__(self, every_seconds: float = 300.0) -> None:
        super().__init__()
        self._every_seconds = every_seconds
        self._last: dict[tuple[str, str], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("opentelemetry"):
            return True
        key = (record.name, str(record.msg))
        last = self._last.get(key)
        if last is not None and record.created - last < self._every_seconds:
            return False
        self._last[key] = record.created
        return True


_HANDLER_NAME = "pacerd"


def configure_logging(
    log_level: str = "info", log_format: str = "auto", *, stream: TextIO | None = None
) -> None:
    """Route structlog and stdlib logging to one handler on ``stream`` (stderr).

    ``log_format``: ``json`` | ``console`` | ``auto`` (JSON unless ``stream`` is a TTY).
    Calling it again replaces the previous pacerd handler.
    """
    out = sys.stderr if stream is None else stream
    tty = out.isatty()
    use_json = log_format == "json" or (log_format == "auto" and not tty)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        _add_log_context,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _add_trace_context,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    final: list[Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if use_json:
        final += [structlog.processors.dict_tracebacks, _redact_processor]
        final.append(structlog.processors.JSONRenderer())
    else:
        final += [structlog.processors.format_exc_info, _redact_processor]
        final.append(
            structlog.dev.ConsoleRenderer(
                colors=tty, exception_formatter=structlog.dev.plain_traceback
            )
        )
    handler = logging.StreamHandler(out)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processors=final, foreign_pre_chain=shared)
    )
    handler.addFilter(_QuietRepeats())
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    set_log_level(log_level)


def set_log_level(log_level: str) -> None:
    """Change the level at run time (SIGHUP reload); ``debug`` … ``critical``."""
    level = logging.getLevelNamesMapping().get(log_level.upper())
    if level is None:
        raise ValueError(f"unknown log level {log_level!r}")
    logging.getLogger().setLevel(level)
    # urllib3 (the OTLP exporter's HTTP client) is too chatty below WARNING.
    logging.getLogger("urllib3").setLevel(max(level, logging.WARNING))


# -- trace context in messages --------------------------------------------------------


def inject_traceparent(
    headers: MutableMapping[str, str], context: Context | None = None
) -> MutableMapping[str, str]:
    """Write W3C ``traceparent`` (and ``tracestate``/``baggage``) of the current span."""
    propagate.inject(headers, context=context)
    return headers


class _HeaderGetter(Getter[Mapping[str, object]]):
    """Reads AMQP headers, whose values may arrive as bytes."""

    def get(self, carrier: Mapping[str, object], key: str) -> list[str] | None:
        value = carrier.get(key)
        if isinstance(value, bytes | bytearray):
            return [bytes(value).decode("utf-8", "replace")]
        if isinstance(value, str):
            return [value]
        return None

    def keys(self, carrier: Mapping[str, object]) -> list[str]:
        return list(carrier)


def extract_context(headers: Mapping[str, object] | None) -> Context:
    """The trace context carried in message headers (empty when there is none)."""
    return propagate.extract(headers or {}, getter=_HeaderGetter())


# -- exporter selection (OTEL_* variables) -------------------------------------------


def _env_list(name: str, default: str) -> list[str]:
    """``OTEL_*_EXPORTER``: a comma-separated list; ``none`` selects nothing."""
    raw = os.environ.get(name, "").strip() or default
    return [p for part in raw.split(",") if (p := part.strip().lower()) and p != "none"]


def _default_exporter(signal: str) -> str:
    """``otlp`` when an OTLP endpoint is configured for ``signal`` (TRACES or
    METRICS), else ``none``: the SDK exports nothing unless asked, and an OTLP
    exporter with no collector would retry against localhost:4318 and log the
    failures every few seconds. ``OTEL_*_EXPORTER=otlp`` still selects it."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"):
        if os.environ.get(name, "").strip():
            return "otlp"
    return "none"


def _otlp_protocol(signal: str) -> str:
    return (
        os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "").strip()
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip()
        or "http/protobuf"
    ).lower()


def _load_plugin(group: str, name: str) -> object | None:
    """The exporter class an OpenTelemetry package registers under ``name``."""
    from importlib.metadata import entry_points

    for entry_point in entry_points(group=group, name=name):
        loaded: object = entry_point.load()
        return loaded
    _log.warning("otel_exporter_unknown", group=group, name=name)
    return None


def _plugin_name(kind: str, signal: str) -> str:
    """``otlp`` means OTLP over HTTP unless ``OTEL_EXPORTER_OTLP_*PROTOCOL=grpc``."""
    if kind != "otlp":
        return kind
    protocol = _otlp_protocol(signal)
    if protocol == "grpc":
        return "otlp_proto_grpc"
    if protocol != "http/protobuf":
        _log.warning("otel_protocol_unsupported", protocol=protocol, using="http/protobuf")
    return "otlp_proto_http"


def _span_exporters_from_env() -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    for kind in _env_list("OTEL_TRACES_EXPORTER", _default_exporter("TRACES")):
        factory = _load_plugin("opentelemetry_traces_exporter", _plugin_name(kind, "TRACES"))
        made = factory() if callable(factory) else None
        if isinstance(made, SpanExporter):
            exporters.append(made)
    return exporters


def _metric_readers_from_env(
    registry: CollectorRegistry | None, exporters: list[MetricExporter]
) -> list[MetricReader]:
    readers: list[MetricReader] = []
    for kind in _env_list("OTEL_METRICS_EXPORTER", _default_exporter("METRICS")):
        if kind == "prometheus":  # served by health.py, not by a server of its own
            readers.append(_prometheus_reader(registry))
            continue
        factory = _load_plugin("opentelemetry_metrics_exporter", _plugin_name(kind, "METRICS"))
        made = factory() if callable(factory) else None
        if isinstance(made, MetricExporter):
            exporters.append(made)
            readers.append(PeriodicExportingMetricReader(made))
        elif isinstance(made, MetricReader):
            readers.append(made)
    return readers


def _prometheus_reader(registry: CollectorRegistry | None) -> MetricReader:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY

    reader: MetricReader = PrometheusMetricReader(registry=registry or REGISTRY)
    return reader


def _resource(service_name: str, instance: str | None = None) -> Resource:
    """``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` win over the config's
    name and the instance name (``service.instance.id``, which keeps two
    instances' series apart once a collector merges them)."""
    detected = OTELResourceDetector().detect()
    ours: dict[str, AttributeValue] = {"service.version": __version__}
    if "service.name" not in detected.attributes:
        ours["service.name"] = service_name
    if instance and "service.instance.id" not in detected.attributes:
        ours["service.instance.id"] = instance
    return Resource.create(ours)


# -- the Telemetry object ------------------------------------------------------------


_Attributes = Mapping[str, "AttributeValue | None"]


def _attributes(values: _Attributes) -> dict[str, AttributeValue]:
    """Drops unset values and redacts strings, so no secret reaches a span."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in values.items() if v is not None}


_SeriesKey = tuple[tuple[str, str], ...]


def _series_key(attributes: Mapping[str, str]) -> _SeriesKey:
    """A series' attributes as a key, whatever their order."""
    return tuple(sorted(attributes.items()))


SeriesRule = Callable[[str], tuple[str, str]]
"""Which attribute a destination's series are reported under: ``("destination",
NAME)`` (its own series) or, say, ``("group", GROUP)`` (shared with the group's
other destinations). ``Config.series_for`` is the daemon's."""


def per_destination(destination: str) -> tuple[str, str]:
    """The default ``SeriesRule``: every destination has series of its own."""
    return ("destination", destination)


class LatestValues:
    """The last value of every gauge series, read by the observable gauges at
    each collection (from the exporter's or the scrape's thread, hence the lock).

    Values are kept per destination; a collection reports each under its
    destination's ``SeriesRule`` attribute, the destinations that share one
    (a group's) summed, or for the ``maxima`` gauges their maximum. What a
    destination leaves here goes with ``forget``."""

    def __init__(self, rule: SeriesRule = per_destination, *, maxima: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._series: dict[str, dict[_SeriesKey, float]] = {}
        self._rule = rule
        self._maxima = frozenset(maxima)
        self._keys: dict[str, tuple[str, str]] = {}  # destination -> its series attribute
        # destination -> (gauge, series) of its own: forget() touches only these
        self._owned: dict[str, set[tuple[str, _SeriesKey]]] = {}

    def set_rule(self, rule: SeriesRule) -> None:
        """Report every destination, those already recorded too, under ``rule``."""
        with self._lock:
            self._rule = rule
            self._keys = {destination: rule(destination) for destination in self._keys}

    def series_of(self, destination: str) -> tuple[str, str]:
        """``destination``'s series attribute (remembered until it is forgotten)."""
        with self._lock:
            return self._key_locked(destination)

    def _key_locked(self, destination: str) -> tuple[str, str]:
        key = self._keys.get(destination)
        if key is None:
            key = self._keys[destination] = self._rule(destination)
        return key

    def set(self, name: str, value: float, attributes: Mapping[str, str]) -> None:
        destination = attributes.get("destination")
        if destination is not None:
            rest = {k: v for k, v in attributes.items() if k != "destination"}
            self.set_for(destination, [(name, value, rest)])
            return
        key = _series_key(attributes)
        with self._lock:
            self._series.setdefault(name, {})[key] = value

    def set_for(
        self, destination: str, values: Iterable[tuple[str, float, Mapping[str, str]]]
    ) -> None:
        """Gauges of one destination at once (a tick sets several): each
        ``(name, value, attributes besides the destination)``."""
        own = ("destination", destination)
        with self._lock:
            self._key_locked(destination)
            owned = self._owned.setdefault(destination, set())
            for name, value, rest in values:
                key = tuple(sorted((own, *rest.items()))) if rest else (own,)
                owned.add((name, key))
                self._series.setdefault(name, {})[key] = value

    def discard(self, name: str, attributes: Mapping[str, str]) -> None:
        """Drops one series (its value is no longer known)."""
        key = _series_key(attributes)
        with self._lock:
            self._series.get(name, {}).pop(key, None)
            owned = self._owned.get(attributes.get("destination", ""))
            if owned is not None:
                owned.discard((name, key))

    def forget(self, destination: str, *, keep: Sequence[str] = ()) -> None:
        """Drops every series of ``destination`` but those of the ``keep`` gauges
        (its own series only: the cost does not grow with the destinations)."""
        with self._lock:
            owned = self._owned.get(destination, set())
            for name, key in [(n, k) for n, k in owned if n not in keep]:
                self._series.get(name, {}).pop(key, None)
                owned.discard((name, key))
            if not owned:
                self._owned.pop(destination, None)
                self._keys.pop(destination, None)

    def destinations(self) -> int:
        """How many destinations have something remembered here."""
        with self._lock:
            return len(self._keys)

    def observer(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, dict(key)) for key, value in self.collect(name).items()]

        return observe

    def collect(self, name: str) -> dict[_SeriesKey, float]:
        """What a collection of ``name`` reports: attributes -> value."""
        with self._lock:
            series = list(self._series.get(name, {}).items())
            keys = dict(self._keys)
        highest = name in self._maxima
        out: dict[_SeriesKey, float] = {}
        for key, value in series:
            attributes = dict(key)
            destination = attributes.get("destination")
            if destination is not None:
                label, series_name = keys.get(destination) or per_destination(destination)
                del attributes["destination"]
                attributes[label] = series_name
            reported = _series_key(attributes)
            before = out.get(reported)
            if before is None:
                out[reported] = value
            else:
                out[reported] = max(before, value) if highest else before + value
        return out


class Totals:
    """Sums that only grow, kept here per series and reported at each
    collection by an observable counter (from the exporter's or the scrape's
    thread, hence the lock). Every tick of every destination adds to its
    counters: through the SDK's synchronous ``Counter.add`` (attributes
    checked, a measurement built and matched to its views, per call) that
    was a third of a tick's telemetry, here it is one addition."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[_SeriesKey, int] = {}

    def add(self, amount: int, attributes: Mapping[str, str]) -> None:
        key = _series_key(attributes)
        with self._lock:
            self._sums[key] = self._sums.get(key, 0) + amount

    def observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            sums = list(self._sums.items())
        return [Observation(total, dict(key)) for key, total in sums]


class Telemetry:
    """The tracer, the meter and pacerd's instruments; built once by the daemon."""

    def __init__(
        self,
        tracer_provider: TracerProvider,
        meter_provider: MeterProvider,
        *,
        span_exporters: Sequence[SpanExporter] = (),
        metric_exporters: Sequence[MetricExporter] = (),
        metric_readers: Sequence[MetricReader] = (),
        instance: str = "",
        series: SeriesRule = per_destination,
        record_spans: bool = True,
    ) -> None:
        """``span_exporters``/``metric_exporters`` are aborted if shutdown runs late;
        ``instance`` names this process in ``pacerd.build_info``; ``series`` says
        which attribute each destination's series are reported under.
        ``record_spans=False`` (no exporter: nobody would read them) makes
        every span a ``NonRecordingSpan`` that only carries its context."""
        self.tracer_provider = tracer_provider
        self.record_spans = record_spans
        self.meter_provider = meter_provider
        self.span_exporters = tuple(span_exporters)
        self.metric_exporters = tuple(metric_exporters)
        self.metric_readers = tuple(metric_readers)
        self._closed = False
        self.tracer = tracer_provider.get_tracer("pacerd", __version__)
        self.meter = meter = meter_provider.get_meter("pacerd", __version__)
        self.latest = latest = LatestValues(series, maxima=MAXIMUM_GAUGES)

        def gauge(name: str, unit: str, description: str) -> ObservableGauge:
            return meter.create_observable_gauge(name, [latest.observer(name)], unit, description)

        self.rate = gauge(METRIC_RATE, "{job}/s", "Admission rate per destination")
        self.admitted, self.refusals = Totals(), Totals()  # added to by every tick
        # the (paused, paused locally, cooling down) gauges last set, per destination
        self._admission_states: dict[str, tuple[bool, bool, bool]] = {}
        meter.create_observable_counter(
            METRIC_ADMITTED, [self.admitted.observe], "{job}", "Jobs admitted"
        )
        meter.create_observable_counter(
            METRIC_REFUSALS, [self.refusals.observe], "{job}", "Upstream refusals"
        )
        self.inflight = gauge(METRIC_INFLIGHT, "{job}", "Jobs offered, no outcome")
        self.due = gauge(METRIC_DUE, "{job}", "Jobs due and waiting")
        self.oldest_due_age = gauge(METRIC_OLDEST_DUE_AGE, "s", "Oldest due age")
        self.drain_eta = gauge(METRIC_DRAIN_ETA, "s", "Time to drain the due work")
        self.dead = gauge(METRIC_DEAD, "{job}", "Jobs in state dead")
        self.leader = gauge(METRIC_LEADER, "", "1 when this instance leads the destination")
        self.paused = gauge(METRIC_PAUSED, "", "1 when admission is paused (ledger or local)")
        self.cooldown = gauge(METRIC_COOLDOWN, "", "1 during a Retry-After cool-down")
        self.destinations = gauge(
            METRIC_DESTINATIONS, "{destination}", "Destinations of a group this instance knows"
        )
        self.build_info = gauge(METRIC_BUILD_INFO, "", "Always 1; the labels say what runs")
        latest.set(METRIC_BUILD_INFO, 1, {
            "version": __version__, "python_version": platform.python_version(),
            "instance_name": instance,
        })  # fmt: skip
        self.outcomes = meter.create_counter(
            METRIC_OUTCOMES, "{report}", "Outcome reports handled, by result"
        )
        self.publish_confirm = meter.create_histogram(
            METRIC_PUBLISH_CONFIRM, "s", "From a release slice's publish to its last confirm",
            explicit_bucket_boundaries_advisory=_CONFIRM_BUCKETS_SECONDS,
        )  # fmt: skip
        self.publish_failures = meter.create_counter(
            METRIC_PUBLISH_FAILURES, "{message}", "Publishes nacked, returned or timed out"
        )
        self.leases_reclaimed = meter.create_counter(
            METRIC_LEASES_RECLAIMED, "{lease}", "Expired claims and offers returned"
        )
        self.outcomes_applied = meter.create_counter(
            METRIC_OUTCOMES_APPLIED, "{report}", "Outcome reports handled"
        )
        self.outcomes_invalid = meter.create_counter(
            METRIC_OUTCOMES_INVALID, "{message}", "Malformed outcome messages parked"
        )
        # what the ledger and the lock session sent, by statement name
        self._statement_counts_by: list[Mapping[str, int]] = []
        self.ledger_statements = meter.create_observable_counter(
            METRIC_LEDGER_STATEMENTS, [self._statement_counts], "{statement}",
            "Named SQL statements sent to the ledger, by name",
        )  # fmt: skip
        self.tick_duration = meter.create_histogram(
            METRIC_TICK_DURATION,
            "s",
            "One tick of one destination until its first release may go: read, plan, first claim",
            explicit_bucket_boundaries_advisory=_TICK_BUCKETS_SECONDS,
        )
        self.round_trip = meter.create_histogram(
            METRIC_ROUND_TRIP,
            "s",
            "The first job of a release slice published here, from its publish confirmed to"
            " its outcome applied",
            explicit_bucket_boundaries_advisory=_ROUND_TRIP_BUCKETS_SECONDS,
        )

    def count_statements(self, *counts: Mapping[str, int]) -> None:
        """Reports ``counts`` (statements sent so far, by name; each a
        ``Counter`` that only grows) on ``pacerd.ledger.statements``, summed
        under each name."""
        self._statement_counts_by.extend(counts)

    def _statement_counts(self, options: CallbackOptions) -> Iterable[Observation]:
        totals: Counter[str] = Counter()
        for counts in self._statement_counts_by:
            totals.update(dict(counts))  # a copy taken at once: the loop may add a name
        return [Observation(n, {"statement": name}) for name, n in sorted(totals.items())]

    # spans

    def span(
        self,
        name: str,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: _Attributes | None = None,
        context: Context | None = None,
    ) -> AbstractContextManager[Span]:
        """A current span; an exception ends it with status ERROR, message redacted.
        Without ``record_spans``, a span that is not recorded (see ``_context_only``)."""
        if not self.record_spans:
            return trace.use_span(
                self._context_only(name, kind, context), end_on_exit=False,
                record_exception=False, set_status_on_exception=False,
            )  # fmt: skip
        return self._recorded_span(name, kind=kind, attributes=attributes, context=context)

    def _context_only(self, name: str, kind: SpanKind, context: Context | None) -> Span:
        """What the SDK would start, without the recording: the same trace id
        (the parent's, or a new one), a new span id and the sampler's
        decision, so that the trace context goes on to the logs and to the
        workers as before. A recorded span that no processor exports cost
        about a tenth of the daemon's CPU with a thousand destinations active."""
        provider = self.tracer_provider
        parent = trace.get_current_span(context).get_span_context()
        ids = provider.id_generator
        trace_id = parent.trace_id if parent.is_valid else ids.generate_trace_id()
        sampled = provider.sampler.should_sample(context, trace_id, name, kind)
        sample = sampled.decision is Decision.RECORD_AND_SAMPLE
        flags = TraceFlags.SAMPLED if sample else TraceFlags.DEFAULT
        return NonRecordingSpan(
            SpanContext(
                trace_id, ids.generate_span_id(), is_remote=False,
                trace_flags=TraceFlags(flags), trace_state=sampled.trace_state,
            )
        )  # fmt: skip

    @contextmanager
    def _recorded_span(
        self,
        name: str,
        *,
        kind: SpanKind,
        attributes: _Attributes | None,
        context: Context | None,
    ) -> Iterator[Span]:
        with self.tracer.start_as_current_span(
            name,
            context=context,
            kind=kind,
            attributes=_attributes(attributes or {}),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except Exception as exc:
                message = redact(str(exc))
                span.add_event(
                    "exception",
                    {"exception.type": type(exc).__qualname__, "exception.message": message},
                )
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {message}"))
                raise

    def tick_span(self, destination: str, *, shadow: bool = False) -> AbstractContextManager[Span]:
        attrs: _Attributes = {"pacerd.destination": destination, "pacerd.shadow": shadow}
        return self.span(SPAN_TICK, attributes=attrs)

    def claim_span(self, destination: str, *, limit: int) -> AbstractContextManager[Span]:
        attrs: _Attributes = {
            "db.system.name": "postgresql",
            "db.operation.name": "claim_due",
            "pacerd.destination": destination,
            "pacerd.limit": limit,
        }
        return self.span(SPAN_CLAIM, kind=SpanKind.CLIENT, attributes=attrs)

    def publish_span(
        self, destination: str, *, messages: Sequence[str], exchange: str = READY_EXCHANGE
    ) -> AbstractContextManager[Span]:
        """Around the publish of one release slice (``messages``: the slice's
        ``job_id:attempt`` message ids); call ``inject_traceparent`` inside it
        for the headers every message of the slice carries."""
        if not self.record_spans:  # the context alone: nothing reads the attributes
            return self.span(SPAN_PUBLISH, kind=SpanKind.PRODUCER)
        attrs: dict[str, AttributeValue | None] = {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": exchange,
            "messaging.rabbitmq.destination.routing_key": destination,
            "pacerd.destination": destination,
        }
        if len(messages) == 1:
            message_id = messages[0]
            job_id, _, attempt = message_id.rpartition(":")
            attrs["messaging.message.id"] = message_id
            attrs["messaging.message.conversation_id"] = job_id
            attrs["pacerd.job_id"] = job_id
            attrs["pacerd.attempt"] = int(attempt) if attempt.isdigit() else attempt
        else:
            attrs["messaging.batch.message_count"] = len(messages)
        return self.span(SPAN_PUBLISH, kind=SpanKind.PRODUCER, attributes=attrs)

    def mark_offered_span(self, destination: str, *, count: int) -> AbstractContextManager[Span]:
        attrs: _Attributes = {
            "db.system.name": "postgresql",
            "db.operation.name": "mark_offered",
            "pacerd.destination": destination,
            "pacerd.count": count,
        }
        return self.span(SPAN_MARK_OFFERED, kind=SpanKind.CLIENT, attributes=attrs)

    def reconcile_span(self) -> AbstractContextManager[Span]:
        return self.span(SPAN_RECONCILE)

    def outcome_span(
        self,
        headers: Mapping[str, object] | None,
        *,
        job_id: str | None = None,
        attempt: int | None = None,
        outcome: str | None = None,
    ) -> AbstractContextManager[Span]:
        """Handling one outcome message; a child of the worker's span when it sent one."""
        attrs: _Attributes = {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "process",
            "messaging.destination.name": OUTCOMES_QUEUE,
            "pacerd.job_id": job_id,
            "pacerd.attempt": attempt,
            "pacerd.outcome": outcome,
        }
        return self.span(
            SPAN_OUTCOME, kind=SpanKind.CONSUMER, attributes=attrs,
            context=extract_context(headers),
        )  # fmt: skip

    # metrics (and the attributes of the current span)

    def record_tick(
        self,
        destination: str,
        *,
        rate: float,
        budget: int,
        admitted: int,
        inflight: int,
        due: int,
        oldest_due_age_seconds: float | None,
        drain_eta_seconds: float | None,
        refused: int,
        duration_seconds: float | None = None,
        shadow: bool = False,
        span: Span | None = None,
    ) -> None:
        """One tick's numbers: gauges, counters, and attributes on the tick span.

        Call it inside ``tick_span`` (or pass ``span``). In shadow mode
        ``admitted`` is what the tick would have admitted.
        """
        latest, none = self.latest, dict[str, str]()
        gauges: list[tuple[str, float, Mapping[str, str]]] = [
            (METRIC_RATE, rate, none),
            (METRIC_INFLIGHT, inflight, none),
            (METRIC_DUE, due, none),
            (METRIC_OLDEST_DUE_AGE, oldest_due_age_seconds or 0.0, none),
        ]
        if drain_eta_seconds is not None:
            gauges.append((METRIC_DRAIN_ETA, drain_eta_seconds, none))
        else:  # unknown now (nothing due, or no rate): not reported
            latest.discard(METRIC_DRAIN_ETA, {"destination": destination})
        latest.set_for(destination, gauges)
        series = self.series_attributes(destination)
        if admitted:
            mode = "shadow" if shadow else "active"
            self.admitted.add(admitted, {**series, "mode": mode})
        if refused:
            self.refusals.add(refused, series)
        if duration_seconds is not None:
            self.tick_duration.record(duration_seconds, series)
        target = span if span is not None else trace.get_current_span()
        if not target.is_recording():
            return
        target.set_attributes(
            _attributes({
                "pacerd.rate": rate,
                "pacerd.budget": budget,
                "pacerd.admitted": admitted,
                "pacerd.refused": refused,
                "pacerd.inflight": inflight,
                "pacerd.due": due,
                "pacerd.oldest_due_age_seconds": oldest_due_age_seconds,
                "pacerd.drain_eta_seconds": drain_eta_seconds,
            })
        )  # fmt: skip

    def record_reconcile(
        self, *, claims_released: int, offers_rescheduled: int, offers_dead: int,
        span: Span | None = None,
    ) -> None:  # fmt: skip
        """One reconcile pass: expired claims returned, expired offers rescheduled or dead."""
        for lease, result, count in (
            ("claim", "released", claims_released),
            ("offer", "rescheduled", offers_rescheduled),
            ("offer", "dead", offers_dead),
        ):
            if count:
                self.leases_reclaimed.add(count, {"lease": lease, "result": result})
        target = span if span is not None else trace.get_current_span()
        target.set_attributes({
            "pacerd.claims_released": claims_released,
            "pacerd.offers_rescheduled": offers_rescheduled,
            "pacerd.offers_dead": offers_dead,
        })  # fmt: skip

    def record_outcome(self, outcome: str, result: str, *, span: Span | None = None) -> None:
        """A report handled: ``outcome`` (ok|refused|…), ``result`` (applied|stale|unknown)."""
        self.count_outcomes(outcome, result, 1)
        target = span if span is not None else trace.get_current_span()
        target.set_attributes({"pacerd.outcome": outcome, "pacerd.result": result})

    def count_outcomes(self, outcome: str, result: str, count: int) -> None:
        """``count`` reports of one outcome and result (a batch, without spans)."""
        attributes = {"outcome": outcome, "result": result}
        self.outcomes.add(count, attributes)
        self.outcomes_applied.add(count, attributes)

    def record_dead(self, destination: str, dead: int) -> None:
        """Jobs of ``destination`` in state ``dead`` (the ledger's count)."""
        self.latest.set(METRIC_DEAD, dead, {"destination": destination})

    def record_leadership(self, leading: Mapping[str, bool]) -> None:
        """For every destination this instance knows: does it lead it. A group's
        series count the destinations it leads, and ``pacerd.destinations`` how
        many the group has."""
        latest = self.latest
        for destination, leads in leading.items():
            where = {"destination": destination}
            latest.set(METRIC_LEADER, int(leads), where)
            if latest.series_of(destination)[0] != "destination":
                latest.set(METRIC_DESTINATIONS, 1, where)
            else:
                latest.discard(METRIC_DESTINATIONS, where)

    def record_admission_state(
        self, destination: str, *, paused: bool, paused_locally: bool, cooldown: bool
    ) -> None:
        """Why the last tick admitted nothing, if it was paused or cooling
        down. Every tick says it; the gauges are set only when it changed."""
        closed = (paused, paused_locally, cooldown)
        if self._admission_states.get(destination) == closed:
            return
        self._admission_states[destination] = closed
        self.latest.set_for(destination, [
            (METRIC_PAUSED, int(paused), {"scope": "ledger"}),
            (METRIC_PAUSED, int(paused_locally), {"scope": "local"}),
            (METRIC_COOLDOWN, int(cooldown), {}),
        ])  # fmt: skip

    def record_publish(
        self, destination: str, *, confirm_seconds: float | None = None,
        nacked: int = 0, returned: int = 0, timeouts: int = 0,
    ) -> None:  # fmt: skip
        """A release slice's time to its last confirm, and the publishes that failed."""
        if confirm_seconds is None and not (nacked or returned or timeouts):
            return  # a tick whose publishes all went through
        where = self.series_attributes(destination)
        if confirm_seconds is not None:
            self.publish_confirm.record(confirm_seconds, where)
        for reason, count in (("nacked", nacked), ("returned", returned), ("timeout", timeouts)):
            if count:
                self.publish_failures.add(count, {**where, "reason": reason})

    def record_round_trip(self, destination: str, seconds: float) -> None:
        """A job released here: from its publish confirmed to its outcome applied."""
        self.round_trip.record(seconds, self.series_attributes(destination))

    def forget_destination(self, destination: str, *, everything: bool = False) -> None:
        """This instance no longer leads ``destination``: its per-tick gauges
        stop (the ledger's counts and the leader gauges stay). ``everything``:
        the destination is gone or idle, and nothing of it is kept."""
        keep = () if everything else (METRIC_DEAD, METRIC_LEADER, METRIC_DESTINATIONS)
        self.latest.forget(destination, keep=keep)
        self._admission_states.pop(destination, None)  # its closed gauges went: set them again

    def set_series(self, rule: SeriesRule) -> None:
        """Report each destination's series under ``rule(destination)`` from the
        next collection on: ``("destination", NAME)`` for series of its own,
        ``("group", GROUP)`` for its group's (``Config.series_for``)."""
        self.latest.set_rule(rule)

    def series_attributes(self, destination: str) -> dict[str, str]:
        """The attribute ``destination``'s counters and histograms are recorded
        under: ``{"destination": NAME}`` or ``{"group": GROUP}``."""
        label, name = self.latest.series_of(destination)
        return {label: name}

    def record_invalid_outcome(self, reason: str) -> None:
        """A malformed outcome message was parked in ``pacerd.outcomes.invalid``."""
        self.outcomes_invalid.add(1, {"reason": reason})

    # lifecycle

    def shutdown(self, timeout_seconds: float = 2.0) -> None:
        """Flush and stop the providers, waiting at most about ``timeout_seconds``.

        Blocking: from async code use ``aclose``. With no collector listening the
        OTLP exporter would retry for its whole timeout; past ours it is aborted.
        """
        if self._closed:
            return
        self._closed = True
        worker = threading.Thread(
            target=self._shutdown_providers, args=(timeout_seconds,),
            name="pacerd-telemetry-shutdown", daemon=True,
        )  # fmt: skip
        worker.start()
        worker.join(timeout_seconds)
        if worker.is_alive():
            _log.warning("telemetry_shutdown_timed_out", timeout_seconds=timeout_seconds)
            exporters: list[SpanExporter | MetricExporter] = [
                *self.span_exporters, *self.metric_exporters,
            ]  # fmt: skip
            otel_logger = logging.getLogger("opentelemetry")
            level = otel_logger.level
            otel_logger.setLevel(logging.ERROR)  # aborting makes the SDK warn; we know
            try:
                for exporter in exporters:
                    try:
                        exporter.shutdown()  # aborts the exporter's retries
                    except Exception as exc:  # shutting down: nothing left to do about it
                        _log.debug("telemetry_exporter_shutdown_failed", error=repr(exc))
                worker.join(1.0)
            finally:
                otel_logger.setLevel(level)

    async def aclose(self, timeout_seconds: float = 2.0) -> None:
        """``shutdown`` in a worker thread, so the event loop keeps running."""
        await anyio.to_thread.run_sync(self.shutdown, timeout_seconds)

    def _shutdown_providers(self, timeout_seconds: float) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=timeout_seconds * 1000)


def setup_telemetry(
    service_name: str = "pacerd",
    log_level: str = "info",
    log_format: str = "auto",
    *,
    prometheus: bool = False,
    prometheus_registry: CollectorRegistry | None = None,
    metric_readers: Sequence[MetricReader] | None = None,
    span_exporter: SpanExporter | None = None,
    log_stream: TextIO | None = None,
    set_global: bool = False,
    instance: str | None = None,
    series: SeriesRule = per_destination,
) -> Telemetry:
    """Configure logging, traces and metrics; return the ``Telemetry`` to hand around.

    Exporters follow ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``
    (``otlp`` over HTTP, ``console``, ``none``, ``prometheus`` for metrics);
    unset, a signal goes over OTLP only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    the signal's own endpoint variable is set, and nowhere otherwise. The
    sampler ``OTEL_TRACES_SAMPLER``, endpoints and the rest of ``OTEL_*`` are
    read by the SDK itself. ``span_exporter`` (exported at once,
    for tests) or ``metric_readers`` replace the environment's choice.
    ``prometheus`` adds a reader feeding ``prometheus_registry`` (default: the
    global registry that ``/metrics`` serves). ``set_global`` also installs the
    providers as OpenTelemetry's globals (once per process). ``instance`` (the
    instance name) goes on every log line, the resource and ``pacerd.build_info``.
    ``series`` (``Config.series_for``) says which attribute each destination's
    metric series are reported under: its own, or its group's.
    """
    bind_log_context(**({"instance": instance} if instance else {}))
    configure_logging(log_level, log_format, stream=log_stream)
    resource = _resource(service_name, instance)
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    span_exporters = [span_exporter] if span_exporter is not None else _span_exporters_from_env()
    for exporter in span_exporters:
        tracer_provider.add_span_processor(
            SimpleSpanProcessor(exporter) if span_exporter is not None
            else BatchSpanProcessor(exporter)
        )  # fmt: skip
    metric_exporters: list[MetricExporter] = []
    readers = (
        list(metric_readers) if metric_readers is not None
        else _metric_readers_from_env(prometheus_registry, metric_exporters)
    )  # fmt: skip
    if prometheus and not any(type(r).__name__ == "PrometheusMetricReader" for r in readers):
        readers.append(_prometheus_reader(prometheus_registry))
    meter_provider = MeterProvider(
        metric_readers=readers, resource=resource, shutdown_on_exit=False
    )
    if set_global:
        trace.set_tracer_provider(tracer_provider)
        from opentelemetry import metrics

        metrics.set_meter_provider(meter_provider)
    _log.debug(
        "telemetry_configured",
        span_exporters=[type(e).__name__ for e in span_exporters],
        metric_readers=[type(r).__name__ for r in readers],
    )
    return Telemetry(
        tracer_provider, meter_provider, span_exporters=span_exporters,
        metric_exporters=metric_exporters, metric_readers=readers, instance=instance or "",
        series=series, record_spans=bool(span_exporters),
    )  # fmt: skip
