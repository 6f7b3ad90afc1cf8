"""The ``pacerd`` command: parsing, printing and exit codes only.

Every verb takes ``-c/--config`` (default ``$PACERD_CONFIG``, else
``/etc/pacerd/pacerd.toml``). Errors are one line on stderr and a non-zero exit
status that says what kind of failure it was (``pacerd.exitcodes``), never a
traceback unless ``--debug``. The verbs are listed in docs/protocol.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any

import anyio
import shtab
import tomli_w

from pacerd import __version__
from pacerd.clock import SystemClock
from pacerd.errors import (
    BrokerUnavailable,
    ConfigError,
    LedgerUnavailable,
    MigrationError,
    PacerdError,
)
from pacerd.exitcodes import (
    EX_CONFIG,
    EX_FAILURE,
    EX_INTERRUPTED,
    EX_NOT_MIGRATED,
    EX_OK,
    EX_UNAVAILABLE,
    EX_UNKNOWN_JOB,
    EX_USAGE,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from pacerd.config import Config

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class UsageError(PacerdError):
    """The command line is invalid."""


class UnknownJob(PacerdError):
    """No such job."""


class LedgerNotMigrated(MigrationError):
    """The ledger schema is not up to date: run `pacerd migrate` first."""


def parse_moment(text: str, *, now: dt.datetime) -> dt.datetime:
    """An ISO-8601 timestamp, or a duration ago (``30m``, ``2h``, ``7d``)."""
    match = _DURATION.match(text.strip())
    if match:
        return now - dt.timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"{text!r} is neither an ISO-8601 time nor a duration like 30m, 2h, 7d"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)


def count(text: str) -> int:
    """An argument that counts something: a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def seconds(text: str) -> float:
    """An argument in seconds: a finite number (negative: in the past)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """An argument in seconds that must be more than 0."""
    value = seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return value


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    # Options accepted before or after the verb. SUPPRESS keeps a subparser
    # from overwriting a value given before the verb with its default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-c",
        "--config",
        default=argparse.SUPPRESS,
        help="config file (default $PACERD_CONFIG, else /etc/pacerd/pacerd.toml)",
    )
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="machine-readable output")

    parser = argparse.ArgumentParser(
        prog="pacerd",
        description="Release due work from a PostgreSQL ledger into RabbitMQ"
        " at the pace the upstream can absorb.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"pacerd {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    run = verbs.add_parser("run", parents=[common], help="run the daemon")
    run.add_argument(
        "--shadow", action="store_true", help="compute decisions, claim and publish nothing"
    )
    migrate = verbs.add_parser(
        "migrate",
        parents=[common, as_json],
        help="create or upgrade the ledger schema and its grants",
    )
    migrate.add_argument(
        "--no-roles",
        action="store_true",
        help="create no role (they are made elsewhere); grant those that exist",
    )
    migrate.add_argument(
        "--print-grants", action="store_true", help="print the grants' SQL; change nothing"
    )
    migrate.add_argument(
        "--partitions",
        type=int,
        metavar="N",
        help="how many partitions destinations hash into, led one lock each (default: keep;"
        " 64 for a new ledger); changed only while no pacerd instance runs",
    )
    for role in ("producer", "worker", "operator"):
        migrate.add_argument(
            f"--{role}-role",
            default=f"pacerd_{role}",
            metavar="NAME",
            help=f"(default pacerd_{role})",
        )
    verbs.add_parser(
        "check-config", parents=[common, as_json], help="validate the config file; change nothing"
    )
    config = verbs.add_parser("config", parents=[common], help="inspect the configuration")
    config_verbs = config.add_subparsers(dest="config_verb", required=True, metavar="VERB")
    config_verbs.add_parser(
        "show",
        parents=[common, as_json],
        help="the effective configuration (file, environment, secret files), secrets masked",
    )
    completion = verbs.add_parser(
        "completion", parents=[common], help="print a shell completion script"
    )
    completion.add_argument("shell", choices=shtab.SUPPORTED_SHELLS)

    status = verbs.add_parser(
        "status", parents=[common, as_json], help="per-destination state of the ledger"
    )
    status.add_argument("--watch", action="store_true", help="refresh live in the terminal")
    status.add_argument(
        "--interval", type=positive_seconds, default=1.0, help="--watch refresh seconds (default 1)"
    )
    status.add_argument(
        "--group", metavar="NAME", help="only the destinations of this group (-: of no group)"
    )
    status.add_argument(
        "--destination", metavar="GLOB", help="only the destinations whose name fits the glob"
    )
    status.add_argument(
        "--top",
        type=int,
        metavar="N",
        help="only the N with the oldest due work, then the most refusals",
    )
    status.add_argument(
        "--totals",
        action="store_true",
        help="show the totals per group even with no group configured; with --json,"
        " print {groups, destinations, selected, left_out} instead of the list",
    )

    schedule = verbs.add_parser(
        "schedule", parents=[common, as_json], help="schedule or revise a job"
    )
    schedule.add_argument("job_id")
    schedule.add_argument("--kind", required=True)
    schedule.add_argument("--destination", required=True)
    schedule.add_argument("--payload", default="{}", help="JSON payload (default {})")
    when = schedule.add_mutually_exclusive_group()
    when.add_argument("--eligible-at", help="ISO-8601 time the job becomes due (default now)")
    when.add_argument("--delay", type=seconds, help="seconds from now until the job is due")
    schedule.add_argument("--revision", type=int, default=0)
    schedule.add_argument("--max-attempts", type=int)

    cancel = verbs.add_parser("cancel", parents=[common, as_json], help="cancel a job")
    cancel.add_argument("job_id")
    cancel.add_argument("--reason", help="kept in the job's history")

    replay = verbs.add_parser(
        "replay", parents=[common, as_json], help="replay dead jobs through normal admission"
    )
    replay.add_argument("job_id", nargs="?", help="one job; or select by filter")
    replay.add_argument("--reason", required=True, help="kept in each job's history (required)")
    _add_dead_filter(replay)
    replay.add_argument("--dry-run", action="store_true", help="only count what would be replayed")
    replay.add_argument(
        "--limit", type=count, default=10_000, help="replay at most this many (default 10000)"
    )

    dead = verbs.add_parser(
        "dead", parents=[common, as_json], help="list dead jobs with their last error"
    )
    _add_dead_filter(dead)
    dead.add_argument("--limit", type=count, default=50, help="list at most this many (default 50)")

    show = verbs.add_parser(
        "show", parents=[common, as_json], help="a job's state and full history"
    )
    show.add_argument("job_id")

    for verb, text in (
        ("pause", "pause admission (durable, every instance)"),
        ("resume", "resume admission"),
    ):
        p = verbs.add_parser(verb, parents=[common, as_json], help=text)
        p.add_argument("--destination", help="one destination (default: all, present and future)")

    worker = verbs.add_parser("worker", parents=[common], help="run a Python worker process")
    worker.add_argument(
        "--app", required=True, help="module:attribute of a pacerd.worker.WorkerApp"
    )
    return parser


def _add_dead_filter(p: argparse.ArgumentParser) -> None:
    p.add_argument("--destination")
    p.add_argument("--kind")
    p.add_argument("--error", help="last error contains this text")
    p.add_argument(
        "--dead-since", help="dead since an ISO-8601 time or a duration ago (30m, 2h, 7d)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config = getattr(args, "config", None)
    args.debug = getattr(args, "debug", False)
    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"pacerd: {exc}", file=sys.stderr)
        return EX_CONFIG
    except UsageError as exc:
        print(f"pacerd: error: {exc}", file=sys.stderr)
        return EX_USAGE
    except PacerdError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"pacerd: error: {exc}", file=sys.stderr)
        return _status_of(exc)
    except KeyboardInterrupt:
        return EX_INTERRUPTED
    except BrokenPipeError:  # the reader (`| head`) left: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EX_FAILURE


def _status_of(exc: PacerdError) -> int:
    if isinstance(exc, UnknownJob):
        return EX_UNKNOWN_JOB
    if isinstance(exc, LedgerNotMigrated):
        return EX_NOT_MIGRATED
    if isinstance(exc, LedgerUnavailable | BrokerUnavailable):
        return EX_UNAVAILABLE
    return EX_FAILURE


def _dispatch(args: argparse.Namespace) -> int:
    from pacerd import config as config_module

    if args.verb == "completion":
        print(shtab.complete(build_parser(), shell=args.shell), end="")
        return EX_OK
    environ = dict(os.environ)
    path = args.config or config_module.default_config_path(environ)
    explicit = bool(args.config or environ.get("PACERD_CONFIG"))
    if not explicit and not os.path.exists(path):
        path = None  # no file anywhere: the defaults (and PACERD_* overrides) apply
    try:
        cfg = config_module.load_config(path, environ)
    except ConfigError as exc:
        if args.verb != "check-config" or not args.json:
            raise
        _print_json({"config": path, "ok": False, "problems": exc.problems})
        return EX_CONFIG

    if args.verb == "check-config":
        return _check_config(cfg, path, args)
    if args.verb == "config":
        shown = cfg.masked()
        if args.json:
            _print_json(shown)
        else:
            print(f"# the effective configuration of {path or 'the defaults'}, secrets masked")
            print(tomli_w.dumps(_without_none(shown)), end="")
        return EX_OK
    if args.verb == "run":
        from pacerd import daemon

        return daemon.main(cfg, config_path=path, shadow=args.shadow)
    if args.verb == "worker":
        from pacerd import worker

        return worker.main(cfg, app_ref=args.app)
    if args.verb == "status" and args.watch:
        return anyio.run(_watch_status, cfg, args)
    handler = _ASYNC_VERBS[args.verb]
    return anyio.run(handler, cfg, args)


def _print_json(doc: object) -> None:
    print(json.dumps(doc, indent=2, default=str))


def _emit(args: argparse.Namespace, doc: dict[str, Any], text: str) -> None:
    """One result: ``doc`` as JSON with ``--json``, else the line ``text``."""
    if args.json:
        _print_json(doc)
    else:
        print(text)


def _without_none(tree: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: an unset per-destination key is left out."""
    return {
        k: _without_none(v) if isinstance(v, dict) else v for k, v in tree.items() if v is not None
    }


