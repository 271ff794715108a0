"""Dead-letter operations benchmark (figures, not a test). Starts its own
PostgreSQL, migrates, and fills a database with --settled settled rows per
side (COMPLETED events, PROCESSED inbox messages) and --dead dead letters per
side (half of the inbox ones `HTTP 500: order <uuid> failed after <n> tries`,
half `BAD_PAYLOAD: field "amount" is <x>`; the outbox ones `NO_STREAM: ...`).
Then it times, median of --rounds:

  * outbox.dlq_groups() over everything, against the query an operator
    writes today (GROUP BY handler, subject, last_error over the inbox's dead
    letters: no masking, so one group per row), side by side;
  * one page of outbox.dlq_list(), and outbox.dlq_count();
  * a whole discard then restore of every dead letter through
    outbox.dlq_discard / dlq_restore in batches of --batch (audited,
    guarded), against a bare UPDATE of the same rows' status in batches of
    the same size (no audit, no guard check: the reference).

Usage: .venv/bin/python bench/dlq_bench.py [--dead 3000] [--settled 200000] [--batch 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

import machine
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres

FILL = """
INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload)
SELECT 'sea', 'order', i::text, 'created', '{"schema_version": 1}' FROM generate_series(1, %(settled)s + %(dead)s) AS i;
UPDATE outbox.events SET status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),
    claimed_at = now(), claimed_by = 'bench';
UPDATE outbox.events SET status = CASE WHEN id <= %(dead)s THEN 'DEAD_LETTER' ELSE 'COMPLETED' END,
    published_at = CASE WHEN id > %(dead)s THEN now() END,
    last_error = CASE WHEN id <= %(dead)s THEN 'NO_STREAM: no stream for ' || event_id END;
