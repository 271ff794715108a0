"""A JetStream that does not answer: one episode at a time, and its probe's pacing.

The relay tells a broker that is away (no ack in time, not connected, no
responders, a 503 / no-leader / no-quorum API error: publisher.Outcome.away)
from a message JetStream refuses. An away outcome starts an episode (or keeps
the current one going): claiming pauses, as it does while NATS is
disconnected, and one probe with growing pauses (core.gate.FIRST_PAUSE
doubling up to PAUSE_CAP, shared with the consumer's handler gate) finds when
JetStream answers again. The relay ends the episode when a probe's publish is
answered; docs/relay.md, "JetStream away", tells the whole story. The state
is core.gate.Outage's, so that the unit tests drive it with a clock of their own.
"""

from __future__ import annotations

from pgoutbox.core.gate import FIRST_PAUSE, PAUSE_CAP, Episode, Outage

__all__ = ["FIRST_PAUSE", "PAUSE_CAP", "Episode", "JetStreamAway"]


class JetStreamAway(Outage):
    what = "JetStream"
