"""Held-snapshot benchmark (figures, not a test): what a snapshot held by
another session does to pgoutbox's hot statements, for this checkout's schema
and, side by side in the same run, --before COMMIT's (default: main).

Another session runs `BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*)
FROM pg_class;` and keeps the transaction open: from then on no dead row
version can be vacuumed, nor its index entries marked dead, until it ends.

For each schema, on a private PostgreSQL 15 and nats-server (fsync on, free
loopback ports, stopped by PID at the end), with the relay on its defaults
as a login in pgoutbox_relay only:

  1. the relay-only drain of a backlog of --events events, nothing held;
  2. the same drain with the snapshot held from before the emits (every
     row version the drain leaves stays);
  3. with the snapshot still held, the consumer's inbox path for as many
     messages (inbox.receive_batch then inbox.settle, batches of 100), its
     time per message in the first and the last tenth of the batches;
  4. still held: each hot statement under auto_explain (ANALYZE, BUFFERS;
     nested statements; rolled back): the shared buffers it touched and its
     time; then the dead tuples, updates and HOT updates per table
     (pg_stat_user_tables), the size of each index, the NOTIFY queue's use;
  5. the snapshot released and the tables vacuumed: the hot statements again.

    .venv/bin/python bench/held_snapshot.py [--events 30000] [--before main]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats
import psycopg

import checkout  # noqa: F401  (the checkout's root on sys.path, for harness/)
import machine
from harness import releases
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres
from pgoutbox.outbox import streams
from relay_bench import RELAY_LOGIN, postgres_cpu_seconds, relay_process

CONTEXT = "held"
HOLD = "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class;"


def migrate_with(url: str, pythonpath: str | None) -> None:
    """Migrates with the package at pythonpath (None: this checkout)."""
    if pythonpath is None:
        with psycopg.connect(url, autocommit=True) as conn:
            migrate.migrate(conn)
        return
    code = (
        "import psycopg, sys; from pgoutbox.core import migrate;"
        " migrate.migrate(psycopg.connect(sys.argv[1], autocommit=True))"
    )
    subprocess.run(
        [sys.executable, "-c", code, url], check=True, env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"}
    )


def emit_backlog(url: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for start in range(0, n, 1000):
            conn.execute(
                "SELECT count(outbox.emit('order', g::text, 'order_created',"
                " jsonb_build_object('schema_version', 1, 'order_id', g), context => %s))"
                " FROM generate_series(%s::int, %s::int) AS g",
                (CONTEXT, start, min(n, start + 1000) - 1),
            )


def drain(
    root: Path, pg: EmbeddedPostgres, ns: EmbeddedNats, n: int, name: str, pythonpath: str | None
) -> tuple[float, float]:
    """(events/s from the first to the last published_at, PostgreSQL CPU µs per event)."""
    cpu = postgres_cpu_seconds(pg)
    with psycopg.connect(pg.url, autocommit=True) as conn:
        mark = conn.execute("SELECT coalesce(max(id), 0) FROM outbox.events").fetchone()[0]
        emit_backlog(pg.url, n)
        with relay_process(root, pg, ns, name, pythonpath=pythonpath, defaults=True) as proc:
            while conn.execute(
                "SELECT count(*) FROM outbox.events WHERE id > %s AND status <> 'COMPLETED'", (mark,)
            ).fetchone()[0]:
                if proc.poll() is not None:
                    raise RuntimeError(f"relay exited with {proc.returncode}; see {root}/{name}.log")
                time.sleep(0.2)
        first, last = conn.execute(
            "SELECT min(published_at), max(published_at) FROM outbox.events WHERE id > %s", (mark,)
        ).fetchone()
    time.sleep(0.5)
    return n / max((last - first).total_seconds(), 1e-6), (postgres_cpu_seconds(pg) - cpu) / n * 1e6


def inbox_load(url: str, n: int) -> tuple[float, float]:
    """receive_batch + settle for n new messages in batches of 100: ms per message
    in the first and the last tenth of the batches."""
    times = []
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(n // 100):
            ids = [uuid.uuid4() for _ in range(100)]
            started = time.perf_counter()
            with conn.transaction():
                conn.execute(
                    "SELECT count(*) FROM inbox.receive_batch('bench', %s, %s, %s)",
                    (ids, [f"{CONTEXT}.event.order_created.v1"] * 100, ["{}"] * 100),
                )
            with conn.transaction():
                conn.execute("SELECT count(*) FROM inbox.settle('bench', %s)", (ids,))
            times.append((time.perf_counter() - started) * 1000 / 100)
    tenth = max(1, len(times) // 10)
    return sum(times[:tenth]) / tenth, sum(times[-tenth:]) / tenth


STATEMENTS = {
    "outbox.claim(batch 10)": "SELECT count(*) FROM outbox.claim('bench', 10, '30 seconds')",
    "claim(10) + mark_published": (
        "SELECT outbox.mark_published(c.claim_token, array_agg(c.event_id))"
        " FROM outbox.claim('bench', 10, '30 seconds') AS c GROUP BY c.claim_token"
    ),
    "outbox.backlog()": "SELECT count(*) FROM outbox.backlog()",
    "inbox.receive_batch(100)": (
        "SELECT count(*) FROM inbox.receive_batch('bench', %(ids)s, %(subjects)s, %(envelopes)s)"
    ),
    "inbox.backlog()": "SELECT count(*) FROM inbox.backlog()",
}
BUFFERS = re.compile(r"Buffers: shared hit=(\d+)(?: read=(\d+))?")
DURATION = re.compile(r"duration: ([0-9.]+) ms")


def explain(url: str, emit_first: int) -> None:
    """Each hot statement under auto_explain, in a rolled-back transaction; prints
    the buffers and time of each nested statement that reads pgoutbox's tables."""
    with psycopg.connect(url) as conn:
        notes: list[str] = []
        conn.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
        if emit_first:
            emit_backlog(url, emit_first)  # something due for the claim to take
        conn.execute("LOAD 'auto_explain'")
        for setting, value in (
            ("log_min_duration", "0"),
            ("log_analyze", "on"),
            ("log_buffers", "on"),
            ("log_nested_statements", "on"),
            ("log_level", "notice"),
        ):
            conn.execute(f"SET auto_explain.{setting} = {value}")
        conn.commit()
        ids = [uuid.uuid4() for _ in range(100)]
        args = {"ids": ids, "subjects": [f"{CONTEXT}.event.order_created.v1"] * 100, "envelopes": ["{}"] * 100}
        for label, sql in STATEMENTS.items():
            notes.clear()
            started = time.perf_counter()
            conn.execute(sql, args if "%(" in sql else None)
            took = (time.perf_counter() - started) * 1000
            conn.rollback()
            parts = []
            for note in notes:
                text = note.split("Query Text:", 1)[-1].strip() if "Query Text:" in note else "?"
                text = " ".join(line for line in text.splitlines() if "_check_" not in line)[:40]
                if "outbox.events" not in note and "inbox.messages" not in note:
                    continue
                if text.upper().startswith("SELECT COUNT(*) FROM OUTBOX") or "FROM outbox.claim(" in text:
                    continue
                b = BUFFERS.search(note)
                d = DURATION.search(note)
                hits = int(b.group(1)) + int(b.group(2) or 0) if b else 0
                parts.append(f"{text!r}: {hits} buffers, {float(d.group(1)) if d else 0:.2f} ms")
            print(f"      {label:26s} {took:8.2f} ms in all; " + ("; ".join(parts) or "-"), flush=True)


