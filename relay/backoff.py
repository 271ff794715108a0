"""Exponential backoff with bounded jitter, for the consumer's redelivery
delays (nak) and the replay schedule of dead letters.

    delay(n) = uniform(1 - jitter, 1) * min(max_delay, base * 2 ** (n - 1))

jitter = 0 gives the plain exponential; jitter = 1 is "full jitter" (0 to the
ceiling). The default 0.5 keeps every delay at least half its ceiling, so a
replay never fires right after the failure it follows, while replays of many
messages dead-lettered together still spread out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    base: float
    max_delay: float
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.base <= 0 or self.max_delay < self.base:
            raise ValueError(f"need 0 < base <= max_delay, got base={self.base}, max_delay={self.max_delay}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be between 0 and 1, got {self.jitter}")

    def ceiling(self, attempt: int) -> float:
        """The delay before jitter for attempt 1, 2, ...; capped at max_delay."""
        if attempt < 1:
            raise ValueError(f"attempts count from 1, got {attempt}")
        # min() before the power would overflow for large attempts.
        return min(self.max_delay, self.base * 2.0 ** min(attempt - 1, 1023))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        ceiling = self.ceiling(attempt)
        draw = (rng or random).random()
        return ceiling * (1.0 - self.jitter * draw)


def jitter_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be between 0 and 1, got {value}")
    return value
