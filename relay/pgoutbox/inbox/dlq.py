"""The dead-letter queue on the wire: one JetStream stream per bounded context
(`{CONTEXT}_DLQ`, subjects `{context}.dlq.>`, created by the consumer when no
stream captures them) holding two kinds of messages:

    {context}.dlq.dead.{handler}.{event_type}.v{n}   MessageDeadLettered notices
    {context}.dlq.dead.{handler}.invalid             messages refused before the inbox
                                                     (envelope.InvalidMessage: id, subject,
                                                     header or body at fault)
    {context}.dlq.replay.{handler}                   replays of a dead letter to its
                                                     one handler (its own durable)

Notices are deduplicated by message id: Nats-Msg-Id is
`{message_id}:dead:{handler}:{n}` with n the dead-letter count, so a consumer
that dies after publishing and before recording the dead letter publishes
the same notice again, and JetStream drops it.

Every notice fits under the server's max_payload: when copying the original
(envelope, or raw message) would not, the notice carries only its stream
and stream sequence. publish() tells a refusal that can never clear
(DlqRefused) from one that may.

A replay carries the original event exactly as the relay published it (see
core/wire.py; its ce-* headers are the CloudEvents attributes the original
carried, even those of a foreign or structured-mode one), except the subject and `Nats-Msg-Id =
{message_id}:replay:{handler}:{n}:{nonce}`: the nonce keeps JetStream from
dropping a replay that follows a crashed replayer pass, and the message id is
the part before the first colon, still taken from Nats-Msg-Id alone (a
delivery, replay or not, is read by core/wire.py::envelope_from).

DeadLetters is the consumer's side of it: the path a message takes when it
is dead-lettered in hand or cannot enter the inbox, apart from the flow
(flow.py) that every other message takes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from pgoutbox.core import cloudevents, wire
from pgoutbox.core.backoff import Backoff
from pgoutbox.core.errors import ConfigError, SqlState
from pgoutbox.core.stopping import sleep
from pgoutbox.core.wire import ORIGINAL_SUBJECT, PERMANENT_JS_ERRORS, PublishError, message_size
from pgoutbox.inbox.database_gate import DatabaseGate, Stopping
from pgoutbox.inbox.metrics import Outcome
from pgoutbox.inbox.settings import HandlerRuntime
from pgoutbox.inbox.store import Inbox, settles

log = logging.getLogger(__name__)
# A message to publish: subject, body, headers.
Notice = tuple[str, bytes, dict[str, str]]

HANDLER = "Pgoutbox-Handler"
# Of a notice that could not copy the original: the reason is ours, but may quote a handler.
_REASON_KEPT = 2000


def stream_name(context: str) -> str:
    return f"{context.upper()}_DLQ"


def stream_subject(context: str) -> str:
    return f"{context}.dlq.>"


def replay_subject(context: str, handler: str) -> str:
    return f"{context}.dlq.replay.{handler}"


def dead_subject(context: str, handler: str, envelope: Mapping[str, Any] | None) -> str:
    if envelope and envelope.get("event_type") and envelope.get("event_version"):
        return f"{context}.dlq.dead.{handler}.{envelope['event_type']}.v{envelope['event_version']}"
    return f"{context}.dlq.dead.{handler}.invalid"


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class NoticeTooLarge(Exception):
    """Not even the reference-only notice fits under the server's max_payload."""


def _fits(body: bytes, headers: Mapping[str, str], max_payload: int | None) -> bool:
    return max_payload is None or message_size(body, headers) <= max_payload


def _notice(
    *,
    context: str,
    handler: str,
    msg_id: str,
    original_subject: str,
    reason: str,
    envelope: Mapping[str, Any] | None,
    fields: dict[str, Any],
    copied: str,
    max_payload: int | None,
    copy: bool,
) -> Notice:
    """The notice with the original copied into field `copied` when asked and
    it fits under max_payload, else the same notice with `copied` null and a
    `{copied}_omitted` note: stream and stream_sequence then are the way to
    the original. NoticeTooLarge when not even that fits."""
    body = {
        "type": "MessageDeadLettered",
        "handler": handler,
        "original_subject": original_subject,
        "reason": reason,
        "dead_lettered_at": _now(),
        **fields,
    }
    headers = {wire.MSG_ID: msg_id, HANDLER: handler, ORIGINAL_SUBJECT: original_subject}
    subject = dead_subject(context, handler, envelope)
    full_headers = {**headers, **{k: v for k, v in ((envelope or {}).get("trace") or {}).items() if isinstance(v, str)}}
    data = json.dumps(body, default=str).encode()
    if copy and _fits(data, full_headers, max_payload):
        return subject, data, full_headers
    why = (
        f"the notice would take {message_size(data, full_headers)} bytes, over the server's max_payload of "
        f"{max_payload}"
        if copy
        else "JetStream refused the notice that copied it as too large"
    )
    body[copied] = None
    body[f"{copied}_omitted"] = (
        f"{copied} not copied: {why}; read the original at stream_sequence {body.get('stream_sequence')} "
        f"of stream {body.get('stream')}"
    )
    body["reason"] = reason[:_REASON_KEPT]
    data = json.dumps(body, default=str).encode()
    if _fits(data, headers, max_payload):
        return subject, data, headers
    raise NoticeTooLarge(
        f"even the reference-only notice takes {message_size(data, headers)} bytes, over the server's "
        f"max_payload of {max_payload}"
    )


