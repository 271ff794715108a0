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
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
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


class WireError(ValueError):
    """An event that cannot go on the wire as it is. `code` is stable: it is
    the prefix of the relay's last_error (BAD_HEADER, BAD_SUBJECT,
    BAD_PAYLOAD, BAD_TIMESTAMP; docs/relay.md)."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class Unrepresentable:
    """A timestamp, as PostgreSQL rendered it, that the wire format (RFC 3339,
    years 0001-9999, UTC) cannot express: ±infinity, years past 9999, BC."""

    text: str


def wire_time(text: str) -> str | Unrepresentable:
    """RFC 3339 text ("...T...Z", as for a datetime) of a timestamptz in
    PostgreSQL's text form; never raises, so that one row cannot fail a fetch."""
    # The relay's sessions render DateStyle ISO in UTC: "2024-05-09 07:35:25.5+00"
    # (years 0001-9999; others have more digits or a " BC" suffix).
    if len(text) >= 22 and text[4] == "-" and text[10] == " " and text.endswith("+00") and text[:4].isdigit():
        clock = text[11:-3]
        if len(clock) > 8:  # PostgreSQL trims the fraction's trailing zeros; Python's form has six digits
            clock = clock.ljust(15, "0")
        return f"{text[:10]}T{clock}Z"
    try:  # another session time zone: same instant, in UTC
        return _text(datetime.fromisoformat(text))
    except (ValueError, OverflowError):
        return Unrepresentable(text)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    return str(value)


def _show(text: str, limit: int = 60) -> str:
    """A value for an error text: quoted, control characters visible, bounded."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


# A header name NATS accepts (an HTTP token; nats-py refuses others).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A token that is not reserved. Reserved, in any letter case: the names NATS,
# JetStream or nats-py interpret or pgoutbox sets itself, which an emitter's
# copy would override or duplicate (Status and Description mark status
# replies: a "Status: 404" message ends a fetch).
_FREE_NAME = re.compile(r"(?!(?i:nats-|pgoutbox-|(?:status|description)\Z))[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A subject NATS can publish to: dot-separated, non-empty tokens without
# wildcards, whitespace or control characters.
_SUBJECT = re.compile(r"[^\s\x00-\x1f\x7f.*>]+(?:\.[^\s\x00-\x1f\x7f.*>]+)*")
# The server closes a connection whose PUB line exceeds max_control_line
# (4 KiB by default); 512 characters stay below it even at 4 bytes each.
MAX_SUBJECT = 512


def _emitter_headers(extra: Any) -> dict[str, str]:
    """The entries of outbox.events.headers, refused (WireError) when NATS
    cannot carry them unaltered or when they would pose as reserved headers."""
    if isinstance(extra, str):
        if extra == "{}":
            return {}
        extra = json.loads(extra)
    if not isinstance(extra, dict):
        raise WireError("BAD_HEADER", f"headers must be a JSON object, got {type(extra).__name__}")
    headers: dict[str, str] = {}
    for name, value in extra.items():
        if value is None:
            continue  # null: the header is absent
        if not _FREE_NAME.fullmatch(name):
            if not _HEADER_NAME.fullmatch(name):
                raise WireError("BAD_HEADER", f"header name {_show(name)} is not a token NATS can carry "
                                "(letters, digits and !#$%&'*+-.^_`|~ only)")
            raise WireError("BAD_HEADER", f"header name {_show(name)} is reserved (Nats-*, Pgoutbox-*, "
                            "Status and Description, in any letter case)")
        if type(value) is not str:
            raise WireError("BAD_HEADER", f"header {_show(name)} has a JSON {type(value).__name__} value; "
                            "header values must be strings")
        headers[name] = value
    return headers


def _check_values(headers: Mapping[str, str]) -> None:
    # nats-py strips each value and turns CR/LF into spaces: such a value
    # would arrive altered (or, unescaped, end the header block).
    for name, value in headers.items():
        if "\r" in value or "\n" in value or value != value.strip():
            raise WireError("BAD_HEADER", f"header {name} value {_show(value)} has CR/LF or leading/trailing "
                            "whitespace, which NATS does not carry unaltered")


def to_nats(event: Mapping[str, Any]) -> tuple[str, bytes, dict[str, str]]:
    """(subject, body, headers) for an outbox.events row (as a mapping).

    payload may be a JSON object (dict) or its JSON text (str), as the relay
    reads it; headers a dict or its JSON text; occurred_at a datetime, wire
    text (wire_time) or Unrepresentable. What NATS cannot carry unaltered
    raises WireError, whose code names the fault.
    """
    subject = event["subject"]
    if not isinstance(subject, str) or len(subject) > MAX_SUBJECT or not _SUBJECT.fullmatch(subject):
        raise WireError("BAD_SUBJECT", f"subject {_show(str(subject))} is not a NATS subject one can publish to "
                        f"(dot-separated tokens without whitespace or wildcards, at most {MAX_SUBJECT} characters)")
    occurred = event.get("occurred_at")
    if isinstance(occurred, Unrepresentable):  # the one timestamp on the wire
        raise WireError("BAD_TIMESTAMP", f"occurred_at {_show(occurred.text)} cannot be expressed on the wire "
                        "(RFC 3339, years 0001-9999)")
    headers = _emitter_headers(event.get("headers") or {})
    for header, field in _FIELDS.items():
        value = event.get(field)
        if value is not None:
            headers[header] = value if type(value) is str else _text(value)
    headers[MSG_ID] = str(event["event_id"])
    _check_values(headers)
    payload = event["payload"]
    if isinstance(payload, str):
        body = payload.encode()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return subject, body, headers


def from_nats(subject: str, body: bytes, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The REQ-058 envelope a handler receives, built from a NATS message.

    message_id comes from Nats-Msg-Id, never from a fresh UUID: without it the
    message cannot be deduplicated, so it is refused (ValueError).
    """
    headers = dict(headers or {})
    message_id = headers.get(MSG_ID)
    if not message_id:
        raise ValueError("message has no Nats-Msg-Id header")
    uuid.UUID(message_id)  # ValueError when it is not one
    envelope: dict[str, Any] = {"message_id": message_id, "subject": subject}
    for header, field in _FIELDS.items():
        envelope[field] = headers.get(header)
    if envelope["event_version"] is not None:
        envelope["event_version"] = int(envelope["event_version"])
    envelope["payload"] = json.loads(body) if body else None
    envelope["trace"] = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
    return envelope
