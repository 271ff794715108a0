"""End-to-end latency benchmark (figures, not a test): from a writer's commit of
outbox.emit() to the handler's receipt of the HTTP call, through a real
`pgoutbox relay` and N `pgoutbox consume` processes, at paced emit rates.

Everything runs on this host, started by the bench on free loopback ports
and stopped by PID: a private PostgreSQL 15 (fsync on, synchronous_commit
on), nats-server with JetStream (file storage), the relay, the consumers
(inbox in the same PostgreSQL, HTTP handler mode) and a fake handler: a
keep-alive HTTP/1.1 server in a process of its own that answers 200 at once
and records when each message id arrived. Relay and consumers run with the
product's defaults (every OUTBOX_* setting unset but the URLs, the streams
file, the registry file and the HTTP ports, 0 = any free port; the README's
handler manifest: timeout 10s, max_deliver 5), each as the login its doc
gives it: a member of pgoutbox_relay only, of pgoutbox_consumer only; the
writers as a member of pgoutbox_writer only. The writers run in a process of
their own: each event is one transaction (`SELECT outbox.emit(...)` in
autocommit) from one of --writers sessions, paced to the rate; the commit
time is taken right after the statement returns. Both sides read CLOCK_MONOTONIC, one clock for every
process on the host. The first second of each rate is left out (connections
and prepared statements warm up); a message delivered twice counts at its
first arrival.

Prints per rate: the rate achieved, p50, p99 and max latency, events that
never reached the handler within the wait, the consumer processes used, and
the CPU the relay and the consumers spent per event (from the emits' start
until the last event arrived, divided by the events), and the steal of that
stretch; beside them, for workers that serve them, what their own latency
histograms (docs/observability.md) observed over the same run, as
Prometheus's histogram_quantile estimates them from the buckets: commit ->
JetStream ack (the relay) and commit -> outcome recorded (the consumers; it
ends after the handler's answer and the inbox's settle, so it should be a
little above the bench's own figure, which ends at the handler's receipt);
then the highest rate that held p99 < 500 ms (with --find-max,
bisected further between the highest rate that held and the lowest that did
not), and the hypervisor's steal over the run.

    .venv/bin/python bench/e2e_bench.py [--rates 200,500,1000,2000,3000] [--consumers 1] [--seconds 15]
        [--find-max N] [--code COMMIT,.] [--profile DIR] [--format batch]

--format batch: the same manifest with `format = "batch"` (docs/handlers.md, "Batch
handlers"): the handler receives a fetch per request and records each message's arrival
when the request reaches it, answering 200 for each.

With --hold MINUTES (docs/benchmarks.md, "Held snapshot"): for each --code in
turn, a pipeline of its own whose schema that code's migrations built (the
claim path is SQL), at the first --rates rate for a minute, then with another
session holding a snapshot (`BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT
count(*) FROM pg_class;` kept open) for MINUTES, then a minute released;
prints per minute of commit time p50 and p99 (commit -> handler), PostgreSQL's
CPU per event (the whole server, emits included) and the dead tuples of
outbox.* and inbox.*, the codes side by side.

    .venv/bin/python bench/e2e_bench.py --hold 10 --rates 400 --code main,.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg

import checkout  # noqa: F401  (the checkout's root on sys.path, for harness/)
import figures
import machine
from harness import releases
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from relay_bench import postgres_cpu_seconds

CONTEXT = "e2e"
SUBJECT = f"{CONTEXT}.event.order_created.v1"
TARGET_P99_MS = 500.0
EMIT = (
    "SELECT outbox.emit('order', %(n)s::text, 'order_created',"
    " jsonb_build_object('schema_version', 1, 'order_id', %(n)s::text::int, 'total_cents', 3490,"
    " 'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-1', 'qty', 2))),"
    f" context => '{CONTEXT}',"
    " headers => jsonb_build_object('traceparent',"
    " '00-' || md5(%(n)s::text) || '-' || left(md5(%(n)s::text || 's'), 16) || '-01'))"
)


# ---- the fake handler (a process of its own: `e2e_bench.py --handler PORT`) ----

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n"


def serve_handler(port: int) -> None:
    arrivals: dict[str, float] = {}

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                now = time.monotonic()
                length, message_id = 0, None
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"pgoutbox-message-id":
                        message_id = value.strip().decode()
                body = await reader.readexactly(length) if length else b""
                if b"\r\nPgoutbox-Batch-Size:" in head:  # a batch handler: a result per message
                    ids = [m["envelope"]["message_id"] for m in json.loads(body)["messages"]]
                    for mid in ids:
                        arrivals.setdefault(mid, now)
                    out = json.dumps({"results": [{"message_id": mid, "status": 200} for mid in ids]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(out) + out)
                elif head.startswith(b"GET /"):
                    body = (json.dumps(arrivals) if head.startswith(b"GET /arrivals") else str(len(arrivals))).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                else:
                    if message_id is not None:
                        arrivals.setdefault(message_id, now)
                    writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", port, backlog=1024)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---- the writers (a process of its own: `e2e_bench.py --writers URL RATE SECONDS FIRST`) ----


async def write_at_rate(url: str, rate: int, seconds: float, first: int, writers: int) -> dict:
    """Emits rate events/s for seconds from `writers` sessions; returns
    {started, finished, total, committed: {event_id: monotonic time after the commit}}."""
    committed: dict[str, float] = {}
    total = int(rate * seconds)
    conns = [await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(writers)]
    for c in conns:  # prepared before the clock starts
        for _ in range(6):
            await c.execute("SELECT outbox.emit('warm', '0', 'warm', '{\"schema_version\": 1}', context => 'warm')")
    started = time.monotonic() + 0.2

    async def writer(k: int) -> None:
        for i in range(k, total, writers):
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            cur = await conns[k].execute(EMIT, {"n": str(first + i)})
            event_id = (await cur.fetchone())[0]
            committed[str(event_id)] = time.monotonic()

    await asyncio.gather(*(writer(k) for k in range(writers)))
    for c in conns:
        await c.close()
    return {"started": started, "finished": time.monotonic(), "total": total, "committed": committed}


# ---- the bench ----


# The login of each party: a member of the one group its doc names, nothing more.
LOGINS = {"writer": "pgoutbox_writer", "relay": "pgoutbox_relay", "consumer": "pgoutbox_consumer"}


class Pipeline:
    """PostgreSQL, NATS, the handler, the relay and the consumers, all ours."""

    def __init__(
        self,
        root: Path,
        codes: list[str],
        profile: str | None = None,
        schema_code: str = ".",
        fmt: str = "pgoutbox",
        statements: bool = False,
    ):
        self.root = root
        self.format = fmt  # the handler's format: "pgoutbox" (a POST per message) or "batch"
        self.schema_code = schema_code  # whose migrations build the schema ("." = this checkout)
        settings = {"max_wal_size": "4GB"}
        if statements:  # --statements: every statement's time and buffers, nested ones included
            settings |= {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"}
        self.statements = statements
        self.pg = EmbeddedPostgres(root / "pg", settings=settings)
        self.nats = EmbeddedNats(root / "nats")
        self.handler: subprocess.Popen | None = None
        self.handler_url = ""
        self.relay: subprocess.Popen | None = None
        self.consumers: list[subprocess.Popen] = []
        # The commits whose package the relay and consumers run ("." = this checkout).
        self.codes = codes
        self.pythonpaths: dict[str, str | None] = {}
        self.pythonpath: str | None = None
        self.profile = profile  # a folder: run the workers under yappi (bench/profiled.py), a profile per rate
        self.streams = root / "streams.toml"

    def url(self, party: str) -> str:
        return self.pg.url.replace("postgresql://postgres@", f"postgresql://e2e_{party}@")

    def env(self, extra: dict[str, str], party: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "PYTHON"))}
        env["OUTBOX_NATS_URL"] = self.nats.url
        if party:
            env["OUTBOX_DATABASE_URL"] = self.url(party)
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        env.update(extra)
        return env

    def spawn(self, command: str, name: str, extra: dict[str, str], profile: str | None = None) -> subprocess.Popen:
        log = (self.root / f"{name}.log").open("ab")
        run = [str(Path(__file__).with_name("profiled.py")), profile] if profile else ["-m", "pgoutbox.cli.main"]
        return subprocess.Popen(
            [sys.executable, *run, command],
            env=self.env(extra, command.replace("consume", "consumer")),
            stdout=log,
            stderr=log,
        )

    def _export(self, commit: str) -> str:
        """The package of `commit`, from git, importable as `pgoutbox` (PYTHONPATH)."""
        repo = Path(__file__).resolve().parents[1]
        return str(releases.export(repo, commit, self.root / f"code-{len(self.pythonpaths)}"))

    def start(self) -> None:
        self.pg.start()
        self.nats.start()
        for code in self.codes:
            self.pythonpaths[code] = None if code == "." else self._export(code)
        if self.schema_code != ".":
            code = (
                "import psycopg, sys; from pgoutbox.core import migrate;"
                " migrate.migrate(psycopg.connect(sys.argv[1], autocommit=True))"
            )
            subprocess.run(
                [sys.executable, "-c", code, self.pg.url],
                check=True,
                env={**self.env({}), "PYTHONPATH": str(self.pythonpaths[self.schema_code])},
            )
        with psycopg.connect(self.pg.url, autocommit=True) as conn:
            if self.schema_code == ".":
                migrate.migrate(conn)
            for party, group in LOGINS.items():
                conn.execute(f"CREATE ROLE e2e_{party} LOGIN IN ROLE {group}")
            if self.statements:
                conn.execute("CREATE EXTENSION pg_stat_statements")
        port = free_port()
        self.handler = subprocess.Popen(
            [sys.executable, __file__, "--handler", str(port)], stdout=subprocess.PIPE, text=True
        )
        assert self.handler.stdout is not None and self.handler.stdout.readline().strip() == "ready"
        self.handler_url = f"http://127.0.0.1:{port}"
        streams = self.streams
        streams.write_text(f'[streams.{CONTEXT}]\nname = "E2E_EVENTS"\nduplicate_window = "2m"\nmax_age = "1h"\n')
        manifests = self.root / "handlers"
        manifests.mkdir()
        (manifests / "orders.toml").write_text(  # the README's manifest
            f'[[handler]]\nname = "orders"\nurl = "{self.handler_url}/orders"\nsubjects = ["{SUBJECT}"]\n'
            'timeout = "10s"\nmax_deliver = 5\n' + ('format = "batch"\n' if self.format == "batch" else "")
        )
        for argv in (
            ["streams", "--streams-file", str(streams)],
            ["registry", "generate", "--manifest-dir", str(manifests), "--registry-file", str(self.root / "reg.json")],
        ):
            subprocess.run(
                [sys.executable, "-m", "pgoutbox.cli.main", *argv], env=self.env({}), check=True, capture_output=True
            )

    def set_workers(self, code: str, n: int, label: str) -> None:
        """A relay and n consumers of `code`, started afresh."""
        self.stop_consumers()
        self._stop(self.relay)
        self.pythonpath = self.pythonpaths[code]
        profile = f"{self.profile}/{label}" if self.profile else None
        self.relay = self.spawn(
            "relay",
            "relay",
            {"OUTBOX_STREAMS_FILE": str(self.streams), "OUTBOX_RELAY_HTTP_PORT": "0"},
            f"{profile}-relay.pstat" if profile else None,
        )
        self.consumers = [
            self.spawn(
                "consume",
                f"consumer-{i}",
                {"OUTBOX_REGISTRY_FILE": str(self.root / "reg.json"), "OUTBOX_CONSUMER_HTTP_PORT": "0"},
                f"{profile}-consumer-{i}.pstat" if profile else None,
            )
            for i in range(n)
        ]

    @staticmethod
    def _stop(p: subprocess.Popen | None) -> None:
        if p and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_consumers(self) -> None:
        for p in self.consumers:
            p.send_signal(signal.SIGTERM)
        for p in self.consumers:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.consumers = []

    def arrivals(self) -> dict[str, float]:
        return httpx.get(f"{self.handler_url}/arrivals", timeout=30).json()

    def arrived(self) -> int:
        """How many distinct message ids arrived so far (cheap to ask while the pipeline runs)."""
        return int(httpx.get(f"{self.handler_url}/count", timeout=30).text)

    def stop(self) -> None:
        self.stop_consumers()
        for p in (self.relay, self.handler):
            if p and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.nats.stop()
        self.pg.stop("immediate")


def wait_ready(pipe: Pipeline, timeout: float = 60) -> None:
    """Until an event emitted now reaches the handler: relay and consumers bound."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(pipe.url("writer"), autocommit=True) as conn:
        while time.monotonic() < deadline:
            event_id = str(conn.execute(EMIT, {"n": "0"}).fetchone()[0])
            until = time.monotonic() + 3
            while time.monotonic() < until:
                if event_id in pipe.arrivals():
                    return
                time.sleep(0.1)
    raise RuntimeError(f"the pipeline did not deliver within {timeout}s; see the logs under {pipe.root}")


