"""``ledger.retry_transient``: a deadlock victim or a serialization failure is
run once more; a second one, or any other error, is raised. (The real
deadlock against PostgreSQL is in tests/integration/test_ledger_lock_order.py.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg
import pytest
import structlog

from pacerd import ledger

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


def _attempts(*failures: type[Exception]) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def attempt() -> str:
        calls.append(len(calls))
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]("boom")
        return "done"

    return calls, attempt


@pytest.mark.parametrize(
    "error", [asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.SerializationError]
)
async def test_a_transient_failure_is_run_once_more(error: type[Exception]) -> None:
    calls, attempt = _attempts(error)
    with structlog.testing.capture_logs() as events:
        assert await ledger.retry_transient("mark_offered", attempt) == "done"
    assert calls == [0, 1]
    assert [(e["event"], e["query"]) for e in events] == [("ledger_retried", "mark_offered")]


async def test_a_second_transient_failure_is_raised() -> None:
    calls, attempt = _attempts(
        asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.DeadlockDetectedError
    )
    with pytest.raises(asyncpg.exceptions.DeadlockDetectedError):
        await ledger.retry_transient("apply_reports", attempt)
    assert calls == [0, 1]


async def test_other_errors_are_not_retried() -> None:
    calls, attempt = _attempts(asyncpg.exceptions.UniqueViolationError)
    with pytest.raises(asyncpg.exceptions.UniqueViolationError):
        await ledger.retry_transient("claim_due", attempt)
    assert calls == [0]
