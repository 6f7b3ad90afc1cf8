from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pydantic
import pytest

from pacerd.config import (
    EX_CONFIG,
    Config,
    DestinationConfig,
    PacingConfig,
    default_config_path,
    load_config,
    reload_diff,
)
from pacerd.errors import ConfigError
from pacerd.pacer import PacingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "config.example.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pacerd.toml"
    path.write_text(text)
    return path


def problems(text: str | None, tmp_path: Path, environ: dict[str, str] | None = None) -> list[str]:
    path = None if text is None else write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ or {})
    assert caught.value.source == ("configuration" if path is None else str(path))
    return caught.value.problems


# -- defaults and the example file ----------------------------------------------------------


def test_defaults() -> None:
    config = load_config(None, {})
    assert config == Config()
    assert config.database.dsn == "postgresql://postgres@127.0.0.1:5432/test"
    assert config.broker.url == "amqp://guest:guest@127.0.0.1:5672/"
    assert config.broker.queue_type == "quorum"
    assert config.pacing.mode == "active"
    assert config.retry.payload_max_bytes == 256 * 1024
    assert config.telemetry.http_address == ""
    assert config.destinations == {}
    assert config.pacing_for("anything") == PacingParams()
    assert config.queue_for("anything") == "pacerd.ready.anything"
    assert EX_CONFIG == 78


def test_example_file_equals_defaults() -> None:
    assert load_config(EXAMPLE, {}) == load_config(None, {})


def test_example_file_shows_every_key() -> None:
    with EXAMPLE.open("rb") as f:
        shown = tomllib.load(f)
    expected = {
        name: set(type(section).model_fields)
        for name, section in Config()
        if isinstance(section, pydantic.BaseModel)
    }
    assert {name: set(keys) for name, keys in shown.items()} == expected
    commented = EXAMPLE.read_text()
    assert "# [destinations.example]" in commented


def test_pacing_keys_mirror_pacing_params() -> None:
    params = [f.name for f in dataclasses.fields(PacingParams)]
    assert [k for k in PacingConfig.model_fields if k != "mode"] == params
    assert [k for k in DestinationConfig.model_fields if k != "queue"] == params
    assert PacingConfig().params() == PacingParams()


def test_default_config_path() -> None:
    assert default_config_path({}) == "/etc/pacerd/pacerd.toml"
    assert default_config_path({"PACERD_CONFIG": "/srv/p.toml"}) == "/srv/p.toml"


def test_config_is_frozen() -> None:
    config = load_config(None, {})
    with pytest.raises(pydantic.ValidationError):
        config.pacing.tick_seconds = 2.0


# -- one test per class of problem -------------------------------------------------------------


def test_out_of_range_exact_message(tmp_path: Path) -> None:
    assert problems("[pacing]\ntick_seconds = -1\n", tmp_path) == [
        "pacing.tick_seconds = -1: must be greater than 0"
    ]


def test_unknown_key_suggests_the_close_one(tmp_path: Path) -> None:
    assert problems("[pacing]\ntick_second = 0.5\n[pacng]\n", tmp_path) == [
        "pacing.tick_second = 0.5: unknown key, did you mean `tick_seconds`?",
        "pacng: unknown section, did you mean `pacing`?",
    ]
    assert problems("[broker]\nzzz = 1\n", tmp_path) == ["broker.zzz = 1: unknown key"]


def test_wrong_type(tmp_path: Path) -> None:
    text = '[database]\npool_max_size = "8"\n[broker]\ndeclare_queues = 1\n[leases]\nx = 1\n'
    assert problems(text, tmp_path) == [
        "database.pool_max_size = '8': must be a valid integer",
        "broker.declare_queues = 1: must be a valid boolean",
        "leases.x = 1: unknown key",
    ]
    assert problems("pacing = 3\n", tmp_path) == ["pacing = 3: must be a table"]


