"""The event on the wire, shared by the relay (writer) and the consumer
(reader), so that a consumer can build the handler envelope from the NATS
message alone, without the producer's database.

    subject  {context}.event.{event_type}.v{event_version}
    body     the payload as JSON (UTF-8): compact when given as an object; the
             relay passes PostgreSQL's own jsonb text through unchanged, so
             numbers keep their exact digits (a Python float would not)
    headers  Nats-Msg-Id        event_id (JetStream dedup; the inbox message_id)
             Pgoutbox-*         the event's metadata, below
             Pgoutbox-Created-At  created_at (RFC 3339, UTC): when the emitting
                                transaction wrote the event; not an envelope
                                field, only for the consumer's latency metric
             traceparent, ...   every entry of outbox.events.headers (W3C trace
                                context and whatever the emitter supplied)
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pgoutbox.core import cloudevents

MSG_ID = "Nats-Msg-Id"
# Not in _FIELDS: the handler's envelope does not carry it. The consumer reads
# it (created_epoch) to measure how old an event is when its outcome is
# recorded; optional, since replays, foreign publishers and older relays lack it.
CREATED_AT = "Pgoutbox-Created-At"
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
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
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
                raise WireError(
                    "BAD_HEADER",
                    f"header name {_show(name)} is not a token NATS can carry "
                    "(letters, digits and !#$%&'*+-.^_`|~ only)",
                )
            raise WireError(
                "BAD_HEADER",
                f"header name {_show(name)} is reserved (Nats-*, Pgoutbox-*, "
                "Status and Description, in any letter case)",
            )
        # Other JSON values travel as their compact JSON text (what emit documents).
        headers[name] = value if type(value) is str else json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return headers


def header_value_problem(value: str) -> str | None:
    """Why NATS would not carry a header value unaltered, or None: the one
    rule for the relay and the replayer (what they publish) and the consumer
    (what it admits into the inbox, from which replays are built). nats-py
    strips every value it publishes as Python's str.strip() does (Unicode
    white space, U+00A0 and U+001F included) and turns CR/LF into spaces; on
    receipt it strips ASCII white space only, so a foreign client's "t\u00a0"
    arrives whole but could never be re-published as it came."""
    if "\r" in value or "\n" in value:
        return "has CR or LF, which NATS does not carry unaltered"
    if value != value.strip():
        return "has white space at an end (Unicode included), which NATS clients strip"
    return None


def _check_values(headers: Mapping[str, str]) -> None:
    for name, value in headers.items():
        problem = header_value_problem(value)
        if problem is not None:
            raise WireError("BAD_HEADER", f"header {name} value {_show(value)} {problem}")
        if name.lower() in TRACE_HEADERS and not _HTTP_VALUE.match(value):
            # The consumer passes the trace context on as HTTP headers of the handler call.
            raise WireError("BAD_HEADER", f"header {name} value {_show(value)} is not visible ASCII")


def _cloudevent(headers: dict[str, str], event: Mapping[str, Any], source: str) -> None:
    """The ce-* headers, after the emitter's and ours were checked: their
    values are percent-encoded, always printable ASCII."""
    try:
        cloudevents.put_binary(headers, event, headers.get("Pgoutbox-Occurred-At"), source)
    except ValueError as exc:
        raise WireError("BAD_HEADER", str(exc)) from None


# (source template, context, event_type, event_version) -> the ce-* headers an
# event type shares, encoded once. Bounded: a relay sees few event types, and
# a flood of new ones only costs the cache being rebuilt.
_SHARED: dict[tuple[str, str, Any, Any], tuple[str, str]] = {}
_SHARED_MOST = 4096


def _fast_cloudevent(headers: dict[str, str], event: Mapping[str, Any], source: str) -> bool:
    """The common case of _check_values and _cloudevent at once: every value
    printable ASCII but space, `"` and `%` (one match over them all), and no
    emitter header that CloudEvents reads (ce-*, Content-Type), so that no
    value needs checking or percent-encoding one by one. False, with
    `headers` untouched, when the case does not hold: the caller takes the
    exact path, which also names what is wrong."""
    if "cloudevents" in event or not cloudevents.plain("".join(headers.values())):
        return False
    for name in headers:
        if name[:3] in cloudevents.PREFIXES or (len(name) == 12 and name.lower() == "content-type"):
            return False
    aggregate_type, aggregate_id = event.get("aggregate_type"), event.get("aggregate_id")
    if (
        aggregate_type is not None
        and aggregate_id is not None
        and not (type(aggregate_type) is type(aggregate_id) is str)
    ):
        return False
    context, event_type, version = event["context"], event["event_type"], event["event_version"]
    key = (source, context, event_type, version)
    shared = _SHARED.get(key)
    if shared is None:
        if len(_SHARED) >= _SHARED_MOST:
            _SHARED.clear()
        ce_type = f"{context}.{event_type}.v{version}"
        shared = _SHARED[key] = (cloudevents.encode(source.replace(cloudevents.CONTEXT_PLACEHOLDER, context)), ce_type)
    ce_type = shared[1]
    if not cloudevents.plain(ce_type):  # the parts were plain as headers: a non-str version could still differ
        return False
    # The order and values put_binary gives; every value is plain, so encode() would return it as it is.
    headers["ce-specversion"] = cloudevents.SPECVERSION
    headers["ce-id"] = headers[MSG_ID]
    headers["ce-source"] = shared[0]
    headers["ce-type"] = ce_type
    headers["ce-datacontenttype"] = cloudevents.DATACONTENTTYPE
    occurred = headers.get("Pgoutbox-Occurred-At")
    if occurred is not None:
        headers["ce-time"] = occurred
    if aggregate_type is not None and aggregate_id is not None:
        headers["ce-subject"] = f"{aggregate_type}/{aggregate_id}"
    for name in cloudevents.TRACING:
        value = headers.get(name)
        if value is not None:
            headers["ce-" + name] = value
    return True


def to_nats(event: Mapping[str, Any], source: str = cloudevents.DEFAULT_SOURCE) -> tuple[str, bytes, dict[str, str]]:
    """(subject, body, headers) for an outbox.events row (as a mapping).

    payload may be a JSON object (dict) or its JSON text (str), as the relay
    reads it; headers a dict or its JSON text; occurred_at a datetime, wire
    text (wire_time) or Unrepresentable. What NATS cannot carry unaltered
    raises WireError, whose code names the fault. `source`: the CloudEvents
    source, "{context}" standing for the event's (OUTBOX_CLOUDEVENTS_SOURCE).
    """
    subject = event["subject"]
    if not isinstance(subject, str) or len(subject) > MAX_SUBJECT or not _SUBJECT.fullmatch(subject):
        raise WireError(
            "BAD_SUBJECT",
            f"subject {_show(str(subject))} is not a NATS subject one can publish to "
            f"(dot-separated tokens without whitespace or wildcards, at most {MAX_SUBJECT} characters)",
        )
    occurred = event.get("occurred_at")
    if isinstance(occurred, Unrepresentable):  # the one timestamp on the wire
        raise WireError(
            "BAD_TIMESTAMP",
            f"occurred_at {_show(occurred.text)} cannot be expressed on the wire (RFC 3339, years 0001-9999)",
        )
    headers = _emitter_headers(event.get("headers") or {})
    for header, field in _FIELDS.items():
        value = event.get(field)
        if value is not None:
            headers[header] = value if type(value) is str else _text(value)
    created = event.get("created_at")
    if created is not None and not isinstance(created, Unrepresentable):  # no metric is worth failing an event
        headers[CREATED_AT] = created if type(created) is str else _text(created)
    headers[MSG_ID] = str(event["event_id"])
    if not _fast_cloudevent(headers, event, source):
        _check_values(headers)
        _cloudevent(headers, event, source)
    payload = event["payload"]
    if isinstance(payload, str):
        body = payload.encode()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return subject, body, headers


def created_epoch(headers: Mapping[str, str] | None) -> float | None:
    """The POSIX time of a message's Pgoutbox-Created-At, or None when it is
    missing or unreadable: the header only feeds a metric, so nothing about it
    may fail a message."""
    text = headers.get(CREATED_AT) if headers else None
    if not text or not text.endswith("Z") or len(text) > 40:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()  # a "Z" suffix is UTC (Python 3.11+)
    except (ValueError, TypeError, OverflowError):
        return None


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
_SHOWN = 80  # a foreign message's values, quoted in .invalid reasons


def canonical_id(value: str | None, header: str = MSG_ID) -> str:
    """The canonical text (lower-case, hyphenated) of a message id; InvalidMessage otherwise."""
    if not value:
        raise InvalidMessage(f"header {header} is missing: without it the message cannot be deduplicated")
    if not UUID_TEXT.fullmatch(value):
        raise InvalidMessage(f"header {header} {_show(value, _SHOWN)} is not a UUID in the 8-4-4-4-12 hexadecimal form")
    return value.lower()  # the form matched is uuid.UUID's text but for letter case


def parse_subject(subject: str) -> tuple[str, str, int]:
    """(context, event_type, event_version) of `{context}.event.{event_type}.v{version}`."""
    found = SUBJECT.match(subject or "")
    if not found:
        raise InvalidMessage(
            f"subject {_show(subject or '', _SHOWN)} is not {{context}}.event.{{event_type}}.v{{version}}"
        )
    return found[1], found[2], int(found[3])


_FIELDS_BY_LOWER = {name.lower(): field for name, field in _FIELDS.items()}


def _ours(headers: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Envelope field -> (header as sent, value) of the Pgoutbox-* headers, in any
    letter case; the same header twice with different values is refused."""
    found: dict[str, tuple[str, str]] = {}
    for name, value in headers.items():
        field = _FIELDS_BY_LOWER.get(name.lower())
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
            raise InvalidMessage(f"header {name} {_show(value, _SHOWN)} contradicts the subject ({expected!r})")
    if "event_version" in ours:
        name, value = ours["event_version"]
        # At most 9 digits, as in the subject, before int(): Python refuses
        # to parse over 4,300 digits, and no longer header means a version.
        if not (value.isascii() and value.isdigit() and len(value) <= 9 and int(value) == version):
            raise InvalidMessage(f"header {name} {_show(value, _SHOWN)} contradicts the subject ({version})")


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


