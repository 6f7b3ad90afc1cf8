"""The deployment files: systemd unit, Dockerfile, compose stack, collector,
Prometheus and Grafana configs.

No Docker engine runs here, so the container files are checked by reading them:
the hadolint-style essentials of the Dockerfile; and for the compose stack, that
every command parses with its program's own parser (the ``--app`` and ``-m``
modules import), every environment variable is one its program reads (a valid
config override, an ``OTEL_*`` variable of the SDK for a program that sets up
telemetry, or a name in the program's source), every host:port named in an
environment value or a Prometheus, collector or Grafana config is a service
listening there, and every bind-mounted file exists; and that each party logs
in as its own identity: the PostgreSQL init script and the RabbitMQ definitions
create every user the compose URLs name, with exactly the rights of
``pacerd.roles`` (the init script also runs against the real PostgreSQL). The
systemd unit is checked with ``systemd-analyze`` when it is installed.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import uuid
from dataclasses import dataclass
from importlib.metadata import entry_points, packages_distributions
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, unquote, urlsplit

import anyio
import asyncpg
import opentelemetry.environment_variables as otel_env_api
import opentelemetry.sdk.environment_variables as otel_env_sdk
import pytest
import yaml
from prometheus_client import CollectorRegistry
from support.metrics import exercise_every_metric, grouped_series
from support.services import ADMIN_DSN, dsn_for, with_user

from pacerd import cli, config, daemon, ledger, worker
from pacerd.health import parse_address
from pacerd.roles import (
    DAEMON_BROKER_PERMISSIONS,
    BrokerPermissions,
    RoleNames,
    worker_broker_permissions,
)
from pacerd.telemetry import METRICS, setup_telemetry
from pacerd_demo import app as demo_app

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

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


def test_unit_credentials_example_is_read_by_the_config(tmp_path: Path) -> None:
    """The unit's commented LoadCredential= example, once uncommented, gives pacerd
    its DSN and broker URL from $CREDENTIALS_DIRECTORY."""
    lines = UNIT.read_text().splitlines()
    credentials = {
        line.split("=", 1)[1].split(":")[0]: line.split(":", 1)[1]
        for line in lines if line.startswith("#LoadCredential=")
    }  # fmt: skip
    [environment] = [line for line in lines if line.startswith("#Environment=PACERD_")]
    env = dict(pair.split("=", 1) for pair in environment.removeprefix("#Environment=").split())
    assert set(env.values()) == set(credentials)
    directory = tmp_path / "credentials"
    directory.mkdir()
    (directory / env["PACERD_DATABASE__DSN_FILE"]).write_text("postgresql://p:s3cret@db/pacerd\n")
    (directory / env["PACERD_BROKER__URL_FILE"]).write_text("amqp://p:s3cret@mq/\n")
    cfg = config.load_config(None, {**env, "CREDENTIALS_DIRECTORY": str(directory)})
    assert cfg.database.dsn == "postgresql://p:s3cret@db/pacerd"
    assert cfg.broker.url == "amqp://p:s3cret@mq/"


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
    # liveness only: a broker outage must not get a reconnecting daemon restarted
    url = re.search(r"http://127\.0\.0\.1:(\d+)/livez'", command[2])
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


# -- compose: every name in the stack is one the code it is given to reads ------------

COMPOSE = ROOT / "compose.yaml"
DEPLOY = ROOT / "deploy"
SERVICES = {"postgres", "rabbitmq", "jaeger", "otel-collector", "prometheus", "grafana",
            "migrate", "pacerd", "worker", "upstream", "producer"}  # fmt: skip
PACERD_IMAGE = "pacerd:local"
# What the third-party images listen on and read, from their documentation.
IMAGE_PORTS = {
    "postgres": {5432}, "rabbitmq": {5672, 15672}, "jaegertracing/all-in-one": {4317, 4318, 16686},
    "prom/prometheus": {9090}, "grafana/grafana": {3000},
}  # fmt: skip
IMAGE_ENV_PREFIXES = {
    "postgres": ("POSTGRES_",), "rabbitmq": ("RABBITMQ_DEFAULT_",),
    "jaegertracing/all-in-one": ("COLLECTOR_OTLP_ENABLED",), "grafana/grafana": ("GF_",),
}  # fmt: skip
ANY_INTERFACE = frozenset({"", "0.0.0.0", "::"})
URL = re.compile(r"\b[a-z][a-z0-9+]*://(?:[^/@\s]*@)?([A-Za-z0-9_.-]+):(\d+)")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = load_yaml(COMPOSE)
    return document


def services_of(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose["services"]
    return services


def image_env() -> dict[str, str]:
    """The ENV of the image's final stage (KEY=value pairs)."""
    pairs = " ".join(rest for word, rest in final_stage() if word == "ENV").split()
    return dict(pair.split("=", 1) for pair in pairs)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@dataclass(frozen=True)