# Each side's histogram and the labels of the series read (le aside).
AGES = {
    "relay": ("pgoutbox_relay_event_age_at_publish_seconds_bucket", {"context": CONTEXT}),
    "consumer": (
        "pgoutbox_consumer_event_age_at_outcome_seconds_bucket",
        {"handler": "orders", "outcome": "processed"},
    ),
}


def _http_port(log: Path, started: str) -> int | None:
    """The metrics port a worker logged at start-up (its last `started` line:
    each rate starts the workers afresh, appending to the same log)."""
    with contextlib.suppress(OSError):
        for line in reversed(log.read_text(errors="replace").splitlines()):
            if line.startswith("{") and started in line:
                return json.loads(line).get("http_port")
    return None


def age_buckets(pipe: Pipeline) -> dict[str, dict[float, float]]:
    """Each side's age histogram, summed over its processes: upper bound -> cumulative count."""
    found: dict[str, dict[float, float]] = {"relay": {}, "consumer": {}}
    logs = [("relay", pipe.root / "relay.log", '"action": "started"')]
    logs += [("consumer", pipe.root / f"consumer-{i}.log", '"consumer started"') for i in range(len(pipe.consumers))]
    for side, log, started in logs:
        port = _http_port(log, started)
        if port is None:
            continue
        with contextlib.suppress(httpx.HTTPError):
            name, wanted = AGES[side]
            for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
                if not line.startswith(name + "{"):
                    continue
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) : line.rindex("}")]))
                le = labels.pop("le")
                if labels == wanted:
                    bound = float("inf") if le == "+Inf" else float(le)
                    found[side][bound] = found[side].get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def bucket_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """histogram_quantile(q, ...) of the observations between two scrapes, in ms
    (linear within the bucket, as Prometheus does; None without observations)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower * 1000
            return (lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)) * 1000
        lower, below = bound, count
    return None


def run_rate(pipe: Pipeline, code: str, rate: int, consumers: int, seconds: float, first: int, writers: int) -> dict:
    pipe.set_workers(code, consumers, f"{'this' if code == '.' else code}-{rate}")
    wait_ready(pipe)
    procs = [p for p in (pipe.relay, *pipe.consumers) if p]
    if pipe.profile:
        for p in procs:
            p.send_signal(signal.SIGUSR1)  # the profiles count from here
    before = pipe.arrived()
    ages_before = age_buckets(pipe)
    ticks = machine.cpu_ticks()
    cpu = {p.pid: machine.cpu_seconds(p.pid) for p in procs}
    out = subprocess.run(
        [sys.executable, __file__, "--writers", pipe.url("writer"), str(rate), str(seconds), str(first), str(writers)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    run = json.loads(out)
    committed: dict[str, float] = run["committed"]
    # Until every event arrived, or none did for 20 s (a backlog drains at the consumers' pace).
    last, progress = before, time.monotonic()
    while (count := pipe.arrived()) < before + len(committed) and time.monotonic() - progress < 20:
        if count > last:
            last, progress = count, time.monotonic()
        time.sleep(0.25)
    spent = {pid: machine.cpu_seconds(pid) - c for pid, c in cpu.items()}
    steal = machine.steal_since(ticks)
    time.sleep(0.5)  # the consumers count an outcome just after the handler's answer
    ages_after = age_buckets(pipe)
    metric = {
        f"{side}_{name}": bucket_quantile(q, ages_before[side], ages_after[side])
        for side in ("relay", "consumer")
        for name, q in (("p50", 0.5), ("p99", 0.99))
    }
    arrivals = pipe.arrivals()
    warm = run["started"] + 1.0
    lat = sorted((arrivals[e] - t) * 1000 for e, t in committed.items() if e in arrivals and t >= warm)
    q = statistics.quantiles(lat, n=100)
    n = len(committed)
    return {
        "achieved": run["total"] / (run["finished"] - run["started"]),
        "p50": q[49],
        "p99": q[98],
        "max": lat[-1],
        "samples": len(lat),
        "missing": len(set(committed) - set(arrivals)),
        "relay_us": spent[pipe.relay.pid] / n * 1e6 if pipe.relay else 0.0,
        "consumer_us": sum(spent[p.pid] for p in pipe.consumers) / n * 1e6,
        "steal": steal,
        **metric,
    }


def record(code: str, rate: int, res: dict) -> None:
    """The figures bench/guard.py compares ("." is this checkout, any commit the one before)."""
    side = "this" if code == "." else "before"
    figures.record(f"e2e p99 at {rate}/s", side, res["p99"], "ms", "lower")
    figures.record(f"e2e relay CPU per event at {rate}/s", side, res["relay_us"], "us", "lower")
    figures.record(f"e2e consumer CPU per event at {rate}/s", side, res["consumer_us"], "us", "lower")


def held(res: dict, rate: int) -> bool:
    """p99 under the target, nothing missing, and the writers kept the pace."""
    return res["p99"] < TARGET_P99_MS and not res["missing"] and res["achieved"] >= 0.95 * rate


def report(code: str, rate: int, n: int, res: dict) -> None:
    print(
        f"  {'this checkout' if code == '.' else code:14s} {rate:5d} events/s (achieved {res['achieved']:,.0f}/s),"
        f" {n} consumer process(es):"
        f" p50 {res['p50']:7.1f} ms  p99 {res['p99']:7.1f} ms  max {res['max']:7.1f} ms"
        f"  ({res['samples']} samples, {res['missing']} missing; CPU per event: relay"
        f" {res['relay_us']:.0f} us, consumers {res['consumer_us']:.0f} us; {res['steal']})",
        flush=True,
    )
    if res["consumer_p99"] is not None:
        print(
            "    the workers' own histograms (histogram_quantile of the buckets):"
            f" commit -> handler processed p50 {res['consumer_p50']:.1f} ms p99 {res['consumer_p99']:.1f} ms;"
            + (
                f" commit -> JetStream ack p50 {res['relay_p50']:.1f} ms p99 {res['relay_p99']:.1f} ms"
                if res["relay_p99"] is not None
                else ""
            ),
            flush=True,
        )
    if res["achieved"] < 0.95 * rate:
        print(f"    the writers fell behind the pace ({res['achieved']:,.0f} of {rate:,}/s): the machine is saturated")


# ---- a held snapshot (--hold) ----

HOLD = ("BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT count(*) FROM pg_class")


def dead_tuples(url: str) -> int:
    return table_stats(url)[0]


def table_stats(url: str) -> tuple[int, int]:
    """Dead tuples and autovacuum runs so far, outbox.* and inbox.*."""
    with psycopg.connect(url, autocommit=True) as conn:
        dead, vacuums = conn.execute(
            "SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(autovacuum_count), 0)"
            " FROM pg_stat_user_tables WHERE schemaname IN ('outbox', 'inbox')"
        ).fetchone()
        return int(dead), int(vacuums)


# A server process's part, from its title (`postgres: <user> <db> ...` for a session).
PARTS = {
    "e2e_relay": "relay",
    "e2e_consumer": "consumer",
    "e2e_writer": "writers",
    "autovacuum worker": "autovacuum",
}


def cpu_by_part(pg: EmbeddedPostgres, seen: dict[int, tuple[str, float]]) -> dict[str, float]:
    """The server's CPU so far by part (relay, consumer, writers, autovacuum, other);
    `seen` keeps each process's last reading, so that one that exited still counts up to it.
    `exited` is the rest: what processes that exited spent after their last reading (mostly
    autovacuum workers, which live seconds) and the postmaster's own."""
    postmaster = int((pg.datadir / "postmaster.pid").read_text().split()[0])
    total = machine.cpu_seconds(postmaster, reaped_children=True)
    for child in Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            title = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            part = next((v for k, v in PARTS.items() if title.startswith(f"postgres: {k}")), "other")
            cpu = machine.cpu_seconds(int(child))
            total += cpu
            seen[int(child)] = (part, cpu)
    parts = {"relay": 0.0, "consumer": 0.0, "writers": 0.0, "autovacuum": 0.0, "other": 0.0}
    for part, cpu in seen.values():
        parts[part] += cpu
    parts["exited"] = total - sum(parts.values())
    parts["total"] = total
    return parts


