"""The configuration: a TOML file plus ``PACERD_<SECTION>__<KEY>`` environment
overrides, validated into one frozen ``Config``.

``load_config`` reports every problem at once (key path, offending value, why)
by raising ``ConfigError``; the daemon exits with ``EX_CONFIG`` and
``pacerd check-config`` runs the same code. The only I/O here is reading the
file and the secret files it names: ``dsn_file``, ``url_file`` and
``password_file`` take the DSN, the broker URL or just their password from a
file (a systemd credential, a container secret), so the secret never sits in
the TOML or the environment. A secret's value never appears in a problem.
The ``[pacing]`` keys mirror ``pacerd.pacer.PacingParams`` field for field,
defaults included, so the two cannot drift.

``Config.route_for`` is the one place that says where a destination's ready
work goes (queue and routing key): its own queue, or its group's shared one
(the first ``[groups.NAME]`` in file order whose ``match`` glob fits it).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import json
import os
import re
import socket
import tomllib
import types
from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pacerd.errors import ConfigError
from pacerd.pacer import PacingParams

EX_CONFIG = 78  # sysexits.h: configuration error
DEFAULT_CONFIG_PATH = "/etc/pacerd/pacerd.toml"
ENV_PREFIX = "PACERD_"
DESTINATION_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$"
RESTART_KEYS = (
    "database.",
    "broker.",
    "pacing.mode",
    "reconcile.",
    "telemetry.http_address",
    "telemetry.service_name",
    "telemetry.destination_series",
    "telemetry.log_format",
    "daemon.",
)  # prefixes a HUP reload cannot apply

CREDENTIALS_DIRECTORY = "CREDENTIALS_DIRECTORY"  # set by systemd's LoadCredential=
# (section, file key, key it fills, what the file holds)
SECRET_FILES = (
    ("database", "dsn_file", "dsn", "url"),
    ("database", "password_file", "dsn", "password"),
    ("broker", "url_file", "url", "url"),
    ("broker", "password_file", "url", "password"),
)

_P = PacingParams()
_NO_VALUE = object()  # a problem whose value is not worth repeating
_Tick = Annotated[float, Field(gt=0, le=60)]
_Positive = Annotated[float, Field(gt=0)]
_NonNegative = Annotated[float, Field(ge=0)]
_OpenFraction = Annotated[float, Field(gt=0, lt=1)]  # (0, 1)
_Margin = Annotated[float, Field(ge=0, lt=1)]  # [0, 1)
_Share = Annotated[float, Field(ge=0, le=1)]  # [0, 1]
_Resume = Annotated[float, Field(gt=0, le=1)]  # (0, 1]
_Factor = Annotated[float, Field(ge=1)]
_Count = Annotated[int, Field(ge=1)]
_DestinationName = Annotated[str, StringConstraints(pattern=DESTINATION_NAME_PATTERN)]
READY_QUEUE_PREFIX = "pacerd.ready."
# What a ``match`` glob may hold: destination-name characters and * ? [ ] !
_GLOB_CHARACTERS = re.compile(r"[A-Za-z0-9_.:\-*?\[\]!]+")


def ready_queue_name(name: str) -> str:
    """The default ready queue of a destination or a group: ``pacerd.ready.<name>``."""
    return READY_QUEUE_PREFIX + name


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReadyRoute:
    """Where a destination's ready work goes: ``queue``, bound to ``pacerd.ready``
    with ``routing_key`` (the destination's name, or its group's)."""

    queue: str
    routing_key: str
    group: str | None = None


def _check_glob(value: str) -> str:
    """``value`` if it is a glob (or a plain name) over destination names, else ValueError."""
    if not _GLOB_CHARACTERS.fullmatch(value):
        raise ValueError(
            'must be a glob such as "tenant-*" made of destination-name characters'
            " (A-Z a-z 0-9 _ . : -) and * ? [ ] !"
        )
    if value.count("[") != value.count("]") or re.search(r"\[!?\]", value):
        raise ValueError("has an unclosed or empty [...] set")
    try:
        re.compile(fnmatch.translate(value))
    except re.error as exc:
        raise ValueError(f"is not a valid glob ({exc})") from None
    return value


def _cross_field(key: str, value: object, rule: str) -> PydanticCustomError:
    return PydanticCustomError(
        "cross_field", "{key}: {rule}", {"key": key, "value": value, "rule": rule}
    )


class _Section(BaseModel):
    # strict: TOML is typed, so "8" for an int is a mistake; env strings are parsed first
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class DatabaseConfig(_Section):
    dsn: str = "postgresql://postgres@127.0.0.1:5432/test"
    dsn_file: str = ""  # a file holding the whole DSN, used instead of dsn
    password_file: str = ""  # a file holding the password to put in the DSN
    pool_max_size: Annotated[int, Field(ge=2, le=100)] = 8
    connect_timeout_seconds: _Positive = 10.0

    @field_validator("dsn")
    @classmethod
    def _postgres_url(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL")
        return value


class BrokerConfig(_Section):
    url: str = "amqp://guest:guest@127.0.0.1:5672/"
    url_file: str = ""  # a file holding the whole URL, used instead of url
    password_file: str = ""  # a file holding the password to put in the URL
    queue_type: Literal["quorum", "classic"] = "quorum"
    publish_timeout_seconds: _Positive = 10.0
    declare_queues: bool = True
    outcome_prefetch: Annotated[int, Field(ge=1, le=65535)] = 500

    @field_validator("url")
    @classmethod
    def _amqp_url(cls, value: str) -> str:
        if not value.startswith(("amqp://", "amqps://")):
            raise ValueError("must be an amqp:// or amqps:// URL")
        return value


class PacingConfig(_Section):
    mode: Literal["active", "shadow"] = "active"
    tick_seconds: _Tick = _P.tick_seconds
    initial_rate: _Positive = _P.initial_rate
    min_rate: _Positive = _P.min_rate
    max_rate: _Positive = _P.max_rate
    increase_step: _Positive = _P.increase_step
    decrease_factor: _OpenFraction = _P.decrease_factor
    decrease_margin: _Margin = _P.decrease_margin
    refusal_threshold: _OpenFraction = _P.refusal_threshold
    max_inflight: _Count = _P.max_inflight
    live_share: _Share = _P.live_share
    live_window_seconds: _NonNegative = _P.live_window_seconds
    slow_start_factor: _Factor = _P.slow_start_factor
    refusal_min_count: _Count = _P.refusal_min_count
    ceiling_resume_fraction: _Resume = _P.ceiling_resume_fraction

    @model_validator(mode="after")
    def _rates_ordered(self) -> PacingConfig:
        if self.min_rate > self.max_rate:
            raise _cross_field(
                "min_rate", self.min_rate, f"must be at most max_rate ({self.max_rate!r})"
            )
        if not self.min_rate <= self.initial_rate <= self.max_rate:
            raise _cross_field(
                "initial_rate",
                self.initial_rate,
                f"must be between min_rate ({self.min_rate!r}) and max_rate ({self.max_rate!r})",
            )
        return self

    def params(self) -> PacingParams:
        return PacingParams(**self.model_dump(exclude={"mode"}))


class DestinationConfig(_Section):
    """Per-destination overrides of ``[pacing]`` (None = inherit) and the queue."""

    queue: Annotated[str, Field(min_length=1)] | None = None  # None: pacerd.ready.<destination>
    tick_seconds: _Tick | None = None
    initial_rate: _Positive | None = None
    min_rate: _Positive | None = None
    max_rate: _Positive | None = None
    increase_step: _Positive | None = None
    decrease_factor: _OpenFraction | None = None
    decrease_margin: _Margin | None = None
    refusal_threshold: _OpenFraction | None = None
    max_inflight: _Count | None = None
    live_share: _Share | None = None
    live_window_seconds: _NonNegative | None = None
    slow_start_factor: _Factor | None = None
    refusal_min_count: _Count | None = None
    ceiling_resume_fraction: _Resume | None = None


class GroupConfig(DestinationConfig):
    """``[groups.NAME]``: every destination whose name fits ``match`` takes these
    ``[pacing]`` keys as defaults and shares ``queue`` (None: pacerd.ready.<NAME>)."""

    match: str  # an fnmatch glob over destination names, case-sensitive

    @field_validator("match")
    @classmethod
    def _glob(cls, value: str) -> str:
        return _check_glob(value)


class LeasesConfig(_Section):
    claim_seconds: _Positive = 30.0
    offer_seconds: _Positive = 300.0


class RetryConfig(_Section):
    max_attempts: Annotated[int, Field(ge=1, le=1000)] = 10
    backoff_base_seconds: _Positive = 1.0
    backoff_cap_seconds: _Positive = 3600.0
    payload_max_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = 262144

    @model_validator(mode="after")
    def _cap_above_base(self) -> RetryConfig:
        if self.backoff_cap_seconds < self.backoff_base_seconds:
            raise _cross_field(
                "backoff_cap_seconds",
                self.backoff_cap_seconds,
                f"must be at least backoff_base_seconds ({self.backoff_base_seconds!r})",
            )
        return self


class ReconcileConfig(_Section):
    interval_seconds: _Positive = 5.0
    batch_size: Annotated[int, Field(ge=1, le=100_000)] = 1000


class DaemonConfig(_Section):
    shutdown_grace_seconds: _NonNegative = 10.0
    instance_name: str = ""  # empty: hostname:pid, chosen at run time


class TelemetryConfig(_Section):
    service_name: str = "pacerd"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    http_address: str = ""  # empty: no /healthz or /metrics listener
    # names or globs of grouped destinations that keep series of their own
    destination_series: tuple[str, ...] = ()

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("http_address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if value and not (host and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError("must be empty or host:port with port 1..65535")
        return value

    @field_validator("destination_series", mode="before")
    @classmethod
    def _a_list(cls, value: object) -> object:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError('must be a list of names or globs, e.g. ["tenant-0042"]')
        return tuple(value)  # TOML arrays are lists

    @field_validator("destination_series")
    @classmethod
    def _names_or_globs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            try:
                _check_glob(item)
            except ValueError as exc:
                raise ValueError(f"{item!r} {exc}") from None
        return value


class Config(_Section):
    database: DatabaseConfig = DatabaseConfig()
    broker: BrokerConfig = BrokerConfig()
    pacing: PacingConfig = PacingConfig()
    leases: LeasesConfig = LeasesConfig()
    retry: RetryConfig = RetryConfig()
    reconcile: ReconcileConfig = ReconcileConfig()
    daemon: DaemonConfig = DaemonConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    groups: dict[_DestinationName, GroupConfig] = Field(default_factory=dict)
    destinations: dict[_DestinationName, DestinationConfig] = Field(default_factory=dict)

    @field_validator("groups")
    @classmethod
    def _groups_fit_pacing(
        cls, value: dict[str, GroupConfig], info: ValidationInfo
    ) -> dict[str, GroupConfig]:
        pacing = info.data.get("pacing")
        if pacing is None:  # [pacing] itself is invalid and reported
            return value
        problems: list[str] = []
        for name, group in value.items():
            try:
                _overlay(pacing, group)
            except ValidationError as exc:
                problems += _problems(exc, prefix=("groups", name))
        if problems:
            raise PydanticCustomError(
                "destination_pacing", "{problems}", {"problems": "\n".join(problems)}
            )
        return value

    @field_validator("destinations")
    @classmethod
    def _destinations_fit_pacing(
        cls, value: dict[str, DestinationConfig], info: ValidationInfo
    ) -> dict[str, DestinationConfig]:
        pacing = info.data.get("pacing")
        if pacing is None:  # [pacing] itself is invalid and reported
            return value
        groups: dict[str, GroupConfig] = info.data.get("groups") or {}
        problems: list[str] = []
        for name, overrides in value.items():
            group = _group_of(tuple((g, c.match) for g, c in groups.items()), name)
            if group is not None and overrides.queue is not None:
                problems.append(
                    _problem(
                        ("destinations", name, "queue"),
                        overrides.queue,
                        f"{name} is in group {group} (match = {groups[group].match!r}) and"
                        f" shares its queue; set queue in [groups.{group}] instead",
                        None,
                    )
                )
            if group is None and name in groups:
                problems.append(
                    _problem(
                        ("destinations", name),
                        _NO_VALUE,
                        f"is named like group {name} but outside its match"
                        f" ({groups[name].match!r}): both would use routing key {name!r}",
                        None,
                    )
                )
            try:
                base = pacing if group is None else _overlay(pacing, groups[group])
                _overlay(base, overrides)
            except ValidationError as exc:
                problems += _problems(exc, prefix=("destinations", name))
        if problems:
            raise PydanticCustomError(
                "destination_pacing", "{problems}", {"problems": "\n".join(problems)}
            )
        return value

    def group_for(self, destination: str) -> str | None:
        """The first group, in file order, whose ``match`` fits ``destination``."""
        return _group_of(tuple((g, c.match) for g, c in self.groups.items()), destination)

    def series_for(self, destination: str) -> tuple[str, str]:
        """The metric attribute ``destination``'s series are reported under:
        ``("group", NAME)`` for a destination of a group, unless
        ``[telemetry] destination_series`` names it (or a glob there fits it);
        else ``("destination", destination)``."""
        group = self.group_for(destination)
        if group is None or _fits_any(self.telemetry.destination_series, destination):
            return ("destination", destination)
        return ("group", group)

    def pacing_for(self, destination: str) -> PacingParams:
        """``[pacing]``, overlaid with the destination's group's keys, then with
        ``[destinations.<destination>]``, if any."""
        group = self.group_for(destination)
        pacing = self.pacing if group is None else _overlay(self.pacing, self.groups[group])
        overrides = self.destinations.get(destination)
        return (pacing if overrides is None else _overlay(pacing, overrides)).params()

    def route_for(self, destination: str) -> ReadyRoute:
        """Where ``destination``'s ready work is published and consumed."""
        group = self.group_for(destination)
        if group is not None:
            return self.route_for_group(group)
        overrides = self.destinations.get(destination)
        own = overrides.queue if overrides is not None else None
        return ReadyRoute(queue=own or ready_queue_name(destination), routing_key=destination)

    def route_for_group(self, group: str) -> ReadyRoute:
        """The shared queue of ``[groups.<group>]`` (KeyError if there is none)."""
        queue = self.groups[group].queue or ready_queue_name(group)
        return ReadyRoute(queue=queue, routing_key=group, group=group)

    def queue_for(self, destination: str) -> str:
        return self.route_for(destination).queue

    def redacted_dsn(self) -> str:
        return _redact(self.database.dsn)

    def redacted_broker_url(self) -> str:
        return _redact(self.broker.url)

    def masked(self) -> dict[str, Any]:
        """Every key with its effective value, the DSN and broker passwords masked."""
        tree = self.model_dump(mode="json")
        tree["database"]["dsn"] = self.redacted_dsn()
        tree["broker"]["url"] = self.redacted_broker_url()
        return tree


