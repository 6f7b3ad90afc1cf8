"""The ledger's roles and the rights of each: the SQL text that ``pacerd
migrate`` runs after the migrations (``pacerd migrate --print-grants`` prints
it). Pure: it builds text and sends none (``ledger.migrate`` does).

- owner: everything; the role that runs ``pacerd migrate`` and ``pacerd run``.
- producer: EXECUTE schedule, cancel, is_current.
- every role: SELECT on migrations (the schema version).
- worker: EXECUTE report, is_current.
- operator: the producer's functions, replay, pause, resume; SELECT on jobs,
  job_events, destinations, control.

No role but the owner may write a table: every change goes through a
function that runs with the owner's rights (SECURITY DEFINER) on a fixed
search_path. Roles are cluster-wide; creating one is idempotent and survives
a concurrent ``pacerd migrate`` of another database of the same cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFINER_SEARCH_PATH = "pg_catalog, pacerd, pg_temp"
# The public SQL API; each runs as its owner (migration 0004).
PUBLIC_FUNCTIONS = (
    "schedule",
    "report",
    "report_many",
    "cancel",
    "replay",
    "is_current",
    "pause",
    "resume",
)
PRODUCER_FUNCTIONS = ("schedule", "cancel", "is_current")
WORKER_FUNCTIONS = ("report", "is_current")
OPERATOR_FUNCTIONS = (*PRODUCER_FUNCTIONS, "replay", "pause", "resume")
# What `pacerd status`, `show` and `dead` read.
OPERATOR_TABLES = ("jobs", "job_events", "destinations", "control", "partitions")
# Every role may read which migrations are applied: a client tells an
# unmigrated ledger (its own exit status) from a refusal.
EVERY_ROLE_TABLES = ("migrations",)

# Plain lower-case identifiers: they need no quoting anywhere (SQL, shell, docs).
_ROLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check_role_name(name: str) -> str:
    """``name`` if it is a usable role name, else ``ValueError``."""
    if not _ROLE_NAME.match(name) or name.startswith("pg_") or name == "public":
        raise ValueError(
            f"role name {name!r}: use 1-63 lower-case letters, digits and _,"
            " not starting with a digit or pg_, and not public"
        )
    return name


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleNames:
    """The names of the three roles ``pacerd migrate`` grants."""

    producer: str = "pacerd_producer"
    worker: str = "pacerd_worker"
    operator: str = "pacerd_operator"

    def __post_init__(self) -> None:
        for name in (self.producer, self.worker, self.operator):
            check_role_name(name)

    def rights(self) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
        """(role, functions, tables it may read), one entry per distinct role."""
        merged: dict[str, tuple[set[str], set[str]]] = {}
        for role, functions, tables in (
            (self.producer, PRODUCER_FUNCTIONS, EVERY_ROLE_TABLES),
            (self.worker, WORKER_FUNCTIONS, EVERY_ROLE_TABLES),
            (self.operator, OPERATOR_FUNCTIONS, (*OPERATOR_TABLES, *EVERY_ROLE_TABLES)),
        ):
            f, t = merged.setdefault(role, (set(), set()))
            f.update(functions)
            t.update(tables)
        order = {
            name: i
            for i, name in enumerate((*PUBLIC_FUNCTIONS, *OPERATOR_TABLES, *EVERY_ROLE_TABLES))
        }
        return [
            (role, tuple(sorted(f, key=order.__getitem__)), tuple(sorted(t, key=order.__getitem__)))
            for role, (f, t) in merged.items()
        ]


def _role_statements(role: str, functions: tuple[str, ...], tables: tuple[str, ...]) -> list[str]:
    statements = [
        # Exactly these rights: whatever was granted before in the schema is taken back.
        f"REVOKE ALL ON ALL TABLES IN SCHEMA pacerd FROM {role};",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA pacerd FROM {role};",
        f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pacerd FROM {role};",
        f"GRANT USAGE ON SCHEMA pacerd TO {role};",
        "GRANT EXECUTE ON FUNCTION "
        + ", ".join(f"pacerd.{name}" for name in functions)
        + f" TO {role};",
    ]
    if tables:
        statements.append(
            "GRANT SELECT ON TABLE " + ", ".join(f"pacerd.{t}" for t in tables) + f" TO {role};"
        )
    return statements


def _create_role(role: str) -> str:
    return f"""\
