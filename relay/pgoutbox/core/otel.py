"""The OpenTelemetry side of core.tracing: imported only when the OTEL_*
variables ask for traces (tracing.from_environment), never otherwise.

Spans follow the messaging semantic conventions (v1.44): name
`{operation} {destination}`, messaging.system "nats", the subject as
messaging.destination.name, the event id as messaging.message.id.

  relay     send {subject}     PRODUCER, one per published batch: a link to
                               each event's creation context (the
                               traceparent stored at emit), or that context
                               as parent for a batch of one event
  consumer  process {subject}  CONSUMER, per message handed to the handler,
                               parent: the creation context (the message's
                               traceparent header)
              POST             CLIENT, child: the handler call, whose
                               traceparent header continues from this span
              settle {subject} CLIENT, child: the inbox outcome and the ack
                               (or nak, or dead letter)

The SDK does its own reading of what it knows (OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG), OTEL_EXPORTER_OTLP_*,
OTEL_BSP_*, span limits); this module decides the exporters and refuses
what it cannot honour.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from pgoutbox import __version__
from pgoutbox.core import bounds
from pgoutbox.core.backoff import Every
from pgoutbox.core.errors import TracingMisconfigured

log = logging.getLogger(__name__)
_ROOT = Context()  # an explicit empty context: a span without a creation context starts a trace

SYSTEM = "nats"
# Attributes of our own (no convention exists for them), in milliseconds.
OUTBOX_WAIT = "pgoutbox.outbox.wait_ms"  # created_at (the emitting transaction) -> the batch's send
STREAM_WAIT = "pgoutbox.stream.wait_ms"  # JetStream's timestamp of the message -> its fetch


def _creation(headers: Any) -> SpanContext | None:
    """The creation context in an event's headers (a dict, or its JSON text
    as the relay claims it); None without a valid traceparent."""
    if not headers:
        return None
    if isinstance(headers, str):
        if "traceparent" not in headers:
            return None  # most rows without one: no JSON parse
        try:
            headers = json.loads(headers)
        except ValueError:
            return None
    if not isinstance(headers, Mapping):
        return None
    parent = headers.get("traceparent")
    if not isinstance(parent, str):
        return None
    state = headers.get("tracestate")
    return span_context(parent, state if isinstance(state, str) else None)


# W3C trace context: version-trace_id-parent_id-flags, lower-case hex; a
# later version may append fields, version 00 may not, ff is invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def span_context(traceparent: str, tracestate: str | None = None) -> SpanContext | None:
    """The remote SpanContext a traceparent names, or None when it is not a
    valid one. What the SDK's propagator accepts, parsed without its Context
    objects: the relay does this for every event of a batch."""
    found = _TRACEPARENT.fullmatch(traceparent.strip())
    if found is None or found[1] == "ff" or (found[1] == "00" and found[5]):
        return None
    trace_id, span_id = int(found[2], 16), int(found[3], 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=TraceFlags(int(found[4], 16)),
        trace_state=TraceState.from_header([tracestate]) if tracestate else None,
    )


def _wait_ms(created: Any, now_ns: int) -> float | None:
    """now - created_at in ms; created_at as the relay claims it (wire text), or a datetime."""
    if isinstance(created, str):
        try:
            created = datetime.fromisoformat(created)
        except ValueError:
            return None
    if isinstance(created, datetime) and created.tzinfo is not None:
        return round(now_ns / 1e6 - created.timestamp() * 1e3, 3)
    return None  # a timestamp the wire cannot express (wire.Unrepresentable)


class _Send:
    def __init__(self, span: Span, count: int):
        self.span = span
        self.count = count

    def end(self, failures: Sequence[str]) -> None:
        if failures:
            self.span.set_attribute("error.type", failures[0])
            self.span.set_attribute("pgoutbox.failed_count", len(failures))
            self.span.set_status(
                Status(StatusCode.ERROR, f"{len(failures)} of {self.count} event(s) not published: {failures[0]}")
            )
        self.span.end()


@functools.lru_cache(maxsize=256)
def _url_attributes(url: str) -> dict[str, Any]:
    """The HTTP client attributes of a handler URL (a handful of URLs: parsed once each)."""
    parts = urlsplit(url)
    attributes: dict[str, Any] = {"url.full": url}
    if parts.hostname:
        attributes["server.address"] = parts.hostname
    attributes["server.port"] = parts.port or (443 if parts.scheme == "https" else 80)
    return attributes


class _Http:
    def __init__(self, span: Span):
        self.span = span

    def headers(self) -> dict[str, str]:
        """This span's W3C trace context (what the propagator's inject writes, formatted here: per message)."""
        ctx = self.span.get_span_context()
        headers = {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        if state:
            headers["tracestate"] = state
        return headers

    def end(self, status: int | None, error: str | None) -> None:
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
            if status >= 400:
                self.span.set_attribute("error.type", str(status))
                self.span.set_status(Status(StatusCode.ERROR))
        else:
            kind = "timeout" if (error or "").startswith("timeout") else "connection_error"
            self.span.set_attribute("error.type", kind)
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class _Settle:
    def __init__(self, span: Span):
        self.span = span

    def end(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.span.set_attribute("error.type", type(error).__qualname__)
            self.span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        self.span.end()


class _Process:
    def __init__(self, tracer: trace.Tracer, span: Span, subject: str, message_id: str):
        self.tracer = tracer
        self.span = span
        self.subject = subject
        self.message_id = message_id
        self.context = trace.set_span_in_context(span, _ROOT)

    def http(self, method: str, url: str) -> _Http:
        attributes = {"http.request.method": method, **_url_attributes(url)}
        return _Http(self.tracer.start_span(method, self.context, SpanKind.CLIENT, attributes))

    def settle(self, operation: str) -> _Settle:
        attributes = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "settle",
            "messaging.operation.name": operation,
            "messaging.destination.name": self.subject,
            "messaging.message.id": self.message_id,
        }
        return _Settle(self.tracer.start_span(f"settle {self.subject}", self.context, SpanKind.CLIENT, attributes))

    def end(self, outcome: str | None, error: BaseException | None = None) -> None:
        if outcome is not None:
            self.span.set_attribute("pgoutbox.outcome", outcome)
        if error is not None:
            self.span.set_attribute("error.type", type(error).__qualname__)
            self.span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        elif outcome in ("retried", "dead_lettered"):
            # The handler's failure: the answer is on the CLIENT span.
            self.span.set_attribute("error.type", outcome)
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()


def _exporters(environ: Mapping[str, str]) -> list[str]:
    names = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]
    unknown = [n for n in names if n not in ("otlp", "console", "none")]
    if unknown:
        raise TracingMisconfigured(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']}: pgoutbox exports traces with "
            "otlp (OTLP/HTTP) or console only, or none"
        )
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip()
    if "otlp" in names and protocol not in ("", "http/protobuf"):
        raise TracingMisconfigured(
            f"OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL={protocol}: pgoutbox exports OTLP over http/protobuf only"
        )
    return [n for n in names if n != "none"]


class _Untraced:
    """The spans of an event or message whose span could not be started."""

    def end(self, *args: Any, **kwargs: Any) -> None:
        return None

    def headers(self) -> dict[str, str]:
        return {}

    def http(self, method: str, url: str) -> _Untraced:
        return self

    def settle(self, operation: str) -> _Untraced:
        return self


_UNTRACED = _Untraced()


class OtelTracer:
    """core.tracing.Tracer on the OpenTelemetry SDK."""

    on = True

    def __init__(self, provider: TracerProvider, service: str, exporters: list[str]):
        self.provider = provider
        self.tracer = provider.get_tracer("pgoutbox", __version__)
        self.service = service
        self.exporters = exporters
        self._lines = Every(60)

    @classmethod
    def build(cls, default_service: str, environ: Mapping[str, str]) -> OtelTracer:
        names = _exporters(environ)
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: default_service}))
        # One send span links every event of a batch: up to a claim's largest
        # batch, unless OTEL_SPAN_LINK_COUNT_LIMIT says otherwise (the SDK's
        # own default, 128, would drop the links of most of a full batch).
        links = None if environ.get("OTEL_SPAN_LINK_COUNT_LIMIT") else int(bounds.CLAIM_BATCH.high or 10_000)
        provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_links=links))
        for name in names:
            exporter: SpanExporter = OTLPSpanExporter() if name == "otlp" else ConsoleSpanExporter()
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, str(resource.attributes[SERVICE_NAME]), names)

    @property
    def describe(self) -> str:
        return f"service.name {self.service}, exporters {', '.join(self.exporters) or 'none'}"

    def send(self, rows: Sequence[Mapping[str, Any]]) -> _Send | _Untraced:
        try:
            return self._send(rows)
        except Exception:  # no event may fail for its span: the batch goes untraced
            self._failed("send")
            return _UNTRACED

    def process(
        self, envelope: Mapping[str, Any], handler: str, delivery: int, stream_wait_ms: float | None
    ) -> _Process | _Untraced:
        try:
            return self._process(envelope, handler, delivery, stream_wait_ms)
        except Exception:  # no message may fail for its span: it goes untraced
            self._failed("process")
            return _UNTRACED

    def _failed(self, what: str) -> None:
        if self._lines():
            log.exception("could not start a %s span; untraced", what, extra={"action": "tracing_error"})

    def _send(self, rows: Sequence[Mapping[str, Any]]) -> _Send:
        now = time.time_ns()
        first = rows[0]
        subject = first["subject"]
        single = all(r["subject"] == subject for r in rows)
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
        }
        if single:
            attributes["messaging.destination.name"] = subject
        links: list[Link] = []
        oldest: float | None = None
        parent = _ROOT
        for row in rows:
            wait = _wait_ms(row.get("created_at"), now)
            if wait is not None and (oldest is None or wait > oldest):
                oldest = wait
            creation = _creation(row.get("headers"))
            if creation is not None:
                link: dict[str, Any] = {"messaging.message.id": str(row["event_id"])}
                if wait is not None:
                    link[OUTBOX_WAIT] = wait
                links.append(Link(creation, link))
        if len(rows) == 1:
            attributes["messaging.message.id"] = str(first["event_id"])
            if links:  # the one context there is: the span's parent, as the conventions allow
                parent = trace.set_span_in_context(NonRecordingSpan(links[0].context), _ROOT)
                links = []
        else:
            attributes["messaging.batch.message_count"] = len(rows)
        if oldest is not None:
            attributes[OUTBOX_WAIT] = oldest  # the batch's longest wait; each link has its event's
        name = f"send {subject}" if single else "send"
        span = self.tracer.start_span(name, parent, SpanKind.PRODUCER, attributes, links, start_time=now)
        return _Send(span, len(rows))

    def _process(
        self, envelope: Mapping[str, Any], handler: str, delivery: int, stream_wait_ms: float | None
    ) -> _Process:
        subject = str(envelope["subject"])
        message_id = str(envelope["message_id"])
        creation = _creation(envelope.get("trace"))
        parent = _ROOT if creation is None else trace.set_span_in_context(NonRecordingSpan(creation), _ROOT)
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": subject,
            "messaging.message.id": message_id,
            "messaging.consumer.group.name": handler,
            "pgoutbox.delivery": delivery,
        }
        if stream_wait_ms is not None:
            attributes[STREAM_WAIT] = stream_wait_ms
        span = self.tracer.start_span(f"process {subject}", parent, SpanKind.CONSUMER, attributes)
        return _Process(self.tracer, span, subject, message_id)

    async def shutdown(self) -> None:
        """Exports what the batch processors still hold (their own timeout bounds it)."""
        await asyncio.to_thread(self.provider.shutdown)
