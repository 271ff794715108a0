"""Scheduled events with a real relay process: an event emitted with
deliver_after => 3 s is published 3 s after it committed, within a second,
and not before; the relay runs on its defaults, as a pgoutbox_relay login,
and the writer is a pgoutbox_writer login. With the fallback poll set far
apart (30 s), the relay still publishes it on time: it asked when the next
scheduled event falls due (outbox.next_scheduled) and woke then."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import psycopg
import pytest

from support.outbox import RelayProcess, apply_streams, msg_ids, stream_messages
from support.roles import login
from support.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def relay(tmp_path):
    started: list[RelayProcess] = []

    def make(database_url: str, nats_url: str, **settings: str) -> RelayProcess:
        process = RelayProcess(tmp_path, f"relay-{len(started)}", database_url, nats_url, **settings)
        # On its defaults: only the addresses, its name and its HTTP port are set.
        for name in ("OUTBOX_RELAY_LEASE", "OUTBOX_RELAY_PUBLISH_TIMEOUT"):
            if name.lower().removeprefix("outbox_") not in settings:
                process.env.pop(name, None)
        started.append(process)
        return process.start()

    yield make
    for process in started:
        process.stop()


def published_after(database_url: str, event_id: str) -> timedelta | None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT published_at - created_at FROM outbox.events WHERE event_id = %s AND status = 'COMPLETED'",
            (event_id,),
        ).fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("settings", [{}, {"relay_poll_interval": "30s"}], ids=["defaults", "poll-30s"])
def test_an_event_scheduled_3s_ahead_is_published_3s_later_within_1s(database_url, nats_server, relay, settings):
    asyncio.run(apply_streams(nats_server.url))
    process = relay(login(database_url, "pgoutbox_relay"), nats_server.url, **settings)
    process.wait_started()
    with psycopg.connect(login(database_url, "pgoutbox_writer"), autocommit=True) as writer:
        event_id = str(
            writer.execute(
                "SELECT outbox.emit('order', '42', 'reminder_due', '{\"schema_version\": 1}',"
                " context => 'sea', deliver_after => interval '3 seconds')"
            ).fetchone()[0]
        )
    wait_for(lambda: published_after(database_url, event_id) is not None, 20, "the scheduled event published")
    waited = published_after(database_url, event_id)
    assert timedelta(seconds=3) <= waited < timedelta(seconds=4), waited
    assert msg_ids(asyncio.run(stream_messages(nats_server.url))) == [event_id]


def test_events_scheduled_a_second_apart_are_each_published_on_time(database_url, nats_server, relay):
    """The second falls due after the relay claimed the first: the claim that
    took the first asks again, rather than leaving it to the 30 s poll."""
    asyncio.run(apply_streams(nats_server.url))
    process = relay(login(database_url, "pgoutbox_relay"), nats_server.url, relay_poll_interval="30s")
    process.wait_started()
    with psycopg.connect(login(database_url, "pgoutbox_writer"), autocommit=True) as writer, writer.transaction():
        first, second = (
            str(
                writer.execute(
                    "SELECT outbox.emit('order', '42', 'reminder_due', '{\"schema_version\": 1}',"
                    " context => 'sea', deliver_after => %s)",
                    (timedelta(seconds=delay),),
                ).fetchone()[0]
            )
            for delay in (2, 3)
        )
    for event_id, delay in ((first, 2), (second, 3)):
        wait_for(lambda e=event_id: published_after(database_url, e) is not None, 20, f"the event due in {delay} s")
        waited = published_after(database_url, event_id)
        assert timedelta(seconds=delay) <= waited < timedelta(seconds=delay + 1), (delay, waited)