def test_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    (problem,) = problems("[pacing]\ntick_seconds = = 1\n", tmp_path)
    assert problem.startswith(f"{tmp_path / 'pacerd.toml'}: TOML syntax error: ")
    assert "line 2, column 16" in problem


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "nope.toml", {})
    assert caught.value.problems == [f"{tmp_path / 'nope.toml'}: file not found"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[pacing]\nmin_rate = 50.0\n",
            "pacing.initial_rate = 10.0: must be between min_rate (50.0) and max_rate (10000.0)",
        ),
        (
            "[pacing]\nmin_rate = 5.0\nmax_rate = 2.0\n",
            "pacing.min_rate = 5.0: must be at most max_rate (2.0)",
        ),
        (
            "[retry]\nbackoff_cap_seconds = 0.5\n",
            "retry.backoff_cap_seconds = 0.5: must be at least backoff_base_seconds (1.0)",
        ),
    ],
)
def test_cross_field_rules(tmp_path: Path, text: str, expected: str) -> None:
    assert problems(text, tmp_path) == [expected]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[pacing]\ntick_seconds = 61\n",
            "pacing.tick_seconds = 61: must be less than or equal to 60",
        ),
        ("[pacing]\ndecrease_factor = 1.0\n", "pacing.decrease_factor = 1.0: must be less than 1"),
        ("[pacing]\nmax_rate = inf\n", "pacing.max_rate = inf: must be a finite number"),
        ("[pacing]\nmode = 'fast'\n", "pacing.mode = 'fast': must be 'active' or 'shadow'"),
        (
            "[database]\npool_max_size = 1\n",
            "database.pool_max_size = 1: must be greater than or equal to 2",
        ),
        (
            "[database]\ndsn = 'mysql://x'\n",
            "database.dsn = 'mysql://x': must be a postgresql:// URL",
        ),
        (
            "[retry]\npayload_max_bytes = 100\n",
            "retry.payload_max_bytes = 100: must be greater than or equal to 1024",
        ),
        (
            "[telemetry]\nhttp_address = 'localhost:0'\n",
            "telemetry.http_address = 'localhost:0': must be empty or host:port with port 1..65535",
        ),
        (
            "[telemetry]\nlog_format = 'xml'\n",
            "telemetry.log_format = 'xml': must be 'auto', 'json' or 'console'",
        ),
    ],
)
def test_out_of_range_values(tmp_path: Path, text: str, expected: str) -> None:
    assert problems(text, tmp_path) == [expected]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = """
[database]
pool_max_size = 0
[pacing]
tick_secnds = 1.0
[telemetry]
log_level = "loud"
"""
    found = problems(text, tmp_path)
    assert found == [
        "database.pool_max_size = 0: must be greater than or equal to 2",
        "pacing.tick_secnds = 1.0: unknown key, did you mean `tick_seconds`?",
        "telemetry.log_level = 'loud': must be 'debug', 'info', 'warning' or 'error'",
    ]
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "pacerd.toml", {"PACERD_RETRY__MAX_ATTEMPTS": "many"})
    assert len(caught.value.problems) == 4
    assert str(caught.value).startswith(f"{tmp_path / 'pacerd.toml'} is invalid (4 problem(s)):")


# -- environment overrides ---------------------------------------------------------------------


def test_env_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[pacing]\ntick_seconds = 2.0\nmode = 'shadow'\n")
    environ = {
        "PACERD_PACING__TICK_SECONDS": "0.5",
        "PACERD_DATABASE__DSN": "postgresql://app:pw@db:5432/prod",
        "PACERD_DATABASE__POOL_MAX_SIZE": "20",
        "PACERD_BROKER__DECLARE_QUEUES": "no",
        "PACERD_TELEMETRY__LOG_LEVEL": "DEBUG",
        "PACERD_CONFIG": str(path),  # the path variable, not an override
        "PACERD_SOMETHING": "ignored",  # no __: not an override
        "OTHER__THING": "ignored",
    }
    config = load_config(path, environ)
    assert config.pacing.tick_seconds == 0.5
    assert config.pacing.mode == "shadow"
    assert config.database.dsn == "postgresql://app:pw@db:5432/prod"
    assert config.database.pool_max_size == 20
    assert config.broker.declare_queues is False
    assert config.telemetry.log_level == "debug"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), ("1", True), ("YES", True), ("false", False), ("0", False), ("No", False)],
)
def test_env_booleans(raw: str, expected: bool) -> None:
    config = load_config(None, {"PACERD_BROKER__DECLARE_QUEUES": raw})
    assert config.broker.declare_queues is expected


