"""Every CLI verb, end to end against the real database (``python -m pacerd``)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest

from pacerd.client import Client
from pacerd.exitcodes import (
    EX_FAILURE,
    EX_INTERRUPTED,
    EX_NOT_MIGRATED,
    EX_OK,
    EX_UNAVAILABLE,
    EX_UNKNOWN_JOB,
    EX_USAGE,
)
from pacerd.ledger import Ledger, migration_files

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def pacerd(
    dsn: str, *args: str, config: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")} | (env or {})
    env.setdefault("PACERD_DATABASE__DSN", dsn)
    command = [sys.executable, "-m", "pacerd"]
    if config is not None:
        command += ["-c", str(config)]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


async def _kill(dsn: str, job_id: str, error: str = "bad input") -> None:
    """Drives one job to `dead`: claim it, then report a permanent failure."""
    ledger = await Ledger.connect(dsn, max_size=2)
    client = await Client.connect(dsn)
    try:
        job = (await client.show(job_id) or (None, []))[0]
        assert job is not None
        claimed = await ledger.claim_due(
            job.destination, live_limit=0, limit=100, claim_seconds=30, epoch=0,
            live_window_seconds=0, instance="test",
        )  # fmt: skip
        mine = [c for c in claimed if c.job_id == job_id]
        assert mine, claimed
        others = [c.ref for c in claimed if c.job_id != job_id]
        await ledger.release_claims(others, reason="test")
        assert await client.report(job_id, mine[0].attempt, "fail", error=error) == "applied"
    finally:
        await client.close()
        await ledger.close()


async def test_migrate_on_an_empty_database_then_again(empty_db_dsn: str) -> None:
    first = pacerd(empty_db_dsn, "migrate")
    assert first.returncode == 0, first.stderr
    assert "applied 0001_ledger.sql" in first.stdout
    again = pacerd(empty_db_dsn, "migrate")
    assert again.returncode == 0
    assert again.stdout.strip() == "ledger schema is up to date"
    assert json.loads(pacerd(empty_db_dsn, "migrate", "--json").stdout) == {
        "applied": [],
        "partitions": 64,
    }


async def test_migrate_sets_the_partitions_only_while_no_instance_runs(empty_db_dsn: str) -> None:
    first = pacerd(empty_db_dsn, "migrate", "--json", "--partitions", "8")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["partitions"] == 8
    kept = pacerd(empty_db_dsn, "migrate", "--json")
    assert json.loads(kept.stdout)["partitions"] == 8
    for bad in ("0", "4097", "-3"):
        refused = pacerd(empty_db_dsn, "migrate", "--partitions", bad)
        assert refused.returncode == EX_USAGE, (bad, refused.stderr)
        assert "--partitions must be between 1 and 4096" in refused.stderr
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await conn.fetchval("SELECT pacerd.schedule('j1', 'k', 'tenant-7', '{}'::jsonb)")
        placed = "SELECT partition = pacerd._partition_of(destination, $1) FROM pacerd.destinations"
        assert await conn.fetchval(placed, 8)
        # an instance's leadership session is connected: the number stays
        leader = await asyncpg.connect(
            empty_db_dsn, server_settings={"application_name": "pacerd:leader"}
        )
        try:
            busy = pacerd(empty_db_dsn, "migrate", "--partitions", "16")
        finally:
            await leader.close()
        assert busy.returncode == EX_FAILURE
        assert "partitions stay 8: 1 pacerd instance(s) run on it" in busy.stderr
        assert await conn.fetchval(placed, 8)
        # none runs: every destination is placed again
        moved = pacerd(empty_db_dsn, "migrate", "--json", "--partitions", "16")
        assert moved.returncode == 0, moved.stderr
        assert json.loads(moved.stdout)["partitions"] == 16
        assert await conn.fetchval(placed, 16)
    finally:
        await conn.close()


async def test_check_config(db_dsn: str, tmp_path: Path) -> None:
    good = pacerd(db_dsn, "check-config")
    assert good.returncode == 0, good.stderr
    assert "ok" in good.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[pacing]\ntick_second = 1\nmax_rate = -1\n")
    result = pacerd(db_dsn, "check-config", config=bad)
    assert result.returncode == 78
    assert "pacing.tick_second = 1: unknown key, did you mean `tick_seconds`?" in result.stderr
    assert "pacing.max_rate = -1: must be greater than 0" in result.stderr
    assert "Traceback" not in result.stderr
    missing = pacerd(db_dsn, "check-config", config=tmp_path / "nope.toml")
    assert missing.returncode == 78


async def test_schedule_show_status_cancel(db_dsn: str) -> None:
    scheduled = pacerd(
        db_dsn, "schedule", "cli-1", "--kind", "email", "--destination", "cli-dest",
        "--payload", '{"to": "a@example.com"}', "--delay", "-5",
    )  # fmt: skip
    assert scheduled.returncode == 0, scheduled.stderr
    assert scheduled.stdout.strip() == "cli-1: scheduled"
    repeat = pacerd(db_dsn, "schedule", "cli-1", "--kind", "email", "--destination", "cli-dest")
    assert repeat.stdout.strip() == "cli-1: unchanged"
    revised = pacerd(
        db_dsn, "schedule", "cli-1", "--kind", "email", "--destination", "cli-dest",
        "--revision", "2", "--delay", "-5",
    )  # fmt: skip
    assert revised.stdout.strip() == "cli-1: revised"

    shown = pacerd(db_dsn, "show", "cli-1", "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["state"] == "scheduled"
    assert doc["revision"] == 2
    assert [e["event"] for e in doc["history"]] == ["scheduled", "revised"]
    human = pacerd(db_dsn, "show", "cli-1")
    assert "cli-1" in human.stdout
    assert "revised" in human.stdout

    status = pacerd(db_dsn, "status", "--json")
    assert status.returncode == 0, status.stderr
    rows = {r["destination"]: r for r in json.loads(status.stdout)}
    assert rows["cli-dest"]["due"] == 1
    assert rows["cli-dest"]["oldest_due_age_seconds"] >= 4
    assert rows["cli-dest"]["paused"] is False
    table = pacerd(db_dsn, "status")
    assert "cli-dest" in table.stdout

    cancelled = pacerd(db_dsn, "cancel", "cli-1", "--reason", "no longer needed")
    assert cancelled.stdout.strip() == "cli-1: cancelled"
    assert pacerd(db_dsn, "cancel", "cli-1").stdout.strip() == "cli-1: unchanged"
    unknown = pacerd(db_dsn, "cancel", "nope")
    assert unknown.returncode == EX_UNKNOWN_JOB
    missing = pacerd(db_dsn, "show", "nope")
    assert missing.returncode == EX_UNKNOWN_JOB
    assert missing.stderr.strip() == "pacerd: error: no job 'nope'"


GROUPED = """
[groups.tenants]
match = "st-t-*"

