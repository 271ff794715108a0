"""Cost of `pgoutbox audit` (figures, not a test): events checked per second
and peak memory, on an outbox of N COMPLETED events whose stream lost a few
messages. Starts its own PostgreSQL and nats-server and prints:

  1. the audit as shipped (default --bucket 250000: at most that many event
     ids held in memory at once, the rest in temporary files);
  2. the reference, in the same run on the same data: the same audit with one
     bucket holding every event (what a compare-in-memory audit costs), so
     that the bounded-memory design's price and saving show side by side.

Each audit runs as the real command in a child process; its peak RSS is the
child's ru_maxrss (resource.getrusage). Both must report exactly the messages
the bench deleted.

Setup, not measured: the rows are inserted set-based as COMPLETED rows with the
table's triggers off (session_replication_role = replica: what a relay leaves
behind, without paying for a million claims), and the stream is filled with
core NATS publishes (no ack awaited per message), one per event with its id
as Nats-Msg-Id, before `--lost` of them are deleted through the JetStream API.

Usage: .venv/bin/python bench/audit_bench.py [--events 100000] [--lost 100]
       .venv/bin/python bench/audit_bench.py --events 1000000     (the documented figure)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats
import psycopg

import machine
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres

ROOT = Path(__file__).resolve().parents[1]
STREAM = "SEA_EVENTS"
BODY = b'{"schema_version":1,"order_id":"abc-123","total":99.99,"lines":[1,2,3]}'

INSERT = """
INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, subject, payload,
    status, attempts, claimed_at, claimed_by, claim_token, published_at)
SELECT 'sea', 'order', i::text, 'order_created', 'sea.event.order_created.v1',
    jsonb_build_object('schema_version', 1, 'n', i),
    'COMPLETED', 1, now(), 'bench', gen_random_uuid(), now()
FROM generate_series(%s::bigint, %s::bigint) AS i
"""


def fill_outbox(url: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        step = 200_000
        for lo in range(1, n + 1, step):
            conn.execute(INSERT, (lo, min(n, lo + step - 1)))
        conn.execute("ANALYZE outbox.events")


async def fill_stream(nats_url: str, db_url: str, n: int, lost: int) -> list[str]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream(timeout=30)
    await js.add_stream(name=STREAM, subjects=["sea.event.>"], max_age=7 * 86400, duplicate_window=120)
    with psycopg.connect(db_url) as conn, conn.cursor(name="ids") as cur:
        cur.itersize = 20_000
        cur.execute("SELECT event_id::text FROM outbox.events ORDER BY id")
        sent = 0
        for (event_id,) in cur:
            await nc.publish("sea.event.order_created.v1", BODY, headers={"Nats-Msg-Id": event_id})
            sent += 1
            if sent % 20_000 == 0:
                await nc.flush()
                # let the server store what was sent before sending more
                while (await js.stream_info(STREAM)).state.messages < sent - 40_000:
                    await asyncio.sleep(0.05)
        await nc.flush()
    while (state := (await js.stream_info(STREAM)).state).messages < n:
        await asyncio.sleep(0.1)
    assert state.messages == n, state
    chosen = sorted(random.Random(7).sample(range(1, n + 1), lost))
    deleted = []
    for seq in chosen:
        msg = await js.get_msg(STREAM, seq)
        deleted.append(msg.headers["Nats-Msg-Id"])
        await js.delete_msg(STREAM, seq)
    await nc.close()
    return deleted


# The audit command itself, reporting its own peak RSS (resource.getrusage) when it ends.
_WRAPPED = (
    "import resource, sys; from pgoutbox.cli.main import main; code = main(sys.argv[1:]); "
    "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)"
)


def run_audit(db_url: str, nats_url: str, bucket: int) -> dict:
    """The real command in a child process: its output, wall time and peak RSS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    env.update(OUTBOX_DATABASE_URL=db_url, OUTBOX_NATS_URL=nats_url, OUTBOX_AUDIT_SAMPLE="1000000")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPED, "audit", STREAM, "--bucket", str(bucket), "--progress", "1h"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.monotonic() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"audit failed ({proc.returncode}): {proc.stderr}")
    checked = int(re.search(r"([\d,]+) COMPLETED events", proc.stdout).group(1).replace(",", ""))
    sample = re.search(r"sample: (.*)", proc.stdout)
    return {
        "checked": checked,
        "missing": set(sample.group(1).split(", ")) if sample else set(),
        "wall": wall,
        "peak_mib": int(re.search(r"maxrss (\d+)", proc.stderr).group(1)) / 1024,  # KiB on Linux
        "phases": [line for line in proc.stdout.splitlines() if re.search(r"done.* at [0-9.]+s$", line)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--lost", type=int, default=100)
    parser.add_argument("--bucket", type=int, default=250_000, help="the audit's --bucket (shipped default)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pgoutbox-audit-bench-"))
    root.chmod(0o755)  # PostgreSQL runs as another user below it
    pg = EmbeddedPostgres(root / "pg", settings={"fsync": "off", "synchronous_commit": "off"})
    broker = EmbeddedNats(root / "nats")
    pg.start()
    broker.start()
    try:
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        url = pg.dsn("bench")
        with psycopg.connect(url, autocommit=True) as conn:
            migrate.migrate(conn)
        t = time.monotonic()
        fill_outbox(url, args.events)
        deleted = asyncio.run(fill_stream(broker.url, url, args.events, args.lost))
        print(
            f"setup: {args.events:,} COMPLETED events and their stream, {args.lost} messages deleted, "
            f"in {time.monotonic() - t:.0f}s (not measured)"
        )
        print(machine.load())
        steal = machine.cpu_ticks()
        runs = {"shipped": args.bucket, "reference: one bucket": 10**9}
        results = {name: run_audit(url, broker.url, bucket) for name, bucket in runs.items()}
        print(machine.steal_since(steal))
        for name, r in results.items():
            ok = "exactly the deleted ones" if r["missing"] == set(deleted) else f"WRONG: {len(r['missing'])}"
            print(
                f"{name:22} --bucket {runs[name]:>13,}: {r['checked']:,} events checked in {r['wall']:.1f}s "
                f"= {r['checked'] / r['wall']:,.0f} events/s, peak RSS {r['peak_mib']:.0f} MiB, missing: {ok}"
            )
            for line in r["phases"]:
                print(f"{'':24}{line}")
    finally:
        broker.stop()
        pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
