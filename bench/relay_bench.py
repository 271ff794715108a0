"""Relay benchmark (not a test): prints, in one run on this machine,

  (a) the raw nats-py JetStream publish rate for the same messages (subject,
      body, headers built by pgoutbox.core.wire from the very rows the relay
      will drain), pipelined in windows of the relay's batch size;
  (b) the relay's drain rate for a backlog of --events events, as events/s
      and as a ratio to (a);
  (c) end-to-end latency p50/p99 from emit's commit (outbox.emit in its own
      autocommit transaction) to receipt by a JetStream subscriber, at fixed
      emit rates, with the LISTEN/NOTIFY wake-up and poll-only;
  (d) the relay's peak RSS (VmHWM) in each run;
  (f) --parts f with --before COMMIT: the drain of (b), side by side with
      that commit, each relay on its defaults (a login in pgoutbox_relay
      only) and on a database its own release's migrations built, so that a
      changed claim counts; --rounds interleaved rounds, a fresh database
      and an empty stream per drain; the medians of events/s, of the ratio
      to (a)'s publish_async in the same run, and of relay and PostgreSQL
      CPU per event (what bench/guard.py compares);
  (e) the relay at moderate rates (--moderate, default 200,500,1000/s): CPU
      per event of the relay process (from the emits' start until the last
      event reached the subscriber), PostgreSQL's CPU per event (emit included)
      and emit -> subscriber p50/p99; this build and, with --before COMMIT,
      that commit's relay, in --rounds interleaved rounds (medians printed).
      Each relay runs with the product's defaults (the HTTP port aside: 0) as a
      login in pgoutbox_relay only. --tracing adds this build with traces on
      (OTEL_EXPORTER_OTLP_ENDPOINT: an OTLP/HTTP sink in a process of its
      own, harness.otlp) in the same rounds, and prints what tracing costs per
      event against this build with tracing off.

Everything runs on a private PostgreSQL 15 (default durability: fsync on,
synchronous_commit on) and nats-server (file storage) started on free ports
under a temporary folder, and stopped (by PID) at the end. The relay runs as
a real subprocess (`python -m pgoutbox.cli.main relay`), as in production.

    .venv/bin/python bench/relay_bench.py [--events 100000] [--rates 500,2000] [--notify-throttle 2ms]
    .venv/bin/python bench/relay_bench.py --parts e [--moderate 200,500,1000] [--before COMMIT] [--rounds 3]
    .venv/bin/python bench/relay_bench.py --parts e --tracing [--before COMMIT]   # traces off vs on
    .venv/bin/python bench/relay_bench.py --parts af --before COMMIT [--events 50000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import nats
import psycopg
from nats.js.api import DeliverPolicy, StreamConfig

import checkout  # noqa: F401  (the checkout's root on sys.path, for harness/)
import figures
import machine
from harness import releases
from pgoutbox.core import migrate, wire
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres
from pgoutbox.outbox import streams
from pgoutbox.outbox.calls import CLAIMED_COLUMNS

CONTEXT = "bench"
EMIT_CHUNK = 10_000
# One order event: ~200 bytes of payload plus a W3C traceparent header.
EMIT_SQL = """
SELECT count(outbox.emit(
    'order', i::text, 'order_created',
    jsonb_build_object(
        'schema_version', 1, 'order_id', i, 'customer', 'c-' || (i %% 1000),
        'total_cents', 1250 * 2 + 990,
        'lines', jsonb_build_array(
            jsonb_build_object('sku', 'SKU-1', 'qty', 2, 'price_cents', 1250),
            jsonb_build_object('sku', 'SKU-2', 'qty', 1, 'price_cents', 990))),
    context => %(context)s,
    headers => jsonb_build_object('traceparent',
        '00-' || md5(i::text) || '-' || left(md5(i::text || 's'), 16) || '-01'),
    correlation_id => gen_random_uuid()
)) FROM generate_series(%(lo)s::int, %(hi)s::int) AS i
"""
ONE_EMIT_SQL = EMIT_SQL.replace("count(outbox.emit(", "(outbox.emit(").replace(
    "FROM generate_series(%(lo)s::int, %(hi)s::int) AS i", "FROM (SELECT %(lo)s::int AS i) AS x"
)


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def postgres_cpu_seconds(pg: EmbeddedPostgres) -> float:
    """CPU of the whole PostgreSQL server: the postmaster, its live children and
    the backends it has reaped."""
    postmaster = int((pg.datadir / "postmaster.pid").read_text().split()[0])
    total = machine.cpu_seconds(postmaster, reaped_children=True)
    for child in Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a child that exited meanwhile
            total += machine.cpu_seconds(int(child))
    return total


RELAY_LOGIN = "bench_relay"


@contextlib.contextmanager
def relay_process(
    root: Path,
    pg: EmbeddedPostgres,
    ns: EmbeddedNats,
    name: str,
    *,
    pythonpath: str | None = None,
    defaults: bool = False,
    profile: str | None = None,
    extra_env: dict[str, str] | None = None,
    **settings: str,
):
    """A relay process. defaults: as a login in pgoutbox_relay only, every
    setting at its default but the HTTP port (0: any free port). profile: run
    it under yappi (bench/profiled.py), writing this pstats file at its exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "PYTHON", "OTEL_"))}
    env.update(
        {
            "OUTBOX_DATABASE_URL": pg.url.replace("postgresql://postgres@", f"postgresql://{RELAY_LOGIN}@")
            if defaults
            else pg.url,
            "OUTBOX_NATS_URL": ns.url,
            "OUTBOX_RELAY_HTTP_PORT": "0",
        }
    )
    if not defaults:
        env.update({"OUTBOX_RELAY_NAME": name, "OUTBOX_LOG_LEVEL": "INFO"})
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update({f"OUTBOX_RELAY_{k.upper()}": v for k, v in settings.items()})
    env.update(extra_env or {})
    log = (root / f"{name}.log").open("w")
    command = [str(Path(__file__).with_name("profiled.py")), profile] if profile else ["-m", "pgoutbox.cli.main"]
    proc = subprocess.Popen([sys.executable, *command, "relay"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def relay_http_port(root: Path, name: str, timeout: float = 30) -> int:
    """The port the relay's /metrics landed on (from its "started" log line)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in (root / f"{name}.log").read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("action") == "started":
                return json.loads(line)["http_port"]
        time.sleep(0.1)
    raise RuntimeError(f"relay {name} did not start; see {root}/{name}.log")


# The histograms these figures read, and their names before 0.4.0 (a --before
# COMMIT that old serves those).
CLAIM, PUBLISH, BATCH = (
    "pgoutbox_relay_claim_duration_seconds",
    "pgoutbox_relay_publish_duration_seconds",
    "pgoutbox_relay_batch_events",
)
OLD_NAMES = {
    "outbox_relay_claim_seconds": CLAIM,
    "outbox_relay_publish_seconds": PUBLISH,
    "outbox_relay_batch_size": BATCH,
}


def histogram_totals(port: int) -> dict[str, float]:
    """name_sum and name_count of the relay's histograms, by their current names."""
    value = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        name, _, number = line.partition(" ")
        base, _, part = name.rpartition("_")
        if part in ("sum", "count") and OLD_NAMES.get(base, base) in (CLAIM, PUBLISH, BATCH):
            value[f"{OLD_NAMES.get(base, base)}_{part}"] = float(number)
    return value


def stage_times(port: int) -> str:
    """Mean claim and publish durations and batch size, from the relay's /metrics."""
    value = histogram_totals(port)

    def mean(metric: str) -> float:
        return value[f"{metric}_sum"] / max(1.0, value[f"{metric}_count"])

    return (
        f"claim {mean(CLAIM) * 1000:.1f} ms, publish {mean(PUBLISH) * 1000:.1f} ms, {mean(BATCH):.1f} events per batch"
    )


def claim_counts(port: int) -> tuple[float, float]:
    """(claims, non-empty batches) so far, from the relay's /metrics."""
    found = histogram_totals(port)
    return found.get(f"{CLAIM}_count", 0.0), found.get(f"{BATCH}_count", 0.0)


def small_claim_ms(url: str, rounds: int = 15) -> float:
    """Median time of outbox.claim() handing out 5 fresh events (then marked)."""
    times = []
    with psycopg.connect(url, autocommit=True) as conn:
        for r in range(rounds):
            conn.execute(EMIT_SQL, {"context": "claimcost", "lo": 1, "hi": 5})
            started = time.perf_counter()
            rows = conn.execute("SELECT event_id, claim_token FROM outbox.claim('bench', 500, '30s')").fetchall()
            times.append(time.perf_counter() - started)
            conn.execute("SELECT outbox.mark_published(%s, %s)", (rows[0][1], [r[0] for r in rows]))
    return statistics.median(times) * 1000


def emit_backlog(url: str, n: int) -> float:
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for lo in range(1, n + 1, EMIT_CHUNK):
            conn.execute(EMIT_SQL, {"context": CONTEXT, "lo": lo, "hi": min(n, lo + EMIT_CHUNK - 1)})
    return time.perf_counter() - started


async def raw_publish_rate(ns_url: str, rows: list[dict], window: int) -> dict[str, float]:
    """nats-py alone: the same messages into a separate stream, pipelined by window."""
    messages = []
    for row in rows:
        subject, body, headers = wire.to_nats(row)
        messages.append(("raw." + subject, body, headers))
    nc = await nats.connect(ns_url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="RAW", subjects=["raw.>"]))
    rates = {}
    try:
        # js.publish_async: nats-py's pipelined publish (futures, one reply inbox).
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(0, len(messages), window):
            futures = [await js.publish_async(s, b, headers=dict(h)) for s, b, h in messages[i : i + window]]
            await asyncio.gather(*futures)
        rates["publish_async"] = len(messages) / (time.perf_counter() - started)
        rates["cpu_us"] = (time.process_time() - cpu) / len(messages) * 1e6
        await js.purge_stream("RAW")
        # js.publish under asyncio.gather: one request (and task) per message.
        sample = messages[: len(messages) // 2]
        started = time.perf_counter()
        for i in range(0, len(sample), window):
            await asyncio.gather(
                *(
                    js.publish(s, b, headers=dict(h) | {"Nats-Msg-Id": h["Nats-Msg-Id"] + "-2"})
                    for s, b, h in sample[i : i + window]
                )
            )
        rates["publish+gather"] = len(sample) / (time.perf_counter() - started)
    finally:
        await js.delete_stream("RAW")
        await nc.close()
    return rates


def migrate_as(pythonpath: str, url: str) -> None:
    """Migrates `url` with the migrations of the package on `pythonpath`, through its own command."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "PYTHON"))}
    subprocess.run(
        [sys.executable, "-m", "pgoutbox.cli.main", "migrate", "--database-url", url],
        env=env | {"PYTHONPATH": pythonpath},
        check=True,
        capture_output=True,
    )


def drain(
    root: Path,
    pg,
    ns,
    n: int,
    batch_size: int | None,
    *,
    pythonpath: str | None = None,
    name: str = "drain",
    profile: str | None = None,
) -> tuple[float, float, float, float]:
    """(events/s between the first and last published_at, wall seconds, peak RSS MB,
    relay CPU microseconds per event). batch_size None: the relay on its
    defaults, as a login in pgoutbox_relay only."""
    pg_cpu, nats_cpu = postgres_cpu_seconds(pg), machine.cpu_seconds(ns.process.pid)
    with psycopg.connect(pg.url, autocommit=True) as conn:
        started = time.perf_counter()
        settings = {} if batch_size is None else {"batch_size": str(batch_size)}
        with relay_process(
            root, pg, ns, name, pythonpath=pythonpath, defaults=batch_size is None, profile=profile, **settings
        ) as proc:
            while True:
                left = conn.execute(
                    "SELECT coalesce(sum(unpublished), 0) FROM outbox.backlog(%s)", (CONTEXT,)
                ).fetchone()[0]
                if left == 0:
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"relay exited with {proc.returncode}; see {root}/{name}.log")
                time.sleep(0.05)
            wall = time.perf_counter() - started
            rss = peak_rss_mb(proc.pid)
            cpu = machine.cpu_seconds(proc.pid) / n * 1e6
            print(f"    relay stages during the drain: {stage_times(relay_http_port(root, name))}")
        first, last, done = conn.execute(
            "SELECT min(published_at), max(published_at), count(*) FILTER (WHERE status = 'COMPLETED')"
            " FROM outbox.events WHERE context = %s",
            (CONTEXT,),
        ).fetchone()
    if done != n:
        raise RuntimeError(f"only {done} of {n} events COMPLETED")
    time.sleep(0.5)  # the relay's backends exit and are reaped
    pg_us = (postgres_cpu_seconds(pg) - pg_cpu) / n * 1e6
    print(
        f"    CPU per event during the drain: PostgreSQL {pg_us:.0f} us,"
        f" nats-server {(machine.cpu_seconds(ns.process.pid) - nats_cpu) / n * 1e6:.0f} us (and the relay, below)"
    )
    drain.pg_us = pg_us  # type: ignore[attr-defined]
    return n / (last - first).total_seconds(), wall, rss, cpu


def drain_side_by_side(root: Path, pg, ns, args, raw_rate: float) -> None:
    """(f): this build's drain against --before's, in interleaved rounds."""
    import types

    from sql_bench import new_database

    codes = {"before": export_package(root, args.before), "this": None}
    templates = {}
    for label in codes:
        templates[label] = new_database(pg.url, f"drain_template_{label}")
        path = codes[label]
        if path is None:
            with psycopg.connect(templates[label], autocommit=True) as conn:
                migrate.migrate(conn)
        else:
            migrate_as(path, templates[label])
    print(
        f"(f) the relay's drain of {args.events:,} events, this build against {args.before}, {args.rounds}"
        " interleaved round(s); each relay on its defaults, on a database its own migrations built"
    )
    got: dict[str, list[dict[str, float]]] = {label: [] for label in codes}
    for r in range(args.rounds):
        ticks = machine.cpu_ticks()
        for label in list(codes)[r % 2 :] + list(codes)[: r % 2]:
            url = new_database(pg.url, f"drain_{label}_{r}", template=f"drain_template_{label}")
            emit_backlog(url, args.events)
            asyncio.run(purge_stream(ns.url))
            db = types.SimpleNamespace(url=url, datadir=pg.datadir)
            rate, _, _, cpu = drain(root, db, ns, args.events, None, pythonpath=codes[label], name=f"drain-{label}-{r}")
            got[label].append({"rate": rate, "relay_us": cpu, "pg_us": drain.pg_us})  # type: ignore[attr-defined]
            print(f"    round {r + 1} {label:6s}: {rate:8,.0f} events/s, relay {cpu:4.0f} us/event", flush=True)
        print(f"  round {r + 1}: {machine.steal_since(ticks)}; {machine.load()}", flush=True)
    for label, runs in got.items():
        rate = statistics.median(x["rate"] for x in runs)
        relay_us = statistics.median(x["relay_us"] for x in runs)
        pg_us = statistics.median(x["pg_us"] for x in runs)
        print(
            f"  median {label:6s}: {rate:8,.0f} events/s = {rate / raw_rate:.2f} x publish_async;"
            f" relay {relay_us:.0f} us, PostgreSQL {pg_us:.0f} us CPU per event"
        )
        figures.record("relay drain", label, rate, "events/s", "higher")
        figures.record("relay drain / publish_async", label, rate / raw_rate, "x", "higher")
        figures.record("relay CPU per event (drain)", label, relay_us, "us", "lower")
        figures.record("PostgreSQL CPU per event (drain)", label, pg_us, "us", "lower")


async def purge_stream(ns_url: str) -> None:
    nc = await nats.connect(ns_url)
    try:
        await nc.jetstream().purge_stream("BENCH_EVENTS")
    finally:
        await nc.close()


async def emit_at_rate(pg_url: str, rate: int, seconds: float, emit_sync: bool, first: int) -> dict:
    """Emits at `rate`/s, each event in its own transaction, from 8 sessions;
    returns {event_id: perf_counter() right after its commit}."""
    committed: dict[str, float] = {}
    total = int(rate * seconds)
    writers = 8
    options = "" if emit_sync else "-c synchronous_commit=off"
    conns = [await psycopg.AsyncConnection.connect(pg_url, autocommit=True, options=options) for _ in range(writers)]
    started = time.perf_counter() + 0.2

    async def writer(k: int) -> None:
        conn = conns[k]
        for i in range(k, total, writers):
            delay = started + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            cur = await conn.execute(ONE_EMIT_SQL, {"context": CONTEXT, "lo": first + i})
            committed[str((await cur.fetchone())[0])] = time.perf_counter()

    await asyncio.gather(*(writer(k) for k in range(writers)))
    for c in conns:
        await c.close()
    return {"started": started, "finished": time.perf_counter(), "total": total, "committed": committed}


async def latency_run(pg_url: str, ns_url: str, rate: int, seconds: float, emit_sync: bool) -> dict[str, float]:
    """Times commit -> JetStream subscriber. The emitters run in a process of
    their own so that neither side's timestamps wait on the other's work
    (perf_counter is CLOCK_MONOTONIC: one clock for both processes)."""
    nc = await nats.connect(ns_url)
    js = nc.jetstream()
    received: dict[str, float] = {}

    async def on_msg(msg):
        received[msg.headers[wire.MSG_ID]] = time.perf_counter()

    sub = await js.subscribe(f"{CONTEXT}.event.>", cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
    emitter = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--emitter",
        pg_url,
        str(rate),
        str(seconds),
        "on" if emit_sync else "off",
        str(10_000_000 + rate * 1000),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await emitter.communicate()
    run = json.loads(out)
    committed = run["committed"]
    deadline = time.perf_counter() + 30
    while len(set(committed) - set(received)) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    await sub.unsubscribe()
    await nc.close()
    # The first half second warms up connections and prepared statements.
    warm = run["started"] + 0.5
    lat = sorted((received[e] - t) * 1000 for e, t in committed.items() if e in received and t >= warm)
    missing = len(set(committed) - set(received))
    q = statistics.quantiles(lat, n=100)
    return {
        "achieved_rate": run["total"] / (run["finished"] - run["started"]),
        "p50": q[49],
        "p99": q[98],
        "max": lat[-1],
        "samples": len(lat),
        "missing": missing,
        "total": len(committed),
    }


@functools.cache
def export_package(root: Path, commit: str) -> str:
    """The package of `commit`, from git, importable as `pgoutbox` (PYTHONPATH);
    exported once per run (parts e and f both ask for it)."""
    return str(releases.export(Path(__file__).resolve().parents[1], commit, root / f"code-{commit}"))


TRACING_ON = "traces on (OTLP/HTTP)"


def moderate_rates(root: Path, pg, ns, args) -> None:
    """(e): the relay's CPU per event at moderate rates, this build against
    --before in interleaved rounds, each relay started afresh per round."""
    codes: dict[str, tuple[str | None, dict[str, str]]] = {"this build": (None, {})}
    if args.before:
        codes = {f"before ({args.before})": (export_package(root, args.before), {}), **codes}
    for variant in args.variant:  # LABEL:VAR=VALUE,VAR=VALUE: this build with those variables
        label, _, assignments = variant.partition(":")
        codes[label] = (None, dict(a.split("=", 1) for a in assignments.split(",") if a))
    sink = None
    if args.tracing:
        from harness.otlp import SinkProcess  # the otel extra (in dev)

        sink = SinkProcess()
        codes[TRACING_ON] = (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint})
    rates = [int(x) for x in args.moderate.split(",")]
    print(
        f"(e) the relay at moderate rates: {args.rounds} round(s) of {args.seconds:g} s per rate and relay,"
        f" 8 emitting sessions (synchronous_commit={args.emit_sync}); defaults, login in pgoutbox_relay only"
    )
    got: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in range(1, args.rounds + 1):
        ticks = machine.cpu_ticks()
        for label, (path, extra_env) in codes.items():
            name = f"moderate-{r}-{len(got)}"
            profile = f"{args.profile}/relay-{label.split()[0]}.pstat" if args.profile and r == 1 else None
            with relay_process(
                root, pg, ns, name, pythonpath=path, defaults=True, profile=profile, extra_env=extra_env
            ) as proc:
                port = relay_http_port(root, name)
                for rate in rates:
                    time.sleep(1)  # the relay idles between rates, as in production
                    if profile:
                        proc.send_signal(signal.SIGUSR1)  # the profile counts from here
                    cpu0, pg0, counts = machine.cpu_seconds(proc.pid), postgres_cpu_seconds(pg), claim_counts(port)
                    res = asyncio.run(latency_run(pg.url, ns.url, rate, args.seconds, args.emit_sync == "on"))
                    n = res["total"]
                    res["relay_us"] = (machine.cpu_seconds(proc.pid) - cpu0) / n * 1e6
                    res["pg_us"] = (postgres_cpu_seconds(pg) - pg0) / n * 1e6
                    claims, batches = (b - a for a, b in zip(counts, claim_counts(port), strict=True))
                    res["claims"], res["per_batch"] = claims / n * 100, n / max(1.0, batches)
                    got.setdefault((label, rate), []).append(res)
        print(f"  round {r}: {machine.steal_since(ticks)}; {machine.load()}", flush=True)
        for (label, rate), runs in got.items():
            res = runs[-1]
            print(
                f"    {label:22s} @ {rate:5d}/s (achieved {res['achieved_rate']:,.0f}/s):"
                f" relay {res['relay_us']:5.0f} us per event, PostgreSQL {res['pg_us']:4.0f} us;"
                f"  p50 {res['p50']:6.2f} ms  p99 {res['p99']:6.2f} ms  ({res['missing']} missing);"
                f" {res['claims']:.0f} claims per 100 events, {res['per_batch']:.1f} events per batch",
                flush=True,
            )
    print(f"  median of {args.rounds} round(s):")
    medians = {}
    for (label, rate), runs in got.items():
        med = medians[label, rate] = {
            k: statistics.median(x[k] for x in runs) for k in ("relay_us", "pg_us", "p50", "p99", "claims")
        }
        print(
            f"    {label:22s} @ {rate:5d}/s: relay {med['relay_us']:5.0f} us per event, PostgreSQL"
            f" {med['pg_us']:4.0f} us;  p50 {med['p50']:6.2f} ms  p99 {med['p99']:6.2f} ms;"
            f" {med['claims']:.0f} claims per 100 events"
        )
    if sink is not None:
        print(f"  traces on, against off (medians; the sink received {sink.close():,} spans):")
        for rate in rates:
            on, off = medians[TRACING_ON, rate], medians["this build", rate]
            print(
                f"    @ {rate:5d}/s: relay {on['relay_us'] - off['relay_us']:+5.0f} us CPU per event,"
                f" p50 {on['p50'] - off['p50']:+6.2f} ms, p99 {on['p99'] - off['p99']:+6.2f} ms"
            )


def main() -> int:
    if sys.argv[1:2] == ["--emitter"]:  # the emitting half of a latency run (see latency_run)
        url, rate, seconds, sync, first = sys.argv[2:7]
        run = asyncio.run(emit_at_rate(url, int(rate), float(seconds), sync == "on", int(first)))
        print(json.dumps(run))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--rates", default="500,2000")
    ap.add_argument("--seconds", type=float, default=6.0, help="emit duration per latency run")
    ap.add_argument(
        "--emit-sync",
        choices=("on", "off"),
        default="on",
        help="synchronous_commit of the latency runs' emitting sessions",
    )
    ap.add_argument(
        "--parts",
        default="abcde",
        help="a+b: publish and drain rates; c: latency; e: moderate rates; f: drain against --before; d always",
    )
    ap.add_argument("--notify-throttle", help="outbox.set_notify_throttle() for the run (default: the schema's, 5ms)")
    ap.add_argument("--moderate", default="200,500,1000", help="(e): emit rates")
    ap.add_argument("--before", metavar="COMMIT", help="(e), (f): also run this commit's relay, interleaved")
    ap.add_argument("--rounds", type=int, default=3, help="(e), (f): rounds")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:VAR=V,...",
        help="(e): also run this build with these environment variables (repeatable)",
    )
    ap.add_argument("--tracing", action="store_true", help="(e): also this build with traces on, to a local sink")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="(b), (e): profile the drain's relay and each relay of (e)'s round 1 (yappi, CPU clock) into DIR",
    )
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pgoutbox-bench-"))
    root.chmod(0o755)  # PostgreSQL runs as another user below
    pg = EmbeddedPostgres(root / "pg", settings={"max_wal_size": "4GB"})
    ns = EmbeddedNats(root / "nats")
    print(f"relay bench: {machine.load()} (shared machine: figures are noisy)")
    ticks = machine.cpu_ticks()
    try:
        pg.start()
        ns.start()
        with psycopg.connect(pg.url, autocommit=True) as conn:
            migrate.migrate(conn)
            conn.execute(f"CREATE ROLE {RELAY_LOGIN} LOGIN IN ROLE pgoutbox_relay")
            if args.notify_throttle:  # read by the emitters' trigger and by the relay at start-up
                conn.execute("SELECT outbox.set_notify_throttle(%s::interval)", (args.notify_throttle,))
                print(f"outbox.set_notify_throttle('{args.notify_throttle}')")
        specs = [streams.StreamSpec(CONTEXT, "BENCH_EVENTS", (f"{CONTEXT}.event.>",), "limits", "file", 1, 0, -1, 120)]

        async def setup_stream():
            nc = await nats.connect(ns.url)
            await streams.apply(nc.jetstream(), specs)
            await nc.close()

        asyncio.run(setup_stream())

        peak = rss = 0.0
        if "a" in args.parts:
            took = emit_backlog(pg.url, args.events)
            print(f"backlog: {args.events} events emitted in {took:.1f}s")
            with psycopg.connect(pg.url, autocommit=True) as conn:
                cur = conn.cursor(row_factory=psycopg.rows.dict_row)
                rows = cur.execute(
                    f"SELECT {CLAIMED_COLUMNS.replace('claim_token, ', '')} FROM outbox.events ORDER BY id"
                ).fetchall()
            nats_cpu = machine.cpu_seconds(ns.process.pid)
            raw = asyncio.run(raw_publish_rate(ns.url, rows, args.batch_size))
            nats_cpu = (machine.cpu_seconds(ns.process.pid) - nats_cpu) / (1.5 * len(rows)) * 1e6
            raw_cpu = raw.pop("cpu_us")
            best = max(raw.values())
            del rows
            print(
                f"(a) raw nats-py JetStream publish, windows of {args.batch_size}, {args.events} msgs: "
                + ", ".join(f"{k} {v:,.0f} msg/s" for k, v in raw.items())
                + f" (publish_async: {raw_cpu:.0f} us of client CPU per message; nats-server"
                f" {nats_cpu:.0f} us per message over both runs)"
            )
        if "b" in args.parts:
            profile = f"{args.profile}/relay-drain.pstat" if args.profile else None
            rate, wall, rss, cpu = drain(root, pg, ns, args.events, args.batch_size, profile=profile)
            print(
                f"(b) relay drain of {args.events}: {rate:,.0f} events/s (first to last published_at; "
                f"{wall:.1f}s wall incl. start-up) = {rate / best:.2f} x (a) best "
                f"[{max(raw, key=raw.get)}]; target >= 0.70; relay process CPU {cpu:.0f} us per event "
                "(PostgreSQL's claim/mark work runs beside it on the same 2 cores)"
            )
            peak = rss
        if "f" in args.parts:
            if not args.before or "a" not in args.parts:
                ap.error("--parts f needs a (the publish_async reference) and --before COMMIT")
            drain_side_by_side(root, pg, ns, args, raw["publish_async"])
        if "c" in args.parts:
            # Each event leaves dead entries in the claim index until a vacuum;
            # after the drain's churn a claim walks over them (see docs/relay.md).
            before = small_claim_ms(pg.url)
            with psycopg.connect(pg.url, autocommit=True) as conn:
                conn.execute("VACUUM outbox.events")
            print(
                f"claim of 5 events: {before:.1f} ms after the drain's churn, {small_claim_ms(pg.url):.1f} ms "
                "after VACUUM outbox.events (the latency runs start from the vacuumed table)"
            )
            print(
                "(c) end-to-end latency, emit commit -> JetStream subscriber (8 emitting sessions, "
                f"synchronous_commit={args.emit_sync}):"
            )
            for mode, settings in (
                ("LISTEN/NOTIFY", {"wakeups": "true"}),
                ("poll-only 1s", {"wakeups": "false", "poll_interval": "1s"}),
            ):
                name = f"latency-{mode[:4].lower()}"
                with relay_process(root, pg, ns, name, **settings) as proc:
                    port = relay_http_port(root, name)
                    for r in (int(x) for x in args.rates.split(",")):
                        res = asyncio.run(latency_run(pg.url, ns.url, r, args.seconds, args.emit_sync == "on"))
                        print(
                            f"    {mode:14s} @ {r:5d}/s (achieved {res['achieved_rate']:,.0f}/s): "
                            f"p50 {res['p50']:7.2f} ms  p99 {res['p99']:7.2f} ms  max {res['max']:7.2f} ms  "
                            f"({res['samples']} samples, {res['missing']} missing)"
                        )
                    print(f"    {'':14s}   relay stages over both rates: {stage_times(port)}")
                    peak = max(peak, peak_rss_mb(proc.pid))
                    code = None
                    proc.send_signal(signal.SIGTERM)
                    code = proc.wait(30)
                    if code != 0:
                        print(f"    relay exited with {code} on SIGTERM (expected 0)")
        if "e" in args.parts:
            moderate_rates(root, pg, ns, args)
        print(f"(d) relay peak RSS (VmHWM): drain {rss:.0f} MB, max over all runs {peak:.0f} MB; target <= 150 MB")
        print(f"done: {machine.load()}; {machine.steal_since(ticks)}")
    finally:
        ns.stop()
        pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
