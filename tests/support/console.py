"""Helpers for the console's tests (tests/console/): people with passwords,
the console served in the test's event loop, dead letters seeded through the
workers' own SQL functions."""

from __future__ import annotations

import asyncio
import contextlib
import time

import psycopg
import psycopg.types.json
import uvicorn

from pgoutbox.console.app import create_app
from pgoutbox.console.settings import ConsoleConfig
from pgoutbox.core import settings, wire
from pgoutbox.dev.embedded import free_port
from support.inbox import event as inbox_event
from support.outbox import emit
from support.waiting import until

PASSWORD = "console-test-password"


def person(superuser_url: str, group: str) -> tuple[str, str]:
    """A login role in `group` only, with a password: (name, password)."""
    name = f"p_{group.removeprefix('pgoutbox_')}_{time.monotonic_ns()}"
    with psycopg.connect(superuser_url, autocommit=True) as c:
        c.execute(
            psycopg.sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                psycopg.sql.Identifier(name), psycopg.sql.Literal(PASSWORD), psycopg.sql.Identifier(group)
            )
        )
    return name, PASSWORD


@contextlib.asynccontextmanager
async def serving(database_url: str, **overrides):
    """The console on a free loopback port, in this event loop, on the documented
    defaults (a test that needs another value passes it, with its reason): (base URL, Console)."""
    values = {"database_url": database_url, "port": str(free_port())}
    values.update(overrides)
    cfg = settings.build(ConsoleConfig, environ={}, overrides=values)
    app = create_app(cfg)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_config=None, access_log=False, proxy_headers=False)
    )
    task = asyncio.ensure_future(server.serve())
    await until(lambda: server.started or task.done(), 10, "the console listening")
    if task.done():
        task.result()
    try:
        yield f"http://127.0.0.1:{cfg.port}", app.state.console
    finally:
        server.should_exit = True
        await task


def seed_dead_letters(consumer_url: str, handler: str, subject: str, n: int, error: str) -> list[str]:
    """n dead letters of `handler`, recorded as the consumer records them (receive, then
    record_error dead), with envelopes as the wire builds them: no NATS needed."""
    ids = []
    with psycopg.connect(consumer_url, autocommit=True) as c:
        for _ in range(n):
            ev = inbox_event(event_type=subject.split(".")[2], payload={"order": "A-17"})
            envelope = wire.from_nats(*wire.to_nats(ev))
            c.execute(
                "SELECT inbox.receive(%s, %s, %s, %s)",
                (ev["event_id"], handler, subject, psycopg.types.json.Jsonb(envelope)),
            )
            c.execute("SELECT inbox.record_error(%s, %s, %s, true, '1h')", (ev["event_id"], handler, error))
            ids.append(ev["event_id"])
    return ids


def worker_url(superuser_url: str, group: str) -> str:
    """A URL with a login (and password) in `group` only, for the workers."""
    name, password = person(superuser_url, group)
    return superuser_url.replace("postgres@", f"{name}:{password}@", 1)


def seed_outbox_dead_letters(superuser_url: str, n: int, error: str, context: str = "sea") -> list[str]:
    """n outbox events dead-lettered as the relay does it: emitted (writer), claimed and
    marked failed with no retry (relay)."""
    ids = emit(worker_url(superuser_url, "pgoutbox_writer"), n, context=context)
    with psycopg.connect(worker_url(superuser_url, "pgoutbox_relay"), autocommit=True) as c:
        claimed = c.execute("SELECT event_id, claim_token FROM outbox.claim('seed', %s, '1m')", (n,)).fetchall()
        token = claimed[0][1]
        c.execute(
            "SELECT outbox.mark_failed(%s, %s::uuid[], %s::text[], %s::timestamptz[])",
            (token, [r[0] for r in claimed], [error] * n, [None] * n),
        )
    return ids
