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
the part before the first colon, still taken from Nats-Msg-Id alone.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from pgoutbox.core import cloudevents, wire
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.wire import PublishError, message_size

ORIGINAL_SUBJECT = "Pgoutbox-Original-Subject"
HANDLER = "Pgoutbox-Handler"
# Of a notice that could not copy the original: the reason is ours, but may quote a handler.
_REASON_KEPT = 2000
_REPLAY = re.compile(r"^[A-Za-z0-9_-]+\.dlq\.replay\.[A-Za-z0-9_-]+$")


def stream_name(context: str) -> str:
    return f"{context.upper()}_DLQ"


def stream_subject(context: str) -> str:
    return f"{context}.dlq.>"


def replay_subject(context: str, handler: str) -> str:
    return f"{context}.dlq.replay.{handler}"


def is_replay(subject: str) -> bool:
    return bool(_REPLAY.match(subject))


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
) -> tuple[str, bytes, dict[str, str]]:
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
) -> tuple[str, bytes, dict[str, str]]:
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
) -> tuple[str, bytes, dict[str, str]]:
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


def replay_message(row: Mapping[str, Any]) -> tuple[str, bytes, dict[str, str]]:
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


def envelope_from(subject: str, body: bytes, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The handler envelope of a delivered message, original or replay;
    envelope.InvalidMessage naming the header, subject or body at fault."""
    if not is_replay(subject):
        return wire.from_nats(subject, body, headers)
    headers = dict(headers or {})
    original = headers.get(ORIGINAL_SUBJECT)
    if not original:
        raise wire.InvalidMessage(f"header {ORIGINAL_SUBJECT} is missing on a replay")
    headers[wire.MSG_ID] = (headers.get(wire.MSG_ID) or "").split(":", 1)[0]
    return wire.from_nats(original, body, headers)


class DlqRefused(Exception):
    """A DLQ publish that can never succeed: retrying it would only repeat the refusal."""

    def __init__(self, code: PublishError, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code


# JetStream refusals that do not clear by themselves: the message exceeds the
# stream's max_msg_size; the stream is gone.
_PERMANENT_JS_ERRORS = frozenset({10054, 10059})


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
        if exc.err_code in _PERMANENT_JS_ERRORS:
            code = PublishError.MAX_PAYLOAD if exc.err_code == 10054 else PublishError.NO_STREAM
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
