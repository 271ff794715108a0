"""Wake-ups: a dedicated LISTEN connection turns the outbox_v1 notifications
into an event the claim loop waits on, together with its two timers.

The trigger throttles notifications (sql/40_outbox_wakeup.sql): an event
emitted within one throttle interval after a notification sends none.
So after each notification the loop also claims once more one interval later
(recheck_at), and in any case polls every poll_interval: a notification is a
hint, the table is the truth. After a reconnection the loop is woken at once,
since notifications sent meanwhile are lost; the relay also asks to be woken
when a retry it scheduled falls due (no notification announces that).

Failover: notifications come only from the server the session listens on. The
liveness call also asks whether that server still takes writes; one that no
longer does (a primary fenced read-only while a standby takes over) is left,
and the loop listens anew on whichever server the conninfo's
target_session_attrs=read-write finds. A retired primary simply drops the
session, with the same outcome.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time

from pgoutbox.core import db
from pgoutbox.core.backoff import Every, reconnect_delays
from pgoutbox.outbox import calls
from pgoutbox.outbox.calls import WAKEUP_CHANNEL, DatabaseUnavailable

log = logging.getLogger("pgoutbox.outbox.wakeups")

# Also true on a standby and on a primary fenced with default_transaction_read_only.
_LIVENESS = "SELECT outbox.schema_version() AS v, current_setting('transaction_read_only') = 'on' AS read_only"


class Wakeups:
    def __init__(self, poll_interval: float, throttle: float = 0.0):
        self.poll_interval = poll_interval
        self.throttle = throttle
        self.received = 0
        self._event = asyncio.Event()
        self._deadlines: list[float] = []  # heap of monotonic times to claim again

    def wake(self) -> None:
        self._event.set()

    def wake_at(self, when: float) -> None:
        """Claim again at `when` (monotonic), e.g. when a retry falls due."""
        heapq.heappush(self._deadlines, when)

    def notified(self) -> None:
        self.received += 1
        self.wake_at(time.monotonic() + self.throttle)
        self._event.set()

    def arm(self) -> None:
        """Called right before a claim: wake-ups from now on count for the next wait."""
        self._event.clear()
        now = time.monotonic()
        while self._deadlines and self._deadlines[0] <= now:
            heapq.heappop(self._deadlines)

    async def wait(self) -> None:
        """Until a notification, a wake(), the next deadline or the fallback poll."""
        timeout = self.poll_interval
        if self._deadlines:
            timeout = min(timeout, max(0.0, self._deadlines[0] - time.monotonic()))
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass

    async def listen(self, database_url: str | None) -> None:
        """LISTEN forever (cancel to stop), reconnecting after connection loss."""
        pool = calls.pool(database_url, "listen")  # a session of its own, checked like the others
        try:
            await self._listen(pool)
        finally:
            await pool.close()

    async def _listen(self, pool) -> None:
        delays, lines = reconnect_delays(), Every()
        while True:
            try:
                conn = await pool.getconn()
            except DatabaseUnavailable as exc:
                if lines():
                    log.warning(
                        "LISTEN connection failed (attempt %d): %s",
                        lines.attempts,
                        exc,
                        extra={"action": "listen_retry"},
                    )
                await asyncio.sleep(next(delays))
                continue
            try:
                await conn.execute(f"LISTEN {WAKEUP_CHANNEL}")
                delays, lines = reconnect_delays(), Every()
                self.wake()
                log.info("listening", extra={"action": "listen", "channel": WAKEUP_CHANNEL})
                while True:
                    # The timeout turns a silently dead connection into an
                    # error: the liveness call below fails on it.
                    async for _ in conn.notifies(timeout=max(self.poll_interval, 5.0)):
                        self.notified()
                    cur = await conn.execute(_LIVENESS)
                    row = await cur.fetchone()
                    if row and row["read_only"]:  # the pool's sessions return dicts (calls.pool)
                        raise DatabaseUnavailable(
                            f"the server of the LISTEN session at {db.describe(pool.database_url)} "
                            "no longer accepts writes (a standby took over?): listening anew"
                        )
            except Exception as exc:
                if lines():
                    log.warning(
                        "LISTEN connection lost: %s",
                        " / ".join(str(exc).split("\n")).strip() or type(exc).__name__,
                        extra={"action": "listen_lost"},
                    )
                await asyncio.sleep(next(delays))
            finally:
                await conn.close()  # LISTEN state must not outlive this loop: the pool replaces it
                await pool.putconn(conn)
