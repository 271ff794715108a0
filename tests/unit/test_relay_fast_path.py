"""The relay's cheap common case gives what the exact path gives: the
headers of wire.to_nats's fast path (no value checked or percent-encoded one
by one), the HPUB bytes the publisher builds itself (nats-py's own publish
builds the same), the publish acks read without JSON, and the age histogram
observed once per batch."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from fakes import event_row
from prometheus_client import CollectorRegistry, Histogram

from pgoutbox.core import wire
from pgoutbox.outbox import publisher
from pgoutbox.outbox.metrics import observe_many

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
ROWS = {
    "plain": {},
    "trace context": {"headers": json.dumps({"traceparent": TRACEPARENT, "tracestate": "a=b"})},
    "every field": {
        "correlation_id": "c1",
        "causation_id": "c2",
        "tenant_id": "t",
        "ordering_key": "k",
        "created_at": "2025-01-02T03:04:05.250000Z",
    },
    "no aggregate": {"aggregate_type": None, "aggregate_id": None},
    "space in an id": {"aggregate_id": "a b"},
    "percent in an id": {"aggregate_id": "50%"},
    "quote in an id": {"aggregate_id": 'say "hi"'},
    "non-ASCII id": {"aggregate_id": "café"},
    "integer id": {"aggregate_id": 7},
    "emitter ce- header": {"headers": json.dumps({"ce-dataschema": "https://example.com/s"})},
    "emitter Content-Type": {"headers": json.dumps({"Content-Type": "application/json"})},
    "other emitter header": {"headers": json.dumps({"x-thing": "1", "n": 2})},
    "a replay": {"cloudevents": {"specversion": "1.0", "id": "x", "source": "/s", "type": "t"}},
}
SOURCES = ("/pgoutbox/{context}", "https://example.com/a%20b/{context}")


def exact(row, source):
    """to_nats with the fast path off: every value checked and encoded one by one."""
    original = wire._fast_cloudevent
    wire._fast_cloudevent = lambda *_: False
    try:
        return wire.to_nats(row, source)
    finally:
        wire._fast_cloudevent = original


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", ROWS)
def test_the_fast_path_gives_the_exact_paths_headers_in_the_same_order(case, source):
    row = event_row(**ROWS[case])
    fast = wire.to_nats(row, source)
    assert fast == exact(row, source)
    assert list(fast[2]) == list(exact(row, source)[2])


@pytest.mark.parametrize("value", ["a\r\nb", " lead", "trail\u00a0"])
def test_a_value_nats_cannot_carry_is_refused_as_before(value):
    with pytest.raises(wire.WireError) as caught:
        wire.to_nats(event_row(aggregate_id=value))
    assert caught.value.code == "BAD_HEADER"


@pytest.mark.parametrize("case", ROWS)
def test_the_hpub_command_is_the_one_nats_py_publish_builds(case):
    subject, body, headers = wire.to_nats(event_row(**ROWS[case]))
    sent: list[bytes] = []
    nc = nats.NATS()  # not connected: its _send_publish only renders and queues

    async def capture(command: bytes, priority: bool = False) -> None:
        sent.append(command)

    nc._send_command = capture  # type: ignore[method-assign]
    asyncio.run(nc._send_publish(subject, "_INBOX.x.7", body, len(body), headers))
    assert publisher._hpub(subject, "_INBOX.x.7", headers, body) == sent[0]


@pytest.mark.parametrize(
    ("ack", "duplicate"),
    [
        (b'{"stream":"SEA","seq":12}', False),
        (b'{"stream":"SEA","seq":12,"duplicate":true}', True),
        (b'{"stream":"SEA","domain":"hub","seq":3}', False),
    ],
)
def test_a_publish_ack_is_read_without_json(ack, duplicate):
    found = publisher._PUB_ACK.fullmatch(ack)
    assert found is not None and (found[1] is not None) == duplicate == bool(json.loads(ack).get("duplicate"))


@pytest.mark.parametrize(
    "reply", [b'{"error":{"code":400,"err_code":10054,"description":"too large"},"stream":"SEA"}', b"{}", b"junk"]
)
def test_anything_else_is_left_to_the_json_reading(reply):
    assert publisher._PUB_ACK.fullmatch(reply) is None


def test_observing_a_batch_at_once_counts_as_observing_each():
    buckets = (0.001, 0.01, 0.1, 1.0, 10.0)
    amounts = [0.0, 0.001, 0.0011, 0.5, 1.0, 3.0, 11.0, 1e9, 0.01, 0.01]
    each, many = CollectorRegistry(), CollectorRegistry()
    one = Histogram("age_seconds", "h", ["context"], buckets=buckets, registry=each)
    for amount in amounts:
        one.labels("sea").observe(amount)
    observe_many(Histogram("age_seconds", "h", ["context"], buckets=buckets, registry=many).labels("sea"), amounts)
    seen, got = ([s for m in r.collect() for s in m.samples if not s.name.endswith("_created")] for r in (each, many))
    assert [(s.name, s.labels) for s in seen] == [(s.name, s.labels) for s in got]
    assert [s.value for s in seen] == pytest.approx([s.value for s in got])
