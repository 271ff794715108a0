"""Consumer benchmark (not a test): in one run, on the same messages, the same
no-op HTTP handler and the same PostgreSQL and nats-server, side by side:

  (a) bare JetStream fetch + ack: the ceiling for any consumer;
  (b) fetch -> httpx POST -> ack, no database: a plain httpx loop (one
      AsyncClient, json=), and the consumer's own HTTP path (HandlerClient);
  (c) `pgoutbox consume` as a process, with the product's default settings:
      this build, and the release before it (commit 0ca30af, per-message
      inbox calls) run from a copy of its package: msg/s, and CPU per message
      of the consumer process and of PostgreSQL;
  (d) the in-database handler mode (no HTTP): per message (handle_in_transaction,
      fetches of 10) and batched like the example (handle_batch_in_transaction:
      one transaction per fetch, inbox rows written once, PROCESSED), both
      against (a); `--only d` runs (a) and (d) alone;
  (e) 1, 2 and 4 consumer processes on one durable;
  (f) --http2: HTTP/1.1 keep-alive against HTTP/2 (h2c, prior knowledge) on
      a handler speaking both, through httpx.

Every loop has a durable of its own on one stream holding --messages
messages, so each reads all of them. Rates of the processes count from their
first processed message to their last (start-up excluded). The handler is a
separate process, so that it does not compete for the GIL. PostgreSQL runs
with the default durability (synchronous_commit on).

    .venv/bin/python bench/consumer_bench.py [--messages 10000] [--processes 1,2,4] [--http2]
    .venv/bin/python bench/consumer_bench.py --only d [--indb-fetch 256]   # (a) and (d) only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import nats
import nats.errors
import nats.js.errors
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig

import machine
from pgoutbox.core import migrate, settings, wire
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from pgoutbox.inbox import registry
from pgoutbox.inbox import settings as cs
from pgoutbox.inbox.handler_client import HandlerClient, request_body
from relay_bench import postgres_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "0ca30af"  # release 0.2.0: the consumer before the batched inbox
STREAM, SUBJECT = "BENCH_EVENTS", "bench.event.tick.v1"
# OUTBOX_CONSUMER_CONCURRENCY's default: the reference loops keep as many calls in flight.
CONCURRENCY = int(next(s.default for s in settings.of(cs.ConsumerConfig) if s.name == "concurrency"))

NOOP_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n"


# -- the no-op handler: HTTP/1.1 keep-alive, and h2c with --http2 -------------
async def _noop_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        first = await reader.readexactly(3)
        if first == b"PRI":  # the HTTP/2 connection preface: prior knowledge h2c
            await _h2_connection(first, reader, writer)
            return
        head = first + await reader.readuntil(b"\r\n\r\n")
        while True:
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            writer.write(NOOP_RESPONSE)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _h2_connection(first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    data = first
    while True:
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                conn.send_headers(event.stream_id, [(":status", "200"), ("content-length", "0")], end_stream=True)
            elif isinstance(event, h2.events.ConnectionTerminated):
                writer.close()
                return
        writer.write(conn.data_to_send())
        await writer.drain()
        data = await reader.read(65536)
        if not data:
            writer.close()
            return


async def _serve_noop(port: int) -> None:
    server = await asyncio.start_server(_noop_connection, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _start_noop_handler() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-noop", str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, f"http://127.0.0.1:{port}/noop"


# -- messages ------------------------------------------------------------------
async def _publish(js, n: int) -> None:
    for start in range(0, n, 1000):
        batch = []
        for i in range(start, min(n, start + 1000)):
            subject, body, headers = wire.to_nats(
                {
                    "event_id": str(uuid.uuid4()),
                    "subject": SUBJECT,
                    "context": "bench",
                    "event_type": "tick",
                    "event_version": 1,
                    "aggregate_type": "counter",
                    "aggregate_id": str(i),
                    "payload": {"schema_version": 1, "n": i, "pad": "x" * 200},
                    "headers": {"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"},
                }
            )
            batch.append(js.publish(subject, body, headers=headers))
        await asyncio.gather(*batch)


async def _pull(js, durable: str):
    await js.add_consumer(
        STREAM,
        ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            max_ack_pending=10_000,
            ack_wait=60,
            filter_subject=SUBJECT,
        ),
    )
    return await js.pull_subscribe_bind(durable, STREAM)


async def _fetch_loop(js, durable: str, n: int, batch: int, each) -> tuple[float, float]:
    """Fetches all n messages, `each(msgs)` per fetch; (msg/s, this process's CPU us per message)."""
    sub = await _pull(js, durable)
    done = 0
    cpu, started = time.process_time(), time.perf_counter()
    while done < n:
        try:
            msgs = await sub.fetch(batch, timeout=2)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        await each(msgs)
        done += len(msgs)
    await js._nc.flush()
    return n / (time.perf_counter() - started), (time.process_time() - cpu) / n * 1e6


async def _bare(js, n: int) -> tuple[float, float]:
    async def each(msgs):
        for msg in msgs:
            await msg.ack()

    return await _fetch_loop(js, "bare", n, 64, each)


async def _plain_httpx(js, n: int, url: str, *, http2: bool = False, durable: str = "plain_httpx"):
    """The no-database reference: one httpx.AsyncClient, json=, CONCURRENCY calls at once."""
    limits = httpx.Limits(max_connections=1 if http2 else CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, http1=not http2, http2=http2, timeout=30) as client:

        async def call(msg):
            envelope = wire.from_nats(msg.subject, msg.data, msg.headers)
            response = await client.post(url, json=envelope, headers={"Idempotency-Key": envelope["message_id"]})
            response.raise_for_status()
            await msg.ack()

        async def each(msgs):
            await asyncio.gather(*(call(m) for m in msgs))

        return await _fetch_loop(js, durable, n, CONCURRENCY, each)


async def _handler_client(js, n: int, url: str, durable: str = "handler_client") -> tuple[float, float]:
    """The no-database reference on the consumer's own HTTP path."""
    client = HandlerClient(per_origin=CONCURRENCY + 1)

    async def call(msg):
        envelope = wire.from_nats(msg.subject, msg.data, msg.headers)
        answer = await client.call(url, request_body(envelope), envelope, handler="ref", delivery=1, timeout=10)
        assert answer.status == 200, answer
        await msg.ack()

    async def each(msgs):
        await asyncio.gather(*(call(m) for m in msgs))

    try:
        return await _fetch_loop(js, durable, n, CONCURRENCY, each)
    finally:
        await client.aclose()


# -- in-database handler mode ---------------------------------------------------
async def _in_database(js, n: int, pg: EmbeddedPostgres, fetch: int | None) -> tuple[float, float, float]:
    """The in-database handler mode: per message (fetch None: fetches of 10),
    or batched like the example, with fetches of `fetch`; (msg/s, this
    process's CPU us per message, PostgreSQL's CPU us per message)."""
    from pgoutbox.inbox.in_database import handle_batch_in_transaction, handle_in_transaction

    batched = fetch is not None
    name = "indb_batch" if batched else "indb_each"
    conn = await psycopg.AsyncConnection.connect(pg.url, autocommit=True)
    # The business change: one row per event, in a table of the loop's own.
    await conn.execute(f"CREATE TABLE IF NOT EXISTS {name} (n integer PRIMARY KEY)")
    insert = f"INSERT INTO {name} VALUES (%s) ON CONFLICT DO NOTHING"

    async def apply(c, envelope):
        await c.execute(insert, (envelope["payload"]["n"],))

    async def each(msgs):
        envelopes = [wire.from_nats(m.subject, m.data, m.headers) for m in msgs]
        if batched:
            outcomes = await handle_batch_in_transaction(conn, name, envelopes, apply)
        else:
            outcomes = [await handle_in_transaction(conn, name, e, apply) for e in envelopes]
        assert all(o == "processed" for o in outcomes), outcomes
        for m in msgs:
            await m.ack()

    try:
        # The batched path takes what a fetch gives.
        pg0 = postgres_cpu_seconds(pg)
        rate, cpu = await _fetch_loop(js, name, n, fetch or 10, each)
        return rate, cpu, (postgres_cpu_seconds(pg) - pg0) / n * 1e6
    finally:
        await conn.close()


# -- consumer processes ------------------------------------------------------------
async def _acked(js, durable: str) -> int:
    """Messages the durable has acknowledged (its ack floor; 0 before it exists):
    asked of JetStream, so that polling costs PostgreSQL nothing."""
    try:
        info = await js.consumer_info(STREAM, durable)
    except nats.js.errors.NotFoundError:
        return 0
    return info.ack_floor.stream_seq or 0


async def _consume(
    js,
    workdir: Path,
    pg: EmbeddedPostgres,
    nats_url: str,
    url: str,
    handler: str,
    n: int,
    processes: int,
    pythonpath: str,
    settings: list[str],
) -> dict[str, float]:
    """`pgoutbox consume` x processes on durable `handler`, default settings."""
    manifests = workdir / f"manifests-{handler}"
    manifests.mkdir()
    (manifests / "bench.toml").write_text(f'[[handler]]\nname = "{handler}"\nurl = "{url}"\nsubjects = ["{SUBJECT}"]\n')
    registry.generate(manifests, workdir / f"{handler}.registry.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "PYTHON"))}
    env.update(
        {
            "PYTHONPATH": pythonpath,
            "OUTBOX_DATABASE_URL": pg.url,
            "OUTBOX_NATS_URL": nats_url,
            "OUTBOX_REGISTRY_FILE": str(workdir / f"{handler}.registry.json"),
            "OUTBOX_CONSUMER_HTTP_PORT": "0",
            "OUTBOX_CONSUMER_RUN_REPLAYER": "false",
            "OUTBOX_LOG_LEVEL": "WARNING",
        }
    )
    env.update(item.split("=", 1) for item in settings)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; from pgoutbox.cli.main import main; sys.exit(main())", "consume"],
            env=env,
            stdout=subprocess.DEVNULL,
            cwd=workdir,
        )
        for _ in range(processes)
    ]
    try:
        deadline = time.monotonic() + 120
        while (first := await _acked(js, handler)) == 0:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"consumer {handler} processed nothing")
            await asyncio.sleep(0.02)
        t0, cpu0, pg0 = time.perf_counter(), sum(machine.cpu_seconds(p.pid) for p in procs), postgres_cpu_seconds(pg)
        while (done := await _acked(js, handler)) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"consumer {handler}: {done} of {n} acknowledged in time")
            await asyncio.sleep(0.02)
        elapsed = time.perf_counter() - t0
        cpu = sum(machine.cpu_seconds(p.pid) for p in procs) - cpu0
        pg_cpu = postgres_cpu_seconds(pg) - pg0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    counted = n - first
    return {
        "rate": counted / elapsed,
        "cpu_us": cpu / counted * 1e6,
        "pg_us": pg_cpu / counted * 1e6,
    }