def test_bad_env_override_is_attributed_to_the_variable(tmp_path: Path) -> None:
    environ = {
        "PACERD_PACING__TICK_SECONDS": "fast",
        "PACERD_PACING__MAX_RATE": "-5",
        "PACERD_BROKER__DECLARE_QUEUES": "maybe",
        "PACERD_RECONCILE__BATCH_SIZE": "1.5",
    }
    assert problems(None, tmp_path, environ) == [
        "broker.declare_queues = 'maybe' (from PACERD_BROKER__DECLARE_QUEUES): "
        "must be a boolean (true/false/1/0/yes/no)",
        "pacing.tick_seconds = 'fast' (from PACERD_PACING__TICK_SECONDS): must be a number",
        "reconcile.batch_size = '1.5' (from PACERD_RECONCILE__BATCH_SIZE): must be an integer",
        "pacing.max_rate = -5.0 (from PACERD_PACING__MAX_RATE): must be greater than 0",
    ]


def test_unknown_env_key_or_section(tmp_path: Path) -> None:
    environ = {
        "PACERD_BROKER__QUEUE_TIPE": "classic",
        "PACERD_PACNG__TICK_SECONDS": "1",
        "PACERD_DESTINATIONS__MIN_RATE": "1",
    }
    assert problems(None, tmp_path, environ) == [
        "broker.queue_tipe = 'classic' (from PACERD_BROKER__QUEUE_TIPE): "
        "unknown key, did you mean `queue_type`?",
        "PACERD_DESTINATIONS__MIN_RATE: expected PACERD_<SECTION>__<KEY>, "
        "PACERD_DESTINATIONS__<NAME>__<KEY> or PACERD_GROUPS__<NAME>__<KEY>",
        "pacng.tick_seconds = '1' (from PACERD_PACNG__TICK_SECONDS): "
        "unknown section, did you mean `pacing`?",
    ]


def test_env_problems_do_not_hide_file_problems(tmp_path: Path) -> None:
    found = problems(
        "[leases]\nclaim_seconds = 0\n", tmp_path, {"PACERD_LEASES__OFER_SECONDS": "1"}
    )
    assert found == [
        "leases.ofer_seconds = '1' (from PACERD_LEASES__OFER_SECONDS): "
        "unknown key, did you mean `offer_seconds`?",
        "leases.claim_seconds = 0: must be greater than 0",
    ]


# -- destinations ------------------------------------------------------------------------------

DESTINATIONS = """
[pacing]
max_rate = 100.0

[destinations.openai]
max_rate = 50.0
initial_rate = 5.0
queue = "llm.openai"

[destinations."Acme.API"]
tick_seconds = 0.5
"""


def test_destination_overrides_and_pacing_for(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, DESTINATIONS), {})
    assert config.pacing_for("openai") == PacingParams(max_rate=50.0, initial_rate=5.0)
    assert config.pacing_for("Acme.API") == PacingParams(max_rate=100.0, tick_seconds=0.5)
    assert config.pacing_for("other") == PacingParams(max_rate=100.0)
    assert config.queue_for("openai") == "llm.openai"
    assert config.queue_for("Acme.API") == "pacerd.ready.Acme.API"


def test_destination_env_overrides(tmp_path: Path) -> None:
    environ = {
        "PACERD_DESTINATIONS__OPENAI__MAX_RATE": "40",  # matches [destinations.openai]
        "PACERD_DESTINATIONS__ACME.API__MIN_RATE": "2",  # matches "Acme.API", case aside
        "PACERD_DESTINATIONS__NEW_ONE__QUEUE": "q.new",  # not in the file: lower-cased
    }
    config = load_config(write(tmp_path, DESTINATIONS), environ)
    assert config.pacing_for("openai").max_rate == 40.0
    assert config.pacing_for("Acme.API").min_rate == 2.0
    assert config.queue_for("new_one") == "q.new"


