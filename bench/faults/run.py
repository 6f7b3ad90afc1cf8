"""The fault-injection scenarios in their full form, and the results table.

    .venv/bin/python bench/faults/run.py                      # every scenario, full size
    .venv/bin/python bench/faults/run.py -s pacerd-kill -s drill
    .venv/bin/python bench/faults/run.py --quick              # the test suite's sizes
    .venv/bin/python bench/faults/run.py --list

Each scenario gets a fresh database (``pacerd_faults_<scenario>``, dropped
afterwards unless ``--keep``) and a RabbitMQ vhost of the run's own
(``pacerd-faults-bench``); the daemons', workers' and upstream's logs are kept
under ``--output`` (default ``$TMPDIR/pacerd-faults-<timestamp>``) with
``results.json`` and ``results.md``. The scenarios and the audit are the test
suite's (``tests/faults/fault_scenarios.py``, ``tests/faults/faultlib.py``).

The real service faults (``rabbitmq-restart``, ``postgres-restart``) restart
the shared local RabbitMQ and PostgreSQL and raise RabbitMQ's memory alarm,
which blocks every publisher on the broker: run them when nobody else needs
the services, or leave them out with ``--no-real``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "faults"))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' support package

import fault_scenarios as fs  # noqa: E402  (the test suite's scenarios)
import faultlib  # noqa: E402

if TYPE_CHECKING:
    from faultlib import Audit

VHOST = "pacerd-faults-bench"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    name: str
    what: str
    full: fs.Scale
    quick: fs.Scale
    real: bool = False  # restarts shared services / raises the memory alarm


K = faultlib.Knobs()
BENCH = replace(K, max_rate=400.0, initial_rate=100.0, claim_seconds=5.0, offer_seconds=30.0)

PLANS: list[Plan] = [
    Plan(
        name="baseline",
        what="no fault: the same drain, for comparison",
        full=fs.Scale(jobs=10_000, faults=0, workers=3, settle_seconds=120, knobs=BENCH),
        quick=fs.Scale(jobs=400, faults=0, workers=1, settle_seconds=20, knobs=K),
    ),
    Plan(
        name="pacerd-kill",
        what="kill -9 of pacerd at random moments, between claim and publish, and between"
        " confirm and mark-offered, restarting it each time",
        full=fs.Scale(jobs=50_000, faults=12, workers=3, settle_seconds=120, knobs=BENCH),
        quick=fs.Scale(jobs=400, faults=3, workers=1, settle_seconds=20, knobs=K),
    ),
    Plan(
        name="worker-kill",
        what="kill -9 of workers between the upstream call and the outcome report",
        full=fs.Scale(jobs=10_000, faults=10, workers=3, settle_seconds=120, knobs=BENCH),
        quick=fs.Scale(jobs=240, faults=2, workers=2, settle_seconds=20, knobs=K),
    ),
    Plan(
        name="broker-proxy",
        what="pacerd's and the workers' broker connections reset; a broker blocking"
        " publishers past the publish timeout (TCP fault proxy)",
        full=fs.Scale(jobs=10_000, faults=9, workers=3, settle_seconds=120, knobs=BENCH),
        quick=fs.Scale(jobs=400, faults=3, workers=1, settle_seconds=20, knobs=K),
    ),
    Plan(
        name="rabbitmq-restart",
        what="RabbitMQ stopped and started (stop_app/start_app); its memory alarm raised and"
        " cleared (set_vm_memory_high_watermark 0)",
        full=fs.Scale(jobs=10_000, faults=4, workers=3, settle_seconds=180, knobs=BENCH),
        quick=fs.Scale(jobs=1_000, faults=2, workers=1, settle_seconds=60, knobs=K),
        real=True,
    ),
    Plan(
        name="postgres-restart",
        what="pg_terminate_backend of every pacerd and worker session; PostgreSQL restarted"
        " (pg_ctlcluster 15 main restart)",
        full=fs.Scale(jobs=10_000, faults=6, workers=3, settle_seconds=180, knobs=BENCH),
        quick=fs.Scale(jobs=1_000, faults=2, workers=1, settle_seconds=60, knobs=K),
        real=True,
    ),
    Plan(
        name="network",
        what="latency, stalls and resets between pacerd and each service and between the"
        " workers and the broker (TCP fault proxy)",
        full=fs.Scale(
            jobs=10_000,
            faults=9,
            workers=3,
            settle_seconds=120,
            knobs=replace(BENCH, publish_timeout_seconds=2.0),
        ),
        quick=fs.Scale(
            jobs=400,
            faults=3,
            workers=1,
            settle_seconds=20,
            knobs=replace(K, publish_timeout_seconds=1.0),
        ),
    ),
    Plan(
        name="bad-input",
        what="malformed outcomes, outcomes for unknown jobs and stale attempts, refused"
        " producer calls, a config reloaded with errors",
        full=fs.Scale(jobs=10_000, faults=5_000, workers=3, settle_seconds=120, knobs=BENCH),
        quick=fs.Scale(jobs=240, faults=30, workers=1, settle_seconds=20, knobs=K),
    ),
    Plan(
        name="poison-nul",
        what=fs.POISONS["nul"],
        full=fs.Scale(jobs=2_000, faults=1, workers=2, settle_seconds=30, knobs=BENCH),
        quick=fs.Scale(jobs=60, faults=1, workers=1, settle_seconds=5, knobs=K),
    ),
    Plan(
        name="poison-nested",
        what=fs.POISONS["nested"],
        full=fs.Scale(jobs=2_000, faults=1, workers=2, settle_seconds=30, knobs=BENCH),
        quick=fs.Scale(jobs=80, faults=1, workers=1, settle_seconds=5, knobs=K),
    ),
    Plan(
        name="poison-payload",
        what=fs.POISONS["payload"],
        full=fs.Scale(jobs=2_000, faults=1, workers=2, settle_seconds=30, knobs=BENCH),
        quick=fs.Scale(jobs=80, faults=1, workers=1, settle_seconds=5, knobs=K),
    ),
    Plan(
        name="drill",
        what="the recovery drill (seed 000): pause, accumulate, supersede a revision, resume"
        " small with two dispatchers, kill -9 the leader between enqueue and mark-offered",
        full=fs.Scale(
            jobs=2_000,
            faults=1,
            workers=2,
            settle_seconds=120,
            knobs=replace(fs.DRILL_KNOBS, claim_seconds=5.0),
        ),
        quick=fs.Scale(
            jobs=120,
            faults=1,
            workers=2,
            settle_seconds=30,
            knobs=fs.DRILL_KNOBS,
        ),
    ),
]


async def run_one(plan: Plan, scale: fs.Scale, env: fs.Env) -> Audit:
    match plan.name:
        case "baseline":
            audit, _cadence, _share = await fs.steady_drain(env, scale)
            return audit
        case "pacerd-kill":
            return await fs.pacerd_kill(env, scale)
        case "worker-kill":
            return await fs.worker_kill(env, scale)
        case "broker-proxy" | "rabbitmq-restart":
            return await fs.broker_faults(env, scale)
        case "postgres-restart":
            return await fs.ledger_faults(env, scale)
        case "network":
            return await fs.network_faults(env, scale)
        case "bad-input":
            return await fs.bad_input(env, scale)
        case "poison-nul" | "poison-nested" | "poison-payload":
            return await fs.poison(env, scale, kind=plan.name.removeprefix("poison-"))
        case "drill":
            audit, _report = await fs.recovery_drill(env, scale)
            return audit
    raise ValueError(plan.name)


async def main(args: argparse.Namespace) -> int:
    plans = [p for p in PLANS if not args.scenario or p.name in args.scenario]
    if args.no_real:
        plans = [p for p in plans if not p.real]
    output = Path(
        args.output
        or Path(tempfile.gettempdir()) / f"pacerd-faults-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    await anyio.Path(output).mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])
    started = dt.datetime.now(dt.UTC)
    amqp_url = await faultlib.create_vhost(VHOST)
    rows: list[dict[str, str]] = []
    details: list[dict[str, object]] = []
    try:
        for plan in plans:
            scale = plan.quick if args.quick else plan.full
            database = f"pacerd_faults_{plan.name.replace('-', '_')}"
            dsn = await faultlib.create_database(database)
            workdir = output / plan.name
            await anyio.Path(workdir).mkdir(parents=True, exist_ok=True)
            env = fs.Env(
                dsn=dsn, amqp_url=amqp_url, workdir=workdir,
                destination=f"bench-{plan.name}", real=plan.real, seed=args.seed,
            )  # fmt: skip
            print(f"== {plan.name}: {plan.what} ({scale.jobs:,} jobs)", flush=True)
            t0 = time.monotonic()
            try:
                audit = await run_one(plan, scale, env)
            finally:
                if not args.keep:
                    await faultlib.drop_database(database)
            row = audit.row()
            row["scenario"] = plan.name
            rows.append(row)
            details.append(
                {
                    "scenario": plan.name,
                    "what": plan.what,
                    "seconds": round(time.monotonic() - t0, 1),
                    "violations": audit.violations(),
                    "notes": audit.notes,
                    "crashes": audit.crashes,
                    "states": audit.states,
                    "faults": [asdict(f) for f in audit.faults],
                    "replays": audit.replays,
                    "deliveries": audit.deliveries,
                    "ticks_logged": audit.ticks_logged,
                    "claim_groups": audit.claim_groups,
                    "upstream_peak": audit.upstream_peak,
                    "upstream_refused": audit.upstream_refused,
                }
            )
            print(faultlib.markdown_table([row]), flush=True)
            for line in [*audit.violations(), *audit.notes]:
                print(f"   {line}", flush=True)
    finally:
        await faultlib.delete_vhost(VHOST)
    table = faultlib.markdown_table(rows)
    header = f"{started:%Y-%m-%d %H:%M} UTC · `{command}`"
    await anyio.Path(output / "results.md").write_text(f"{header}\n\n{table}\n")
    await anyio.Path(output / "results.json").write_text(json.dumps(details, indent=2, default=str))
    print(f"\n{header}\n\n{table}\n\nlogs and details: {output}")
    return 0 if all(r["result"] == "pass" for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-s", "--scenario", action="append", choices=[p.name for p in PLANS])
    p.add_argument("--quick", action="store_true", help="the test suite's sizes")
    p.add_argument("--no-real", action="store_true", help="skip the service restarts and alarm")
    p.add_argument("--keep", action="store_true", help="keep each scenario's database")
    p.add_argument("--output", default=None, help="logs and results (default: a temp dir)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    return p


if __name__ == "__main__":
    arguments = build_parser().parse_args()
    if arguments.list:
        for plan in PLANS:
            print(f"{plan.name:18} {'(real) ' if plan.real else ''}{plan.what}")
        sys.exit(0)
    sys.exit(anyio.run(main, arguments))
