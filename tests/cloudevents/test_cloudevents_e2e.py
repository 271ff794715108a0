"""CloudEvents end to end, with the official Python SDK on the other side.

A real `pgoutbox relay` and a real `pgoutbox consume` (subprocesses, on their
defaults, each logged in as the one role docs/reference.md gives it), a real
PostgreSQL and nats-server. The handler, of format "cloudevents", is an HTTP
server that parses every request with the SDK's `from_http` and answers 422
to one it cannot parse (so a request the SDK refuses shows as a dead letter).

- what the relay publishes, read back from JetStream, parses as a CloudEvent
  through the SDK (its binary-mode reader over the ce-* headers);
- the handler parses every request, with the attributes the table of
  docs/cloudevents.md gives;
- foreign CloudEvents published by a plain NATS client, binary and
  structured, enter the inbox and reach the handler; one whose ce-id is not
  a UUID goes to `.invalid` with the reason.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import uuid
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import nats
import psycopg
from cloudevents.core.bindings.http import HTTPMessage, from_binary, from_http
from cloudevents.core.formats.json import JSONFormat
from psycopg.types.json import Jsonb

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
from support.outbox import apply_streams, stream_messages
from support.roles import login
from support.waiting import until, wait_for
from support.workers import worker

ROOT = Path(__file__).resolve().parents[2]
PGOUTBOX = Path(sys.executable).parent / "pgoutbox"
HANDLER = "ce_sink"
SUBJECT = "sea.event.order_placed.v1"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def documented_role(command: str) -> str:
    """The one role the command-roles table of docs/reference.md gives."""
    table = (ROOT / "docs" / "reference.md").read_text()
    [row] = re.findall(rf"^\| {re.escape(command)} \|(.*)\|$", table, re.M)
    [role] = re.findall(r"`(pgoutbox_[a-z]+)`", row)
    return role


class SdkHandler:
    """Parses each request with the SDK; keeps (event, headers) or the error."""

    def __init__(self, fail_first: bool = False) -> None:
        self.events: list[tuple[Any, dict[str, str]]] = []
        self.errors: list[str] = []
        self.fail_first = fail_first  # 422 to the first request of each event: a dead letter, then its replay
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                headers = dict(self.headers)
                try:
                    event = from_http(HTTPMessage(headers, raw), JSONFormat())
                    first = all(e.get_id() != event.get_id() for e, _ in sink.events)
                    sink.events.append((event, headers))
                    status = 422 if sink.fail_first and first else 200
                except Exception as exc:
                    sink.errors.append(f"{type(exc).__name__}: {exc}; headers {headers}; body {raw[:200]!r}")
                    status = 422
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/events"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def by_id(self) -> dict[str, tuple[Any, dict[str, str]]]:
        return {event.get_id(): (event, headers) for event, headers in list(self.events)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def emit(writer: str, owner: str, aggregate_id: str, payload: dict, headers: dict) -> tuple[str, datetime]:
    """Emits as the writer (which may not read the table); (event_id, occurred_at)."""
    with psycopg.connect(writer, autocommit=True) as conn:
        [event_id] = conn.execute(
            "SELECT outbox.emit('order', %s, 'order_placed', %s, context => 'sea', headers => %s)",
            (aggregate_id, Jsonb({"schema_version": 1, **payload}), Jsonb(headers)),
        ).fetchone()
    with psycopg.connect(owner, autocommit=True) as conn:
        [occurred_at] = conn.execute(
            "SELECT occurred_at FROM outbox.events WHERE event_id = %s", (event_id,)
        ).fetchone()
    return str(event_id), occurred_at


async def publish_foreign(nats_url: str) -> dict[str, Any]:
    """Binary, structured and a bad binary CloudEvent, as another producer would send them."""
    binary_id, structured_id = str(uuid.uuid4()), str(uuid.uuid4())
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.publish(
            SUBJECT,
            b'{"schema_version": 1, "from": "binary", "big": 12345678901234567890.5}',
            headers={
                "ce-specversion": "1.0",
                "ce-id": binary_id,
                "ce-source": "https://shop.example/orders%20eu",
                "ce-type": "com.example.order.placed",
                "ce-time": "2025-01-02T03:04:05Z",
                "ce-datacontenttype": "application/json",
                "ce-region": "eu",
            },
        )
        structured = {
            "specversion": "1.0",
            "id": structured_id,
            "source": "/legacy/orders",
            "type": "com.example.order.placed",
            "subject": "order/7",
            "datacontenttype": "application/json",
            "data": {"schema_version": 1, "from": "structured"},
        }
        await js.publish(
            SUBJECT, json.dumps(structured).encode(), headers={"Content-Type": "application/cloudevents+json"}
        )
        bad = {"ce-specversion": "1.0", "ce-id": "order-17", "ce-source": "/s", "ce-type": "t"}
        await js.publish(SUBJECT, b'{"schema_version": 1}', headers=bad)
    finally:
        await nc.close()
    return {"binary": binary_id, "structured": structured_id}


def test_relay_consumer_and_sdk_agree_on_cloudevents(database_url, nats_server, tmp_path):
    sink = SdkHandler()
    try:
        manifests = tmp_path / "handlers"
        manifests.mkdir()
        (manifests / "ce.toml").write_text(
            f'[[handler]]\nname = "{HANDLER}"\nurl = "{sink.url}"\nsubjects = ["{SUBJECT}"]\nformat = "cloudevents"\n'
        )
        subprocess.run([str(PGOUTBOX), "registry", "generate"], cwd=tmp_path, check=True, capture_output=True)
        asyncio.run(apply_streams(nats_server.url))
        writer = login(
            database_url, documented_role("`outbox.emit()`, called by your application in its own transaction")
        )
        emitted = {
            "plain": emit(writer, database_url, "42", {"n": 1}, {"traceparent": TRACEPARENT, "tracestate": "vendor=x"}),
            "unicode": emit(writer, database_url, 'caf\u00e9 "7" 100%', {"n": 2}, {}),
            "extension": emit(
                writer, database_url, "43", {"n": 3}, {"ce-partitionkey": "k 1", "ce-source": "urn:shop:orders"}
            ),
        }
        common = {"OUTBOX_NATS_URL": nats_server.url}
        with (
            worker(
                tmp_path,
                "consume",
                '"consumer started"',
                **common,
                OUTBOX_DATABASE_URL=login(database_url, documented_role("`pgoutbox consume`")),
                OUTBOX_CONSUMER_HTTP_PORT="0",
            ),
            worker(
                tmp_path,
                "relay",
                '"action": "started"',
                **common,
                OUTBOX_DATABASE_URL=login(database_url, documented_role("`pgoutbox relay`")),
                OUTBOX_RELAY_HTTP_PORT="0",
            ),
        ):
            foreign = asyncio.run(publish_foreign(nats_server.url))
            wait_for(lambda: len(sink.events) + len(sink.errors) >= 5, 60, "five handler calls")

            async def read_invalid() -> list:
                nc = await nats.connect(nats_server.url)
                try:
                    return await dlq_messages(nc.jetstream(), subject=f"sea.dlq.dead.{HANDLER}.invalid")
                finally:
                    await nc.close()

            notices = wait_for(lambda: asyncio.run(read_invalid()), 30, "the .invalid notice")
            relayed = asyncio.run(stream_messages(nats_server.url))
        # (a) every request parsed through the SDK, with the attributes documented.
        assert sink.errors == []
        got = sink.by_id()
        assert sorted(got) == sorted([e[0] for e in emitted.values()] + list(foreign.values()))
        event, headers = got[emitted["plain"][0]]
        assert (event.get_specversion(), event.get_source(), event.get_type()) == (
            "1.0",
            "/pgoutbox/sea",
            "sea.order_placed.v1",
        )
        assert event.get_subject() == "order/42" and event.get_datacontenttype() == "application/json"
        assert event.get_time() == emitted["plain"][1]
        assert event.get_extension("traceparent") == TRACEPARENT and headers["traceparent"] == TRACEPARENT
        assert event.get_extension("tracestate") == "vendor=x"
        assert event.get_data() == {"schema_version": 1, "n": 1}
        assert headers["Idempotency-Key"] == emitted["plain"][0]
        event, _ = got[emitted["unicode"][0]]
        assert event.get_subject() == 'order/caf\u00e9 "7" 100%'
        event, _ = got[emitted["extension"][0]]
        assert event.get_source() == "urn:shop:orders" and event.get_extension("partitionkey") == "k 1"
        # (c) foreign events: binary (body byte for byte) and structured (data as the body).
        event, headers = got[foreign["binary"]]
        assert event.get_source() == "https://shop.example/orders eu" and event.get_extension("region") == "eu"
        assert event.get_type() == "com.example.order.placed"
        assert event.get_data() == {"schema_version": 1, "from": "binary", "big": 12345678901234567890.5}
        event, _ = got[foreign["structured"]]
        assert (event.get_source(), event.get_subject()) == ("/legacy/orders", "order/7")
        assert event.get_data() == {"schema_version": 1, "from": "structured"}
        for message_id in list(foreign.values()) + [e[0] for e in emitted.values()]:
            assert inbox_row(database_url, message_id, HANDLER)["status"] == "PROCESSED"
        [notice] = notices
        reason = json.loads(notice.data)["reason"]
        assert "ce-id (the CloudEvents id) 'order-17' is not a UUID" in reason, reason
        # (b) what the relay published parses through the SDK from its ce-* headers.
        ours = [m for m in relayed if m.headers.get("Nats-Msg-Id") in {e[0] for e in emitted.values()}]
        assert len(ours) == 3
        for message in ours:
            assert set(message.headers) >= {
                "ce-specversion",
                "ce-id",
                "ce-source",
                "ce-type",
                "ce-time",
                "ce-subject",
                "ce-datacontenttype",
            }
            event = from_binary(HTTPMessage(dict(message.headers), message.data), JSONFormat())
            assert event.get_id() == message.headers["Nats-Msg-Id"]
            assert event.get_type() == "sea.order_placed.v1"
            assert event.get_time().isoformat().replace("+00:00", "Z") == message.headers["Pgoutbox-Occurred-At"]
            assert event.get_data() == json.loads(message.data)
        unicode = next(m for m in ours if m.headers["Nats-Msg-Id"] == emitted["unicode"][0])
        assert unicode.headers["ce-subject"] == "order/caf%C3%A9%20%227%22%20100%25"
    finally:
        sink.close()


async def test_a_replay_reaches_the_handler_with_the_attributes_of_the_first_delivery(
    database_url, nats_server, tmp_path
):
    """The handler dead-letters the first request of each event (422); the
    replayer re-publishes it from the inbox, and the replay's request carries
    the same CloudEvent: a relay-published one and a foreign structured one."""
    sink = SdkHandler(fail_first=True)
    try:
        # not default: the test is about the cloudevents format
        registry_file = write_registry(
            tmp_path, [{"name": HANDLER, "url": sink.url, "subjects": [SUBJECT], "format": "cloudevents"}]
        )
        cfg = default_consumer_config(
            login(database_url, documented_role("`pgoutbox consume`")), nats_server.url, registry_file
        )
        ours = event({"n": 1}, event_type="order_placed")
        ours["aggregate_id"] = "caf\u00e9 1"
        foreign_id = str(uuid.uuid4())
        structured = {
            "specversion": "1.0",
            "id": foreign_id,
            "source": "/legacy/orders",
            "type": "com.example.order.placed",
            "subject": "order 7",
            "region": "eu",
            "data": {"schema_version": 1, "n": 2},
        }
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            async with running_consumer(cfg):
                await publish(js, ours)
                await js.publish(
                    SUBJECT, json.dumps(structured).encode(), headers={"Content-Type": "application/cloudevents+json"}
                )
                await until(
                    lambda: all(
                        (inbox_row(database_url, i, HANDLER) or {}).get("status") == "DEAD_LETTER"
                        for i in (ours["event_id"], foreign_id)
                    ),
                    20,
                    "both dead-lettered",
                )
                # An operator's redrive (as the admin role): the replayer re-publishes both
                # at its next look (the defaults' automated replay would wait a minute).
                with psycopg.connect(login(database_url, "pgoutbox_admin"), autocommit=True) as conn:
                    conn.execute("SELECT inbox.redrive(%s, NULL, 'handler fixed')", (HANDLER,))
                await until(lambda: len(sink.events) >= 4, 30, "two deliveries of each event")
                await until(
                    lambda: all(
                        inbox_row(database_url, i, HANDLER)["status"] == "PROCESSED"
                        for i in (ours["event_id"], foreign_id)
                    ),
                    10,
                    "both processed after their replay",
                )
        assert sink.errors == []
        for message_id in (ours["event_id"], foreign_id):
            first, replay = [(e, h) for e, h in sink.events if e.get_id() == message_id]
            # The headers themselves (the SDK fills a missing time with its own clock on each parse).
            ce_headers = [
                {k.lower(): v for k, v in h.items() if k.lower().startswith("ce-")} for _, h in (first, replay)
            ]
            assert ce_headers[0] == ce_headers[1] and ce_headers[0]["ce-id"] == message_id, message_id
            assert first[1]["Content-Type"] == replay[1]["Content-Type"] == "application/json"
            assert first[0].get_data() == replay[0].get_data()
            assert replay[1]["Idempotency-Key"] == message_id
        relayed = next(e for e, _ in sink.events if e.get_id() == ours["event_id"])
        assert (relayed.get_source(), relayed.get_subject()) == ("/pgoutbox/sea", "order/caf\u00e9 1")
        foreign = next(e for e, _ in sink.events if e.get_id() == foreign_id)
        assert foreign.get_extension("region") == "eu" and foreign.get_data() == {"schema_version": 1, "n": 2}
    finally:
        sink.close()
