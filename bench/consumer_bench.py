"""Consumer throughput, not a test: messages/s through JetStream -> inbox ->
a no-op HTTP handler -> ack, and its ratio to a bare JetStream fetch-and-ack
loop over the same messages, measured in the same run.

    .venv/bin/python bench/consumer_bench.py [--messages 20000] [--concurrency 64]
                                             [--synchronous-commit on|off]

Starts its own PostgreSQL and nats-server (file storage) under a temporary
folder, or uses OUTBOX_DATABASE_URL / OUTBOX_NATS_URL when set. The no-op
handler is a minimal keep-alive HTTP/1.1 server in a separate process, so
that it does not compete with the consumer for the GIL. Every consumed
message costs the consumer two PostgreSQL transactions (inbox.receive, then
inbox.mark_processed) and one HTTP round trip; the bare loop costs neither.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

NOOP_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n"


async def _noop_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            writer.write(NOOP_RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _serve_noop(port: int) -> None:
    server = await asyncio.start_server(_noop_connection, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _start_noop_handler() -> tuple[subprocess.Popen, str]:
    from pgoutbox.dev.embedded import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-noop", str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, f"http://127.0.0.1:{port}/noop"


async def _publish(js, n: int) -> None:
    from pgoutbox.core import wire

    for start in range(0, n, 1000):
        batch = []
        for i in range(start, min(n, start + 1000)):
            subject, body, headers = wire.to_nats(
                {
                    "event_id": str(uuid.uuid4()),
                    "subject": "bench.event.tick.v1",
                    "context": "bench",
                    "event_type": "tick",
                    "event_version": 1,
                    "aggregate_type": "counter",
                    "aggregate_id": str(i),
                    "payload": {"schema_version": 1, "n": i, "pad": "x" * 200},
                    "headers": {},
                }
            )
            batch.append(js.publish(subject, body, headers=headers))
        await asyncio.gather(*batch)


async def _bare_loop(js, n: int, batch: int) -> float:
    """Fetch-and-ack with nothing in between: the ceiling for any consumer."""
    import nats.errors
    from nats.js.api import AckPolicy, ConsumerConfig

    await js.add_consumer(
        "BENCH_EVENTS",
        ConsumerConfig(
            durable_name="bare",
            ack_policy=AckPolicy.EXPLICIT,
            max_ack_pending=10_000,
            ack_wait=60,
            filter_subject="bench.event.tick.v1",
        ),
    )
    sub = await js.pull_subscribe_bind("bare", "BENCH_EVENTS")
    done = 0
    started = time.perf_counter()
    while done < n:
        try:
            msgs = await sub.fetch(batch, timeout=2)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        for msg in msgs:
            await msg.ack()
        done += len(msgs)
    await js._nc.flush()
    return time.perf_counter() - started


async def _consumer(
    database_url: str, nats_url: str, handler_url: str, n: int, concurrency: int, batch: int, workdir: Path
) -> tuple[float, dict]:
    import dataclasses

    from pgoutbox.core import settings
    from pgoutbox.inbox import registry
    from pgoutbox.inbox import settings as cs
    from pgoutbox.inbox.consumer import Consumer

    manifests = workdir / "manifests"
    manifests.mkdir()
    (manifests / "bench.toml").write_text(
        f'[[handler]]\nname = "noop"\nurl = "{handler_url}"\nsubjects = ["bench.event.tick.v1"]\n'
    )
    registry.generate(manifests, workdir / "registry.json")
    cfg = settings.build(
        cs.ConsumerConfig,
        environ={},
        overrides={
            "database_url": database_url,
            "nats_url": nats_url,
            "registry_file": str(workdir / "registry.json"),
            "concurrency": str(concurrency),
            "batch_size": str(batch),
            "max_ack_pending": "10000",
            "db_pool_size": str(min(concurrency, 32)),
            "run_replayer": "false",
            "fetch_timeout": "500ms",
            "log_level": "WARNING",
        },
    )
    cfg = dataclasses.replace(cfg, http_port=None)  # no metrics server
    consumer = Consumer(cs.load_handlers(cfg), cfg)
    await consumer.start()
    started = time.perf_counter()  # the fetch loops have not run yet
    while consumer.metrics.value("noop", "processed") < n:
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - started
    outcomes = {o: consumer.metrics.value("noop", o) for o in ("processed", "duplicate", "retried", "error")}
    await consumer.stop()
    return elapsed, outcomes


async def main(args) -> None:
    import nats
    import psycopg

    from pgoutbox.core import migrate
    from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres

    workdir = Path(tempfile.mkdtemp(prefix="pgoutbox-consumer-bench-"))
    pg = nats_server = handler = None
    try:
        database_url = os.environ.get("OUTBOX_DATABASE_URL")
        if not database_url:
            # Its own temporary folder: the postgres user must be able to enter it.
            pg = EmbeddedPostgres(
                Path(tempfile.mkdtemp(prefix="pgoutbox-bench-pg-")),
                settings={"synchronous_commit": args.synchronous_commit},
            )
            pg.start()
            database_url = pg.url
        nats_url = os.environ.get("OUTBOX_NATS_URL")
        if not nats_url:
            nats_server = EmbeddedNats(workdir / "nats")
            nats_url = nats_server.start()
        with psycopg.connect(database_url, autocommit=True) as conn:
            migrate.migrate(conn)
        handler, handler_url = _start_noop_handler()
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await js.add_stream(name="BENCH_EVENTS", subjects=["bench.event.>"])
        load_before = os.getloadavg()
        t = time.perf_counter()
        await _publish(js, args.messages)
        publish_s = time.perf_counter() - t
        bare_s = await _bare_loop(js, args.messages, args.batch)
        consumer_s, outcomes = await _consumer(
            database_url, nats_url, handler_url, args.messages, args.concurrency, args.batch, workdir
        )
        load_after = os.getloadavg()
        await nc.close()
        bare_rate, consumer_rate = args.messages / bare_s, args.messages / consumer_s
        print(
            json.dumps(
                {
                    "messages": args.messages,
                    "concurrency": args.concurrency,
                    "fetch_batch": args.batch,
                    "synchronous_commit": args.synchronous_commit if pg else "(external database)",
                    "publish_msgs_per_s": round(args.messages / publish_s),
                    "bare_fetch_ack_msgs_per_s": round(bare_rate),
                    "consumer_msgs_per_s": round(consumer_rate),
                    "consumer_to_bare_ratio": round(consumer_rate / bare_rate, 3),
                    "consumer_outcomes": outcomes,
                    "cpus": os.cpu_count(),
                    "load_average_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
                },
                indent=2,
            )
        )
    finally:
        if handler:
            handler.kill()
            handler.wait()
        if nats_server:
            nats_server.stop()
        if pg:
            pg.stop("immediate")
            shutil.rmtree(pg.root, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-noop":
        asyncio.run(_serve_noop(int(sys.argv[2])))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64, help="consumer slots (OUTBOX_CONSUMER_CONCURRENCY)")
    parser.add_argument("--batch", type=int, default=64, help="fetch batch, both loops")
    parser.add_argument(
        "--synchronous-commit",
        default="on",
        choices=("on", "off"),
        help="of the embedded PostgreSQL (on: every inbox commit waits for its WAL flush)",
    )
    asyncio.run(main(parser.parse_args()))
