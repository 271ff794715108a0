"""Upcasters end to end, as an operator runs pgoutbox: the application emits
v1 and v2 events (a login holding pgoutbox_writer only), `pgoutbox relay`
(pgoutbox_relay only) publishes them, `pgoutbox consume` (pgoutbox_consumer
only) hands them to handlers whose manifests declare `version = 2`; both
processes on their defaults (only addresses and ports given). The upcaster is
registered by a login holding pgoutbox_admin only.

  * billing (order_created v1 and v2, version = 2, an upcaster that renames
    amount to total and raises on an amount that is not a number): every
    payload it receives is a v2 one, the upcast ones included, each message
    exactly once; the header says which version each came in at; the two
    messages the upcaster raises on are dead-lettered (UPCAST_FAILED), only
    they;
  * shipping (order_shipped v1 and v2, version = 2, no upcaster registered):
    its v1 messages are dead-lettered (UPCAST_MISSING), its v2 ones handled.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from support.inbox import FakeHandler, add_stream, dlq_messages, jetstream, write_registry
from support.waiting import until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

UPCASTER = """
CREATE SCHEMA app;
-- order_created v1 {"amount": n} -> v2 {"total": n}; raises on an amount that is no number.
CREATE FUNCTION app.order_created_v1_v2(p jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE
AS $$
    SELECT (p - 'amount')
        || jsonb_build_object('total', (p ->> 'amount')::numeric, 'schema_version', 2)
$$;
"""


class Worker:
    """`python -m pgoutbox.cli.main <command>` with the defaults and the given addresses."""

    def __init__(self, command: str, log: Path, env: dict[str, str], ready: str):
        self.command, self.log, self.ready = command, log, ready
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
        self._out = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pgoutbox.cli.main", command],
            env={**base, **env},
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    async def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.ready not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None, f"{self.command} exited: {self.log.read_text(errors='replace')[-2000:]}"
            assert time.monotonic() < deadline, f"{self.command} did not start within {timeout}s"
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


@pytest.fixture
def logins(database_url):
    """One login per role, each a member of that pgoutbox role only (roles are
    cluster-wide: the names are this test's own)."""
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"up_{role}_{suffix}" for role in ("writer", "relay", "consumer", "admin")}
    with psycopg.connect(database_url, autocommit=True) as conn:
        for role, name in names.items():
            conn.execute(f"CREATE ROLE {name} LOGIN IN ROLE pgoutbox_{role}")
        conn.execute(UPCASTER)
        conn.execute(f"GRANT USAGE ON SCHEMA app TO {names['admin']}")
    base = database_url.replace("postgresql://postgres@", "postgresql://{}@", 1)
    assert base != database_url, database_url
    yield {role: base.format(name) for role, name in names.items()}
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA app CASCADE")
        for name in names.values():
            conn.execute(f"DROP OWNED BY {name}")
            conn.execute(f"DROP ROLE {name}")


def _emit(url: str, events: list[tuple[str, int, dict]]) -> list[str]:
    """(event_type, version, payload) emitted in order, in one transaction; their ids."""
    with psycopg.connect(url) as conn:
        return [
            str(
                conn.execute(
                    "SELECT outbox.emit('order', %s, %s, %s, context => 'sea', event_version => %s)",
                    (str(i), event_type, Jsonb(payload), version),
                ).fetchone()[0]
            )
            for i, (event_type, version, payload) in enumerate(events)
        ]


def _inbox(database_url: str) -> dict[tuple[str, str], tuple[str, str | None]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute("SELECT message_id::text, handler, status, last_error FROM inbox.messages").fetchall()
    return {(r[0], r[1]): (r[2], r[3]) for r in rows}


async def test_a_handler_declaring_version_2_gets_only_v2_payloads_each_once(
    tmp_path, database_url, logins, nats_server
):
    billing, shipping = FakeHandler(), FakeHandler()
    workers: list[Worker] = []
    try:
        with psycopg.connect(logins["admin"], autocommit=True) as conn:
            conn.execute("SELECT inbox.register_upcaster('order_created', 1, 'app.order_created_v1_v2(jsonb)')")
        registry = write_registry(
            tmp_path,
            [
                {
                    "name": "billing",
                    "url": billing.url,
                    "subjects": ["sea.event.order_created.v1", "sea.event.order_created.v2"],
                    "version": 2,
                },
                {
                    "name": "shipping",
                    "url": shipping.url,
                    "subjects": ["sea.event.order_shipped.v1", "sea.event.order_shipped.v2"],
                    "version": 2,
                },
            ],
        )
        # The stream holds v1 and v2 events, interleaved, before any consumer runs.
        events: list[tuple[str, int, dict]] = []
        for i in range(20):
            events.append(("order_created", 1, {"schema_version": 1, "amount": i}))
            events.append(("order_created", 2, {"schema_version": 2, "total": 100 + i}))
            if i % 4 == 0:
                events.append(("order_shipped", 1 + i % 8 // 4, {"schema_version": 1, "n": i}))
        events.insert(7, ("order_created", 1, {"schema_version": 1, "amount": "twelve"}))
        events.insert(30, ("order_created", 1, {"schema_version": 1, "amount": [1]}))
        ids = _emit(logins["writer"], events)
        kinds = dict(zip(ids, events, strict=True))
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            common = {"OUTBOX_NATS_URL": nats_server.url}
            relay = Worker(
                "relay",
                tmp_path / "relay.log",
                {**common, "OUTBOX_DATABASE_URL": logins["relay"], "OUTBOX_RELAY_HTTP_PORT": "0"},
                '"action": "started"',
            )
            workers.append(relay)
            consumer = Worker(
                "consume",
                tmp_path / "consumer.log",
                {
                    **common,
                    "OUTBOX_DATABASE_URL": logins["consumer"],
                    "OUTBOX_REGISTRY_FILE": str(registry),
                    "OUTBOX_CONSUMER_HTTP_PORT": "0",
                },
                "consumer started",
            )
            workers.append(consumer)
            await relay.wait_ready()
            await consumer.wait_ready()

            def settled() -> bool:
                rows = _inbox(database_url)
                wanted = [(i, "billing" if kinds[i][0] == "order_created" else "shipping") for i in ids]
                return all(rows.get(key, ("",))[0] in ("PROCESSED", "DEAD_LETTER") for key in wanted)

            await until(settled, 60, "every message settled")
            await asyncio.sleep(1.0)  # any stray second call would show now
            dlq = await dlq_messages(js)

        rows = _inbox(database_url)
        broken = {
            i for i, (t, v, p) in kinds.items() if t == "order_created" and v == 1 and not isinstance(p["amount"], int)
        }
        upcast = {i for i, (t, v, p) in kinds.items() if t == "order_created" and v == 1} - broken
        native = {i for i, (t, v, _) in kinds.items() if t == "order_created" and v == 2}
        shipped_v1 = {i for i, (t, v, _) in kinds.items() if t == "order_shipped" and v == 1}
        shipped_v2 = {i for i, (t, v, _) in kinds.items() if t == "order_shipped" and v == 2}
        assert len(broken) == 2 and len(upcast) == 20 and len(native) == 20 and shipped_v1 and shipped_v2

        # billing: every payload a v2 one, each message once, the version it came in at in a header.
        calls = collections.Counter(c.message_id for c in billing.calls)
        assert dict(calls) == dict.fromkeys(upcast | native, 1)
        for call in billing.calls:
            payload = call.body["payload"]
            assert call.body["event_version"] == 2 and "amount" not in payload, call.body
            if call.message_id in upcast:
                assert payload == {"schema_version": 2, "total": kinds[call.message_id][2]["amount"]}
                assert call.headers["Pgoutbox-Received-Version"] == "1"
            else:
                assert payload == kinds[call.message_id][2]
                assert call.headers["Pgoutbox-Received-Version"] == "2"
        assert {i for i in upcast | native if rows[(i, "billing")][0] == "PROCESSED"} == upcast | native
        # The broken upcaster's messages, and only they, are dead letters naming the type and versions.
        for i in broken:
            status, error = rows[(i, "billing")]
            assert status == "DEAD_LETTER" and error.startswith("UPCAST_FAILED [OB072]: order_created v1 -> v2"), error
        # shipping: no upcaster, so its v1 messages are dead letters; its v2 ones are handled once.
        assert collections.Counter(c.message_id for c in shipping.calls) == dict.fromkeys(shipped_v2, 1)
        for i in shipped_v1:
            status, error = rows[(i, "shipping")]
            assert status == "DEAD_LETTER" and error.startswith(
                "UPCAST_MISSING [OB071]: no upcaster for order_shipped v1 -> v2"
            ), error
        noticed = {m.headers["Nats-Msg-Id"].split(":", 1)[0] for m in dlq if m.headers}
        assert broken | shipped_v1 <= noticed, "each dead letter has its DLQ notice"
        dead = {key for key, (status, _) in rows.items() if status == "DEAD_LETTER"}
        assert dead == {(i, "billing") for i in broken} | {(i, "shipping") for i in shipped_v1}
    finally:
        for w in workers:
            w.stop()
        billing.close()
        shipping.close()


PICKY = """
-- reading_taken v1 -> v2; fails on {"n": 3} with an ASSERT (P0004, which
-- PL/pgSQL's OTHERS does not catch) and on {"n": 4} with a custom SQLSTATE.
CREATE FUNCTION app.reading_v1_v2(p jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    ASSERT (p ->> 'n')::integer <> 3, 'three is not a reading';
    IF (p ->> 'n')::integer = 4 THEN
        RAISE EXCEPTION 'four is not a reading' USING ERRCODE = 'AB123';
    END IF;
    RETURN p || '{"schema_version": 2}';
END
$$;
"""


async def test_an_upcaster_assert_or_custom_raise_dead_letters_that_message_only(
    tmp_path, database_url, logins, nats_server
):
    """One fetch of six v1 messages for a handler that wants v2: the upcaster
    fails with an ASSERT on one and a RAISE with a custom SQLSTATE on another.
    Each of those two is UPCAST_FAILED with the error's code and text, a dead
    letter delivered once, with its DLQ notice; the four others are
    PROCESSED, each handed to the handler once as v2. The consumer on its
    defaults, as a login holding pgoutbox_consumer only."""
    meter = FakeHandler()
    workers: list[Worker] = []
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(PICKY)
        with psycopg.connect(logins["admin"], autocommit=True) as conn:
            conn.execute("SELECT inbox.register_upcaster('reading_taken', 1, 'app.reading_v1_v2(jsonb)')")
        registry = write_registry(
            tmp_path,
            [{"name": "meter", "url": meter.url, "subjects": ["sea.event.reading_taken.v1"], "version": 2}],
        )
        # All six in the stream before the consumer starts: its first fetch takes them together.
        ids = _emit(logins["writer"], [("reading_taken", 1, {"schema_version": 1, "n": n}) for n in range(1, 7)])
        by_n = dict(zip(range(1, 7), ids, strict=True))
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            common = {"OUTBOX_NATS_URL": nats_server.url}
            relay = Worker(
                "relay",
                tmp_path / "relay.log",
                {**common, "OUTBOX_DATABASE_URL": logins["relay"], "OUTBOX_RELAY_HTTP_PORT": "0"},
                '"action": "started"',
            )
            workers.append(relay)
            await relay.wait_ready()

            async def in_stream() -> bool:
                return (await js.stream_info("SEA_EVENTS")).state.messages >= len(ids)

            await until(in_stream, 60, "the six events in the stream")
            consumer = Worker(
                "consume",
                tmp_path / "consumer.log",
                {
                    **common,
                    "OUTBOX_DATABASE_URL": logins["consumer"],
                    "OUTBOX_REGISTRY_FILE": str(registry),
                    "OUTBOX_CONSUMER_HTTP_PORT": "0",
                },
                "consumer started",
            )
            workers.append(consumer)
            await consumer.wait_ready()

            def settled() -> bool:
                rows = _inbox(database_url)
                return all(rows.get((i, "meter"), ("",))[0] in ("PROCESSED", "DEAD_LETTER") for i in ids)

            async def noticed() -> bool:
                return len(await dlq_messages(js)) >= 2

            await until(settled, 60, "every message settled")
            await until(noticed, 30, "the two DLQ notices")
            dlq = await dlq_messages(js)

        rows = _inbox(database_url)
        assert rows[(by_n[3], "meter")] == (
            "DEAD_LETTER",
            "UPCAST_FAILED [OB072]: reading_taken v1 -> v2: app.reading_v1_v2(jsonb) raised [P0004] "
            "three is not a reading",
        )
        assert rows[(by_n[4], "meter")] == (
            "DEAD_LETTER",
            "UPCAST_FAILED [OB072]: reading_taken v1 -> v2: app.reading_v1_v2(jsonb) raised [AB123] "
            "four is not a reading",
        )
        good = {by_n[n] for n in (1, 2, 5, 6)}
        assert {i for i in good if rows[(i, "meter")][0] == "PROCESSED"} == good
        calls = collections.Counter(c.message_id for c in meter.calls)
        assert dict(calls) == dict.fromkeys(good, 1)
        assert all(c.body["event_version"] == 2 and c.body["payload"]["schema_version"] == 2 for c in meter.calls)
        noticed_ids = collections.Counter(m.headers["Nats-Msg-Id"].split(":", 1)[0] for m in dlq if m.headers)
        assert dict(noticed_ids) == {by_n[3]: 1, by_n[4]: 1}, "one DLQ notice for each dead letter, none else"
        with psycopg.connect(database_url, autocommit=True) as conn:
            attempts = conn.execute(
                "SELECT message_id::text, attempts FROM inbox.messages WHERE handler = 'meter'"
            ).fetchall()
        assert dict(attempts) == dict.fromkeys(ids, 1), "no fetch was handed back for redelivery"
    finally:
        for w in workers:
            w.stop()
        meter.close()