def _check_config(cfg: Config, path: str | None, args: argparse.Namespace) -> int:
    pacing = cfg.pacing
    if args.json:
        _print_json(
            {
                "config": path,
                "ok": True,
                "database": cfg.redacted_dsn(),
                "broker": cfg.redacted_broker_url(),
                "destinations": {name: cfg.queue_for(name) for name in sorted(cfg.destinations)},
                "groups": {
                    name: {"match": group.match, "queue": cfg.route_for_group(name).queue}
                    for name, group in cfg.groups.items()
                },
            }
        )
        return EX_OK
    print(f"{path or 'defaults'}: ok")
    print(f"  database: {cfg.redacted_dsn()}")
    print(f"  broker:   {cfg.redacted_broker_url()}")
    print(
        f"  pacing:   mode={pacing.mode} tick={pacing.tick_seconds}s "
        f"rate={pacing.initial_rate}/s in [{pacing.min_rate}, {pacing.max_rate}]"
    )
    for name, group in cfg.groups.items():  # file order: the first match wins
        print(f"  group {name}: match {group.match!r}, queue {cfg.route_for_group(name).queue}")
    for name in sorted(cfg.destinations):
        group_name = cfg.group_for(name)
        in_group = f" (group {group_name})" if group_name else ""
        print(f"  destination {name}: queue {cfg.queue_for(name)}{in_group}")
    return EX_OK