_SECTIONS: dict[str, type[_Section]] = {
    "database": DatabaseConfig,
    "broker": BrokerConfig,
    "pacing": PacingConfig,
    "leases": LeasesConfig,
    "retry": RetryConfig,
    "reconcile": ReconcileConfig,
    "daemon": DaemonConfig,
    "telemetry": TelemetryConfig,
    "destinations": DestinationConfig,
    "groups": GroupConfig,
}
_NAMED_SECTIONS = ("destinations", "groups")  # [section.NAME] tables


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReloadDiff:
    changed: list[str]  # key paths whose value changed
    needs_restart: list[str]  # those among changed that a reload cannot apply


def _overlay(pacing: PacingConfig, overrides: DestinationConfig) -> PacingConfig:
    keys = overrides.model_dump(exclude={"queue", "match"}, exclude_none=True)
    return PacingConfig.model_validate(pacing.model_dump() | keys)


@functools.lru_cache(maxsize=65536)
def _group_of(globs: tuple[tuple[str, str], ...], destination: str) -> str | None:
    """The first ``(group, glob)`` of ``globs`` that fits ``destination``."""
    return next((g for g, glob in globs if fnmatch.fnmatchcase(destination, glob)), None)


@functools.lru_cache(maxsize=65536)
def _fits_any(globs: tuple[str, ...], destination: str) -> bool:
    return any(fnmatch.fnmatchcase(destination, glob) for glob in globs)


