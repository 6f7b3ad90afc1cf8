"""The deployment files: systemd unit, Dockerfile, compose stack, collector config.

No Docker engine runs here, so the container files are checked by reading them:
the hadolint-style essentials of the Dockerfile, and the compose file's services,
dependencies and health checks (fully parsed when PyYAML is importable; an
indentation-based reading of each service block otherwise). The systemd unit is
checked with ``systemd-analyze`` when it is installed.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "pacerd.service"
EXEC_START_BINARY = "/usr/local/bin/pacerd"
DRAIN_GRACE_SECONDS = 10.0
MAX_EXPOSURE = 2.0

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


# -- systemd -------------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_unit_essentials() -> None:
    s = unit_settings()
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["main"]
    assert s["ExecStart"] == [f"{EXEC_START_BINARY} run -c /etc/pacerd/pacerd.toml"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["Restart"] == ["on-failure"]
    assert s["WatchdogSec"] == ["30"]
    assert float(s["TimeoutStopSec"][0]) > DRAIN_GRACE_SECONDS
    assert s["DynamicUser"] == ["yes"]
    assert s["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert "@system-service" in s["SystemCallFilter"]
    assert s["CapabilityBoundingSet"] == [""]


@needs_systemd_analyze
def test_unit_exposure_is_low() -> None:
    run = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(UNIT)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    match = re.search(r"Overall exposure level for pacerd\.service: (\d+(?:\.\d+)?)", run.stdout)
    assert match, run.stdout + run.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, run.stdout


@needs_systemd_analyze
def test_unit_verifies_clean(tmp_path: Path) -> None:
    # verify checks that ExecStart's binary exists and is executable; pacerd is not
    # installed on a build machine, so a copy points it at a stand-in executable.
    binary = tmp_path / "bin" / "pacerd"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    text = UNIT.read_text()
    assert text.count(f"ExecStart={EXEC_START_BINARY} ") == 1
    copy = tmp_path / "pacerd.service"
    copy.write_text(text.replace(f"ExecStart={EXEC_START_BINARY} ", f"ExecStart={binary} "))
    run = subprocess.run(
        ["systemd-analyze", "verify", str(copy)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    ours = [line for line in (run.stdout + run.stderr).splitlines() if "pacerd" in line]
    assert run.returncode == 0, run.stdout + run.stderr
    assert ours == []


# -- Dockerfile ----------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def test_dockerfile_is_multi_stage_from_python_slim() -> None:
    instructions = dockerfile_instructions()
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)
    stages = [rest for word, rest in instructions if word == "FROM"]
    assert len(stages) >= 2
    assert any(re.search(r"\bAS builder$", stage, re.IGNORECASE) for stage in stages)
    base = stages[-1].split()[0]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base.startswith("python:3.11-slim")
    assert any("from=builder" in rest for word, rest in final_stage() if word in ("COPY", "RUN"))


def test_dockerfile_runtime_is_non_root_and_lean() -> None:
    stage = final_stage()
    users = [rest for word, rest in stage if word == "USER"]
    assert users
    assert users[-1].split(":")[0] not in ("root", "0")
    env = " ".join(rest for word, rest in stage if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "PYTHONUNBUFFERED=1" in env
    runs = " ".join(rest for word, rest in stage if word == "RUN")
    assert "pip install --no-cache-dir" in runs
    assert "[dev" not in runs
    assert "[demo" not in runs


def exec_form(stage: list[tuple[str, str]], instruction: str) -> list[str]:
    [value] = [rest for word, rest in stage if word == instruction][-1:]
    parsed = json.loads(value)
    assert isinstance(parsed, list)
    return [str(item) for item in parsed]


def test_dockerfile_entrypoint_signal_and_healthcheck() -> None:
    stage = final_stage()
    assert exec_form(stage, "ENTRYPOINT") == ["pacerd"]
    assert exec_form(stage, "CMD") == ["run", "-c", "/etc/pacerd/pacerd.toml"]
    assert [rest for word, rest in stage if word == "STOPSIGNAL"] == ["SIGTERM"]
    [health] = [rest for word, rest in stage if word == "HEALTHCHECK"]
    command = json.loads(health.split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-c"]
    assert "urllib.request" in command[2]
    url = re.search(r"http://127\.0\.0\.1:(\d+)/healthz", command[2])
    assert url, command
    env = " ".join(rest for word, rest in stage if word == "ENV")
    assert f"PACERD_TELEMETRY__HTTP_ADDRESS=0.0.0.0:{url.group(1)}" in env
    assert [rest for word, rest in stage if word == "EXPOSE"] == [url.group(1)]


def test_dockerfile_copies_only_what_the_context_sends() -> None:
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for word, rest in dockerfile_instructions():
        if word == "COPY" and "--from=" not in rest:
            sources = [part for part in rest.split() if not part.startswith("--")][:-1]
            for source in sources:
                name = source.rstrip("/").removeprefix("./")
                assert name in allowed, name
                assert (ROOT / name).exists(), name


# -- compose -------------------------------------------------------------------------

COMPOSE = ROOT / "compose.yaml"
SERVICES = {"postgres", "rabbitmq", "jaeger", "otel-collector", "migrate", "pacerd", "worker",
            "upstream"}  # fmt: skip


def service_blocks() -> dict[str, str]:
    """Each top-level service's text, read by indentation (no YAML parser needed)."""
    blocks: dict[str, list[str]] = {}
    current: str | None = None
    inside = False
    for line in COMPOSE.read_text().splitlines():
        if re.match(r"^\S", line):
            inside = line.startswith("services:")
            current = None
            continue
        name = re.match(r"^  ([A-Za-z0-9][\w.-]*):\s*$", line)
        if inside and name:
            current = name.group(1)
            blocks[current] = []
        elif inside and current:
            blocks[current].append(line)
    return {name: "\n".join(lines) for name, lines in blocks.items()}


