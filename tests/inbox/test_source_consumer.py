"""The source documents' consumer, configured as they write it (000, "SEA
consuming from VIBESPRO_EVENTS"): the durable sea__from_vibespro on
VIBESPRO_EVENTS with filter_subject "vibespro.event.>", ack_wait 120s,
max_deliver 20 and max_ack_pending 50, from a manifest that says exactly
that. `pgoutbox relay` (pgoutbox_relay only) and `pgoutbox consume`
(pgoutbox_consumer only) run as processes on their defaults (addresses and
ports given); the application emits as a pgoutbox_writer login.

  * events of two types, each in two versions, all reach the handler once,
    each as it was emitted (the handler declares no version);
  * the durable JetStream holds has the source's filter, ack wait and
    max_ack_pending (the inbox counts the 20 deliveries: JetStream's own
    max_deliver is unlimited, docs/consumer.md).
"""

from __future__ import annotations

import collections

import psycopg
import pytest
from psycopg.types.json import Jsonb

from support.inbox import FakeHandler, add_stream, jetstream, write_registry
from support.roles import login
from support.waiting import until
from support.workers import worker

pytestmark = pytest.mark.slow

SOURCE = {
    "name": "sea__from_vibespro",
    "stream": "VIBESPRO_EVENTS",
    "subjects": ["vibespro.event.>"],
    "ack_wait": "120s",
    "max_deliver": 20,
    "max_ack_pending": 50,
}
KINDS = [("vibe_created", 1), ("vibe_created", 2), ("vibe_shared", 1), ("vibe_shared", 2)]


async def test_the_sources_consumer_gets_every_type_and_version_its_wildcard_covers(
    tmp_path, database_url, nats_server
):
    handler = FakeHandler()
    try:
        registry = write_registry(tmp_path, [{**SOURCE, "url": handler.url}])
        with psycopg.connect(login(database_url, "pgoutbox_writer")) as conn:
            emitted = {
                str(
                    conn.execute(
                        "SELECT outbox.emit('vibe', %s, %s, %s, context => 'vibespro', event_version => %s)",
                        (str(i), kind, Jsonb({"schema_version": version, "n": i}), version),
                    ).fetchone()[0]
                ): (kind, version, i)
                for i, (kind, version) in enumerate(KINDS * 3)
            }
        async with jetstream(nats_server.url) as js:
            assert await add_stream(js, context="vibespro") == "VIBESPRO_EVENTS"
            common = {"OUTBOX_NATS_URL": nats_server.url}
            with (
                worker(
                    tmp_path,
                    "relay",
                    '"action": "started"',
                    **common,
                    OUTBOX_DATABASE_URL=login(database_url, "pgoutbox_relay"),
                    OUTBOX_RELAY_HTTP_PORT="0",  # side by side with other tests
                ),
                worker(
                    tmp_path,
                    "consume",
                    "consumer started",
                    **common,
                    OUTBOX_DATABASE_URL=login(database_url, "pgoutbox_consumer"),
                    OUTBOX_REGISTRY_FILE=str(registry),
                    OUTBOX_CONSUMER_HTTP_PORT="0",  # side by side with other tests
                ),
            ):
                await until(
                    lambda: {c.message_id for c in handler.calls} >= set(emitted), 60, "every event at the handler"
                )
                info = await js.consumer_info("VIBESPRO_EVENTS", "sea__from_vibespro")
        config = info.config
        filters = config.filter_subjects or [config.filter_subject]
        assert (filters, config.ack_wait, config.max_ack_pending) == (["vibespro.event.>"], 120.0, 50)
        assert collections.Counter(c.message_id for c in handler.calls) == dict.fromkeys(emitted, 1)
        for call in handler.calls:
            kind, version, i = emitted[call.message_id]
            assert call.body["subject"] == f"vibespro.event.{kind}.v{version}"
            assert (call.body["event_version"], call.body["payload"]) == (version, {"schema_version": version, "n": i})
        assert {(k, v) for k, v, _ in emitted.values()} == set(KINDS)
    finally:
        handler.close()
