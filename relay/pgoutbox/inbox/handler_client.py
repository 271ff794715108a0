"""POSTs the event envelope to a handler over HTTP/1.1 (http1.Http1Pool)
and reports what came back, without judging it: handler_contract decides
what an answer means.

The body is the envelope minus its trace context, which travels as the W3C
`traceparent`/`tracestate` headers. `Idempotency-Key` carries the message id,
so a handler can deduplicate on its own too (defence in depth).
`Pgoutbox-Received-Version` (only for a handler whose manifest declares a
version) is the version the payload came in at; the body's event_version
and payload are the declared version's, upcast when it came older.

A handler of format "cloudevents" gets the HTTP binding's binary mode
instead: the CloudEvents attributes as ce-* headers (datacontenttype as
Content-Type), the payload alone as the body (cloudevent_lines).

The request is built for cheapness: the body is serialised once, as bytes
(the inbox stores the same text plus the trace context); the handler's URL
is parsed once; connections are kept alive between calls.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pgoutbox.core import cloudevents
from pgoutbox.inbox.http1 import TEXT_KEPT, Http1Pool, HttpError, Target

_TEXT_LIMIT = TEXT_KEPT

# Answers that say the handler cannot take any message now, not what it makes
# of this one: a proxy with no handler behind it (502, 504), a handler
# unavailable (503) or throttling its callers (429). docs/handlers.md,
# "A handler that is away", says why 429 is one and a timeout is not.
AWAY_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class HandlerAnswer:
    status: int | None  # None: no HTTP answer (timeout, connection error)
    error: str | None  # why there was no answer
    retry_after: float | None  # seconds, from a Retry-After header
    elapsed: float
    text: str = ""  # the start of the response body, for last_error
    # No answer because the handler never got the request (http1.HttpError.away).
    unreachable: bool = False

    @property
    def away(self) -> bool:
        """The handler is away, this answer says nothing about the message
        (AWAY_STATUSES, or no connection): the handler's gate
        closes and the message goes back uncounted (inbox/gates.py)."""
        return self.unreachable or self.status in AWAY_STATUSES

    @property
    def summary(self) -> str:
        if self.status is None:
            return str(self.error)
        text = " ".join(self.text.split())[:_TEXT_LIMIT]
        return f"HTTP {self.status}" + (f": {text}" if text else "")


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: ignored, the backoff applies


def request_headers(
    envelope: dict[str, Any], handler: str, delivery: int, received: int | None = None
) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": envelope["message_id"],
        "Pgoutbox-Message-Id": envelope["message_id"],
        "Pgoutbox-Handler": handler,
        "Pgoutbox-Delivery": str(delivery),
    }
    if received is not None:
        headers["Pgoutbox-Received-Version"] = str(received)
    headers.update({k: v for k, v in (envelope.get("trace") or {}).items() if isinstance(v, str)})
    return headers


def _header_lines(
    envelope: dict[str, Any],
    handler: str,
    delivery: int,
    received: int | None = None,
    trace: Mapping[str, str] | None = None,
) -> bytes:
    """request_headers() as the lines of the request (one f-string: this runs
    for every message). Every value is safe on a header line: a canonical
    UUID, a handler name ([A-Za-z0-9_.-]), digits, and trace headers the
    envelope admitted as visible ASCII only (wire.from_nats), or that the
    OpenTelemetry propagator wrote (`trace`, when tracing is on)."""
    mid = envelope["message_id"]
    lines = (
        f"Content-Type: application/json\r\nIdempotency-Key: {mid}\r\nPgoutbox-Message-Id: {mid}\r\n"
        f"Pgoutbox-Handler: {handler}\r\nPgoutbox-Delivery: {delivery}\r\n"
    )
    if received is not None:
        lines += f"Pgoutbox-Received-Version: {received}\r\n"
    if trace is None:
        trace = envelope.get("trace")
    if trace:
        lines += "".join(f"{k}: {v}\r\n" for k, v in trace.items() if isinstance(v, str))
    return lines.encode()


def cloudevent_lines(
    attributes: dict[str, str],
    envelope: dict[str, Any],
    handler: str,
    delivery: int,
    received: int | None = None,
    trace: Mapping[str, str] | None = None,
) -> bytes:
    """The header lines of a handler of format "cloudevents": the binary
    mode's, then pgoutbox's own (Idempotency-Key, delivery, trace context),
    minus the Content-Type the attributes set."""
    own = _header_lines(envelope, handler, delivery, received, trace).removeprefix(_JSON_TYPE)
    return cloudevents.http_lines(attributes).encode() + own


# The envelope's Content-Type, the first of _header_lines (the unit tests see that it goes).
_JSON_TYPE = b"Content-Type: application/json\r\n"


_compact = json.JSONEncoder(separators=(",", ":")).encode
# Kept in the inbox, not in the body: the trace context travels as headers;
# the CloudEvents attributes go only to a handler of format "cloudevents".
_NOT_IN_BODY = ("trace", "cloudevents")


def payload_body(envelope: dict[str, Any], payload: bytes | None = None) -> bytes:
    """The body a handler of format "cloudevents" gets: the payload as it
    came when given, else the envelope's, as compact JSON."""
    return bytes(payload).strip() if payload is not None else _compact(envelope["payload"]).encode()


