"""`pgoutbox backfill` throughput from each source (figures, not a test).
Starts its own PostgreSQL, migrates, emits --events events of one subject
over --keys ordering keys, then per --source:
    outbox   the events stay in the outbox (--stream off);
    stream   they are published to a stream of a NATS server of its own, as
             the relay publishes them, and the backfill reads them from it;
    archive  they are spread over --days past days, archived and dropped by
             `pgoutbox archive` (Spark, local[1], as pgoutbox_archiver), and
             the backfill reads them back through Spark (the rate then
             includes its Spark start, in the command's process).
It starts a keep-alive HTTP/1.1 handler
answering 200 on a thread of this process, then runs the real command (a
process, as a login holding pgoutbox_backfiller only, no throttle, no state
file) into a new handler each round, and reports events/s: the events over
the time from its plan line to its end (start-up and the plan left out).

The consumer's live rate to compare with is in docs/benchmarks.md (the
consumer on its defaults: 64 calls in flight); backfill sends one event after
the other, on purpose (per-key order without per-key bookkeeping), so it
pays one receive, one POST and one mark per event in turn.

Usage: .venv/bin/python bench/backfill_bench.py [--source outbox|stream|archive] [--events 5000] [--keys 50]
       [--rounds 3] [--concurrency 8] [--days 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg

import machine
from pgoutbox.core import migrate, wire
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres

SUBJECT = "shop.event.order_created.v1"


class Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def one_round(
    url: str, login: str, handler_url: str, work: Path, name: str, events: int, concurrency: int, extra: list[str]
) -> float:
    manifests = work / name
    manifests.mkdir()
    manifest = f'[[handler]]\nname = "{name}"\nurl = "{handler_url}"\nsubjects = ["{SUBJECT}"]\n'
    (manifests / "h.toml").write_text(manifest)
    registry = work / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    env |= {"SPARK_LOCAL_IP": "127.0.0.1", "OUTBOX_SPARK_MASTER": "local[1]", "PYSPARK_PYTHON": sys.executable}
    pgoutbox = [sys.executable, "-m", "pgoutbox.cli.main"]
    subprocess.run(
        [*pgoutbox, "registry", "generate", "--manifest-dir", str(manifests), "--registry-file", str(registry)],
        check=True,
        capture_output=True,
        env=env,
    )
    command = [*pgoutbox, "backfill", "--handler", name, "--registry-file", str(registry), "--database-url", login]
    proc = subprocess.Popen(
        [*command, "--rate", "1000000", "--state-file", "", "--concurrency", str(concurrency), *extra],
        stdout=subprocess.PIPE,
        stderr=(work / f"{name}.err").open("w"),
        env=env,
    )
    assert proc.stdout is not None
    started = None
    plan = []
    for line in proc.stdout:
        if started is None and line.startswith(b"backfill "):
            started = time.monotonic()
        if line.startswith((b"  archive", b"  outbox", b"  stream")):
            plan.append(line.decode().rstrip()[:100])
    assert proc.wait() == 0 and started is not None, (work / f"{name}.err").read_text()[-3000:]
    print("\n".join(plan))  # which source gave the events
    elapsed = time.monotonic() - started
    with psycopg.connect(url, autocommit=True) as conn:
        done = conn.execute(
            "SELECT count(*) FROM inbox.messages WHERE handler = %s AND status = 'PROCESSED'", (name,)
        ).fetchone()
    assert done == (events,), done
    return events / elapsed


async def publish(dsn: str, nats_url: str) -> None:
    """Every event into SHOP_EVENTS, as the relay publishes it."""
    import nats
    from psycopg.rows import dict_row

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="SHOP_EVENTS", subjects=["shop.event.>"])
        with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
            for row in cur.execute("SELECT * FROM outbox.events ORDER BY id"):
                subject, body, headers = wire.to_nats(row)
                await js.publish(subject, body, headers=headers)
    finally:
        await nc.close()


def archive_all(dsn: str, events: int, keys: int, days: int, work: Path) -> None:
    """The events over `days` past days (ended more than 8 days ago), COMPLETED,
    then archived and dropped by `pgoutbox archive` as pgoutbox_archiver."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        first = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date - %s", (days + 9,)).fetchone()[0]
        conn.execute("SELECT outbox.create_partitions(%s, %s)", (days, first))
        conn.execute(
            "INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, ordering_key,"
            " occurred_at, created_at) SELECT 'shop', 'order', i::text, 'order_created',"
            " jsonb_build_object('schema_version', 1, 'n', i), 'k' || (i %% %s), t, t"
            " FROM generate_series(1, %s) AS i,"
            " LATERAL (SELECT %s::date + ((i - 1) * %s / %s) * interval '1 day' + interval '1 hour'"
            " + (i %% 1000) * interval '1 second' AS t) AS at",
            (keys, events, first, days, events),
        )
        conn.execute(
            "UPDATE outbox.events SET status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),"
            " claimed_at = created_at, claimed_by = 'bench', available_at = created_at"
        )
        conn.execute("UPDATE outbox.events SET status = 'COMPLETED', published_at = created_at")
        conn.execute("CREATE ROLE bench_archiver LOGIN IN ROLE pgoutbox_archiver")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    env |= {"SPARK_LOCAL_IP": "127.0.0.1", "OUTBOX_SPARK_MASTER": "local[1]", "PYSPARK_PYTHON": sys.executable}
    login = dsn.replace("postgres@", "bench_archiver@", 1)
    subprocess.run(
        [sys.executable, "-m", "pgoutbox.cli.main", "archive", "--database-url", login, "--sources", "outbox"]
        + ["--archive-uri", str(work / "archive"), "--retention", "8d"],
        check=True,
        capture_output=True,
        env=env,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="pgoutbox backfill --concurrency (its default: 8)")
    parser.add_argument("--source", choices=("outbox", "stream", "archive"), default="outbox")
    parser.add_argument("--days", type=int, default=5, help="archive: days the events are spread over")
    args = parser.parse_args()
    print(machine.load())
    ticks = machine.cpu_ticks()
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-backfill-bench-"))
    work = Path(tempfile.mkdtemp(prefix="pgoutbox-backfill-bench-files-"))
    server = EmbeddedPostgres(root)
    server.start()
    broker = EmbeddedNats(work / "nats") if args.source == "stream" else None
    http = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            migrate.migrate(conn)
            if args.source != "archive":
                conn.execute(
                    "SELECT outbox.emit('order', i::text, 'order_created', jsonb_build_object('schema_version', 1,"
                    " 'n', i), 'shop', ordering_key => 'k' || (i %% %s)) FROM generate_series(1, %s) AS i",
                    (args.keys, args.events),
                )
            conn.execute("CREATE ROLE bench_backfiller LOGIN IN ROLE pgoutbox_backfiller")
        extra = ["--stream", "off"]
        if args.source == "archive":
            archive_all(server.dsn(), args.events, args.keys, args.days, work)
        if broker is not None:
            broker.start()
            asyncio.run(publish(server.dsn(), broker.url))
            extra = ["--nats-url", broker.url]
        login = server.dsn().replace("postgres@", "bench_backfiller@", 1)
        handler_url = f"http://127.0.0.1:{http.server_address[1]}/events"
        rates = [
            one_round(server.dsn(), login, handler_url, work, f"h{n}", args.events, args.concurrency, extra)
            for n in range(args.rounds)
        ]
        print(
            json.dumps(
                {
                    "source": args.source,
                    "events": args.events,
                    "keys": args.keys,
                    "concurrency": args.concurrency,
                    "rounds_events_per_s": [round(r) for r in rates],
                    "median_events_per_s": round(statistics.median(rates)),
                }
            )
        )
        print(machine.steal_since(ticks))
    finally:
        http.shutdown()
        if broker is not None:
            broker.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
