"""A single nats-server restarted on the same port without JetStream for 5
minutes while 100 events are emitted, then back with JetStream and its old
store, with real processes on the defaults: one `pgoutbox relay`
as a login granted only pgoutbox_relay (every setting at its default but the
addresses and the HTTP port), events emitted by a login granted only
pgoutbox_writer. Every event reaches the stream exactly once, none is
dead-lettered, no operator acts; /readyz said why meanwhile; the gauge went
0, then 1. An xdist group of its own (a chain of about 6 minutes).
"""

from __future__ import annotations

import asyncio

import pytest

from pgoutbox.dev.embedded import EmbeddedNats
from support.jetstream_away import (
    BEFORE,
    OUTAGE,
    NoJetStream,
    Watch,
    assert_every_event_once,
    emit,
    emit_during,
    gauge,
    relay_settings,
)
from support.outbox import apply_streams, status_counts
from support.roles import login
from support.waiting import wait_for
from support.workers import worker


@pytest.mark.slow
def test_a_single_server_without_jetstream_for_five_minutes_delays_events_and_dead_letters_none(database_url, tmp_path):
    nats = EmbeddedNats(tmp_path / "nats")
    nats.start()
    no_js = NoJetStream(tmp_path / "nats", nats.port)
    writer = login(database_url, "pgoutbox_writer")
    try:
        asyncio.run(apply_streams(nats.url))
        with worker(tmp_path, "relay", '"action": "started"', **relay_settings(database_url, nats.url)) as port:
            assert port
            watch = Watch(port)
            watch.start()
            try:
                emit(writer, BEFORE, 0)
                wait_for(lambda: status_counts(database_url) == {"COMPLETED": BEFORE}, 60, "the first events out")
                assert gauge(port) == 1.0  # before the outage
                nats.stop()
                no_js.start()  # the same port, no JetStream
                emit_during(writer, OUTAGE, watch)
                no_js.stop()
                nats.start()  # JetStream again, with its old store
                assert_every_event_once(database_url, nats.url, tmp_path / "relay.log")
                wait_for(lambda: watch.gauge[-1:] == [1.0], 30, "the gauge back at 1", interval=0.5)
            finally:
                watch.stop()
        assert 0.0 in watch.gauge and watch.gauge[-1] == 1.0, watch.gauge  # 0 during the outage, then 1
        assert any(r.startswith("JetStream not answering since ") for r in watch.reasons), watch.reasons
    finally:
        no_js.stop()
        nats.stop()
