"""The consumer's flow for a handler of format "batch", without a server, on
the in-memory fakes of tests/unit/fakes.py: one request for the fetch; the
processed and failed outcomes of the batch settled in one inbox.settle, each
message acked (or nakked) only after it; a dead letter its own notice first;
an away answer for the batch sends every message back with no failure
counted; a failed call of the batch is each message's own dead letter."""

from __future__ import annotations

import asyncio
import json

from fakes import FakeHandlerClient, FakeInbox, FakeInboxRow, FakeJetStream, FakeNats, answers, delivery

from pgoutbox.core import settings
from pgoutbox.inbox import registry
from pgoutbox.inbox import settings as consumer_settings
from pgoutbox.inbox.database_gate import DatabaseGate
from pgoutbox.inbox.flow import MessageFlow
from pgoutbox.inbox.gates import HandlerGate
from pgoutbox.inbox.handler_client import HandlerAnswer
from pgoutbox.inbox.metrics import ConsumerMetrics

CONFIG = settings.build(
    consumer_settings.ConsumerConfig,
    environ={},
    overrides={"database_url": "postgresql://fake@127.0.0.1:1/fake", "nats_url": "nats://127.0.0.1:1"},
)
SPEC = registry.HandlerSpec(
    name="billing",
    url="http://127.0.0.1:1/batch",
    context="sea",
    stream="SEA_EVENTS",
    subjects=("sea.event.order_created.v1",),
    format="batch",
)
HANDLER = consumer_settings.resolve(SPEC, CONFIG)


class BatchClient(FakeHandlerClient):
    """HandlerClient.call_batch: a result per message from `statuses` (message id ->
    status, 200 when absent), or `whole` for the batch; each request recorded."""

    def __init__(self, whole: HandlerAnswer | None = None, fail: Exception | None = None) -> None:
        super().__init__()
        self.results: dict[str, int] = {}
        self.whole, self.fail = whole, fail
        self.requests: list[list[str]] = []

    async def call_batch(self, url, body, *, handler, count, timeout, keep):
        ids = [m["envelope"]["message_id"] for m in json.loads(body)["messages"]]
        assert count == len(ids)
        self.requests.append(ids)
        if self.fail is not None:
            raise self.fail
        if self.whole is not None:
            return self.whole, b""
        results = [{"message_id": m, "status": self.results.get(m, 200), "error": "fake"} for m in ids]
        return HandlerAnswer(200, None, None, 0.001), json.dumps({"results": results}).encode()


class Flow:
    def __init__(self, client: BatchClient, gated: bool = False):
        self.inbox, self.client, self.nc, self.js = FakeInbox(), client, FakeNats(), FakeJetStream()
        self.outcomes: dict[str, object] = {}
        stopping = asyncio.Event()
        self.gates = {"billing": HandlerGate("billing", stopping=stopping)} if gated else {}
        self.flow = MessageFlow(
            inbox=self.inbox,  # type: ignore[arg-type]
            client=self.client,  # type: ignore[arg-type]
            nc=self.nc,
            js=self.js,
            metrics=ConsumerMetrics(),
            retry_backoff=consumer_settings.retry_backoff(CONFIG),
            replay_backoff=consumer_settings.replay_backoff(CONFIG),
            stopping=stopping,
            gate=DatabaseGate(self.inbox.schema_version),
            handler_gates=self.gates,
        )

    async def fetch(self, *msgs) -> None:
        await self.flow.handle_fetch(
            list(msgs), HANDLER, lambda msg, outcome: self.outcomes.__setitem__(msg.reply, outcome)
        )


def _id(msg) -> str:
    return msg.headers["Nats-Msg-Id"]