def _before_package(workdir: Path) -> str:
    """Release 0.2.0's package, from git, importable as `pgoutbox` (PYTHONPATH)."""
    target = workdir / "before"
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "relay"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    (target / "relay").rename(target / "pgoutbox")
    return str(target)


def _line(name: str, rate: float, cpu: float | None = None, pg: float | None = None, ref: tuple | None = None):
    text = f"  {name:58s} {rate:8,.0f} msg/s"
    if ref:
        text += f"  = {rate / ref[1]:5.2f} x {ref[0]}"
    if cpu is not None:
        text += f"  | Python {cpu:5.0f} us/msg"
    if pg is not None:
        text += f"  PostgreSQL {pg:4.0f} us/msg"
    print(text, flush=True)


async def _run(args, pg: EmbeddedPostgres, nats_url: str, url: str, workdir: Path) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    n, only = args.messages, args.only

    async def consume(handler: str, processes: int = 1, pythonpath: str = str(ROOT)) -> dict[str, float]:
        return await _consume(js, workdir, pg, nats_url, url, handler, n, processes, pythonpath, args.setting)

    try:
        await js.add_stream(name=STREAM, subjects=["bench.event.>"])
        await _publish(js, n)
        print("(a) reference")
        bare = await _bare(js, n)
        _line("bare JetStream fetch + ack", *bare)
        ref = None
        if "b" in only or "c" in only:
            print(f"(b) fetch -> httpx POST -> ack, no database ({CONCURRENCY} calls at once)")
            _line("plain httpx loop (one AsyncClient, json=)", *await _plain_httpx(js, n, url))
            client = await _handler_client(js, n, url)
            _line("the consumer's HTTP path (HandlerClient)", *client)
            ref = ("(b) HandlerClient", client[0])
        if "f" in only and args.http2:
            print(f"(f) HTTP/1.1 keep-alive against HTTP/2 (h2c), plain httpx loop, {CONCURRENCY} calls at once")
            h1 = await _plain_httpx(js, n, url, durable="h1")
            _line(f"HTTP/1.1, {CONCURRENCY} keep-alive connections", *h1)
            try:
                h2 = await _plain_httpx(js, n, url, http2=True, durable="h2")
                _line(f"HTTP/2, one connection, {CONCURRENCY} streams", *h2, None, ("HTTP/1.1", h1[0]))
            except httpx.TimeoutException:
                # Seen in long runs: the test handler's h2c side (the h2 package, pure
                # Python) stops answering one connection; its figure is then missing.
                print("  HTTP/2: the test handler stopped answering (ReadTimeout); no figure")
            own = await _handler_client(js, n, url, durable="handler_client_f")
            _line("HTTP/1.1, HandlerClient (one client per connection)", *own, None, ("HTTP/1.1", h1[0]))
        now = None
        if "c" in only:
            told = " ".join(args.setting)
            print(f"(c) pgoutbox consume, one process, default settings (concurrency {CONCURRENCY}) {told}")
            now = await consume("after1")
            _line("this build (batched inbox)", now["rate"], now["cpu_us"], now["pg_us"], ref)
        if "c" in only and not args.skip_before:
            before = await consume("before1", pythonpath=_before_package(workdir))
            _line(f"before: release 0.2.0 ({BEFORE}, per-message inbox)", *before.values(), ref)
        if "d" in only:
            print("(d) in-database handler mode, no HTTP (one connection)")
            each = await _in_database(js, n, pg, None)
            _line("per message (handle_in_transaction, fetch 10)", *each, ("bare", bare[0]))
            batched = await _in_database(js, n, pg, args.indb_fetch)
            _line(f"batched (handle_batch_in_transaction, fetch {args.indb_fetch})", *batched, ("bare", bare[0]))
        if "e" in only:
            print("(e) consumer processes on one durable (this build)")
            # Measured again here, one after the other: the machine's load drifts.
            base = None
            for count in [int(x) for x in args.processes.split(",")]:
                res = await consume(f"scale{count}", count)
                base = base or ("first", res["rate"])
                _line(f"{count} process(es)", *res.values(), base)
    finally:
        await nc.close()


