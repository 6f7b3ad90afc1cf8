"""The claim itself honours a durable pause and a Retry-After cool-down: a
tick that read its destination open before a pause or a refusal committed
claims nothing after it (the check is in the claim statement, not only at
the top of the tick)."""

from __future__ import annotations

import datetime as dt

import asyncpg
import pytest

from pacerd import ledger

pytestmark = pytest.mark.services


async def _claim(led: ledger.Ledger, now: dt.datetime | None = None) -> list[str]:
    got = await led.claim_due(
        "d", live_limit=0, limit=10, claim_seconds=30.0, epoch=0, live_window_seconds=0.0,
        instance="test", now=now,
    )  # fmt: skip
    await led.release_claims([c.ref for c in got], reason="test")
    return sorted(c.job_id for c in got)


async def test_no_claim_while_paused_or_cooling_down(db_dsn: str) -> None:
    conn = await asyncpg.connect(db_dsn)
    led = await ledger.Ledger.connect(db_dsn, max_size=2)
    try:
        await conn.execute(
            "SELECT pacerd.schedule(job_id => j, kind => 'k', destination => 'd', payload => '{}',"
            " eligible_at => now() - interval '1 minute') FROM unnest(ARRAY['a', 'b']) j"
        )
        assert await _claim(led) == ["a", "b"]

        await conn.execute("SELECT pacerd.pause('d')")
        assert await _claim(led) == []
        await conn.execute("SELECT pacerd.resume('d')")
        await conn.execute("SELECT pacerd.pause(NULL)")
        assert await _claim(led) == []
        await conn.execute("SELECT pacerd.resume(NULL)")
        assert await _claim(led) == ["a", "b"]

        (a,) = await led.claim_due(
            "d", live_limit=0, limit=1, claim_seconds=30.0, epoch=0, live_window_seconds=0.0,
            instance="test",
        )  # fmt: skip
        assert (
            await conn.fetchval(
                "SELECT pacerd.report($1, $2, 'refused', retry_after_s => 3600)",
                a.job_id,
                a.attempt,
            )
            == "applied"
        )
        until = await conn.fetchval("SELECT cooldown_until FROM pacerd.destinations")
        assert await _claim(led) == []
        assert await _claim(led, now=until - dt.timedelta(microseconds=1)) == []
        # Once the cool-down has passed (the refused job became due at that same time):
        assert await _claim(led, now=until) == ["a", "b"]
    finally:
        await led.close()
        await conn.close()