def test_destination_override_is_revalidated_against_pacing(tmp_path: Path) -> None:
    text = DESTINATIONS + "[destinations.slow]\nmin_rate = 200.0\n"
    assert problems(text, tmp_path) == [
        "destinations.slow.min_rate = 200.0: must be at most max_rate (100.0)"
    ]
    text = DESTINATIONS + "[destinations.slow]\nmax_rate = 5.0\n[database]\npool_max_size = 1\n"
    assert problems(text, tmp_path) == [
        "database.pool_max_size = 1: must be greater than or equal to 2",
        "destinations.slow.initial_rate = 10.0: must be between min_rate (1.0) and max_rate (5.0)",
    ]


def test_bad_destination_tables(tmp_path: Path) -> None:
    text = """
[destinations."bad name"]
[destinations.ok]
mode = "shadow"
min_rat = 1.0
live_share = 2.0
"""
    assert problems(text, tmp_path) == [
        'destinations."bad name": invalid destination name, '
        "must match ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$",
        "destinations.ok.live_share = 2.0: must be less than or equal to 1",
        "destinations.ok.mode = 'shadow': unknown key",
        "destinations.ok.min_rat = 1.0: unknown key, did you mean `min_rate`?",
    ]


# -- redaction and reload ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("postgresql://app:s3cr/t@db:5432/prod", "postgresql://app:***@db:5432/prod"),
        (
            "postgresql://app:p@ss@db/prod?sslmode=require",
            "postgresql://app:***@db/prod?sslmode=require",
        ),
        (
            "postgresql://app@db/prod?password=hunter2&x=1",
            "postgresql://app@db/prod?password=***&x=1",
        ),
        ("postgresql://postgres@127.0.0.1:5432/test", "postgresql://postgres@127.0.0.1:5432/test"),
        ("amqps://guest:guest@mq:5671/vhost", "amqps://guest:***@mq:5671/vhost"),
    ],
)
def test_redaction(url: str, redacted: str) -> None:
    scheme = "database" if url.startswith("postgres") else "broker"
    key = "PACERD_DATABASE__DSN" if scheme == "database" else "PACERD_BROKER__URL"
    config = load_config(None, {key: url})
    shown = config.redacted_dsn() if scheme == "database" else config.redacted_broker_url()
    assert shown == redacted


def test_reload_diff(tmp_path: Path) -> None:
    old = load_config(None, {})
    assert reload_diff(old, old).changed == []
    new = load_config(
        write(tmp_path, DESTINATIONS),
        {
            "PACERD_DATABASE__DSN": "postgresql://postgres@10.0.0.1/test",
            "PACERD_TELEMETRY__HTTP_ADDRESS": "127.0.0.1:9464",
            "PACERD_TELEMETRY__LOG_LEVEL": "debug",
        },
    )
    diff = reload_diff(old, new)
    assert diff.changed == [
        "database.dsn",
        'destinations."Acme.API".tick_seconds',
        "destinations.openai.initial_rate",
        "destinations.openai.max_rate",
        "destinations.openai.queue",
        "pacing.max_rate",
        "telemetry.http_address",
        "telemetry.log_level",
    ]
    assert diff.needs_restart == ["database.dsn", "telemetry.http_address"]


# -- secrets from files -------------------------------------------------------------------


def secret(tmp_path: Path, name: str, content: str) -> Path:
    path = tmp_path / name
    path.write_text(content)
    path.chmod(0o600)
    return path


def test_dsn_and_url_from_files(tmp_path: Path) -> None:
    dsn = secret(tmp_path, "dsn", "postgresql://pacerd:s3cret@db.internal/pacerd\n")
    url = secret(tmp_path, "url", "amqps://pacerd:hunter2@mq.internal/\n")
    path = write(tmp_path, f'[database]\ndsn_file = "{dsn}"\n[broker]\nurl_file = "{url}"\n')
    config = load_config(path, {})
    assert config.database.dsn == "postgresql://pacerd:s3cret@db.internal/pacerd"
    assert config.broker.url == "amqps://pacerd:hunter2@mq.internal/"
    assert config.redacted_dsn() == "postgresql://pacerd:***@db.internal/pacerd"
    assert config.redacted_broker_url() == "amqps://pacerd:***@mq.internal/"


