"""What the CLI prints for a person: user data is shown as stored, never read as markup."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from pacerd import overview, statusview
from pacerd.client import DestinationStatus
from pacerd.models import JobEvent, JobState, JobView

if TYPE_CHECKING:
    import pytest

AT = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
TRICKY = "[/x] closing tag, [red]colour[/red], [bold]b, :thumbs_up: and \\[escaped]"


def dead_job(job_id: str = "job-[red]1", error: str = TRICKY) -> JobView:
    return JobView(
        job_id=job_id, kind="[b]render", destination="pdf-api", state=JobState.DEAD,
        attempt=3, failures=3, max_attempts=3, next_attempt_at=AT, revision=0,
        payload={}, cursor=None, last_error=error, lease_expires_at=None,
        created_at=AT, updated_at=AT,
    )  # fmt: skip


def test_dead_prints_job_ids_and_errors_verbatim(capsys: pytest.CaptureFixture[str]) -> None:
    statusview.print_dead([dead_job()])
    out = capsys.readouterr().out
    assert "job-[red]1" in out
    assert "[b]render" in out
    assert TRICKY in out


def test_show_prints_job_error_and_history_verbatim(capsys: pytest.CaptureFixture[str]) -> None:
    events = [
        JobEvent(id=1, job_id="job-[red]1", attempt=3, event="dead", at=AT,
                 detail={"error": "[/x]"}),
    ]  # fmt: skip
    statusview.print_job(dead_job(), events)
    out = capsys.readouterr().out
    assert out.startswith("job-[red]1  [b]render → pdf-api  dead")
    assert f"last error: {TRICKY}" in out
    assert "{'error': '[/x]'}" in out


def test_status_hint_keeps_its_brackets(capsys: pytest.CaptureFixture[str]) -> None:
    statusview.print_status([])
    assert "configure [destinations.NAME]" in capsys.readouterr().out


def test_status_table_prints_names_verbatim(capsys: pytest.CaptureFixture[str]) -> None:
    row = DestinationStatus(
        destination="a[/x]", paused=False, paused_all=False, cooldown_remaining_seconds=0.0,
        rate=None, budget=None, inflight=0, due=0, oldest_due_age_seconds=None,
        refusal_ratio=None, drain_eta_seconds=None, dead=0, leader="host:[red]1", leader_since=None,
        n_accepted=0, n_refused=0,
    )  # fmt: skip
    statusview.print_status([row])
    out = capsys.readouterr().out
    assert "a[/x]" in out
    assert "host:[red]1" in out


# -- many destinations: selection, ranking, totals per group ----------------------------


def status(
    name: str,
    *,
    due: int = 0,
    age: float | None = None,
    ratio: float | None = None,
    rate: float | None = None,
    inflight: int = 0,
    dead: int = 0,
    paused: bool = False,
    cooldown: float = 0.0,
    accepted: int = 0,
    refused: int = 0,
) -> DestinationStatus:
    return DestinationStatus(
        destination=name, paused=paused, paused_all=False, cooldown_remaining_seconds=cooldown,
        rate=rate, budget=None, inflight=inflight, due=due, oldest_due_age_seconds=age,
        refusal_ratio=ratio, drain_eta_seconds=None, dead=dead, leader=None, leader_since=None,
        n_accepted=accepted, n_refused=refused,
    )  # fmt: skip


def group_of(destination: str) -> str | None:
    for prefix, group in (("tenant-", "tenants"), ("eu-", "eu")):
        if destination.startswith(prefix):
            return group
    return None


ORDER = ["tenants", "eu"]


def names(rows: list[DestinationStatus]) -> list[str]:
    return [r.destination for r in rows]


def test_rank_by_oldest_due_age_then_refusal_ratio_then_name() -> None:
    rows = [
        status("a", age=None, ratio=0.9), status("b", age=10.0, ratio=0.1),
        status("c", age=10.0, ratio=0.5), status("d", age=300.0), status("e", age=10.0, ratio=0.5),
        status("f"),
    ]  # fmt: skip
    assert names(overview.ranked(rows)) == ["d", "c", "e", "b", "a", "f"]
    # --watch ranks by the ratios it measured between refreshes
    assert names(overview.ranked(rows, {"b": 0.9})) == ["d", "b", "c", "e", "a", "f"]


def test_selection_by_group_ungrouped_and_glob() -> None:
    rows = [status("tenant-1"), status("tenant-2"), status("eu-1"), status("smtp")]
    by = overview.Selection
    assert names(overview.overview(rows, group_of, by(group="tenants")).destinations) == [
        "tenant-1", "tenant-2",
    ]  # fmt: skip
    assert names(overview.overview(rows, group_of, by(group="-")).destinations) == ["smtp"]
    assert names(overview.overview(rows, group_of, by(destination="*-1")).destinations) == [
        "tenant-1", "eu-1",
    ]  # fmt: skip
    both = by(group="tenants", destination="*-2")
    assert names(overview.overview(rows, group_of, both).destinations) == ["tenant-2"]
    assert overview.overview(rows, group_of, by(destination="Tenant-*")).selected == 0


def test_top_n_are_ranked_and_the_rest_counted() -> None:
    rows = [status(f"tenant-{n}", age=float(n)) for n in range(10)]
    view = overview.overview(rows, group_of, overview.Selection(top=3))
    assert names(view.destinations) == ["tenant-9", "tenant-8", "tenant-7"]
    assert (view.selected, view.left_out) == (10, 7)
    assert view.groups[0].destinations == 10  # totals are over every selected destination


def test_more_than_the_default_without_a_filter_shows_the_top_50() -> None:
    rows = [status(f"t{n:03}", age=float(n % 7)) for n in range(120)]
    view = overview.overview(rows, group_of)
    assert len(view.destinations) == overview.DEFAULT_LIMIT
    assert view.left_out == 70
    assert {r.oldest_due_age_seconds for r in view.destinations} >= {6.0, 5.0}
    assert all(r.oldest_due_age_seconds != 0.0 for r in view.destinations)
    # a filter (or no limit, for JSON) lists everything selected, by name
    assert overview.overview(rows, group_of, overview.Selection(destination="t*")).left_out == 0
    unlimited = overview.overview(rows, group_of, limit=None)
    assert names(unlimited.destinations) == [f"t{n:03}" for n in range(120)]
    small = [status("b"), status("a", age=5.0)]
    assert names(overview.overview(small, group_of).destinations) == ["b", "a"]  # as stored


def test_group_totals() -> None:
    rows = [
        status("tenant-1", due=10, age=30.0, rate=2.0, inflight=1, dead=1, paused=True,
               accepted=90, refused=10),
        status("tenant-2", due=5, age=600.0, rate=3.5, inflight=4, cooldown=12.0,
               accepted=10, refused=40),
        status("tenant-3"),
        status("smtp", due=1, age=2.0, rate=None, accepted=5),
        status("eu-1", due=2),
    ]  # fmt: skip
    groups = overview.totals(rows, group_of, order=ORDER)
    assert [g.group for g in groups] == ["tenants", "eu", None]  # config order, ungrouped last
    tenants = groups[0]
    assert tenants == overview.GroupTotals(
        group="tenants", destinations=3, paused=1, cooldown=1, rate=5.5, inflight=5, due=15,
        oldest_due_age_seconds=600.0, dead=1, accepted=100, refused=50,
    )  # fmt: skip
    assert tenants.refusal_ratio == 50 / 150  # over the group's outcomes, not a mean of ratios
    assert groups[2].refusal_ratio == 0.0
    assert groups[1].refusal_ratio is None  # no outcome yet
    assert groups[1].oldest_due_age_seconds is None
    windowed = overview.totals(rows, group_of, order=ORDER, counts={"tenant-1": (1, 3)})
    assert (windowed[0].accepted, windowed[0].refused) == (1, 3)


def test_a_bad_selection_is_explained() -> None:
    by = overview.Selection
    assert by(top=0).problem(ORDER) == "--top must be at least 1, not 0"
    assert by(top=-2).problem(ORDER) == "--top must be at least 1, not -2"
    assert by(group="nope").problem(ORDER) == (
        "no group 'nope' in the configuration (groups: tenants, eu;"
        " --group - selects the destinations in no group)"
    )
    assert "none is configured" in str(by(group="x").problem([]))
    assert by(destination=" ").problem(ORDER) == "--destination must not be empty"
    assert by(group="-", top=1, destination="t*").problem(ORDER) is None
    assert by(group="-").problem([]) is None


def test_status_shows_group_totals_above_the_top_50(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [status(f"tenant-{n:03}", age=float(n)) for n in range(60)] + [status("smtp")]
    statusview.print_status(rows, group_of, order=ORDER)
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(n for n, line in enumerate(lines) if "destinations" in line and "group" in line)
    assert any(line.split("│")[1].strip() == "tenants" for line in lines[header:] if "│" in line)
    assert out.index("tenants") < out.index("tenant-059")  # totals above the table
    assert "tenant-010" in out  # the 50 oldest
    assert "tenant-009" not in out
    assert "smtp" not in out.split("tenant-059")[1]  # no due work: ranked last, left out
    assert "11 more destination(s) not shown" in out


def test_status_without_groups_looks_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    statusview.print_status([status("smtp"), status("sms")])
    out = capsys.readouterr().out
    assert "smtp" in out
    assert "sms" in out
    assert "cool-down" not in out.splitlines()[1]  # no group totals: only the one table
    assert "not shown" not in out


def test_status_when_nothing_matches(capsys: pytest.CaptureFixture[str]) -> None:
    selection = overview.Selection(destination="nope-*")
    statusview.print_status([status("smtp")], group_of, selection=selection, totals=True)
    assert "no destination matches" in capsys.readouterr().out


def test_json_with_totals() -> None:
    rows = [status("tenant-1", due=3, age=9.0, accepted=1, refused=1), status("smtp")]
    view = overview.overview(rows, group_of, overview.Selection(top=1), order=ORDER)
    doc = statusview.overview_dict(view, group_of)
    assert [g["group"] for g in doc["groups"]] == ["tenants", None]
    assert doc["groups"][0]["refusal_ratio"] == 0.5
    assert [d["destination"] for d in doc["destinations"]] == ["tenant-1"]
    assert doc["destinations"][0]["group"] == "tenants"
    assert (doc["selected"], doc["left_out"]) == (2, 1)
    assert statusview.status_dict(rows[1])["group"] is None


def test_watch_measures_ratios_between_refreshes_and_forgets_what_left() -> None:
    state = statusview.WatchState()
    selection = overview.Selection(group="tenants")
    first = [status("tenant-1", accepted=10, refused=0), status("tenant-2", accepted=5),
             status("smtp", accepted=1)]  # fmt: skip
    view = state.view(first, group_of, selection, ORDER)
    assert view.groups[0].refusal_ratio is None  # nothing measured yet
    assert set(state.previous) == {"tenant-1", "tenant-2"}  # only what is selected
    second = [status("tenant-1", accepted=13, refused=1), status("smtp", accepted=9)]
    view = state.view(second, group_of, selection, ORDER)
    assert state.ratios == {"tenant-1": 0.25}
    assert view.groups[0].refusal_ratio == 0.25
    assert set(state.rates) == {"tenant-1"}  # tenant-2 is gone: forgotten
