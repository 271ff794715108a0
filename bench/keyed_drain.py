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
    outbox.hand_back of the whole claim (a relay during a JetStream outage);
  * keyed, heads first (a proposal, not in sql/): outbox.claim with its
    per-row ordering-key probe replaced by the heads of the keys, found with
    one loose index scan of events_unfinished_key_idx (a probe per key, not
    per row), defined in the bench database only as bench.claim_heads.

Measured (20,000 events, 50 keys, batch 100, load average 21 on 2 cores):
unkeyed 4,219 events/s (11 ms a claim); keyed 110 (0.026 of it: 50 events a
claim, 423 ms a claim, as the walk probes the key index once per row of the
whole keyed backlog); after 200 hand-backs 103 (no difference beyond
noise); heads first 688 (6.3 times keyed, 45 ms a claim: the walk of the
claimable index is left), but 0.57 of the reference on unkeyed events
(20 ms a claim): not ready to replace outbox.claim as it is.

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


# outbox.claim (sql/30_outbox_api.sql), its ordering-key condition replaced:
# a keyed event is claimable when it is the first unfinished event of its key
# (its head), and the heads come from one loose index scan (a recursive CTE:
# one descent of events_unfinished_key_idx per key) instead of one probe per
# row walked. Equivalent: the head of a key is the one unfinished event with
# no earlier unfinished event of its key.
CLAIM_HEADS = """
CREATE SCHEMA IF NOT EXISTS bench;
CREATE OR REPLACE FUNCTION bench.claim_heads(worker text, batch_size integer, lease interval)
RETURNS SETOF outbox.events
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    token uuid := gen_random_uuid();
BEGIN
    RETURN QUERY
    WITH RECURSIVE heads (ordering_key, id) AS (
        (
            SELECT h.ordering_key, h.id FROM outbox.events AS h
            WHERE h.ordering_key IS NOT NULL AND h.status <> 'COMPLETED'
            ORDER BY h.ordering_key, h.id LIMIT 1
        )
        UNION ALL
        SELECT n.ordering_key, n.id
        FROM heads AS k
        CROSS JOIN LATERAL (
            SELECT h.ordering_key, h.id FROM outbox.events AS h
            WHERE h.ordering_key > k.ordering_key AND h.status <> 'COMPLETED'
            ORDER BY h.ordering_key, h.id LIMIT 1
        ) AS n
    ),
    candidates AS (
        SELECT e.id, e.created_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND e.available_at <= now()
            AND (e.ordering_key IS NULL OR e.id = ANY(ARRAY(SELECT h.id FROM heads AS h)))
        ORDER BY e.id
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.events AS e
    SET status = 'PROCESSING',
        attempts = e.attempts + 1,
        claimed_at = now(),
        claimed_by = worker,
        claim_token = token,
        available_at = now() + lease
    WHERE e.id = ANY(ARRAY(SELECT c.id FROM candidates AS c))
        AND e.created_at = ANY(ARRAY(SELECT c.created_at FROM candidates AS c))
        AND e.created_at >= (SELECT min(c.created_at) FROM candidates AS c)
        AND e.created_at <= (SELECT max(c.created_at) FROM candidates AS c)
    RETURNING e.*;
END;
$$;
"""


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
        for name, keys, handbacks, claim in (
            ("unkeyed (reference)", 0, 0, "outbox.claim"),
            (f"keyed ({args.keys} keys)", args.keys, 0, "outbox.claim"),
            (f"keyed, after {args.handbacks} hand-backs", args.keys, args.handbacks, "outbox.claim"),
            ("keyed, heads first (proposal)", args.keys, 0, "bench.claim_heads"),
            ("unkeyed, heads first (proposal)", 0, 0, "bench.claim_heads"),
        ):
            url = new_database(server, "keyed_run", "keyed_template")
            fill(url, args.events, keys)
            if handbacks:
                hand_backs(url, handbacks, args.batch)
            if claim != "outbox.claim":
                with psycopg.connect(url, autocommit=True) as c:
                    c.execute(CLAIM_HEADS)
            r = drain(url, args.batch, args.limit, claim)
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
