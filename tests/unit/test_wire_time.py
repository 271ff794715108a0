"""Poison rows without a server: the wire time rendering, the encoder's
permanent codes and bounded error texts (tests/outbox/test_relay_poison.py
runs the relay over poison rows in a real database)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from pgoutbox.core import wire
from pgoutbox.outbox.publisher import MAX_DETAIL, Outcome, PublishError, encode_outcome

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


# -- the encoder alone ---------------------------------------------------------


def row(**overrides):
    base = {
        "event_id": "5b0c4bd5-bd35-4ef4-8a8c-1a1d0d1f1f00",
        "subject": "sea.event.x.v1",
        "context": "sea",
        "event_type": "x",
        "event_version": 1,
        "aggregate_type": "order",
        "aggregate_id": "1",
        "occurred_at": "2025-01-02T03:04:05Z",
        "payload": '{"schema_version": 1}',
        "headers": "{}",
    }
    return {**base, **overrides}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2025-01-02 03:04:05+00", "2025-01-02T03:04:05Z"),
        ("2025-01-02 03:04:05.1+00", "2025-01-02T03:04:05.100000Z"),
        ("2025-01-02 03:04:05.123456+00", "2025-01-02T03:04:05.123456Z"),
        ("2025-01-02 03:04:05+05:30", "2025-01-01T21:34:05Z"),
        ("0001-01-01 00:00:00+00", "0001-01-01T00:00:00Z"),
    ],
)
def test_wire_time_matches_the_datetime_rendering(text, expected):
    assert wire.wire_time(text) == expected
    if "+00" in text:  # the same text as a datetime gives (the format of earlier versions)
        as_datetime = datetime.fromisoformat(text)
        assert wire.to_nats(row(occurred_at=as_datetime))[2]["Pgoutbox-Occurred-At"] == expected


@pytest.mark.parametrize(
    "text",
    [
        "infinity",
        "-infinity",
        "10000-01-01 00:00:00+00",
        "294276-12-31 23:59:59+00",
        "0001-12-31 00:00:00+00 BC",
        "0001-01-01 00:30:00+01",
        "",
        "garbage",
    ],
)
def test_wire_time_marks_what_rfc_3339_cannot_express(text):
    value = wire.wire_time(text)
    assert value == wire.Unrepresentable(text)
    outcome = encode_outcome(row(occurred_at=value))
    assert outcome.code == PublishError.BAD_TIMESTAMP and outcome.permanent
    assert (
        outcome.error == f"BAD_TIMESTAMP: occurred_at {text[:60]!r} cannot be expressed on the wire "
        "(RFC 3339, years 0001-9999)"
    )


def test_every_poison_class_has_a_permanent_code_from_the_encoder():
    cases = {
        "BAD_HEADER": [
            row(headers='{"x": "a\\r\\nb"}'),
            row(headers='{"Nats-TTL": "1s"}'),
            row(headers='{"PGOUTBOX-context": "y"}'),
            row(headers="[]"),
            row(aggregate_id="x\n"),
            row(headers=json.dumps({"a b" * 5_000: "v"})),
        ],
        "BAD_SUBJECT": [
            row(subject=None),
            row(subject="sea.event..v1"),
            row(subject="sea.event.x.v2"),
            row(subject="s" * 509 + ".event.x.v1", context="s" * 509),
            row(subject="sea.event.x y.v1", event_type="x y"),
        ],
        "BAD_PAYLOAD": [row(payload="[]"), row(payload='"text"'), row(payload="")],
        "ENCODE_FAILED": [{k: v for k, v in row().items() if k != "payload"}, row(headers="{not json")],
    }
    for code, bad in cases.items():
        for r in bad:
            outcome = encode_outcome(r)
            assert isinstance(outcome, Outcome), r
            assert (outcome.code, outcome.permanent) == (code, True), (r, outcome)
            assert outcome.error.startswith(f"{code}: ") and len(outcome.error) <= len(code) + 2 + MAX_DETAIL + 3
    subject, body, headers = encode_outcome(
        row(headers=json.dumps({"traceparent": TRACEPARENT, "gone": None, "retries": 5, "meta": {"a": "b c"}}))
    )
    assert headers["traceparent"] == TRACEPARENT and "gone" not in headers
    assert headers["retries"] == "5" and headers["meta"] == '{"a":"b c"}'  # other JSON values as compact JSON text


def test_error_texts_are_bounded_and_free_of_nul():
    outcome = Outcome("e", code=PublishError.ENCODE_FAILED, detail="x" * 1000)
    assert outcome.error == "ENCODE_FAILED: " + "x" * MAX_DETAIL + "..."
    outcome = Outcome("e", code=PublishError.ENCODE_FAILED, detail="a\x00b\ud800c")
    assert outcome.error == "ENCODE_FAILED: a\\x00b\\ud800c"
    outcome.error.encode()  # storable: valid UTF-8, no NUL
