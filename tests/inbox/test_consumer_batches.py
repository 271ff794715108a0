"""The batched inbox path (inbox.receive_batch, inbox.settle): what the SQL
functions do, the per-message fallback (a refused batch, a schema 7
database), the batched in-database handler, and several consumer processes
sharing one durable."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
import uuid

import psycopg
import pytest
from psycopg.rows import dict_row

from pgoutbox import OLDEST_SCHEMA
from pgoutbox.core import migrate
from pgoutbox.core.backoff import Backoff
from pgoutbox.inbox import store as inbox_store
from pgoutbox.inbox.database_gate import DatabaseGate
from pgoutbox.inbox.flow import Admitted, MessageFlow
from pgoutbox.inbox.handler_client import request_body
from pgoutbox.inbox.in_database import handle_batch_in_transaction
from pgoutbox.inbox.metrics import ConsumerMetrics
from pgoutbox.inbox.store import Inbox
from support.inbox import (
    FakeHandler,
    add_stream,
    consumer_config,
    consumer_metric,
    event,
    inbox_row,
    jetstream,
    publish,
    running_consumer,
    write_registry,
)
from support.roles import login
from support.waiting import until
from support.workers import worker

H = "billing"
SUBJECT = "sea.event.order_created.v1"


def _envelope(message_id: str | None = None, subject: str = SUBJECT) -> dict:
    return {"message_id": message_id or str(uuid.uuid4()), "subject": subject, "payload": {"n": 1}, "trace": {}}


def _receive_batch(conn, envelopes: list[dict], handler: str = H) -> list[dict]:
    return conn.execute(
        "SELECT * FROM inbox.receive_batch(%s, %s::uuid[], %s::text[], %s::jsonb[])",
        (
            handler,
            [e["message_id"] for e in envelopes],
            [e["subject"] for e in envelopes],
            [psycopg.types.json.Jsonb(e) for e in envelopes],
        ),
    ).fetchall()


def test_receive_batch_records_a_fetch_and_returns_each_row_in_order(database_url):
    done, repeated, new = (_envelope() for _ in range(3))
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT inbox.receive(%s, %s, %s)", (done["message_id"], H, SUBJECT))
        conn.execute("SELECT inbox.mark_processed(%s, %s)", (done["message_id"], H))
        conn.execute("SELECT inbox.receive(%s, %s, %s)", (repeated["message_id"], H, SUBJECT))
        rows = _receive_batch(conn, [new, done, repeated, new])
        stored = conn.execute(
            "SELECT envelope FROM inbox.messages WHERE message_id = %s", (new["message_id"],)
        ).fetchone()
    assert [r["ordinal"] for r in rows] == [1, 2, 3, 4]
    assert [(str(r["message_id"]), r["status"], r["attempts"]) for r in rows] == [
        (new["message_id"], "RECEIVED", 1),  # an id given twice is recorded once
        (done["message_id"], "PROCESSED", 1),  # a duplicate: not counted
        (repeated["message_id"], "RECEIVED", 2),  # a redelivery: counted
        (new["message_id"], "RECEIVED", 1),
    ]
    assert stored["envelope"] == new


def test_receive_batch_refuses_the_whole_batch_for_one_bad_value_with_a_code(database_url):
    with psycopg.connect(database_url, autocommit=True) as conn:
        for handler, batch in (
            (H, [_envelope(), _envelope(subject="sea.event.with space.v1")]),
            (H, [_envelope(subject="")]),
            ("not a name", [_envelope()]),
        ):
            with pytest.raises(psycopg.Error) as caught:
                _receive_batch(conn, batch, handler=handler)
            assert caught.value.sqlstate == "OB020"
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("SELECT * FROM inbox.receive_batch(%s, %s::uuid[], '{}', '{}')", (H, [str(uuid.uuid4())]))
        assert caught.value.sqlstate == "OB006"
        assert conn.execute("SELECT count(*) FROM inbox.messages").fetchone() == (0,)


def test_settle_moves_what_is_still_open_and_returns_only_that(database_url):
    ok, failing, settled = (_envelope() for _ in range(3))
    with psycopg.connect(database_url, autocommit=True) as conn:
        _receive_batch(conn, [ok, failing, settled])
        conn.execute("SELECT inbox.mark_processed(%s, %s)", (settled["message_id"], H))
        moved = conn.execute(
            "SELECT message_id::text, status FROM inbox.settle(%s, %s::uuid[], %s::uuid[], %s::text[])",
            (H, [ok["message_id"], settled["message_id"]], [failing["message_id"]], ["HTTP 500"]),
        ).fetchall()
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("SELECT * FROM inbox.settle(%s, '{}', %s::uuid[], %s::text[])", (H, [ok["message_id"]], [" "]))
        assert caught.value.sqlstate == "OB006"
    assert sorted(moved) == sorted([(ok["message_id"], "PROCESSED"), (failing["message_id"], "FAILED")])
    row = inbox_row(database_url, failing["message_id"], H)
    assert row["status"] == "FAILED" and row["last_error"] == "HTTP 500" and row["processed_at"] is None
    assert inbox_row(database_url, ok["message_id"], H)["processed_at"] is not None


async def test_a_refused_batch_is_received_one_by_one_and_only_the_bad_message_is_refused(database_url):
    pool = inbox_store.pool(database_url, 2)
    try:
        inbox = Inbox(pool)
        await inbox.schema_version()
        assert inbox.batches
        flow = MessageFlow(
            inbox=inbox,
            client=None,  # type: ignore[arg-type]  # no handler call here
            nc=None,
            js=None,
            metrics=ConsumerMetrics(),
            retry_backoff=Backoff(0.1, 1),
            replay_backoff=Backoff(0.1, 1),
            stopping=asyncio.Event(),
            gate=DatabaseGate(inbox.schema_version),
        )
        good, bad = _envelope(), _envelope(subject="x" * 1100)
        admitted = [Admitted(None, e, 1, request_body(e)) for e in (good, bad)]
        rows = await flow._receive_all(
            type("H", (), {"name": H, "spec": type("S", (), {"version": None})()})(), admitted
        )  # type: ignore[arg-type]
    finally:
        await pool.close()
    assert rows[0]["status"] == "RECEIVED"
    assert isinstance(rows[1], str) and "OB020" in rows[1]
    assert inbox_row(database_url, bad["message_id"], H) is None


async def test_on_schema_7_the_consumer_records_and_settles_message_by_message(
    tmp_path, empty_database_url, nats_server, handler
):
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        migrate.migrate(conn, target=OLDEST_SCHEMA)  # the oldest this consumer runs on
        assert conn.execute("SELECT to_regproc('inbox.receive_batch')").fetchone() == (None,)
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    cfg = consumer_config(empty_database_url, nats_server.url, registry_file)
    events = [event(), event({"answers": [500, 200]}), event({"answers": [422]})]
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            assert not consumer.inbox.batches
            for ev in events:
                await publish(js, ev)

            def statuses():
                return [(inbox_row(empty_database_url, ev["event_id"], H) or {}).get("status") for ev in events]

            await until(lambda: statuses() == ["PROCESSED", "PROCESSED", "DEAD_LETTER"], 15, "outcomes")
    assert [len(handler.calls_for(ev["event_id"])) for ev in events] == [1, 2, 1]


async def test_a_batch_in_the_database_applies_each_new_message_once_and_isolates_a_failure(database_url):
    first, again, failing = _envelope(), _envelope(), _envelope()
    failing["payload"] = {"n": -1}
    applied: list[str] = []

    async def apply(conn, envelope):
        if envelope["payload"]["n"] < 0:
            raise ValueError("negative")
        applied.append(envelope["message_id"])

    conn = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        # A duplicate in the same batch, and an earlier-processed message: applied once.
        outcomes = await handle_batch_in_transaction(conn, H, [first, again, first], apply)
        assert outcomes == ["processed", "processed", "duplicate"]
        assert await handle_batch_in_transaction(conn, H, [again], apply) == ["duplicate"]
        # A failing apply rolls the batch back; each is then tried on its own.
        applied.clear()
        second = _envelope()
        outcomes = await handle_batch_in_transaction(conn, H, [second, failing], apply, last_deliveries=[False, True])
    finally:
        await conn.close()
    assert outcomes[0] == "processed" and isinstance(outcomes[1], ValueError)
    assert applied == [second["message_id"], second["message_id"]]  # once rolled back, once committed
    assert inbox_row(database_url, second["message_id"], H)["status"] == "PROCESSED"
    row = inbox_row(database_url, failing["message_id"], H)
    assert row["status"] == "DEAD_LETTER" and row["last_error"] == "ValueError: negative"


def _receive_processed(conn, envelopes: list[dict]) -> list[tuple]:
    return conn.execute(
        "SELECT ordinal, message_id::text, status FROM inbox.receive_processed(%s, %s::uuid[], %s::text[], %s::jsonb[])",
        (
            H,
            [e["message_id"] for e in envelopes],
            [e["subject"] for e in envelopes],
            [psycopg.types.json.Jsonb(e) for e in envelopes],
        ),
    ).fetchall()


def test_receive_processed_writes_new_rows_processed_and_returns_only_those_it_did_not_record(database_url):
    new, done, failed, parked, dropped = (_envelope() for _ in range(5))
    with psycopg.connect(database_url, autocommit=True) as conn:
        for e in (done, failed, parked):
            conn.execute("SELECT inbox.receive(%s, %s, %s)", (e["message_id"], H, SUBJECT))
        conn.execute("SELECT inbox.mark_processed(%s, %s)", (done["message_id"], H))
        conn.execute("SELECT inbox.record_error(%s, %s, 'HTTP 500')", (failed["message_id"], H))
        conn.execute("SELECT inbox.record_error(%s, %s, 'poison', dead => true)", (parked["message_id"], H))
        with conn.transaction():
            skipped = _receive_processed(conn, [new, done, failed, parked, new])
        # Rolled back with the business change: nothing of the call is kept.
        with pytest.raises(RuntimeError), conn.transaction():
            assert _receive_processed(conn, [dropped]) == []
            raise RuntimeError("the business change fails")
        assert _receive_processed(conn, []) == []
    assert skipped == [
        (2, done["message_id"], "PROCESSED"),  # a duplicate
        (4, parked["message_id"], "DEAD_LETTER"),
        (5, new["message_id"], "PROCESSED"),  # the same id earlier in this call
    ]
    row = inbox_row(database_url, new["message_id"], H)
    assert (row["status"], row["attempts"], row["envelope"]) == ("PROCESSED", 1, new)
    assert row["processed_at"] >= row["received_at"]
    row = inbox_row(database_url, failed["message_id"], H)  # a redelivery after a failure: counted
    assert (row["status"], row["attempts"], row["last_error"]) == ("PROCESSED", 2, None)
    assert inbox_row(database_url, done["message_id"], H)["attempts"] == 1
    assert inbox_row(database_url, parked["message_id"], H)["status"] == "DEAD_LETTER"
    assert inbox_row(database_url, dropped["message_id"], H) is None


@pytest.mark.parametrize("first_commits", [True, False])
async def test_receive_processed_waits_on_a_concurrent_delivery_then_sees_its_outcome(database_url, first_commits):
    """A second delivery of the same message, while the first transaction is
    open: it waits, then finds the row PROCESSED (first committed: a
    duplicate) or records it itself (first rolled back)."""
    e = _envelope()
    args = (H, [e["message_id"]], [SUBJECT], [psycopg.types.json.Jsonb(e)])
    query = "SELECT ordinal, status FROM inbox.receive_processed(%s, %s::uuid[], %s::text[], %s::jsonb[])"
    first = await psycopg.AsyncConnection.connect(database_url)
    second = await psycopg.AsyncConnection.connect(database_url)
    try:
        assert await (await first.execute(query, args)).fetchall() == []
        waiting = asyncio.ensure_future(second.execute(query, args))
        pid = second.info.backend_pid

        def blocked() -> bool:  # the event itself: PostgreSQL has the second session wait on a lock
            with psycopg.connect(database_url, autocommit=True) as c:
                row = c.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            return bool(row) and row[0] == "Lock"

        await until(lambda: asyncio.to_thread(blocked), 10, "the second delivery to wait on the first one's row")
        assert not waiting.done()  # blocked on the first one's uncommitted row
        await (first.commit() if first_commits else first.rollback())
        rows = await (await asyncio.wait_for(waiting, 10)).fetchall()
        await second.commit()
    finally:
        await first.close()
        await second.close()
    assert rows == ([(1, "PROCESSED")] if first_commits else [])
    row = inbox_row(database_url, e["message_id"], H)
    assert (row["status"], row["attempts"]) == ("PROCESSED", 1)


async def test_a_batch_in_the_database_skips_parked_messages_and_retries_failed_ones(database_url):
    failed, parked = _envelope(), _envelope()
    applied: list[str] = []

    async def apply(conn, envelope):
        applied.append(envelope["message_id"])

    with psycopg.connect(database_url, autocommit=True) as sync:
        for e in (failed, parked):
            sync.execute("SELECT inbox.receive(%s, %s, %s)", (e["message_id"], H, SUBJECT))
        sync.execute("SELECT inbox.record_error(%s, %s, 'timeout')", (failed["message_id"], H))
        sync.execute("SELECT inbox.record_error(%s, %s, 'poison', dead => true)", (parked["message_id"], H))
    conn = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        assert await handle_batch_in_transaction(conn, H, [parked, failed], apply) == ["parked", "processed"]
        assert await handle_batch_in_transaction(conn, H, [failed], apply) == ["duplicate"]
    finally:
        await conn.close()
    assert applied == [failed["message_id"]]
    assert inbox_row(database_url, failed["message_id"], H)["status"] == "PROCESSED"
    assert inbox_row(database_url, parked["message_id"], H)["status"] == "DEAD_LETTER"


@pytest.mark.slow
async def test_two_consumer_processes_on_one_durable_process_every_message_exactly_once(
    tmp_path, database_url, nats_server
):
    handler = FakeHandler()
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [SUBJECT]}])
    settings = {
        "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_consumer"),
        "OUTBOX_NATS_URL": nats_server.url,
        "OUTBOX_REGISTRY_FILE": str(registry_file),
        "OUTBOX_CONSUMER_HTTP_PORT": "0",  # any free port, the one it took read from its start line
    }
    events = [event({"delay": 0.005}) for _ in range(300)]
    try:
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            with contextlib.ExitStack() as stack:
                ports = []
                for i in range(2):
                    folder = tmp_path / f"consumer{i}"
                    folder.mkdir()
                    ports.append(stack.enter_context(worker(folder, "consume", '"consumer started"', **settings)))
                await until(lambda: _ready(ports), 30, "both consumers ready")
                for ev in events:
                    await publish(js, ev)

                def processed() -> int:
                    with psycopg.connect(database_url) as conn:
                        row = conn.execute("SELECT count(*) FROM inbox.messages WHERE status = 'PROCESSED'").fetchone()
                    return row[0] if row else 0

                await until(lambda: processed() == len(events), 60, "every message processed")
                await until(
                    lambda: sum(consumer_metric(p, H, "processed") for p in ports) == len(events),
                    10,
                    "every ack counted",
                )
                shares = [consumer_metric(p, H, "processed") for p in ports]
    finally:
        handler.close()
    assert sorted(c.message_id for c in handler.calls) == sorted(ev["event_id"] for ev in events)
    assert all(share > 0 for share in shares), shares


def _ready(ports: list[int]) -> bool:
    for port in ports:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1)
        except OSError:
            return False
    return True