def notice(
    *,
    context: str,
    handler: str,
    message_id: str,
    original_subject: str,
    reason: str,
    attempts: int,
    dead_letters: int,
    replay_attempts: int,
    next_replay_in: float | None,
    envelope: Mapping[str, Any] | None,
    stream: str | None = None,
    stream_sequence: int | None = None,
    max_payload: int | None = None,
    copy: bool = True,
) -> Notice:
    """A MessageDeadLettered notice (subject, body, headers) that fits under
    max_payload: with the envelope, or referencing the original by stream and
    stream sequence when the envelope does not fit."""
    return _notice(
        context=context,
        handler=handler,
        msg_id=f"{message_id}:dead:{handler}:{dead_letters}",
        original_subject=original_subject,
        reason=reason,
        envelope=envelope,
        copied="envelope",
        max_payload=max_payload,
        copy=copy,
        fields={
            "message_id": message_id,
            "attempts": attempts,
            "dead_letters": dead_letters,
            "replay_attempts": replay_attempts,
            "next_replay_in_seconds": next_replay_in,
            "stream": stream,
            "stream_sequence": stream_sequence,
            "envelope": dict(envelope) if envelope is not None else None,
        },
    )


def unreadable_notice(
    *,
    context: str,
    handler: str,
    stream: str | None,
    sequence: int | None,
    subject: str,
    body: bytes,
    headers: Mapping[str, str] | None,
    reason: str,
    max_payload: int | None = None,
    copy: bool = True,
) -> Notice:
    """A notice for a message that cannot enter the inbox, with its raw
    content when that fits under max_payload."""
    return _notice(
        context=context,
        handler=handler,
        msg_id=f"invalid:{stream}:{sequence}:{handler}",
        original_subject=subject,
        reason=reason,
        envelope=None,
        copied="raw",
        max_payload=max_payload,
        copy=copy,
        fields={
            "message_id": None,
            "stream": stream,
            "stream_sequence": sequence,
            "raw": {"headers": dict(headers or {}), "body": bytes(body).decode("utf-8", errors="replace")},
        },
    )


def replay_message(row: Mapping[str, Any]) -> Notice:
    """The replay of an inbox row (as inbox.claim_replays returns it)."""
    env = row["envelope"]
    meta = row["dlq_metadata"] or {}
    count = int(meta.get("replay_attempts") or 0) + int(meta.get("redrives") or 0)
    # The CloudEvents attributes as the original carried them (none: none).
    event = {
        **env,
        "event_id": env["message_id"],
        "subject": row["subject"],
        "headers": env.get("trace") or {},
        "cloudevents": cloudevents.expand(env["cloudevents"], env) if env.get("cloudevents") else None,
    }
    _, body, headers = wire.to_nats(event)
    headers[wire.MSG_ID] = f"{row['message_id']}:replay:{row['handler']}:{count}:{secrets.token_hex(4)}"
    headers[ORIGINAL_SUBJECT] = row["subject"]
    headers[HANDLER] = row["handler"]
    return replay_subject(row["context"], row["handler"]), body, headers


