"""Cost of the console's bulk actions (figures, not a test): dead letters
replayed per second by `pgoutbox console`'s throttled batches, against the
reference, in the same run on the same kind of data: a bare loop of the one SQL
call each batch makes (`SELECT outbox.dlq_replay(filter, reason, 100)` until it
returns 0) on one connection, with no pause. Starts its own PostgreSQL.

Three handlers get N dead letters each (recorded through the consumer's SQL
functions, not measured); then
  1. the reference loop replays the first handler's;
  2. the console, OUTBOX_CONSOLE_ACTION_PAUSE=0, replays the second's: the
     console's own price (HTTP, the background task, its connection);
  3. the console on its defaults (100 rows a batch, 200ms apart) replays the
     third's: the throttle an operator gets.
Each console run is timed from the Confirm POST to the action's end.

Usage: .venv/bin/python bench/console_bench.py [--dead-letters 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import uvicorn
from psycopg.types.json import Jsonb

import machine
from pgoutbox.console.app import create_app
from pgoutbox.console.settings import ConsoleConfig
from pgoutbox.core import migrate, settings
from pgoutbox.dev.embedded import EmbeddedPostgres, free_port

HANDLERS = ("reference", "console_nopause", "console_defaults")
SUBJECT = "sea.event.order_created.v1"


def seed(url: str, handler: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        for i in range(n):
            mid = str(uuid.uuid4())
            envelope = {
                "message_id": mid,
                "subject": SUBJECT,
                "context": "sea",
                "event_type": "order_created",
                "event_version": 1,
                "payload": {"schema_version": 1, "n": i},
            }
            c.execute("SELECT inbox.receive(%s, %s, %s, %s)", (mid, handler, SUBJECT, Jsonb(envelope)))
            c.execute("SELECT inbox.record_error(%s, %s, 'HTTP 422: no', true, '1h')", (mid, handler))


def reference(url: str, handler: str) -> tuple[int, float]:
    flt = json.dumps({"side": "inbox", "owner": handler})
    done, start = 0, time.perf_counter()
    with psycopg.connect(url, autocommit=True) as c:
        while n := c.execute("SELECT outbox.dlq_replay(%s::jsonb, 'bench', 100)", (flt,)).fetchone()[0]:
            done += n
    return done, time.perf_counter() - start


async def console(url: str, user: str, handler: str, pause: str | None) -> tuple[int, float, int]:
    values = {"database_url": url, "port": str(free_port())}
    if pause is not None:
        values["action_pause"] = pause
    cfg = settings.build(ConsoleConfig, environ={}, overrides=values)
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_config=None, access_log=False))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cfg.port}") as client:
            page = await client.get("/login")
            token = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
            await client.post("/login", data={"user": user, "password": "-", "csrf": token})
            csrf = re.search(r'name="csrf" value="([^"]+)"', (await client.get("/")).text).group(1)
            form = {"csrf": csrf, "action": "replay", "scope": "filter", "side": "inbox", "owner": handler}
            start = time.perf_counter()
            started = await client.post("/actions/run", data={**form, "reason": "bench", "total": "0"})
            action = app.state.console.actions.get(started.headers["location"].rsplit("/", 1)[1])
            while action.state == "running":
                await asyncio.sleep(0.005)
            return action.done, time.perf_counter() - start, action.batches
    finally:
        server.should_exit = True
        await task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dead-letters", type=int, default=2000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-console-bench-"))
    pg = EmbeddedPostgres(root, settings={"fsync": "off", "synchronous_commit": "off"})
    pg.start()
    ticks = machine.cpu_ticks()
    try:
        with psycopg.connect(pg.dsn(), autocommit=True) as c:
            migrate.migrate(c)
            c.execute("CREATE ROLE bench_admin LOGIN IN ROLE pgoutbox_admin")
            c.execute("CREATE ROLE bench_consumer LOGIN IN ROLE pgoutbox_consumer")
        base = f"postgresql://127.0.0.1:{pg.port}/postgres"
        for h in HANDLERS:
            seed(base.replace("//", "//bench_consumer@"), h, args.dead_letters)
        print(f"{args.dead_letters} inbox dead letters per run; {machine.load()}")
        done, seconds = reference(base.replace("//", "//bench_admin@"), HANDLERS[0])
        print(f"reference: bare dlq_replay loop, 100/call   {done:6d} in {seconds:6.2f} s = {done / seconds:8.0f} /s")
        for handler, pause, label in (
            (HANDLERS[1], "0s", "console, pause 0"),
            (HANDLERS[2], None, "console, defaults"),
        ):
            done, seconds, batches = asyncio.run(console(base, "bench_admin", handler, pause))
            rate = done / seconds
            print(f"{label:<20s} 100/batch, {batches:3d} batches  {done:6d} in {seconds:6.2f} s = {rate:8.0f} /s")
        print(machine.steal_since(ticks))
    finally:
        pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