[groups.eu]
match = "st-eu-*"
"""


async def _schedule_many(dsn: str, destinations: dict[str, float]) -> None:
    """One job due ``age`` seconds ago for each destination."""
    client = await Client.connect(dsn)
    try:
        now = await client.pool.fetchval("SELECT now()")
        for destination, age in destinations.items():
            await client.schedule(
                f"job-{destination}", kind="k", destination=destination, payload={},
                eligible_at=now - dt.timedelta(seconds=age),
            )  # fmt: skip
    finally:
        await client.close()


async def test_status_by_group_glob_and_top_with_group_totals(db_dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "pacerd.toml"
    config.write_text(GROUPED)
    tenants = {f"st-t-{n:03}": 100.0 + n for n in range(60)}
    await _schedule_many(db_dsn, {**tenants, "st-eu-1": 5000.0, "st-smtp": 30.0})

    def doc(*args: str) -> Any:
        result = pacerd(db_dsn, "status", "--json", *args, config=config)
        assert result.returncode == EX_OK, result.stderr
        return json.loads(result.stdout)

    everything = doc()  # the list of destinations, every one, as before
    assert isinstance(everything, list)
    assert len(everything) == 62
    groups = {r["destination"]: r["group"] for r in everything}
    assert groups["st-t-007"] == "tenants"
    assert groups["st-eu-1"] == "eu"
    assert groups["st-smtp"] is None
    assert {r["destination"] for r in doc("--group", "tenants")} == set(tenants)
    assert [r["destination"] for r in doc("--group", "-")] == ["st-smtp"]
    assert [r["destination"] for r in doc("--destination", "st-t-05?")] == [
        f"st-t-05{n}" for n in range(10)
    ]
    top = [r["destination"] for r in doc("--top", "3")]
    assert top == ["st-eu-1", "st-t-059", "st-t-058"]  # the oldest due work first

    totals = doc("--totals", "--group", "tenants", "--top", "2")
    assert [g["group"] for g in totals["groups"]] == ["tenants"]
    [group] = totals["groups"]
    assert group["destinations"] == 60
    assert group["due"] == 60
    assert group["oldest_due_age_seconds"] >= 159
    assert group["refusal_ratio"] is None  # no outcome yet
    assert [r["destination"] for r in totals["destinations"]] == ["st-t-059", "st-t-058"]
    assert (totals["selected"], totals["left_out"]) == (60, 58)
    every_group = doc("--totals")
    assert [g["group"] for g in every_group["groups"]] == ["tenants", "eu", None]
    assert len(every_group["destinations"]) == 62  # JSON leaves out only what --top does

    table = pacerd(db_dsn, "status", config=config)
    assert table.returncode == EX_OK, table.stderr
    assert "tenants" in table.stdout.split("st-eu-1")[0]  # the group totals come first
    assert "12 more destination(s) not shown" in table.stdout
    assert "st-t-011" in table.stdout  # the 50 with the oldest due work: st-eu-1 and 49
    assert "st-t-010" not in table.stdout
    assert "st-smtp" not in table.stdout
    chosen = pacerd(db_dsn, "status", "--group", "tenants", config=config)
    assert "not shown" not in chosen.stdout  # a filter shows every destination it selects
    assert "st-t-000" in chosen.stdout


async def test_status_rejects_a_bad_selection_as_usage(db_dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "pacerd.toml"
    config.write_text(GROUPED)
    known = "(groups: tenants, eu; --group - selects the destinations in no group)"
    for args, message in (
        (("--group", "nope"), f"pacerd: error: no group 'nope' in the configuration {known}"),
        (("--top", "0"), "pacerd: error: --top must be at least 1, not 0"),
        (("--top", "0", "--watch"), "pacerd: error: --top must be at least 1, not 0"),
        (("--group", "nope", "--json"), "pacerd: error: no group 'nope'"),
    ):  # fmt: skip
        result = pacerd(db_dsn, "status", *args, config=config)
        assert result.returncode == EX_USAGE, (args, result.stderr)
        assert result.stderr.startswith(message), (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
        assert result.stdout == ""


async def test_bad_input_is_one_line_and_non_zero(db_dsn: str) -> None:
    empty = pacerd(db_dsn, "schedule", " ", "--kind", "k", "--destination", "d")
    assert empty.returncode == 1
    assert empty.stderr.strip() == "pacerd: error: pacerd.schedule: job_id must not be empty"
    bad_json = pacerd(
        db_dsn, "schedule", "j", "--kind", "k", "--destination", "d", "--payload", "{"
    )
    assert bad_json.returncode == 2
    assert bad_json.stderr.startswith("pacerd: error: --payload is not valid JSON")
    no_db = pacerd("postgresql://postgres@127.0.0.1:1/none", "status")
    assert no_db.returncode == EX_UNAVAILABLE
    assert no_db.stderr.startswith("pacerd: error: the ledger cannot be reached")
    assert len(no_db.stderr.strip().splitlines()) == 1


async def test_dead_and_replay_one_and_by_filter(db_dsn: str) -> None:
    for n in range(3):
        pacerd(db_dsn, "schedule", f"d-{n}", "--kind", "render", "--destination", "cli-dead")
    for n in range(3):
        await _kill(db_dsn, f"d-{n}")
    listed = pacerd(db_dsn, "dead", "--destination", "cli-dead", "--json")
    assert listed.returncode == 0, listed.stderr
    assert sorted(j["job_id"] for j in json.loads(listed.stdout)) == ["d-0", "d-1", "d-2"]
    assert {j["last_error"] for j in json.loads(listed.stdout)} == {"bad input"}
    assert "bad input" in pacerd(db_dsn, "dead").stdout

    no_reason = pacerd(db_dsn, "replay", "d-0")
    assert no_reason.returncode == 2
    one = pacerd(db_dsn, "replay", "d-0", "--reason", "input fixed")
    assert one.stdout.strip() == "d-0: replayed"
    history = json.loads(pacerd(db_dsn, "show", "d-0", "--json").stdout)["history"]
    assert history[-1]["event"] == "replayed"
    assert history[-1]["detail"]["reason"] == "input fixed"

    dry = pacerd(db_dsn, "replay", "--destination", "cli-dead", "--reason", "x", "--dry-run")
    assert dry.stdout.strip() == "2 dead job(s) would be replayed (2 match)"
    assert len(json.loads(pacerd(db_dsn, "dead", "--json").stdout)) == 2
    bulk = pacerd(db_dsn, "replay", "--error", "bad", "--reason", "bulk fix")
    assert bulk.stdout.strip() == "replayed 2 dead job(s) (2 matched)"
    assert json.loads(pacerd(db_dsn, "dead", "--json").stdout) == []
    both = pacerd(db_dsn, "replay", "d-1", "--kind", "render", "--reason", "x")
    assert both.returncode == 2


async def test_pause_and_resume(db_dsn: str) -> None:
    assert pacerd(db_dsn, "pause", "--destination", "p1").stdout.strip() == "p1: paused"
    assert pacerd(db_dsn, "pause", "--destination", "p1").stdout.strip() == "p1: unchanged"
    rows = {r["destination"]: r for r in json.loads(pacerd(db_dsn, "status", "--json").stdout)}
    assert rows["p1"]["paused"] is True
    assert rows["p1"]["state"] == "paused"
    assert pacerd(db_dsn, "pause").stdout.strip() == "all destinations: paused"
    rows = {r["destination"]: r for r in json.loads(pacerd(db_dsn, "status", "--json").stdout)}
    assert rows["p1"]["state"] == "paused (all)"
    assert pacerd(db_dsn, "resume").stdout.strip() == "all destinations: resumed"
    rows = {r["destination"]: r for r in json.loads(pacerd(db_dsn, "status", "--json").stdout)}
    assert rows["p1"]["paused"] is False
    assert pacerd(db_dsn, "resume", "--destination", "p1").stdout.strip() == "p1: unchanged"


async def test_dead_and_show_print_markup_in_user_data_verbatim(db_dsn: str) -> None:
    error = "upstream said [/x] then [red]stop[/red]"
    pacerd(db_dsn, "schedule", "m-[red]1", "--kind", "render", "--destination", "cli-markup")
    await _kill(db_dsn, "m-[red]1", error=error)
    listed = pacerd(db_dsn, "dead", "--destination", "cli-markup")
    assert listed.returncode == EX_OK, listed.stderr
    assert "m-[red]1" in listed.stdout
    assert error in listed.stdout
    shown = pacerd(db_dsn, "show", "m-[red]1")
    assert shown.returncode == EX_OK, shown.stderr
    assert f"last error: {error}" in shown.stdout


async def test_unknown_jobs_have_their_own_exit_status(db_dsn: str) -> None:
    for args in (
        ("show", "nope"),
        ("cancel", "nope"),
        ("replay", "nope", "--reason", "x"),
        ("replay", "nope", "--reason", "x", "--dry-run"),
    ):
        result = pacerd(db_dsn, *args)
        assert result.returncode == EX_UNKNOWN_JOB, (args, result.stdout, result.stderr)
    bad_input = pacerd(db_dsn, "schedule", " ", "--kind", "k", "--destination", "d")
    assert bad_input.returncode == EX_FAILURE


async def test_an_interrupted_verb_exits_130(db_dsn: str) -> None:
    """SIGINT (Ctrl-C) to ``status --watch``, once its session is on the
    ledger, ends it with exit status 130 and no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACERD_")}
    env["PACERD_DATABASE__DSN"] = db_dsn
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pacerd", "status", "--watch", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    conn = await asyncpg.connect(db_dsn)
    try:
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        while await conn.fetchval(query) < 2 and proc.returncode is None:
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    proc.send_signal(signal.SIGINT)
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == EX_INTERRUPTED, stderr
    assert b"Traceback" not in stderr