class DlqRefused(Exception):
    """A DLQ publish that can never succeed: retrying it would only repeat the refusal."""

    def __init__(self, code: PublishError, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code


async def publish(js: JetStreamContext, subject: str, body: bytes, headers: dict[str, str]) -> tuple[str, int]:
    """Publishes one DLQ message and returns the stream and sequence its
    PubAck names; DlqRefused when the refusal is permanent (too large, no
    stream captures the subject, a permanent JetStream error), anything else
    (timeouts, lost connection) propagates as it is."""
    try:
        ack = await js.publish(subject, body, headers=headers)
        return str(ack.stream), int(ack.seq)
    except nats.errors.MaxPayloadError:
        raise DlqRefused(PublishError.MAX_PAYLOAD, f"{len(body)} bytes exceed the server's max_payload") from None
    except nats.js.errors.NoStreamResponseError:
        try:  # a JetStream that is starting answers no-responders too: ask it
            await js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            raise DlqRefused(PublishError.NO_STREAM, f"no JetStream stream captures {subject}") from None
        raise
    except nats.js.errors.APIError as exc:
        code = PERMANENT_JS_ERRORS.get(exc.err_code) if exc.err_code is not None else None
        if code is not None:
            raise DlqRefused(code, f"JetStream [{exc.err_code}] {exc.description}") from None
        raise


async def ensure_stream(js: JetStreamContext, context: str, *, max_age: float, duplicate_window: float) -> str:
    """The name of the stream capturing this context's DLQ subjects; creates
    `{CONTEXT}_DLQ` when none does. An existing stream is left as it is."""
    probe = replay_subject(context, "probe")
    try:
        return str(await js.find_stream_name_by_subject(probe))
    except nats.js.errors.NotFoundError:
        pass
    config = StreamConfig(
        name=stream_name(context),
        subjects=[stream_subject(context)],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age,
        duplicate_window=duplicate_window,
        description=f"pgoutbox dead letters and replays of context {context}",
    )
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        # Lost a race with another consumer creating it: fine if it is ours now.
        try:
            return str(await js.find_stream_name_by_subject(probe))
        except nats.js.errors.NotFoundError:
            raise ConfigError(f"cannot create DLQ stream {config.name}: {exc}") from exc
    return stream_name(context)


# -- the consumer's dead letters -------------------------------------------------

# Prefix of last_error when no DLQ notice could be published for a dead letter.
UNPUBLISHABLE = "DLQ_UNPUBLISHABLE"


def origin(msg: Any) -> tuple[str | None, int | None]:
    """Stream and stream sequence of a delivery, or of a stream's copy (advisory)."""
    if isinstance(msg, Msg):
        return msg.metadata.stream, msg.metadata.sequence.stream
    return msg.stream, msg.seq


@dataclass(kw_only=True)
class DeadLetters:
    """The consumer's dead-letter path, off its happy path: a message
    dead-lettered in hand (its notice published, then its inbox row
    recorded DEAD_LETTER, then acked) and a message that cannot enter the
    inbox (its `.invalid` notice, then acked). Inbox calls run through the
    database gate, like the flow's."""

    inbox: Inbox
    nc: Any
    js: Any
    gate: DatabaseGate
    stopping: asyncio.Event
    retry_backoff: Backoff
    replay_backoff: Backoff

    def use(self, nc: Any, js: Any) -> None:
        """The connection to publish on, after the consumer re-established it."""
        self.nc, self.js = nc, js

    async def dead_letter(
        self, msg: Any, h: HandlerRuntime, envelope: dict[str, Any], row: dict[str, Any], reason: str
    ) -> bool:
        """Publishes the notice, records the dead letter, acks; False when
        another delivery settled the row first (nothing recorded or acked).
        The message stays in hand until both are done: JetStream would
        redeliver it, but the handler would be called again for nothing."""
        meta = row["dlq_metadata"] or {}
        replays = int(meta.get("replay_attempts") or 0)
        replay_after = self.replay_backoff.delay(replays + 1) if replays < h.replay_max_attempts else None
        message_id = envelope["message_id"]
        stream, sequence = origin(msg)

        def build(copy: bool) -> Notice:
            return notice(
                context=h.spec.context,
                handler=h.name,
                message_id=message_id,
                original_subject=envelope["subject"],
                reason=reason,
                attempts=row["attempts"],
                dead_letters=int(meta.get("dead_letters") or 0) + 1,
                replay_attempts=replays,
                next_replay_in=replay_after,
                envelope=envelope,
                stream=stream,
                stream_sequence=sequence,
                max_payload=self.nc.max_payload,
                copy=copy,
            )

        subject, problem, placed = await self._publish_notice(build, persist=True)
        recorded = reason if problem is None else f"{UNPUBLISHABLE}: {problem}; {reason}"
        if not await self.gate.run(
            lambda: settles(
                self.inbox.record_error(message_id, h.name, recorded, dead=True, replay_after=replay_after)
            ),
            self.stopping,
        ):
            return False
        await msg.ack()
        if placed is not None:
            await self._name_notice(h, message_id, placed)
        log.warning(
            "dead-lettered",
            extra={
                "handler": h.name,
                "message_id": message_id,
                "reason": recorded,
                "dlq_subject": subject,
                "replay_in": None if replay_after is None else round(replay_after, 3),
            },
        )
        return True

    async def _name_notice(self, h: HandlerRuntime, message_id: str, placed: tuple[str, int]) -> None:
        """Records which DLQ stream message announced the dead letter, for
        dlq_show. Best-effort, after the dead letter is recorded and the
        message acked: behind the database gate (an outage delays it), and a
        failure, or the consumer stopping meanwhile, costs only this pointer
        (the notice itself is in the stream, found by its message id)."""
        stream, sequence = placed
        try:
            await self.gate.run(
                lambda: self.inbox.record_dlq_notice(message_id, h.name, stream, sequence), self.stopping
            )
        except Exception as exc:
            log.warning(
                "the dead letter's DLQ notice could not be recorded",
                extra={
                    "handler": h.name,
                    "message_id": message_id,
                    "dlq_stream": stream,
                    "dlq_stream_sequence": sequence,
                    "error": "stopping" if isinstance(exc, Stopping) else repr(exc),
                },
            )

    async def _publish_notice(
        self, build: Callable[[bool], Notice], *, persist: bool
    ) -> tuple[str | None, str | None, tuple[str, int] | None]:
        """Publishes the notice build(copy) makes: the original copied when it
        fits, else referenced; referenced again when JetStream refuses the
        copy as too large (a stream's max_msg_size). Returns (subject, None,
        (stream, sequence) from the PubAck), or (None, why, None) when no
        notice can ever be published."""
        problem = None
        for copy in (True, False):
            try:
                subject, body, headers = build(copy)
            except NoticeTooLarge as exc:
                return None, f"{PublishError.MAX_PAYLOAD}: {exc}", None
            try:
                placed = await self._publish(subject, body, headers, persist=persist)
                return subject, None, placed
            except DlqRefused as exc:
                problem = str(exc)
                if exc.code is not PublishError.MAX_PAYLOAD:
                    break
        log.error("no DLQ notice can be published", extra={"error": problem})
        return None, problem, None

    async def _publish(self, subject: str, body: bytes, headers: dict[str, str], *, persist: bool) -> tuple[str, int]:
        """Publishes to the DLQ. persist: a failed publish is retried here (the
        message kept alive by in-progress acks) until it succeeds or the
        consumer stops, rather than calling the handler again; a permanent
        refusal (DlqRefused) is never retried."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return await publish(self.js, subject, body, headers)
            except DlqRefused:
                raise
            except Exception as exc:
                if not persist or self.stopping.is_set():
                    raise
                delay = self.retry_backoff.delay(attempt)
                log.error(
                    "DLQ publish failed on the last delivery; retrying",
                    extra={
                        "dlq_subject": subject,
                        "error": repr(exc),
                        "retry_in": round(delay, 3),
                    },
                )
                if not await sleep(delay, self.stopping):
                    raise

    async def unreadable(self, msg: Any, h: HandlerRuntime, why: str) -> Outcome:
        """Publishes a message that cannot enter the inbox to `.invalid`, raw
        when that fits; acks it when it was delivered (a stream's copy, from an
        advisory, has nothing to ack). When no notice can be published, the
        error log line (stream and sequence) is what is left to find."""
        stream, sequence = origin(msg)
        reason = f"{SqlState.INVALID_MESSAGE.name} [{SqlState.INVALID_MESSAGE.value}]: {why}"

        def build(copy: bool) -> Notice:
            return unreadable_notice(
                context=h.spec.context,
                handler=h.name,
                stream=stream,
                sequence=sequence,
                subject=msg.subject,
                body=msg.data or b"",
                headers=msg.headers,
                reason=reason,
                max_payload=self.nc.max_payload,
                copy=copy,
            )

        subject, problem, _ = await self._publish_notice(build, persist=False)
        if isinstance(msg, Msg):
            await msg.ack()
        log.error(
            "unreadable message sent to the DLQ"
            if problem is None
            else f"unreadable message acknowledged without a DLQ notice ({UNPUBLISHABLE})",
            extra={
                "handler": h.name,
                "stream": stream,
                "stream_sequence": sequence,
                "subject": msg.subject,
                "reason": why,
                "dlq_subject": subject,
                "error": problem,
            },
        )
        return Outcome.INVALID
