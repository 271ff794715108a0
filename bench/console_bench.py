"""The console at scale (figures, not a test): 100,000 inbox dead letters
over 50 groups (10 handlers x 5 causes, 2,000 a group), recorded through the
consumer's own SQL functions (inbox.receive, inbox.record_error), so that each
is classified once, when recorded, as in production. Starts its own
PostgreSQL.

Then, as a pgoutbox_admin login:
  1. SQL alone, each call the median of 5 (after one warm-up): the groups
     (`dlq_groups`), a group page (`dlq_groups` of the group + the first
     and a later keyset page of `dlq_list`), the confirm dialog
     (`dlq_prepare` of a group: the set fixed and counted), one replay
     batch of a prepared action (`dlq_act`, 100 rows), and `dlq_prepare`
     of a whole handler (10,000: "select all N matching");
  2. the same pages through the console over HTTP (server-side rendering
     included; the median of 5);
  3. a bulk replay of one handler's 10,000 dead letters by the console, on
     its defaults and with OUTBOX_CONSOLE_ACTION_PAUSE=0, timed from the
     Confirm POST to the action's end, against a bare loop of the same SQL
     call (`dlq_act` with the default batch, until 0) on one connection.

Usage: .venv/bin/python bench/console_bench.py [--per-group 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import uvicorn

import machine
from pgoutbox.console.app import create_app
from pgoutbox.console.settings import ConsoleConfig
from pgoutbox.core import migrate, settings
from pgoutbox.dev.embedded import EmbeddedPostgres, free_port

HANDLERS = [f"handler_{i:02d}" for i in range(10)]
CAUSES = [
    "HTTP 422: order {n} has no tax region",
    "HTTP 503: upstream 'billing-{n}' unavailable",
    "TimeoutError: no answer within {n} ms",
    'BAD_PAYLOAD: field "amount" is {n}, expected a string',
    "KeyError: 'customer_{n}'",
]
SUBJECT = "sea.event.order_created.v1"

# One statement per handler and cause: receive + record_error dead, row by
# row inside the server (the consumer's calls, without its round trips).
SEED = """
WITH received AS (
    SELECT m.mid, m.i, inbox.receive(m.mid, %(handler)s::text, %(subject)s::text, jsonb_build_object(
        'message_id', m.mid, 'subject', %(subject)s::text, 'context', 'sea', 'event_type', 'order_created',
        'event_version', 1, 'tenant_id', 't' || (m.i %% 7), 'payload', jsonb_build_object('n', m.i)
    ))
    FROM (SELECT gen_random_uuid() AS mid, i FROM generate_series(1, %(n)s::int) AS i) AS m
)
SELECT count(inbox.record_error(r.mid, %(handler)s::text, replace(%(error)s::text, '{n}', r.i::text), true, '1h'))
FROM received AS r
"""


def seed(url: str, per_group: int) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        for handler in HANDLERS:
            for error in CAUSES:
                c.execute(SEED, {"handler": handler, "subject": SUBJECT, "error": error, "n": per_group})


def median_ms(call: Callable[[], Any], runs: int = 5) -> float:
    call()  # warm-up: plans and caches
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def sql_figures(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with psycopg.connect(url, autocommit=True) as c:
        group = c.execute(
            "SELECT group_id FROM outbox.dlq_groups(%s::jsonb, 1)", (json.dumps({"owner": HANDLERS[0]}),)
        ).fetchone()[0]
        g = json.dumps({"group": group})
        out["groups (dlq_groups, 200 groups max)"] = median_ms(
            lambda: c.execute("SELECT * FROM outbox.dlq_groups('{}'::jsonb, 200)").fetchall()
        )
        page = c.execute("SELECT cursor FROM outbox.dlq_list(%s::jsonb, 51)", (g,)).fetchall()
        after = page[49][0]
        out["group page (dlq_groups of it + dlq_list 51)"] = median_ms(
            lambda: (
                c.execute("SELECT * FROM outbox.dlq_groups(%s::jsonb, 1)", (g,)).fetchall(),
                c.execute("SELECT * FROM outbox.dlq_list(%s::jsonb, 51)", (g,)).fetchall(),
            )
        )
        out["a later keyset page (dlq_list after a cursor)"] = median_ms(
            lambda: c.execute("SELECT * FROM outbox.dlq_list(%s::jsonb, 51, %s)", (g, after)).fetchall()
        )
        out["confirm dialog: dlq_prepare of a group (2,000)"] = median_ms(
            lambda: c.execute("SELECT * FROM outbox.dlq_prepare(%s::jsonb, 'replay')", (g,)).fetchall()
        )
        whole = json.dumps({"owner": HANDLERS[1]})
        out["dlq_prepare of a handler (10,000: all N matching)"] = median_ms(
            lambda: c.execute("SELECT * FROM outbox.dlq_prepare(%s::jsonb, 'replay')", (whole,)).fetchall()
        )
        action = c.execute("SELECT action_id FROM outbox.dlq_prepare(%s::jsonb, 'replay')", (whole,)).fetchone()[0]
        out["one replay batch (dlq_act, 100 rows)"] = median_ms(
            lambda: c.execute("SELECT outbox.dlq_act(%s, 'bench', 100)", (action,)).fetchone()
        )
        c.execute("SELECT outbox.dlq_stop(%s)", (action,))
    return out


class Served:
    """The console on a free port in this event loop, logged in as `user`."""

    def __init__(self, url: str, user: str, **overrides: str) -> None:
        values = {"database_url": url, "port": str(free_port()), **overrides}
        self.cfg = settings.build(ConsoleConfig, environ={}, overrides=values)
        self.app = create_app(self.cfg)
        self.user = user

    async def __aenter__(self) -> Served:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.cfg.port, log_config=None, access_log=False)
        self.server = uvicorn.Server(config)
        self.task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.cfg.port}", timeout=120)
        page = await self.client.get("/login")
        token = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
        await self.client.post("/login", data={"user": self.user, "password": "-", "csrf": token})
        self.csrf = re.search(r'name="csrf" value="([^"]+)"', (await self.client.get("/")).text).group(1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        self.server.should_exit = True
        await self.task

    async def timed(self, method: str, path: str, **kwargs: Any) -> tuple[float, httpx.Response]:
        times, answer = [], None
        for i in range(6):
            start = time.perf_counter()
            answer = await self.client.request(method, path, **kwargs)
            assert answer.status_code < 400, (path, answer.status_code, answer.text[-300:])
            if i:
                times.append((time.perf_counter() - start) * 1000)
        assert answer is not None
        return statistics.median(times), answer


async def http_figures(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    async with Served(url, "bench_admin") as s:
        ms, groups = await s.timed("GET", "/dead-letters")
        out["/dead-letters (the groups)"] = ms
        group = re.search(r'data-group="([0-9a-f]{32})"', groups.text).group(1)
        ms, page = await s.timed("GET", f"/dead-letters/groups/{group}")
        out["a group's page"] = ms
        after = re.search(r'href="\?after=([^"]+)"', page.text)
        if after:
            ms, _ = await s.timed("GET", f"/dead-letters/groups/{group}?after={after.group(1)}")
            out["its next page (keyset)"] = ms
        form = {"csrf": s.csrf, "action": "replay", "scope": "group", "group": group}
        ms, _ = await s.timed("POST", "/actions/prepare", data=form)
        out["the confirm dialog (a group of 2,000)"] = ms
    return out


def reference(url: str, handler: str, batch: int) -> tuple[int, float]:
    with psycopg.connect(url, autocommit=True) as c:
        action = c.execute(
            "SELECT action_id FROM outbox.dlq_prepare(%s::jsonb, 'replay')", (json.dumps({"owner": handler}),)
        ).fetchone()[0]
        done, start = 0, time.perf_counter()
        while n := c.execute("SELECT outbox.dlq_act(%s, 'bench', %s)", (action, batch)).fetchone()[0]:
            done += n
    return done, time.perf_counter() - start


async def bulk(url: str, handler: str, **overrides: str) -> tuple[int, float, int]:
    async with Served(url, "bench_admin", **overrides) as s:
        form = {"csrf": s.csrf, "action": "replay", "scope": "filter", "owner": handler}
        dialog = await s.client.post("/actions/prepare", data=form)
        prepared = re.search(r'name="prepared" value="(\d+)"', dialog.text).group(1)
        start = time.perf_counter()
        started = await s.client.post("/actions/run", data={**form, "prepared": prepared, "reason": "bench"})
        action = s.app.state.console.actions.get(started.headers["location"].rsplit("/", 1)[1])
        while action.state == "running":
            await asyncio.sleep(0.005)
        return action.done, time.perf_counter() - start, action.batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-group", type=int, default=2000)
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
        start = time.perf_counter()
        seed(base.replace("//", "//bench_consumer@"), args.per_group)
        total = args.per_group * len(HANDLERS) * len(CAUSES)
        seconds = time.perf_counter() - start
        print(f"{total} inbox dead letters in {len(HANDLERS) * len(CAUSES)} groups, recorded in {seconds:.0f} s")
        with psycopg.connect(pg.dsn(), autocommit=True) as c:
            c.execute("VACUUM ANALYZE")
        print(machine.load())
        admin = base.replace("//", "//bench_admin@")
        print("SQL alone, median of 5:")
        for what, ms in sql_figures(admin).items():
            print(f"  {what:<52s} {ms:8.1f} ms")
        print("through the console over HTTP (rendering included), median of 5:")
        for what, ms in asyncio.run(http_figures(base)).items():
            print(f"  {what:<52s} {ms:8.1f} ms")
        print(f"bulk replay of one handler's {args.per_group * len(CAUSES)} dead letters:")
        batch = settings.build(ConsoleConfig, environ={}, overrides={}).action_batch  # the default
        done, seconds = reference(admin, HANDLERS[2], batch)
        rate = done / seconds
        print(f"  reference: bare dlq_act loop, {batch}/call          {done:6d} in {seconds:6.2f} s = {rate:6.0f} /s")
        for handler, pause, label in ((HANDLERS[3], {"action_pause": "0s"}, "pause 0"), (HANDLERS[4], {}, "defaults")):
            done, seconds, batches = asyncio.run(bulk(base, handler, **pause))
            print(
                f"  console, {label:<9s} {batches:4d} batches            {done:6d} in {seconds:6.2f} s = "
                f"{done / seconds:6.0f} /s"
            )
        print(machine.load())
        print(machine.steal_since(ticks))
    finally:
        pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
