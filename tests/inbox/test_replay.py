"""Replay of dead letters: exponential backoff with bounded jitter,
the cap, the per-handler switch, operator redrive, and a replayer that dies
mid-pass."""

from __future__ import annotations

import asyncio
import json

import psycopg
import pytest

from pgoutbox.cli import main as cli
from pgoutbox.inbox import dlq as dlq_wire
from pgoutbox.inbox import store as inbox_store
from pgoutbox.inbox.metrics import ConsumerMetrics
from pgoutbox.inbox.replayer import Replayer
from pgoutbox.inbox.store import Inbox
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
from support.roles import login
from support.waiting import until

H = "billing"
SUBJECT = "sea.event.order_created.v1"


# -- the replayer against real servers --------------------------------------


def _notices(dlq):
    return [json.loads(m.data) for m in dlq if ".dlq.dead." in m.subject]


@pytest.mark.slow
async def test_a_dead_letter_is_replayed_with_backoff_until_the_cap(tmp_path, database_url, nats_server, handler):
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    cfg = consumer_config(
        database_url,
        nats_server.url,
        registry_file,
        # not default: the test is about the replay backoff; 300 ms doubling to a cap of
        # 500 ms, looked for every 100 ms, instead of 1 minute to 1 hour
        replay_base_delay="300ms",
        replay_max_delay="500ms",
        replay_poll_interval="100ms",
    )
    ev = event({"answers": [422]})
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            await publish(js, ev)
            await until(lambda: consumer.metrics.value(H, "dead_lettered") == 4, 20, "four dead letters")
            await asyncio.sleep(1.0)  # capped: nothing more comes
            dlq = await dlq_messages(js)
    calls = handler.calls_for(ev["event_id"])
    assert len(calls) == 4  # the first delivery and 3 replays
    notices = _notices(dlq)
    assert [n["dead_letters"] for n in notices] == [1, 2, 3, 4]
    assert [n["replay_attempts"] for n in notices] == [0, 1, 2, 3]
    delays = [n["next_replay_in_seconds"] for n in notices]
    # Ceilings 0.3, 0.6 -> capped 0.5, 0.5; jitter 0.5 keeps each in [ceiling/2, ceiling]; then the cap.
    assert 0.15 <= delays[0] <= 0.3 and 0.25 <= delays[1] <= 0.5 and 0.25 <= delays[2] <= 0.5
    assert delays[3] is None
    for before, after, delay in zip(calls, calls[1:], delays):
        assert after.at - before.at >= delay - 0.02  # never earlier than scheduled
    # Each replay is a fresh delivery of the same message on the handler's replay subject.
    assert all(c.body["message_id"] == ev["event_id"] and c.body["subject"] == SUBJECT for c in calls)
    assert [c.headers["Pgoutbox-Delivery"] for c in calls] == ["1"] * 4
    meta = inbox_row(database_url, ev["event_id"], H)["dlq_metadata"]
    assert (meta["replay_attempts"], meta["dead_letters"], meta["next_replay_at"]) == (3, 4, None)
    assert [m.subject for m in dlq if ".dlq.replay." in m.subject] == [f"sea.dlq.replay.{H}"] * 3


async def test_a_replay_reaches_only_its_handler_and_succeeds_once_fixed(tmp_path, database_url, nats_server):
    billing, audit = FakeHandler(answers=[422, 200]), FakeHandler(answers=[200])
    try:
        registry_file = write_registry(
            tmp_path,
            [
                {"name": H, "url": billing.url, "subjects": [SUBJECT]},
                {"name": "audit", "url": audit.url, "subjects": [SUBJECT]},
            ],
        )
        cfg = consumer_config(
            database_url, nats_server.url, registry_file, replay_base_delay="200ms", replay_poll_interval="100ms"
        )  # not default: the test is about automated replay, so it comes within a second
        ev = event()
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            async with running_consumer(cfg):
                await publish(js, ev)
                await until(lambda: (inbox_row(database_url, ev["event_id"], H) or {}).get("status") == "PROCESSED", 15)
                await asyncio.sleep(0.3)
    finally:
        billing.close()
        audit.close()
    assert len(billing.calls) == 2 and len(audit.calls) == 1
    row = inbox_row(database_url, ev["event_id"], H)
    assert row["dlq_metadata"]["replay_attempts"] == 1 and row["attempts"] == 2
    assert inbox_row(database_url, ev["event_id"], "audit")["attempts"] == 1


