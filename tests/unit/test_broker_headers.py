"""pgoutbox's connections parse received headers as nats-py does
(broker.parse_header_lines replaces nats-py's own, which spends a Python-level
generator per header name): the same dict for the same bytes."""

from __future__ import annotations

import json

import nats
import pytest

from pgoutbox.core import broker, wire
from pgoutbox.core.cloudevents import DEFAULT_SOURCE

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def relay_block() -> bytes:
    """The header lines of a message as the relay publishes it."""
    row = {
        "event_id": "0b7c3d1e-1f2a-4b5c-8d9e-0a1b2c3d4e5f",
        "subject": "sea.event.order_created.v1",
        "context": "sea",
        "event_type": "order_created",
        "event_version": 1,
        "aggregate_type": "order",
        "aggregate_id": "café 1",
        "occurred_at": "2025-01-02T03:04:05Z",
        "payload": "{}",
        "headers": json.dumps({"traceparent": TRACEPARENT}),
    }
    _, _, headers = wire.to_nats(row, DEFAULT_SOURCE)
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() + b"\r\n"


ODD = [
    b"a:b\r\n",
    b"a:\tb \r\n",
    b"no colon\r\n",
    b"sp ace: x\r\n",
    b"tab\tname: x\r\n",
    b" lead: x\r\n",
    b": empty name\r\n",
    b"caf\xc3\xa9: non-ASCII name\r\n",
    b"v: \xff bad UTF-8\r\n",
    b"a: 1\r\na: 2\r\n",
    b"colons: a:b:c\r\n",
    *(b"x%sy: z\r\n" % bytes([c]) for c in range(128) if c not in (10, 13, 58)),  # every ASCII byte inside a name
]


@pytest.mark.parametrize("block", [relay_block(), *ODD])
def test_the_headers_parse_as_nats_py_parses_them(block):
    assert broker.parse_header_lines(block) == nats.NATS._parse_header_lines(block)
