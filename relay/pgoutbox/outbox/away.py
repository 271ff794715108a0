"""A JetStream that does not answer: one episode at a time, and its probe's pacing.

The relay tells a broker that is away (no ack in time, not connected, no
responders, a 503 / no-leader / no-quorum API error: publisher.Outcome.away)
from a message JetStream refuses. An away outcome starts an episode (or keeps
the current one going): claiming pauses, as it does while NATS is
disconnected, and one probe with growing pauses (FIRST_PAUSE doubling up to
PAUSE_CAP) finds when JetStream answers again. The relay ends the episode
when a probe's publish is answered; docs/relay.md, "JetStream away", tells the
whole story. This module holds only the state, so that the unit tests drive
it with a clock of their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

# The first pause before a probe, doubled after each probe that finds
# JetStream still away, up to the cap: a probe costs a request (and, once
# JetStream answers it, a claim of one event), so a long outage costs one
# probe every 30 s, and a short one (a leader election of a few seconds) ends
# within about a second of JetStream being back.
FIRST_PAUSE = 0.5
PAUSE_CAP = 30.0


@dataclass(frozen=True)
class Episode:
    """A finished episode, for its closing log line."""

    seconds: float
    handed_back: int
    reason: str


class JetStreamAway:
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
        self._pause = first_pause
        self.reason = ""
        self.handed_back = 0

    @property
    def active(self) -> bool:
        return self._since is not None

    def begin(self, reason: str) -> bool:
        """JetStream did not answer: True when this starts an episode (the
        caller logs it once); during one, the reason is only brought up to date."""
        self.reason = reason
        if self._since is not None:
            return False
        self._since, self._since_wall = self._clock(), self._wall()
        self._pause = self.first_pause
        self.handed_back = 0
        return True

    def still(self, reason: str) -> None:
        """A probe found JetStream still away."""
        if self._since is not None:
            self.reason = reason

    def counted(self, events: int) -> None:
        """Events handed back during the episode (none is counted outside one)."""
        if self._since is not None:
            self.handed_back += events

    def next_pause(self) -> float:
        """The pause before the next probe: FIRST_PAUSE, doubling up to PAUSE_CAP."""
        pause = self._pause
        self._pause = min(self._pause * 2, self.pause_cap)
        return pause

    def end(self) -> Episode | None:
        """JetStream answered: the finished episode, or None when none was on."""
        if self._since is None:
            return None
        episode = Episode(self._clock() - self._since, self.handed_back, self.reason)
        self._since = None
        self.handed_back = 0
        self.reason = ""
        return episode

    def describe(self) -> str:
        """What /readyz says while an episode is on."""
        since = datetime.fromtimestamp(self._since_wall, UTC).isoformat(timespec="seconds")
        return f"JetStream not answering since {since}: {self.reason}"
