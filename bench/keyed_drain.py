"""How fast the relay's SQL drains a backlog of keyed events (ordering_key
set), against the same backlog without keys, in the same run (figures, not
a test). Issue 30: after a JetStream quorum loss in the cluster soak, 32,078
keyed events were still unsettled 15 minutes later.

Each scenario starts a database of its own from a migrated template, emits
the backlog, then drains it with the relay's cycle (outbox.claim of a
batch, outbox.mark_published), and prints events/s, events per claim and
the time of one claim:

  * unkeyed: the reference;
  * keyed: every event with one of --keys ordering keys (the chaos soak: 50);
  * keyed, after hand-backs: the same, after --handbacks rounds of claim +
    outbox.hand_back of the whole claim (a relay during a JetStream outage).

Usage: .venv/bin/python bench/keyed_drain.py [--events 20000] [--keys 50] [--batch 100] [--handbacks 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import psycopg

import machine
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres

PAYLOAD = json.dumps({"schema_version": 1, "order_id": "abc-123", "total": 99.99})


def new_database(server_url: str, name: str, template: str) -> str:
    with psycopg.connect(server_url, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name}")
        c.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    return psycopg.conninfo.make_conninfo(server_url, dbname=name)


def fill(url: str, events: int, keys: int) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(
            "SELECT outbox.emit('order', g::text, 'order_created', %s::jsonb, context => 'sea',"
            " ordering_key => CASE WHEN %s > 0 THEN 'k' || (g %% greatest(%s, 1)) END)"
            " FROM generate_series(1, %s) AS g",
            (PAYLOAD, keys, keys, events),
        )
        c.execute("VACUUM ANALYZE outbox.events")


def hand_backs(url: str, rounds: int, batch: int) -> int:
    handed = 0
    with psycopg.connect(url, autocommit=True) as c:
        for _ in range(rounds):
            rows = c.execute(
                "SELECT event_id, claim_token FROM outbox.claim('bench', %s, '1 minute')", (batch,)
            ).fetchall()
            if rows:
                handed += c.execute(
                    "SELECT outbox.hand_back(%s, %s, 'PUBLISH_TIMEOUT: bench')", (rows[0][1], [r[0] for r in rows])
                ).fetchone()[0]
    return handed


def drain(url: str, batch: int, limit_seconds: float) -> dict[str, float]:
    claims: list[float] = []
    sizes: list[int] = []
    moved = 0
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as c:
        while time.perf_counter() - started < limit_seconds:
            t0 = time.perf_counter()
            rows = c.execute(
                "SELECT event_id, claim_token FROM outbox.claim('bench', %s, '1 minute')", (batch,)
            ).fetchall()
            claims.append(time.perf_counter() - t0)
            if not rows:
                break
            sizes.append(len(rows))
            c.execute("SELECT outbox.mark_published(%s, %s)", (rows[0][1], [r[0] for r in rows]))
            moved += len(rows)
        left = c.execute("SELECT count(*) FROM outbox.events WHERE status <> 'COMPLETED'").fetchone()[0]
    spent = time.perf_counter() - started
    return {
        "events_per_s": moved / spent,
        "per_claim": statistics.mean(sizes) if sizes else 0.0,
        "claim_ms_median": statistics.median(claims) * 1000,
        "claim_ms_first": claims[0] * 1000,
        "moved": moved,
        "left": left,
        "seconds": spent,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--keys", type=int, default=50)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--handbacks", type=int, default=200)
    ap.add_argument("--limit", type=float, default=120.0, help="seconds at most per drain")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-keyed-"))
    pg = EmbeddedPostgres(root, settings={"shared_buffers": "256MB", "max_wal_size": "4GB"})
    server = pg.start()
    try:
        template = new_database(server, "keyed_template", "template1")
        with psycopg.connect(template, autocommit=True) as c:
            migrate.migrate(c)
        steal0 = machine.cpu_ticks()
        print(f"{args.events} events, batch {args.batch}, {machine.load()}")
        print(f"{'scenario':<34}{'events/s':>10}{'per claim':>11}{'claim ms':>10}{'first':>8}{'left':>8}")
        results = {}
        for name, keys, handbacks in (
            ("unkeyed (reference)", 0, 0),
            (f"keyed ({args.keys} keys)", args.keys, 0),
            (f"keyed, after {args.handbacks} hand-backs", args.keys, args.handbacks),
        ):
            url = new_database(server, "keyed_run", "keyed_template")
            fill(url, args.events, keys)
            if handbacks:
                hand_backs(url, handbacks, args.batch)
            r = drain(url, args.batch, args.limit)
            results[name] = r
            print(
                f"{name:<34}{r['events_per_s']:>10.0f}{r['per_claim']:>11.1f}{r['claim_ms_median']:>10.1f}"
                f"{r['claim_ms_first']:>8.1f}{r['left']:>8}"
            )
        ref = results["unkeyed (reference)"]["events_per_s"]
        for name, r in results.items():
            print(f"  {name}: {r['events_per_s'] / ref:.3f} of the reference's rate")
        print(f"during the runs: {machine.steal_since(steal0)}; {machine.load()}")
    finally:
        pg.stop()


if __name__ == "__main__":
    main()
