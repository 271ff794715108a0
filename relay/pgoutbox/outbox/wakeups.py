"""Wake-ups: a dedicated LISTEN connection turns the outbox_v1 notifications
into wake-ups of the claim loop's wait, together with its two timers.

The trigger throttles notifications (sql/15_outbox_wakeup.sql): an event
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
from collections.abc import Callable
from typing import Any

import psycopg

from pgoutbox.core import db
from pgoutbox.core.backoff import Retrier
from pgoutbox.core.errors import one_line
from pgoutbox.outbox import calls
from pgoutbox.outbox.calls import WAKEUP_CHANNEL, DatabaseUnavailable

log = logging.getLogger(__name__)

# Also true on a standby and on a primary fenced with default_transaction_read_only.
_LIVENESS = "SELECT outbox.schema_version() AS v, current_setting('transaction_read_only') = 'on' AS read_only"


class Wakeups:
    """What the claim loop waits for, without a task or a coroutine per wait:
    one future at a time, resolved by a notification, wake(), stop() or its
    timer (the next deadline, the fallback poll, or the end of a pause). At
    moderate rates the relay spends most of its CPU going to sleep and waking
    up again, so a wait costs one future and one timer handle, and a
    notification one callback (listen)."""

    def __init__(self, poll_interval: float, throttle: float = 0.0):
        self.poll_interval = poll_interval
        self.throttle = throttle
        self.received = 0
        self._woken = False  # a wake-up since arm()
        self._urgent = False  # a wake-up since arm() that no pause may hold back
        self._stopped = False
        self._waiter: asyncio.Future[None] | None = None
        self._wakes = True  # whether the waiter ends on a wake-up (not during a pause)
        self._deadlines: list[float] = []  # heap of monotonic times to claim again
        # The LISTEN session's socket and reader while one watches it (listen).
        self._listener: tuple[asyncio.AbstractEventLoop, int, Callable[[], None]] | None = None

    def wake(self, *, urgent: bool = False) -> None:
        """Claim again. urgent: at once, even within the claim interval (a
        key's next event became claimable: its latency is a chain's)."""
        self._woken = True
        self._urgent = self._urgent or urgent
        if self._wakes or urgent:
            self._resolve()

    def stop(self) -> None:
        """Ends the wait or pause under way, and every later one at once."""
        self._stopped = True
        self._resolve()

    def wake_at(self, when: float) -> None:
        """Claim again at `when` (monotonic), e.g. when a retry falls due."""
        heapq.heappush(self._deadlines, when)

    def notified(self) -> None:
        self.received += 1
        self.wake_at(time.monotonic() + self.throttle)
        self.wake()

    def arm(self) -> None:
        """Called right before a claim: wake-ups from now on count for the next wait."""
        self._woken = self._urgent = False
        now = time.monotonic()
        while self._deadlines and self._deadlines[0] <= now:
            heapq.heappop(self._deadlines)

    async def wait(self) -> None:
        """Until a notification, a wake(), the next deadline or the fallback poll."""
        if self._woken or self._stopped:
            return
        timeout = self.poll_interval
        if self._deadlines:
            timeout = min(timeout, self._deadlines[0] - time.monotonic())
            if timeout <= 0:
                return
        await self._sleep(timeout, wakes=True)

    async def pause(self, seconds: float) -> None:
        """Sleeps `seconds` whatever wakes meanwhile, but for an urgent one or
        stop(): the others count for the wait() after it, which then returns
        at once. The LISTEN socket is not watched meanwhile (a notification now
        would only wake the process for nothing): what arrived is read when
        the pause ends, as one notification."""
        if seconds <= 0 or self._stopped or self._urgent:
            return
        listener = self._listener
        if listener is not None:
            listener[0].remove_reader(listener[1])
        try:
            await self._sleep(seconds, wakes=False)
        finally:
            if listener is not None and self._listener is listener:
                listener[2]()  # what arrived meanwhile
                if self._listener is listener:  # not lost while reading
                    listener[0].add_reader(listener[1], listener[2])

    async def _sleep(self, seconds: float, *, wakes: bool) -> None:
        loop = asyncio.get_running_loop()
        self._waiter, self._wakes = loop.create_future(), wakes
        timer = loop.call_later(seconds, self._resolve)
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter, self._wakes = None, True

    def _resolve(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _notifications(self, conn: psycopg.AsyncConnection[Any], seconds: float) -> None:
        """For `seconds`, calls notified() whenever notifications arrive on the
        idle LISTEN session: a reader callback on its socket that reads them
        with libpq, rather than psycopg's notifies() generator (a wait set up
        and torn down per notification). Raises what reading raises (the
        connection lost)."""
        loop = asyncio.get_running_loop()
        pgconn, fd = conn.pgconn, conn.fileno()
        lost: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                pgconn.consume_input()
                got = False
                while pgconn.notifies() is not None:
                    got = True
            except Exception as exc:  # psycopg.OperationalError: the server went away
                loop.remove_reader(fd)
                self._listener = None
                if not lost.done():
                    lost.set_exception(exc)
                return
            if got:
                self.notified()

        self._listener = (loop, fd, readable)
        loop.add_reader(fd, readable)

        def timeout() -> None:
            if not lost.done():
                lost.set_result(None)

        timer = loop.call_later(seconds, timeout)
        try:
            await lost
        finally:
            timer.cancel()
            if self._listener is not None:
                self._listener = None
                loop.remove_reader(fd)

    async def listen(self, database_url: str | None) -> None:
        """LISTEN forever (cancel to stop), reconnecting after connection loss."""
        pool = calls.pool(database_url, "listen")  # a session of its own, checked like the others
        try:
            await self._listen(pool)
        finally:
            await pool.close()

    async def _listen(self, pool: db.Pool) -> None:
        retry = Retrier()  # cancelled to stop (listen)
        while True:
            try:
                conn = await pool.getconn()
            except DatabaseUnavailable as exc:
                if retry.failed():
                    log.warning(
                        "LISTEN connection failed (attempt %d): %s",
                        retry.attempts,
                        exc,
                        extra={"action": "listen_retry"},
                    )
                await retry.pause()
                continue
            try:
                # Notifications that arrive while psycopg runs a statement on
                # this session (LISTEN, the liveness call) come through here.
                conn.add_notify_handler(lambda _: self.notified())
                await conn.execute(f"LISTEN {WAKEUP_CHANNEL}")
                retry.succeeded()
                self.wake()
                log.info("listening", extra={"action": "listen", "channel": WAKEUP_CHANNEL})
                while True:
                    # The timeout turns a silently dead connection into an
                    # error: the liveness call below fails on it.
                    await self._notifications(conn, max(self.poll_interval, 5.0))
                    cur = await conn.execute(_LIVENESS)
                    row: Any = await cur.fetchone()
                    if row and row["read_only"]:  # the pool's sessions return dicts (calls.pool)
                        raise DatabaseUnavailable(
                            f"the server of the LISTEN session at {db.describe(pool.database_url)} "
                            "no longer accepts writes (a standby took over?): listening anew"
                        )
            except Exception as exc:
                if retry.failed():
                    log.warning(
                        "LISTEN connection lost: %s",
                        one_line(exc),
                        extra={"action": "listen_lost"},
                    )
                await retry.pause()
            finally:
                await conn.close()  # LISTEN state must not outlive this loop: the pool replaces it
                await pool.putconn(conn)
