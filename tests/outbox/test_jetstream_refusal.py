"""A message JetStream refuses (over the stream's max_msg_size, under the
server's max_payload) is the message's own failure: it still dead-letters
(MAX_PAYLOAD), and starts no "JetStream away" episode; a relay on the
defaults as a login granted only pgoutbox_relay."""

from __future__ import annotations

import asyncio

import psycopg
from psycopg.types.json import Jsonb

from support.jetstream_away import emit, gauge, log_lines, relay_settings
from support.outbox import apply_streams, status_counts
from support.roles import login
from support.waiting import wait_for
from support.workers import worker


def test_a_message_jetstream_refuses_still_dead_letters_and_starts_no_episode(database_url, nats_server, tmp_path):
    # The stream takes at most 4 KiB a message (the server's max_payload stays 1 MiB).
    asyncio.run(apply_streams(nats_server.url, max_msg_size=4096))
    writer = login(database_url, "pgoutbox_writer")
    with worker(tmp_path, "relay", '"action": "started"', **relay_settings(database_url, nats_server.url)) as port:
        assert port
        with psycopg.connect(writer, autocommit=True) as conn:
            big = conn.execute(
                "SELECT outbox.emit('order', '1', 'order_created', %s, context => 'sea')::text",
                (Jsonb({"schema_version": 1, "blob": "x" * 8000}),),
            ).fetchone()[0]
        emit(writer, 1, 2)
        wait_for(
            lambda: status_counts(database_url) == {"COMPLETED": 1, "DEAD_LETTER": 1},
            60,
            "the small event out, the big one dead-lettered",
            detail=lambda: f"{status_counts(database_url)}",
        )
        assert gauge(port) == 1.0
    with psycopg.connect(database_url, autocommit=True) as conn:
        (error,) = conn.execute("SELECT last_error FROM outbox.events WHERE event_id = %s", (big,)).fetchone()
    assert error.startswith("MAX_PAYLOAD: [10054] ")
    actions = [line.get("action") for line in log_lines(tmp_path / "relay.log")]
    assert "jetstream_away" not in actions and "dead_letter" in actions
