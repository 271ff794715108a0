"""The event on the wire, shared by the relay (writer) and the consumer
(reader), so that a consumer can build the REQ-058 envelope from the NATS
message alone, without the producer's database.

    subject  {context}.event.{event_type}.v{event_version}
    body     the payload as JSON (UTF-8): compact when given as an object; the
             relay passes PostgreSQL's own jsonb text through unchanged, so
             numbers keep their exact digits (a Python float would not)
    headers  Nats-Msg-Id        event_id (JetStream dedup; the inbox message_id)
             Pgoutbox-*         the event's metadata, below
             traceparent, ...   every entry of outbox.events.headers (W3C trace
                                context and whatever the emitter supplied)
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

MSG_ID = "Nats-Msg-Id"
PREFIX = "Pgoutbox-"
# header name -> envelope field
_FIELDS = {
    "Pgoutbox-Context": "context",
    "Pgoutbox-Event-Type": "event_type",
    "Pgoutbox-Event-Version": "event_version",
    "Pgoutbox-Aggregate-Type": "aggregate_type",
    "Pgoutbox-Aggregate-Id": "aggregate_id",
    "Pgoutbox-Occurred-At": "occurred_at",
    "Pgoutbox-Correlation-Id": "correlation_id",
    "Pgoutbox-Causation-Id": "causation_id",
    "Pgoutbox-Tenant-Id": "tenant_id",
    "Pgoutbox-Ordering-Key": "ordering_key",
}


def _text(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    return str(value)


def to_nats(event: Mapping[str, Any]) -> tuple[str, bytes, dict[str, str]]:
    """(subject, body, headers) for an outbox.events row (as a mapping).

    payload may be a JSON object (dict) or its JSON text (str), as the relay
    reads it; headers a dict or its JSON text.
    """
    headers: dict[str, str] = {}
    extra = event.get("headers") or {}
    if isinstance(extra, str):
        extra = json.loads(extra) if extra != "{}" else {}
    for key, value in extra.items():
        if key == MSG_ID or key.startswith(PREFIX) or value is None:
            continue  # reserved names cannot be overridden by the emitter
        headers[str(key)] = value if isinstance(value, str) else json.dumps(value)
    for header, field in _FIELDS.items():
        value = event.get(field)
        if value is not None:
            headers[header] = _text(value)
    headers[MSG_ID] = str(event["event_id"])
    payload = event["payload"]
    if isinstance(payload, str):
        body = payload.encode()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return event["subject"], body, headers


class InvalidMessage(ValueError):
    """A message that cannot enter the inbox; the text names the header, the
    subject or the body at fault."""


# The one message-id form accepted: 8-4-4-4-12 hexadecimal digits, either case;
# its canonical text is lower case. Python's uuid.UUID also takes braces,
# "urn:uuid:" and hyphens anywhere, PostgreSQL other variants: neither is the
# text JetStream deduplicates on, so they are refused rather than guessed at.
UUID_TEXT = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
SUBJECT = re.compile(r"^([A-Za-z0-9_-]{1,64})\.event\.([A-Za-z0-9_-]{1,128})\.v([1-9][0-9]{0,8})$")
TRACE_HEADERS = ("traceparent", "tracestate")
# What an HTTP header value can carry (visible ASCII, space, tab).
_HTTP_VALUE = re.compile(r"^[\t\x20-\x7e]*$")
_SHOWN = 80


def _show(value: str) -> str:
    return repr(value if len(value) <= _SHOWN else value[:_SHOWN] + "...")


def canonical_id(value: str | None, header: str = MSG_ID) -> str:
    """The canonical text (lower-case, hyphenated) of a message id; InvalidMessage otherwise."""
    if not value:
        raise InvalidMessage(f"header {header} is missing: without it the message cannot be deduplicated")
    if not UUID_TEXT.match(value):
        raise InvalidMessage(
            f"header {header} {_show(value)} is not a UUID in the 8-4-4-4-12 hexadecimal form")
    return str(uuid.UUID(value))


def parse_subject(subject: str) -> tuple[str, str, int]:
    """(context, event_type, event_version) of `{context}.event.{event_type}.v{version}`."""
    found = SUBJECT.match(subject or "")
    if not found:
        raise InvalidMessage(
            f"subject {_show(subject or '')} is not {{context}}.event.{{event_type}}.v{{version}}")
    return found[1], found[2], int(found[3])


def _ours(headers: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Envelope field -> (header as sent, value) of the Pgoutbox-* headers, in any
    letter case; the same header twice with different values is refused."""
    by_lower = {name.lower(): field for name, field in _FIELDS.items()}
    found: dict[str, tuple[str, str]] = {}
    for name, value in headers.items():
        field = by_lower.get(name.lower())
        if field is None:
            continue
        if field in found and found[field][1] != value:
            raise InvalidMessage(f"headers {found[field][0]} and {name} disagree")
        found[field] = (name, value)
    return found