async def test_an_unmigrated_ledger_is_not_retried(empty_db_dsn: str) -> None:
    run = pacerd(empty_db_dsn, "run")
    assert run.returncode == EX_NOT_MIGRATED, run.stderr
    assert "pacerd migrate" in run.stdout + run.stderr
    assert pacerd(empty_db_dsn, "status", "--watch").returncode == EX_NOT_MIGRATED
    status = pacerd(empty_db_dsn, "status")
    assert status.returncode == EX_NOT_MIGRATED
    pending = ", ".join(name for _, name, _ in migration_files())
    assert status.stderr.strip() == (
        f"pacerd: error: the ledger schema is not up to date ({pending} pending):"
        " run `pacerd migrate` first"
    )
    assert pacerd(empty_db_dsn, "migrate").returncode == EX_OK
    assert pacerd(empty_db_dsn, "status").returncode == EX_OK


async def test_the_ledger_dsn_from_a_credentials_file(db_dsn: str, tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "database.dsn").write_text(db_dsn + "\n")
    env = {
        "CREDENTIALS_DIRECTORY": str(credentials),
        "PACERD_DATABASE__DSN_FILE": "database.dsn",
        "PACERD_DATABASE__DSN": "postgresql://nobody@127.0.0.1:1/unused",
    }
    scheduled = pacerd(
        db_dsn, "schedule", "cred-1", "--kind", "k", "--destination", "cred", env=env
    )
    assert scheduled.returncode == EX_OK, scheduled.stderr
    assert scheduled.stdout.strip() == "cred-1: scheduled"


