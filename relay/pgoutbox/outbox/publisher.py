"""Pipelined JetStream publishing of claimed outbox rows, one outcome per row.

Every message of a batch is sent before any ack is awaited (one reply inbox,
one future per message), then the acks are awaited together under one
timeout. nats-py's own js.publish_async is not used: in nats-py 2.16 a
JetStream error reply (e.g. "message size exceeds maximum allowed") raises
inside its reply callback and the future never resolves, which would turn a
permanent error into an endless series of timeouts.

Outcomes carry a stable error code as the prefix of their text (it ends up in
outbox.events.last_error); permanent ones are dead-lettered at once, the
others are retried with backoff. docs/relay.md lists the codes.

Each failed outcome is also either *away* (the broker did not answer: no ack
in time, not connected, no responders that JetStream cannot confirm as "no
stream", a JetStream API error that says JetStream itself cannot serve now)
or *refused* (JetStream answered with an error about this message). Only a
refusal is the event's own failure: the relay hands away outcomes back with no
attempt counted and pauses claiming until JetStream answers again
(docs/relay.md, "JetStream away").
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from pgoutbox.core import broker, wire
from pgoutbox.core.cloudevents import DEFAULT_SOURCE
from pgoutbox.core.errors import BrokerUnavailable
from pgoutbox.core.stopping import wait_set
from pgoutbox.core.wire import HEADER_FRAMING, JS_MESSAGE_TOO_LARGE, PERMANENT, PublishError, message_size

log = logging.getLogger(__name__)

# JetStream API errors that say JetStream itself cannot serve now, not that
# this message is wrong (nats-server server/errors.json, error_code: HTTP
# code, constant): a publish that gets one is "away", handed back with no
# attempt counted. Every other API error (10054 too large, 10071 wrong last
# sequence, 10070 wrong last msg id, 10097 header too large, ...) is a
# refusal of the message and counts toward its attempts.
JETSTREAM_AWAY_CODES = frozenset(
    {
        10008,  # 503 JSClusterNotAvailErr: "JetStream system temporarily unavailable" (no meta leader, no quorum)
        10009,  # 500 JSClusterNotLeaderErr: "JetStream cluster can not handle request" (not leader)
        10023,  # 503 JSInsufficientResourcesErr: "insufficient resources"
        10028,  # 500 JSMemoryResourcesExceededErr: "insufficient memory resources available"
        10039,  # 503 JSNotEnabledForAccountErr: "JetStream not enabled for account"
        10047,  # 500 JSStorageResourcesExceededErr: "insufficient storage resources available"
        10076,  # 503 JSNotEnabledErr: "JetStream not enabled"
        10077,  # 503 JSStreamStoreFailedF: the stream's store failed
        10118,  # 500 JSStreamOfflineErr: "stream is offline"
        10194,  # 500 JSStreamOfflineReasonErrF: "stream is offline: {err}"
    }
)
# last_error holds the code and a bounded detail (it quotes the event's own values).
MAX_DETAIL = 500


@dataclass(frozen=True)
class Outcome:
    event_id: Any
    duplicate: bool = False  # JetStream had it already (a re-publish): still a success
    code: PublishError | None = None
    detail: str = ""
    away: bool = False  # the broker did not answer: handed back, no attempt counted

    @property
    def ok(self) -> bool:
        return self.code is None

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT

    @property
    def error(self) -> str:
        detail = self.detail[:MAX_DETAIL] + ("..." if len(self.detail) > MAX_DETAIL else "")
        # PostgreSQL text holds neither NUL nor lone surrogates.
        detail = detail.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()
        return f"{self.code}: {detail}"


class _Rejected(Exception):
    """A JetStream error reply to a publish."""

    def __init__(self, err_code: int | None, description: str):
        super().__init__(description)
        self.err_code = err_code


class _NoResponders(Exception):
    """Nothing listens on the subject: no stream captures it."""


def encode(row: Mapping[str, Any], source: str = DEFAULT_SOURCE) -> tuple[str, bytes, dict[str, str]]:
    """wire.to_nats, plus what a claimed row must satisfy that a replayed
    envelope need not: the subject the INSERT trigger derives from the row's
    parts, and an object payload (rows written around emit can lack both)."""
    subject, body, headers = wire.to_nats(row, source)
    if subject != f"{row['context']}.event.{row['event_type']}.v{row['event_version']}":
        raise wire.WireError(
            PublishError.BAD_SUBJECT,
            f"subject {subject!r} is not {{context}}.event.{{event_type}}.v{{event_version}} of this event",
        )
    if body[:1] != b"{":  # jsonb renders an object with "{" first
        raise wire.WireError(PublishError.BAD_PAYLOAD, f"payload is not a JSON object: {body[:40]!r}")
    return subject, body, headers


def encode_outcome(row: Mapping[str, Any], source: str = DEFAULT_SOURCE) -> tuple[str, bytes, dict[str, str]] | Outcome:
    """The message for a row, or the row's permanent failure: nothing an event
    carries may fail its batch."""
    try:
        return encode(row, source)
    except wire.WireError as exc:
        code = PublishError._value2member_map_.get(exc.code, PublishError.ENCODE_FAILED)
        return Outcome(row["event_id"], code=code, detail=exc.detail)  # type: ignore[arg-type]
    except Exception as exc:
        return Outcome(row["event_id"], code=PublishError.ENCODE_FAILED, detail=f"{type(exc).__name__}: {exc}")


# A JetStream publish ack as nats-server writes it (PubAck: stream, an
# optional domain, seq, duplicate only when true); anything else, an error
# reply included, is read as JSON.
_PUB_ACK = re.compile(rb'\{"stream":"[^"\\]*",(?:"domain":"[^"\\]*",)?"seq":\d+(,"duplicate":true)?\}')


def _hpub(subject: str, reply: str, headers: Mapping[str, str], body: bytes) -> bytes:
    """The HPUB command nats-py's publish builds for these headers, built in
    one join: to_nats has checked every name (an HTTP token) and value (no CR,
    LF or white space at an end), so nats-py's per-header strip, check and
    newline translation would change nothing."""
    block = ("NATS/1.0\r\n" + "".join([f"{k}: {v}\r\n" for k, v in headers.items()]) + "\r\n").encode()
    return b"%s\r\n%s\r\n" % (f"HPUB {subject} {reply} {len(block)} {len(block) + len(body)}".encode(), block + body)


def _may_exceed(body: bytes, headers: Mapping[str, str], limit: int) -> bool:
    """Cheap upper bound first (a UTF-8 character is at most 4 bytes); exact only near the limit."""
    chars = sum(map(len, headers)) + sum(map(len, headers.values())) + 4 * len(headers)
    return len(body) + HEADER_FRAMING + 4 * chars > limit and message_size(body, headers) > limit


class Publisher:
    """One NATS connection that reconnects forever; publishes batches pipelined."""

    def __init__(self, url: str, *, timeout: float, name: str = "pgoutbox-relay", source: str = DEFAULT_SOURCE):
        self.url = url
        self.source = source  # the CloudEvents source template (OUTBOX_CLOUDEVENTS_SOURCE)
        self.timeout = timeout
        self.name = name
        self.nc: nats.NATS | None = None
        self._connected = asyncio.Event()
        self._inbox = ""
        self._tokens = itertools.count()
        self._waiting: dict[str, asyncio.Future[bool]] = {}  # token -> duplicate

    @property
    def js(self) -> JetStreamContext:
        return self._client().jetstream(timeout=self.timeout)

    def _client(self) -> nats.NATS:
        if self.nc is None:  # publish_batch before connect(): the batch fails and is retried
            raise BrokerUnavailable("not connected to NATS yet")
        return self.nc

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def wait_connected(self, timeout: float | None = None) -> bool:
        await wait_set(self._connected, timeout)
        return self.connected

    async def connect(self) -> None:
        """Returns once connected; retries for as long as NATS is unreachable."""

        async def disconnected() -> None:
            self._connected.clear()

        async def reconnected() -> None:
            self._connected.set()

        self.nc = await broker.connect(self.url, self.name, disconnected_cb=disconnected, reconnected_cb=reconnected)
        self._inbox = self.nc.new_inbox()
        await self.nc.subscribe(self._inbox + ".*", cb=self._on_reply)
        self._connected.set()

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()

    async def _on_reply(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject.rpartition(".")[2], None)
        if future is None or future.done():
            return  # a late ack for a publish already given up on
        if msg.headers and msg.headers.get("Status") == "503":  # NATS's no-responders status, not an API error
            future.set_exception(_NoResponders())
            return
        ack = _PUB_ACK.fullmatch(msg.data)
        if ack is not None:  # the common case, without a JSON decode per message
            future.set_result(ack[1] is not None)
            return
        try:
            reply = json.loads(msg.data)
        except ValueError:
            future.set_exception(_Rejected(None, f"unreadable ack {msg.data[:100]!r}"))
            return
        err = reply.get("error")
        if err:
            future.set_exception(_Rejected(err.get("err_code"), err.get("description", str(err))))
        else:
            future.set_result(bool(reply.get("duplicate")))

    async def publish_batch(self, rows: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        """Publishes every row (Nats-Msg-Id = event_id) and waits for all acks."""
        if not self.connected:
            return [
                Outcome(r["event_id"], code=PublishError.NATS_UNAVAILABLE, detail="not connected", away=True)
                for r in rows
            ]
        outcomes: list[Outcome | None] = [None] * len(rows)
        sent: dict[int, tuple[str, asyncio.Future[bool]]] = {}
        nc = self._client()
        max_payload = nc.max_payload
        loop = asyncio.get_running_loop()
        send, flush = _sender(nc)
        for i, row in enumerate(rows):
            message = encode_outcome(row, self.source)
            if isinstance(message, Outcome):
                outcomes[i] = message
                continue
            subject, body, headers = message
            if _may_exceed(body, headers, max_payload):
                # The server would answer with -ERR and drop the connection.
                outcomes[i] = Outcome(
                    row["event_id"],
                    code=PublishError.MAX_PAYLOAD,
                    detail=f"message of {message_size(body, headers)} bytes (payload and headers) exceeds the "
                    f"server's max_payload of {max_payload} bytes",
                )
                continue
            token = str(next(self._tokens))
            future = self._waiting[token] = loop.create_future()
            try:
                await send(subject, f"{self._inbox}.{token}", headers, body)
            except Exception as exc:
                self._waiting.pop(token, None)
                outcomes[i] = _classify_send_error(row["event_id"], exc)
                continue
            sent[i] = (token, future)
        if sent:
            await flush()
            await asyncio.wait([f for _, f in sent.values()], timeout=self.timeout)
        no_stream: dict[str, Outcome] = {}
        for i, (token, future) in sent.items():
            event_id = rows[i]["event_id"]
            if not future.done():
                self._waiting.pop(token, None)
                future.cancel()
                outcomes[i] = Outcome(
                    event_id,
                    code=PublishError.PUBLISH_TIMEOUT,
                    detail=f"no JetStream ack within {self.timeout:g}s",
                    away=True,
                )
                continue
            failure = future.exception()
            if failure is None:
                outcomes[i] = Outcome(event_id, duplicate=future.result())
            elif isinstance(failure, _NoResponders):
                subject = rows[i]["subject"]
                if subject not in no_stream:
                    no_stream[subject] = await self._confirm_no_stream(subject)
                found = no_stream[subject]
                outcomes[i] = Outcome(event_id, code=found.code, detail=found.detail, away=found.away)
            else:
                outcomes[i] = rejected(event_id, getattr(failure, "err_code", None), str(failure))
        return outcomes  # type: ignore[return-value]

    async def jetstream_answers(self) -> str | None:
        """The probe of a JetStream away: None when JetStream answers an
        account info request ($JS.API.INFO; a clustered JetStream answers it
        only with a meta leader), else why not. It does not prove that a
        stream has a leader: the relay's next small claim does."""
        if not self.connected:
            return "NATS_UNAVAILABLE: not connected"
        try:
            await self.js.account_info()
        except Exception as exc:
            answer = f"{type(exc).__name__}: {exc}".rstrip(": ")
            return f"{PublishError.NATS_UNAVAILABLE}: JetStream did not answer $JS.API.INFO: {answer}"
        return None

    async def _confirm_no_stream(self, subject: str) -> Outcome:
        """A no-responders reply is permanent only if JetStream itself says no
        stream captures the subject (not while JetStream is still starting)."""
        try:
            stream = await self.js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return Outcome(
                None, code=PublishError.NO_STREAM, detail=f"no JetStream stream captures subject {subject!r}"
            )
        except Exception as exc:
            return Outcome(
                None,
                code=PublishError.NATS_UNAVAILABLE,
                detail=f"JetStream did not answer for {subject!r}: {type(exc).__name__}",
                away=True,
            )
        # The stream exists but nothing answered for it: no leader (yet).
        return Outcome(
            None,
            code=PublishError.JETSTREAM_ERROR,
            detail=f"stream {stream} did not respond for {subject!r}",
            away=True,
        )