def request_body(envelope: dict[str, Any], payload: bytes | None = None) -> bytes:
    """The envelope minus its trace context (and CloudEvents attributes), as
    compact JSON. `payload`: the message body as it came (a JSON object
    wire.from_nats checked), sent in place of the parsed payload, so that
    numbers keep every digit (Python would turn
    12345678901234567890.123456789 into a float) and the body is not
    encoded again."""
    if payload is None:
        return _compact({k: v for k, v in envelope.items() if k not in _NOT_IN_BODY}).encode()
    head = _compact({k: v for k, v in envelope.items() if k not in _NOT_IN_BODY and k != "payload"})
    return b"".join((head[:-1].encode(), b',"payload":', bytes(payload).strip(), b"}"))


# Idle connections are closed after this long; a handler's own keep-alive
# timeout should be longer (most servers: 5 s or more).
KEEPALIVE_EXPIRY = 4.0


class HandlerClient:
    """Calls handlers on kept-alive HTTP/1.1 connections, at most
    `per_origin` at once per origin."""

    def __init__(self, per_origin: int = 16):
        # Loading the CA bundle costs ~25 ms: once, not once per connection.
        self._pool = Http1Pool(per_origin, KEEPALIVE_EXPIRY, ssl.create_default_context())
        self._targets: dict[str, Target] = {}

    def _target(self, url: str) -> Target:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = Target.parse(url)
        return target

    async def call(
        self,
        url: str,
        body: bytes,
        envelope: dict[str, Any],
        *,
        handler: str,
        delivery: int,
        timeout: float,
        received: int | None = None,
        trace: Mapping[str, str] | None = None,
        cloudevent: dict[str, str] | None = None,
    ) -> HandlerAnswer:
        """POSTs `body` (request_body(envelope)) with the envelope's headers;
        `received`: the version the payload came in at (a versioned handler);
        `trace`: the trace context to send instead of the envelope's (the
        handler call's own span, when tracing is on); `cloudevent`: the
        attributes of a handler of format "cloudevents" (then `body` is
        payload_body())."""
        if cloudevent is None:
            lines = _header_lines(envelope, handler, delivery, received, trace)
        else:
            lines = cloudevent_lines(cloudevent, envelope, handler, delivery, received, trace)
        answer, _ = await self._post(url, body, lines, timeout)
        return answer

    async def call_batch(
        self, url: str, body: bytes, *, handler: str, count: int, timeout: float, keep: int
    ) -> tuple[HandlerAnswer, bytes]:
        """POSTs a batch handler's request (inbox/batch.py builds `body`, of
        `count` messages): the answer, and the body of a 2xx one (at most
        `keep` bytes; a longer one is a broken answer)."""
        lines = f"Content-Type: application/json\r\nPgoutbox-Handler: {handler}\r\nPgoutbox-Batch-Size: {count}\r\n"
        return await self._post(url, body, lines.encode(), timeout, keep)

    async def _post(
        self, url: str, body: bytes, lines: bytes, timeout: float, keep: int = 0
    ) -> tuple[HandlerAnswer, bytes]:
        started = time.monotonic()
        try:
            answer = await self._pool.post(self._target(url), body, lines, timeout, keep)
        except TimeoutError:
            return HandlerAnswer(None, f"timeout after {timeout:g}s", None, time.monotonic() - started), b""
        except HttpError as exc:
            return HandlerAnswer(
                None, f"connection error: {exc}", None, time.monotonic() - started, unreachable=exc.away
            ), b""
        return HandlerAnswer(
            answer.status,
            None,
            _retry_after(answer.headers.get("retry-after")),
            time.monotonic() - started,
            answer.text if answer.status >= 300 else "",
        ), answer.body

    async def aclose(self) -> None:
        await self._pool.aclose()