async def test_a_password_file_is_masked_in_check_config(db_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "password").write_text("pw-from-file-71\n")
    config = tmp_path / "pacerd.toml"
    config.write_text('[database]\npassword_file = "password"\n')
    env = {"PACERD_DATABASE__DSN": "postgresql://pacerd@db.internal/pacerd"}
    checked = pacerd(db_dsn, "check-config", config=config, env=env)
    assert checked.returncode == EX_OK, checked.stderr
    assert "postgresql://pacerd:***@db.internal/pacerd" in checked.stdout
    assert "pw-from-file-71" not in checked.stdout + checked.stderr


async def test_every_result_verb_speaks_json(db_dsn: str) -> None:
    def doc(*args: str) -> object:
        result = pacerd(db_dsn, *args, "--json")
        assert result.returncode in (EX_OK, EX_UNKNOWN_JOB), result.stderr
        return json.loads(result.stdout)

    schedule = ("schedule", "j-1", "--kind", "k", "--destination", "cli-json")
    assert doc(*schedule) == {"job_id": "j-1", "result": "scheduled"}
    assert doc(*schedule) == {"job_id": "j-1", "result": "unchanged"}
    assert doc("cancel", "j-1") == {"job_id": "j-1", "result": "cancelled"}
    assert doc("cancel", "nope") == {"job_id": "nope", "result": "unknown"}
    pacerd(db_dsn, "schedule", "j-2", "--kind", "k", "--destination", "cli-json")
    await _kill(db_dsn, "j-2")
    assert doc("replay", "j-2", "--reason", "x", "--dry-run") == {
        "job_id": "j-2", "state": "dead", "would_replay": True,
    }  # fmt: skip
    assert doc("replay", "--destination", "cli-json", "--reason", "x", "--dry-run") == {
        "matched": 1, "would_replay": 1,
    }  # fmt: skip
    assert doc("replay", "--destination", "cli-json", "--reason", "x") == {
        "matched": 1, "replayed": 1,
    }  # fmt: skip
    assert doc("replay", "j-2", "--reason", "x") == {"job_id": "j-2", "result": "unchanged"}
    assert doc("pause", "--destination", "cli-json") == {
        "destination": "cli-json", "result": "paused",
    }  # fmt: skip
    assert doc("resume") == {"destination": None, "result": "resumed"}


