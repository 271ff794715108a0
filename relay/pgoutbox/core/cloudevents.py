"""CloudEvents 1.0 on the wire: the NATS protocol binding in binary mode
(every attribute a `ce-` header, the payload the body) for what the relay
publishes, and both modes, binary and structured, for what the consumer
admits; the HTTP binding's binary mode for a handler of format "cloudevents".

    attribute        derived from the event (relay)                  header
    specversion      1.0                                              ce-specversion
    id               event_id (= Nats-Msg-Id)                         ce-id
    source           OUTBOX_CLOUDEVENTS_SOURCE, "{context}" filled in ce-source
    type             {context}.{event_type}.v{event_version}          ce-type
    time             occurred_at (RFC 3339, UTC)                      ce-time
    subject          {aggregate_type}/{aggregate_id}                  ce-subject
    datacontenttype  application/json                                 ce-datacontenttype
    traceparent      the event's traceparent header (distributed      ce-traceparent
    tracestate       tracing extension), when it carries one          ce-tracestate

Values are percent-encoded as both bindings require (space, `"`, `%` and
everything outside printable ASCII, as UTF-8 bytes with upper-case hex), and
decoded on receipt after a double-quoted string is unescaped; a sequence
that is not UTF-8 is refused. Header names are case-insensitive: attribute
names are read in lower case. docs/cloudevents.md has the whole contract.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Mapping, MutableMapping
from datetime import datetime
from typing import Any

SPECVERSION = "1.0"
PREFIX = "ce-"
# The prefix in every letter case: one slice and one set lookup per header name.
PREFIXES = _PREFIXES = frozenset({"ce-", "Ce-", "cE-", "CE-"})
DATACONTENTTYPE = "application/json"
# The media type of the JSON event format; structured mode is recognised
# by a Content-Type starting with "application/cloudevents" (either case).
STRUCTURED = "application/cloudevents+json"
CONTEXT_PLACEHOLDER = "{context}"
DEFAULT_SOURCE = "/pgoutbox/{context}"
# What pgoutbox alone decides: an emitter header repeating one must agree.
FIXED = ("specversion", "id", "datacontenttype")
REQUIRED = ("specversion", "id", "source", "type")
TRACING = ("traceparent", "tracestate")

# A value needing no encoding: printable ASCII but `"` and `%` (U+0021,
# U+0023-U+0024, U+0026-U+007E). Most values are: one match, no copy.
_PLAIN = re.compile(r"[!#$&-~]*")
_SAFE_CHARS = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in '"%')
# Attribute names: lower-case letters and digits (CloudEvents 1.0, "Attribute Naming Convention").
_NAME = re.compile(r"[a-z0-9]{1,64}")
# The names the relay writes: known good without the pattern.
_KNOWN = frozenset({"specversion", "id", "source", "type", "time", "subject", "datacontenttype", *TRACING})
# The attributes whose JSON-format value must be a string (the others of an
# event may be booleans or integers, carried as their canonical strings).
_STRINGS = frozenset({*REQUIRED, "time", "subject", "datacontenttype", "dataschema"})
# RFC 3986 URI-reference characters: unreserved, sub-delims, ":@/?#[]", and %XX.
_URI_REFERENCE = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?#\[\]]|%[0-9A-Fa-f]{2})+")
# A media type travels as the handler's Content-Type as it is: visible ASCII and space only.
_MEDIA = re.compile(r"[\x20-\x7e]+")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")


class NotACloudEvent(ValueError):
    """A message that claims to be a CloudEvent (a ce- header, or the
    structured media type) and is not one pgoutbox can admit; the text says why."""


def plain(value: str) -> bool:
    """Whether `value` needs no percent-encoding (nor any NATS header check:
    it has no white space or control character)."""
    return _PLAIN.fullmatch(value) is not None


def encode(value: str) -> str:
    """A header value: the attribute's string, percent-encoded where the bindings require it."""
    if _PLAIN.fullmatch(value):
        return value
    return urllib.parse.quote(value, safe=_SAFE_CHARS)


def decode(value: str) -> str:
    """The attribute's string of a header value: a double-quoted string
    unescaped, then one round of percent-decoding; NotACloudEvent when the
    bytes are not UTF-8 (an overlong form included)."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    if "%" not in value:
        return value
    try:
        return urllib.parse.unquote_to_bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise NotACloudEvent(f"value {value[:80]!r} percent-decodes to bytes that are not UTF-8") from None


def source_template(text: str) -> str:
    """OUTBOX_CLOUDEVENTS_SOURCE: a URI-reference (RFC 3986), `{context}`
    standing for the event's context; ValueError otherwise."""
    filled = text.replace(CONTEXT_PLACEHOLDER, "sea")  # a context is [A-Za-z0-9_-]: any one checks the rest
    if not filled or not _URI_REFERENCE.fullmatch(filled) or filled.count("#") > 1:
        raise ValueError(
            "not a URI-reference (RFC 3986: letters, digits, -._~!$&'()*+,;=:@/?#[] and %XX escapes; "
            f"{CONTEXT_PLACEHOLDER} for the context)"
        )
    if ":" in filled.split("/", 1)[0] and not _SCHEME.match(filled):
        raise ValueError("not a URI-reference: a scheme starts with a letter (or write ./ before a relative path)")
    return text


