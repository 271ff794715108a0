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
