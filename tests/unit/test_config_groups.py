"""``[groups.NAME]``: matching, pacing layers, routes, and the problems reported."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import structlog

from pacerd.config import Config, ReadyRoute, load_config, reload_diff
from pacerd.daemon import Daemon
from pacerd.errors import ConfigError
from pacerd.pacer import PacingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "config.example.toml"

GROUPS = """
[pacing]
max_rate = 100.0

[groups.tenants]
match = "tenant-*"
max_rate = 20.0
initial_rate = 2.0

[groups.t-all]
match = "t*"
queue = "shared.t"

[destinations.tenant-vip]
max_rate = 50.0

[destinations.smtp]
queue = "mail"
"""


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> Config:
    path = tmp_path / "pacerd.toml"
    path.write_text(text)
    return load_config(path, environ or {})


def problems(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, environ)
    return caught.value.problems


def test_a_grouped_destination_routes_to_the_group_queue(tmp_path: Path) -> None:
    config = load(tmp_path, GROUPS)
    shared = ReadyRoute(queue="pacerd.ready.tenants", routing_key="tenants", group="tenants")
    assert config.route_for("tenant-a") == shared
    assert config.route_for("tenant-vip") == shared  # configured, still grouped
    assert config.route_for("tenant-") == shared
    assert config.queue_for("tenant-b") == "pacerd.ready.tenants"
    assert config.route_for_group("tenants") == shared
    assert config.route_for_group("t-all") == ReadyRoute(
        queue="shared.t", routing_key="t-all", group="t-all"
    )


def test_an_ungrouped_destination_keeps_its_own_queue(tmp_path: Path) -> None:
    config = load(tmp_path, GROUPS)
    assert config.route_for("smtp") == ReadyRoute(queue="mail", routing_key="smtp")
    assert config.route_for("pdf") == ReadyRoute(queue="pacerd.ready.pdf", routing_key="pdf")
    assert config.group_for("Tenant-a") is None  # the glob is case-sensitive
    assert config.route_for("Tenant-a").routing_key == "Tenant-a"


def test_the_first_group_in_file_order_wins(tmp_path: Path) -> None:
    config = load(tmp_path, GROUPS)
    assert config.group_for("tenant-a") == "tenants"  # fits both globs
    assert config.group_for("tx") == "t-all"
    text = '[groups.early]\nmatch = "t*"\n[groups.late]\nmatch = "tenant-*"\nmax_rate = 70.0\n'
    config = load(tmp_path, text)
    assert list(config.groups) == ["early", "late"]
    assert config.group_for("tenant-a") == "early"
    assert config.route_for("tenant-a").queue == "pacerd.ready.early"
    assert config.pacing_for("tenant-a") == PacingParams()  # none of late's keys


def test_pacing_layers_pacing_then_group_then_destination(tmp_path: Path) -> None:
    config = load(tmp_path, GROUPS)
    assert config.pacing_for("tenant-a") == PacingParams(max_rate=20.0, initial_rate=2.0)
    assert config.pacing_for("tenant-vip") == PacingParams(max_rate=50.0, initial_rate=2.0)
    assert config.pacing_for("tx") == PacingParams(max_rate=100.0)  # a group of no keys
    assert config.pacing_for("smtp") == PacingParams(max_rate=100.0)


def test_group_keys_from_the_environment(tmp_path: Path) -> None:
    environ = {
        "PACERD_GROUPS__TENANTS__MAX_RATE": "30",
        "PACERD_GROUPS__NEW__MATCH": "new-?",
    }
    config = load(tmp_path, GROUPS, environ)
    assert config.pacing_for("tenant-a").max_rate == 30.0
    assert config.group_for("new-1") == "new"
    assert config.group_for("new-12") is None
    assert problems(tmp_path, GROUPS, {"PACERD_GROUPS__TENANTS__MACH": "x*"}) == [
        "groups.tenants.mach = 'x*' (from PACERD_GROUPS__TENANTS__MACH): unknown key,"
        " did you mean `match`?"
    ]


def test_a_grouped_destination_may_not_name_its_own_queue(tmp_path: Path) -> None:
    text = GROUPS + '[destinations.tenant-own]\nqueue = "own"\n'
    assert problems(tmp_path, text) == [
        "destinations.tenant-own.queue = 'own': tenant-own is in group tenants"
        " (match = 'tenant-*') and shares its queue; set queue in [groups.tenants] instead"
    ]


def test_a_destination_named_like_a_group_outside_it_is_rejected(tmp_path: Path) -> None:
    text = '[groups.tenants]\nmatch = "tenant-*"\n[destinations.tenants]\nmax_rate = 50.0\n'
    assert problems(tmp_path, text) == [
        "destinations.tenants: is named like group tenants but outside its match"
        " ('tenant-*'): both would use routing key 'tenants'"
    ]


@pytest.mark.parametrize(
    ("glob", "why"),
    [
        ("", 'must be a glob such as "tenant-*" made of destination-name characters'),
        ("tenant/*", 'must be a glob such as "tenant-*" made of destination-name characters'),
        ("tenant-[a", "has an unclosed or empty [...] set"),
        ("tenant-[]", "has an unclosed or empty [...] set"),
    ],
)
def test_a_bad_glob_is_a_problem(tmp_path: Path, glob: str, why: str) -> None:
    (problem,) = problems(tmp_path, f"[groups.g]\nmatch = {glob!r}\n".replace("'", '"'))
    assert problem.startswith(f"groups.g.match = {glob!r}: {why}")


def test_group_problems_are_reported_together(tmp_path: Path) -> None:
    text = """
