"""The consumer's flow (pgoutbox.inbox.flow.MessageFlow) without a server:
what it does with each delivery of a fetch, decided from the inbox row and
the handler's answer, on the in-memory fakes of tests/unit/fakes.py (the
inbox, the handler client, the NATS connection that carries acks and naks,
JetStream for DLQ notices). Settings are the defaults. The server tiers
(tests/inbox/) check the same decisions end to end."""

from __future__ import annotations

import asyncio
import json

import psycopg
import psycopg.errors
import pytest
from fakes import FakeHandlerClient, FakeInbox, FakeInboxRow, FakeJetStream, FakeNats, answers, delivery
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pgoutbox.core import settings, tracing
from pgoutbox.core.otel import OtelTracer
from pgoutbox.inbox import registry
from pgoutbox.inbox import settings as consumer_settings
from pgoutbox.inbox.database_gate import DatabaseGate
from pgoutbox.inbox.flow import MessageFlow
from pgoutbox.inbox.metrics import ConsumerMetrics
from support.waiting import until

CONFIG = settings.build(
    consumer_settings.ConsumerConfig,
    environ={},
    overrides={"database_url": "postgresql://fake@127.0.0.1:1/fake", "nats_url": "nats://127.0.0.1:1"},
)
SPEC = registry.HandlerSpec(
    name="billing",
    url="http://127.0.0.1:1/events",
    context="sea",
    stream="SEA_EVENTS",
    subjects=("sea.event.order_created.v1",),
)
HANDLER = consumer_settings.resolve(SPEC, CONFIG)


class Flow:
    """A MessageFlow on fakes, and what it reported for each message."""

    def __init__(self, client: FakeHandlerClient, inbox: FakeInbox | None = None, tracer=tracing.OFF):
        self.inbox = inbox or FakeInbox()
        self.client, self.nc, self.js = client, FakeNats(), FakeJetStream()
        self.outcomes: dict[str, object] = {}
        self.flow = MessageFlow(
            inbox=self.inbox,  # type: ignore[arg-type]
            client=self.client,  # type: ignore[arg-type]
            nc=self.nc,
            js=self.js,
            metrics=ConsumerMetrics(),
            retry_backoff=consumer_settings.retry_backoff(CONFIG),
            replay_backoff=consumer_settings.replay_backoff(CONFIG),
            stopping=asyncio.Event(),
            gate=DatabaseGate(self.inbox.schema_version),
            tracer=tracer,
        )

    async def fetch(self, *msgs) -> None:
        await self.flow.handle_fetch(
            list(msgs), HANDLER, lambda msg, outcome: self.outcomes.__setitem__(msg.reply, outcome)
        )

    def message_id(self, msg) -> str:
        return msg.headers["Nats-Msg-Id"]


async def test_a_processed_answer_settles_the_row_then_acks():
    f = Flow(FakeHandlerClient(200))
    msg = delivery(f.nc)
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "processed"
    assert f.inbox.row(f.message_id(msg), "billing").status == "PROCESSED"
    assert answers(f.nc, msg) == [b""]  # one ack
    assert f.inbox.calls == ["receive_batch", "settle"]


async def test_a_failure_below_max_deliver_records_it_and_naks_with_a_delay():
    f = Flow(FakeHandlerClient(503))
    msg = delivery(f.nc)
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "retried"
    row = f.inbox.row(f.message_id(msg), "billing")
    assert (row.status, row.failures, row.last_error) == ("FAILED", 1, "HTTP 503: fake")
    (nak,) = answers(f.nc, msg)
    assert nak.startswith(b"-NAK") and json.loads(nak[len(b"-NAK") :])["delay"] > 0
    assert f.js.published == []


async def test_the_failure_that_reaches_max_deliver_dead_letters_with_a_notice_then_acks():
    f = Flow(FakeHandlerClient(503))
    msg = delivery(f.nc, delivered=HANDLER.max_deliver)
    message_id = f.message_id(msg)
    failed = HANDLER.max_deliver - 1  # the handler failed every earlier delivery
    f.inbox.rows[(message_id, "billing")] = FakeInboxRow(status="FAILED", attempts=failed, failures=failed)
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "dead_lettered"
    row = f.inbox.row(message_id, "billing")
    assert row.status == "DEAD_LETTER" and row.last_error.startswith(f"max_deliver ({HANDLER.max_deliver}) reached")
    ((subject, _, _),) = f.js.published  # the notice, before the row and the ack
    assert subject.startswith("sea.dlq.")
    assert answers(f.nc, msg) == [b""]
    # then the notice's place, after the dead letter: (stream, seq) of its PubAck
    assert row.notice == ("SEA_DLQ", 1)
    assert f.inbox.calls[-2:] == ["record_error", "record_dlq_notice"]


