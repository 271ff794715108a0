"""Each handler answer leads to the documented inbox state, ack behaviour and
DLQ content (handler_contract.py), against a real PostgreSQL, nats-server
and HTTP handler."""

from __future__ import annotations

import json

import psycopg
import pytest

from pgoutbox.core import wire
from support.inbox import (
    acked_through,
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


async def _ack_state(js):
    info = await js.consumer_info("SEA_EVENTS", H)
    return {
        "ack_floor": info.ack_floor.stream_seq,
        "ack_pending": info.num_ack_pending,
        "deliveries": info.delivered.consumer_seq,
    }


async def _run_one(tmp_path, database_url, nats_server, url, answers, *, timeout: float = 15, **cfg_overrides):
    """Publishes one event whose handler answers `answers`; returns once the
    message is acknowledged (within `timeout` s), with everything the test needs to look at."""
    registry_file = write_registry(tmp_path, [{"name": H, "url": url, "subjects": ["sea.event.order_created.v1"]}])
    cfg = consumer_config(database_url, nats_server.url, registry_file, **cfg_overrides)
    ev = event({"answers": answers})
    states = []
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            await publish(js, ev)

            def watch():
                row = inbox_row(database_url, ev["event_id"], H)
                # RECEIVED is transient (handler being called): the outcomes are the rest.
                if row and row["status"] != "RECEIVED" and (not states or states[-1] != row["status"]):
                    states.append(row["status"])
                return row

            async def acked():
                watch()
                return (await _ack_state(js))["ack_floor"] == 1

            await until(acked, timeout, "the message to be acknowledged")
            watch()  # the row may have moved between the last look and the ack
            ack = await _ack_state(js)
            dlq = await dlq_messages(js)
            metrics = consumer.metrics
    return ev, inbox_row(database_url, ev["event_id"], H), states, ack, dlq, metrics


async def test_200_marks_processed_and_acks_with_the_full_envelope(tmp_path, database_url, nats_server, handler):
    ev, row, states, ack, dlq, metrics = await _run_one(tmp_path, database_url, nats_server, handler.url, [200])
    assert row["status"] == "PROCESSED" and row["processed_at"] is not None and row["attempts"] == 1
    assert ack == {"ack_floor": 1, "ack_pending": 0, "deliveries": 1}
    assert dlq == []
    [call] = handler.calls
    # The full envelope, message_id from Nats-Msg-Id; trace context as a header.
    assert call.body == {
        "message_id": ev["event_id"],
        "subject": "sea.event.order_created.v1",
        "context": "sea",
        "event_type": "order_created",
        "event_version": 1,
        "aggregate_type": "order",
        "aggregate_id": "42",
        "occurred_at": "2025-01-02T03:04:05Z",
        "correlation_id": ev["correlation_id"],
        "causation_id": ev["causation_id"],
        "tenant_id": "t1",
        "ordering_key": None,
        "payload": ev["payload"],
    }
    assert call.headers["traceparent"] == ev["headers"]["traceparent"]
    assert call.headers["Idempotency-Key"] == ev["event_id"]
    assert call.headers["Pgoutbox-Delivery"] == "1"
    assert row["envelope"]["trace"] == {"traceparent": ev["headers"]["traceparent"]}
    assert metrics.value(H, "processed") == 1


async def test_409_counts_as_already_processed(tmp_path, database_url, nats_server, handler):
    _, row, _, ack, dlq, metrics = await _run_one(tmp_path, database_url, nats_server, handler.url, [409])
    assert row["status"] == "PROCESSED" and row["last_error"] is None
    assert ack == {"ack_floor": 1, "ack_pending": 0, "deliveries": 1}
    assert dlq == [] and len(handler.calls) == 1
    assert metrics.value(H, "processed") == 1


async def test_422_dead_letters_publishes_to_the_dlq_and_acks(tmp_path, database_url, nats_server, handler):
    ev, row, _, ack, dlq, metrics = await _run_one(tmp_path, database_url, nats_server, handler.url, [422])
    assert row["status"] == "DEAD_LETTER"
    assert row["last_error"].startswith("HTTP 422")
    assert ack == {"ack_floor": 1, "ack_pending": 0, "deliveries": 1}  # acked: no infinite retry
    assert len(handler.calls) == 1
    [notice] = dlq
    assert notice.subject == f"sea.dlq.dead.{H}.order_created.v1"
    assert notice.headers["Nats-Msg-Id"] == f"{ev['event_id']}:dead:{H}:1"
    body = json.loads(notice.data)
    assert body["type"] == "MessageDeadLettered"
    assert (body["message_id"], body["original_subject"], body["attempts"]) == (
        ev["event_id"],
        "sea.event.order_created.v1",
        1,
    )
    assert body["reason"].startswith("HTTP 422")
    assert body["envelope"]["payload"] == ev["payload"]
    # Automated replay is scheduled (the defaults: base delay 1m, jitter 0.5): in 30 to 60 seconds.
    assert 30 <= body["next_replay_in_seconds"] <= 60
    meta = row["dlq_metadata"]
    assert (meta["dead_letters"], meta["replay_attempts"]) == (1, 0)
    assert meta["next_replay_at"] is not None
    assert metrics.value(H, "dead_lettered") == 1


@pytest.mark.parametrize("answer", [500, 400, "timeout"])  # 503: the handler away (test_handler_gate.py)
async def test_transient_failure_records_the_error_and_is_redelivered(
    tmp_path, database_url, nats_server, handler, answer
):
    ev, row, states, ack, dlq, metrics = await _run_one(
        tmp_path,
        database_url,
        nats_server,
        handler.url,
        [answer, 200],
        handler_timeout="500ms",  # not default: the "timeout" answer must outlast it (the handler hangs 3 s)
        retry_max_delay="1s",  # not default: one retry of at most 1 s (FAILED lasts 0.5-1 s: long enough to be seen)
    )
    # First delivery: FAILED with the error, not acked; JetStream redelivers it.
    assert states == ["FAILED", "PROCESSED"], states
    assert row["status"] == "PROCESSED" and row["attempts"] == 2
    assert [c.headers["Pgoutbox-Delivery"] for c in handler.calls_for(ev["event_id"])] == ["1", "2"]
    assert ack == {"ack_floor": 1, "ack_pending": 0, "deliveries": 2}
    assert dlq == []
    assert metrics.value(H, "retried") == 1 and metrics.value(H, "processed") == 1


async def test_transient_failure_error_text_is_recorded(tmp_path, database_url, nats_server, handler):
    """The inbox keeps the error while the message waits for redelivery."""
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    # not default: the rows must stay FAILED while the test reads them (5 s), and the
    # "timeout" answer must outlast the handler timeout (the handler hangs 3 s; 1 s
    # leaves the 500 answer time to arrive on a loaded machine)
    cfg = consumer_config(
        database_url, nats_server.url, registry_file, retry_delay="5s", retry_max_delay="5s", handler_timeout="1s"
    )
    ev500, evtimeout = event({"answers": [500]}), event({"answers": ["timeout"]})
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg):
            await publish(js, ev500)
            await publish(js, evtimeout)
            for ev in (ev500, evtimeout):
                await until(lambda ev=ev: (inbox_row(database_url, ev["event_id"], H) or {}).get("status") == "FAILED")
            info = await js.consumer_info("SEA_EVENTS", H)
            assert info.num_ack_pending == 2 and info.ack_floor.stream_seq == 0  # nothing acked
    assert inbox_row(database_url, ev500["event_id"], H)["last_error"].startswith("HTTP 500")
    assert inbox_row(database_url, evtimeout["event_id"], H)["last_error"].startswith("timeout after 1s")


