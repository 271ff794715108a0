"""A server that is away: one episode at a time, its probe's pacing, and
(Gate) the asyncio plumbing that pauses work while it lasts.

Three things pause while what they need is away, and they share this:
the relay while JetStream does not answer (outbox/away.py), the consumer
while PostgreSQL is away (inbox/database_gate.py) and the consumer's
fetching for one handler while that handler is away (inbox/gates.py).
An episode starts on the first failure that says "away", and one probe,
with growing pauses, finds when it is back; the start and the end are one
log line each, and /readyz says why while it lasts.

Outage holds only the state, so that the unit tests drive it with a clock
of their own; Gate adds the event that waiters wait on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from pgoutbox.core.stopping import until_stopped

# The first pause before a probe, doubled after each probe that finds the
# server still away, up to the cap: a probe costs a request (for the relay
# and a handler, one real event), so a long outage costs one probe every
# 30 s, and a short one (a leader election, a handler restart of a few
# seconds) ends within about a second of the server being back.
FIRST_PAUSE = 0.5
PAUSE_CAP = 30.0


def growing_pauses(first: float = FIRST_PAUSE, cap: float = PAUSE_CAP) -> Iterator[float]:
    """first, doubling, up to cap, without end."""
    pause = first
    while True:
        yield pause
        pause = min(pause * 2, cap)


@dataclass(frozen=True)
class Episode:
    """A finished episode, for its closing log line."""

    seconds: float
    handed_back: int
    reason: str


class Outage:
    """One episode at a time of a server being away: since when, why, how
    many units of work went back meanwhile, and the pause before the next probe."""

    what = "server"

    def __init__(
        self,
        *,
        first_pause: float = FIRST_PAUSE,
        pause_cap: float = PAUSE_CAP,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.first_pause = first_pause
        self.pause_cap = pause_cap
        self._clock = clock
        self._wall = wall
        self._since: float | None = None  # monotonic
        self._since_wall = 0.0
        self._pauses = growing_pauses(first_pause, pause_cap)
        self.reason = ""
        self.handed_back = 0

    @property
    def active(self) -> bool:
        return self._since is not None

    def begin(self, reason: str) -> bool:
        """The server is away: True when this starts an episode (the caller
        logs it once); during one, the reason is only brought up to date."""
        self.reason = reason
        if self._since is not None:
            return False
        self._since, self._since_wall = self._clock(), self._wall()
        self._pauses = growing_pauses(self.first_pause, self.pause_cap)
        self.handed_back = 0
        return True

    def still(self, reason: str) -> None:
        """A probe found the server still away."""
        if self._since is not None:
            self.reason = reason

    def counted(self, units: int) -> None:
        """Units of work handed back during the episode (none is counted outside one)."""
        if self._since is not None:
            self.handed_back += units

    def next_pause(self) -> float:
        """The pause before the next probe: first_pause, doubling up to pause_cap."""
        return next(self._pauses)

    def end(self) -> Episode | None:
        """The server answered: the finished episode, or None when none was on."""
        if self._since is None:
            return None
        episode = Episode(self._clock() - self._since, self.handed_back, self.reason)
        self._since = None
        self.handed_back = 0
        self.reason = ""
        return episode

    def since(self) -> str:
        return datetime.fromtimestamp(self._since_wall, UTC).isoformat(timespec="seconds")

    def describe(self) -> str:
        """What /readyz says while an episode is on."""
        return f"{self.what} not answering since {self.since()}: {self.reason}"


class Gate:
    """An Outage with an asyncio event: open while the server answers,
    closed from the first call that finds it away until a probe finds it
    back. Work that needs the server waits (wait()) while it is closed."""

    def __init__(self, outage: Outage) -> None:
        self.outage = outage
        self._up = asyncio.Event()
        self._up.set()

    @property
    def is_up(self) -> bool:
        return self._up.is_set()

    def close_for(self, reason: str) -> bool:
        """Closes the gate: True when this starts an episode (the caller logs it)."""
        self._up.clear()
        return self.outage.begin(reason)

    def open(self) -> Episode | None:
        """Opens the gate: the episode that ended (the caller logs it), if one was on."""
        self._up.set()
        return self.outage.end()

    async def wait(self, stopping: asyncio.Event) -> bool:
        """Until the gate is open (True) or `stopping` is set (False)."""
        return self._up.is_set() or await until_stopped(self._up.wait(), stopping)

    def describe(self) -> str:
        return self.outage.describe()
