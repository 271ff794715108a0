"""The testing kit's Python side (pgoutbox.testing, docs/testing.md) on a
real PostgreSQL and a real HTTP handler: capture() sees what a block emits in
the test's open transaction and nothing else, for a login holding only
pgoutbox_writer; its assertions fail naming what was expected and what was
emitted; it refuses an autocommit connection, a block that ends the
transaction and a database without the kit; call_handler() sends what the
consumer sends and reports what the consumer would do; `pgoutbox testing`
installs and prints the kit."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
import pytest

from pgoutbox.cli import main as cli
from pgoutbox.core import tap
from pgoutbox.testing import (
    EmittedEvent,
    KitMissing,
    TransactionEnded,
    acapture,
    call_handler,
    capture,
    contains,
    event,
)
from support.roles import login

EMIT = "SELECT outbox.emit('order', %s, %s, %s::jsonb, 'shop', ordering_key => %s)"


def emit(conn, event_type: str, payload: dict, key: str = "o-1") -> None:
    conn.execute(EMIT, (key, event_type, json.dumps({"schema_version": 1, **payload}), key))


@pytest.fixture
def kit(database_url):
    """The kit installed by its owner; a login with pgoutbox_writer only."""
    with psycopg.connect(database_url, autocommit=True) as owner:
        tap.install(owner)
    return login(database_url, "pgoutbox_writer")


def test_capture_sees_the_blocks_own_events_only(kit, database_url):
    with psycopg.connect(kit) as conn, psycopg.connect(database_url, autocommit=True) as other:
        emit(conn, "order_created", {"total": 1}, "before")
        with capture(conn) as emitted:
            emit(conn, "order_created", {"total": 5})
            emit(other, "order_created", {"total": 7}, "committed-by-another-session")
            emit(conn, "order_paid", {})
        assert [(e.event_type, e.payload, e.ordering_key) for e in emitted.events] == [
            ("order_created", {"total": 5, "schema_version": 1}, "o-1"),
            ("order_paid", {"schema_version": 1}, "o-1"),
        ]
        assert (
            isinstance(emitted.events[0], EmittedEvent) and emitted.events[0].subject == "shop.event.order_created.v1"
        )
        emitted.assert_emits("order_created", {"total": 5})
        emitted.assert_emits_exactly(1, "order_paid")
        emitted.assert_emitted_in_order(["order_created", "order_paid"])
        conn.rollback()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM outbox.events")


def test_a_failed_assertion_names_what_was_expected_and_what_was_emitted(kit):
    with psycopg.connect(kit) as conn:
        with capture(conn) as emitted:
            emit(conn, "order_created", {"total": 5})
        with pytest.raises(AssertionError) as failed:
            emitted.assert_emits("order_created", {"total": 6})
        assert str(failed.value) == (
            'expected: an event order_created whose payload contains {"total": 6}\n'
            'emitted:  1 event(s)\n    order_created {"total": 5, "schema_version": 1} (ordering_key o-1)'
        )
        with pytest.raises(AssertionError, match=r"^expected: exactly 2 event\(s\) order_created\nemitted:  1 event"):
            emitted.assert_emits_exactly(2, "order_created")
        with pytest.raises(AssertionError, match=r"^expected: no event\nemitted:  1 event"):
            emitted.assert_emits_nothing()
        with pytest.raises(AssertionError, match=r"^expected: order_paid, order_created, in this order\n"):
            emitted.assert_emitted_in_order(["order_paid", "order_created"])
        with capture(conn) as nothing:
            pass
        nothing.assert_emits_nothing()
        with pytest.raises(AssertionError, match=r"^expected: an event order_created\nemitted:  nothing$"):
            nothing.assert_emits("order_created")


def test_contains_is_jsonb_containment():
    assert contains({"a": 1, "b": {"c": [1, 2, {"d": 3}]}}, {"b": {"c": [{"d": 3}, 1]}})
    assert not contains({"a": 1}, {"a": True}) and not contains({"a": True}, {"a": 1})
    assert not contains({"a": [1]}, {"a": 1}) and not contains({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}})
    assert contains({"a": 1.0}, {"a": 1}) and contains({}, {})


def test_capture_refuses_what_it_cannot_see(kit, empty_database_url):
    with psycopg.connect(kit, autocommit=True) as conn, pytest.raises(TransactionEnded, match="autocommit off"):
        with capture(conn):
            pass
    with psycopg.connect(kit) as conn, pytest.raises(TransactionEnded, match="ended the transaction"):
        with capture(conn):
            emit(conn, "order_created", {})
            conn.commit()
    with psycopg.connect(empty_database_url) as conn, pytest.raises(KitMissing, match="pgoutbox testing install-tap"):
        with capture(conn):
            pass


async def test_acapture_on_an_async_connection(kit):
    async with await psycopg.AsyncConnection.connect(kit) as conn:
        async with acapture(conn) as emitted:
            await conn.execute(EMIT, ("o-2", "order_created", '{"schema_version": 1, "total": 2}', "o-2"))
        emitted.assert_emits_exactly(1, "order_created", {"total": 2})


def test_call_handler_sends_what_the_consumer_sends_and_says_what_it_would_do(kit, handler):
    with psycopg.connect(kit) as conn:
        with capture(conn) as emitted:
            emit(conn, "order_created", {"total": 5})
        (created,) = emitted.events
    result = call_handler(handler.url, created, handler="order_projection", delivery=2)
    assert (result.status, result.action) == (200, "processed")
    (call,) = handler.calls
    assert call.raw == result.request_body
    assert call.body == {k: v for k, v in result.envelope.items() if k != "trace" and k != "cloudevents"}
    assert call.body["message_id"] == created.event_id and call.body["payload"] == created.payload
    assert call.body["ordering_key"] == "o-1" and call.body["event_type"] == "order_created"
    sent = {k.lower(): v for k, v in call.headers.items()}
    for name, value in result.request_headers.items():
        assert sent[name.lower()] == value
    assert result.request_headers["Idempotency-Key"] == created.event_id
    assert (result.request_headers["Pgoutbox-Handler"], result.request_headers["Pgoutbox-Delivery"]) == (
        "order_projection",
        "2",
    )
    for answer, action in ((409, "processed"), (422, "dead_letter"), (503, "retry"), (404, "retry")):
        got = call_handler(handler.url, event("order_created", {"schema_version": 1, "answers": [answer]}))
        assert (got.status, got.action) == (answer, action)
    handler.close()
    gone = call_handler(handler.url, created, timeout=2)
    assert (gone.status, gone.action) == (None, "retry") and gone.error


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self):
        self.seen.append((dict(self.headers), self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_call_handler_speaks_cloudevents_binary_mode_to_such_a_handler():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sent = event("order_created", {"schema_version": 1, "total": 5}, context="shop", aggregate_id="o-9")
        result = call_handler(f"http://127.0.0.1:{server.server_address[1]}/ce", sent, format="cloudevents")
    finally:
        server.shutdown()
        server.server_close()
    assert (result.status, result.action) == (204, "processed")
    ((headers, body),) = _Recorder.seen
    assert json.loads(body) == {"schema_version": 1, "total": 5}
    assert headers["ce-id"] == sent["event_id"] == result.request_headers["ce-id"]
    assert headers["ce-type"] == "shop.order_created.v1" and headers["ce-subject"] == "test/o-9"
    assert headers["Idempotency-Key"] == sent["event_id"]


def test_the_testing_command_installs_the_kit_again_and_prints_it(database_url, capsys):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP EXTENSION pgtap")
    for _ in range(2):  # idempotent
        assert cli.main(["testing", "install-tap", "--database-url", database_url]) == 0
    out = capsys.readouterr().out
    assert "installed the testing kit in schema pgoutbox_tap" in out and "pgTAP is not installed" in out
    with psycopg.connect(database_url, autocommit=True) as conn:
        names = {
            r[0] for r in conn.execute("SELECT proname FROM pg_proc WHERE pronamespace = 'pgoutbox_tap'::regnamespace")
        }
    assert {"emits", "emits_exactly", "emits_nothing", "emitted_in_order", "upcasters_reach", "upcasts_to"} <= names
    assert cli.main(["testing", "tap-sql"]) == 0
    assert capsys.readouterr().out == tap.kit_sql()
