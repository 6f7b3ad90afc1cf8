"""The role model and its SQL text (``pacerd.roles``), without a database."""

from __future__ import annotations

import re

import pytest

from pacerd.roles import (
    DAEMON_BROKER_PERMISSIONS,
    PUBLIC_FUNCTIONS,
    RoleNames,
    grants_sql,
    worker_broker_permissions,
)


@pytest.mark.parametrize(
    "name", ["", "Upper", "9lives", "pg_producer", "public", "a-b", "a b", "x; DROP", "a" * 64]
)
def test_unusable_role_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="role name"):
        RoleNames(producer=name)


def test_one_role_in_two_parts_gets_both_rights_once() -> None:
    roles = RoleNames(producer="app", worker="app")
    rights = {role: (functions, tables) for role, functions, tables in roles.rights()}
    assert rights["app"] == (("schedule", "report", "cancel", "is_current"), ("migrations",))
    sql = grants_sql(roles)
    # Its earlier rights are revoked once, before the grants, not between them.
    assert sql.count("REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pacerd FROM app;") == 1
    assert sql.count("CREATE ROLE app NOLOGIN;") == 1


def test_every_public_function_is_restated_as_definer_on_the_fixed_path() -> None:
    sql = grants_sql(RoleNames())
    for name in PUBLIC_FUNCTIONS:
        assert (
            f"ALTER FUNCTION pacerd.{name} SECURITY DEFINER"
            " SET search_path = pg_catalog, pacerd, pg_temp;" in sql
        )


def test_without_role_creation_no_role_is_created() -> None:
    sql = grants_sql(RoleNames(), create_roles=False)
    assert "CREATE ROLE" not in sql
    assert sql.count("does not exist: its grants were skipped") == 3


def test_broker_patterns() -> None:
    worker = worker_broker_permissions(["pacerd.ready.llm", "pacerd.ready.tenant-1"])
    assert worker.configure == "^$"
    assert re.fullmatch(worker.write, "pacerd.outcomes")
    assert not re.search(worker.write, "pacerd.ready")
    assert not re.search(worker.write, "amq.default")
    assert re.search(worker.read, "pacerd.ready.tenant-1")
    assert not re.search(worker.read, "pacerd.ready.tenant-10")
    assert not re.search(worker.read, "pacerd.outcomes")
    everything = worker_broker_permissions()
    assert re.search(everything.read, "pacerd.ready.any")
    assert not re.search(everything.read, "pacerd.ready")
    for name in ("pacerd.ready", "pacerd.outcomes", "pacerd.outcomes.invalid", "pacerd.ready.x"):
        assert re.search(DAEMON_BROKER_PERMISSIONS.configure, name)
    assert re.search(DAEMON_BROKER_PERMISSIONS.write, "amq.default")
    assert not re.search(DAEMON_BROKER_PERMISSIONS.write, "amq.topic")
