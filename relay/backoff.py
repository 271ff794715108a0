"""Retry policy for failed publishes: exponential backoff with full jitter.

Full jitter (delay drawn uniformly from [0, min(cap, base * 2**(n-1))]) spreads
the retries of a batch that failed together, so they do not come back as one
burst; see "Exponential Backoff And Jitter" (AWS Architecture Blog, 2015).
The database only records the decision (mark_failed's retry_at, NULL = give
up); the policy itself is configuration of the relay.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryPolicy:
    base: float  # seconds; the ceiling of the first retry's delay
    cap: float  # seconds; no delay is longer
    max_attempts: int  # publish attempts (claims) before DEAD_LETTER
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def ceiling(self, attempts: int) -> float:
        """The longest delay after the attempts-th failed attempt (1-based)."""
        exponent = min(max(attempts, 1) - 1, 62)  # 2**62 * base is past any cap
        return min(self.cap, self.base * 2.0**exponent)

    def delay(self, attempts: int) -> float | None:
        """Seconds until the next attempt, or None when the event should be dead-lettered."""
        if attempts >= self.max_attempts:
            return None
        return self.rng.uniform(0.0, self.ceiling(attempts))


def reconnect_delays(base: float = 0.1, cap: float = 5.0):
    """Endless delays for reconnecting to a server: doubling, capped, full jitter."""
    policy = RetryPolicy(base, cap, max_attempts=1 << 62)
    attempt = 0
    while True:
        attempt += 1
        yield policy.delay(attempt)
