"""A handler that is away delays its messages and never dead-letters them
(inbox/gates.py), against a real PostgreSQL, nats-server and HTTP handler:
its gate closes, the message in hand goes back with no failure counted (the
inbox row stays RECEIVED), one probe with growing pauses finds when the
handler is back, and /readyz and pgoutbox_consumer_handler_up say so
meanwhile. tests/inbox/test_handler_outage.py runs the 5-minute outage with
real processes."""

from __future__ import annotations

import asyncio
import socket

from support.inbox import (
    FakeHandler,
    add_stream,
    consumer_config,
    dlq_messages,
    event,
    inbox_row,
    jetstream,
    publish,
    running_consumer,
    write_registry,
)
from support.waiting import until

H = "billing"
SUBJECT = "sea.event.order_created.v1"


def _up(consumer) -> float | None:
    return consumer.metrics.registry.get_sample_value("pgoutbox_consumer_handler_up", {"handler": H})


async def test_a_handler_answering_503_is_away_and_its_message_waits_uncounted(
    tmp_path, database_url, nats_server, handler
):
    """503, 503, then 200, with max_deliver 2: counted, the second 503 would
    have dead-lettered the message; the gate makes both a wait instead."""
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    # not default: max_deliver 2: one counted failure would dead-letter it, so none may be counted
    cfg = consumer_config(database_url, nats_server.url, registry_file, max_deliver="2")
    ev = event({"answers": [503, 503, 200]})
    seen = []  # the consumer as the handler's third call (the probe that finds it back) finds it
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            handler.on_request = lambda call: seen.append(
                (len(handler.calls), consumer.problems(), _up(consumer), inbox_row(database_url, ev["event_id"], H))
            )
            assert _up(consumer) == 1
            await publish(js, ev)
            await until(lambda: consumer.metrics.value(H, "processed") == 1, 15, "the message processed")
            up_after = _up(consumer)
            problems_after = consumer.problems()
            dlq = await dlq_messages(js)
    row = inbox_row(database_url, ev["event_id"], H)
    assert [c.headers["Pgoutbox-Delivery"] for c in handler.calls_for(ev["event_id"])] == ["1", "2", "3"]
    assert row["status"] == "PROCESSED" and dlq == []
    assert "failures" not in (row["dlq_metadata"] or {}) and row["last_error"] is None
    third = seen[2]
    assert third[2] == 0  # the gauge, while the probe was in flight
    assert any(p.startswith(f"handler {H} not answering since ") and "HTTP 503" in p for p in third[1]), third[1]
    assert third[3]["status"] == "RECEIVED"  # never FAILED
    assert up_after == 1 and not any(p.startswith("handler ") for p in problems_after)
    assert consumer.metrics.value(H, "deferred") == 2
    assert consumer.metrics.value(H, "retried") == 0 and consumer.metrics.value(H, "dead_lettered") == 0