async def test_a_notice_that_cannot_be_recorded_costs_only_its_place_never_the_dead_letter():
    f = Flow(FakeHandlerClient(422))
    msg = delivery(f.nc)

    async def refuse(*_: object) -> bool:
        raise RuntimeError("an unexpected refusal")

    f.inbox.record_dlq_notice = refuse  # type: ignore[method-assign]
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "dead_lettered"
    row = f.inbox.row(f.message_id(msg), "billing")
    assert row.status == "DEAD_LETTER" and row.notice is None
    assert answers(f.nc, msg) == [b""]


async def test_a_422_dead_letters_at_the_first_answer():
    f = Flow(FakeHandlerClient(422))
    msg = delivery(f.nc)
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "dead_lettered"
    assert f.inbox.row(f.message_id(msg), "billing").status == "DEAD_LETTER"
    assert len(f.js.published) == 1


@pytest.mark.parametrize(("status", "outcome"), [("PROCESSED", "duplicate"), ("DEAD_LETTER", "parked")])
async def test_a_settled_row_is_acked_without_calling_the_handler(status, outcome):
    f = Flow(FakeHandlerClient(200))
    msg = delivery(f.nc, delivered=2)
    f.inbox.rows[(f.message_id(msg), "billing")] = FakeInboxRow(status=status)
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == outcome
    assert f.client.calls == [] and answers(f.nc, msg) == [b""]


async def test_the_database_gate_holds_the_message_until_postgresql_is_back():
    inbox = FakeInbox(down=3)  # the receive, then two probes, find PostgreSQL away
    f = Flow(FakeHandlerClient(200), inbox)
    msg = delivery(f.nc)
    fetch = asyncio.create_task(f.fetch(msg))
    await until(lambda: not f.flow.gate.is_up, 5, "the gate closed")
    assert f.client.calls == [] and answers(f.nc, msg) == []  # held: neither called nor answered
    await asyncio.wait_for(fetch, 10)
    assert f.flow.gate.is_up
    assert f.outcomes[msg.reply] == "processed" and len(f.client.calls) == 1
    assert answers(f.nc, msg) == [b""]
    assert inbox.calls.count("receive_batch") == 2  # the held call ran again once the probe passed


# -- traced (tracing on, spans kept in memory) -----------------------------------


def _traced_flow(client: FakeHandlerClient) -> tuple[Flow, InMemorySpanExporter]:
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return Flow(client, tracer=OtelTracer(provider, "pgoutbox-consumer", [])), exported


async def test_traced_a_processed_message_has_a_process_span_with_post_and_settle_children_and_the_handler_gets_posts_traceparent():
    f, exported = _traced_flow(FakeHandlerClient(200))
    creation = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    msg = delivery(f.nc, headers=json.dumps({"traceparent": creation}))
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "processed" and answers(f.nc, msg) == [b""]
    spans = {s.name: s for s in exported.get_finished_spans()}
    process, post, settle = (
        spans["process sea.event.order_created.v1"],
        spans["POST"],
        spans["settle sea.event.order_created.v1"],
    )
    # the creation context: the traceparent fakes.event_row emits
    assert f"{process.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert f"{process.parent.span_id:016x}" == "b7ad6b7169203331"
    assert post.parent.span_id == settle.parent.span_id == process.context.span_id
    assert settle.attributes["messaging.operation.name"] == "ack"
    assert process.attributes["pgoutbox.outcome"] == "processed" and process.attributes["pgoutbox.stream.wait_ms"] >= 0
    assert process.status.status_code is StatusCode.UNSET
    (sent,) = f.client.traces
    assert sent == {"traceparent": f"00-{post.context.trace_id:032x}-{post.context.span_id:016x}-01"}


@pytest.mark.parametrize(
    ("status", "operation", "outcome"), [(503, "nak", "retried"), (422, "dead_letter", "dead_lettered")]
)
async def test_traced_a_failed_answer_marks_the_post_and_process_spans_as_errors(status, operation, outcome):
    f, exported = _traced_flow(FakeHandlerClient(status))
    msg = delivery(f.nc)
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == outcome
    spans = {s.name: s for s in exported.get_finished_spans()}
    post, process = spans["POST"], spans["process sea.event.order_created.v1"]
    assert post.attributes["http.response.status_code"] == status and post.attributes["error.type"] == str(status)
    assert spans["settle sea.event.order_created.v1"].attributes["messaging.operation.name"] == operation
    assert process.attributes["error.type"] == outcome and process.status.status_code is StatusCode.ERROR