async def test_a_manifest_cap_of_zero_parks_the_dead_letter(tmp_path, database_url, nats_server, handler):
    registry_file = write_registry(  # not default: the test is about a manifest's replay_max_attempts of 0
        tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT], "replay_max_attempts": 0}]
    )
    cfg = consumer_config(
        database_url, nats_server.url, registry_file, replay_base_delay="100ms", replay_poll_interval="100ms"
    )  # not default: the test is about automated replay, so it comes within a second
    ev = event({"answers": [422, 200]})
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            await publish(js, ev)
            await until(lambda: consumer.metrics.value(H, "dead_lettered") == 1)
            await asyncio.sleep(0.5)
            dlq = await dlq_messages(js)
    assert len(handler.calls) == 1
    assert _notices(dlq)[0]["next_replay_in_seconds"] is None
    assert inbox_row(database_url, ev["event_id"], H)["dlq_metadata"]["next_replay_at"] is None


def _due(database_url: str, message_id: str) -> bool:
    """The dead letter's automated replay has fallen due (the database's clock)."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT (dlq_metadata->>'next_replay_at')::timestamptz <= now() FROM inbox.messages"
            " WHERE message_id = %s AND handler = %s",
            (message_id, H),
        ).fetchone()
    return bool(row and row[0])


def _count_passes(replayer) -> list[int]:
    """Counts the replayer's passes from now on (a one-element list the test reads)."""
    passes = [0]
    run_once = replayer.run_once

    async def counted() -> int:
        n = await run_once()
        passes[0] += 1
        return n

    replayer.run_once = counted
    return passes


async def test_switched_off_replay_waits_for_an_operator_redrive_with_a_reason(
    tmp_path, database_url, nats_server, handler
):
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    cfg = consumer_config(
        database_url, nats_server.url, registry_file, replay_base_delay="100ms", replay_poll_interval="100ms"
    )  # not default: the test is about automated replay, so it comes within a second
    db = ["--database-url", login(database_url, "pgoutbox_admin")]
    assert await asyncio.to_thread(cli.main, ["replay-switch", H, "off", "--reason", "bug 12 under analysis", *db]) == 0
    ev = event({"answers": [422, 200]})
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            await publish(js, ev)
            await until(lambda: consumer.metrics.value(H, "dead_lettered") == 1)
            # Due, but switched off: two whole replayer passes after it fell due leave it alone.
            await until(lambda: _due(database_url, ev["event_id"]), 10, "the replay to fall due")
            passes = _count_passes(consumer.replayer)
            await until(lambda: passes[0] >= 2, 10, "two replayer passes")
            assert len(handler.calls) == 1
            assert await asyncio.to_thread(cli.main, ["redrive", H, ev["event_id"], *db]) == 2  # no reason
            assert (
                await asyncio.to_thread(
                    cli.main, ["redrive", H, ev["event_id"], "--reason", "fixed in 2.1, checked on staging", *db]
                )
                == 0
            )
            await until(lambda: (inbox_row(database_url, ev["event_id"], H) or {}).get("status") == "PROCESSED", 15)
    assert len(handler.calls) == 2
    meta = inbox_row(database_url, ev["event_id"], H)["dlq_metadata"]
    assert (meta["redrives"], meta["replay_attempts"]) == (1, 0)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT handler, reason FROM inbox.redrive_log").fetchall() == [
            (H, "fixed in 2.1, checked on staging")
        ]
    # A redrive of a message that is no longer dead-lettered is refused with its code.
    assert await asyncio.to_thread(cli.main, ["redrive", H, ev["event_id"], "--reason", "again", *db]) == 2