def _put(headers: MutableMapping[str, str], name: str, value: str) -> None:
    headers[PREFIX + name] = encode(value)


def _emitted(headers: MutableMapping[str, str]) -> dict[str, str]:
    """The emitter's ce-* headers, taken out of `headers`: attribute -> value
    (its text, encoded here). A copy of a fixed attribute must agree."""
    found = {}
    for name in [n for n in headers if n[:3] in _PREFIXES]:
        attribute = name[3:].lower()
        if not _NAME.fullmatch(attribute):
            raise ValueError(f"header name {name!r} does not name a CloudEvents attribute (ce- then a-z, 0-9)")
        if attribute in found:
            raise ValueError(f"header {name!r} sets the CloudEvents attribute {attribute} twice")
        found[attribute] = headers.pop(name)
    return found


def put_binary(headers: MutableMapping[str, str], event: Mapping[str, Any], time: str | None, source: str) -> None:
    """Adds the ce-* headers of an outbox event (relay) or of a stored
    envelope's attributes (a replay: event["cloudevents"], None when the
    original carried none) to `headers`, which holds the emitter's headers;
    ValueError names an emitter header that cannot stand."""
    if "cloudevents" in event:  # a replay carries the attributes it came with, as they came
        stored = event["cloudevents"]
        for name in [n for n in headers if n[:3] in _PREFIXES]:
            del headers[name]
        for name, value in (stored or {}).items():
            _put(headers, name, value)
        return
    emitted = _emitted(headers) if any(n[:3] in _PREFIXES for n in headers) else {}
    if is_structured(headers):  # the body is the payload: a reader would take it for the whole event
        raise ValueError(
            "header Content-Type says structured mode (application/cloudevents...); the body is the payload"
        )
    context = event["context"]
    attributes = {
        "specversion": SPECVERSION,
        "id": str(event["event_id"]),
        "source": source.replace(CONTEXT_PLACEHOLDER, context),
        "type": f"{context}.{event['event_type']}.v{event['event_version']}",
        "datacontenttype": DATACONTENTTYPE,
    }
    if time is not None:
        attributes["time"] = time
    if event.get("aggregate_type") is not None and event.get("aggregate_id") is not None:
        attributes["subject"] = f"{event['aggregate_type']}/{event['aggregate_id']}"
    for name in TRACING:
        if name in headers:
            attributes[name] = headers[name]
    for name, value in emitted.items():
        if name in FIXED and value != attributes[name]:
            raise ValueError(f"header ce-{name} {value[:80]!r} differs from pgoutbox's {attributes[name]!r}")
        if not value:
            raise ValueError(f"header ce-{name} is empty (an attribute has a value, or is absent)")
        attributes[name] = value
    if emitted:  # what the consumer would refuse (a time that is not RFC 3339...) fails here, at once
        _check(attributes)
    for name, value in attributes.items():
        _put(headers, name, value)


def is_structured(headers: Mapping[str, str] | None) -> bool:
    """A message in structured mode: Content-Type application/cloudevents..., in any letter case."""
    if not headers:
        return False
    for name, value in headers.items():
        if len(name) == 12 and name.lower() == "content-type":  # the length first: most names differ in it
            return value.strip().lower().startswith("application/cloudevents")
    return False


def _is_json(media_type: str) -> bool:
    essence = media_type.split(";", 1)[0].strip().lower()
    return essence == "application/json" or essence.endswith("+json") or essence == "text/json"


def _check(attributes: dict[str, str]) -> dict[str, str]:
    missing = [name for name in REQUIRED if not attributes.get(name)]
    if missing:
        raise NotACloudEvent(f"required attribute(s) {', '.join(missing)} missing")
    if attributes["specversion"] != SPECVERSION:
        raise NotACloudEvent(f"specversion {attributes['specversion'][:20]!r} is not {SPECVERSION}")
    media = attributes.get("datacontenttype")
    if media is not None and not (_is_json(media) and _MEDIA.fullmatch(media)):
        raise NotACloudEvent(f"datacontenttype {media[:80]!r} is not JSON: the payload must be a JSON object")
    if "time" in attributes:
        try:
            datetime.fromisoformat(attributes["time"])
        except ValueError:
            raise NotACloudEvent(f"time {attributes['time'][:80]!r} is not an RFC 3339 timestamp") from None
    return attributes


