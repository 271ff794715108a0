"""Replay of dead letters, the arithmetic: exponential backoff with bounded
jitter and the cap (tests/inbox/test_replay.py replays end to end)."""

from __future__ import annotations

import random

import pytest

from pgoutbox.core.backoff import Backoff

# -- the policy -------------------------------------------------------------


def test_backoff_doubles_up_to_the_cap():
    b = Backoff(base=1.0, max_delay=60.0, jitter=0.0)
    assert [b.delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert b.ceiling(10_000) == 60.0  # no overflow for absurd attempt numbers


@pytest.mark.parametrize("jitter", [0.25, 0.5, 1.0])
def test_jitter_stays_within_its_bounds_and_spreads_over_them(jitter):
    b = Backoff(base=0.5, max_delay=30.0, jitter=jitter)
    rng = random.Random(7)
    for attempt in range(1, 12):
        ceiling = b.ceiling(attempt)
        samples = [b.delay(attempt, rng) for _ in range(2000)]
        low, high = ceiling * (1 - jitter), ceiling
        assert all(low <= s <= high for s in samples), attempt
        # Spread over the whole band, not stuck at one end.
        assert min(samples) < low + 0.05 * (high - low) and max(samples) > high - 0.05 * (high - low)


def test_backoff_refuses_nonsense():
    for kwargs in (
        {"base": 0, "max_delay": 1},
        {"base": 2, "max_delay": 1},
        {"base": 1, "max_delay": 2, "jitter": 1.5},
    ):
        with pytest.raises(ValueError):
            Backoff(**kwargs)
    with pytest.raises(ValueError):
        Backoff(1, 2).delay(0)
