"""SQL core benchmark (figures, not a test). Starts its own PostgreSQL with
default durability (fsync on, synchronous_commit on) and prints:

  1. emit throughput, one event per business transaction (BEGIN; emit;
     COMMIT), with synchronous_commit on and off (off is where the commit
     serialisation NOTIFY causes shows: commits no longer wait for the disk),
     with 1 and 4 concurrent writer processes, for three wake-up
     variants: none (trigger disabled), pgoutbox's throttled per-statement
     trigger, and a naive per-row NOTIFY trigger for reference;
  2. claim + mark_published draining a backlog, against a bare
     `UPDATE ... FOR UPDATE SKIP LOCKED` loop on a plain table, same batch.

Usage: .venv/bin/python bench/sql_bench.py [--seconds 5] [--backlog 100000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psycopg

from pgoutbox import migrate
from pgoutbox.embedded import EmbeddedPostgres

PAYLOAD = json.dumps({"schema_version": 1, "order_id": "abc-123", "total": 99.99, "lines": [1, 2, 3]})

VARIANTS = ("none", "throttled", "per-row NOTIFY")

NAIVE_TRIGGER = """
CREATE OR REPLACE FUNCTION public.naive_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('outbox_naive', NEW.context); RETURN NULL; END $$;
CREATE OR REPLACE TRIGGER _901_naive_notify AFTER INSERT ON outbox.events
FOR EACH ROW EXECUTE FUNCTION public.naive_notify();
"""


def _writer(url: str, seconds: float, start_at: float, out: mp.Queue) -> None:
    with psycopg.connect(url) as conn:
        n = 0
        while time.time() < start_at:
            time.sleep(0.001)
        deadline = start_at + seconds
        while time.time() < deadline:
            conn.execute(
                "SELECT outbox.emit('order', %s, 'order_created', %s::jsonb, context => 'sea')",
                (str(n), PAYLOAD),
            )
            conn.commit()
            n += 1
    out.put(n)


def emit_rate(url: str, writers: int, seconds: float) -> float:
    out: mp.Queue = mp.Queue()
    start_at = time.time() + 0.5
    procs = [mp.Process(target=_writer, args=(url, seconds, start_at, out)) for _ in range(writers)]
    for p in procs:
        p.start()
    total = sum(out.get() for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


def set_wakeup(url: str, variant: str) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("DROP TRIGGER IF EXISTS _901_naive_notify ON outbox.events")
        c.execute("ALTER TABLE outbox.events DISABLE TRIGGER _900_notify")
        if variant == "throttled":
            c.execute("ALTER TABLE outbox.events ENABLE TRIGGER _900_notify")
        elif variant == "per-row NOTIFY":
            c.execute(NAIVE_TRIGGER)


def drain_outbox(url: str, batch: int) -> float:
    with psycopg.connect(url, autocommit=True) as c:
        n = 0
        t0 = time.perf_counter()
        while True:
            rows = c.execute(
                "SELECT event_id, claim_token FROM outbox.claim('bench', %s, '1 minute')", (batch,)
            ).fetchall()
            if not rows:
                break
            c.execute("SELECT outbox.mark_published(%s, %s)", (rows[0][1], [r[0] for r in rows]))
            n += len(rows)
        return n / (time.perf_counter() - t0)


def setup_bare(c: psycopg.Connection, rows: int) -> None:
    """A plain job table with the same payloads and a matching partial index."""
    c.execute("DROP TABLE IF EXISTS public.jobs")
    c.execute(
        "CREATE TABLE public.jobs (id bigserial PRIMARY KEY, status text NOT NULL DEFAULT 'PENDING',"
        " payload jsonb NOT NULL, claimed_at timestamptz, done_at timestamptz)"
    )
    c.execute("CREATE INDEX jobs_pending ON public.jobs (id) WHERE status IN ('PENDING', 'PROCESSING')")
    c.execute("INSERT INTO public.jobs (payload) SELECT %s::jsonb FROM generate_series(1, %s)", (PAYLOAD, rows))
    c.execute("VACUUM ANALYZE public.jobs")


def drain_bare(url: str, batch: int) -> float:
    with psycopg.connect(url, autocommit=True) as c:
        n = 0
        t0 = time.perf_counter()
        while True:
            rows = c.execute(
                "WITH c AS (SELECT id FROM public.jobs WHERE status = 'PENDING' ORDER BY id LIMIT %s"
                " FOR UPDATE SKIP LOCKED)"
                " UPDATE public.jobs AS j SET status = 'PROCESSING', claimed_at = now()"
                " FROM c WHERE j.id = c.id RETURNING j.*",
                (batch,),
            ).fetchall()
            if not rows:
                break
            c.execute(
                "UPDATE public.jobs SET status = 'DONE', done_at = now() WHERE id = ANY(%s)",
                ([r[0] for r in rows],),
            )
            n += len(rows)
        return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="per emit measurement")
    ap.add_argument("--repeat", type=int, default=3, help="emit runs per variant (median)")
    ap.add_argument("--backlog", type=int, default=100_000, help="events to drain")
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pgoutbox-bench-"))
    pg = EmbeddedPostgres(root, settings={"shared_buffers": "256MB", "max_wal_size": "4GB"})
    url = pg.start()
    try:
        with psycopg.connect(url, autocommit=True) as c:
            migrate.migrate(c)
        print(f"PostgreSQL 15, fsync on; emit figures: median of {args.repeat} runs of {args.seconds:.0f} s")
        print("\n1. emit throughput (one event per transaction), rows/s")
        for sync in ("on", "off"):
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(f"ALTER SYSTEM SET synchronous_commit = {sync}")
                c.execute("SELECT pg_reload_conf()")
            print(f"   synchronous_commit = {sync}")
            print(f"   {'wake-up':<16}{'1 writer':>12}{'4 writers':>12}")
            # Median of --repeat runs, variants in rotating order, so that
            # neither table growth nor a noisy neighbour favours one variant.
            samples: dict[str, dict[int, list[float]]] = {v: {1: [], 4: []} for v in VARIANTS}
            for r in range(args.repeat):
                for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                    set_wakeup(url, variant)
                    for w in (1, 4):
                        samples[variant][w].append(emit_rate(url, w, args.seconds))
            rates = {v: {w: statistics.median(x) for w, x in by_w.items()} for v, by_w in samples.items()}
            for variant in VARIANTS:
                print(f"   {variant:<16}{rates[variant][1]:>12,.0f}{rates[variant][4]:>12,.0f}")
            for w in (1, 4):
                cost = 1 - rates["throttled"][w] / rates["none"][w]
                naive = 1 - rates["per-row NOTIFY"][w] / rates["none"][w]
                print(f"   cost of the wake-up at {w} writer(s): throttled {cost:+.1%}, per-row NOTIFY {naive:+.1%}")
        set_wakeup(url, "throttled")
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("ALTER SYSTEM RESET synchronous_commit")
            c.execute("SELECT pg_reload_conf()")

        print(f"\n2. drain a {args.backlog:,}-event backlog, batch {args.batch}, events/s")
        with psycopg.connect(url, autocommit=True) as c:
            # Start both sides equal: publish what the emit runs left, so that
            # only the backlog below is pending.
            drain_outbox(url, 1000)
            c.execute(
                "SELECT outbox.emit('order', g::text, 'order_created', %s::jsonb, context => 'sea')"
                " FROM generate_series(1, %s) AS g",
                (PAYLOAD, args.backlog),
            )
            c.execute("VACUUM ANALYZE outbox.events")
            setup_bare(c, args.backlog)
        bare = drain_bare(url, args.batch)
        outbox = drain_outbox(url, args.batch)
        print(f"   bare UPDATE ... SKIP LOCKED loop : {bare:>10,.0f}")
        print(f"   outbox.claim + mark_published   : {outbox:>10,.0f}")
        print(f"   ratio                            : {outbox / bare:>10.2f}  (target >= 0.8)")
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