INSERT INTO inbox.messages (message_id, handler, subject, status, processed_at)
SELECT gen_random_uuid(), 'billing', 'sea.event.order_created.v1', 'PROCESSED', now()
FROM generate_series(1, %(settled)s);
SELECT count(*) FROM (
    SELECT inbox.receive(g, 'billing', 'sea.event.order_created.v1',
        jsonb_build_object('message_id', g, 'payload', '{"schema_version": 1}'::jsonb)),
        inbox.record_error(g, 'billing', CASE WHEN n %% 2 = 0
            THEN 'HTTP 500: order ' || g || ' failed after ' || n %% 7 || ' tries'
            ELSE 'BAD_PAYLOAD: field "amount" is ' || n || '.5' END, TRUE)
    FROM (SELECT gen_random_uuid() AS g, n FROM generate_series(1, %(dead)s) AS n) AS x
) AS y
"""

TODAY = """SELECT handler, subject, last_error, count(*) FROM inbox.messages
WHERE status = 'DEAD_LETTER' GROUP BY 1, 2, 3"""


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def loop(conn: psycopg.Connection, sql: str, params: tuple) -> int:
    total = 0
    while n := conn.execute(sql, params).fetchone()[0]:
        total += n
    return total


def bare_loop(conn: psycopg.Connection, to_outbox: str, to_inbox: str, batch: int) -> int:
    """The reference: the same status moves with no audit and no guard check."""
    conn.execute("ALTER TABLE outbox.events DISABLE TRIGGER USER")
    conn.execute("ALTER TABLE inbox.messages DISABLE TRIGGER USER")
    conn.execute("ALTER TABLE outbox.discarded_events DISABLE TRIGGER USER")
    try:
        total = 0
        for sql in (to_outbox, to_inbox):
            while n := conn.execute(sql, (batch,)).rowcount:
                total += n
        return total
    finally:
        conn.execute("ALTER TABLE outbox.events ENABLE TRIGGER USER")
        conn.execute("ALTER TABLE inbox.messages ENABLE TRIGGER USER")
        conn.execute("ALTER TABLE outbox.discarded_events ENABLE TRIGGER USER")


BARE_OUT = [
    # an outbox event stays DEAD_LETTER: its discard is a mark of its own
    """INSERT INTO outbox.discarded_events (event_id, row_id, created_at)
        SELECT e.event_id, e.id, e.created_at FROM outbox.events AS e WHERE e.status = 'DEAD_LETTER'
            AND NOT EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id) LIMIT %s""",
    """UPDATE inbox.messages SET dlq_metadata = dlq_metadata || '{"discarded": {}}' WHERE (message_id, handler) IN (
        SELECT message_id, handler FROM inbox.messages
        WHERE status = 'DEAD_LETTER' AND NOT dlq_metadata ? 'discarded' LIMIT %s)""",
]
BARE_BACK = [
    """DELETE FROM outbox.discarded_events WHERE event_id IN (
        SELECT event_id FROM outbox.discarded_events LIMIT %s)""",
    """UPDATE inbox.messages SET dlq_metadata = dlq_metadata - 'discarded' WHERE (message_id, handler) IN (
        SELECT message_id, handler FROM inbox.messages WHERE dlq_metadata ? 'discarded' LIMIT %s)""",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dead", type=int, default=3000, help="dead letters per side")
    parser.add_argument("--settled", type=int, default=200_000, help="settled rows per side")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pgoutbox-dlq-bench-"))
    root.chmod(0o755)  # PostgreSQL runs as another user below it
    pg = EmbeddedPostgres(root / "pg", settings={"fsync": "off", "synchronous_commit": "off"})
    pg.start()
    try:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        url = pg.dsn("bench")
        with psycopg.connect(url, autocommit=True) as conn:
            migrate.migrate(conn)
            t = time.monotonic()
            for statement in FILL.split(";\n"):
                conn.execute(statement, {"settled": args.settled, "dead": args.dead})
            conn.execute("VACUUM ANALYZE outbox.events")
            conn.execute("VACUUM ANALYZE inbox.messages")
            print(
                f"setup: {args.dead:,} dead letters and {args.settled:,} settled rows per side "
                f"in {time.monotonic() - t:.0f}s (not measured)"
            )
            print(machine.load())
            steal = machine.cpu_ticks()
            groups = conn.execute("SELECT count(*) FROM outbox.dlq_groups('{}', 10000)").fetchone()[0]
            today = conn.execute(f"SELECT count(*) FROM ({TODAY}) AS t").fetchone()[0]
            figures: dict[str, list[float]] = {k: [] for k in ("groups", "today", "list", "count", "ops", "bare")}
            moved = (0, 0)
            for _ in range(args.rounds):
                figures["groups"].append(timed(lambda: conn.execute("SELECT * FROM outbox.dlq_groups()").fetchall()))
                figures["today"].append(timed(lambda: conn.execute(TODAY).fetchall()))
                figures["list"].append(timed(lambda: conn.execute("SELECT * FROM outbox.dlq_list()").fetchall()))
                figures["count"].append(
                    timed(lambda: conn.execute("SELECT outbox.dlq_count('{}', 'discard')").fetchall())
                )
                t = time.perf_counter()
                d = loop(conn, "SELECT outbox.dlq_discard('{}', 'bench', %s)", (args.batch,))
                r = loop(conn, "SELECT outbox.dlq_restore('{}', 'bench', %s)", (args.batch,))
                figures["ops"].append(time.perf_counter() - t)
                t = time.perf_counter()
                bd = bare_loop(conn, *BARE_OUT, args.batch)
                br = bare_loop(conn, *BARE_BACK, args.batch)
                figures["bare"].append(time.perf_counter() - t)
                moved = (d + r, bd + br)
            print(machine.steal_since(steal))
            med = {k: statistics.median(v) * 1000 for k, v in figures.items()}
            n = 2 * args.dead
            print(f"dlq_groups, {n:,} dead letters -> {groups} groups:  {med['groups']:8.1f} ms")
            print(f"  reference: GROUP BY last_error (inbox only) -> {today:,} groups: {med['today']:8.1f} ms")
            print(f"dlq_list, one page of 100:                      {med['list']:8.1f} ms")
            print(f"dlq_count (discard):                            {med['count']:8.1f} ms")
            print(
                f"discard + restore of all, batches of {args.batch}: {moved[0]:,} moves in {med['ops']:8.1f} ms"
                f" = {moved[0] / med['ops'] * 1000:,.0f} rows/s"
            )
            print(
                f"  reference: bare UPDATEs, same batches:       {moved[1]:,} moves in {med['bare']:8.1f} ms"
                f" = {moved[1] / med['bare'] * 1000:,.0f} rows/s"
            )
    finally:
        pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
