"""`pgoutbox backfill` throughput from the outbox source (figures, not a
test). Starts its own PostgreSQL, migrates, emits --events events of one
subject over --keys ordering keys, starts a keep-alive HTTP/1.1 handler
answering 200 on a thread of this process, then runs the real command (a
process, as a login holding pgoutbox_backfiller only, no throttle, no state
file) into a new handler each round, and reports events/s: the events over
the time from its plan line to its end (start-up and the plan left out).

The consumer's live rate to compare with is in docs/benchmarks.md (the
consumer on its defaults: 64 calls in flight); backfill sends one event after
the other, on purpose (per-key order without per-key bookkeeping), so it
pays one receive, one POST and one mark per event in turn.

Usage: .venv/bin/python bench/backfill_bench.py [--events 5000] [--keys 50] [--rounds 3] [--concurrency 8]
"""

from __future__ import annotations

import argparse
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
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres

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


def one_round(url: str, login: str, handler_url: str, work: Path, name: str, events: int, concurrency: int) -> float:
    manifests = work / name
    manifests.mkdir()
    manifest = f'[[handler]]\nname = "{name}"\nurl = "{handler_url}"\nsubjects = ["{SUBJECT}"]\n'
    (manifests / "h.toml").write_text(manifest)
    registry = work / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    pgoutbox = [sys.executable, "-m", "pgoutbox.cli.main"]
    subprocess.run(
        [*pgoutbox, "registry", "generate", "--manifest-dir", str(manifests), "--registry-file", str(registry)],
        check=True,
        capture_output=True,
        env=env,
    )
    command = [*pgoutbox, "backfill", "--handler", name, "--registry-file", str(registry), "--database-url", login]
    proc = subprocess.Popen(
        [*command, "--rate", "1000000", "--state-file", "", "--concurrency", str(concurrency)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None
    started = None
    for line in proc.stdout:
        if started is None and line.startswith(b"backfill "):
            started = time.monotonic()
    assert proc.wait() == 0 and started is not None
    elapsed = time.monotonic() - started
    with psycopg.connect(url, autocommit=True) as conn:
        done = conn.execute(
            "SELECT count(*) FROM inbox.messages WHERE handler = %s AND status = 'PROCESSED'", (name,)
        ).fetchone()
    assert done == (events,), done
    return events / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="pgoutbox backfill --concurrency (its default: 8)")
    args = parser.parse_args()
    print(machine.load())
    ticks = machine.cpu_ticks()
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-backfill-bench-"))
    work = Path(tempfile.mkdtemp(prefix="pgoutbox-backfill-bench-files-"))
    server = EmbeddedPostgres(root)
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            migrate.migrate(conn)
            conn.execute(
                "SELECT outbox.emit('order', i::text, 'order_created', jsonb_build_object('schema_version', 1, 'n', i),"
                " 'shop', ordering_key => 'k' || (i %% %s)) FROM generate_series(1, %s) AS i",
                (args.keys, args.events),
            )
            conn.execute("CREATE ROLE bench_backfiller LOGIN IN ROLE pgoutbox_backfiller")
        login = server.dsn().replace("postgres@", "bench_backfiller@", 1)
        handler_url = f"http://127.0.0.1:{http.server_address[1]}/events"
        rates = [
            one_round(server.dsn(), login, handler_url, work, f"h{n}", args.events, args.concurrency)
            for n in range(args.rounds)
        ]
        print(
            json.dumps(
                {
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
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