def _status_selection(cfg: Config, args: argparse.Namespace) -> Any:
    """The destinations ``status`` was asked for (UsageError when invalid)."""
    from pacerd.overview import Selection

    selection = Selection(group=args.group, destination=args.destination, top=args.top)
    problem = selection.problem(list(cfg.groups))
    if problem is not None:
        raise UsageError(problem)
    return selection


async def _watch_status(cfg: Config, args: argparse.Namespace) -> int:
    """``status --watch`` until Ctrl-C: the ledger's check, then the live view,
    in one event loop whose SIGINT handler ends either at once with status 130
    (a signal that lands between two loops, or is taken for an ordinary
    cancellation, is never lost)."""
    from pacerd import statusview

    selection = _status_selection(cfg, args)
    failed: list[PacerdError] = []
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def view() -> None:
                try:
                    await _check_ledger(cfg)
                    await statusview.watch(
                        cfg.database.dsn,
                        args.interval,
                        group_of=cfg.group_for,
                        selection=selection,
                        order=list(cfg.groups),
                        totals=args.totals,
                    )
                except PacerdError as exc:  # raised as main() reports it, not in a group
                    failed.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(view)
            async for _ in signals:
                tg.cancel_scope.cancel()
    if failed:
        raise failed[0]
    return EX_INTERRUPTED


