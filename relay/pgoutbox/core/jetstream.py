"""JetStream's pull API driven by hand ($JS.API.CONSUMER.MSG.NEXT), once for
the consumer's fetches (Puller) and the broker-loss audit's stream pass
(outbox/audit.py): a pull request, the server's status replies, where a
stream message stands.

A pull request is JSON published to `$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}`
with a reply subject: `batch` messages at most; `no_wait` (the server sends
what is there, then a 404 status) or `expires` (it waits that long for
messages, then sends a 408). Messages and statuses arrive on the reply
subject. A status (no reply subject, a `Status` header) ends the request
when it is 4xx or 5xx: 404 no messages (no_wait), 408 expired, 409 a
conflict (the consumer was deleted, max_waiting reached, ...); a heartbeat
(100) ends nothing.

nats-py's fetch takes any delivered message with a `Status` header for the
server's own status reply: a stream message carrying `Status: 404` ends the
fetch, `Status: 1` makes it raise, and one left in its queue is dropped
unacknowledged. Such a message (any producer can publish one) came back at
every redelivery and stalled its handler. Here a message is the server's
status only when it has no reply subject: every stream message has one
(`$JS.ACK.…`, for its acknowledgements), whatever its headers say.

A fetch (Puller.fetch) asks for what is there at once (no_wait: the server sends up to
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
from nats.aio.msg import Msg

from pgoutbox.core.stopping import wait_set

# Beyond the request's own expiry: how long to wait for its 408 before
# taking the request as lost (a reconnect drops pending pull requests).
_GRACE = 1.0


def next_subject(stream: str, consumer: str) -> str:
    """Where a pull request for `consumer` of `stream` is published."""
    return f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def pull_request(batch: int, expires: float | None = None) -> bytes:
    """A pull request for up to `batch` messages: waiting `expires` seconds
    for them, or, without it, no_wait (only what is there at once)."""
    request: dict[str, Any] = {"batch": batch}
    if expires is None:
        request["no_wait"] = True
    else:
        request["expires"] = int(expires * 1_000_000_000)  # nanoseconds
    return json.dumps(request).encode()


def status(msg: Msg) -> str | None:
    """None for a stream message, else the server's status code ("404", "100", ...).
    A message is the server's status only when it has no reply subject:
    every stream message has one (`$JS.ACK.…`, for its acknowledgements),
    whatever its headers say."""
    if msg.reply:
        return None
    return (msg.headers or {}).get("Status", "")


def ends_request(code: str) -> bool:
    """Whether a status ends its pull request (4xx, 5xx; not a heartbeat, 100)."""
    return code[:1] in ("4", "5")


def position(msg: Msg) -> tuple[int, int]:
    """A stream message's stream sequence and the messages still pending
    for its consumer, read from its reply subject
    `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>`
    without building nats-py's metadata; the longer form (with domain and
    account hash) through the metadata."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[8])
    meta = msg.metadata
    return meta.sequence.stream, meta.num_pending


class Puller:
    """Fetches from one durable (`stream`, `durable`) over `nc`."""

    def __init__(self, nc: Any, stream: str, durable: str):
        self._nc = nc
        self._next = next_subject(stream, durable)
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
        code = status(msg)
        if code is None:
            self._messages.append(msg)
        elif ends_request(code):
            self._ended.add(msg.subject)
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
        wait = _GRACE + 1.0 if expires is None else expires + _GRACE
        had = len(self._messages)
        await self._nc.publish(self._next, pull_request(batch, expires), reply=reply)
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
