"""The pacerd exception hierarchy.

Only ``ledger.py`` and ``publisher.py`` translate driver exceptions (asyncpg,
aio-pika) into these, always with ``raise ... from exc``; nothing above those
modules catches a driver error. Each class docstring is its default message.

    PacerdError
    ├── ConfigError
    ├── MigrationError
    ├── LedgerError
    │   ├── LedgerUnavailable
    │   └── LedgerRejected
    ├── PublishError
    │   ├── PublishRejected
    │   ├── PublishTimeout
    │   └── BrokerUnavailable
"""

from __future__ import annotations


class PacerdError(Exception):
    """pacerd failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigError(PacerdError):
    """The configuration is invalid."""

    def __init__(self, problems: list[str], source: str = "configuration") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} is invalid ({len(self.problems)} problem(s)):\n{lines}")


class MigrationError(PacerdError):
    """The ledger schema could not be migrated."""


class LedgerError(PacerdError):
    """The ledger failed."""


class LedgerUnavailable(LedgerError):
    """The ledger (PostgreSQL) cannot be reached."""


class LedgerRejected(LedgerError):
    """The ledger rejected the request."""


class PublishError(PacerdError):
    """Publishing to the broker failed."""


class PublishRejected(PublishError):
    """The broker refused the message (nack or unroutable return)."""


class PublishTimeout(PublishError):
    """The broker did not confirm the message in time."""


class BrokerUnavailable(PublishError):
    """The broker (RabbitMQ) cannot be reached."""
