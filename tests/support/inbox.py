"""Helpers for the consumer tests: a real HTTP handler (stdlib server on a
free port, in a thread), events published to a real JetStream in the relay's
wire format, a registry written from a manifest, polling."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import psycopg
from psycopg.rows import dict_row

from pgoutbox.core import settings, wire
from pgoutbox.inbox import registry
from pgoutbox.inbox import settings as cs
from pgoutbox.inbox.consumer import Consumer
from support.roles import as_role


@dataclass
class Call:
    message_id: str
    body: dict
    headers: dict
    at: float
    raw: bytes = b""  # the request body as it came


@dataclass
class FakeHandler:
    """Answers according to the payload's "answers" list, one entry per call
    for that message (the last one repeats): an HTTP status, or "timeout"
    (sleeps `hang` seconds, longer than the consumer's timeout). "delay"
    in the payload makes every call take that long before answering."""

    hang: float = 3.0
    answers: list | None = None  # when set, used instead of the payload's
    calls: list[Call] = field(default_factory=list)
    on_request: Callable[[Call], None] | None = None
    port: int = 0  # 0: any free port

    def __post_init__(self):
        fake = self
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                body = json.loads(raw)
                call = Call(body["message_id"], body, dict(self.headers), time.monotonic(), raw)
                with fake._lock:
                    n = sum(1 for c in fake.calls if c.message_id == call.message_id)
                    fake.calls.append(call)
                if fake.on_request:
                    fake.on_request(call)
                payload = body.get("payload") or {}
                answers = fake.answers or payload.get("answers") or [200]
                answer = answers[min(n, len(answers) - 1)]
                time.sleep(float(payload.get("delay", 0)))
                if answer == "timeout":
                    time.sleep(fake.hang)
                    answer = 200
                out = json.dumps({"answer": answer}).encode()
                self.send_response(int(answer))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/events"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def calls_for(self, message_id: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.message_id == message_id]

    def close(self):
        self._server.shutdown()
        self._server.server_close()


def refused_url() -> str:
    """A URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/events"


def event(
    payload: dict | None = None,
    *,
    event_type: str = "order_created",
    version: int = 1,
    context: str = "sea",
    event_id: str | None = None,
) -> dict[str, Any]:
    """An outbox.events row as the relay reads it."""
    return {
        "event_id": event_id or str(uuid.uuid4()),
        "context": context,
        "subject": f"{context}.event.{event_type}.v{version}",
        "event_type": event_type,
        "event_version": version,
        "aggregate_type": "order",
        "aggregate_id": "42",
        "occurred_at": datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
        "correlation_id": str(uuid.uuid4()),
        "causation_id": str(uuid.uuid4()),
        "tenant_id": "t1",
        "payload": {"schema_version": 1, **(payload or {})},
        "headers": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    }


async def publish(js, ev: dict[str, Any]):
    subject, body, headers = wire.to_nats(ev)
    return await js.publish(subject, body, headers=headers)


async def add_stream(js, context: str = "sea", duplicate_window: float = 120.0) -> str:
    name = f"{context.upper()}_EVENTS"
    await js.add_stream(name=name, subjects=[f"{context}.event.>"], duplicate_window=duplicate_window)
    return name


def write_registry(tmp_path: Path, handlers: list[dict[str, Any]]) -> Path:
    """Writes a manifest with these [[handler]] tables and generates the registry."""
    manifests = tmp_path / "manifests"
    manifests.mkdir(exist_ok=True)
    lines = []
    for h in handlers:
        lines.append("[[handler]]")
        for key, value in h.items():
            lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    (manifests / "handlers.toml").write_text("\n".join(lines))
    target = tmp_path / "handlers.registry.json"
    registry.generate(manifests, target)
    return target


def consumer_config(
    database_url: str, nats_url: str, registry_file: Path, *, as_owner: str | None = None, **overrides
) -> cs.ConsumerConfig:
    """The consume command's configuration as a user gets it (docs/reference.md's
    defaults), without a metrics server unless http_port is given (tests run
    side by side), as a login in pgoutbox_consumer only (as_owner: why not). A
    test that needs another value passes it, with its reason (`# not default:
    <why>`), only when the test exists for that value."""
    values = {
        "database_url": as_role(database_url, "pgoutbox_consumer", as_owner),
        "nats_url": nats_url,
        "registry_file": str(registry_file),
        "http_port": None,
    }
    values.update(overrides)
    cfg = settings.build(cs.ConsumerConfig, environ={}, overrides={k: v for k, v in values.items() if v is not None})
    if values.get("http_port") is None:
        cfg = dataclasses.replace(cfg, http_port=None)  # no metrics server
    return cfg


def default_consumer_config(database_url: str, nats_url: str, registry_file: Path) -> cs.ConsumerConfig:
    """The consume command's configuration as a user gets it: the defaults, as a
    login in pgoutbox_consumer only, but no metrics server (tests run side by side)."""
    cfg = settings.build(
        cs.ConsumerConfig,
        environ={},
        overrides={
            "database_url": as_role(database_url, "pgoutbox_consumer"),
            "nats_url": nats_url,
            "registry_file": str(registry_file),
        },
    )
    return dataclasses.replace(cfg, http_port=None)


@contextlib.asynccontextmanager
async def running_consumer(cfg: cs.ConsumerConfig):
    consumer = Consumer(cs.load_handlers(cfg), cfg)
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


@contextlib.asynccontextmanager
async def jetstream(url: str):
    nc = await nats.connect(url)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def acked_through(js, durable: str, stream_seq: int, stream: str = "SEA_EVENTS", timeout: float = 10):
    """The durable's info once its ack floor reaches stream_seq: a consumer
    counts an outcome before its ack reaches the server."""
    deadline = time.monotonic() + timeout
    while (info := await js.consumer_info(stream, durable)).ack_floor.stream_seq < stream_seq:
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.05)
    return info


def inbox_row(database_url: str, message_id: str, handler: str) -> dict | None:
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT * FROM inbox.messages WHERE message_id = %s AND handler = %s", (message_id, handler)
        ).fetchone()


async def dlq_messages(js, context: str = "sea", subject: str | None = None) -> list:
    """Every message in the context's DLQ stream (optionally one subject filter)."""
    try:
        info = await js.stream_info(f"{context.upper()}_DLQ")
    except nats.js.errors.NotFoundError:
        return []
    found = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            msg = await js.get_msg(info.config.name, seq)
        except nats.js.errors.NotFoundError:
            continue
        if subject is None or msg.subject.startswith(subject):
            found.append(msg)
    return found


def consumer_metric(port: int, handler: str, outcome: str) -> float:
    """pgoutbox_consumer_messages_total{handler, outcome} of a consumer process's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    needle = f'pgoutbox_consumer_messages_total{{handler="{handler}",outcome="{outcome}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(needle))
