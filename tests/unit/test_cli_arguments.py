"""Arguments the command line refuses before it touches the ledger: a count
under 1, seconds that are not a finite number, a refresh interval of 0."""

from __future__ import annotations

import pytest

from pacerd import cli
from pacerd_demo import runner


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["dead", "--limit", "-1"], "argument --limit: must be at least 1, not -1"),
        (["dead", "--limit", "ten"], "argument --limit: expected a whole number, got 'ten'"),
        (
            ["replay", "--reason", "r", "--destination", "d", "--dry-run", "--limit", "-5"],
            "argument --limit: must be at least 1, not -5",
        ),
        (
            ["schedule", "j", "--kind", "k", "--destination", "d", "--delay", "nan"],
            "argument --delay: expected a finite number of seconds, got 'nan'",
        ),
        (
            ["schedule", "j", "--kind", "k", "--destination", "d", "--delay", "inf"],
            "argument --delay: expected a finite number of seconds, got 'inf'",
        ),
        (["status", "--watch", "--interval", "0"], "argument --interval: must be more than 0"),
        (["status", "--watch", "--interval", "-1"], "argument --interval: must be more than 0"),
    ],
)
def test_a_bad_number_is_a_usage_error_that_names_its_argument(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_good_numbers_pass_and_a_delay_may_lie_in_the_past() -> None:
    args = cli.build_parser().parse_args(
        ["schedule", "j", "--kind", "k", "--destination", "d", "--delay", "-30"]
    )
    assert args.delay == -30.0
    assert cli.build_parser().parse_args(["dead", "--limit", "1"]).limit == 1
    assert cli.build_parser().parse_args(["status", "--interval", "0.5"]).interval == 0.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "argument --workers: must be at least 1, not 0"),
        (["--jobs", "-3"], "argument --jobs: must be at least 1, not -3"),
        (["--duration", "0"], "argument --duration: must be more than 0 seconds"),
    ],
)
def test_the_demo_refuses_a_run_it_cannot_make(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        runner.build_parser().parse_args(argv)
    assert message in capsys.readouterr().err
