"""``python -m pacerd``, for the fault harness: the same CLI and daemon, with the
AMQP and asyncio libraries' own debug output turned down, so that a daemon run
with ``log_level = "debug"`` writes its ``tick_completed`` lines (the budget
audit reads them) without a line per AMQP frame."""

from __future__ import annotations

import logging

for _name in ("aiormq", "aio_pika", "asyncio", "asyncpg"):
    logging.getLogger(_name).setLevel(logging.INFO)

from pacerd.cli import main  # noqa: E402  (after the loggers are set)

raise SystemExit(main())