class Program:
    """The code a service of the pacerd image runs, and what of the environment it reads."""

    sources: tuple[str, ...]
    reads_config: bool
    reads_otel: bool
    listens: frozenset[int]
    binds: frozenset[str]  # the host part of each address it listens on


def program_of(service: dict[str, Any], env: dict[str, str]) -> Program:
    """Parses the service's command with the program's own argument parser."""
    entrypoint = service.get("entrypoint") or exec_form(final_stage(), "ENTRYPOINT")
    command = [str(part) for part in service.get("command") or exec_form(final_stage(), "CMD")]
    if entrypoint == ["pacerd"]:
        args = cli.build_parser().parse_args(command)
        verb_code: dict[str, Callable[..., Any]] = {
            "run": daemon.main, "worker": worker.main, "migrate": cli._migrate,
        }  # fmt: skip
        assert args.verb in verb_code, f"no check for `pacerd {args.verb}` yet"
        sources = [inspect.getsource(verb_code[args.verb]), inspect.getsource(cli._dispatch)]
        if args.verb == "worker":
            # The app module reads its environment on import: import it afresh with ours.
            os.environ.update({k: v for k, v in env.items() if not k.startswith("PACERD_")})
            app_module = importlib.reload(importlib.import_module(args.app.split(":")[0]))
            app = worker.load_app(args.app)  # the module and attribute exist
            assert app.destinations, f"{args.app} consumes no destination"
            sources.append(inspect.getsource(app_module))
        listens: set[int] = set()
        binds: set[str] = set()
        if args.verb == "run":
            image_defaults = {k: v for k, v in image_env().items() if k != "PACERD_CONFIG"}
            cfg = config.load_config(None, {**image_defaults, **env})
            if cfg.telemetry.http_address:
                bind_host, bind_port = parse_address(cfg.telemetry.http_address)
                listens.add(bind_port)
                binds.add(bind_host or "")
        return Program(
            tuple(sources), True, "setup_telemetry" in sources[0], frozenset(listens),
            frozenset(binds),
        )  # fmt: skip
    assert entrypoint[:2] == ["python", "-m"], entrypoint
    module = importlib.import_module(entrypoint[2])
    args = module.build_parser().parse_args(command)
    if hasattr(module, "params_from_args"):
        module.params_from_args(args)  # the values are valid, not only the flags
    source = inspect.getsource(module)
    port = getattr(args, "port", None)
    host = getattr(args, "host", None)
    return Program(
        (source,), "load_config" in source, "setup_telemetry" in source,
        frozenset({port} if port else set()), frozenset({host} if port and host else set()),
    )  # fmt: skip


def pacerd_image_programs(compose: dict[str, Any]) -> dict[str, tuple[Program, dict[str, str]]]:
    out = {}
    for name, service in services_of(compose).items():
        if service.get("image") == PACERD_IMAGE:
            env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
            try:
                out[name] = (program_of(service, env), env)
            except SystemExit as exc:  # argparse: the usage message went to stderr
                raise AssertionError(f"service {name}: its command does not parse") from exc
            except ImportError as exc:
                raise AssertionError(f"service {name}: {exc}") from exc
    return out


