"""What PostgreSQL spends on the relay's two hot calls alone (figures, not a
test): `outbox.claim(batch)` and `outbox.mark_published` over a backlog of
emitted events, no NATS and no relay process, this checkout's schema against
an earlier commit's, on one PostgreSQL 15 with pg_stat_statements, in
interleaved rounds.

Each round builds the backlog afresh (one database per schema, created from
that commit's migrations; emitted as a login in pgoutbox_writer only),
VACUUM ANALYZEs it, then claims and marks, as a login in pgoutbox_relay only, in a loop
until nothing is left, and prints per event: the loop's wall time, and for the
claim and the mark (and the statements nested in them) time and shared
buffers from pg_stat_statements. Separates the drain's cost in these two
statements from everything else the server does during a relay's drain (the
relay's other sessions, WAL, autovacuum), which bench/relay_bench.py measures
as a whole.

    .venv/bin/python bench/claim_mark_bench.py --before COMMIT [--events 20000] [--batch 500] [--rounds 3]
        [--tenants N] [--scheduled N]

--tenants N: the events belong to N tenants in turn (t0, t1, ..., as a
multi-tenant application emits them; 0: no tenant), to price the fair order of
claims with 1 and with 1,000 tenants (docs/benchmarks.md, "One tenant's backlog and the other tenants").
--scheduled N: before the backlog, N events emitted with deliver_after => 1 day
(reminders, as a scheduling application keeps them waiting), which no claim of
the drain may take: what waiting events cost each claim.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from machine import cpu_ticks, load, steal_since
from pgoutbox.dev.embedded import EmbeddedPostgres

ROOT = Path(__file__).resolve().parents[1]
WRITER, RELAY = "bench_writer", "bench_relay"  # logins in pgoutbox_writer, pgoutbox_relay only


def migrations_of(commit: str, into: Path) -> Path:
    """The up migrations of `commit`, written to a folder of their own."""
    into.mkdir(parents=True)
    listing = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{commit}:migrations"], capture_output=True, text=True
    )
    if listing.returncode != 0:
        raise SystemExit(f"claim_mark_bench: --before {commit}: no migrations/ at that commit in {ROOT}")
    names = listing.stdout.split()
    for name in names:
        if name.endswith(".up.sql"):
            text = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{commit}:migrations/{name}"], check=True, capture_output=True
            ).stdout
            (into / name).write_bytes(text)
    return into


def build(pg: EmbeddedPostgres, name: str, migrations: Path, events: int, tenants: int, scheduled: int) -> None:
    with psycopg.connect(pg.dsn(), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    with psycopg.connect(pg.dsn(name), autocommit=True) as conn:
        for path in sorted(migrations.glob("*.up.sql")):
            conn.execute(path.read_text())  # a file of statements, no parameters: the simple protocol
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT outbox.create_partitions()")
        for login, group in ((WRITER, "pgoutbox_writer"), (RELAY, "pgoutbox_relay")):  # roles are per server
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (login,)).fetchone() is None:
                conn.execute(f"CREATE ROLE {login} LOGIN IN ROLE {group}")
    with psycopg.connect(pg.dsn(name).replace("postgres@", f"{WRITER}@"), autocommit=True) as conn:
        if scheduled:
            conn.execute(
                "SELECT count(outbox.emit('reminder'::varchar, g::text, 'Remind', '{\"schema_version\": 1}'::jsonb,"
                " context => 'orders', deliver_after => interval '1 day')) FROM generate_series(1, %s) AS g",
                (scheduled,),
            )
        for start in range(0, events, 1000):
            with conn.transaction():
                for n in range(start, min(events, start + 1000)):
                    conn.execute(
                        "SELECT outbox.emit(%s::text, %s::text, %s::text, %s::jsonb, %s::text, tenant_id => %s::text)",
                        (
                            "order",
                            str(n),
                            "OrderPlaced",
                            f'{{"schema_version": 1, "n": {n}}}',
                            "orders",
                            f"t{n % tenants}" if tenants else None,
                        ),
                    )
    with psycopg.connect(pg.dsn(name), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox.events")


def drain(pg: EmbeddedPostgres, name: str, batch: int) -> tuple[int, float, list[tuple]]:
    with (
        psycopg.connect(pg.dsn(name), autocommit=True) as owner,
        psycopg.connect(pg.dsn(name).replace("postgres@", f"{RELAY}@"), autocommit=True) as conn,
    ):
        owner.execute("SELECT pg_stat_statements_reset()")
        started, done = time.perf_counter(), 0
        while True:
            rows = conn.execute(
                "SELECT claim_token, event_id FROM outbox.claim('bench', %s, '30 seconds')", (batch,)
            ).fetchall()
            if not rows:
                break
            conn.execute("SELECT outbox.mark_published(%s::uuid, %s::uuid[])", (rows[0][0], [r[1] for r in rows]))
            done += len(rows)
        elapsed = time.perf_counter() - started
        statements = owner.execute(
            "SELECT toplevel, calls, total_exec_time, shared_blks_hit + shared_blks_read,"
            " left(regexp_replace(query, '\\s+', ' ', 'g'), 80)"
            " FROM pg_stat_statements"
            " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
            "   AND query NOT LIKE '%pg_stat_statements%'"
            " ORDER BY total_exec_time DESC LIMIT 6"
        ).fetchall()
    return done, elapsed, statements


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, metavar="COMMIT")
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=0, help="events spread over this many tenants in turn (0: none)")
    ap.add_argument("--scheduled", type=int, default=0, help="events waiting for tomorrow, emitted first (0: none)")
    args = ap.parse_args()
    if args.events < 1 or args.rounds < 1 or not 1 <= args.batch <= 10000:  # claim's own bounds for the batch
        ap.error("--events and --rounds must be at least 1, --batch from 1 to 10000")
    if args.tenants < 0 or args.scheduled < 0:
        ap.error("--tenants and --scheduled must be 0 or more")
    start = cpu_ticks()
    print(
        f"claim + mark alone: {args.events} events of {args.tenants or 'no'} tenant(s),"
        f" {args.scheduled} scheduled for tomorrow waiting, batches of {args.batch}; {load()}"
    )
    with tempfile.TemporaryDirectory(prefix="pgoutbox-claim-mark-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # the postgres user runs the server in it
        schemas = {args.before: migrations_of(args.before, root / "before"), "this": ROOT / "migrations"}
        pg = EmbeddedPostgres(
            root / "pg",
            settings={"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"},
        )
        pg.start()
        try:
            for r in range(args.rounds):
                order = list(schemas) if r % 2 == 0 else list(reversed(schemas))
                for label in order:
                    name = "before" if label == args.before else "this"
                    build(pg, name, schemas[label], args.events, args.tenants, args.scheduled)
                    done, elapsed, statements = drain(pg, name, args.batch)
                    print(f"round {r + 1} {label:>9}: {1e6 * elapsed / done:6.1f} us of wall time per event")
                    for top, calls, ms, buffers, query in statements:
                        print(
                            f"    {'top   ' if top else 'nested'} {calls:5d} calls {1000 * ms / done:7.1f} us/event"
                            f" {buffers / done:6.1f} buffers/event  {query}"
                        )
        finally:
            pg.stop()
    print(f"done: {load()}; {steal_since(start)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
