"""How fast the relay's SQL drains a backlog of keyed events (ordering_key
set), against the same backlog without keys, in the same run (figures, not
a test). After a JetStream quorum loss in the cluster soak, 32,078 keyed
events were still unsettled 15 minutes later.

Each scenario starts a database of its own from a migrated template, emits
the backlog, then drains it with the relay's cycle (outbox.claim of a
batch, outbox.mark_published), and prints events/s, events per claim and
the time of one claim:

  * unkeyed: the reference;
  * keyed: every event with one of --keys ordering keys (the chaos soak: 50);
  * keyed, after hand-backs: the same, after --handbacks rounds of claim +
    outbox.hand_back of the whole claim (a relay during a JetStream outage);
  * keyed, one key per event: every event its own key (events keyed by
    aggregate), where the claim's list of key heads is too long to pay;
  * unkeyed over --tenants tenants (round robin): the claim's cost per
    event when every batch is shared by that many tenants, against the
    reference's one tenant.

With --before COMMIT, each scenario runs on a database that COMMIT's
migrations built too, interleaved with this build's, and the last lines
give this build's rate over COMMIT's.

Figures (docs/benchmarks.md, "A keyed backlog") come from:
  .venv/bin/python bench/keyed_drain.py --before main

Usage: .venv/bin/python bench/keyed_drain.py [--events 20000] [--keys 50] [--batch 100]
           [--handbacks 200] [--tenants 1000] [--before COMMIT]
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


def fill(url: str, events: int, keys: int, tenants: int = 1) -> None:
    """keys 0: no key; -1: one key per event. tenants 1: no tenant_id."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(
            "SELECT outbox.emit('order', g::text, 'order_created', %s::jsonb, context => 'sea',"
            " ordering_key => CASE WHEN %s > 0 THEN 'k' || (g %% greatest(%s, 1))"
            " WHEN %s < 0 THEN 'k' || g END,"
            " tenant_id => CASE WHEN %s > 1 THEN 't' || (g %% %s) END)"
            " FROM generate_series(1, %s) AS g",
            (PAYLOAD, keys, keys, keys, tenants, max(tenants, 1), events),
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


def drain(url: str, batch: int, limit_seconds: float, claim: str = "outbox.claim") -> dict[str, float]:
    claims: list[float] = []
    sizes: list[int] = []
    moved = 0
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as c:
        while time.perf_counter() - started < limit_seconds:
            t0 = time.perf_counter()
            rows = c.execute(f"SELECT event_id, claim_token FROM {claim}('bench', %s, '1 minute')", (batch,)).fetchall()
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
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--limit", type=float, default=120.0, help="seconds at most per drain")
    ap.add_argument("--before", metavar="COMMIT", help="also drain on a database COMMIT's migrations built")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-keyed-"))
    pg = EmbeddedPostgres(root, settings={"shared_buffers": "256MB", "max_wal_size": "4GB"})
    server = pg.start()
    try:
        builds = ["this"]
        new_database(server, "keyed_template_this", "template1")
        with psycopg.connect(
            psycopg.conninfo.make_conninfo(server, dbname="keyed_template_this"), autocommit=True
        ) as c:
            migrate.migrate(c)
        if args.before:
            from relay_bench import export_package, migrate_as

            builds.insert(0, "before")
            migrate_as(export_package(root, args.before), new_database(server, "keyed_template_before", "template1"))
        steal0 = machine.cpu_ticks()
        print(f"{args.events} events, batch {args.batch}, before = {args.before}; {machine.load()}")
        print(
            f"{'scenario':<36}{'build':<8}{'events/s':>10}{'per claim':>11}{'claim ms':>10}{'us/event':>10}"
            f"{'first':>8}{'left':>8}"
        )
        results: dict[tuple[str, str], dict[str, float]] = {}
        for name, keys, handbacks, tenants in (
            ("unkeyed (reference)", 0, 0, 1),
            (f"keyed ({args.keys} keys)", args.keys, 0, 1),
            (f"keyed, after {args.handbacks} hand-backs", args.keys, args.handbacks, 1),
            ("keyed, one key per event", -1, 0, 1),
            (f"unkeyed, {args.tenants:,} tenants", 0, 0, args.tenants),
        ):
            for build in builds:
                url = new_database(server, "keyed_run", f"keyed_template_{build}")
                fill(url, args.events, keys, tenants)
                if handbacks:
                    hand_backs(url, handbacks, args.batch)
                r = drain(url, args.batch, args.limit)
                results[(name, build)] = r
                us_per_event = r["claim_ms_median"] * 1000 / max(r["per_claim"], 1)
                print(
                    f"{name:<36}{build:<8}{r['events_per_s']:>10.0f}{r['per_claim']:>11.1f}{r['claim_ms_median']:>10.1f}"
                    f"{us_per_event:>10.0f}{r['claim_ms_first']:>8.1f}{r['left']:>8}",
                    flush=True,
                )
        for build in builds:
            ref = results[("unkeyed (reference)", build)]["events_per_s"]
            for (name, b), r in results.items():
                if b == build:
                    print(f"  {build}: {name}: {r['events_per_s'] / ref:.3f} of its unkeyed rate")
        if args.before:
            for (name, b), r in results.items():
                if b == "this":
                    ratio = r["events_per_s"] / results[(name, "before")]["events_per_s"]
                    print(f"  {name}: this build {ratio:.2f} x before")
        print(f"during the runs: {machine.steal_since(steal0)}; {machine.load()}")
    finally:
        pg.stop()


if __name__ == "__main__":
    main()
