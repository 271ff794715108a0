"""A dead letter names the DLQ stream message that announced it (0017): the
consumer, logged in as pgoutbox_consumer, records the notice's PubAck
(stream, sequence) after the dead letter, and outbox.dlq_show, read by a
pgoutbox_viewer login, points at that very message of the DLQ stream. Real
nats-server, PostgreSQL and HTTP handler."""

from __future__ import annotations

import json

import psycopg

from support.inbox import (
    add_stream,
    default_consumer_config,
    dlq_messages,
    event,
    inbox_row,
    jetstream,
    publish,
    running_consumer,
    write_registry,
)
from support.roles import login
from support.waiting import until

H = "billing"
SUBJECT = "sea.event.order_created.v1"


def _show(url: str, message_id: str) -> dict:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT outbox.dlq_show('inbox', %s, %s)", (message_id, H)).fetchone()
    assert row is not None
    return dict(row[0])


async def test_a_dead_letters_dlq_show_names_the_sequence_of_its_notice_in_the_dlq_stream(
    tmp_path, database_url, nats_server, handler
):
    registry = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    cfg = default_consumer_config(login(database_url, "pgoutbox_consumer"), nats_server.url, registry)
    # Another message first, so that the notice is not the stream's first message
    # by chance: a 422 after a 422.
    first, doomed = event({"answers": [422]}), event({"answers": [422]})
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg):
            for ev in (first, doomed):
                await publish(js, ev)
                await until(
                    lambda ev=ev: (
                        "dlq_stream_sequence"
                        in ((inbox_row(database_url, ev["event_id"], H) or {}).get("dlq_metadata") or {})
                    ),
                    15,
                    "the notice to be recorded",
                )
        notices = [
            m
            for m in await dlq_messages(js)
            if doomed["event_id"] in m.data.decode() and m.headers.get("Pgoutbox-Handler") == H
        ]
    assert len(notices) == 1, notices
    shown = _show(login(database_url, "pgoutbox_viewer"), doomed["event_id"])
    assert shown["status"] == "DEAD_LETTER"
    assert shown["dlq_stream"] == "SEA_DLQ"
    assert shown["dlq_stream_sequence"] == notices[0].seq
    assert shown["payload"] is None  # a viewer: no payload, yet the notice's place
    assert json.loads(notices[0].data)  # the notice itself is a readable document
