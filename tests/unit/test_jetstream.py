"""core/jetstream.py: JetStream's pull API as the consumer's fetches and the
audit's stream pass drive it by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pgoutbox.core import jetstream


def test_a_pull_request_waits_or_takes_only_what_is_there():
    assert jetstream.next_subject("SEA", "billing") == "$JS.API.CONSUMER.MSG.NEXT.SEA.billing"
    assert json.loads(jetstream.pull_request(64)) == {"batch": 64, "no_wait": True}
    assert json.loads(jetstream.pull_request(1, 2.0)) == {"batch": 1, "expires": 2_000_000_000}


def test_a_stream_message_is_never_a_status_whatever_its_headers_say():
    posing = SimpleNamespace(reply="$JS.ACK.SEA.billing.1.7.7.1700000000000000000.0", headers={"Status": "404"})
    assert jetstream.status(posing) is None


@pytest.mark.parametrize(
    "code, ends",
    [("404", True), ("408", True), ("409", True), ("503", True), ("100", False)],
)
def test_which_statuses_end_a_request(code, ends):
    msg = SimpleNamespace(reply="", headers={"Status": code})
    assert jetstream.status(msg) == code
    assert jetstream.ends_request(code) is ends


def test_a_messages_position_is_read_from_its_ack_subject():
    msg = SimpleNamespace(reply="$JS.ACK.SEA.audit.1.42.40.1700000000000000000.5")
    assert jetstream.position(msg) == (42, 5)
