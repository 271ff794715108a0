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
      a handler speaking both, through httpx;
  (g) `pgoutbox consume` with default settings against hand-written loops on
      the same messages and handler (bench/reference_loops.py): fetch -> raw
      keep-alive POST -> ack, and a hand-written inbox (fetch -> one INSERT ...
      ON CONFLICT of the batch -> POSTs -> one UPDATE of the batch -> ack), in
      --rounds interleaved rounds, with the medians; CPU per message of the
      loop's process, PostgreSQL and the handler. `--only g` runs (a) and (g).
  (h) `pgoutbox consume` with default settings, without and with an upcast
      step: the same manifest, plus `version = 2` and an upcaster of tick
      v1 -> v2 (a renamed field) registered, so that every message is upcast
      in the inbox call that records its fetch; in --rounds interleaved
      rounds, with the medians and the difference per message (wall time,
      CPU of the consumer process and of PostgreSQL). `--only h` runs (a) and (h).
  (i) `pgoutbox consume` with default settings, traces off and on (the same
      process plus OTEL_EXPORTER_OTLP_ENDPOINT: an OTLP/HTTP sink in a process
      of its own, harness.otlp), in --rounds interleaved rounds, with the
      medians and what tracing costs per message. `--only i` runs (a) and (i).
  (j) `pgoutbox consume` with default settings, the same manifest of format
      "pgoutbox" (one POST per message) and of format "batch" (one POST per
      fetch, up to batch_size 32, one result per message), on the same handler
      process (/noop answers a message, /batch a batch): the no-op handler
      above (never the bottleneck), and a handler on the standard library's
      ThreadingHTTPServer (a thread and a parse per request, as a small
      Python service has), in --rounds interleaved rounds, with the medians.
      `--only j` runs (a) and (j).

Every `pgoutbox consume` runs as the login docs/consumer.md gives it (a member
of pgoutbox_consumer only), with the README's manifest (timeout 10s,
max_deliver 5) and every OUTBOX_* setting at its default but the HTTP port
(0: any free port, as several run at once).

Every loop has a durable of its own on one stream holding --messages
messages, so each reads all of them. Rates of the processes count from their
first processed message to their last (start-up excluded). The handler is a
separate process, so that it does not compete for the GIL. PostgreSQL runs
with the default durability (synchronous_commit on).

    .venv/bin/python bench/consumer_bench.py [--messages 10000] [--processes 1,2,4] [--http2]
    .venv/bin/python bench/consumer_bench.py --only d [--indb-fetch 256]   # (a) and (d) only
    .venv/bin/python bench/consumer_bench.py --only g [--rounds 3]          # (a) and (g) only
    .venv/bin/python bench/consumer_bench.py --only h [--rounds 3]          # (a) and (h) only
    .venv/bin/python bench/consumer_bench.py --only i [--rounds 3]          # (a) and (i) only
    .venv/bin/python bench/consumer_bench.py --only j [--rounds 3]          # (a) and (j) only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import nats
import nats.errors
import nats.js.errors
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig

import checkout  # noqa: F401  (the checkout's root on sys.path, for harness/)
import figures
import machine
import reference_loops
from harness import releases
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
class _Noop(asyncio.Protocol):
    """Answers every request 200 at once; a protocol rather than streams, so
    that the handler is never the bottleneck (tens of thousands of requests/s
    on one core). Pipelined requests are answered together, in order."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buffer = b""
        self.h2 = None

    def data_received(self, data: bytes) -> None:
        if self.h2 is not None:
            self._h2_received(data)
            return
        buf = self.buffer + data if self.buffer else data
        if buf[:3] == b"PRI":  # the HTTP/2 connection preface: prior knowledge h2c
            self._h2_start(buf)
            return
        pos, answered, answers = 0, 0, []
        while (end := buf.find(b"\r\n\r\n", pos)) >= 0:
            at = buf.find(b"\r\nContent-Length:", pos, end)
            if at < 0:
                at = buf.find(b"\r\ncontent-length:", pos, end)
            if at < 0:  # any other spelling
                at = buf[: end + 2].lower().find(b"\r\ncontent-length:", pos)
            length = int(buf[at + 17 : buf.find(b"\r\n", at + 2)]) if at >= 0 else 0
            if end + 4 + length > len(buf):
                break
            if buf.startswith(b"POST /batch", pos):  # a batch handler: one result per message
                answers.append(_batch_answer(buf[end + 4 : end + 4 + length]))
            else:
                answers.append(NOOP_RESPONSE)
            pos = end + 4 + length
            answered += 1
        self.buffer = buf[pos:]
        if answered:
            self.transport.write(b"".join(answers))

    def _h2_start(self, data: bytes) -> None:
        import h2.config
        import h2.connection

        self.h2 = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False))
        self.h2.initiate_connection()
        self._h2_received(data)

    def _h2_received(self, data: bytes) -> None:
        import h2.events

        assert self.h2 is not None
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self.h2.send_headers(event.stream_id, [(":status", "200"), ("content-length", "0")], end_stream=True)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.transport.close()
                return
        self.transport.write(self.h2.data_to_send())


def _batch_answer(body: bytes) -> bytes:
    """A batch handler's 200: every message processed (docs/handlers.md, "Batch handlers")."""
    results = [{"message_id": m["envelope"]["message_id"], "status": 200} for m in json.loads(body)["messages"]]
    out = json.dumps({"results": results}).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: keep-alive\r\n\r\n%s" % (len(out), out)