def _storable_texts(attributes: Mapping[str, str]) -> None:
    """_storable for the CloudEvents attributes (strings), in one pass over them all."""
    joined = "".join(attributes.values())
    if "\x00" in joined or not joined.isascii():
        for name, value in attributes.items():
            _storable(value, f"CloudEvents attribute {name}")


def _admitted_value(name: str, value: str) -> None:
    """A header value the envelope keeps: storable, and one a replay can carry unaltered."""
    if not value.isascii() or "\x00" in value:  # ASCII has no surrogate: only a NUL could fail
        _storable(value, f"header {name}")
    problem = header_value_problem(value)
    if problem is not None:
        raise InvalidMessage(f"header {name} value {_show(value, _SHOWN)} {problem}")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _Infinite(Exception):
    """A JSON number that is infinite as a float (not a ValueError: not "not JSON")."""


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Infinite(text)
    return value


def _json(body: bytes | None, where: str, parse_float: Any = None) -> Any:
    """The body's JSON value; InvalidMessage saying why there is none."""
    if not body:
        raise InvalidMessage(f"{where} is empty: the payload must be a JSON object")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidMessage(f"{where} is not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=parse_float)
    except RecursionError:
        raise InvalidMessage(f"{where} is JSON nested too deeply") from None
    except ValueError as exc:
        raise InvalidMessage(f"{where} is not JSON ({exc})") from None


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def _payload(body: bytes | None) -> dict[str, Any]:
    """The body as a JSON object; anything else is refused, saying why."""
    try:
        value = _json(body, "body", _finite)
        # A JSON string holds a NUL or an unpaired surrogate only through a \\u escape:
        # without one, and with no infinite number, nothing in it is refused: no walk.
        walk = b"\\u" in (body if isinstance(body, bytes) else bytes(body or b""))
    except _Infinite:
        value, walk = _json(body, "body"), True  # the walk names the number
    if not isinstance(value, dict):
        raise InvalidMessage(f"body is {_kind(value)}, not a JSON object")
    if walk:
        _storable(value, "body")
    return value


def _cloudevent_in(headers: Mapping[str, str], body: bytes | None) -> tuple[dict[str, str] | None, Any]:
    """(attributes, payload) of a CloudEvent in either mode: payload is the
    body's object in binary mode, the `data` member in structured mode;
    (None, None) for a message that is no CloudEvent."""
    try:
        if cloudevents.is_structured(headers):
            document = _json(body, "body")
            attributes, data = cloudevents.from_structured(document)
            if not isinstance(data, dict):
                raise InvalidMessage(f"data of the structured CloudEvent is {_kind(data)}, not a JSON object")
            return attributes, data
        return cloudevents.from_binary(headers), None
    except cloudevents.NotACloudEvent as exc:
        raise InvalidMessage(f"not a CloudEvent pgoutbox can admit: {exc}") from None


def _message_id(headers: Mapping[str, str], attributes: dict[str, str] | None) -> str:
    """Nats-Msg-Id, else the CloudEvents id; both given, they must agree."""
    given = headers.get(MSG_ID)
    if attributes is None:
        return canonical_id(given)
    if given:
        # Nats-Msg-Id's own fault first: the reason a non-CloudEvent would get.
        message_id = canonical_id(given)
        if message_id == attributes["id"].lower():
            return message_id
        raise InvalidMessage(
            f"header {MSG_ID} {_show(given, _SHOWN)} and CloudEvents id {_show(attributes['id'], _SHOWN)} disagree"
        )
    return canonical_id(attributes["id"], "ce-id (the CloudEvents id)")


def from_nats(subject: str, body: bytes, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The envelope a handler receives, built from a NATS message, or
    InvalidMessage naming the header, subject or body at fault.

    message_id is the canonical text of Nats-Msg-Id (else of the CloudEvents
    id), never a fresh UUID: without it the message cannot be deduplicated.
    Context, event type and version come from the subject; Pgoutbox-*
    headers may repeat them, not contradict them. Every other value passes
    through as sent. A CloudEvent (binary or structured mode) keeps in
    `cloudevents` the attributes the other fields do not give back
    (cloudevents.kept; cloudevents.expand makes them whole); its time and
    trace context fill occurred_at and trace where no Pgoutbox-Occurred-At
    or traceparent does.
    """
    headers = dict(headers or {})
    attributes, data = _cloudevent_in(headers, body)
    message_id = _message_id(headers, attributes)
    context, event_type, version = parse_subject(subject)
    ours = _ours(headers)
    _check_subject_headers(ours, context, event_type, version)
    envelope: dict[str, Any] = {"message_id": message_id, "subject": subject}
    for field in _FIELDS.values():
        envelope[field] = ours[field][1] if field in ours else None
        if field in ours:
            _admitted_value(*ours[field])
    envelope.update(context=context, event_type=event_type, event_version=version)
    if data is None:
        envelope["payload"] = _payload(body)
    else:
        _storable(data, "data")
        envelope["payload"] = data
    trace = {}
    for name in TRACE_HEADERS:
        if name in headers:
            value = headers[name]
        elif attributes is not None and name in attributes:
            value = attributes[name]  # the distributed tracing extension
        else:
            continue
        _admitted_value(name, value)
        if not _HTTP_VALUE.match(value):
            raise InvalidMessage(f"header {name} {_show(value, _SHOWN)} has characters an HTTP header cannot carry")
        trace[name] = value
    envelope["trace"] = trace
    if attributes is not None:
        _storable_texts(attributes)
        if envelope["occurred_at"] is None and "time" in attributes:
            envelope["occurred_at"] = attributes["time"]
        envelope["cloudevents"] = cloudevents.kept(attributes, envelope)
    return envelope


def payload_bytes(body: bytes, headers: Mapping[str, str] | None) -> bytes | None:
    """The payload as the message carries it (its exact digits), or None
    when the body is not the payload (a structured CloudEvent: its data)."""
    return None if cloudevents.is_structured(headers) else body


# -- a replay of a dead letter (inbox/dlq.py writes it) ----------------------------

# The subject the replayed message was first delivered on: a replay travels on
# {context}.dlq.replay.{handler}, which the envelope does not take its fields from.
ORIGINAL_SUBJECT = "Pgoutbox-Original-Subject"
_REPLAY = re.compile(r"^[A-Za-z0-9_-]+\.dlq\.replay\.[A-Za-z0-9_-]+$")


def is_replay(subject: str) -> bool:
    return bool(_REPLAY.match(subject))


def envelope_from(subject: str, body: bytes, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The handler envelope of a delivered message, original or replay;
    InvalidMessage naming the header, subject or body at fault."""
    if not is_replay(subject):
        return from_nats(subject, body, headers)
    headers = dict(headers or {})
    original = headers.get(ORIGINAL_SUBJECT)
    if not original:
        raise InvalidMessage(f"header {ORIGINAL_SUBJECT} is missing on a replay")
    # The message id is the part of a replay's Nats-Msg-Id before its first colon.
    headers[MSG_ID] = (headers.get(MSG_ID) or "").split(":", 1)[0]
    return from_nats(original, body, headers)


# -- publishing: what both sides share ------------------------------------------

# NATS/1.0\r\n ... \r\n\r\n: the framing nats-py puts around headers.
HEADER_FRAMING = len(b"NATS/1.0\r\n") + len(b"\r\n")


class PublishError(enum.StrEnum):
    """Stable codes, the prefix of last_error for events that failed to publish."""

    MAX_PAYLOAD = "MAX_PAYLOAD"  # message larger than the server or stream allows
    NO_STREAM = "NO_STREAM"  # no JetStream stream captures the subject
    BAD_HEADER = "BAD_HEADER"  # a header NATS cannot carry unaltered, or posing as a reserved one
    BAD_SUBJECT = "BAD_SUBJECT"  # not a publishable subject, or not {context}.event.{event_type}.v{version}
    BAD_PAYLOAD = "BAD_PAYLOAD"  # the payload is not a JSON object
    BAD_TIMESTAMP = "BAD_TIMESTAMP"  # a timestamp RFC 3339 cannot express (±infinity, BC, years > 9999)
    ENCODE_FAILED = "ENCODE_FAILED"  # anything else that failed while building this event's message
    PUBLISH_TIMEOUT = "PUBLISH_TIMEOUT"  # no ack in time (maybe stored: a retry is deduplicated)
    NATS_UNAVAILABLE = "NATS_UNAVAILABLE"  # not connected to NATS
    JETSTREAM_ERROR = "JETSTREAM_ERROR"  # a JetStream error that may clear


# What an event carries fails the same way on every attempt: dead-lettered at once.
PERMANENT = frozenset(
    {
        PublishError.MAX_PAYLOAD,
        PublishError.NO_STREAM,
        PublishError.BAD_HEADER,
        PublishError.BAD_SUBJECT,
        PublishError.BAD_PAYLOAD,
        PublishError.BAD_TIMESTAMP,
        PublishError.ENCODE_FAILED,
    }
)

# JetStream API errors (the err_code of an error reply) that never clear by
# themselves: the message exceeds the stream's max_msg_size; the stream is gone.
JS_MESSAGE_TOO_LARGE = 10054
JS_STREAM_NOT_FOUND = 10059
PERMANENT_JS_ERRORS: Mapping[int, PublishError] = {
    JS_MESSAGE_TOO_LARGE: PublishError.MAX_PAYLOAD,
    JS_STREAM_NOT_FOUND: PublishError.NO_STREAM,
}


def message_size(body: bytes, headers: Mapping[str, str]) -> int:
    """Bytes the server counts against max_payload (headers included)."""
    return len(body) + HEADER_FRAMING + sum(len(k.encode()) + len(str(v).encode()) + 4 for k, v in headers.items())