def instance_name(cfg: Config) -> str:
    """This process's name in logs, metrics and leadership records:
    ``[daemon] instance_name``, else ``host:pid``."""
    return cfg.daemon.instance_name or f"{socket.gethostname()}:{os.getpid()}"


def default_config_path(environ: Mapping[str, str] | None = None) -> str:
    return (os.environ if environ is None else environ).get("PACERD_CONFIG") or DEFAULT_CONFIG_PATH


def load_config(
    path: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None
) -> Config:
    """Read ``path`` (None: no file), apply the environment, validate; raise
    ``ConfigError`` listing every problem."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            problems.append(f"{os.fspath(path)}: file not found")
        except OSError as exc:
            problems.append(f"{os.fspath(path)}: cannot be read ({exc.strerror})")
        except tomllib.TOMLDecodeError as exc:
            problems.append(f"{os.fspath(path)}: TOML syntax error: {exc}")
    readable = not problems
    env_sources = _apply_environ(data, environ, problems)
    # relative to the config file's folder; with no file, to the working
    # directory ("": open() resolves it, and no getcwd runs on an event loop)
    base = environ.get(CREDENTIALS_DIRECTORY) or (
        os.path.dirname(os.fspath(path)) if path is not None else ""
    )
    file_sources = _read_secret_files(data, base, problems)
    if readable:
        try:
            config = Config.model_validate(data)
        except ValidationError as exc:
            problems += _problems(
                exc, env_sources=env_sources | file_sources, hidden=file_sources.keys()
            )
        else:
            if not problems:
                return config
    raise ConfigError(problems, source="configuration" if path is None else os.fspath(path))


def reload_diff(old: Config, new: Config) -> ReloadDiff:
    before, after = _flatten(old.model_dump()), _flatten(new.model_dump())
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return ReloadDiff(
        changed=changed, needs_restart=[k for k in changed if k.startswith(RESTART_KEYS)]
    )


def _apply_environ(
    data: dict[str, Any], environ: Mapping[str, str], problems: list[str]
) -> dict[tuple[str, ...], str]:
    """Write ``PACERD_<SECTION>__<KEY>`` values into ``data``; return loc -> variable."""
    sources: dict[tuple[str, ...], str] = {}
    for var, raw in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue  # PACERD_CONFIG and friends are not overrides
        section, _, rest = var[len(ENV_PREFIX) :].lower().partition("__")
        named = section in _NAMED_SECTIONS
        name, _, key = rest.rpartition("__") if named else ("", "", rest)
        loc = (section, name, key) if name else (section, key)
        if section not in _SECTIONS:
            problems.append(
                _problem(loc, raw, "unknown section" + _suggest(section, _SECTIONS), var)
            )
            continue
        model = _SECTIONS[section]
        if not key or named != bool(name):
            problems.append(
                f"{var}: expected PACERD_<SECTION>__<KEY>, PACERD_DESTINATIONS__<NAME>__<KEY>"
                " or PACERD_GROUPS__<NAME>__<KEY>"
            )
            continue
        if key not in model.model_fields:
            problems.append(
                _problem(loc, raw, "unknown key" + _suggest(key, model.model_fields), var)
            )
            continue
        try:
            value = _parse_env(raw, model.model_fields[key].annotation)
        except ValueError as exc:
            problems.append(_problem(loc, raw, str(exc), var))
            continue
        table = data.setdefault(section, {})
        if name and isinstance(table, dict):
            name = next((n for n in table if n.lower() == name), name)
            loc = (section, name, key)
            table = table.setdefault(name, {})
        if isinstance(table, dict):  # else the file's own type error is reported
            table[key] = value
            sources[loc] = var
    return sources


def _read_secret_files(
    data: dict[str, Any], base: str, problems: list[str]
) -> dict[tuple[str, ...], str]:
    """Fill ``dsn``/``url`` from the ``*_file`` keys in ``data`` (a file wins over
    the key it fills); return loc -> source.

    A relative path is taken from ``base``: ``$CREDENTIALS_DIRECTORY`` when
    systemd set it, else the config file's directory. One trailing newline is
    dropped. Problems name the file, never its content."""
    sources: dict[tuple[str, ...], str] = {}
    for section, file_key, key, holds in SECRET_FILES:
        table = data.get(section)
        if not isinstance(table, dict) or not table.get(file_key):
            continue
        file_path = table[file_key]
        if not isinstance(file_path, str):
            continue  # the type error is reported by validation
        loc = (section, file_key)
        full = os.path.join(base, os.path.expanduser(file_path))
        try:
            with open(full, encoding="utf-8") as f:
                secret = f.read().removesuffix("\n").removesuffix("\r")
        except OSError as exc:
            problems.append(_problem(loc, file_path, f"cannot be read ({exc.strerror})", None))
            continue
        except UnicodeDecodeError:
            problems.append(_problem(loc, file_path, "is not UTF-8 text", None))
            continue
        if not secret.strip():
            problems.append(_problem(loc, file_path, "is empty", None))
            continue
        if holds == "url":
            table[key] = secret.strip()
        else:
            url = table.get(key, _SECTIONS[section].model_fields[key].default)
            with_password = _with_password(url, secret) if isinstance(url, str) else None
            if with_password is None:
                why = f"needs a user name in {section}.{key} to go with the password"
                problems.append(_problem(loc, file_path, why, None))
                continue
            table[key] = with_password
        sources[(section, key)] = f"{section}.{file_key}: {full}"
    return sources


def _with_password(url: str, password: str) -> str | None:
    """``url`` with its password set (percent-encoded); None if it names no user."""
    parts = urlsplit(url)
    if not parts.username:
        return None
    host = parts.netloc.rpartition("@")[2]
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def _parse_env(raw: str, annotation: Any) -> object:
    if get_origin(annotation) in (Union, types.UnionType):  # X | None
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (tuple, list):  # a list of names: comma-separated
        return [part.strip() for part in raw.split(",") if part.strip()]
    if annotation is bool:
        flags = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
        if raw.strip().lower() not in flags:
            raise ValueError("must be a boolean (true/false/1/0/yes/no)")
        return flags[raw.strip().lower()]
    if annotation in (int, float):
        try:
            return annotation(raw)
        except ValueError:
            kind = "an integer" if annotation is int else "a number"
            raise ValueError(f"must be {kind}") from None
    return raw


def _problems(
    exc: ValidationError,
    prefix: tuple[str, ...] = (),
    env_sources: Mapping[tuple[str, ...], str] | None = None,
    hidden: Collection[tuple[str, ...]] = (),
) -> list[str]:
    """One readable line per pydantic error: ``path = value: why``; the value is
    left out for ``hidden`` locations (read from a secret file)."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc, value, kind = prefix + tuple(str(p) for p in err["loc"]), err["input"], err["type"]
        ctx = err.get("ctx", {})
        if kind == "destination_pacing":
            lines += str(ctx["problems"]).splitlines()
            continue
        if kind == "cross_field":
            loc, value, why = (*loc, str(ctx["key"])), ctx["value"], str(ctx["rule"])
        elif kind == "extra_forbidden":
            parent = Config if len(loc) == 1 else _SECTIONS.get(loc[0], Config)
            section = len(loc) == 1 and isinstance(value, dict)
            why = ("unknown section" if section else "unknown key") + _suggest(
                loc[-1], parent.model_fields
            )
        elif loc and loc[-1] == "[key]":
            loc, value = loc[:-1], _NO_VALUE
            what = "group" if loc[:1] == ("groups",) else "destination"
            why = f"invalid {what} name, must match {DESTINATION_NAME_PATTERN}"
        elif kind == "missing":
            value, why = _NO_VALUE, "is required"
        elif kind in ("model_type", "dict_type"):
            why = "must be a table"
        else:
            why = re.sub(
                r"^(Input|String) should ", "must ", err["msg"].removeprefix("Value error, ")
            )
        if loc in hidden:
            value = _NO_VALUE
        lines.append(_problem(loc, value, why, (env_sources or {}).get(loc)))
    return lines


