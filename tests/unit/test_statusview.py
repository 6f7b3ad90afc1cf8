"""What the CLI prints for a person: user data is shown as stored, never read as markup."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from pacerd import statusview
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