def main(args) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="pgoutbox-consumer-bench-"))
    workdir.chmod(0o755)  # PostgreSQL runs as another user
    pg = EmbeddedPostgres(workdir / "pg")
    nats_server = EmbeddedNats(workdir / "nats")
    handler = None
    print(f"consumer bench: {args.messages} messages; {machine.load()} (shared machine: figures are noisy)")
    ticks = machine.cpu_ticks()
    try:
        pg.start()
        nats_url = nats_server.start()
        with psycopg.connect(pg.url, autocommit=True) as conn:
            migrate.migrate(conn)
        handler, url = _start_noop_handler()
        asyncio.run(_run(args, pg, nats_url, url, workdir))
        print(f"{machine.steal_since(ticks)}; {machine.load()}")
    finally:
        if handler:
            handler.kill()
            handler.wait()
        nats_server.stop()
        pg.stop("immediate")
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-noop":
        asyncio.run(_serve_noop(int(sys.argv[2])))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--processes", default="1,2,4", help="consumer process counts for (e)")
    parser.add_argument("--http2", action="store_true", help="(f): needs the h2 package (httpx[http2])")
    parser.add_argument(
        "--setting", action="append", default=[], metavar="OUTBOX_X=V", help="for the consumer processes (repeatable)"
    )
    parser.add_argument("--indb-fetch", type=int, default=256, help="fetch size of the batched in-database loop")
    parser.add_argument("--only", default="abcdef", help="the parts to run (a always)")
    parser.add_argument("--skip-before", action="store_true", help="do not run release 0.2.0's consumer")
    main(parser.parse_args())