async def test_check_config_json(db_dsn: str, tmp_path: Path) -> None:
    good = json.loads(pacerd(db_dsn, "check-config", "--json").stdout)
    assert good["ok"] is True
    assert good["database"] == db_dsn
    bad = tmp_path / "bad.toml"
    bad.write_text("[pacing]\ntick_second = 1\n")
    result = pacerd(db_dsn, "check-config", "--json", config=bad)
    assert result.returncode == 78
    assert json.loads(result.stdout) == {
        "config": str(bad),
        "ok": False,
        "problems": ["pacing.tick_second = 1: unknown key, did you mean `tick_seconds`?"],
    }


async def test_config_show_is_the_merged_configuration_masked(db_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "mq-password").write_text("mq-secret-52\n")
    config = tmp_path / "pacerd.toml"
    config.write_text(
        '[broker]\nurl = "amqp://pacerd@mq.internal/"\npassword_file = "mq-password"\n'
        "[pacing]\ntick_seconds = 0.5\n[destinations.smtp]\nmax_rate = 50.0\n"
    )
    env = {"PACERD_PACING__MAX_RATE": "400"}
    shown = pacerd(db_dsn, "config", "show", config=config, env=env)
    assert shown.returncode == EX_OK, shown.stderr
    assert "mq-secret-52" not in shown.stdout
    tree = tomllib.loads(shown.stdout)
    assert tree["broker"]["url"] == "amqp://pacerd:***@mq.internal/"
    assert tree["broker"]["password_file"] == "mq-password"
    assert tree["pacing"]["tick_seconds"] == 0.5
    assert tree["pacing"]["max_rate"] == 400.0
    assert tree["destinations"]["smtp"]["max_rate"] == 50.0
    assert tree["retry"]["max_attempts"] == 10  # defaults are shown too
    as_json = json.loads(pacerd(db_dsn, "config", "show", "--json", config=config, env=env).stdout)
    assert as_json["broker"] == tree["broker"]
    assert as_json["destinations"]["smtp"]["min_rate"] is None


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completion_from_the_parser() -> None:
    script = pacerd("postgresql://unused@127.0.0.1:1/none", "completion", "bash")
    assert script.returncode == EX_OK, script.stderr
    for verb in ("run", "migrate", "status", "replay", "config", "completion"):
        assert verb in script.stdout
    registered = subprocess.run(
        ["bash", "-c", 'eval "$1" && complete -p pacerd', "bash", script.stdout],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert registered.returncode == 0, registered.stderr
    assert registered.stdout.strip().endswith(" pacerd")