def _check_subject_headers(ours: dict[str, tuple[str, str]], context: str, event_type: str, version: int) -> None:
    """Headers repeating what the subject says are fine; contradicting it, refused."""
    for field, expected in (("context", context), ("event_type", event_type)):
        if field in ours and ours[field][1] != expected:
            name, value = ours[field]
            raise InvalidMessage(f"header {name} {_show(value)} contradicts the subject ({expected!r})")
    if "event_version" in ours:
        name, value = ours["event_version"]
        if not (value.isascii() and value.isdigit() and int(value) == version):
            raise InvalidMessage(f"header {name} {_show(value)} contradicts the subject ({version})")


def _storable(value: Any, where: str) -> None:
    """PostgreSQL's jsonb holds no NUL character, no unpaired surrogate, no
    infinite number: such a message could never be recorded, so it is refused."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            if "\x00" in item:
                raise InvalidMessage(f"{where} contains a NUL character (\\u0000), which PostgreSQL cannot store")
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidMessage(f"{where} contains an unpaired surrogate ({exc.reason})") from None
        elif isinstance(item, float) and not math.isfinite(item):
            raise InvalidMessage(f"{where} contains a number out of range ({item})")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _payload(body: bytes | None) -> dict[str, Any]:
    """The body as a JSON object; anything else is refused, saying why."""
    if not body:
        raise InvalidMessage("body is empty: the payload must be a JSON object")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidMessage(f"body is not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise InvalidMessage("body is JSON nested too deeply") from None
    except ValueError as exc:
        raise InvalidMessage(f"body is not JSON ({exc})") from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise InvalidMessage(f"body is {kind}, not a JSON object")
    _storable(value, "body")
    return value


def from_nats(subject: str, body: bytes, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The REQ-058 envelope a handler receives, built from a NATS message, or
    InvalidMessage naming the header, subject or body at fault.

    message_id is the canonical text of Nats-Msg-Id, never a fresh UUID: without
    it the message cannot be deduplicated. Context, event type and version come
    from the subject; Pgoutbox-* headers may repeat them, not contradict them.
    Every other value passes through as sent.
    """
    headers = dict(headers or {})
    message_id = canonical_id(headers.get(MSG_ID))
    context, event_type, version = parse_subject(subject)
    ours = _ours(headers)
    _check_subject_headers(ours, context, event_type, version)
    envelope: dict[str, Any] = {"message_id": message_id, "subject": subject}
    for field in _FIELDS.values():
        envelope[field] = ours[field][1] if field in ours else None
        if field in ours:
            _storable(ours[field][1], f"header {ours[field][0]}")
    envelope.update(context=context, event_type=event_type, event_version=version)
    envelope["payload"] = _payload(body)
    trace = {}
    for name in TRACE_HEADERS:
        if name in headers:
            value = headers[name]
            if not _HTTP_VALUE.match(value):
                raise InvalidMessage(f"header {name} {_show(value)} has characters an HTTP header cannot carry")
            trace[name] = value
    envelope["trace"] = trace
    return envelope
