"""One gate per handler: a handler that is away delays its messages, never
dead-letters them.

A handler is away when an answer says nothing about the message: no
connection (refused, reset before any answer, a name that does not resolve,
no connection within the timeout) or 429, 502, 503, 504
(handler_client.AWAY_STATUSES). The first such answer closes the handler's
gate: its fetch loops (events and replays) stop fetching, and each message in
hand that gets such an answer goes back with a nak, its inbox row left
RECEIVED, no failure counted (flow.MessageFlow._act). One probe finds when the
handler is back: after a pause (core.gate.FIRST_PAUSE doubling up to
PAUSE_CAP, or a longer Retry-After of a 429 or 503, up to the cap), one fetch
of one message goes through; the handler's answer about it (2xx, 4xx, 500,
a timeout: anything but away) opens the gate, and that answer is the
message's own outcome as at any other time. An away answer keeps the gate
closed and the next probe waits a longer pause.

An away answer about one message while the handler answers the others (a
handler that resets the connection, or answers 503, for that payload every
time) would keep the gate closing, and that message coming back, without
end. So an away answer counts as the message's own failure, as a 500 would,
when since its previous away answer the handler answered a call made after
that answer (own_failure): a call made before it may be a straggler of the
minutes before an outage, and says nothing of now. A handler that is down
answers no call, so an outage of any length still counts nothing.

The gauge pgoutbox_consumer_handler_up{handler} reads 0 while the gate is
closed, /readyz names the handler and why, and one log line marks the start
and one the end of each episode (actions handler_away, handler_back).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from pgoutbox.core.gate import PAUSE_CAP, Gate, Outage
from pgoutbox.core.stopping import sleep, until_stopped

log = logging.getLogger(__name__)

# Messages whose last away answer the gate remembers (the oldest forgotten
# first): a forgotten one's next away answer is a deferral again.
REMEMBERED = 10_000


class HandlerGate(Gate):
    def __init__(self, handler: str, up_gauge: object | None = None, *, stopping: asyncio.Event) -> None:
        super().__init__(Outage())
        self.handler = handler
        self.outage.what = f"handler {handler}"
        self._gauge = up_gauge
        self._stopping = stopping
        self._turn = asyncio.Event()  # one probe may go
        self._probing = False  # a probe's message is in hand
        self._timer: asyncio.Task[None] | None = None
        self._at_least = 0.0  # a Retry-After the next pause honours
        self._calls = 0  # calls made so far, numbered from 1
        self._answered = 0  # the latest call answered about its message
        self._went_back: OrderedDict[str, int] = OrderedDict()  # message id -> calls made at its away answer
        self._set_gauge(1)

    def _set_gauge(self, value: int) -> None:
        if self._gauge is not None:
            self._gauge.set(value)  # type: ignore[attr-defined]

    # -- what the message flow reports ---------------------------------------------
    def calling(self) -> int:
        """A call is about to be made: its number, for answered() and own_failure()."""
        self._calls += 1
        return self._calls

    def own_failure(self, message_id: str) -> bool:
        """An away answer about this message: True when it is the message's
        own failure (since its previous away answer the handler answered a
        call made after that answer), False when it is the handler away."""
        before = self._went_back.pop(message_id, None)
        self._went_back[message_id] = self._calls
        if len(self._went_back) > REMEMBERED:
            self._went_back.popitem(last=False)
        return before is not None and self._answered > before

    def away(self, reason: str, retry_after: float | None = None) -> None:
        """An answer that says the handler is away."""
        if retry_after is not None:
            self._at_least = max(self._at_least, min(retry_after, PAUSE_CAP))
        if self.close_for(reason):
            self._set_gauge(0)
            log.warning(
                "handler %s away (%s): fetching paused, its messages go back without counting a failure",
                self.handler,
                reason,
                extra={"action": "handler_away", "handler": self.handler},
            )
            self._schedule()
        else:
            self.outage.still(reason)
        self.outage.counted(1)

    def answered(self, call: int = 0) -> None:
        """An answer about a message (to call number `call`): the handler is there."""
        self._answered = max(self._answered, call)
        if self.is_up:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._turn.clear()
        self._probing = False
        self._at_least = 0.0
        episode = self.open()
        self._set_gauge(1)
        if episode is not None:
            log.info(
                "handler %s back after %.1f s: fetching resumed (%d message(s) went back meanwhile)",
                self.handler,
                episode.seconds,
                episode.handed_back,
                extra={
                    "action": "handler_back",
                    "handler": self.handler,
                    "seconds": round(episode.seconds, 1),
                    "handed_back": episode.handed_back,
                },
            )

    # -- what the fetch loops ask ---------------------------------------------------
    async def admit(self, stopping: asyncio.Event) -> bool | None:
        """Before a fetch: False when the gate is open (fetch as usual), True
        when it is closed and this fetch is the probe (one message), None
        when the consumer stops meanwhile."""
        while not self.is_up:
            opened = asyncio.ensure_future(self._up.wait())
            turn = asyncio.ensure_future(self._turn.wait())
            try:
                if not await until_stopped(asyncio.wait({opened, turn}, return_when=asyncio.FIRST_COMPLETED), stopping):
                    return None
            finally:
                opened.cancel()
                turn.cancel()
            if self.is_up:
                return False
            if self._turn.is_set():
                self._turn.clear()
                self._probing = True
                return True
        return False

    def probe_unused(self) -> None:
        """The probe's fetch found no message: the next fetch is the probe."""
        if not self.is_up and self._probing:
            self._probing = False
            self._turn.set()

    def probe_done(self) -> None:
        """The probe's message is finished; still away: the next probe after a longer pause."""
        self._probing = False
        if not self.is_up:
            self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None and not self._timer.done():
            return
        pause = max(self.outage.next_pause(), self._at_least)
        self._at_least = 0.0
        self._timer = asyncio.create_task(self._after(pause))

    async def _after(self, pause: float) -> None:
        if await sleep(pause, self._stopping) and not self.is_up:
            self._turn.set()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
