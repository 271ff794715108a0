"""The dead-letter queue on the wire: one JetStream stream per bounded context
(`{CONTEXT}_DLQ`, subjects `{context}.dlq.>`, created by the consumer when no
stream captures them) holding two kinds of messages:

    {context}.dlq.dead.{handler}.{event_type}.v{n}   MessageDeadLettered notices
    {context}.dlq.dead.{handler}.invalid             unreadable messages (no usable
                                                     Nats-Msg-Id, body not JSON)
    {context}.dlq.replay.{handler}                   replays of a dead letter to its
                                                     one handler (its own durable)

Notices are deduplicated by message id: Nats-Msg-Id is
`{message_id}:dead:{handler}:{n}` with n the dead-letter count, so a consumer
that dies after publishing and before recording the dead letter publishes
the same notice again, and JetStream drops it.

A replay carries the original event exactly as the relay published it (see
envelope.py), except the subject and `Nats-Msg-Id =
{message_id}:replay:{handler}:{n}:{nonce}`: the nonce keeps JetStream from
dropping a replay that follows a crashed replayer pass, and the message id is
the part before the first colon, still taken from Nats-Msg-Id alone.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import nats.js.errors
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from . import envelope as wire
from .errors import ConfigError

ORIGINAL_SUBJECT = "Pgoutbox-Original-Subject"
HANDLER = "Pgoutbox-Handler"
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
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _notice(
    *, context: str, handler: str, msg_id: str, original_subject: str, reason: str,
    envelope: Mapping[str, Any] | None, fields: dict[str, Any],
) -> tuple[str, bytes, dict[str, str]]:
    body = {
        "type": "MessageDeadLettered",
        "handler": handler,
        "original_subject": original_subject,
        "reason": reason,
        "dead_lettered_at": _now(),
        **fields,
    }
    headers = {wire.MSG_ID: msg_id, HANDLER: handler, ORIGINAL_SUBJECT: original_subject}
    headers.update({k: v for k, v in ((envelope or {}).get("trace") or {}).items() if isinstance(v, str)})
    return dead_subject(context, handler, envelope), json.dumps(body, default=str).encode(), headers


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
) -> tuple[str, bytes, dict[str, str]]:
    """A MessageDeadLettered notice (subject, body, headers)."""
    return _notice(
        context=context, handler=handler, msg_id=f"{message_id}:dead:{handler}:{dead_letters}",
        original_subject=original_subject, reason=reason, envelope=envelope,
        fields={
            "message_id": message_id,
            "attempts": attempts,
            "dead_letters": dead_letters,
            "replay_attempts": replay_attempts,
            "next_replay_in_seconds": next_replay_in,
            "envelope": dict(envelope) if envelope is not None else None,
        },
    )


def unreadable_notice(
    *, context: str, handler: str, stream: str, sequence: int, subject: str,
    body: bytes, headers: Mapping[str, str] | None, reason: str,
) -> tuple[str, bytes, dict[str, str]]:
    """A notice for a message that cannot enter the inbox, with its raw content."""
    return _notice(
        context=context, handler=handler, msg_id=f"invalid:{stream}:{sequence}:{handler}",
        original_subject=subject, reason=reason, envelope=None,
        fields={
            "message_id": None,
            "stream": stream,
            "stream_sequence": sequence,
            "raw": {"headers": dict(headers or {}), "body": body.decode("utf-8", errors="replace")},
        },
    )


def replay_message(row: Mapping[str, Any]) -> tuple[str, bytes, dict[str, str]]:
    """The replay of an inbox row (as inbox.claim_replays returns it)."""
    env = row["envelope"]
    meta = row["dlq_metadata"] or {}
    count = int(meta.get("replay_attempts") or 0) + int(meta.get("redrives") or 0)
    event = {**env, "event_id": env["message_id"], "subject": row["subject"], "headers": env.get("trace") or {}}
    _, body, headers = wire.to_nats(event)
    headers[wire.MSG_ID] = f"{row['message_id']}:replay:{row['handler']}:{count}:{secrets.token_hex(4)}"
    headers[ORIGINAL_SUBJECT] = row["subject"]
    headers[HANDLER] = row["handler"]
    return replay_subject(row["context"], row["handler"]), body, headers


def envelope_from(subject: str, body: bytes, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The REQ-058 envelope of a delivered message, original or replay.
    ValueError when it has no usable Nats-Msg-Id or its body is not JSON."""
    if not is_replay(subject):
        return wire.from_nats(subject, body, headers)
    headers = dict(headers or {})
    original = headers.get(ORIGINAL_SUBJECT)
    if not original:
        raise ValueError(f"replay message has no {ORIGINAL_SUBJECT} header")
    headers[wire.MSG_ID] = (headers.get(wire.MSG_ID) or "").split(":", 1)[0]
    return wire.from_nats(original, body, headers)


async def ensure_stream(js, context: str, *, max_age: float, duplicate_window: float) -> str:
    """The name of the stream capturing this context's DLQ subjects; creates
    `{CONTEXT}_DLQ` when none does. An existing stream is left as it is."""
    probe = replay_subject(context, "probe")
    try:
        return await js.find_stream_name_by_subject(probe)
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
            return await js.find_stream_name_by_subject(probe)
        except nats.js.errors.NotFoundError:
            raise ConfigError(f"cannot create DLQ stream {config.name}: {exc}") from exc
    return config.name
