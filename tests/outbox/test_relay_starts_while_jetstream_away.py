"""A relay (re)started while JetStream is away (a nats-server on its port
without JetStream: the connection comes up, no stream answers) waits for it
and starts once it answers, as a running relay does: it does not exit. The
chaos soak found a relay restarted by its supervisor just before a JetStream
outage exiting with a ConfigError. A real `pgoutbox relay` process on the
defaults, as a login granted only pgoutbox_relay."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from pgoutbox.dev.embedded import EmbeddedNats
from support.jetstream_away import NoJetStream, emit, relay_settings
from support.outbox import apply_streams, status_counts
from support.roles import login
from support.waiting import wait_for
from support.workers import PGOUTBOX


@pytest.mark.slow  # the start-up check's 30 s wait for an election, then the relay's retries
def test_a_relay_started_while_jetstream_is_away_waits_for_it_and_then_publishes(database_url, tmp_path):
    nats = EmbeddedNats(tmp_path / "nats")
    nats.start()
    asyncio.run(apply_streams(nats.url))
    nats.stop()
    no_js = NoJetStream(tmp_path / "nats", nats.port)
    no_js.start()  # the same port, no JetStream
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    log = tmp_path / "relay.log"
    relay = None
    try:
        emit(login(database_url, "pgoutbox_writer"), 3, 0)
        with log.open("w") as out:
            relay = subprocess.Popen(
                [str(PGOUTBOX), "relay"],
                env={**env, **relay_settings(database_url, nats.url)},
                cwd=tmp_path,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def said(text: str):
            def check() -> bool:
                assert relay is not None and relay.poll() is None, f"the relay exited:\n{log.read_text()}"
                return text in log.read_text()

            return check

        # The start-up check's own wait for an election (30 s) comes first.
        wait_for(said("JetStream not answering"), 180, "the relay to say JetStream is not answering")
        assert '"action": "started"' not in log.read_text()  # not started without its streams checked
        no_js.stop()
        nats.start()  # JetStream again, with its store
        wait_for(said('"action": "started"'), 120, "the relay to start once JetStream answers")
        wait_for(lambda: status_counts(database_url) == {"COMPLETED": 3}, 60, "the events out")
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(60) == 0, log.read_text()
    finally:
        if relay is not None and relay.poll() is None:
            relay.kill()
            relay.wait(10)
        no_js.stop()
        nats.stop()
