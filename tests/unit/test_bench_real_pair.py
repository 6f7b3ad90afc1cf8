"""The pure figures of ``bench/real_pair.py``: the Jain index and how soon
two senders share an upstream fairly."""

from __future__ import annotations

import math

import pytest

from bench import real_pair


def test_jain_is_one_for_equal_shares_and_half_for_one_sender_of_two() -> None:
    assert real_pair.jain([50.0, 50.0]) == 1.0
    assert real_pair.jain([100.0, 0.0]) == 0.5
    assert real_pair.jain([0.0, 0.0]) == 1.0  # nothing sent: nothing unfair
    assert real_pair.jain([70.0, 30.0]) == pytest.approx(100.0**2 / (2 * (70.0**2 + 30.0**2)))


def test_fair_after_is_the_first_window_from_which_every_later_one_is_fair() -> None:
    # B starts at 10 s; 70/30 until 60 s, then 50/50 for good
    a = [100] * 10 + [70] * 50 + [50] * 120
    b = [0] * 10 + [30] * 50 + [50] * 120
    got = real_pair.fairness([a, b], 10)
    # the window from 50 s (10 s of 70/30, 20 s of 50/50: 1,700 / 1,300,
    # Jain 0.9825) is the first fair one; the one from 45 s has 0.9615
    assert got["fair_after_s"] == 40.0
    assert got["jain_last"] == 1.0
    assert got["jain_min_late"] == 1.0  # windows from 130 s on


def test_never_fair_is_infinite_and_a_late_dip_is_reported() -> None:
    a = [100] * 10 + [70] * 170
    b = [0] * 10 + [30] * 170
    got = real_pair.fairness([a, b], 10)
    assert got["fair_after_s"] == math.inf
    assert got["jain_min_late"] < real_pair.TARGET