def _sender(
    nc: nats.NATS,
) -> tuple[Callable[[str, str, dict[str, str], bytes], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """(send, flush) for one batch: send queues one message as nats-py's
    publish does, with its header block built by _hpub; flush hands what was
    queued to nats-py's flusher once per batch (its publish asks for a flush
    per message). Built on nats-py internals (pinned in pyproject.toml), so a
    client without them gets its own publish (tests/unit/test_relay_hpub.py
    checks that both put the same bytes on the wire)."""
    command = getattr(nc, "_send_command", None)
    if command is None or not hasattr(nc, "_flush_pending"):

        async def publish(subject: str, reply: str, headers: dict[str, str], body: bytes) -> None:
            await nc.publish(subject, body, reply=reply, headers=headers)

        async def nothing() -> None:
            return None

        return publish, nothing
    stats = nc.stats

    async def send(subject: str, reply: str, headers: dict[str, str], body: bytes) -> None:
        # What nats-py's publish checks before it queues (the subject was checked by to_nats,
        # the size by _may_exceed; publish_batch runs only while connected).
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        if nc.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        if len(body) > nc.max_payload:
            raise nats.errors.MaxPayloadError
        await command(_hpub(subject, reply, headers, body))
        stats["out_msgs"] += 1
        stats["out_bytes"] += len(body)

    async def flush() -> None:
        if nc.is_connected and nc._flush_queue is not None and nc._flush_queue.empty():  # else a flush is due
            await nc._flush_pending()

    return send, flush


def rejected(event_id: Any, err_code: int | None, description: str) -> Outcome:
    """The outcome of a JetStream API error reply to a publish: away when its
    code says JetStream cannot serve now (JETSTREAM_AWAY_CODES), else a
    refusal of this message: too large for the stream (a stream's
    max_msg_size) is MAX_PAYLOAD, permanent; any other may clear (limits
    reached, a leader moving...) and is retried."""
    code = PublishError.MAX_PAYLOAD if err_code == JS_MESSAGE_TOO_LARGE else PublishError.JETSTREAM_ERROR
    return Outcome(event_id, code=code, detail=f"[{err_code}] {description}", away=err_code in JETSTREAM_AWAY_CODES)


def _classify_send_error(event_id: Any, exc: Exception) -> Outcome:
    if isinstance(exc, nats.errors.MaxPayloadError):
        return Outcome(event_id, code=PublishError.MAX_PAYLOAD, detail="payload exceeds max_payload")
    if isinstance(exc, nats.errors.BadHeaderError):
        return Outcome(event_id, code=PublishError.BAD_HEADER, detail=str(exc))
    if isinstance(exc, nats.errors.BadSubjectError):
        return Outcome(event_id, code=PublishError.BAD_SUBJECT, detail="nats-py refused the subject")
    if isinstance(exc, (UnicodeError, TypeError, ValueError)):  # the message itself, not the connection
        return Outcome(event_id, code=PublishError.ENCODE_FAILED, detail=f"{type(exc).__name__}: {exc}")
    # The connection failed under the send (closed, reconnecting, flush timeout).
    return Outcome(event_id, code=PublishError.NATS_UNAVAILABLE, detail=f"{type(exc).__name__}: {exc}", away=True)