def from_binary(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The attributes (decoded) of a binary-mode message, None without any
    ce- header; NotACloudEvent when they are not a CloudEvent's."""
    attributes: dict[str, str] = {}
    for name, value in headers.items():
        if name[:3] not in _PREFIXES:
            continue
        attribute = name[3:].lower()
        if attribute not in _KNOWN and not _NAME.fullmatch(attribute):
            raise NotACloudEvent(f"header {name[:80]!r} does not name a CloudEvents attribute (ce- then a-z, 0-9)")
        try:
            decoded = value if "%" not in value and value[:1] != '"' else decode(value)
        except NotACloudEvent as exc:  # the reason names the header at fault
            raise NotACloudEvent(f"header {name[:80]} {exc}") from None
        if attributes.get(attribute, decoded) != decoded:
            raise NotACloudEvent(f"header ce-{attribute} is given twice, with different values")
        attributes[attribute] = decoded
    return _check(attributes) if attributes else None


def _canonical(value: Any) -> str:
    """An attribute's canonical string (structured mode carries JSON values)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    raise NotACloudEvent(f"attribute value {json.dumps(value)[:80]} is not a string, boolean or integer")


def from_structured(document: Any) -> tuple[dict[str, str], Any]:
    """(attributes, data) of a JSON-format event already parsed; NotACloudEvent otherwise."""
    if not isinstance(document, dict):
        raise NotACloudEvent("a structured-mode body must be a JSON object (the JSON event format)")
    if "data_base64" in document:
        raise NotACloudEvent("data_base64 (binary data) is not a JSON payload")
    attributes = {}
    for name, value in document.items():
        if name == "data":
            continue
        if not _NAME.fullmatch(name):
            raise NotACloudEvent(f"member {name[:80]!r} is not a CloudEvents attribute name (a-z, 0-9)")
        if value is None:
            continue
        if name in _STRINGS and not isinstance(value, str):
            # The JSON format gives these attributes string types (String, URI-reference,
            # Timestamp): `"source": false` is not the source "false".
            raise NotACloudEvent(f"attribute {name} is {json.dumps(value)[:80]}, not a JSON string")
        attributes[name] = _canonical(value)
    return _check(attributes), document.get("data")


def derived(envelope: Mapping[str, Any], source: str) -> dict[str, str]:
    """The attributes of an envelope that came without any (a message of a
    relay before CloudEvents): as the relay derives them."""
    context = envelope["context"]
    attributes = {
        "specversion": SPECVERSION,
        "id": envelope["message_id"],
        "source": source.replace(CONTEXT_PLACEHOLDER, context),
        "type": f"{context}.{envelope['event_type']}.v{envelope['event_version']}",
        "datacontenttype": DATACONTENTTYPE,
    }
    if envelope.get("occurred_at"):
        attributes["time"] = envelope["occurred_at"]
    if envelope.get("aggregate_type") is not None and envelope.get("aggregate_id") is not None:
        attributes["subject"] = f"{envelope['aggregate_type']}/{envelope['aggregate_id']}"
    attributes.update((k, v) for k, v in (envelope.get("trace") or {}).items() if k in TRACING)
    return attributes


def kept(attributes: Mapping[str, str], envelope: Mapping[str, Any]) -> dict[str, str | None]:
    """What the inbox keeps of a message's attributes: those the envelope
    does not give back (derived()), null for a derived one the message did
    not carry; the source always. A relay's message keeps its source alone."""
    base = derived(envelope, "")
    found: dict[str, str | None] = {k: v for k, v in attributes.items() if base.get(k) != v}
    found.update((k, None) for k in base if k not in attributes)
    found["source"] = attributes["source"]
    return found


def expand(stored: Mapping[str, str | None], envelope: Mapping[str, Any]) -> dict[str, str]:
    """The attributes kept() kept, whole again."""
    full: dict[str, str | None] = {**derived(envelope, ""), **stored}
    return {k: v for k, v in full.items() if v is not None}


def http_lines(attributes: Mapping[str, str]) -> str:
    """The HTTP binding's binary-mode header lines of these attributes:
    datacontenttype as Content-Type, every other one as ce-{name}."""
    # A media type may hold spaces and quotes (parameters): as it is, being visible ASCII (_check).
    lines = [f"Content-Type: {attributes.get('datacontenttype') or DATACONTENTTYPE}\r\n"]
    lines.extend(f"ce-{name}: {encode(value)}\r\n" for name, value in attributes.items() if name != "datacontenttype")
    return "".join(lines)
