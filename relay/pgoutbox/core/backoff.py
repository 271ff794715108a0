"""Exponential backoff with bounded jitter, for the consumer's redelivery
delays (nak) and the replay schedule of dead letters, (RetryPolicy) the
relay's publish retries, and (retrying) every wait for a server to answer.

    delay(n) = uniform(1 - jitter, 1) * min(max_delay, base * 2 ** (n - 1))

jitter = 0 gives the plain exponential; jitter = 1 is "full jitter" (0 to the
ceiling). The default 0.5 keeps every delay at least half its ceiling, so a
replay never fires right after the failure it follows, while replays of many
messages dead-lettered together still spread out.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pgoutbox.core.stopping import sleep

T = TypeVar("T")


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


@dataclass(frozen=True)
class RetryPolicy:
    """The relay's retries of failed publishes: full jitter (a Backoff with
    jitter 1: uniform in (0, min(cap, base * 2**(n-1))]) so that a batch that
    failed together does not come back as one burst, and a cap on attempts.
    The database only records the decision (mark_failed's retry_at, NULL =
    dead-letter)."""

    base: float  # seconds; the ceiling of the first retry's delay
    cap: float  # seconds; no delay is longer
    max_attempts: int  # publish attempts (claims) before DEAD_LETTER
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.base, self.cap, jitter=1.0)

    def ceiling(self, attempts: int) -> float:
        return self.backoff.ceiling(max(attempts, 1))

    def delay(self, attempts: int) -> float | None:
        """Seconds until the next attempt after `attempts` failed ones, or None: give up."""
        if attempts >= self.max_attempts:
            return None
        return self.backoff.delay(max(attempts, 1), self.rng)


def reconnect_delays(base: float = 0.1, cap: float = 5.0) -> Iterator[float]:
    """Endless pauses between attempts to reach a server: doubling, capped, full jitter."""
    backoff = Backoff(base, cap, jitter=1.0)
    attempt = 0
    while True:
        attempt += 1
        yield backoff.delay(attempt)


class Every:
    """True at most once per `seconds`: one log line per attempt of a retry
    loop, without a line for each of the quick first attempts."""

    def __init__(self, seconds: float = 5.0):
        self.seconds = seconds
        self.attempts = 0
        self._last = float("-inf")

    def __call__(self) -> bool:
        self.attempts += 1
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True


class Retrier:
    """The pacing of one loop that retries a server until it answers: pauses
    of reconnect_delays() and at most one log line per `every` seconds (Every),
    both started afresh by succeeded(). The loop keeps its own log lines and
    metrics: failed() says whether this failure gets its line, `attempts`
    counts the failures. With `stopping`, a pause ends as soon as it is set;
    without, it runs out (a loop that must go on while the process drains)."""

    def __init__(self, stopping: asyncio.Event | None = None, *, every: float = 5.0) -> None:
        self.stopping = stopping
        self._every = every
        self.succeeded()

    def succeeded(self) -> None:
        """The server answered: the next failure starts from the shortest pause, with its line."""
        self._delays, self._lines = reconnect_delays(), Every(self._every)

    def failed(self) -> bool:
        """Counts a failure: True when it gets its log line."""
        return self._lines()

    @property
    def attempts(self) -> int:
        return self._lines.attempts

    async def pause(self) -> bool:
        """The next pause; False when `stopping` was set before it ran out."""
        if self.stopping is None:
            await asyncio.sleep(next(self._delays))
            return True
        return await sleep(next(self._delays), self.stopping)


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    retry_on: Callable[[Exception], bool],
    log: logging.Logger,
    line: Callable[[Exception, int], str],
    action: str,
    extra: Mapping[str, Any] | None = None,
) -> T:
    """call() until it returns: after a failure retry_on accepts (any other is
    raised), a pause of reconnect_delays() and one log line, at most every 5 s,
    `line(exc, attempt)` under the caller's logger."""
    retry = Retrier()
    while True:
        try:
            return await call()
        except Exception as exc:
            if not retry_on(exc):
                raise
            if retry.failed():
                log.warning(line(exc, retry.attempts), extra={"action": action, **(extra or {})})
            await retry.pause()
