"""PostgreSQL away, as the consumer's inbox calls find it: one gate for the
whole consumer, which its fetch loops wait on and through which every inbox
call of a message in hand runs (DatabaseGate.run).

Not to be confused with core/gate.py, the plumbing every gate is built on,
nor with inbox/gates.py, one gate per handler (a handler that is away).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg

from pgoutbox.core import db
from pgoutbox.core.backoff import Retrier
from pgoutbox.core.errors import DatabaseUnavailable
from pgoutbox.core.gate import Gate, Outage

log = logging.getLogger(__name__)
T = TypeVar("T")

# Times an inbox call runs again at once after a clash with a concurrent transaction.
_CLASHES = 3


class Stopping(Exception):
    """The consumer stops while a message waits for PostgreSQL: it is left
    unacknowledged, for JetStream to redeliver."""


class DatabaseGate(Gate):
    """Whether PostgreSQL answers, as the consumer's inbox calls found it.
    Closed by the first call that finds it away (one log line per outage);
    from then on one probe, with growing pauses, decides when it is back.
    Fetch loops wait while it is closed; inbox calls of the messages in hand
    wait and run again (run). The probe is one cheap query, so its pauses
    stay short (reconnect_delays: 0.1 s doubling to 5 s), where a handler's
    and JetStream's probes, which cost a real event, grow to 30 s."""

    def __init__(self, probe: Callable[[], Awaitable[Any]]):
        super().__init__(Outage())
        self.outage.what = "PostgreSQL"
        self._probe = probe
        self._watch: asyncio.Task[None] | None = None

    async def run(self, call: Callable[[], Awaitable[T]], stopping: asyncio.Event) -> T:
        """Runs an inbox call; while PostgreSQL is away, waits for it (the
        gate) and runs it again: the message waiting here stays in hand, kept
        alive by in-progress acks. Stopping when `stopping` is set meanwhile."""
        clashes = 0
        while True:
            if not await self.wait(stopping):
                raise Stopping()
            try:
                return await call()
            except DatabaseUnavailable as exc:
                if not exc.retryable:
                    raise
                self.lost(exc)
            except psycopg.Error as exc:
                # A clash with a concurrent transaction rolled the call back:
                # once more at once (any other failure is the message's own).
                if db.failure_of(exc) is not db.Failure.CLASH or clashes >= _CLASHES:
                    raise
                clashes += 1

    def lost(self, exc: BaseException) -> None:
        if not self.is_up:
            return
        self.close_for(str(exc))
        log.warning(
            "PostgreSQL away (%s): fetching paused; the messages in hand wait for it",
            exc,
            extra={"action": "db_away"},
        )
        self._watch = asyncio.create_task(self._until_back())

    async def _until_back(self) -> None:
        # Not stop-aware: close() cancels this task when the consumer stops.
        retry = Retrier(every=30.0)
        while True:
            await retry.pause()
            try:
                await self._probe()
                break
            except Exception as exc:
                self.outage.still(str(exc))
                if retry.failed():
                    log.warning("PostgreSQL still away: %s", exc, extra={"action": "db_retry"})
        episode = self.open()
        log.info(
            "PostgreSQL back after %.1f s: fetching resumed",
            episode.seconds if episode else 0.0,
            extra={"action": "db_back"},
        )

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