async def _check_ledger(cfg: Config) -> None:
    """Raises what any verb would (unreachable, not migrated) before a live view starts."""

    async def body(client: Any) -> int:
        return EX_OK

    await _with_client(cfg, body)


async def _with_client(cfg: Config, body: Callable[[Any], Awaitable[int]]) -> int:
    from pacerd.client import Client
    from pacerd.ledger import pending_migrations

    client = await Client.connect(cfg.database.dsn)
    try:
        pending = await pending_migrations(client.pool)
        if pending:
            raise LedgerNotMigrated(
                f"the ledger schema is not up to date ({', '.join(pending)} pending):"
                " run `pacerd migrate` first"
            )
        return await body(client)
    finally:
        await client.close()


async def _migrate(cfg: Config, args: argparse.Namespace) -> int:
    from pacerd import ledger
    from pacerd.roles import RoleNames, grants_sql

    try:
        roles = RoleNames(
            producer=args.producer_role, worker=args.worker_role, operator=args.operator_role
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.print_grants:
        print(grants_sql(roles, create_roles=not args.no_roles), end="")
        return EX_OK
    if args.partitions is not None and not 1 <= args.partitions <= ledger.MAX_PARTITIONS:
        raise UsageError(
            f"--partitions must be between 1 and {ledger.MAX_PARTITIONS}, got {args.partitions}"
        )
    applied = await ledger.migrate(
        cfg.database.dsn,
        roles=roles,
        create_roles=not args.no_roles,
        notice=lambda text: print(f"pacerd: {text}", file=sys.stderr),
    )
    led = await ledger.Ledger.connect(cfg.database.dsn, max_size=2)
    try:
        await led.write_settings(ledger.settings_from_retry(cfg.retry))
        if args.partitions is not None:
            await led.set_partitions(args.partitions)
        partitions = await led.read_partitions()
    finally:
        await led.close()
    if args.json:
        _print_json({"applied": applied, "partitions": partitions})
    elif applied:
        for name in applied:
            print(f"applied {name}")
    else:
        print("ledger schema is up to date")
    return EX_OK


async def _schedule(cfg: Config, args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        eligible_at = None
        if args.eligible_at:
            eligible_at = parse_moment(args.eligible_at, now=SystemClock().now())
        elif args.delay is not None:
            eligible_at = SystemClock().now() + dt.timedelta(seconds=args.delay)
        result = await client.schedule(
            args.job_id,
            kind=args.kind,
            destination=args.destination,
            payload=_json_arg(args.payload, "--payload"),
            eligible_at=eligible_at,
            revision=args.revision,
            max_attempts=args.max_attempts,
        )
        _emit(args, {"job_id": args.job_id, "result": result}, f"{args.job_id}: {result}")
        return EX_OK

    return await _with_client(cfg, body)


async def _cancel(cfg: Config, args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        result = await client.cancel(args.job_id, args.reason)
        _emit(args, {"job_id": args.job_id, "result": result}, f"{args.job_id}: {result}")
        return EX_UNKNOWN_JOB if result == "unknown" else EX_OK

    return await _with_client(cfg, body)


def _dead_filter(args: argparse.Namespace) -> Any:
    from pacerd.client import DeadFilter

    since = None
    if args.dead_since:
        since = parse_moment(args.dead_since, now=SystemClock().now())
    return DeadFilter(
        destination=args.destination, kind=args.kind, error_contains=args.error, dead_since=since
    )


async def _replay(cfg: Config, args: argparse.Namespace) -> int:
    if not args.reason.strip():
        raise UsageError("--reason must not be empty")
    selection = _dead_filter(args)
    has_filter = any(
        v is not None for v in (args.destination, args.kind, args.error, args.dead_since)
    )
    if args.job_id and has_filter:
        raise UsageError("give one JOB_ID or a filter, not both")
    if not args.job_id and not has_filter:
        raise UsageError(
            "give a JOB_ID or at least one filter (--destination, --kind, --error, --dead-since)"
        )

    async def body(client: Any) -> int:
        if args.job_id:
            if args.dry_run:
                found = await client.show(args.job_id)
                state = str(found[0].state) if found else "unknown"
                verdict = "replay" if state == "dead" else "not replay"
                _emit(
                    args,
                    {"job_id": args.job_id, "state": state, "would_replay": state == "dead"},
                    f"{args.job_id}: would {verdict} (state {state})",
                )
                return EX_OK if found else EX_UNKNOWN_JOB
            result = await client.replay(args.job_id, args.reason)
            _emit(args, {"job_id": args.job_id, "result": result}, f"{args.job_id}: {result}")
            return EX_UNKNOWN_JOB if result == "unknown" else EX_OK
        count = await client.count_dead(selection)
        if args.dry_run:
            would = min(count, args.limit)
            _emit(
                args,
                {"matched": count, "would_replay": would},
                f"{would} dead job(s) would be replayed ({count} match)",
            )
            return EX_OK
        replayed = await client.replay_matching(selection, args.reason, limit=args.limit)
        _emit(
            args,
            {"matched": count, "replayed": replayed},
            f"replayed {replayed} dead job(s) ({count} matched)",
        )
        return EX_OK

    return await _with_client(cfg, body)


async def _dead(cfg: Config, args: argparse.Namespace) -> int:
    from pacerd import statusview

    async def body(client: Any) -> int:
        jobs = await client.dead(_dead_filter(args), limit=args.limit)
        if args.json:
            _print_json([statusview.job_dict(j) for j in jobs])
        else:
            statusview.print_dead(jobs)
        return EX_OK

    return await _with_client(cfg, body)


async def _show(cfg: Config, args: argparse.Namespace) -> int:
    from pacerd import statusview

    async def body(client: Any) -> int:
        found = await client.show(args.job_id)
        if found is None:
            raise UnknownJob(f"no job {args.job_id!r}")
        job, events = found
        if args.json:
            doc = statusview.job_dict(job) | {"history": [statusview.event_dict(e) for e in events]}
            _print_json(doc)
        else:
            statusview.print_job(job, events)
        return EX_OK

    return await _with_client(cfg, body)


async def _pause_resume(cfg: Config, args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        operation = client.pause if args.verb == "pause" else client.resume
        result = await operation(args.destination)
        _emit(
            args,
            {"destination": args.destination, "result": result},
            f"{args.destination or 'all destinations'}: {result}",
        )
        return EX_OK

    return await _with_client(cfg, body)


async def _status(cfg: Config, args: argparse.Namespace) -> int:
    from pacerd import statusview
    from pacerd.overview import overview

    selection = _status_selection(cfg, args)

    async def body(client: Any) -> int:
        rows = await client.status()
        if not args.json:
            statusview.print_status(
                rows, cfg.group_for, selection=selection, order=list(cfg.groups),
                totals=args.totals,
            )  # fmt: skip
            return EX_OK
        # JSON lists every selected destination (only --top leaves some out)
        view = overview(rows, cfg.group_for, selection, order=list(cfg.groups), limit=None)
        if args.totals:
            _print_json(statusview.overview_dict(view, cfg.group_for))
        else:
            _print_json(
                [statusview.status_dict(r, cfg.group_for(r.destination)) for r in view.destinations]
            )
        return EX_OK

    return await _with_client(cfg, body)


_ASYNC_VERBS: dict[str, Callable[[Any, argparse.Namespace], Awaitable[int]]] = {
    "migrate": _migrate,
    "schedule": _schedule,
    "cancel": _cancel,
    "replay": _replay,
    "dead": _dead,
    "show": _show,
    "pause": _pause_resume,
    "resume": _pause_resume,
    "status": _status,
}