async def test_a_replayer_dying_before_its_commit_loses_nothing(tmp_path, database_url, nats_server, handler):
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    # not default: the test runs its own replayer on a dead letter due at once
    cfg = consumer_config(database_url, nats_server.url, registry_file, replay_base_delay="50ms", run_replayer="false")
    ev = event({"answers": [422, 200]})
    pool = inbox_store.pool(database_url, 1)
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            await publish(js, ev)
            await until(lambda: consumer.metrics.value(H, "dead_lettered") == 1)
            await until(lambda: _due(database_url, ev["event_id"]), 10, "the replay to fall due")
            replayer = Replayer(
                inbox=Inbox(pool),
                js=js,
                metrics=ConsumerMetrics(),
                worker="doomed",
                batch_size=10,
                poll_interval=1,
                dlq_max_age=3600,
                dlq_duplicate_window=60,
            )
            with pytest.raises(RuntimeError):
                async with replayer.inbox.claimed_replays("doomed", 10) as rows:
                    assert len(rows) == 1
                    subject, body, headers = dlq_wire.replay_message(rows[0])
                    await js.publish(subject, body, headers=headers)
                    # The consumer's inbox.receive() waits on the claimed row's lock...
                    with psycopg.connect(database_url, autocommit=True) as conn:  # fresh stats per query
                        await until(
                            lambda: (
                                conn.execute(
                                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                ).fetchone()[0]
                                == 1
                            ),
                            10,
                            "the consumer to wait on the claimed row",
                        )
                    raise RuntimeError("replayer dies before committing")
            # ...and, after the rollback, finds the row still parked and skips the message.
            await until(lambda: consumer.metrics.value(H, "parked") == 1)
            assert len(handler.calls) == 1
            # The next pass publishes again under a new Nats-Msg-Id: not dropped as a duplicate.
            assert await replayer.run_once() == 1
            await until(lambda: (inbox_row(database_url, ev["event_id"], H) or {}).get("status") == "PROCESSED", 15)
    await pool.close()
    assert len(handler.calls) == 2
    assert inbox_row(database_url, ev["event_id"], H)["dlq_metadata"]["replay_attempts"] == 1


def _dead_letter(database_url: str, envelope: dict) -> str:
    """A dead letter due for replay, recorded through the inbox functions."""
    message_id = envelope["message_id"]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "SELECT inbox.receive(%s, %s, %s, %s)",
            (message_id, H, SUBJECT, psycopg.types.json.Jsonb(envelope)),
        )
        conn.execute("SELECT inbox.record_error(%s, %s, 'HTTP 422', TRUE, interval '0')", (message_id, H))
    return message_id


async def test_a_dead_letter_no_replay_can_carry_is_parked_and_the_pass_replays_the_others(database_url, nats_server):
    """A stored envelope whose tenant ends in U+00A0 (admitted before the
    consumer refused such values; a NATS client strips it when publishing):
    its replay cannot be built. That is its own permanent outcome, coded,
    while the same pass replays the dead letters beside it."""
    from pgoutbox.core import wire

    def envelope(tenant: str) -> dict:
        ev = event()
        return {**wire.from_nats(*wire.to_nats(ev)), "tenant_id": tenant}

    good = [_dead_letter(database_url, envelope("t1")), _dead_letter(database_url, envelope("t2"))]
    odd = _dead_letter(database_url, envelope("t\u00a0"))
    pool = inbox_store.pool(database_url, 1)
    try:
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            replayer = Replayer(
                inbox=Inbox(pool),
                js=js,
                metrics=ConsumerMetrics(),
                worker="replayer",
                batch_size=10,
                poll_interval=1,
                dlq_max_age=3600,
                dlq_duplicate_window=60,
            )
            assert await replayer.run_once() == 2
            replays = await dlq_messages(js, subject=f"sea.dlq.replay.{H}")
    finally:
        await pool.close()
    assert sorted(m.headers["Nats-Msg-Id"].split(":")[0] for m in replays) == sorted(good)
    row = inbox_row(database_url, odd, H)
    assert row["status"] == "DEAD_LETTER"
    assert row["last_error"].startswith("REPLAY_UNBUILDABLE: WireError: BAD_HEADER: header Pgoutbox-Tenant-Id")
    assert row["dlq_metadata"]["next_replay_at"] is None  # parked: not tried again pass after pass
    assert [inbox_row(database_url, m, H)["status"] for m in good] == ["RECEIVED", "RECEIVED"]


async def test_a_redrive_of_an_in_database_dead_letter_is_refused_with_its_code(database_url, capsys):
    """An in-database handler's dead letter would be replayed to a subject
    only the pgoutbox consumer reads: redrive refuses it (OB031), in one line."""
    from pgoutbox.inbox.in_database import handle_in_transaction

    async def apply(conn, envelope):
        raise ValueError("negative order total")

    ev = event()
    envelope = {"message_id": ev["event_id"], "subject": SUBJECT, "payload": {}}
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        with pytest.raises(ValueError):
            await handle_in_transaction(conn, H, envelope, apply, last_delivery=True)
    row = inbox_row(database_url, ev["event_id"], H)
    assert (row["status"], row["dlq_metadata"]["in_database"]) == ("DEAD_LETTER", True)
    code = await asyncio.to_thread(
        cli.main,
        ["redrive", H, ev["event_id"], "--reason", "retry it", "--database-url", login(database_url, "pgoutbox_admin")],
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "OB031" in err[0] and "in-database handler" in err[0]
    assert inbox_row(database_url, ev["event_id"], H)["status"] == "DEAD_LETTER"
