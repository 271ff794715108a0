"""SQL core benchmark (figures, not a test). Starts its own PostgreSQL with
default durability (fsync on, synchronous_commit on) and prints:

  1. emit throughput, one event per business transaction (BEGIN; emit;
     COMMIT), with synchronous_commit on and off (off is where the commit
     serialisation NOTIFY causes shows: commits no longer wait for the disk),
     with 1 and 4 concurrent writer processes, for three wake-up variants,
     each in a database of its own: none (the policy trigger's wake-up test
     answers "not due"), pgoutbox's throttled wake-up, and a naive per-row
     NOTIFY trigger for reference.
     Rates are measured with each variant alone; costs with the variant and
     none running side by side, so that both see the same moment of this
     shared machine (its hypervisor steals 5-25 % of the CPU time at random,
     more than the effects measured here);
  2. claim + mark_published draining a backlog, against a bare
     `UPDATE ... FOR UPDATE SKIP LOCKED` loop on a plain table, same batch,
     two ways: whole drains one after the other (order alternating), and one
     cycle of each in turn (each side timed alone); median of the rounds.
     Each round starts both sides in new databases holding just the backlog
     (reusing the outbox's would make it pay for the rows of earlier rounds).

Usage: .venv/bin/python bench/sql_bench.py [--rounds 5] [--seconds 2] [--backlog 100000]
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

import machine
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres

PAYLOAD = json.dumps({"schema_version": 1, "order_id": "abc-123", "total": 99.99, "lines": [1, 2, 3]})

VARIANTS = ("none", "throttled", "per-row NOTIFY")

NO_WAKEUP = """
CREATE OR REPLACE FUNCTION outbox._wakeup_is_due() RETURNS boolean LANGUAGE sql VOLATILE AS $$ SELECT false $$;
"""

NAIVE_TRIGGER = """
CREATE OR REPLACE FUNCTION public.naive_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('outbox_naive', NEW.context); RETURN NULL; END $$;
CREATE OR REPLACE TRIGGER _901_naive_notify AFTER INSERT ON outbox.events
FOR EACH ROW EXECUTE FUNCTION public.naive_notify();
"""


def _writer(url: str, seconds: float, start_at: float, out: mp.Queue) -> None:
    with psycopg.connect(url) as conn:
        backend = conn.info.backend_pid
        n = 0
        while time.time() < start_at:
            time.sleep(0.001)
        cpu = time.process_time() + machine.cpu_seconds(backend)
        deadline = start_at + seconds
        while time.time() < deadline:
            conn.execute(
                "SELECT outbox.emit('order', %s, 'order_created', %s::jsonb, context => 'sea')",
                (str(n), PAYLOAD),
            )
            conn.commit()
            n += 1
        cpu = time.process_time() + machine.cpu_seconds(backend) - cpu
    out.put((n, cpu))


def emit_together(urls: dict[str, str], writers: int, seconds: float) -> dict[str, tuple[float, float]]:
    """Runs `writers` writer processes against each database at once, over the
    same window; returns {name: (committed transactions/s, CPU µs per
    transaction: writer processes plus their backends)}."""
    out: dict[str, mp.Queue] = {name: mp.Queue() for name in urls}
    start_at = time.time() + 0.5
    procs = [
        mp.Process(target=_writer, args=(url, seconds, start_at, out[name]))
        for name, url in urls.items()
        for _ in range(writers)
    ]
    for p in procs:
        p.start()
    results = {name: [out[name].get() for _ in range(writers)] for name in urls}
    for p in procs:
        p.join()
    return {
        name: (sum(r[0] for r in rs) / seconds, sum(r[1] for r in rs) / sum(r[0] for r in rs) * 1e6)
        for name, rs in results.items()
    }


def alone_rounds(dbs: dict[str, str], writers: int, rounds: int, seconds: float) -> dict[str, float]:
    """Median rows/s of each variant run alone, the variants back to back in
    rotating order."""
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            rates[v].append(emit_together({v: dbs[v]}, writers, seconds)[v][0])
    return {v: statistics.median(x) for v, x in rates.items()}


def paired_costs(dbs: dict[str, str], writers: int, rounds: int, seconds: float) -> dict[str, tuple]:
    """Each variant's cost against none, both running at once (`writers` each),
    so that the hypervisor's steal and any neighbour weigh on both alike:
    {variant: (lost throughput per round, extra CPU per transaction per round)}."""
    costs: dict[str, tuple[list, list]] = {v: ([], []) for v in VARIANTS[1:]}
    for _ in range(rounds):
        for v in VARIANTS[1:]:
            got = emit_together({"none": dbs["none"], v: dbs[v]}, writers, seconds)
            costs[v][0].append(1 - got[v][0] / got["none"][0])
            costs[v][1].append(got[v][1] / got["none"][1] - 1)
    return costs


def spread(xs: list[float]) -> str:
    q1, median, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
    return f"{median:+.1%} [{q1:+.0%}, {q3:+.0%}]"


def new_database(server_url: str, name: str, template: str = "template1", migrated: bool = False) -> str:
    """(Re)creates database `name` from `template`; returns its URL."""
    with psycopg.connect(server_url, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name}")
        c.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    url = psycopg.conninfo.make_conninfo(server_url, dbname=name)
    if migrated:
        with psycopg.connect(url, autocommit=True) as c:
            migrate.migrate(c)
    return url


def create_variant(server_url: str, variant: str) -> str:
    """A database of its own per variant, migrated, with its wake-up set up."""
    url = new_database(server_url, "bench_" + variant.replace("-", "_").replace(" ", "_").lower(), migrated=True)
    with psycopg.connect(url, autocommit=True) as c:
        if variant != "throttled":  # the policy trigger asks this whether a wake-up is due
            c.execute(NO_WAKEUP)
        if variant == "per-row NOTIFY":
            c.execute(NAIVE_TRIGGER)
    return url


def outbox_cycle(c: psycopg.Connection, batch: int) -> int:
    """One claim + mark_published; returns how many events it moved."""
    rows = c.execute("SELECT event_id, claim_token FROM outbox.claim('bench', %s, '1 minute')", (batch,)).fetchall()
    if rows:
        c.execute("SELECT outbox.mark_published(%s, %s)", (rows[0][1], [r[0] for r in rows]))
    return len(rows)


def bare_cycle(c: psycopg.Connection, batch: int) -> int:
    """The same on a plain job table: claim with SKIP LOCKED, then mark done."""
    rows = c.execute(
        "WITH c AS (SELECT id FROM public.jobs WHERE status = 'PENDING' ORDER BY id LIMIT %s"
        " FOR UPDATE SKIP LOCKED)"
        " UPDATE public.jobs AS j SET status = 'PROCESSING', claimed_at = now()"
        " FROM c WHERE j.id = c.id RETURNING j.*",
        (batch,),
    ).fetchall()
    if rows:
        c.execute("UPDATE public.jobs SET status = 'DONE', done_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)


def drain_interleaved(urls: dict[str, str], batch: int) -> dict[str, float]:
    """Drains both backlogs one cycle of each in turn, timing each side's
    cycles only: the two loops never compete for the CPU, and a moment of
    host noise lands on both alike. Returns events/s per side."""
    cycles = {"bare": bare_cycle, "outbox": outbox_cycle}
    conns = {side: psycopg.connect(url, autocommit=True) for side, url in urls.items()}
    spent = dict.fromkeys(urls, 0.0)
    moved = dict.fromkeys(urls, 0)
    try:
        active = list(urls)
        while active:
            for side in list(active):
                t0 = time.perf_counter()
                k = cycles[side](conns[side], batch)
                spent[side] += time.perf_counter() - t0
                moved[side] += k
                if k == 0:
                    active.remove(side)
    finally:
        for c in conns.values():
            c.close()
    return {side: moved[side] / spent[side] for side in urls}


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


def fresh_drain_databases(server_url: str, backlog: int) -> dict[str, str]:
    """Both sides of a drain round start alike: a database of their own,
    created for the round, holding exactly the backlog (the outbox's from
    the migrated template drain_template)."""
    urls = {
        side: new_database(server_url, f"drain_{side}", template)
        for side, template in (("bare", "template1"), ("outbox", "drain_template"))
    }
    with psycopg.connect(urls["outbox"], autocommit=True) as c:
        c.execute(
            "SELECT outbox.emit('order', g::text, 'order_created', %s::jsonb, context => 'sea')"
            " FROM generate_series(1, %s) AS g",
            (PAYLOAD, backlog),
        )
        c.execute("VACUUM ANALYZE outbox.events")
    with psycopg.connect(urls["bare"], autocommit=True) as c:
        setup_bare(c, backlog)
    return urls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0, help="per emit measurement")
    ap.add_argument("--rounds", type=int, default=7, help="side-by-side emit rounds per variant")
    ap.add_argument("--rounds-alone", type=int, default=3, help="emit rounds of each variant alone")
    ap.add_argument("--backlog", type=int, default=100_000, help="events to drain per round")
    ap.add_argument("--drain-rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--parts", default="emit,drain", help="comma-separated: emit, drain")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pgoutbox-bench-"))
    pg = EmbeddedPostgres(root, settings={"shared_buffers": "256MB", "max_wal_size": "4GB"})
    server = url = pg.start()
    try:
        dbs = {v: create_variant(url, v) for v in VARIANTS}
        url = dbs["throttled"]
        parts = args.parts.split(",")
        if "emit" in parts:
            print(f"PostgreSQL 15, fsync on, one database per variant; runs of {args.seconds:g} s")
            print("\n1. emit, one event per transaction (BEGIN; emit; COMMIT)")
            print(f"   rows/s: each variant alone, median of {args.rounds_alone} rounds (variants back to back);")
            print(f"   cost: the variant and none side by side (as many writers each), median of {args.rounds} rounds")
            print("   [middle half], as lost throughput and as extra CPU per transaction (writers + backends)")
            steal0 = machine.cpu_ticks()
            for sync in ("on", "off"):
                with psycopg.connect(url, autocommit=True) as c:
                    c.execute(f"ALTER SYSTEM SET synchronous_commit = {sync}")
                    c.execute("SELECT pg_reload_conf()")
                print(f"   synchronous_commit = {sync}")
                print(
                    f"   {'writers':<9}{'none':>8}{'throttled':>11}{'per-row':>9}"
                    f"{'throttled: throughput':>26}{'CPU':>20}{'per-row: throughput':>26}{'CPU':>20}"
                )
                for w in (1, 4):
                    alone = alone_rounds(dbs, w, args.rounds_alone, args.seconds)
                    costs = paired_costs(dbs, w, args.rounds, args.seconds)
                    print(
                        f"   {w:<9}"
                        + "".join(f"{alone[v]:>{n},.0f}" for v, n in zip(VARIANTS, (8, 11, 9)))
                        + "".join(f"{spread(costs[v][k]):>{n}}" for v in VARIANTS[1:] for k, n in ((0, 26), (1, 20)))
                    )
            print("   target: the throttled wake-up costs <= 10 % at 4 writers")
            print(f"   during the emit runs: {machine.steal_since(steal0)}")
            with psycopg.connect(url, autocommit=True) as c:
                c.execute("ALTER SYSTEM RESET synchronous_commit")
                c.execute("SELECT pg_reload_conf()")
        if "drain" in parts:
            print(
                f"\n2. drain a {args.backlog:,}-event backlog, batch {args.batch}, events/s; median of"
                f" {args.drain_rounds} rounds [each round's ratio]"
            )
            new_database(server, "drain_template", migrated=True)

            def whole_drains(r: int, urls: dict[str, str]) -> dict[str, float]:
                """The comparison the target is set for: each loop on its own, a
                whole drain each, order alternating between rounds."""
                order = ("bare", "outbox") if r % 2 == 0 else ("outbox", "bare")
                return {side: drain_interleaved({side: urls[side]}, args.batch)[side] for side in order}

            def interleaved(r: int, urls: dict[str, str]) -> dict[str, float]:
                """Less sensitive to the machine drifting, but the two loops
                evict each other's caches at every turn."""
                return drain_interleaved(urls, args.batch)

            methods = {"whole drains, one after the other": whole_drains, "one cycle of each in turn": interleaved}
            steal0 = machine.cpu_ticks()
            for method, run in methods.items():
                drained: dict[str, list[float]] = {"bare": [], "outbox": []}
                for r in range(args.drain_rounds):
                    for side, rate in run(r, fresh_drain_databases(server, args.backlog)).items():
                        drained[side].append(rate)
                ratios = [o / b for o, b in zip(drained["outbox"], drained["bare"])]
                print(
                    f"   {method}: bare {statistics.median(drained['bare']):,.0f}, claim + mark"
                    f" {statistics.median(drained['outbox']):,.0f}, ratio {statistics.median(ratios):.2f}"
                    f" {[round(x, 2) for x in ratios]} (target >= 0.8)"
                )
            print(f"   during the drains: {machine.steal_since(steal0)}")
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