async def test_traced_a_settled_row_gets_no_span():
    f, exported = _traced_flow(FakeHandlerClient(200))
    msg = delivery(f.nc, delivered=2)
    f.inbox.rows[(f.message_id(msg), "billing")] = FakeInboxRow(status="PROCESSED")
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "duplicate" and exported.get_finished_spans() == ()


async def test_traced_a_span_that_cannot_start_leaves_the_message_untraced_not_stuck(monkeypatch):
    f, exported = _traced_flow(FakeHandlerClient(200))

    def broken(*args, **kwargs):
        raise ValueError("an attribute the SDK chokes on")

    monkeypatch.setattr(f.flow.tracing.tracer, "start_span", broken)
    msg = delivery(f.nc)
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "processed" and answers(f.nc, msg) == [b""]
    assert f.client.traces == [None], "the handler gets the message's own trace context"
    assert exported.get_finished_spans() == ()


async def test_a_cloudevents_handler_declaring_a_version_gets_the_upcast_payload_under_that_versions_type():
    """The derived ce-type names the version the handler is given, not the one the message came in at."""
    spec = registry.HandlerSpec(
        name="billing",
        url="http://127.0.0.1:1/events",
        context="sea",
        stream="SEA_EVENTS",
        subjects=("sea.event.order_created.v1", "sea.event.order_created.v2"),
        version=2,
        format="cloudevents",
    )
    f = Flow(FakeHandlerClient(200))
    old = delivery(f.nc, seq=1)
    new = delivery(
        f.nc,
        seq=2,
        event_id="0b0e9a8e-3c55-4c1f-9d3f-5f3c1a2b4c5d",
        event_version=2,
        subject="sea.event.order_created.v2",
    )
    f.inbox.upcasts[f.message_id(old)] = '{"schema_version": 2}'
    await f.flow.handle_fetch([old, new], consumer_settings.resolve(spec, CONFIG), lambda msg, outcome: None)
    assert [c["type"] for c in f.client.cloudevents] == ["sea.order_created.v2", "sea.order_created.v2"]
    assert json.loads(f.client.bodies[0]) == {"schema_version": 2}  # the payload alone, upcast


def _server_error(cls: type[psycopg.Error], state: str, text: str) -> psycopg.Error:
    exc = cls(text)
    exc.sqlstate = state
    return exc


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (psycopg.errors.AssertFailure("n must not be 3"), "[P0004] n must not be 3"),
        (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), "[57014] canceling"),
        (_server_error(psycopg.DatabaseError, "AB123", "custom"), "[AB123] custom"),
    ],
)
async def test_an_upcast_that_raises_out_of_the_call_is_that_messages_own_dead_letter(error, shown):
    """What a schema before 18 lets escape (an ASSERT), or any statement error
    of one message's upcast: the fetch goes message by message, the one whose
    upcast raises is received without it and dead-lettered UPCAST_FAILED with
    the error's code and text; the other is processed; the gate stays open."""
    spec = registry.HandlerSpec(
        name="billing",
        url="http://127.0.0.1:1/events",
        context="sea",
        stream="SEA_EVENTS",
        subjects=("sea.event.order_created.v1",),
        version=2,
    )
    f = Flow(FakeHandlerClient(200))
    good, bad = delivery(f.nc, seq=1), delivery(f.nc, seq=2, event_id="0b0e9a8e-3c55-4c1f-9d3f-5f3c1a2b4c5d")
    f.inbox.upcasts[f.message_id(good)] = '{"schema_version": 2}'
    f.inbox.upcast_raises[f.message_id(bad)] = error
    outcomes: dict[str, object] = {}
    await f.flow.handle_fetch(
        [good, bad], consumer_settings.resolve(spec, CONFIG), lambda msg, o: outcomes.__setitem__(msg.reply, o)
    )
    assert outcomes == {good.reply: "processed", bad.reply: "dead_lettered"}
    row = f.inbox.row(f.message_id(bad), "billing")
    assert row.status == "DEAD_LETTER"
    assert row.last_error.startswith(f"UPCAST_FAILED [OB072]: order_created v1 -> v2: {shown}"), row.last_error
    assert f.flow.gate.is_up
    assert answers(f.nc, good) == [b""] and answers(f.nc, bad) == [b""]
    assert len(f.js.published) == 1  # the dead letter's notice


async def test_a_clash_with_a_concurrent_transaction_runs_the_call_again_with_the_gate_open():
    inbox = FakeInbox(clashes=2)
    f = Flow(FakeHandlerClient(200), inbox)
    msg = delivery(f.nc)
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "processed" and f.flow.gate.is_up
    assert inbox.calls.count("receive_batch") == 3, inbox.calls