@pytest.mark.slow
async def test_max_deliver_exhaustion_ends_in_the_dlq_not_in_silence(tmp_path, database_url, nats_server, handler):
    """On the defaults (max_deliver 5, retries after 1, 2, 4 and 8 s): the one
    test of the real retry schedule, hence slow (15 s)."""
    ev, row, _, ack, dlq, _ = await _run_one(tmp_path, database_url, nats_server, handler.url, [500], timeout=60)
    assert [c.headers["Pgoutbox-Delivery"] for c in handler.calls] == ["1", "2", "3", "4", "5"]
    assert row["status"] == "DEAD_LETTER" and row["attempts"] == 5
    assert row["last_error"].startswith("max_deliver (5) reached; last answer: HTTP 500")
    assert ack == {"ack_floor": 1, "ack_pending": 0, "deliveries": 5}
    [notice] = dlq
    body = json.loads(notice.data)
    assert (body["message_id"], body["attempts"]) == (ev["event_id"], 5)


async def test_other_statuses_are_retried_like_5xx(tmp_path, database_url, nats_server, handler):
    """400/404 (not the handler's explicit poison word, 422) are retried and,
    if they persist, dead-lettered at max_deliver; 204 is a success."""
    ev, row, _, _, dlq, _ = await _run_one(tmp_path, database_url, nats_server, handler.url, [404, 400, 204])
    assert row["status"] == "PROCESSED" and row["attempts"] == 3 and dlq == []
    assert len(handler.calls) == 3


