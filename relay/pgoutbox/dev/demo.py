"""`make demo`: the whole pipeline on an embedded PostgreSQL and nats-server
under .data/, started (and stopped) by the demo itself, or on the servers
named by OUTBOX_DATABASE_URL / OUTBOX_NATS_URL when set.

It emits three events in one business transaction (the third a "poison"
order the sample handler refuses), applies the stream of the `sea` context,
runs the relay until the events are published and shows them as a JetStream
subscriber receives them, then runs the consumer over them
(demo_inbox.consume_and_report: handler calls, inbox, DLQ). Re-running it
is safe: it adds three more events and shows only those."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import nats
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pgoutbox.core import db, migrate
from pgoutbox.core import logs as json_logs
from pgoutbox.dev.demo_inbox import consume_and_report, print_rows
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres, NatsServerMissing, nats_server_binary
from pgoutbox.outbox import settings as relay_settings
from pgoutbox.outbox import streams
from pgoutbox.outbox.relay import OutboxRelay

# The working directory's .data/, as `make demo` runs it from the checkout (an installed
# package has no checkout to anchor to).
DATA = Path(os.environ.get("OUTBOX_DEMO_DIR", ".data")).resolve()
DEMO_STREAMS = """
[streams.sea]            # the bounded context "sea": stream SEA_EVENTS, subjects sea.event.>
max_age = "7d"
duplicate_window = "2m"
"""


def _emit(conn: psycopg.Connection[Any]) -> list[str]:
    ids = []
    with conn.transaction():  # the business change and its events commit together
        for n, poison in ((1, False), (2, False), (3, True)):
            row = conn.execute(
                "SELECT outbox.emit('order', %s, 'order_created', %s::jsonb, context => 'sea',"
                " ordering_key => %s, headers => %s::jsonb)",
                (
                    str(1000 + n),
                    json.dumps({"schema_version": 1, "total": 10 * n, "poison": poison}),
                    str(1000 + n),
                    json.dumps({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}),
                ),
            ).fetchone()
            assert row is not None  # outbox.emit returns the event's id
            ids.append(str(row[0]))
    return ids


async def _relay_and_show(database_url: str, nats_url: str, ids: list[str]) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        for name, what in await streams.apply(js, streams.loads(DEMO_STREAMS, "demo")):
            print(f"stream {name}: {what}")
        first_new = (await js.stream_info("SEA_EVENTS")).state.last_seq + 1
        cfg = relay_settings.load(
            environ={},
            overrides={
                "database_url": database_url,
                "nats_url": nats_url,
                "http_port": "0",
                "relay_name": "demo-relay",
                "log_level": "WARNING",
            },
        )
        relay = OutboxRelay(cfg)
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        sub = await js.pull_subscribe(
            "sea.event.>",
            stream="SEA_EVENTS",
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first_new
            ),
        )
        print("\n== received from JetStream (published by the relay)")
        seen: set[str] = set()
        while not seen >= set(ids):
            if task.done():
                task.result()  # the relay stopped: say why
            try:
                messages = await sub.fetch(10, timeout=2)
            except nats.errors.TimeoutError:
                continue
            for msg in messages:
                headers = msg.headers or {}
                msg_id = headers.get("Nats-Msg-Id", "")
                seen.add(msg_id)
                print(f"   seq {msg.metadata.sequence.stream} {msg.subject} Nats-Msg-Id={msg_id}")
                print(f"      headers {json.dumps({k: v for k, v in headers.items() if k != 'Nats-Msg-Id'})}")
                print(f"      payload {msg.data.decode()}")
        stop.set()
        await task
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pg = EmbeddedPostgres(DATA / "postgres")
    natsd = EmbeddedNats(DATA / "nats")
    if "--stop" in argv:
        pg.stop()  # nats-server never outlives a demo run
        return 0
    json_logs.setup("WARNING")  # warnings and dead letters show up as JSON log lines
    url = os.environ.get("OUTBOX_DATABASE_URL")
    nats_url = os.environ.get("OUTBOX_NATS_URL")
    if not nats_url:
        try:  # before PostgreSQL starts: a missing binary is one line, not a half-started demo
            nats_server_binary()
        except NatsServerMissing as e:
            print(f"demo: {e}", file=sys.stderr)
            return 1
    try:
        if not url:
            url = pg.start()
            print(f"embedded PostgreSQL at {url} (data in {pg.root})")
        if not nats_url:
            nats_url = natsd.start()
            print(f"embedded nats-server (JetStream) at {nats_url} (data in {natsd.root})")
        with db.connect(url) as conn:
            for step in migrate.migrate(conn):
                print(f"migrated: {step}")
            ids = _emit(conn)
            for event_id in ids:
                print(f"emitted {event_id}")
            print_rows(conn, "outbox.backlog() before the relay", "SELECT * FROM outbox.backlog()")
            asyncio.run(_relay_and_show(url, nats_url, ids))
            print_rows(conn, "outbox.backlog() after the relay", "SELECT * FROM outbox.backlog()")
            print_rows(
                conn,
                "these events in outbox.events",
                "SELECT event_id, subject, status, attempts, claimed_by, published_at"
                " FROM outbox.events WHERE event_id = ANY(%s::uuid[]) ORDER BY id",
                (ids,),
            )

        asyncio.run(consume_and_report(url, nats_url, len(ids)))
    finally:
        if not os.environ.get("OUTBOX_NATS_URL"):
            natsd.stop()
        if not os.environ.get("OUTBOX_DATABASE_URL"):
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