def test_secret_files_from_the_environment(tmp_path: Path) -> None:
    dsn = secret(tmp_path, "dsn", "postgresql://pacerd:s3cret@db.internal/pacerd")
    config = load_config(None, {"PACERD_DATABASE__DSN_FILE": str(dsn)})
    assert config.database.dsn == "postgresql://pacerd:s3cret@db.internal/pacerd"
    assert config.database.dsn_file == str(dsn)


def test_password_files_fill_the_urls_password(tmp_path: Path) -> None:
    secret(tmp_path, "db-password", "p@ss:w/rd\n")
    secret(tmp_path, "mq-password", "hunter2")
    path = write(
        tmp_path,
        '[database]\ndsn = "postgresql://pacerd@db.internal:5433/pacerd?sslmode=require"\n'
        'password_file = "db-password"\n'
        '[broker]\nurl = "amqp://pacerd:placeholder@mq.internal/vhost"\n'
        'password_file = "mq-password"\n',
    )
    config = load_config(path, {})  # relative paths: next to the config file
    assert config.database.dsn == (
        "postgresql://pacerd:p%40ss%3Aw%2Frd@db.internal:5433/pacerd?sslmode=require"
    )
    assert config.broker.url == "amqp://pacerd:hunter2@mq.internal/vhost"
    assert "p%40ss" not in config.redacted_dsn()


def test_relative_secret_files_come_from_the_credentials_directory(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    secret(credentials, "database.dsn", "postgresql://pacerd:s3cret@db.internal/pacerd\n")
    environ = {
        "CREDENTIALS_DIRECTORY": str(credentials),
        "PACERD_DATABASE__DSN_FILE": "database.dsn",
    }
    config = load_config(write(tmp_path, ""), environ)
    assert config.database.dsn == "postgresql://pacerd:s3cret@db.internal/pacerd"


def test_secret_file_problems_never_show_the_secret(tmp_path: Path) -> None:
    bad = secret(tmp_path, "bad-dsn", "mysql://root:s3cret@db/x\n")
    empty = secret(tmp_path, "empty", "\n")
    found = problems(
        f'[database]\ndsn_file = "{bad}"\n'
        f'[broker]\nurl_file = "{tmp_path / "missing"}"\npassword_file = "{empty}"\n',
        tmp_path,
    )
    assert found == [
        f"broker.url_file = {str(tmp_path / 'missing')!r}: cannot be read"
        " (No such file or directory)",
        f"broker.password_file = {str(empty)!r}: is empty",
        f"database.dsn (from database.dsn_file: {bad}): must be a postgresql:// URL",
    ]
    assert not any("s3cret" in p for p in found)


def test_a_secret_file_wins_over_the_key_it_fills(tmp_path: Path) -> None:
    dsn = secret(tmp_path, "dsn", "postgresql://pacerd:s3cret@db.internal/pacerd")
    config = load_config(EXAMPLE, {"PACERD_DATABASE__DSN_FILE": str(dsn)})
    assert config.database.dsn == "postgresql://pacerd:s3cret@db.internal/pacerd"


def test_a_password_file_needs_a_user_name(tmp_path: Path) -> None:
    secret(tmp_path, "password", "s3cret")
    nameless = problems('[broker]\nurl = "amqp://mq/"\npassword_file = "password"\n', tmp_path)
    assert nameless == [
        "broker.password_file = 'password': needs a user name in broker.url to go with the password"
    ]


def test_an_invalid_dsn_in_the_file_is_shown_redacted(tmp_path: Path) -> None:
    found = problems('[database]\ndsn = "mysql://root:s3cret@db/x"\n', tmp_path)
    assert found == ["database.dsn = 'mysql://root:***@db/x': must be a postgresql:// URL"]


def test_a_password_from_a_file_is_masked_in_log_lines(tmp_path: Path) -> None:
    from pacerd.telemetry import redact

    secret(tmp_path, "password", "p@ss:w/rd%20 x\n")
    path = write(
        tmp_path, '[database]\ndsn = "postgresql://pacerd@db/x"\npassword_file = "password"\n'
    )
    dsn = load_config(path, {}).database.dsn
    line = f"ledger_unavailable dsn={dsn} error=connection refused"
    assert (
        redact(line)
        == "ledger_unavailable dsn=postgresql://pacerd:***@db/x error=connection refused"
    )