DO $create$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{role}') THEN
        BEGIN
            CREATE ROLE {role} NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- created meanwhile by a migrate of another database in this cluster
        END;
    END IF;
END
$create$;"""


def _if_role_exists(role: str, statements: list[str]) -> str:
    body = "\n".join(f"        {s}" for s in statements)
    return f"""\
DO $grant$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{role}') THEN
{body}
    ELSE
        RAISE NOTICE 'role {role} does not exist: its grants were skipped';
    END IF;
END
$grant$;"""


def grants_sql(roles: RoleNames, *, create_roles: bool = True) -> str:
    """The SQL ``pacerd migrate`` runs after the migrations, in one
    transaction: idempotent, so every run re-asserts the whole set."""
    parts = [
        "-- Run by the owner: the role that runs `pacerd migrate` and `pacerd run`.",
        "DO $owner$",
        "BEGIN",
        f"    IF current_user IN ({', '.join(repr(r) for r, _, _ in roles.rights())}) THEN",
        "        RAISE EXCEPTION 'run pacerd migrate as the owner of schema pacerd,"
        " not as one of the roles it grants (%)', current_user;",
        "    END IF;",
        "END",
        "$owner$;",
        "",
        "-- PUBLIC may do nothing in schema pacerd.",
        "REVOKE ALL ON SCHEMA pacerd FROM PUBLIC;",
        "REVOKE ALL ON ALL TABLES IN SCHEMA pacerd FROM PUBLIC;",
        "REVOKE ALL ON ALL SEQUENCES IN SCHEMA pacerd FROM PUBLIC;",
        "REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pacerd FROM PUBLIC;",
        "",
        "-- The public functions run with the owner's rights on a fixed search_path"
        " (restated here:",
        "-- CREATE OR REPLACE FUNCTION resets both unless it says them again).",
    ]
    parts += [
        f"ALTER FUNCTION pacerd.{name} SECURITY DEFINER SET search_path = {DEFINER_SEARCH_PATH};"
        for name in PUBLIC_FUNCTIONS
    ]
    for role, functions, tables in roles.rights():
        parts += ["", f"-- {role}: {', '.join(functions + tables)}"]
        statements = _role_statements(role, functions, tables)
        if create_roles:
            parts += [_create_role(role), *statements]
        else:
            parts.append(_if_role_exists(role, statements))
    return "\n".join(parts) + "\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokerPermissions:
    """One RabbitMQ user's permissions in pacerd's virtual host: a regular
    expression each for configure, write and read (``rabbitmqctl
    set_permissions -p VHOST USER CONFIGURE WRITE READ``)."""

    configure: str
    write: str
    read: str

    def rabbitmqctl(self, vhost: str, user: str) -> list[str]:
        return ["set_permissions", "-p", vhost, user, self.configure, self.write, self.read]


# The daemon declares and binds every pacerd.* exchange and queue, publishes
# offers to pacerd.ready, consumes pacerd.outcomes and parks malformed
# outcomes through the default exchange. (Extend the patterns with any
# `queue =` name outside pacerd.*.)
DAEMON_BROKER_PERMISSIONS = BrokerPermissions(
    configure=r"^pacerd\.", write=r"^(pacerd\..*|amq\.default)$", read=r"^pacerd\."
)


def worker_broker_permissions(queues: list[str] | tuple[str, ...] = ()) -> BrokerPermissions:
    """A worker consumes its ready queues (all of them when ``queues`` is
    empty), publishes outcomes to the pacerd.outcomes exchange, and declares
    nothing: the library checks the topology with passive declares."""
    read = "^(" + "|".join(re.escape(q) for q in queues) + ")$" if queues else r"^pacerd\.ready\."
    return BrokerPermissions(configure="^$", write=r"^pacerd\.outcomes$", read=read)
