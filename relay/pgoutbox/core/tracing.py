"""OpenTelemetry traces of the relay and the consumer, configured only by the
standard OTEL_* environment variables (docs/observability.md#traces).

With no OTEL_* variable set (or OTEL_SDK_DISABLED=true, or
OTEL_TRACES_EXPORTER=none), tracing is OFF: the workers hold `OFF`, whose
`on` is False, check that flag once per batch (relay) or fetch (consumer),
and nothing from opentelemetry is ever imported. When on, `from_environment`
imports pgoutbox.core.otel, which builds the SDK's tracer provider and an
OTLP/HTTP exporter behind a BatchSpanProcessor (its own thread: exports never
block the event loop).

The OFF objects implement the same methods as the spans of core.otel, doing
nothing, so that a code path that forgot the flag still works.

For applications, `current_traceparent()` (also `pgoutbox.tracing`) gives the
current span's W3C trace context as the headers of `outbox.emit`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pgoutbox.core.errors import TracingUnavailable

log = logging.getLogger(__name__)

# Default service.name of each worker, when neither OTEL_SERVICE_NAME nor
# OTEL_RESOURCE_ATTRIBUTES names one.
RELAY_SERVICE = "pgoutbox-relay"
CONSUMER_SERVICE = "pgoutbox-consumer"
INSTALL_HINT = "install pgoutbox[otel] (pip install 'pgoutbox[otel]'), or unset the OTEL_* variables"


# -- the spans the workers use (core.otel implements them for real) -----------


class SendSpan(Protocol):
    def end(self, failures: Sequence[str]) -> None: ...


class HttpSpan(Protocol):
    def headers(self) -> dict[str, str]: ...

    def end(self, status: int | None, error: str | None) -> None: ...


class SettleSpan(Protocol):
    def end(self, error: BaseException | None = None) -> None: ...


class ProcessSpan(Protocol):
    def http(self, method: str, url: str) -> HttpSpan: ...

    def settle(self, operation: str) -> SettleSpan: ...

    def end(self, outcome: str | None, error: BaseException | None = None) -> None: ...


class Tracer(Protocol):
    @property
    def on(self) -> bool: ...

    def send(self, rows: Sequence[Mapping[str, Any]]) -> SendSpan: ...

    def process(
        self, envelope: Mapping[str, Any], handler: str, delivery: int, stream_wait_ms: float | None
    ) -> ProcessSpan: ...

    async def shutdown(self) -> None: ...


class _NoSpan:
    """Every span of the OFF tracer: does nothing."""

    def end(self, *args: Any, **kwargs: Any) -> None:
        return None

    def headers(self) -> dict[str, str]:
        return {}

    def http(self, method: str, url: str) -> _NoSpan:
        return self

    def settle(self, operation: str) -> _NoSpan:
        return self


_NO_SPAN = _NoSpan()


class Off:
    """Tracing off: no span, no import, no cost beyond reading `on`."""

    on = False

    def send(self, rows: Sequence[Mapping[str, Any]]) -> SendSpan:
        return _NO_SPAN

    def process(
        self, envelope: Mapping[str, Any], handler: str, delivery: int, stream_wait_ms: float | None
    ) -> ProcessSpan:
        return _NO_SPAN

    async def shutdown(self) -> None:
        return None


OFF = Off()


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the OTEL_* variables ask for traces: any OTEL_* variable set
    (non-empty), unless the SDK is disabled or the traces exporter is none."""
    env = os.environ if environ is None else environ
    if not any(k.startswith("OTEL_") and v.strip() for k, v in env.items()):
        return False
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()}
    return exporters != {"none"}


def from_environment(service: str, environ: Mapping[str, str] | None = None) -> Tracer:
    """OFF, or the SDK's tracer configured by the OTEL_* variables (service:
    the default service.name). TracingUnavailable when the SDK is missing,
    TracingMisconfigured for a setting it cannot honour: start-up errors."""
    env = os.environ if environ is None else environ
    if not wanted(env):
        return OFF
    try:
        from pgoutbox.core import otel  # only here: the SDK is imported when traces are wanted
    except ImportError as exc:
        raise TracingUnavailable(
            f"OTEL_* variables are set but the OpenTelemetry SDK cannot be imported ({exc.name or exc}): "
            + INSTALL_HINT
        ) from None
    tracer = otel.OtelTracer.build(service, env)
    log.info(
        "traces on: %s",
        tracer.describe,
        extra={"action": "tracing", "service": tracer.service, "exporters": tracer.exporters},
    )
    return tracer


def current_traceparent(context: Any = None) -> dict[str, str]:
    """The W3C trace context of the current OpenTelemetry span (or of
    `context`, an opentelemetry Context), as `outbox.emit` headers:
    {"traceparent": ..., "tracestate": ...} (tracestate only when not empty).
    A sampled-out span propagates too (flags 00), so that the trace stays
    one. Empty when there is no valid span, or opentelemetry-api is not
    installed. Needs only opentelemetry-api (no SDK)."""
    try:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return {}
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return carrier