@pytest.fixture(scope="module")
def programs(compose: dict[str, Any]) -> Iterator[dict[str, tuple[Program, dict[str, str]]]]:
    saved = dict(os.environ)
    try:
        yield pacerd_image_programs(compose)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def listening_ports(
    compose: dict[str, Any], programs: dict[str, tuple[Program, dict[str, str]]]
) -> dict[str, set[int]]:
    ports: dict[str, set[int]] = {}
    for name, service in services_of(compose).items():
        image = str(service["image"])
        if name in programs:
            ports[name] = set(programs[name][0].listens)
        elif name == "otel-collector":
            collector = load_yaml(DEPLOY / "otel-collector.yaml")
            endpoints = [
                p["endpoint"] for p in collector["receivers"]["otlp"]["protocols"].values()
            ]
            endpoints.append(collector["exporters"]["prometheus"]["endpoint"])
            ports[name] = {port_of(e) for e in endpoints}
        else:
            [known] = [p for prefix, p in IMAGE_PORTS.items() if image.startswith(prefix + ":")]
            ports[name] = set(known)
    return ports


def test_compose_services_and_images(compose: dict[str, Any]) -> None:
    services = services_of(compose)
    assert set(services) == SERVICES
    for name, service in services.items():
        image = str(service["image"])
        repository, _, tag = image.rpartition(":")
        assert repository, (name, image)
        assert tag not in ("", "latest"), (name, image)
        if image == PACERD_IMAGE:
            assert service["build"]["context"] == "."
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)


def test_compose_commands_run_real_programs(
    programs: dict[str, tuple[Program, dict[str, str]]],
) -> None:
    """`--app`, `python -m` modules and every flag parse with the program's own parser."""
    assert set(programs) == {"migrate", "pacerd", "worker", "upstream", "producer"}
    assert programs["pacerd"][0].listens


def compose_modules(compose: dict[str, Any]) -> set[str]:
    """The modules the stack's services of the pacerd image run (``-m``, ``--app``)."""
    modules = set()
    for service in services_of(compose).values():
        entrypoint = [str(e) for e in service.get("entrypoint") or []]
        if entrypoint[:2] == ["python", "-m"]:
            modules.add(entrypoint[2])
        command = [str(c) for c in service.get("command") or []]
        if "--app" in command:
            modules.add(command[command.index("--app") + 1].split(":")[0])
    return modules


def test_compose_modules_ship_in_the_wheel_the_image_builds(compose: dict[str, Any]) -> None:
    """The image installs the wheel built from what the Dockerfile copies: every
    package a service runs is one the wheel ships and the builder stage copies."""
    modules = compose_modules(compose)
    assert {"pacerd_demo.app", "pacerd_demo.producer", "pacerd.testing.upstream"} <= modules
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    wheel = build["targets"]["wheel"]["packages"]
    copied = {
        part.rstrip("/").removeprefix("./")
        for word, rest in dockerfile_instructions()
        if word == "COPY" and "--from=" not in rest
        for part in rest.split()[:-1]
        if not part.startswith("--")
    }  # fmt: skip
    for module in sorted(modules):
        top = module.split(".")[0]
        assert top in wheel, module
        assert top in copied, module


def test_compose_environment_is_read_by_its_program(
    compose: dict[str, Any], programs: dict[str, tuple[Program, dict[str, str]]]
) -> None:
    otel_names = {
        value for module in (otel_env_sdk, otel_env_api) for key, value in vars(module).items()
        if key.startswith("OTEL_") and isinstance(value, str)
    }  # fmt: skip
    for name, (program, env) in programs.items():
        pacerd_env = {k: v for k, v in env.items() if k.startswith("PACERD_")}
        if pacerd_env:
            assert program.reads_config, (name, sorted(pacerd_env))
            config.load_config(None, pacerd_env)  # ConfigError names an unknown key
        for key in env:
            if key.startswith("PACERD_"):
                continue
            if key.startswith("OTEL_"):
                assert program.reads_otel, (name, key)
                assert key in otel_names, (name, key)
                continue
            assert any(f'"{key}"' in source for source in program.sources), (name, key)
    config.load_config(None, {k: v for k, v in image_env().items() if k != "PACERD_CONFIG"})
    for name, service in services_of(compose).items():
        if name in programs or name == "otel-collector" or name == "prometheus":
            assert name in programs or not service.get("environment"), name
            continue
        prefixes = [p for image, p in IMAGE_ENV_PREFIXES.items()
                    if str(service["image"]).startswith(image + ":")]  # fmt: skip
        for key in service.get("environment") or {}:
            assert prefixes, (name, key)
            assert key.startswith(prefixes[0]), (name, key)