def test_compose_services_by_reading() -> None:
    blocks = service_blocks()
    assert set(blocks) == SERVICES
    assert "service_completed_successfully" in blocks["pacerd"].split("migrate:", 1)[1]
    assert re.search(r"stop_grace_period: (\d+)s", blocks["pacerd"])
    for name in ("migrate", "worker", "upstream"):  # the image's HEALTHCHECK is pacerd's own
        assert re.search(r"healthcheck:\s*\n\s+disable: true", blocks[name]), name
    assert '"migrate"' in blocks["migrate"]
    assert "pacerd.demo.app:app" in blocks["worker"]
    assert "pacerd.testing.upstream" in blocks["upstream"]
    assert "./deploy/otel-collector.yaml:" in blocks["otel-collector"]


def test_compose_parsed() -> None:
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        pytest.skip("PyYAML is not installed; test_compose_services_by_reading covers the text")
    document = yaml.safe_load(COMPOSE.read_text())
    services = document["services"]
    assert set(services) == SERVICES
    pacerd = services["pacerd"]
    assert pacerd["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert pacerd["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    assert int(str(pacerd["stop_grace_period"]).rstrip("s")) > DRAIN_GRACE_SECONDS
    assert pacerd["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    assert pacerd["command"] == ["run", "-c", "/etc/pacerd/pacerd.toml"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["rabbitmq"]["environment"]["RABBITMQ_DEFAULT_USER"] != "guest"
    for name in ("migrate", "pacerd", "worker", "upstream"):
        assert services[name]["image"] == "pacerd:local"
        assert services[name]["build"]["context"] == "."
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)


def test_collector_sends_traces_to_jaeger() -> None:
    text = (ROOT / "deploy" / "otel-collector.yaml").read_text()
    assert re.search(r"endpoint: 0\.0\.0\.0:4318", text)
    assert re.search(r"otlp/jaeger:\s*\n\s+endpoint: jaeger:4317", text)
    assert re.search(r"traces:\s*\n(\s+\w+: .*\n)*\s+exporters: \[otlp/jaeger\]", text)
