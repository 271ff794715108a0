"""The inbox half of the one demo (`make demo`, dev/demo.py): a sample HTTP
handler, the generated registry, the consumer with its replayer, and one
poison message that ends in the DLQ; prints what happened. demo.py calls
consume_and_report() once the relay has put the events in JetStream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import nats
import psycopg
from nats.js import JetStreamContext

from pgoutbox.core import db, settings
from pgoutbox.inbox import registry
from pgoutbox.inbox import settings as cs
from pgoutbox.inbox.consumer import Consumer

HANDLER = "order_mailer"


def print_rows(conn: psycopg.Connection[Any], title: str, query: str, params: tuple[Any, ...] = ()) -> None:
    cur = conn.execute(query, params)
    names = [c.name for c in cur.description or ()]
    print(f"\n== {title}")
    for row in cur.fetchall():
        print("   " + json.dumps(dict(zip(names, row)), default=str))


class SampleHandler:
    """Answers 200, or 422 to an order whose payload says it is poison."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        sample = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                envelope = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                poison = bool(envelope["payload"].get("poison"))
                sample.seen.append(f"{envelope['subject']} {envelope['aggregate_id']} -> {422 if poison else 200}")
                body = b'{"error": "cannot mail an order without an address"}' if poison else b"{}"
                self.send_response(422 if poison else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/orders"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


async def consume_and_report(database_url: str, nats_url: str, expected: int, context: str = "sea") -> None:
    """Runs the consumer over `expected` events of `context`, then prints the
    handler's calls, the inbox and the DLQ."""
    sample = SampleHandler()
    workdir = Path(tempfile.mkdtemp(prefix="pgoutbox-demo-"))
    (workdir / "handlers").mkdir()
    (workdir / "handlers" / "mailer.toml").write_text(
        f'[[handler]]\nname = "{HANDLER}"\nurl = "{sample.url}"\nsubjects = ["{context}.event.order_created.v1"]\n'
        "replay_max_attempts = 1\n"
    )
    registry.generate(workdir / "handlers", workdir / "handlers.registry.json")
    cfg = settings.build(
        cs.ConsumerConfig,
        environ={},
        overrides={
            "database_url": database_url,
            "nats_url": nats_url,
            "registry_file": str(workdir / "handlers.registry.json"),
            "log_level": "WARNING",
            "replay_base_delay": "1s",
            "replay_poll_interval": "200ms",
            "fetch_timeout": "250ms",
        },
    )
    cfg = dataclasses.replace(cfg, http_port=None)  # no metrics server
    consumer = Consumer(cs.load_handlers(cfg), cfg)
    await consumer.start()
    try:

        def settled() -> bool:
            m = consumer.metrics
            return m.value(HANDLER, "processed") + m.value(HANDLER, "dead_lettered") >= expected + 1

        for _ in range(200):  # the poison message is dead-lettered, replayed once, dead-lettered again
            if settled() and consumer.metrics.value(HANDLER, "dead_lettered") >= 2:
                break
            await asyncio.sleep(0.05)
        async with _connected(nats_url) as js:
            info = await js.stream_info(f"{context.upper()}_DLQ")
            notices = []
            for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
                msg = await js.get_msg(str(info.config.name), seq)
                if ".dlq.dead." in (msg.subject or ""):
                    body = json.loads(msg.data or b"")
                    notices.append(
                        f"{msg.subject}: {body['reason']} (replays so far: {body['replay_attempts']},"
                        f" next in: {body['next_replay_in_seconds']})"
                    )
    finally:
        await consumer.stop()
        sample.server.shutdown()
    print(f"\n== handler {HANDLER} was called {len(sample.seen)} time(s)")
    for line in sample.seen:
        print("   " + line)
    with db.connect(database_url) as conn:
        print_rows(conn, "inbox.backlog()", "SELECT * FROM inbox.backlog()")
        print_rows(conn, "inbox.dead_letters()", "SELECT * FROM inbox.dead_letters()")
        # What `pgoutbox dead-letters groups` and the console's dead-letter page show.
        print_rows(
            conn,
            "outbox.dlq_groups(): dead letters by cause (pgoutbox dead-letters groups; pgoutbox console)",
            "SELECT side, owner, subject, error_class, error_pattern, dead_letters, last_seen FROM outbox.dlq_groups()",
        )
    print(f"\n== DLQ stream {context.upper()}_DLQ")
    for line in notices:
        print("   " + line)


class _connected:
    """A JetStream context on a connection of its own, closed on exit."""

    def __init__(self, url: str):
        self.url = url

    async def __aenter__(self) -> JetStreamContext:
        self.nc = await nats.connect(self.url)
        return self.nc.jetstream()

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()