def table_figures(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT schemaname || '.' || relname, n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd"
            " FROM pg_stat_user_tables WHERE schemaname IN ('outbox', 'inbox') AND (n_tup_upd > 0 OR n_dead_tup > 0)"
            " ORDER BY 1"
        ).fetchall()
        for name, live, dead, upd, hot in rows:
            print(
                f"      {name:32s} live {live:8,d}  dead {dead:8,d}  updates {upd:8,d}"
                f"  HOT {hot / upd if upd else 0:6.1%}"
            )
        idx = conn.execute(
            "SELECT i.schemaname || '.' || i.indexrelname, pg_relation_size(i.indexrelid)"
            " FROM pg_stat_user_indexes AS i WHERE i.schemaname IN ('outbox', 'inbox')"
            " AND pg_relation_size(i.indexrelid) > 8192 * 4 ORDER BY 2 DESC LIMIT 10"
        ).fetchall()
        print("      indexes: " + ", ".join(f"{n} {s / 1024:,.0f} kB" for n, s in idx))
        usage = conn.execute("SELECT pg_notification_queue_usage()").fetchone()[0]
        print(f"      NOTIFY queue usage {usage:.4%}")


def one_schema(root: Path, label: str, pythonpath: str | None, events: int) -> None:
    pg = EmbeddedPostgres(root / f"pg-{label}", settings={"max_wal_size": "4GB"})
    ns = EmbeddedNats(root / f"nats-{label}")
    pg.start()
    ns.start()
    try:
        migrate_with(pg.url, pythonpath)
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {RELAY_LOGIN} LOGIN IN ROLE pgoutbox_relay")
        specs = [streams.StreamSpec(CONTEXT, "HELD_EVENTS", (f"{CONTEXT}.event.>",), "limits", "file", 1, 0, -1, 120)]

        async def setup_stream() -> None:
            nc = await nats.connect(ns.url)
            await streams.apply(nc.jetstream(), specs)
            await nc.close()

        asyncio.run(setup_stream())
        print(f"  schema of {label}:", flush=True)
        rate, cpu = drain(root, pg, ns, events, f"{label}-clean", pythonpath)
        print(
            f"    1. relay-only drain of {events:,} events, nothing held: {rate:8,.0f} events/s,"
            f" PostgreSQL {cpu:.0f} µs/event",
            flush=True,
        )
        with psycopg.connect(pg.url, autocommit=True, application_name="bench: held snapshot") as holder:
            for stmt in HOLD.split(";")[:2]:
                holder.execute(stmt)
            try:
                rate, cpu = drain(root, pg, ns, events, f"{label}-held", pythonpath)
                print(
                    f"    2. the same drain, snapshot held:          {rate:8,.0f} events/s,"
                    f" PostgreSQL {cpu:.0f} µs/event",
                    flush=True,
                )
                first, last = inbox_load(pg.url, events)
                print(
                    f"    3. inbox receive_batch + settle of {events:,} messages, held: {first:.3f} ms/message"
                    f" in the first tenth, {last:.3f} in the last",
                    flush=True,
                )
                print("    4. still held: the hot statements", flush=True)
                explain(pg.url, 200)
                table_figures(pg.url)
            finally:
                holder.execute("ROLLBACK")
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) outbox.events")
            conn.execute("VACUUM (ANALYZE) inbox.messages")
        print("    5. released and vacuumed: the hot statements", flush=True)
        explain(pg.url, 200)
    finally:
        with contextlib.suppress(Exception):
            ns.stop()
        pg.stop("immediate")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=30000, help="events per drain (and inbox messages)")
    ap.add_argument("--before", default="main", help="the commit whose schema to compare with ('' for none)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-held-bench-"))
    root.chmod(0o755)  # PostgreSQL runs as another user
    print(f"held-snapshot bench: {args.events:,} events; {machine.load()}", flush=True)
    ticks = machine.cpu_ticks()
    try:
        schemas: list[tuple[str, str | None]] = []
        if args.before:
            repo = Path(__file__).resolve().parents[1]
            commit = subprocess.run(
                ["git", "-C", str(repo), "rev-parse", "--short", args.before],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            schemas.append((f"before ({commit})", str(releases.export(repo, commit, root / "before"))))
        schemas.append(("this checkout", None))
        for label, path in schemas:
            one_schema(root, label.split()[0], path, args.events)
        print(f"done: {machine.load()}; {machine.steal_since(ticks)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