_SECRET_LOCS = {("database", "dsn"), ("broker", "url")}


def _path(loc: tuple[str, ...]) -> str:
    """``("destinations", "a.b", "min_rate")`` -> ``destinations."a.b".min_rate``."""
    return ".".join(p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else json.dumps(p) for p in loc)


def _problem(loc: tuple[str, ...], value: object, why: str, env_var: str | None) -> str:
    path = _path(loc)
    if loc in _SECRET_LOCS and isinstance(value, str):
        value = _redact(value)
    shown = "" if value is _NO_VALUE or isinstance(value, dict | list) else f" = {value!r}"
    source = f" (from {env_var})" if env_var else ""
    return f"{path}{shown}{source}: {why}"


def _suggest(key: str, known: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f", did you mean `{close[0]}`?" if close else ""


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat |= _flatten(value, (*prefix, key))
        else:
            flat[_path((*prefix, key))] = value
    return flat


def _redact(url: str) -> str:
    """Replace the password in ``scheme://user:password@host/...`` (and any
    ``password=`` query parameter) with ``***``."""
    scheme, sep, rest = url.partition("://")
    at_index = rest.rfind("@", 0, rest.find("?") if "?" in rest else len(rest))
    userinfo, at, hostpart = (
        (rest[:at_index], "@", rest[at_index + 1 :]) if at_index >= 0 else ("", "", rest)
    )
    if ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    hostpart = re.sub(r"(?i)([?&]password=)[^&]*", r"\1***", hostpart)
    return f"{scheme}{sep}{userinfo}{at}{hostpart}"