async def test_a_handler_that_refuses_connections_delays_every_message_until_it_listens(
    tmp_path, database_url, nats_server, caplog
):
    """Nothing listens on the handler's port for more probes than max_deliver
    (2): no message is dead-lettered or FAILED; once a handler listens there,
    each message reaches it once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/events"
    registry_file = write_registry(tmp_path, [{"name": H, "url": url, "subjects": [SUBJECT]}])
    # not default: max_deliver 2: one counted failure would dead-letter it, so none may be counted
    cfg = consumer_config(database_url, nats_server.url, registry_file, max_deliver="2")
    events = [event() for _ in range(3)]
    caplog.set_level("INFO", logger="pgoutbox.inbox.gates")
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            for ev in events:
                await publish(js, ev)
            # Every message went back at least once and the probes went on past max_deliver.
            await until(lambda: consumer.metrics.value(H, "deferred") >= len(events) + 3, 30, "probes")
            rows = [inbox_row(database_url, ev["event_id"], H) for ev in events]
            assert {r["status"] for r in rows} == {"RECEIVED"}, rows
            assert _up(consumer) == 0
            assert any("ConnectionRefusedError" in p for p in consumer.problems())
            back = FakeHandler(port=port)
            try:
                await until(lambda: consumer.metrics.value(H, "processed") == len(events), 60, "the handler back")
            finally:
                back.close()
            assert _up(consumer) == 1
            dlq = await dlq_messages(js)
    assert dlq == []
    assert sorted(c.message_id for c in back.calls) == sorted(ev["event_id"] for ev in events)
    for ev in events:
        row = inbox_row(database_url, ev["event_id"], H)
        assert row["status"] == "PROCESSED" and "failures" not in (row["dlq_metadata"] or {})
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("handler_away") == 1 and actions.count("handler_back") == 1


async def test_a_replay_that_finds_the_handler_away_waits_and_is_not_spent(
    tmp_path, database_url, nats_server, handler
):
    """422 dead-letters the message; its automated replay finds the handler
    away (503, then 503 again for the probe), then back (200): one replay
    spent, the one that processed it; no second dead letter."""
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    # not default: max_deliver 2 (a counted failure would dead-letter it); the replay within 200 ms, not 1 h
    cfg = consumer_config(database_url, nats_server.url, registry_file, max_deliver="2", replay_base_delay="200ms")
    ev = event({"answers": [422, 503, 503, 200]})
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            await publish(js, ev)
            await until(lambda: consumer.metrics.value(H, "processed") == 1, 20, "the replay processed")
            dlq = await dlq_messages(js, subject=f"sea.dlq.dead.{H}")
    row = inbox_row(database_url, ev["event_id"], H)
    assert len(handler.calls_for(ev["event_id"])) == 4
    assert row["status"] == "PROCESSED"
    meta = row["dlq_metadata"]
    assert (meta["replay_attempts"], meta["dead_letters"]) == (1, 1), meta
    assert "failures" not in meta or meta["failures"] == 0, meta
    assert len(dlq) == 1  # the 422's notice only
    assert consumer.metrics.value(H, "deferred") == 2 and consumer.metrics.value(H, "dead_lettered") == 1


async def test_a_handler_away_for_one_message_only_fails_that_message_and_serves_the_others(
    tmp_path, database_url, nats_server, handler
):
    """The handler answers 503 for one message every time and 200 for the
    others, which keep coming: its first 503 is a deferral (nothing tells it
    from an outage yet); each later one, after the handler answered calls made
    since, is that message's own failure, so it dead-letters after max_deliver
    (the default) failures instead of closing the gate again and again, and the
    others are processed meanwhile."""
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    cfg = consumer_config(database_url, nats_server.url, registry_file)
    bad = event({"answers": [503]})
    others: list[dict] = []
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            await publish(js, bad)

            def dead() -> bool:
                row = inbox_row(database_url, bad["event_id"], H)
                return row is not None and row["status"] == "DEAD_LETTER"

            async def keep_publishing() -> None:
                while not dead():
                    ev = event({"answers": [200]})
                    others.append(ev)
                    await publish(js, ev)
                    await asyncio.sleep(0.3)  # not a race: the pace of the trickle, nothing waits on it

            trickle = asyncio.create_task(keep_publishing())
            try:
                await until(dead, 120, "the message the handler is away for dead-lettered")
            finally:
                trickle.cancel()
            await until(lambda: consumer.metrics.value(H, "processed") == len(others), 30, "every other message")
            up = _up(consumer)
            dlq = await dlq_messages(js, subject=f"sea.dlq.dead.{H}")
    row = inbox_row(database_url, bad["event_id"], H)
    assert row["dlq_metadata"]["failures"] == cfg.max_deliver, row["dlq_metadata"]
    assert "HTTP 503" in row["last_error"]
    assert len(dlq) == 1
    assert all(inbox_row(database_url, ev["event_id"], H)["status"] == "PROCESSED" for ev in others)
    assert consumer.metrics.value(H, "deferred") >= 1 and consumer.metrics.value(H, "dead_lettered") == 1
    assert up == 1  # the gate is open: the handler answers the others
