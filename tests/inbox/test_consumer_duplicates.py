"""The same message delivered twice reaches the handler once: a redelivery
after a lost ack, a durable recreated from the start of the stream, and a
republish after JetStream's duplicate window (which JetStream itself no
longer deduplicates)."""

from __future__ import annotations

import asyncio

import pytest

from harness.tcp_proxy import TcpProxy
from support.inbox import (
    acked_through,
    add_stream,
    consumer_config,
    event,
    inbox_row,
    jetstream,
    publish,
    running_consumer,
    write_registry,
)
from support.waiting import until

H = "billing"


@pytest.fixture
def registry_file(tmp_path, handler):
    return write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}])


async def test_redelivery_after_a_lost_ack_reaches_the_handler_once(database_url, nats_server, handler, registry_file):
    proxy = TcpProxy(nats_server.port)
    handler.on_request = lambda call: proxy.drop_client_bytes()  # the ack will be lost
    ev = event()
    try:
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            # not default: the test is about the redelivery after ack_wait (30 s): 2 s
            async with running_consumer(consumer_config(database_url, proxy.url, registry_file, ack_wait="2s")):
                await publish(js, ev)
                await until(lambda: (inbox_row(database_url, ev["event_id"], H) or {}).get("status") == "PROCESSED")
                # not a race: a negative check (nothing acked), and the redelivery below proves the ack was lost
                await asyncio.sleep(0.3)
                info = await js.consumer_info("SEA_EVENTS", H)
                assert (info.ack_floor.stream_seq, info.num_ack_pending) == (0, 1), "the ack must have been lost"
            # A second consumer gets the redelivery after ack_wait; the inbox says it is done.
            second_cfg = consumer_config(
                database_url, nats_server.url, registry_file, ack_wait="2s"
            )  # not default: as above
            async with running_consumer(second_cfg) as second:
                await until(lambda: second.metrics.value(H, "duplicate") == 1, 15, "the redelivery")
                info = await acked_through(js, H, 1)
    finally:
        proxy.close()
    assert len(handler.calls) == 1
    assert (info.ack_floor.stream_seq, info.num_ack_pending, info.delivered.consumer_seq) == (1, 0, 2)
    assert second.metrics.value(H, "processed") == 0
    assert second.metrics.registry.get_sample_value("pgoutbox_consumer_redeliveries_total", {"handler": H}) == 1


async def test_a_recreated_durable_redelivers_everything_and_the_handler_sees_each_once(
    database_url, nats_server, handler, registry_file
):
    events = [event() for _ in range(3)]
    cfg = consumer_config(database_url, nats_server.url, registry_file)
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as first:
            for ev in events:
                await publish(js, ev)
            await until(lambda: first.metrics.value(H, "processed") == 3)
        await js.delete_consumer("SEA_EVENTS", H)  # e.g. lost consumer state, or an operator reset
        async with running_consumer(cfg) as second:
            await until(lambda: second.metrics.value(H, "duplicate") == 3, 15, "the three duplicates")
    assert sorted(c.message_id for c in handler.calls) == sorted(ev["event_id"] for ev in events)


async def test_a_republish_after_the_duplicate_window_reaches_the_handler_once(
    database_url, nats_server, handler, registry_file
):
    ev = event()
    async with jetstream(nats_server.url) as js:
        await add_stream(js, duplicate_window=0.5)
        async with running_consumer(consumer_config(database_url, nats_server.url, registry_file)) as consumer:
            first = await publish(js, ev)
            await until(lambda: consumer.metrics.value(H, "processed") == 1)
            await asyncio.sleep(0.8)  # not a race: the stream's duplicate window (0.5 s) must pass
            again = await publish(js, ev)  # e.g. a relay re-publishing after a long outage
            assert again.duplicate is not True and again.seq == first.seq + 1, "JetStream must not have deduplicated it"
            await until(lambda: consumer.metrics.value(H, "duplicate") == 1)
            info = await acked_through(js, H, 2)
    assert len(handler.calls) == 1
    assert info.ack_floor.stream_seq == 2
    assert inbox_row(database_url, ev["event_id"], H)["attempts"] == 1
