"""`make demo`, the one demo: the relay puts the three events in JetStream and
the consumer processes them (the poison one ends in the DLQ, is replayed once
and stays there)."""

from __future__ import annotations

import logging
import re

from pgoutbox.dev import demo


def test_the_demo_relays_the_events_to_jetstream_and_the_consumer(database_url, nats_server, monkeypatch, capsys):
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_NATS_URL", nats_server.url)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert demo.main([]) == 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out = capsys.readouterr().out
    emitted = re.findall(r"^emitted (\S+)$", out, re.M)
    received = re.findall(r"^   seq \d+ sea\.event\.order_created\.v1 Nats-Msg-Id=(\S+)$", out, re.M)
    assert len(emitted) == 3 and sorted(received) == sorted(emitted)
    assert out.count('"status": "COMPLETED"') == 3 and '"claimed_by": "demo-relay"' in out
    assert "handler order_mailer was called 4 time(s)" in out
    assert out.count("-> 200") == 2 and out.count("-> 422") == 2
    assert '"dead_letter": 1' in out and '"unprocessed": 0' in out  # the inbox half: 2 processed, the poison one dead
    assert out.count("sea.dlq.dead.order_mailer.order_created.v1: HTTP 422") == 2