def test_compose_otel_values_select_installed_exporters(
    programs: dict[str, tuple[Program, dict[str, str]]],
) -> None:
    groups = {"OTEL_TRACES_EXPORTER": "opentelemetry_traces_exporter",
              "OTEL_METRICS_EXPORTER": "opentelemetry_metrics_exporter"}  # fmt: skip
    for name, (_program, env) in programs.items():
        for key, group in groups.items():
            for kind in filter(None, env.get(key, "").split(",")):
                plugin = {"otlp": "otlp_proto_http"}.get(kind, kind)
                assert kind in ("none", "prometheus") or entry_points(group=group, name=plugin), (
                    name, key, kind,
                )  # fmt: skip
        assert env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "http/protobuf", name


def test_compose_urls_and_ports_match_listeners(
    compose: dict[str, Any], programs: dict[str, tuple[Program, dict[str, str]]]
) -> None:
    """Every host:port named anywhere is a service listening on that port."""
    services = services_of(compose)
    ports = listening_ports(compose, programs)
    named: list[tuple[str, str, int]] = []  # (where, host, port)
    for name, (_program, env) in programs.items():
        for value in env.values():
            named += [(name, host, int(port)) for host, port in URL.findall(value)]
    upstreams = demo_app.upstreams_from_env(programs["worker"][1])
    assert upstreams, "DEMO_UPSTREAMS names no destination"
    named += [("DEMO_UPSTREAMS", h, int(p)) for v in upstreams.values() for h, p in URL.findall(v)]
    prometheus = load_yaml(DEPLOY / "prometheus.yml")
    for job in prometheus["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                named.append((f"prometheus {job['job_name']}", host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            named += [(f"prometheus {job['job_name']}", n, int(dns["port"])) for n in dns["names"]]
    collector = load_yaml(DEPLOY / "otel-collector.yaml")
    for exporter, settings in collector["exporters"].items():
        if exporter.startswith("otlp"):
            host, port = settings["endpoint"].rsplit(":", 1)
            named.append((f"collector {exporter}", host, int(port)))
    for path in (DEPLOY / "grafana" / "provisioning" / "datasources").glob("*.yaml"):
        for source in load_yaml(path)["datasources"]:
            named += [(path.name, h, int(p)) for h, p in URL.findall(source["url"])]
    expected = {"postgres", "rabbitmq", "otel-collector", "upstream", "pacerd", "jaeger"}
    assert {host for _, host, _ in named} >= {*expected, "prometheus"}
    for where, host, port in named:
        assert host in services, (where, host)
        assert port in ports[host], (where, host, port, ports[host])
        if host in programs:  # reached from other containers: not on loopback only
            assert programs[host][0].binds <= ANY_INTERFACE, (where, host, programs[host][0].binds)
    for name, service in services.items():
        for mapping in service.get("ports", []):
            assert int(str(mapping).rsplit(":", 1)[1]) in ports[name], (name, mapping)
        for exposed in service.get("expose", []):
            assert int(exposed) in ports[name], (name, exposed)
    assert {port_of(image_env()["PACERD_TELEMETRY__HTTP_ADDRESS"])} == ports["pacerd"]


def test_compose_mounts_exist_and_health_dependencies_have_checks(
    compose: dict[str, Any],
) -> None:
    services = services_of(compose)
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)
        depends_on = service.get("depends_on") or {}
        if isinstance(depends_on, list):
            depends_on = {key: {"condition": "service_started"} for key in depends_on}
        for dependency, how in depends_on.items():
            if how.get("condition") == "service_healthy":
                check = services[dependency].get("healthcheck", {})
                assert check.get("test") or services[dependency]["image"] == PACERD_IMAGE, (
                    dependency
                )
                assert not check.get("disable"), dependency
    # the image's HEALTHCHECK is pacerd's own: other programs of the image turn it off
    for name, service in services.items():
        if service["image"] == PACERD_IMAGE and name != "pacerd":
            assert service["healthcheck"] == {"disable": True}, name
    # pacerd keeps the image's liveness check, or names /livez itself
    check = services["pacerd"].get("healthcheck")
    assert check is None or "/livez" in " ".join(check["test"])


