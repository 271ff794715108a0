"""Traces from emit to handler, exported by a real relay and a real consumer
(`python -m pgoutbox.cli.main relay|consume`, as least-privileged logins, on
the defaults plus OTEL_* variables) to an OTLP/HTTP receiver started here
(support.otlp decodes the protobuf requests); and, with tracing off,
nothing exported and nothing of opentelemetry imported by either worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from harness.otlp import OtlpReceiver, Span
from support.inbox import write_registry
from support.outbox import apply_streams
from support.roles import login
from support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
H = "billing"
SUBJECT = "sea.event.order_created.v1"
CLIENT, PRODUCER, CONSUMER = 3, 4, 5  # opentelemetry.proto.trace.v1.Span.SpanKind
ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR


def _trace(n: int) -> tuple[str, str, str]:
    """(trace id, span id, traceparent) of an application span, made up and sampled."""
    trace_id, span_id = f"{n:032x}", f"{n + 100:016x}"
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _emit(url: str, traceparents: list[str]) -> list[str]:
    """Emits one event per traceparent, in one transaction, as a pgoutbox_writer login."""
    with psycopg.connect(url) as conn:
        return [
            str(
                conn.execute(
                    "SELECT outbox.emit('order', %s, 'order_created', %s, context => 'sea', headers => %s)",
                    (str(i), Jsonb({"schema_version": 1, "n": i}), Jsonb({"traceparent": tp})),
                ).fetchone()[0]
            )
            for i, tp in enumerate(traceparents)
        ]


class Worker:
    """A `pgoutbox relay|consume` subprocess with the given OUTBOX_*/OTEL_* variables
    (none else from the test's environment), output to a log file."""

    def __init__(self, tmp_path: Path, command: str, env: dict[str, str], python_flags: tuple[str, ...] = ()):
        self.log = tmp_path / f"{command}.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "OTEL_"))}
        self._out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, *python_flags, "-m", "pgoutbox.cli.main", command],
            env={**clean, **env},
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def output(self) -> str:
        return self.log.read_text()

    def wait_for_line(self, text: str) -> None:
        def seen():
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
            return text in self.output()

        wait_for(seen, 30, f"{text} in {self.log}")

    def stop(self) -> int:
        """SIGTERM: the worker drains, flushes its spans and exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            self._out.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()


def _workers(tmp_path, database_url, nats_server, handler, otel: dict[str, str], python_flags=()):
    registry = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    relay = Worker(
        tmp_path,
        "relay",
        {
            "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_relay"),
            "OUTBOX_NATS_URL": nats_server.url,
            "OUTBOX_RELAY_HTTP_PORT": "0",  # the default port is fixed: tests run side by side
            **otel,
        },
        python_flags,
    )
    consumer = Worker(
        tmp_path,
        "consume",
        {
            "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_consumer"),
            "OUTBOX_NATS_URL": nats_server.url,
            "OUTBOX_REGISTRY_FILE": str(registry),
            "OUTBOX_CONSUMER_HTTP_PORT": "0",
            **otel,
        },
        python_flags,
    )
    return relay, consumer


def _one(spans: list[Span], **match) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one span with {match}, got {found}"
    return found[0]


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


async def test_relay_and_consumer_export_send_process_http_and_settle_spans_joined_to_the_emit_trace(
    tmp_path, database_url, nats_server, handler, receiver
):
    await apply_streams(nats_server.url)
    writer = login(database_url, "pgoutbox_writer")
    (ta, sa, tpa), (tb, sb, tpb), (tc, sc, tpc) = _trace(0xA), _trace(0xB), _trace(0xC)
    # Two events committed before the relay starts: one claim, one batch.
    id_a, id_b = _emit(writer, [tpa, tpb])
    relay, consumer = _workers(
        tmp_path, database_url, nats_server, handler, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    )
    try:
        relay.wait_for_line('"action": "started"')
        consumer.wait_for_line("consumer started")
        wait_for(lambda: len(handler.calls) == 2, 30, "the batch's two events at the handler")
        # Then one event alone: a batch of one.
        (id_c,) = _emit(writer, [tpc])
        wait_for(lambda: len(handler.calls) == 3, 30, "the third event at the handler")
        assert relay.stop() == 0, relay.output()[-3000:]
        assert consumer.stop() == 0, consumer.output()[-3000:]
    finally:
        relay.kill()
        consumer.kill()
    for worker in (relay, consumer):
        entries = [json.loads(line) for line in worker.output().splitlines() if line.startswith("{")]
        assert any(e.get("action") == "tracing" for e in entries), "a start-up line says traces are on"

    # The relay: stopped workers have flushed everything they held.
    sends = receiver.of("pgoutbox-relay")
    assert len(sends) == 2, sends
    assert all(s.kind == PRODUCER and s.name == f"send {SUBJECT}" for s in sends)
    for s in sends:
        assert s.attributes["messaging.system"] == "nats"
        assert s.attributes["messaging.destination.name"] == SUBJECT
        assert s.attributes["messaging.operation.type"] == "send"
        assert s.attributes["messaging.operation.name"] == "publish"
        assert s.attributes["pgoutbox.outbox.wait_ms"] >= 0
        assert s.status_code != ERROR and "error.type" not in s.attributes
    batch = _one(sends, parent_span_id="")
    assert batch.attributes["messaging.batch.message_count"] == 2
    assert "messaging.message.id" not in batch.attributes
    assert batch.trace_id not in (ta, tb), "a batch of several starts its own trace"
    assert {(t, s) for t, s, _ in batch.links} == {(ta, sa), (tb, sb)}
    by_link = {t: attrs for t, _, attrs in batch.links}
    assert by_link[ta]["messaging.message.id"] == id_a and by_link[tb]["messaging.message.id"] == id_b
    assert all(attrs["pgoutbox.outbox.wait_ms"] >= 0 for attrs in by_link.values())
    alone = _one(sends, trace_id=tc)
    assert alone.parent_span_id == sc, "a batch of one event is the child of its creation context"
    assert alone.links == [] and alone.attributes["messaging.message.id"] == id_c
    assert "messaging.batch.message_count" not in alone.attributes

    # The consumer: per message, process (CONSUMER, child of the creation
    # context) > POST (CLIENT) and settle (CLIENT).
    spans = receiver.of("pgoutbox-consumer")
    assert len(spans) == 9, spans
    for event_id, (trace_id, span_id, _) in ((id_a, _trace(0xA)), (id_b, _trace(0xB)), (id_c, _trace(0xC))):
        process = _one(spans, trace_id=trace_id, kind=CONSUMER)
        assert process.name == f"process {SUBJECT}"
        assert process.parent_span_id == span_id
        assert process.attributes["messaging.system"] == "nats"
        assert process.attributes["messaging.destination.name"] == SUBJECT
        assert process.attributes["messaging.message.id"] == event_id
        assert process.attributes["messaging.operation.type"] == "process"
        assert process.attributes["messaging.consumer.group.name"] == H
        assert process.attributes["pgoutbox.outcome"] == "processed"
        assert process.attributes["pgoutbox.stream.wait_ms"] >= 0
        assert process.status_code != ERROR
        post = _one(spans, trace_id=trace_id, kind=CLIENT, name="POST")
        assert post.parent_span_id == process.span_id
        assert post.attributes["http.request.method"] == "POST"
        assert post.attributes["url.full"] == handler.url
        assert post.attributes["http.response.status_code"] == 200
        settle = _one(spans, trace_id=trace_id, kind=CLIENT, name=f"settle {SUBJECT}")
        assert settle.parent_span_id == process.span_id
        assert settle.attributes["messaging.operation.type"] == "settle"
        assert settle.attributes["messaging.operation.name"] == "ack"
        assert settle.attributes["messaging.message.id"] == event_id
        # The handler's traceparent continues the trace from the HTTP call's span.
        (call,) = handler.calls_for(event_id)
        assert call.headers["traceparent"] == f"00-{trace_id}-{post.span_id}-01"


@pytest.mark.parametrize(
    "otel",
    [
        pytest.param({}, id="no OTEL_ variable"),
        pytest.param({"OTEL_SDK_DISABLED": "true"}, id="OTEL_SDK_DISABLED"),
        pytest.param({"OTEL_TRACES_EXPORTER": "none"}, id="OTEL_TRACES_EXPORTER none"),
    ],
)
async def test_with_tracing_off_nothing_is_exported_nothing_of_opentelemetry_imported_and_the_handler_gets_the_emitted_traceparent(
    tmp_path, database_url, nats_server, handler, receiver, otel
):
    await apply_streams(nats_server.url)
    # Where tracing is off by a variable, the endpoint is set too: only the switch keeps spans from it.
    env = {**otel, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint} if otel else {}
    # -X importtime: the interpreter writes a line for every module imported,
    # whenever it is (lazy imports included), to the worker's log.
    relay, consumer = _workers(tmp_path, database_url, nats_server, handler, env, ("-X", "importtime"))
    _, _, traceparent = _trace(0xD)
    try:
        relay.wait_for_line('"action": "started"')
        consumer.wait_for_line("consumer started")
        (event_id,) = _emit(login(database_url, "pgoutbox_writer"), [traceparent])
        wait_for(lambda: handler.calls_for(event_id), 30, "the event at the handler")
        assert relay.stop() == 0, relay.output()[-3000:]
        assert consumer.stop() == 0, consumer.output()[-3000:]
    finally:
        relay.kill()
        consumer.kill()
    assert handler.calls_for(event_id)[0].headers["traceparent"] == traceparent
    assert receiver.requests == 0
    for worker, module in ((relay, "pgoutbox.outbox.relay"), (consumer, "pgoutbox.inbox.consumer")):
        imported = [line.rsplit("|", 1)[1].strip() for line in worker.output().splitlines() if "import time:" in line]
        assert module in imported and "pgoutbox.core.tracing" in imported, "the probe sees the workers' imports"
        assert not [m for m in imported if m.startswith("opentelemetry") or m == "pgoutbox.core.otel"]
