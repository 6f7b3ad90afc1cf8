"""Telemetry as the tests see it: a value recorded for every metric pacerd
has, and the histograms an in-memory reader collected."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry.sdk.metrics.export import HistogramDataPoint

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from pacerd.telemetry import Telemetry

GROUPED = "tenant-1"  # a destination of group GROUP under ``grouped_series``
GROUP = "tenants"


def grouped_series(destination: str) -> tuple[str, str]:
    """A series rule: ``GROUPED`` reports under ``group=GROUP``, the rest as themselves."""
    return ("group", GROUP) if destination == GROUPED else ("destination", destination)


def exercise_every_metric(tel: Telemetry, destination: str = "mail") -> None:
    """Records a value for every metric pacerd has (so each shows up on a scrape),
    for ``destination`` and for ``GROUPED``, whose series are its group's when
    the telemetry's series rule is ``grouped_series``."""
    tel.record_reconcile(claims_released=1, offers_rescheduled=1, offers_dead=1)
    tel.count_statements({"claim_due": 2})
    tel.record_outcome("refused", "stale")
    tel.record_invalid_outcome("not_json")
    for name in (destination, GROUPED):
        tel.record_tick(
            name, rate=2.5, budget=3, admitted=2, inflight=4, due=10,
            oldest_due_age_seconds=12.0, drain_eta_seconds=4.0, refused=1, duration_seconds=0.02,
        )  # fmt: skip
        tel.record_dead(name, 3)
        tel.record_leadership({name: True})
        tel.record_admission_state(name, paused=True, paused_locally=False, cooldown=True)
        tel.record_publish(name, confirm_seconds=0.01, nacked=1, returned=1, timeouts=1)
        tel.record_round_trip(name, 0.3)


def histogram_points(reader: InMemoryMetricReader, name: str) -> list[HistogramDataPoint]:
    """The data points of the histogram ``name`` (one per series) ``reader`` collects now."""
    data = reader.get_metrics_data()
    assert data is not None
    points = [
        p for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics
        if m.name == name for p in m.data.data_points
    ]  # fmt: skip
    assert all(isinstance(p, HistogramDataPoint) for p in points), name
    return [p for p in points if isinstance(p, HistogramDataPoint)]
