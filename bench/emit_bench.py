"""Emit benchmark (figures, not a test): what `outbox.emit()` costs a business
transaction, side by side with a plain INSERT of the same row into a minimal
outbox table, in one run on one PostgreSQL.

Each writer is a process of its own with one connection and runs one event per
transaction (BEGIN; statement; COMMIT) as fast as it can. Sides:

  emit     outbox.emit(...) on the schema of this checkout;
  plain    INSERT INTO a minimal outbox table: uuid primary key, subject,
           jsonb payload, status, created_at, and an index on pending rows;
  keyed    outbox.emit(..., event_id => ...): the caller's own id (a UUIDv5
           drawn by the writer, new for every event), registered in
           outbox.event_keys: what a retry-safe emit costs;
  scheduled  outbox.emit(..., deliver_after => '1 hour'): a delayed event,
           entered in outbox.schedules;
  correlated outbox.emit(..., correlation_id => ...): an event of a business
           flow, entered in the partial index events_correlation_idx;
  before   outbox.emit(...) on the previous schema version (a database
           migrated one version short), to show what the newest migration
           changed; with --before COMMIT, on the schema that commit's own
           migrations build (bench/guard.py compares releases so).

Rounds are interleaved: every round runs each side for --seconds, in an order
that rotates from round to round, so that a moment of noise on this shared
machine falls on every side alike. All sides share the server and its
durability (fsync on, synchronous_commit as given). Printed per side: the
median transactions/s, the ratio to the plain INSERT (median of the rounds'
ratios), and CPU per transaction: the writers' backends (from /proc), the
whole PostgreSQL server (postmaster and every child: WAL writer and
checkpointer included) and the Python writers themselves. Then emit and
plain run at once, as many writers each, so that both meet the same moment
of this shared machine (its disk and CPUs are shared with other work): the
ratio of their rates. Then the same transactions inside the server, a
procedure that runs `statement; COMMIT` 5,000 times (no client, no network,
synchronous_commit off in that session): backend CPU per transaction, what
emit itself costs. Last, the hypervisor's steal over the run.

    .venv/bin/python bench/emit_bench.py [--writers 1,4] [--rounds 5] [--seconds 2]
        [--synchronous-commit on|off] [--sides emit,plain,before,keyed,scheduled,correlated] [--headers]
        [--before COMMIT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

import checkout  # noqa: F401  (the checkout's root on sys.path, for harness/)
import figures
import machine
from harness import releases
from pgoutbox import SCHEMA_VERSION
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres
from relay_bench import migrate_as, postgres_cpu_seconds
from sql_bench import new_database

PAYLOAD = json.dumps({"schema_version": 1, "order_id": "abc-123", "total": 99.99, "lines": [1, 2, 3]})
TRACEPARENT = json.dumps({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})

PLAIN_TABLE = """
CREATE TABLE public.outbox_plain (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    subject text NOT NULL,
    payload jsonb NOT NULL,
    status text NOT NULL DEFAULT 'PENDING',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_plain_pending ON public.outbox_plain (created_at) WHERE status = 'PENDING';
"""

EMIT = "SELECT outbox.emit('order', %(n)s, 'order_created', %(payload)s::jsonb, context => 'sea')"
EMIT_HEADERS = (
    "SELECT outbox.emit('order', %(n)s, 'order_created', %(payload)s::jsonb, context => 'sea',"
    " headers => %(headers)s::jsonb)"
)
KEYED = "SELECT outbox.emit('order', %(n)s, 'order_created', %(payload)s::jsonb, context => 'sea', event_id => %(id)s)"
SCHEDULED = (
    "SELECT outbox.emit('order', %(n)s, 'order_created', %(payload)s::jsonb, context => 'sea',"
    " deliver_after => interval '1 hour')"
)
CORRELATED = (
    "SELECT outbox.emit('order', %(n)s, 'order_created', %(payload)s::jsonb, context => 'sea',"
    " correlation_id => gen_random_uuid())"
)
PLAIN = "INSERT INTO public.outbox_plain (subject, payload) VALUES ('sea.event.order_created.v1', %(payload)s::jsonb)"


def _writer(url: str, statement: str, headers: str, start_at: float, seconds: float, out: mp.Queue) -> None:
    """One writer: one event per transaction until the window closes; reports
    (transactions, own CPU s, its backend's CPU s)."""
    with psycopg.connect(url) as conn:
        backend = conn.info.backend_pid
        params = {"n": "0", "payload": PAYLOAD, "headers": headers, "id": uuid.uuid5(uuid.NAMESPACE_URL, "0")}
        keyed = "%(id)s" in statement
        run = f"{backend}:{time.time_ns()}"
        for _ in range(10):  # psycopg prepares a statement on its 5th run: out of the window
            conn.execute(statement, params)
            conn.rollback()
        while time.time() < start_at:
            time.sleep(0.001)
        own, server = time.process_time(), machine.cpu_seconds(backend)
        deadline = start_at + seconds
        n = 0
        while time.time() < deadline:
            params["n"] = str(n)
            if keyed:  # a new event each time: the business key of a new order
                params["id"] = uuid.uuid5(uuid.NAMESPACE_URL, f"{run}:{n}")
            conn.execute(statement, params)
            conn.commit()
            n += 1
        own, server = time.process_time() - own, machine.cpu_seconds(backend) - server
    out.put((n, own, server))


def measure(pg: EmbeddedPostgres, runs: dict[str, tuple[str, str]], headers: str, writers: int, seconds: float) -> dict:
    """The sides of runs ({side: (url, statement)}) over one window, all at
    once: {side: transactions/s and CPU µs per transaction}. The server's CPU
    is reported for a side measured alone only."""
    out: dict[str, mp.Queue] = {side: mp.Queue() for side in runs}
    start_at = time.time() + 0.7
    procs = [
        mp.Process(target=_writer, args=(url, statement, headers, start_at, seconds, out[side]))
        for side, (url, statement) in runs.items()
        for _ in range(writers)
    ]
    for p in procs:
        p.start()
    while time.time() < start_at:
        time.sleep(0.001)
    server = postgres_cpu_seconds(pg)
    results = {side: [out[side].get() for _ in range(writers)] for side in runs}
    server = postgres_cpu_seconds(pg) - server
    for p in procs:
        p.join()
    got = {}
    for side, rs in results.items():
        n = sum(r[0] for r in rs)
        got[side] = {
            "tps": n / seconds,
            "backend_us": sum(r[2] for r in rs) / n * 1e6,
            "server_us": server / n * 1e6 if len(runs) == 1 else float("nan"),
            "client_us": sum(r[1] for r in rs) / n * 1e6,
        }
    return got


# The same transactions inside the server: no client, no network, no wait
# for the disk (synchronous_commit off in that session): what emit itself
# costs a transaction, in backend CPU.
LOOP = """
CREATE OR REPLACE PROCEDURE public.bench_loop(n integer) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..n LOOP
        {statement};
        COMMIT;
    END LOOP;
END;
$$;
"""
PAYLOAD_SQL = "'" + PAYLOAD.replace("'", "''") + "'::jsonb"
LOOP_EMIT = f"PERFORM outbox.emit('order', i::text, 'order_created', {PAYLOAD_SQL}, context => 'sea'{{headers}})"
# The writer's UUIDv5 drawn in SQL: md5 with the version digit set (so a
# keyed transaction here also pays an md5 of a short text, about 1 µs).
LOOP_KEYED = LOOP_EMIT.replace(
    "{headers}", ", event_id => overlay(md5(i::text || clock_timestamp()::text) placing '5' from 13 for 1)::uuid"
)
LOOP_SCHEDULED = LOOP_EMIT.replace("{headers}", ", deliver_after => interval '1 hour'")
LOOP_CORRELATED = LOOP_EMIT.replace("{headers}", ", correlation_id => gen_random_uuid()")
LOOP_PLAIN = f"INSERT INTO public.outbox_plain (subject, payload) VALUES ('sea.event.order_created.v1', {PAYLOAD_SQL})"


def server_loop(url: str, n: int) -> float:
    """Backend CPU µs per transaction of bench_loop(n)."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SET synchronous_commit = off")
        c.execute("CALL public.bench_loop(200)")
        cpu = machine.cpu_seconds(c.info.backend_pid)
        c.execute("CALL public.bench_loop(%s)", (n,))
        return (machine.cpu_seconds(c.info.backend_pid) - cpu) / n * 1e6


def setup(server_url: str, sides: list[str], headers: str, before: str | None, root: Path) -> dict[str, str]:
    urls = {}
    for side in sides:
        url = new_database(server_url, f"emit_{side}")
        if side == "before" and before:
            migrate_as(str(releases.export(Path(__file__).resolve().parents[1], before, root / "before")), url)
        with psycopg.connect(url, autocommit=True) as c:
            if side == "plain":
                c.execute(PLAIN_TABLE)
            elif side != "before" or not before:
                migrate.migrate(c, target=SCHEMA_VERSION - 1 if side == "before" else None)
            emit = LOOP_EMIT.replace("{headers}", "" if headers == "{}" else f", headers => '{headers}'::jsonb")
            loop = {
                "plain": LOOP_PLAIN,
                "keyed": LOOP_KEYED,
                "scheduled": LOOP_SCHEDULED,
                "correlated": LOOP_CORRELATED,
            }.get(side, emit)
            c.execute(LOOP.replace("{statement}", loop))
        urls[side] = url
    return urls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", default="1,4", help="comma-separated writer counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0, help="per side and round")
    ap.add_argument("--synchronous-commit", default="on", choices=("on", "off"))
    ap.add_argument(
        "--sides",
        default="emit,plain,before",
        help="comma-separated: emit, plain, before, keyed, scheduled, correlated",
    )
    ap.add_argument("--headers", action="store_true", help="emit with a W3C traceparent header (plain: none)")
    ap.add_argument("--before", metavar="COMMIT", help="the before side: this commit's schema, not one version short")
    args = ap.parse_args()
    sides = args.sides.split(",")

    root = Path(tempfile.mkdtemp(prefix="pgoutbox-emit-bench-"))
    root.chmod(0o755)  # PostgreSQL runs as another user
    pg = EmbeddedPostgres(
        root / "pg",
        settings={
            "shared_buffers": "256MB",
            "max_wal_size": "4GB",
            "synchronous_commit": args.synchronous_commit,
        },
    )
    try:
        headers = TRACEPARENT if args.headers else "{}"
        urls = setup(pg.start(), sides, headers, args.before, root)
        emit_sql = EMIT_HEADERS if args.headers else EMIT
        statements = {
            "emit": emit_sql,
            "before": emit_sql,
            "plain": PLAIN,
            "keyed": KEYED,
            "scheduled": SCHEDULED,
            "correlated": CORRELATED,
        }
        print(
            f"emit bench: PostgreSQL 15, fsync on, synchronous_commit={args.synchronous_commit}; one event per"
            f" transaction; {args.rounds} interleaved rounds of {args.seconds:g} s per side;"
            f" emit {'with a traceparent header' if args.headers else 'without headers'};"
            f" before = {f'commit {args.before}' if args.before else f'schema version {SCHEMA_VERSION - 1}'},"
            f" emit = {SCHEMA_VERSION}"
        )
        print(f"   {machine.load()}")
        ticks = machine.cpu_ticks()
        for writers in (int(w) for w in args.writers.split(",")):
            got: dict[str, list[dict]] = {s: [] for s in sides}
            for r in range(args.rounds):
                for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                    got[side] += [
                        measure(pg, {side: (urls[side], statements[side])}, headers, writers, args.seconds)[side]
                    ]
            print(
                f"\n{writers} writer{'s' if writers > 1 else ''}: {'side':<8}{'tx/s':>8}{'vs plain':>10}"
                f"  {'rounds':>38}   CPU us/tx: {'backend':>8}{'server':>8}{'writer':>8}"
            )
            for side in sides:
                rows = got[side]
                ratio = ""
                if "plain" in got and side != "plain":
                    ratios = [a["tps"] / b["tps"] for a, b in zip(rows, got["plain"])]
                    ratio = f"{statistics.median(ratios):.2f}"
                    code = {"emit": "this", "before": "before"}.get(side)
                    if code:
                        figures.record(
                            f"emit / INSERT, {writers} writers", code, statistics.median(ratios), "x", "higher"
                        )
                rounds = "/".join(f"{x['tps']:,.0f}" for x in rows)
                print(
                    f"{'':12}{side:<8}{statistics.median(x['tps'] for x in rows):>8,.0f}{ratio:>10}"
                    f"  {rounds:>38}   {'':11}"
                    + "".join(
                        f"{statistics.median(x[k] for x in rows):>8.0f}"
                        for k in ("backend_us", "server_us", "client_us")
                    )
                )
            if "plain" in sides and "emit" in sides:
                ratios = []
                for _ in range(args.rounds):
                    both = measure(
                        pg, {k: (urls[k], statements[k]) for k in ("emit", "plain")}, headers, writers, args.seconds
                    )
                    ratios.append(both["emit"]["tps"] / both["plain"]["tps"])
                print(
                    f"{'':12}emit and plain at once ({writers} writer{'s' if writers > 1 else ''} each, sharing the"
                    f" machine's moment): emit / plain {statistics.median(ratios):.2f} {[round(x, 2) for x in ratios]}"
                )
        n = 5000
        loops: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(args.rounds):
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                loops[side].append(server_loop(urls[side], n))
        print(
            f"\ninside the server (a procedure: statement; COMMIT; {n:,} times, synchronous_commit off),"
            f" backend CPU us per transaction, median of {args.rounds} interleaved rounds [all rounds]:"
        )
        for side in sides:
            xs = loops[side]
            print(f"{'':12}{side:<8}{statistics.median(xs):>8.1f}   {[round(x, 1) for x in xs]}")
        print("\ntarget: emit >= 0.9 x plain at 1 and 4 writers")
        print(f"during the run: {machine.steal_since(ticks)}; {machine.load()}")
    finally:
        pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
