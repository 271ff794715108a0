"""Fair claims under a held snapshot (figures, not a test): what claim costs
while another session holds a snapshot, during and after one tenant's
backlog, for this checkout's schema and --before COMMIT's, side by side on
one PostgreSQL 15 with pg_stat_statements (claim_mark_bench's databases:
each commit's migrations, logins in pgoutbox_writer and pgoutbox_relay only).

Per schema, with a snapshot held (REPEATABLE READ, open) from before the
first emit to the end:
  1. drain: --backlog events of the tenant 'bulk' committed at once, then
     claims of 500 (the relay's batch_size) each followed by its mark and by
     5 events of the ten quiet tenants in turn (their traffic), until a
     claim comes back short;
  2. after: --claims rounds of 5 quiet events then a claim of 500 (a relay
     at moderate rates: about 5 rows a claim) and its mark, every entry the
     drain left still in the indexes (after --settle such rounds unmeasured);
  3. the same rounds on a fresh database with nothing held (clean).
Prints per phase the claim's time and shared buffers per call
(pg_stat_statements, the top-level call: its nested statements included).

    .venv/bin/python bench/fair_held.py [--before main] [--backlog 100000] [--claims 200] [--settle 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import psycopg

from claim_mark_bench import RELAY, ROOT, WRITER, build, migrations_of
from machine import cpu_ticks, load, steal_since
from pgoutbox.dev.embedded import EmbeddedPostgres

EMIT = "SELECT outbox.emit('order', %s, 'OrderPlaced', '{\"schema_version\": 1}', context => 'orders', tenant_id => %s)"
BACKLOG = (
    "SELECT count(outbox.emit('order', 'bulk-' || g::text, 'OrderPlaced', '{\"schema_version\": 1}',"
    " context => 'orders', tenant_id => 'bulk')) FROM generate_series(1, %s) AS g"
)
CLAIM = "SELECT claim_token, event_id FROM outbox.claim('bench', 500, '30 seconds')"


def quiet(writer: psycopg.Connection, n: int, start: int) -> int:
    for i in range(n):
        writer.execute(EMIT, (f"q{start + i}", f"quiet{(start + i) % 10}"))
    return start + n


def claim_and_mark(relay: psycopg.Connection) -> int:
    rows = relay.execute(CLAIM).fetchall()
    if rows:
        relay.execute("SELECT outbox.mark_published(%s::uuid, %s::uuid[])", (rows[0][0], [r[1] for r in rows]))
    return len(rows)


def claim_figures(owner: psycopg.Connection) -> tuple[int, float, float]:
    """Calls, µs and shared buffers per call of the top-level claim."""
    calls, ms, buffers = owner.execute(
        "SELECT sum(calls), sum(total_exec_time), sum(shared_blks_hit + shared_blks_read) FROM pg_stat_statements"
        " WHERE toplevel AND query LIKE '%outbox.claim(%'"
        "   AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone()
    calls = int(calls or 0)
    return calls, 1000 * float(ms or 0) / max(calls, 1), float(buffers or 0) / max(calls, 1)


def run(
    pg: EmbeddedPostgres, name: str, migrations: Path, backlog: int, claims: int, settle: int, hold: bool
) -> list[str]:
    build(pg, name, migrations, 0, 0, 0)
    out = []
    with (
        psycopg.connect(pg.dsn(name), autocommit=True) as owner,
        psycopg.connect(pg.dsn(name), autocommit=True) as holder,
        psycopg.connect(pg.dsn(name).replace("postgres@", f"{WRITER}@"), autocommit=True) as writer,
        psycopg.connect(pg.dsn(name).replace("postgres@", f"{RELAY}@"), autocommit=True) as relay,
    ):
        if hold:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM pg_class")
        n = 0
        if backlog:
            owner.execute("SELECT pg_stat_statements_reset()")
            writer.execute(BACKLOG, (backlog,))
            while claim_and_mark(relay) == 500:
                n = quiet(writer, 5, n)
            calls, us, buffers = claim_figures(owner)
            out.append(f"drain  {calls:5d} claims {us:8.0f} us {buffers:7.0f} buffers per claim")
        for _ in range(settle):  # the floor catches up with the drain's end first
            n = quiet(writer, 5, n)
            claim_and_mark(relay)
        owner.execute("SELECT pg_stat_statements_reset()")
        for _ in range(claims):
            n = quiet(writer, 5, n)
            claim_and_mark(relay)
        calls, us, buffers = claim_figures(owner)
        out.append(f"after  {calls:5d} claims {us:8.0f} us {buffers:7.0f} buffers per claim")
        if hold:
            holder.execute("ROLLBACK")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="main", metavar="COMMIT")
    ap.add_argument("--backlog", type=int, default=100000)
    ap.add_argument("--claims", type=int, default=200)
    ap.add_argument("--settle", type=int, default=0, help="claims after the drain before the figures start")
    args = ap.parse_args()
    start = cpu_ticks()
    print(f"fair claims under a held snapshot: backlog {args.backlog}, {args.claims} claims after; {load()}")
    with tempfile.TemporaryDirectory(prefix="pgoutbox-fair-held-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # the postgres user runs the server in it
        schemas = {args.before: migrations_of(args.before, root / "before"), "this": ROOT / "migrations"}
        pg = EmbeddedPostgres(
            root / "pg",
            settings={"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"},
        )
        pg.start()
        try:
            for label, migrations in schemas.items():
                for hold in (True, False):
                    lines = run(pg, "db", migrations, args.backlog if hold else 0, args.claims, args.settle, hold)
                    for line in lines:
                        print(f"{label:>9} {'held ' if hold else 'clean'} {line}")
        finally:
            pg.stop()
    print(f"done: {load()}; {steal_since(start)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