def test_compose_pacerd_lifecycle(compose: dict[str, Any]) -> None:
    services = services_of(compose)
    pacerd = services["pacerd"]
    assert pacerd["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert pacerd["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    assert int(str(pacerd["stop_grace_period"]).rstrip("s")) > DRAIN_GRACE_SECONDS
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    # guest may only connect from localhost, not from other containers
    assert "guest" not in {user["name"] for user in definitions(compose)["users"]}
    for name in ("worker", "producer"):
        assert services[name]["depends_on"]["migrate"]["condition"] == (
            "service_completed_successfully"
        )


def test_programs_in_the_image_need_no_extra(
    programs: dict[str, tuple[Program, dict[str, str]]], compose: dict[str, Any]
) -> None:
    """The image installs pacerd without extras: what compose runs imports none of them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    extras = {
        re.split(r"[<>=;\[ ]", d, maxsplit=1)[0].lower()
        for group in project["optional-dependencies"].values() for d in group
    } - required  # fmt: skip
    blocked = sorted(
        top for top, dists in packages_distributions().items()
        if {d.lower() for d in dists} <= extras and top.isidentifier()
    )  # fmt: skip
    modules = {"pacerd.cli", "pacerd.daemon", "pacerd.worker", "pacerd.ledger"}
    modules |= compose_modules(compose)
    script = (
        "import sys, importlib.abc\n"
        f"BLOCKED = set({blocked!r})\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'{name} is not installed in the image')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {sorted(modules)!r}:\n"
        "    importlib.import_module(m)\n"
    )
    env = {**os.environ, "DEMO_UPSTREAMS": programs["worker"][1]["DEMO_UPSTREAMS"]}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
        check=False,
    )  # fmt: skip
    assert "matplotlib" in blocked
    assert run.returncode == 0, run.stderr


# -- Prometheus, alert rules, Grafana ------------------------------------------------

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (Debian: apt-get install prometheus)",
)
GRAFANA = DEPLOY / "grafana"
SCRAPE_LABELS = {"instance", "job", "le"}  # added by Prometheus, or a histogram's buckets


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


@needs_promtool
def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    check = promtool("check", "rules", "alerts.yml", cwd=DEPLOY)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = promtool("test", "rules", "alerts.test.yml", cwd=DEPLOY)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    rules = load_yaml(DEPLOY / "alerts.yml")["groups"][0]["rules"]
    tests = load_yaml(DEPLOY / "alerts.test.yml")["tests"]
    fired = {
        case["alertname"] for test in tests for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }  # fmt: skip
    assert fired == {rule["alert"] for rule in rules}  # every rule has a test where it fires


@needs_promtool
def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    prometheus = load_yaml(DEPLOY / "prometheus.yml")
    mounted = {
        str(v).split(":")[1]: str(v).split(":")[0]
        for v in load_yaml(COMPOSE)["services"]["prometheus"]["volumes"]
    }  # fmt: skip
    # rule files are named by their path in the container: check the files mounted there
    for index, path in enumerate(prometheus["rule_files"]):
        source = ROOT / mounted[path]
        (tmp_path / source.name).write_text(source.read_text())
        prometheus["rule_files"][index] = str(tmp_path / source.name)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus))
    check = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


def scrape_every_metric() -> dict[str, set[str]]:
    """Each Prometheus series name a telemetry instance exports, with its labels,
    after recording a value for every metric pacerd has, for a destination with
    series of its own and for one whose series are its group's."""
    registry = CollectorRegistry()
    tel = setup_telemetry(
        "pacerd", "info", "json", metric_readers=[], prometheus=True,
        prometheus_registry=registry, log_stream=io.StringIO(), instance="h:1",
        series=grouped_series,
    )  # fmt: skip
    try:
        exercise_every_metric(tel, "llm")
        families = list(registry.collect())
    finally:
        tel.shutdown(timeout_seconds=2)
    family_names = {family.name for family in families}
    for metric in METRICS:  # so a metric added to telemetry.py is recorded above too
        assert any(f.startswith(metric.replace(".", "_")) for f in family_names), metric
    series: dict[str, set[str]] = {"up": set()}
    for family in families:
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard panel, template variable and alert rule."""
    found: list[tuple[str, str]] = []
    dashboard = json.loads((GRAFANA / "dashboards" / "pacerd.json").read_text())
    for panel in dashboard["panels"]:
        found += [(panel["title"], target["expr"]) for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        found.append((f"${variable['name']}", variable["definition"]))
    for group in load_yaml(DEPLOY / "alerts.yml")["groups"]:
        found += [(rule["alert"], rule["expr"]) for rule in group["rules"]]
    return found


def test_dashboard_and_rules_query_only_what_pacerd_exports() -> None:
    series = scrape_every_metric()
    labels = set().union(*series.values()) | SCRAPE_LABELS
    selector = re.compile(r"\b(pacerd_\w+|up)\s*(?:\{([^}]*)\})?")
    for where, expr in queries():
        names = [match.group(1) for match in selector.finditer(expr)]
        assert names, (where, expr)
        for match in selector.finditer(expr):
            name, matchers = match.group(1), match.group(2) or ""
            assert name in series, (where, name)
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                assert label in series[name] | SCRAPE_LABELS, (where, name, label)
        for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            for label in filter(None, (part.strip() for part in grouping.split(","))):
                assert label in labels, (where, label)
    rules_text = (DEPLOY / "alerts.yml").read_text()
    legends = (GRAFANA / "dashboards" / "pacerd.json").read_text()
    for label in re.findall(r"\$labels\.(\w+)", rules_text) + re.findall(r"\{\{(\w+)\}\}", legends):
        assert label in labels, label


def test_grafana_provisioning_matches_compose() -> None:
    grafana = load_yaml(COMPOSE)["services"]["grafana"]
    mounts = dict(str(v).split(":")[:2] for v in grafana["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    [provider] = load_yaml(GRAFANA / "provisioning" / "dashboards" / "pacerd.yaml")["providers"]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    [source] = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yaml")[
        "datasources"
    ]
    dashboard = json.loads((GRAFANA / "dashboards" / "pacerd.json").read_text())
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/pacerd.json"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    uids = {
        target["datasource"]["uid"] for panel in dashboard["panels"]
        for target in [panel, *panel["targets"]]
    }  # fmt: skip
    assert uids == {source["uid"]}


def test_collector_pipelines_reach_jaeger_and_prometheus() -> None:
    collector = load_yaml(DEPLOY / "otel-collector.yaml")
    pipelines = collector["service"]["pipelines"]
    exporters = collector["exporters"]
    assert [exporters[e]["endpoint"] for e in pipelines["traces"]["exporters"]] == ["jaeger:4317"]
    assert pipelines["metrics"]["exporters"] == ["prometheus"]
    for pipeline in pipelines.values():
        assert set(pipeline["receivers"]) <= set(collector["receivers"])
        assert set(pipeline.get("processors", [])) <= set(collector["processors"])
        assert set(pipeline["exporters"]) <= set(exporters)


# -- compose: each party on its own role and broker user -------------------------------

PG_INIT_DIR = "/docker-entrypoint-initdb.d"


def mounts_of(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> file in the repository, for the service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith("./"):
            out[target] = ROOT / source
    return out


def init_scripts(compose: dict[str, Any]) -> list[Path]:
    mounts = mounts_of(services_of(compose)["postgres"])
    scripts = [path for target, path in sorted(mounts.items()) if target.startswith(PG_INIT_DIR)]
    assert scripts, "no init script is mounted into the postgres image"
    return scripts


def init_sql(compose: dict[str, Any]) -> str:
    return "\n".join(path.read_text() for path in init_scripts(compose))


def definitions(compose: dict[str, Any]) -> dict[str, Any]:
    rabbitmq = services_of(compose)["rabbitmq"]
    mounts = mounts_of(rabbitmq)
    conf = {
        key.strip(): value.strip()
        for target, path in mounts.items() if target.startswith("/etc/rabbitmq/conf.d/")
        for line in path.read_text().splitlines() if "=" in line and not line.startswith("#")
        for key, value in [line.split("=", 1)]
    }  # fmt: skip
    assert "load_definitions" in conf, "rabbitmq.conf loads no definitions file"
    document: dict[str, Any] = json.loads(mounts[conf["load_definitions"]].read_text())
    return document


def service_url(compose: dict[str, Any], service: str, key: str) -> SplitResult:
    return urlsplit(str(services_of(compose)[service]["environment"][key]))


DSN_KEY = "PACERD_DATABASE__DSN"
AMQP_KEY = "PACERD_BROKER__URL"


def created_login(sql: str, user: str) -> str:
    """The CREATE ROLE statement of ``user``, which must be a LOGIN role."""
    [statement] = re.findall(rf"CREATE ROLE {re.escape(user)}\b[^;]*;", sql)
    assert " LOGIN " in statement, statement
    return str(statement)


def test_compose_logins_are_created_each_with_its_role(compose: dict[str, Any]) -> None:
    sql = init_sql(compose)
    names = RoleNames()
    owner = service_url(compose, "pacerd", DSN_KEY)
    assert service_url(compose, "migrate", DSN_KEY) == owner
    owner_role = created_login(sql, str(owner.username))
    assert "NOSUPERUSER" in owner_role, owner_role
    assert f"PASSWORD '{owner.password}'" in owner_role
    database = owner.path.lstrip("/")
    assert re.search(rf"CREATE DATABASE {database} OWNER {owner.username};", sql)
    for service, role in (("worker", names.worker), ("producer", names.producer)):
        url = service_url(compose, service, DSN_KEY)
        assert url.path == owner.path, service
        assert url.username not in (owner.username, "postgres"), service
        statement = created_login(sql, str(url.username))
        assert f"PASSWORD '{url.password}'" in statement, service
        assert statement.endswith(f" IN ROLE {role};"), (service, statement)
    for role in (names.producer, names.worker, names.operator):
        assert f"'{role}'" in sql, role  # created NOLOGIN before the logins join it
    # the superuser the image creates is not what pacerd's programs log in as
    superuser = services_of(compose)["postgres"]["environment"]["POSTGRES_USER"]
    assert superuser != owner.username


def test_compose_broker_users_have_the_minimal_permissions(compose: dict[str, Any]) -> None:
    defs = definitions(compose)
    assert not any(k.startswith("RABBITMQ_DEFAULT_")
                   for k in services_of(compose)["rabbitmq"].get("environment") or {})  # fmt: skip
    users = {user["name"]: user for user in defs["users"]}
    assert "guest" not in users
    permissions = {(p["user"], p["vhost"]): p for p in defs["permissions"]}
    daemon_url = service_url(compose, "pacerd", AMQP_KEY)
    worker_url = service_url(compose, "worker", AMQP_KEY)
    assert daemon_url.username != worker_url.username
    for url, expected in (
        (daemon_url, DAEMON_BROKER_PERMISSIONS),
        (worker_url, worker_broker_permissions()),
    ):
        vhost = unquote(url.path.lstrip("/")) or "/"
        assert {"name": vhost} in [{"name": v["name"]} for v in defs["vhosts"]]
        assert users[str(url.username)]["tags"] == [], url.username
        granted = permissions[(str(url.username), vhost)]
        assert (
            BrokerPermissions(
                configure=granted["configure"], write=granted["write"], read=granted["read"]
            )
            == expected
        ), url.username
        assert [p for p in defs["permissions"] if p["user"] == url.username] == [granted]
    # an administrator for the management UI, who is neither the daemon nor a worker
    admins = [u for u in users.values() if "administrator" in u["tags"]]
    assert admins
    assert {u["name"] for u in admins}.isdisjoint({daemon_url.username, worker_url.username})


def rabbit_sha256_verifies(password_hash: str, password: str) -> bool:
    """RabbitMQ's rabbit_password_hashing_sha256: base64(salt + sha256(salt + password)),
    with a 4-byte salt."""
    raw = base64.b64decode(password_hash)
    salt, digest = raw[:4], raw[4:]
    return len(raw) == 36 and hashlib.sha256(salt + password.encode()).digest() == digest


def test_compose_broker_passwords_match_the_definitions(compose: dict[str, Any]) -> None:
    users = {user["name"]: user for user in definitions(compose)["users"]}
    for service in ("pacerd", "worker"):
        url = service_url(compose, service, AMQP_KEY)
        user = users[str(url.username)]
        assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256"
        assert rabbit_sha256_verifies(user["password_hash"], str(url.password)), service
        assert not rabbit_sha256_verifies(user["password_hash"], f"{url.password}x")


@pytest.mark.services
async def test_compose_init_sql_lets_the_owner_migrate_and_the_producer_schedule(
    compose: dict[str, Any],
) -> None:
    """The init script, run in a fresh database with the logins renamed (roles are
    cluster-wide), lets its owner login migrate; its producer login may schedule
    and not write a table, its worker login may report and not schedule."""
    sql = init_sql(compose)
    owner = service_url(compose, "pacerd", DSN_KEY)
    worker_url = service_url(compose, "worker", DSN_KEY)
    producer_url = service_url(compose, "producer", DSN_KEY)
    tag = uuid.uuid4().hex[:10]
    logins = [str(url.username) for url in (owner, worker_url, producer_url)]
    # the owner and its database may share a name: one new name serves both
    olds = sorted({*logins, owner.path.lstrip("/")})
    renamed = {old: f"pacerd_c{i}_{tag}" for i, old in enumerate(olds)}
    for old, new in renamed.items():
        sql = re.sub(rf"(?<![\w']){re.escape(old)}(?![\w'])", new, sql)
    # the names this test gives are the only ones left that it may drop
    for old in renamed:
        assert not re.search(rf"(?<![\w']){re.escape(old)}(?![\w'])", sql), old
    database = renamed[owner.path.lstrip("/")]
    dsn = dsn_for(database)
    try:
        run = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-d", ADMIN_DSN],
                input=sql, capture_output=True, text=True, timeout=60, check=False,
            )
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        await ledger.migrate(with_user(dsn, renamed[str(owner.username)]))
        producer = await asyncpg.connect(with_user(dsn, renamed[str(producer_url.username)]))
        try:
            job = await producer.fetchval("SELECT pacerd.schedule('c-1', 'k', 'compose', '{}')")
            assert job is not None
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await producer.execute("UPDATE pacerd.jobs SET attempt = attempt")
        finally:
            await producer.close()
        worker_conn = await asyncpg.connect(with_user(dsn, renamed[str(worker_url.username)]))
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await worker_conn.fetchval("SELECT pacerd.schedule('c-2', 'k', 'compose', '{}')")
        finally:
            await worker_conn.close()
    finally:
        admin = await asyncpg.connect(ADMIN_DSN)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            for login in logins:
                await admin.execute(f"DROP ROLE IF EXISTS {renamed[login]}")
        finally:
            await admin.close()
