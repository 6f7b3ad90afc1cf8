"""The guard of ``tests/conftest.py``: an async test fails when pacerd's code
makes a blocking call on the event loop (blockbuster); sync tests may block."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from blockbuster import BlockingError

from pacerd.config import load_config

if TYPE_CHECKING:
    from pathlib import Path


async def test_a_blocking_call_of_pacerd_on_the_event_loop_fails_an_async_test(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pacerd.toml"
    path.write_bytes(b"")  # the test's own I/O is not checked, pacerd's is
    with pytest.raises(BlockingError):
        load_config(path, environ={})


def test_a_sync_test_may_block(tmp_path: Path) -> None:
    path = tmp_path / "pacerd.toml"
    path.write_bytes(b"")
    load_config(path, environ={})