async def _serve_noop(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Noop, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _serve_stdlib(port: int) -> None:
    """(j): a handler as a small Python service is written: http.server, a thread per connection."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            answer = _batch_answer(body) if self.path == "/batch" else NOOP_RESPONSE
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


def _start_noop_handler(kind: str = "--serve-noop") -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, kind, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, f"http://127.0.0.1:{port}/noop"


# -- messages ------------------------------------------------------------------
async def _publish(js, n: int) -> None:
    # As the relay publishes them: with Pgoutbox-Created-At, so that the
    # consumer's age-at-outcome histogram observes each message.
    created = datetime.now(UTC)
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
                    "created_at": created,
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
    handler_pid: int | None = None,
    profile: str | None = None,
    manifest_extra: str = "",
) -> dict[str, float]:
    """`pgoutbox consume` x processes on durable `handler`, default settings:
    msg/s, and CPU us per message of the processes, PostgreSQL and the handler."""
    manifests = workdir / f"manifests-{handler}"
    manifests.mkdir()
    # The README's manifest: timeout and max_deliver given, every other value the default.
    (manifests / "bench.toml").write_text(
        f'[[handler]]\nname = "{handler}"\nurl = "{url}"\nsubjects = ["{SUBJECT}"]\ntimeout = "10s"\nmax_deliver = 5\n'
        + manifest_extra
    )
    registry.generate(manifests, workdir / f"{handler}.registry.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "PYTHON", "OTEL_"))}
    env.update(
        {
            "PYTHONPATH": pythonpath,
            # The login docs/consumer.md gives it: a member of pgoutbox_consumer, nothing more.
            "OUTBOX_DATABASE_URL": consumer_url(pg),
            "OUTBOX_NATS_URL": nats_url,
            "OUTBOX_REGISTRY_FILE": str(workdir / f"{handler}.registry.json"),
            # The one departure from the defaults: any free port for /metrics (served all the same).
            "OUTBOX_CONSUMER_HTTP_PORT": "0",
        }
    )
    env.update(item.split("=", 1) for item in settings)
    log = (workdir / f"{handler}.log").open("ab")
    # profile: under yappi (bench/profiled.py), counting from the first acknowledged message.
    command = (
        [str(Path(__file__).with_name("profiled.py")), profile]
        if profile
        else ["-c", "import sys; from pgoutbox.cli.main import main; sys.exit(main())"]
    )
    procs = [
        subprocess.Popen(
            [sys.executable, *command, "consume"],
            env=env,
            stdout=log,
            stderr=log,
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
        if profile:
            for p in procs:
                p.send_signal(signal.SIGUSR1)
        t0, cpu0, pg0 = time.perf_counter(), sum(machine.cpu_seconds(p.pid) for p in procs), postgres_cpu_seconds(pg)
        h0 = machine.cpu_seconds(handler_pid) if handler_pid else 0.0
        while (done := await _acked(js, handler)) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"consumer {handler}: {done} of {n} acknowledged in time")
            await asyncio.sleep(0.02)
        elapsed = time.perf_counter() - t0
        cpu = sum(machine.cpu_seconds(p.pid) for p in procs) - cpu0
        pg_cpu = postgres_cpu_seconds(pg) - pg0
        handler_cpu = machine.cpu_seconds(handler_pid) - h0 if handler_pid else 0.0
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
        "handler_us": handler_cpu / counted * 1e6,
    }


CONSUMER_LOGIN = "bench_consumer"


def create_consumer_login(pg: EmbeddedPostgres) -> None:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {CONSUMER_LOGIN} LOGIN IN ROLE pgoutbox_consumer")


def consumer_url(pg: EmbeddedPostgres) -> str:
    return pg.url.replace("postgresql://postgres@", f"postgresql://{CONSUMER_LOGIN}@")


def _before_package(workdir: Path, commit: str = BEFORE) -> str:
    """A commit's package (release 0.2.0's by default), from git, importable as `pgoutbox` (PYTHONPATH)."""
    return str(releases.export(ROOT, commit, workdir / f"before-{commit}"))


def _line(name: str, rate: float, cpu: float | None = None, pg: float | None = None, ref: tuple | None = None):
    text = f"  {name:58s} {rate:8,.0f} msg/s"
    if ref:
        text += f"  = {rate / ref[1]:5.2f} x {ref[0]}"
    if cpu is not None:
        text += f"  | Python {cpu:5.0f} us/msg"
    if pg is not None:
        text += f"  PostgreSQL {pg:4.0f} us/msg"
    print(text, flush=True)


async def _run(args, pg: EmbeddedPostgres, nats_url: str, url: str, workdir: Path, handler_pid: int) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    n, only = args.messages, args.only
    noop_url, noop_pid = url, handler_pid

    async def consume(
        handler: str,
        processes: int = 1,
        pythonpath: str = str(ROOT),
        settings: list[str] | None = None,
        profile: str | None = None,
        manifest_extra: str = "",
        path: str | None = None,
        url: str | None = None,
        handler_pid: int | None = None,
    ) -> dict[str, float]:
        told = args.setting + (settings or [])
        target = url or noop_url
        return await _consume(
            js,
            workdir,
            pg,
            nats_url,
            target if path is None else target.replace("/noop", path),
            handler,
            n,
            processes,
            pythonpath,
            told,
            handler_pid or noop_pid,
            profile,
            manifest_extra,
        )

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
            _line(
                f"before: release 0.2.0 ({BEFORE}, per-message inbox)",
                before["rate"],
                before["cpu_us"],
                before["pg_us"],
                ref,
            )
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
                _line(f"{count} process(es)", res["rate"], res["cpu_us"], res["pg_us"], base)
        if "g" in only:
            await _against_hand_written(args, js, pg, url, handler_pid, consume)
        if "h" in only:
            await _upcast_step(args, pg, consume)
        if "i" in only:
            await _traces_off_on(args, consume)
        if "j" in only:
            await _batch_format(args, consume)
    finally:
        await nc.close()


# -- (g) pgoutbox consume against a hand-written inbox loop ------------------------
async def _reference(js, durable: str, loop, pg: EmbeddedPostgres, handler_pid: int) -> dict[str, float]:
    """One reference loop on a durable of its own: msg/s and CPU us per message
    of this process, PostgreSQL and the handler."""
    sub = await _pull(js, durable)
    pg0, h0 = postgres_cpu_seconds(pg), machine.cpu_seconds(handler_pid)
    rate, cpu = await loop(sub)
    await js._nc.flush()
    n = loop.n
    return {
        "rate": rate,
        "cpu_us": cpu,
        "pg_us": (postgres_cpu_seconds(pg) - pg0) / n * 1e6,
        "handler_us": (machine.cpu_seconds(handler_pid) - h0) / n * 1e6,
    }


def _loop(fn, n: int, **kwargs):
    async def run(sub):
        return await fn(sub, n, **kwargs)

    run.n = n  # type: ignore[attr-defined]
    return run


# --paced: the hand-written inbox loop in a moderate rate's rhythm (500/s reaches a
# consumer lingering 10 ms as fetches of about 5), against the same loop saturated:
# the least CPU per message a consumer built on these parts pays at that rate, per
# message of its saturated cost.
PACED_FETCH, PACED_PAUSE = 5, 0.010


def _ratio(key: str, got: dict[str, dict[str, float]]) -> str:
    if key == "ref":
        return ""
    if key == "paced":
        return f"= CPU {got[key]['cpu_us'] / got['ref']['cpu_us']:4.2f} x saturated"
    return f"= {got[key]['rate'] / got['ref']['rate']:4.2f} x hand-written"


def _gline(name: str, r: dict[str, float], ratio: str = "") -> None:
    print(
        f"  {name:44s} {r['rate']:7,.0f} msg/s {ratio:28s} | Python {r['cpu_us']:5.0f}  PostgreSQL"
        f" {r['pg_us']:4.0f}  handler {r['handler_us']:3.0f} us/msg",
        flush=True,
    )


async def _against_hand_written(args, js, pg: EmbeddedPostgres, url: str, handler_pid: int, consume) -> None:
    """Rounds of three loops on the same messages and handler, one after the
    other in each round (each on a durable of its own): the no-database loop,
    the hand-written inbox loop, `pgoutbox consume` with default settings; then
    the medians of the rounds. Interleaved, so that the machine's drift falls
    on all three alike."""
    n, batch = args.messages, args.ref_batch
    reference_loops.create_schema(pg.url)
    print(
        f"(g) pgoutbox consume (default settings, login in pgoutbox_consumer only) against hand-written loops:"
        f" {args.rounds} round(s) of {n:,} messages each; the references fetch {batch} and keep"
        f" {CONCURRENCY} keep-alive connections (OUTBOX_CONSUMER_CONCURRENCY's default)"
    )
    names = {
        "raw": "fetch -> raw POST -> ack (no database)",
        "ref": "hand-written inbox (INSERT, POST, UPDATE)",
        "consume": "pgoutbox consume, defaults",
    }
    if args.paced:
        names["paced"] = f"hand-written inbox, fetches of {PACED_FETCH} {PACED_PAUSE * 1000:g} ms apart"
    before = None
    if args.before:
        before = _before_package(Path(tempfile.mkdtemp(prefix="pgoutbox-before-")), args.before)
        names["before"] = f"pgoutbox consume at {args.before}, defaults"
    variants = {}  # LABEL:VAR=V,...: pgoutbox consume with these variables too
    for variant in args.consume_variant:
        label, _, assignments = variant.partition(":")
        variants[label] = [a for a in assignments.split(",") if a]
        names[label] = f"pgoutbox consume, {label}"
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(1, args.rounds + 1):
        ticks = machine.cpu_ticks()
        got = {
            "raw": await _reference(
                js,
                f"g_raw{r}",
                _loop(reference_loops.no_database, n, url=url, concurrency=CONCURRENCY, batch=batch, handler="g_raw"),
                pg,
                handler_pid,
            ),
            "ref": await _reference(
                js,
                f"g_ref{r}",
                _loop(
                    reference_loops.hand_written_inbox,
                    n,
                    url=url,
                    database_url=pg.url,
                    concurrency=CONCURRENCY,
                    batch=batch,
                    handler=f"g_ref{r}",
                ),
                pg,
                handler_pid,
            ),
        }
        if args.paced:
            got["paced"] = await _reference(
                js,
                f"g_paced{r}",
                _loop(
                    reference_loops.hand_written_inbox,
                    n // 4,
                    url=url,
                    database_url=pg.url,
                    concurrency=CONCURRENCY,
                    batch=PACED_FETCH,
                    handler=f"g_paced{r}",
                    pause=PACED_PAUSE,
                ),
                pg,
                handler_pid,
            )
        # This checkout and --before take turns at going first: the second of
        # two back-to-back drains came out ~14 % faster in an A/A run.
        order = ["consume", "before"] if before is not None else ["consume"]
        for key in order if r % 2 else order[::-1]:
            got[key] = await consume(
                f"g_{key}{r}",
                pythonpath=before if key == "before" else str(ROOT),
                profile=f"{args.profile}/{key}.pstat" if args.profile and r == 1 else None,
            )
        for label, told in variants.items():
            got[label] = await consume(
                f"g_{label}{r}",
                settings=told,
                profile=f"{args.profile}/{label}.pstat" if args.profile and r == 1 else None,
            )
        rounds.append(got)
        print(f" round {r}: {machine.steal_since(ticks)}; {machine.load()}")
        for key, name in names.items():
            _gline(name, got[key], _ratio(key, got))
    print(f" median of {len(rounds)} round(s):")
    for key, name in names.items():
        median = {m: statistics.median(g[key][m] for g in rounds) for m in rounds[0][key]}
        measure = "cpu_us" if key == "paced" else "rate"  # what _ratio divides: the median of each round's ratio
        ratio = statistics.median(g[key][measure] / g["ref"][measure] for g in rounds)
        _gline(name, median, _ratio(key, {key: {measure: ratio}, "ref": {measure: 1.0}}))
    for key, side in (("consume", "this"), ("before", "before")):
        if key in names:
            ratio = statistics.median(g[key]["rate"] / g["ref"]["rate"] for g in rounds)
            figures.record("consume / hand-written inbox loop", side, ratio, "x", "higher")
            cpu = statistics.median(g[key]["cpu_us"] for g in rounds)
            figures.record("consume CPU per message (drain)", side, cpu, "us", "lower")
            pg_us = statistics.median(g[key]["pg_us"] for g in rounds)
            figures.record("PostgreSQL CPU per message (consume drain)", side, pg_us, "us", "lower")
    ratios = ", ".join(f"{g['consume']['rate'] / g['ref']['rate']:.2f}" for g in rounds)
    print(f"  consume / hand-written inbox, each round: {ratios} (target >= 0.6, aim 0.8)")


# -- (h) the cost of an upcast step ---------------------------------------------
# tick v1 {"n": i, ...} -> v2 {"count": i, ...}: a renamed field, as in docs/in-database.md.
TICK_UPCASTER = """
CREATE SCHEMA IF NOT EXISTS bench;
CREATE OR REPLACE FUNCTION bench.tick_v1_v2(p jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE
AS $$ SELECT (p - 'n') || jsonb_build_object('count', p -> 'n', 'schema_version', 2) $$;
SELECT inbox.register_upcaster('tick', 1, 'bench.tick_v1_v2(jsonb)');
"""


async def _upcast_step(args, pg: EmbeddedPostgres, consume) -> None:
    print(
        f"(h) pgoutbox consume, default settings: without and with an upcast step (tick v1 -> v2), "
        f"{args.rounds} interleaved round(s)"
    )
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(TICK_UPCASTER)
    rounds = []
    for r in range(1, args.rounds + 1):
        plain = await consume(f"plain{r}")
        upcast = await consume(f"upcast{r}", manifest_extra="version = 2\n")
        rounds.append({"plain": plain, "upcast": upcast})
        _line(f"round {r}: no version (payload as it came)", plain["rate"], plain["cpu_us"], plain["pg_us"])
        _line(f"round {r}: version = 2, every message upcast", upcast["rate"], upcast["cpu_us"], upcast["pg_us"])
    med = {k: {m: statistics.median(g[k][m] for g in rounds) for m in rounds[0][k]} for k in ("plain", "upcast")}
    print(f" median of {len(rounds)} round(s):")
    _line("no version", med["plain"]["rate"], med["plain"]["cpu_us"], med["plain"]["pg_us"])
    _line("version = 2, every message upcast", med["upcast"]["rate"], med["upcast"]["cpu_us"], med["upcast"]["pg_us"])
    wall = (1 / med["upcast"]["rate"] - 1 / med["plain"]["rate"]) * 1e6
    print(
        f"  upcast step, per message: wall {wall:+.0f} us, consumer process "
        f"{med['upcast']['cpu_us'] - med['plain']['cpu_us']:+.0f} us CPU, PostgreSQL "
        f"{med['upcast']['pg_us'] - med['plain']['pg_us']:+.0f} us CPU",
        flush=True,
    )


# -- (i) the cost of traces -----------------------------------------------------
async def _traces_off_on(args, consume) -> None:
    from harness.otlp import SinkProcess  # the otel extra (in dev)

    sink = SinkProcess()
    print(
        f"(i) pgoutbox consume, default settings: traces off, and on (OTLP/HTTP to a sink process), "
        f"{args.rounds} interleaved round(s)"
    )
    rounds = []
    try:
        for r in range(1, args.rounds + 1):
            ticks = machine.cpu_ticks()
            off = await consume(f"traces_off{r}")
            on = await consume(f"traces_on{r}", settings=[f"OTEL_EXPORTER_OTLP_ENDPOINT={sink.endpoint}"])
            rounds.append({"off": off, "on": on})
            print(f" round {r}: {machine.steal_since(ticks)}; {machine.load()}")
            _line("traces off", off["rate"], off["cpu_us"], off["pg_us"])
            _line("traces on", on["rate"], on["cpu_us"], on["pg_us"], ("off", off["rate"]))
    finally:
        spans = sink.close()
    med = {k: {m: statistics.median(g[k][m] for g in rounds) for m in rounds[0][k]} for k in ("off", "on")}
    print(f" median of {len(rounds)} round(s) (the sink received {spans:,} spans):")
    _line("traces off", med["off"]["rate"], med["off"]["cpu_us"], med["off"]["pg_us"])
    _line("traces on", med["on"]["rate"], med["on"]["cpu_us"], med["on"]["pg_us"], ("off", med["off"]["rate"]))
    wall = (1 / med["on"]["rate"] - 1 / med["off"]["rate"]) * 1e6
    print(
        f"  traces on, per message: wall {wall:+.0f} us, consumer process "
        f"{med['on']['cpu_us'] - med['off']['cpu_us']:+.0f} us CPU",
        flush=True,
    )


# -- (j) handlers of format "batch" --------------------------------------------------
async def _batch_format(args, consume) -> None:
    print(
        f"(j) pgoutbox consume, default settings: format pgoutbox (a POST per message) and format batch "
        f"(a POST per fetch) on the same handler process, {args.rounds} interleaved round(s)"
    )
    stdlib, stdlib_url = _start_noop_handler("--serve-stdlib")
    handlers = {"no-op": (None, None), "http.server": (stdlib_url, stdlib.pid)}
    kinds = [(h, f) for h in handlers for f in ("pgoutbox", "batch")]
    rounds = []
    try:
        for r in range(1, args.rounds + 1):
            ticks = machine.cpu_ticks()
            got = {}
            for h, f in kinds:
                url, pid = handlers[h]
                extra = 'format = "batch"\n' if f == "batch" else ""
                name = f"{f}_{h.replace('.', '').replace('-', '')}{r}"
                got[(h, f)] = await consume(
                    name, manifest_extra=extra, path="/batch" if f == "batch" else None, url=url, handler_pid=pid
                )
            rounds.append(got)
            print(f" round {r}: {machine.steal_since(ticks)}; {machine.load()}")
            for h, f in kinds:
                res, ref = got[(h, f)], None if f == "pgoutbox" else ("pgoutbox", got[(h, "pgoutbox")]["rate"])
                _line(f"{h} handler, format {f}", res["rate"], res["cpu_us"], res["pg_us"], ref)
    finally:
        stdlib.kill()
        stdlib.wait()
    print(f" median of {len(rounds)} round(s):")
    for h, f in kinds:
        med = {m: statistics.median(g[(h, f)][m] for g in rounds) for m in rounds[0][(h, f)]}
        ref = None
        if f == "batch":
            ref = ("pgoutbox", statistics.median(g[(h, "pgoutbox")]["rate"] for g in rounds))
        _line(f"{h} handler, format {f}", med["rate"], med["cpu_us"], med["pg_us"], ref)
        print(f"  {'':58s} handler CPU {med['handler_us']:5.0f} us/msg", flush=True)


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
        create_consumer_login(pg)
        handler, url = _start_noop_handler()
        asyncio.run(_run(args, pg, nats_url, url, workdir, handler.pid))
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
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-stdlib":
        _serve_stdlib(int(sys.argv[2]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--processes", default="1,2,4", help="consumer process counts for (e)")
    parser.add_argument("--http2", action="store_true", help="(f): needs the h2 package (httpx[http2])")
    parser.add_argument(
        "--setting", action="append", default=[], metavar="OUTBOX_X=V", help="for the consumer processes (repeatable)"
    )
    parser.add_argument("--indb-fetch", type=int, default=256, help="fetch size of the batched in-database loop")
    parser.add_argument("--only", default="abcdefghij", help="the parts to run (a always)")
    parser.add_argument("--rounds", type=int, default=3, help="(g), (h), (i), (j): interleaved rounds")
    parser.add_argument("--ref-batch", type=int, default=CONCURRENCY, help="(g): fetch size of the reference loops")
    parser.add_argument(
        "--paced",
        action="store_true",
        help=f"(g): also the hand-written inbox loop fetching {PACED_FETCH} every {PACED_PAUSE * 1000:g} ms",
    )
    parser.add_argument(
        "--consume-variant",
        action="append",
        default=[],
        metavar="LABEL:VAR=V,...",
        help="(g): also run pgoutbox consume with these environment variables, in each round",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="(g): profile round 1's consume processes (yappi, CPU clock) into DIR"
    )
    parser.add_argument("--skip-before", action="store_true", help="do not run release 0.2.0's consumer")
    parser.add_argument("--before", help="(g): also run `pgoutbox consume` from this commit's package, each round")
    main(parser.parse_args())