def statement_stats(url: str) -> dict[tuple[int, bool], tuple[str, int, float, int, int]]:
    """pg_stat_statements so far: (queryid, top level) -> (text, calls, ms, shared buffers
    touched, of them read in from outside shared_buffers)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT queryid, toplevel, min(left(query, 200)), sum(calls),"
            " sum(total_exec_time), sum(shared_blks_hit + shared_blks_read), sum(shared_blks_read)"
            " FROM pg_stat_statements WHERE queryid IS NOT NULL GROUP BY 1, 2"
        ).fetchall()
    return {
        (q, t): (" ".join(text.split())[:110], int(c), float(ms), int(b), int(r)) for q, t, text, c, ms, b, r in rows
    }


def run_hold(pipe: Pipeline, code: str, rate: int, hold: float, writers: int) -> list[dict]:
    """One code's pipeline at `rate` for a minute, `hold` minutes held, a minute
    released: per minute of commit time, p50/p99, PostgreSQL CPU per event, dead tuples."""
    pipe.set_workers(code, 1, f"hold-{code}")
    wait_ready(pipe)
    lead, tail = 60.0, 60.0
    seconds = lead + hold * 60 + tail
    out = (pipe.root / "writers.json").open("w")  # a file: a pipe would fill up while we wait
    writer = subprocess.Popen(
        [sys.executable, __file__, "--writers", pipe.url("writer"), str(rate), str(seconds), "1000000", str(writers)],
        stdout=out,
        text=True,
    )
    begun = time.monotonic()
    samples: list[tuple[float, float, int]] = []  # (monotonic, PostgreSQL CPU seconds, dead tuples)
    seen: dict[int, tuple[str, float]] = {}
    parts: list[tuple[float, dict[str, float]]] = []  # (monotonic, CPU seconds by part)
    # (monotonic, pg_stat_statements) at each minute's edge only: reading it costs the server
    stats: list[tuple[float, dict]] = []
    next_stats = begun + lead + 1 - 60
    holder: psycopg.Connection | None = None
    held_at = released_at = 0.0
    while writer.poll() is None:
        now = time.monotonic()
        dead, vacuums = table_stats(pipe.pg.url)
        samples.append((now, postgres_cpu_seconds(pipe.pg), dead))
        parts.append((now, cpu_by_part(pipe.pg, seen) | {"vacuums": float(vacuums)}))
        if pipe.statements and now >= next_stats:
            stats.append((now, statement_stats(pipe.pg.url)))
            next_stats += 60
        if holder is None and not held_at and now - begun >= lead + 1:
            holder = psycopg.connect(pipe.pg.url, autocommit=True, application_name="bench: held snapshot")
            for stmt in HOLD:
                holder.execute(stmt)
            held_at = time.monotonic()
            if pipe.statements:
                stats.append((held_at, statement_stats(pipe.pg.url)))
                next_stats = held_at + 60
        if holder is not None and now - held_at >= hold * 60:
            holder.execute("ROLLBACK")
            holder.close()
            holder, released_at = None, time.monotonic()
        time.sleep(max(0.0, 2.0 - (time.monotonic() - now)))
    if holder is not None:
        holder.close()
        released_at = time.monotonic()
    out.close()
    run = json.loads((pipe.root / "writers.json").read_text())
    committed: dict[str, float] = run["committed"]
    last, progress = -1, time.monotonic()
    while (count := pipe.arrived()) < len(committed) + 1 and time.monotonic() - progress < 60:
        if count > last:
            last, progress = count, time.monotonic()
        time.sleep(0.5)
    arrivals = pipe.arrivals()
    samples.append((time.monotonic(), postgres_cpu_seconds(pipe.pg), dead_tuples(pipe.pg.url)))
    parts.append((time.monotonic(), cpu_by_part(pipe.pg, seen) | {"vacuums": float(table_stats(pipe.pg.url)[1])}))
    if pipe.statements:
        stats.append((time.monotonic(), statement_stats(pipe.pg.url)))

    # The relay's side, commit -> marked published (PostgreSQL's clock), per minute from the hold's start.
    with psycopg.connect(pipe.pg.url, autocommit=True) as conn:
        relay_side = conn.execute(
            "SELECT floor(extract(epoch FROM e.created_at - h.at) / 60)::int,"
            " 1000 * extract(epoch FROM percentile_cont(0.5) WITHIN GROUP (ORDER BY e.published_at - e.created_at)),"
            " 1000 * extract(epoch FROM percentile_cont(0.99) WITHIN GROUP (ORDER BY e.published_at - e.created_at))"
            " FROM outbox.events AS e, (SELECT now() - make_interval(secs => %s) AS at) AS h"
            " WHERE e.context = %s AND e.status = 'COMPLETED' GROUP BY 1",
            (time.monotonic() - held_at, CONTEXT),
        ).fetchall()
    relay_by_minute = {m: (float(p50), float(p99)) for m, p50, p99 in relay_side}

    def cpu_at(t: float) -> float:
        return min(samples, key=lambda x: abs(x[0] - t))[1]

    def nearest(series: list, t: float):
        return min(series, key=lambda x: abs(x[0] - t))[1] if series else {}

    rows = []
    start = run["started"] + 1.0
    # Minutes counted from the hold's start (the first one may begin less than a minute before it).
    edges = [
        held_at + 60 * k for k in range(-round((held_at - start) / 60), int((run["finished"] - held_at) // 60) + 1)
    ]
    for lo, hi in zip(edges, edges[1:]):
        lat = sorted((arrivals[e] - t) * 1000 for e, t in committed.items() if lo <= t < hi and e in arrivals)
        n = sum(1 for t in committed.values() if lo <= t < hi)
        missing = n - len(lat)
        q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [float("nan")] * 99
        dead = min(samples, key=lambda x: abs(x[0] - hi))[2]
        phase = "before" if hi <= held_at + 1 else ("held" if lo < released_at - 1 else "released")
        p_lo, p_hi = nearest(parts, lo), nearest(parts, hi)
        s_lo, s_hi = nearest(stats, lo), nearest(stats, hi)
        statements = {}
        for key, (text, calls, ms, blocks, read) in s_hi.items():
            c0, ms0, b0, r0 = s_lo.get(key, (text, 0, 0.0, 0, 0))[1:]
            if calls > c0:
                statements[f"{'top' if key[1] else 'nested'} {key[0]}"] = (
                    text,
                    calls - c0,
                    ms - ms0,
                    blocks - b0,
                    read - r0,
                )
        rows.append(
            {
                "minute": f"{(lo - held_at) / 60:+.0f}",
                "relay_p50": relay_by_minute.get(round((lo - held_at) / 60), (float("nan"),) * 2)[0],
                "relay_p99": relay_by_minute.get(round((lo - held_at) / 60), (float("nan"),) * 2)[1],
                "phase": phase,
                "p50": q[49],
                "p99": q[98],
                "cpu_us": (cpu_at(hi) - cpu_at(lo)) / max(n, 1) * 1e6,
                "dead": dead,
                "events": n,
                "missing": missing,
                "cpu_parts_us": {k: (p_hi[k] - p_lo.get(k, 0.0)) / max(n, 1) * 1e6 for k in p_hi if k != "vacuums"},
                "autovacuums": int(p_hi.get("vacuums", 0) - p_lo.get("vacuums", 0)),
                "statements": statements,
            }
        )
    return rows


def report_hold(results: dict[str, list[dict]]) -> None:
    codes = list(results)
    print(
        "  minute (of the hold) | "
        + " | ".join(
            f"{c}: p50 / p99 ms, PG CPU us/event, dead tuples, relay commit -> marked p50 / p99" for c in codes
        )
    )
    for i in range(max(len(r) for r in results.values())):
        cells = []
        label = ""
        for c in codes:
            if i >= len(results[c]):
                cells.append("-")
                continue
            r = results[c][i]
            label = label or f"{r['minute']:>4s} {r['phase']:8s}"
            cells.append(
                f"{r['p50']:8.1f} / {r['p99']:8.1f}  {r['cpu_us']:6.0f}  {r['dead']:9,d}"
                f"  relay {r['relay_p50']:7.1f} / {r['relay_p99']:7.1f}"
                + (f" ({r['missing']} missing)" if r["missing"] else "")
            )
        print(f"  {label:14s} | " + " | ".join(cells), flush=True)
    for c in codes:
        print(f"  {c}: PostgreSQL CPU us/event by part (server processes by their title)")
        names = list(results[c][0]["cpu_parts_us"])
        print("    minute          | " + " | ".join(f"{k:>10s}" for k in names) + " | autovacuum runs")
        for r in results[c]:
            print(
                f"    {r['minute']:>4s} {r['phase']:10s} | "
                + " | ".join(f"{r['cpu_parts_us'].get(k, 0.0):10.0f}" for k in names)
                + f" | {r['autovacuums']}"
            )
        report_statements(c, results[c])
    for c in codes:
        base = [r for r in results[c] if r["phase"] == "before"]
        held = [r for r in results[c] if r["phase"] == "held"]
        if base and held:
            p99, cpu = base[-1]["p99"], base[-1]["cpu_us"]
            print(
                f"  {c}: worst held minute p99 {max(r['p99'] for r in held) / p99:.1f}x the minute before,"
                f" PostgreSQL CPU per event {max(r['cpu_us'] for r in held) / cpu:.2f}x"
            )


def report_statements(code: str, rows: list[dict]) -> None:
    """The statements that took the most time over the run (pg_stat_statements, nested
    ones included, so a function and its statements both appear): per event, time (us) and
    shared buffers, the minute before the hold, its first, middle and last minute."""
    if not any(r["statements"] for r in rows):
        return
    before = [r for r in rows if r["phase"] == "before"][-1:]
    held = [r for r in rows if r["phase"] == "held"]
    picked = before + ([held[0], held[len(held) // 2], held[-1]] if held else [])
    totals: dict[str, float] = {}
    for r in rows:
        for k, (_, _, ms, _, _) in r["statements"].items():
            totals[k] = totals.get(k, 0.0) + ms
    print(
        f"  {code}: statements by time, per event: us / shared buffers touched, of them read in (calls per 100 events)"
    )
    print("    " + " | ".join(f"minute {r['minute']:>3s}" for r in picked) + " | statement")
    for k in sorted(totals, key=totals.get, reverse=True)[:25]:
        text = next(r["statements"][k][0] for r in rows if k in r["statements"])
        cells = []
        for r in picked:
            _, calls, ms, blocks, read = r["statements"].get(k, ("", 0, 0.0, 0, 0))
            n = max(r["events"], 1)
            cells.append(f"{ms * 1000 / n:6.1f} / {blocks / n:6.1f}, {read / n:5.2f} ({calls * 100 / n:4.0f})")
        print("    " + " | ".join(cells) + f" | {k.split()[0]} {text}")


def main() -> int:
    if sys.argv[1:2] == ["--handler"]:
        serve_handler(int(sys.argv[2]))
        return 0
    if sys.argv[1:2] == ["--writers"]:
        url, rate, seconds, first, writers = sys.argv[2:7]
        print(json.dumps(asyncio.run(write_at_rate(url, int(rate), float(seconds), int(first), int(writers)))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="200,500,1000,2000,3000", help="comma-separated emit rates (events/s)")
    ap.add_argument(
        "--consumers", default="1", help="consumer processes per rate, comma-separated (one count: for every rate)"
    )
    ap.add_argument("--seconds", type=float, default=15.0, help="emit duration per rate")
    ap.add_argument("--writers", type=int, default=16, help="emitting sessions")
    ap.add_argument(
        "--find-max",
        type=int,
        default=0,
        metavar="N",
        help="then N more rates, bisecting between the highest that held p99 < 500 ms and the lowest that did not",
    )
    ap.add_argument(
        "--code",
        default=".",
        metavar="COMMIT,...",
        help="the relay and consumers of these commits ('.': this checkout), each rate run with each in turn",
    )
    ap.add_argument("--profile", metavar="DIR", help="run the workers under yappi; a profile per code, rate and worker")
    ap.add_argument(
        "--hold", type=float, default=0.0, metavar="MINUTES", help="a snapshot held this long at the first rate"
    )
    ap.add_argument("--format", default="pgoutbox", choices=("pgoutbox", "batch"), help="the handler's format")
    ap.add_argument(
        "--statements",
        action="store_true",
        help="with --hold: pg_stat_statements loaded, its figures per minute (time and buffers per event)",
    )
    args = ap.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    consumers = [int(c) for c in args.consumers.split(",")]
    if len(consumers) == 1:
        consumers = consumers * len(rates)
    if len(consumers) != len(rates):
        ap.error("--consumers needs one count, or one per rate")

    root = Path(tempfile.mkdtemp(prefix="pgoutbox-e2e-bench-"))
    root.chmod(0o755)  # PostgreSQL runs as another user
    codes = args.code.split(",")
    if args.hold:
        print(
            f"e2e bench, a snapshot held {args.hold:g} min at {rates[0]}/s; product defaults; code and schema of"
            f" {', '.join(codes)}; {machine.load()}",
            flush=True,
        )
        ticks = machine.cpu_ticks()
        results = {}
        try:
            for i, c in enumerate(codes):
                pipe = Pipeline(root / f"hold-{i}", [c], schema_code=c, statements=args.statements)
                pipe.root.mkdir()
                pipe.root.chmod(0o755)
                try:
                    pipe.start()
                    results[c] = run_hold(pipe, c, rates[0], args.hold, args.writers)
                    print(json.dumps({c: results[c]}), flush=True)
                finally:
                    with contextlib.suppress(Exception):
                        pipe.stop()
            report_hold(results)
            print(f"done: {machine.load()}; {machine.steal_since(ticks)}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    pipe = Pipeline(root, codes, args.profile, fmt=args.format)
    print(
        "e2e bench: emit commit -> relay -> JetStream -> pgoutbox consume -> HTTP handler; product defaults,"
        f" least-privileged logins; {args.writers} writers; code {', '.join(codes)}; handler format {args.format};"
        f" {machine.load()}",
        flush=True,
    )
    ticks = machine.cpu_ticks()
    code = 0
    try:
        pipe.start()
        first = 1_000_000
        results: dict[str, dict[int, bool]] = {c: {} for c in codes}
        for rate, n in zip(rates, consumers):
            for c in codes:  # side by side: each code at this rate, one after the other
                res = run_rate(pipe, c, rate, n, args.seconds, first, args.writers)
                first += 10_000_000
                report(c, rate, n, res)
                record(c, rate, res)
                results[c][rate] = held(res, rate)
                code = code or (1 if res["missing"] else 0)
        for _ in range(args.find_max):
            for c in codes:
                lo = max((r for r, ok in results[c].items() if ok), default=0)
                hi = min((r for r, ok in results[c].items() if not ok and r > lo), default=None)
                if hi is None or hi - lo <= 100:
                    continue
                rate = (lo + hi) // 2 // 50 * 50
                res = run_rate(pipe, c, rate, consumers[-1], args.seconds, first, args.writers)
                first += 10_000_000
                report(c, rate, consumers[-1], res)
                results[c][rate] = held(res, rate)
        for c in codes:
            best = max((r for r, ok in results[c].items() if ok), default=None)
            above = min((r for r, ok in results[c].items() if not ok and r > (best or 0)), default=None)
            print(
                f"  {'this checkout' if c == '.' else c}: target p99 < {TARGET_P99_MS:.0f} ms; the highest rate that"
                " held it: " + (f"{best:,}/s" if best else "none") + (f" (not {above:,}/s)" if above else "")
            )
        print(f"done: {machine.load()}; {machine.steal_since(ticks)}")
    finally:
        with contextlib.suppress(Exception):
            pipe.stop()
        shutil.rmtree(root, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