[groups."bad name"]
match = "x*"

[groups.nomatch]
max_rate = 3.0

[groups.typo]
match = "y*"
mach = "z"

[groups.slow]
match = "slow-*"
min_rate = 500.0

[groups.q]
match = "q-*"
queue = ""
"""
    assert problems(tmp_path, text) == [
        'groups."bad name": invalid group name, must match ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$',
        "groups.nomatch.match: is required",
        "groups.typo.mach = 'z': unknown key, did you mean `match`?",
        "groups.q.queue = '': must have at least 1 character",
    ]
    # with the tables themselves valid, a group's keys are checked against [pacing]
    assert problems(tmp_path, '[groups.slow]\nmatch = "slow-*"\nmin_rate = 500.0\n') == [
        "groups.slow.initial_rate = 10.0: must be between min_rate (500.0) and max_rate (10000.0)"
    ]


def test_a_destination_override_is_checked_on_top_of_its_group(tmp_path: Path) -> None:
    text = GROUPS + "[destinations.tenant-low]\nmin_rate = 30.0\n"  # above the group's 20
    assert problems(tmp_path, text) == [
        "destinations.tenant-low.min_rate = 30.0: must be at most max_rate (20.0)"
    ]


def test_the_example_file_documents_groups() -> None:
    text = EXAMPLE.read_text()
    block = text[text.index("# [groups.example]") :]
    uncommented = "\n".join(line.removeprefix("# ") for line in block.splitlines())
    shown = tomllib.loads(uncommented)["groups"]["example"]
    config = Config.model_validate({"groups": {"example": shown}})
    assert config.route_for("tenant-1").queue == "pacerd.ready.example"


def test_a_ledger_destination_named_like_a_group_outside_it_is_not_admitted(
    tmp_path: Path,
) -> None:
    """A destination first seen in the ledger, named like a group whose glob it
    does not fit, gets no admission loop, and ``destination_not_admitted`` is
    logged once, not on every pass."""
    daemon = Daemon(load(tmp_path, GROUPS), config_path=None, signals=False)
    names = ["smtp", "t-all", "tenant-1", "tenants"]
    with structlog.testing.capture_logs() as events:
        for _ in range(2):
            admitted = [n for n in names if daemon.supervisor.route(n) is not None]
            assert admitted == ["smtp", "t-all", "tenant-1"]
    refused = [e for e in events if e["event"] == "destination_not_admitted"]
    assert [e["destination"] for e in refused] == ["tenants"]


# -- metric series: the group's, or the destination's own -----------------------------


def test_a_grouped_destination_reports_under_its_group(tmp_path: Path) -> None:
    config = load(tmp_path, GROUPS)
    assert config.series_for("tenant-7") == ("group", "tenants")
    assert config.series_for("tx") == ("group", "t-all")
    assert config.series_for("smtp") == ("destination", "smtp")  # in no group


def test_destination_series_keeps_named_destinations_apart(tmp_path: Path) -> None:
    text = GROUPS + '\n[telemetry]\ndestination_series = ["tenant-vip", "tenant-eu-*"]\n'
    config = load(tmp_path, text)
    assert config.telemetry.destination_series == ("tenant-vip", "tenant-eu-*")
    assert config.series_for("tenant-vip") == ("destination", "tenant-vip")
    assert config.series_for("tenant-eu-3") == ("destination", "tenant-eu-3")
    assert config.series_for("tenant-us-3") == ("group", "tenants")
    assert Config().telemetry.destination_series == ()


def test_destination_series_from_the_environment(tmp_path: Path) -> None:
    environ = {"PACERD_TELEMETRY__DESTINATION_SERIES": "tenant-vip, tenant-eu-*"}
    config = load(tmp_path, GROUPS, environ)
    assert config.telemetry.destination_series == ("tenant-vip", "tenant-eu-*")
    assert config.series_for("tenant-vip") == ("destination", "tenant-vip")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ('"tenant-vip"', 'must be a list of names or globs, e.g. ["tenant-0042"]'),
        ('["ok", 7]', 'must be a list of names or globs, e.g. ["tenant-0042"]'),
        ('["tenant vip"]', "'tenant vip' must be a glob such as \"tenant-*\""),
        ('["tenant-["]', "'tenant-[' has an unclosed or empty [...] set"),
    ],
)
def test_bad_destination_series_is_a_problem(tmp_path: Path, value: str, why: str) -> None:
    [problem] = problems(tmp_path, f"[telemetry]\ndestination_series = {value}\n")
    assert problem.startswith("telemetry.destination_series")
    assert why in problem


def test_destination_series_needs_a_restart(tmp_path: Path) -> None:
    old = load(tmp_path, GROUPS)
    new = load(tmp_path, GROUPS + '\n[telemetry]\ndestination_series = ["tenant-vip"]\n')
    assert reload_diff(old, new).needs_restart == ["telemetry.destination_series"]
