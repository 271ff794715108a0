"""Pull requests to a JetStream durable, read without mistaking a message
for a server status.

nats-py's fetch takes any delivered message with a `Status` header for the
server's own status reply: a stream message carrying `Status: 404` ends the
fetch, `Status: 1` makes it raise, and one left in its queue is dropped
unacknowledged. Such a message (any producer can publish one) came back at
every redelivery and stalled its handler. Here a message is the server's
status only when it has no reply subject: every stream message has one
(`$JS.ACK.…`, for its acknowledgements), whatever its headers say.

A fetch asks for what is there at once (no_wait: the server sends up to
`batch` messages, then a 404 status when it has no more); when nothing is,
it waits for the first message to arrive (a request for one, expiring after
`timeout`), so that a message is handed on as soon as it arrives and no
request is left open for messages nobody would take. Each request has its
own reply subject, so that a late status of an earlier request is told
apart; a stream message is taken whichever request brought it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import nats.errors

from pgoutbox.core.stopping import wait_set

# Beyond the request's own expiry: how long to wait for its 408 before
# taking the request as lost (a reconnect drops pending pull requests).
_GRACE = 1.0


class Puller:
    """Fetches from one durable (`stream`, `durable`) over `nc`."""

    def __init__(self, nc: Any, stream: str, durable: str):
        self._nc = nc
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._prefix = nc.new_inbox()
        self._ids = itertools.count()
        self._messages: list[Any] = []  # stream messages not yet handed out
        self._arrived = asyncio.Event()
        self._ended: set[str] = set()  # reply subjects whose request the server ended
        self._sub: Any = None

    async def start(self) -> Puller:
        # No pending limits: a message that arrived is a delivery whose
        # ack_wait runs; dropping it would only delay it.
        self._sub = await self._nc.subscribe(
            f"{self._prefix}.*", cb=self._on_msg, pending_msgs_limit=0, pending_bytes_limit=0
        )
        return self

    async def _on_msg(self, msg: Any) -> None:
        if msg.reply:
            self._messages.append(msg)
        elif (msg.headers or {}).get("Status", "")[:1] in ("4", "5"):
            # No messages (404, no_wait), expired (408), a conflict (409: the
            # consumer was deleted, max_waiting reached, ...): the request is over.
            self._ended.add(msg.subject)
        # A heartbeat (100) ends nothing.
        self._arrived.set()

    async def fetch(self, batch: int, timeout: float) -> list[Any]:
        """Up to `batch` messages; nats.errors.TimeoutError when none came within `timeout`."""
        if len(self._messages) < batch:
            await self._request(batch - len(self._messages), None)
        if not self._messages:
            await self._request(1, timeout)
        if not self._messages:
            raise nats.errors.TimeoutError
        taken, self._messages = self._messages[:batch], self._messages[batch:]
        return taken

    async def _request(self, batch: int, expires: float | None) -> None:
        """One pull request, until the server ended it (404, 408), it brought
        `batch` messages, or it is taken as lost."""
        reply = f"{self._prefix}.{next(self._ids)}"
        request: dict[str, Any] = {"batch": batch}
        if expires is None:
            request["no_wait"] = True
            wait = _GRACE + 1.0
        else:
            request["expires"] = int(expires * 1_000_000_000)
            wait = expires + _GRACE
        had = len(self._messages)
        await self._nc.publish(self._next, json.dumps(request).encode(), reply=reply)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while reply not in self._ended and len(self._messages) - had < batch:
            left = deadline - loop.time()
            if left <= 0:
                break
            self._arrived.clear()
            if not await wait_set(self._arrived, left):
                break
        self._ended.discard(reply)

    async def unsubscribe(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
