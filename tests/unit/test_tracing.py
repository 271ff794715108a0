"""Tracing's switch and its off path (no server): when the OTEL_* variables
turn traces on, what a missing SDK or an unsupported setting does, the OFF
objects, the helper applications call, and the trace headers of a handler call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from pgoutbox import tracing as public
from pgoutbox.core import tracing
from pgoutbox.core.errors import TracingMisconfigured
from pgoutbox.inbox.handler_client import _header_lines

ENVELOPE = {
    "message_id": "0f8c2a4e-7d1b-4c3a-9e5f-1a2b3c4d5e6f",
    "trace": {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
}


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"PATH": "/bin", "OUTBOX_NATS_URL": "nats://x"}, False),
        ({"OTEL_SERVICE_NAME": ""}, False),  # set but empty: as unset
        ({"OTEL_SERVICE_NAME": "shop"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "TRUE"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ],
)
def test_traces_are_on_when_an_otel_variable_is_set_unless_the_sdk_or_the_traces_exporter_is_switched_off(environ, on):
    assert tracing.wanted(environ) is on
    if not on:
        assert tracing.from_environment("pgoutbox-relay", environ) is tracing.OFF


def test_the_off_tracer_imports_nothing_of_opentelemetry():
    probe = textwrap.dedent(
        """
        import sys
        from pgoutbox.core import tracing
        from pgoutbox.outbox import relay
        from pgoutbox.inbox import consumer
        assert tracing.from_environment("pgoutbox-relay") is tracing.OFF
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry") or m == "pgoutbox.core.otel"))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_otel_variables_without_the_sdk_stop_the_relay_with_one_line_naming_the_extra():
    # sys.modules[name] = None makes `import name` fail as if not installed.
    probe = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry.sdk"] = None
        from pgoutbox.cli.main import main
        sys.exit(main(["relay"]))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OUTBOX_", "PG"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OUTBOX_DATABASE_URL="postgresql://nobody@127.0.0.1:9/x"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("pgoutbox relay: TracingUnavailable [OTEL_SDK_MISSING]: ")
    assert "pgoutbox[otel]" in lines[0]


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_TRACES_EXPORTER": "jaeger"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
    ],
)
def test_an_exporter_or_protocol_pgoutbox_does_not_do_is_refused_at_start_up(environ):
    with pytest.raises(TracingMisconfigured) as refused:
        tracing.from_environment("pgoutbox-relay", environ)
    assert refused.value.code == "OTEL_UNSUPPORTED"


def test_the_off_spans_do_nothing_and_send_no_trace_headers():
    off = tracing.OFF
    assert off.on is False
    off.send([{"event_id": "x", "subject": "s"}]).end(["NO_STREAM"])
    process = off.process(ENVELOPE, "billing", 1, None)
    http = process.http("POST", "http://h/")
    assert http.headers() == {}
    http.end(200, None)
    process.settle("ack").end()
    process.end("processed")


def test_current_traceparent_gives_the_current_span_as_emit_headers():
    tracer = TracerProvider().get_tracer("app")
    with tracer.start_as_current_span("place order") as span:
        ctx = span.get_span_context()
        headers = public.current_traceparent()
    # The flags: sampled (01), plus W3C level 2's random trace id (02) for an SDK that sets it.
    assert ctx.trace_flags & 1 == 1
    assert headers == {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}
    assert public.current_traceparent() == {}, "outside any span: nothing to pass"


def test_current_traceparent_propagates_a_sampled_out_span_and_the_tracestate():
    tracer = TracerProvider(sampler=ALWAYS_OFF).get_tracer("app")
    with tracer.start_as_current_span("not sampled") as span:
        ctx = span.get_span_context()
        assert ctx.is_valid and ctx.trace_flags & 1 == 0
        headers = public.current_traceparent()
    assert headers == {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}
    remote = SpanContext(
        0xA, 0xB, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=TraceState([("shop", "1")])
    )
    assert public.current_traceparent(trace.set_span_in_context(NonRecordingSpan(remote))) == {
        "traceparent": f"00-{0xA:032x}-{0xB:016x}-01",
        "tracestate": "shop=1",
    }


def test_a_handler_call_sends_the_envelopes_trace_context_unless_given_its_own():
    own = {"traceparent": "00-" + "a" * 32 + "-" + "c" * 16 + "-01"}
    assert f"traceparent: {ENVELOPE['trace']['traceparent']}\r\n".encode() in _header_lines(ENVELOPE, "billing", 1)
    lines = _header_lines(ENVELOPE, "billing", 1, trace=own)
    assert f"traceparent: {own['traceparent']}\r\n".encode() in lines
    assert ENVELOPE["trace"]["traceparent"].encode() not in lines


@pytest.mark.parametrize(
    "traceparent",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03",
        " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 ",
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-comes-later",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-more",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "garbage",
    ],
)
def test_the_relays_traceparent_parser_accepts_what_the_sdks_propagator_accepts(traceparent):
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from pgoutbox.core.otel import span_context

    theirs = trace.get_current_span(TraceContextTextMapPropagator().extract({"traceparent": traceparent}))
    expected = theirs.get_span_context()
    ours = span_context(traceparent, "shop=1")
    if not expected.is_valid:
        assert ours is None
    else:
        assert ours is not None
        assert (ours.trace_id, ours.span_id, ours.trace_flags, ours.is_remote) == (
            expected.trace_id,
            expected.span_id,
            expected.trace_flags,
            True,
        )
        assert ours.trace_state.to_header() == "shop=1"


@pytest.mark.parametrize("sampled", [True, False])
def test_the_handler_calls_trace_headers_are_what_the_sdks_propagator_writes(sampled):
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from pgoutbox.core.otel import OtelTracer

    provider = TracerProvider(sampler=ALWAYS_ON if sampled else ALWAYS_OFF)
    tracer = OtelTracer(provider, "pgoutbox-consumer", [])
    flags = "01" if sampled else "00"
    envelope = {
        **ENVELOPE,
        "subject": "sea.event.order_created.v1",
        "trace": {"traceparent": f"00-{'a' * 32}-{'b' * 16}-{flags}", "tracestate": "shop=1,vendor=x"},
    }
    http = tracer.process(envelope, "billing", 1, None).http("POST", "https://handler.example/events")
    expected: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(expected, context=trace.set_span_in_context(http.span))
    assert http.headers() == expected
    assert expected["tracestate"] == "shop=1,vendor=x" and expected["traceparent"].startswith(f"00-{'a' * 32}-")


def test_a_send_span_that_cannot_start_leaves_the_batch_untraced(monkeypatch, caplog):
    from pgoutbox.core.otel import OtelTracer

    tracer = OtelTracer(TracerProvider(), "pgoutbox-relay", [])

    def broken(*args, **kwargs):
        raise ValueError("an attribute the SDK chokes on")

    monkeypatch.setattr(tracer.tracer, "start_span", broken)
    tracer.send([{"event_id": "e1", "subject": "sea.event.order_created.v1", "headers": "{}"}]).end(["NO_STREAM"])
    assert [r.action for r in caplog.records] == ["tracing_error"]