async def test_long_handler_is_kept_alive_by_in_progress_acks(tmp_path, database_url, nats_server, handler):
    """ack_wait 1s, handler takes 2.5s: no redelivery, one call."""
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    # not default: the test is about ack_wait (1 s) being outlasted by a handler (2.5 s) within its timeout
    cfg = consumer_config(database_url, nats_server.url, registry_file, ack_wait="1s", handler_timeout="5s")
    ev = event({"delay": 2.5})
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg):
            await publish(js, ev)
            await until(lambda: (inbox_row(database_url, ev["event_id"], H) or {}).get("status") == "PROCESSED", 15)
            info = await js.consumer_info("SEA_EVENTS", H)
    assert len(handler.calls) == 1
    assert info.num_redelivered == 0 and info.delivered.consumer_seq == 1


async def test_unreadable_messages_go_to_the_dlq_with_their_content(tmp_path, database_url, nats_server, handler):
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    cfg = consumer_config(database_url, nats_server.url, registry_file)
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            await js.publish("sea.event.order_created.v1", b'{"schema_version": 1}')  # no Nats-Msg-Id
            await js.publish(
                "sea.event.order_created.v1",
                b"not json",
                headers={"Nats-Msg-Id": "11111111-2222-3333-4444-555555555555"},
            )
            await js.publish("sea.event.order_created.v1", b"{}", headers={"Nats-Msg-Id": "not-a-uuid"})
            await until(lambda: consumer.metrics.value(H, "invalid") == 3)
            info = await acked_through(js, H, 3)  # the outcome is counted before its ack arrives
            dlq = await dlq_messages(js)
    assert handler.calls == []
    assert info.ack_floor.stream_seq == 3
    assert [m.subject for m in dlq] == [f"sea.dlq.dead.{H}.invalid"] * 3
    bodies = [json.loads(m.data) for m in dlq]
    assert all(b["reason"].startswith("INVALID_MESSAGE [OB020]") for b in bodies)
    assert [b["stream_sequence"] for b in bodies] == [1, 2, 3]
    assert bodies[1]["raw"]["body"] == "not json"


async def test_deliveries_that_consumers_died_holding_cost_the_message_nothing(
    tmp_path, database_url, nats_server, handler
):
    """Two consumers of release 0.3.0 died holding the message (deliveries 1
    and 2 of a durable with max_deliver 2): the consumer, binding the durable
    again without a delivery limit, calls the handler on delivery 3, since
    max_deliver counts the handler's failures, of which there were none."""
    from nats.js.api import AckPolicy, ConsumerConfig

    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    # not default: the test is about deliveries after ack_wait running out, against max_deliver 2
    cfg = consumer_config(database_url, nats_server.url, registry_file, ack_wait="1s", max_deliver="2")
    ev = event()
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        await js.add_consumer(
            "SEA_EVENTS",
            ConsumerConfig(
                durable_name=H,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=1.0,
                max_deliver=2,
                max_ack_pending=256,
                filter_subjects=["sea.event.order_created.v1"],
            ),
        )
        await publish(js, ev)
        doomed = await js.pull_subscribe_bind(H, "SEA_EVENTS")
        assert [m.metadata.num_delivered for m in await doomed.fetch(1, timeout=5)] == [1]
        assert [m.metadata.num_delivered for m in await doomed.fetch(1, timeout=5)] == [2]
        async with running_consumer(cfg) as consumer:
            info = await js.consumer_info("SEA_EVENTS", H)
            await until(lambda: consumer.metrics.value(H, "processed") == 1, 15, "the third delivery")
            dlq = await dlq_messages(js)
    assert info.config.max_deliver == -1
    assert [call.headers["Pgoutbox-Delivery"] for call in handler.calls] == ["3"]
    assert inbox_row(database_url, ev["event_id"], H)["status"] == "PROCESSED"
    assert dlq == []


async def test_payload_numbers_reach_the_handler_and_the_inbox_with_every_digit(
    tmp_path, database_url, nats_server, handler
):
    """The body is passed on as it came (after the checks), not re-encoded
    from Python values: a decimal Python would round reaches the handler,
    and the inbox, digit for digit."""
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    cfg = consumer_config(database_url, nats_server.url, registry_file)
    ev = event()
    body = b'{"amount": 12345678901234567890.123456789, "price": 1.10, "big": 123456789012345678901234567890}'
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            subject, _, headers = wire.to_nats(ev)
            await js.publish(subject, body, headers=headers)
            await until(lambda: consumer.metrics.value(H, "processed") == 1)
    [call] = handler.calls
    assert call.raw.endswith(b',"payload":' + body + b"}")
    with psycopg.connect(database_url) as conn:
        stored = conn.execute(
            "SELECT envelope->'payload'->>'amount', envelope->'payload'->>'price' FROM inbox.messages"
        ).fetchone()
    assert stored == ("12345678901234567890.123456789", "1.10")