async def test_one_request_for_the_fetch_and_one_settle_for_its_processed_and_failed_outcomes():
    client = BatchClient()
    f = Flow(client)
    msgs = [delivery(f.nc, seq=i) for i in range(1, 6)]
    client.results = {_id(msgs[2]): 500, _id(msgs[3]): 422}
    settle = f.inbox.settle
    replies_at_settle: list[int] = []

    async def watched(*args):
        settled = [m for i, m in enumerate(msgs) if i != 3]  # the dead letter goes its own way
        replies_at_settle.append(sum(len(answers(f.nc, m)) for m in settled))
        return await settle(*args)

    f.inbox.settle = watched  # type: ignore[method-assign]
    await f.fetch(*msgs)
    assert client.requests == [[_id(m) for m in msgs]]  # one request, in fetch order
    assert client.calls == []  # no single-message call
    assert [f.outcomes[m.reply] for m in msgs] == ["processed", "processed", "retried", "dead_lettered", "processed"]
    assert f.inbox.calls.count("settle") == 1 and f.inbox.calls.count("receive_batch") == 1
    assert replies_at_settle == [0]  # nothing acked or nakked before the outcomes committed
    assert [f.inbox.row(_id(m), "billing").status for m in msgs] == [
        "PROCESSED",
        "PROCESSED",
        "FAILED",
        "DEAD_LETTER",
        "PROCESSED",
    ]
    assert f.inbox.row(_id(msgs[2]), "billing").last_error == "HTTP 500: fake"
    assert f.inbox.row(_id(msgs[3]), "billing").last_error == "HTTP 422: fake"
    assert answers(f.nc, msgs[2])[0].startswith(b"-NAK")
    assert [answers(f.nc, m) for m in (msgs[0], msgs[3])] == [[b""], [b""]]
    ((subject, _, headers),) = f.js.published  # the dead letter's notice, its own
    assert subject.startswith("sea.dlq.") and _id(msgs[3]) in headers["Nats-Msg-Id"]


async def test_a_batch_answered_503_goes_back_whole_counting_no_failure():
    f = Flow(BatchClient(whole=HandlerAnswer(503, None, None, 0.001, "busy")), gated=True)
    msgs = [delivery(f.nc, seq=i) for i in range(1, 4)]
    await f.fetch(*msgs)
    assert [f.outcomes[m.reply] for m in msgs] == ["deferred"] * 3
    for m in msgs:
        row = f.inbox.row(_id(m), "billing")
        assert (row.status, row.failures) == ("RECEIVED", 0)
        assert answers(f.nc, m)[0].startswith(b"-NAK")
    assert "settle" not in f.inbox.calls and f.js.published == []
    assert not f.gates["billing"].is_up  # the handler is away: fetching waits for a probe


async def test_a_call_that_raises_is_each_messages_own_dead_letter():
    f = Flow(BatchClient(fail=RuntimeError("a defect")))
    msgs = [delivery(f.nc, seq=i) for i in range(1, 3)]
    await f.fetch(*msgs)
    assert [f.outcomes[m.reply] for m in msgs] == ["dead_lettered"] * 2
    for m in msgs:
        assert f.inbox.row(_id(m), "billing").last_error.startswith("CONSUMER_ERROR: RuntimeError: a defect")


async def test_a_duplicate_is_acked_and_left_out_of_the_request():
    client = BatchClient()
    f = Flow(client)
    done, fresh = delivery(f.nc, seq=1), delivery(f.nc, seq=2)
    f.inbox.rows[(_id(done), "billing")] = FakeInboxRow(status="PROCESSED")
    await f.fetch(done, fresh)
    assert client.requests == [[_id(fresh)]]
    assert (f.outcomes[done.reply], f.outcomes[fresh.reply]) == ("duplicate", "processed")


async def test_a_message_answered_away_while_its_batch_is_answered_becomes_its_own_failure():
    """A result of 503 for one message, twice, while the handler answers the
    others of its batches: a deferral the first time (an outage counts
    nothing), its own failure the second (else it would come back without
    end), also when it comes first in its batch."""
    client = BatchClient()
    f = Flow(client, gated=True)
    x, y = delivery(f.nc, seq=1), delivery(f.nc, seq=2)
    client.results = {_id(x): 503}
    await f.fetch(x, y)
    assert (f.outcomes[x.reply], f.outcomes[y.reply]) == ("deferred", "processed")
    again, z = delivery(f.nc, seq=1, delivered=2, event_id=_id(x)), delivery(f.nc, seq=3)
    await f.fetch(again, z)
    assert (f.outcomes[again.reply], f.outcomes[z.reply]) == ("retried", "processed")
    row = f.inbox.row(_id(x), "billing")
    assert (row.status, row.failures, row.last_error) == ("FAILED", 1, "HTTP 503: fake")
    assert f.gates["billing"].is_up
