"""One tenant's backlog beside the others (figures, not a test;
docs/benchmarks.md, "One tenant's backlog and the other tenants").

Latency (the default): the emit -> publish latency of ten quiet tenants, with
and without another tenant's backlog, through a real `pgoutbox relay` on its
defaults, for each --code side by side (the schema from that code's
migrations: the claim order is SQL; the relay from its package). Per code, a
PostgreSQL 15 and a nats-server of their own (bench/e2e_bench.Pipeline; the
relay as a login in pgoutbox_relay only, every OUTBOX_* setting unset but the
URLs and the streams file). Two phases of --seconds each: ten tenants emitting
50 events/s each, one transaction per event, as a login in pgoutbox_writer
only; then the same while one more tenant's backlog of --backlog events lands
one second into the phase, in one transaction (an import amid steady
traffic: all due at once; written before the phase, committed then). Two
latencies per quiet event, the first second of a phase left out: emit ->
JetStream, from the writer's commit (right after the emit returns, autocommit)
to the time JetStream stored the message (its own timestamp, read back from
the stream after the run; one wall clock on this host); and emit -> mark, its
published_at - created_at (the database's clock: the emit's transaction
start, the mark that follows the whole batch's acks). Prints per code and
phase the quiet tenants' p50, p99 and max of both, and how long the backlog
took to drain (its commit to its last event's mark); then the same for the
quiet events committed while it drained ("during": from its commit to that
mark), which is what the backlog delays: a phase longer than the drain mixes
in events that met no backlog; "open", those committed before, while its
transaction was open (the writers' first second, none left out); then the
steal. The drain's end is watched through the claimable rows' index:
counting the backlog's rows every 0.2 s read the whole table each time
(35 ms of a core), load no user has, beside the latencies measured.

    .venv/bin/python bench/fair_bench.py [--code 3f6d34a,.] [--seconds 20] [--backlog 100000] [--rounds 1]

--plan: the claim's plan, with what it read, on --rows due events over
--tenants tenants (this checkout's schema): a claim of the relay's default
batch as a login in pgoutbox_relay only, its statements' plans from
auto_explain, a first claim and one after 20 more claimed and marked.

    .venv/bin/python bench/fair_bench.py --plan [--rows 1000000] [--tenants 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import nats
import psycopg

import e2e_bench
from machine import cpu_ticks, load, steal_since
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres

QUIET, RATE = 10, 50  # tenants, events/s each
STREAM = "E2E_EVENTS"  # e2e_bench.Pipeline's streams file
EMIT = (
    "SELECT outbox.emit('order', %s, 'order_created', '{\"schema_version\": 1}',"
    f" context => '{e2e_bench.CONTEXT}', tenant_id => %s)"
)
BACKLOG = (
    "SELECT count(outbox.emit('order', 'bulk-' || g::text, 'order_created', '{\"schema_version\": 1}',"
    f" context => '{e2e_bench.CONTEXT}', tenant_id => 'bulk')) FROM generate_series(1, %s) AS g"
)
DEFAULT_BATCH = 500  # OUTBOX_RELAY_BATCH_SIZE's default (relay/pgoutbox/outbox/settings.py)


def stored_times(url: str) -> dict[str, float]:
    """When JetStream stored each message of the stream, by message id: its own
    timestamp (the server's clock, this machine's), read back after the run; a
    live subscriber lagged behind a backlog by seconds, parsing headers."""

    async def read() -> dict[str, float]:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            total = (await js.stream_info(STREAM)).state.messages
            sub = await js.pull_subscribe(
                f"{e2e_bench.CONTEXT}.>",
                stream=STREAM,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
            )
            times: dict[str, float] = {}
            seen = 0
            while seen < total:
                for msg in await sub.fetch(min(1000, total - seen), timeout=30):
                    seen += 1
                    mid = (msg.headers or {}).get("Nats-Msg-Id")
                    if mid and mid not in times:
                        times[mid] = msg.metadata.timestamp.timestamp()
            return times
        finally:
            await nc.close()

    return asyncio.run(read())


def quiet_writers(url: str, phase: str, seconds: float) -> dict[str, float]:
    """Ten tenants at 50 events/s each, paced, one session each; each event's commit time."""
    commits: dict[str, float] = {}

    def tenant(i: int) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            started = time.monotonic()
            for n in range(int(seconds * RATE)):
                time.sleep(max(0.0, started + n / RATE - time.monotonic()))  # pacing, not a wait
                event_id = conn.execute(EMIT, (f"{phase}-{i}-{n}", f"quiet-{i}")).fetchone()[0]
                commits[str(event_id)] = time.time()  # JetStream's timestamps are wall-clock

    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(QUIET)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return commits


def to_jetstream(
    commits: dict[str, float], arrivals: dict[str, float], since: float | None = None, until: float | None = None
) -> tuple[list[float], int]:
    """Commit -> stored in JetStream in ms of the events committed from `since`
    (the phase's first second left out by default) until `until`; and how
    many are not in the stream."""
    first = min(commits.values()) + 1.0 if since is None else since
    kept = {k: c for k, c in commits.items() if c >= first and (until is None or c < until)}
    return sorted(1000 * (arrivals[k] - c) for k, c in kept.items() if k in arrivals), sum(
        1 for k in kept if k not in arrivals
    )


def published(owner: psycopg.Connection, like: str, timeout: float) -> float:
    """Waits until every event whose aggregate_id is LIKE `like` is published; seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        left = owner.execute(
            "SELECT count(*) FROM outbox.events WHERE aggregate_id LIKE %s AND status <> 'COMPLETED'", (like,)
        ).fetchone()[0]
        if left == 0:
            return time.monotonic() - started
        time.sleep(0.2)
    raise RuntimeError(f"events {like} not all published within {timeout:.0f} s")


# Whether a tenant has events left to publish, from the claimable rows'
# partial index: cheap beside a backlog.
WAITING = (
    "SELECT EXISTS (SELECT 1 FROM outbox.events WHERE status IN ('PENDING', 'FAILED', 'PROCESSING')"
    " AND (status <> 'PENDING' OR claimed_at IS NOT NULL OR ordering_key IS NOT NULL OR available_at <= created_at)"
    " AND tenant_id = %s)"
)


def drained_at(url: str, tenant: str) -> float:
    """Waits, in a session of its own (a thread's), until every event of
    `tenant` is published; the wall-clock time its last one was marked."""
    with psycopg.connect(url, autocommit=True) as owner:
        owner.execute("SET enable_seqscan = off")  # the index, not a scan of every finished row
        started = time.monotonic()
        while owner.execute(WAITING, (tenant,)).fetchone()[0]:
            if time.monotonic() - started > 1800:
                raise RuntimeError(f"tenant {tenant}'s events not all published within 1800 s")
            time.sleep(0.2)
        return owner.execute(
            "SELECT extract(epoch FROM max(published_at))::float8 FROM outbox.events WHERE tenant_id = %s", (tenant,)
        ).fetchone()[0]


def latencies(
    owner: psycopg.Connection, phase: str, since: float | None = None, until: float | None = None
) -> list[float]:
    """published_at - created_at in ms, as to_jetstream chooses the events."""
    rows = owner.execute(
        "SELECT 1000 * extract(epoch FROM published_at - created_at)::float8 FROM outbox.events"
        " WHERE aggregate_id LIKE %s AND created_at >= coalesce(to_timestamp(%s::float8),"
        "   (SELECT min(created_at) + interval '1 second' FROM outbox.events WHERE aggregate_id LIKE %s))"
        " AND (%s::float8 IS NULL OR created_at < to_timestamp(%s::float8))",
        (f"{phase}-%", since, f"{phase}-%", until, until),
    ).fetchall()
    return sorted(r[0] for r in rows)


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


Phase = tuple[list[float], list[float], int, float | None]  # to JetStream, to the mark, missing, drained in


def run_code(code: str, seconds: float, backlog: int) -> dict[str, Phase]:
    with tempfile.TemporaryDirectory(prefix="pgoutbox-fair-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # the postgres user runs the server in it
        pipe = e2e_bench.Pipeline(root, [code], schema_code=code)
        try:
            pipe.start()
            with psycopg.connect(pipe.pg.url, autocommit=True) as owner:
                owner.execute("SELECT outbox.create_partitions()")
            pipe.set_workers(code, 0, "fair")
            with psycopg.connect(pipe.pg.url, autocommit=True) as owner:
                with psycopg.connect(pipe.url("writer"), autocommit=True) as w:
                    w.execute(EMIT, ("warm-0", "warm"))
                published(owner, "warm-%", 60)
                out: dict[str, Phase] = {}
                commits = quiet_writers(pipe.url("writer"), "alone", seconds)
                published(owner, "alone-%", 600)
                alone = commits
                # The backlog: one transaction (an import, all due at once),
                # written before the phase and committed one second into it,
                # so that it lands amid steady traffic, as an import does; the
                # writers' first second is left out of both phases.
                w = psycopg.connect(pipe.url("writer"))
                for start in range(0, backlog, 1000):
                    w.execute(BACKLOG, (min(1000, backlog - start),))
                marks: list[float] = []  # its commit, then its last event's mark (wall-clock)
                failed: list[BaseException] = []  # the importer's error, raised here

                def land() -> None:
                    try:
                        time.sleep(1.0)
                        w.commit()
                        marks.append(time.time())
                        marks.append(drained_at(pipe.pg.url, "bulk"))
                    except BaseException as exc:
                        failed.append(exc)
                    finally:
                        w.close()

                importer = threading.Thread(target=land)
                importer.start()
                commits = quiet_writers(pipe.url("writer"), "beside", seconds)
                importer.join()
                if failed:
                    raise failed[0]
                committed, ended = marks
                drain_s = ended - committed
                published(owner, "beside-%", 1800)
                stored = stored_times(pipe.nats.url)
                for phase, sent, drain in (("alone", alone, None), ("beside", commits, drain_s)):
                    js, missing = to_jetstream(sent, stored)
                    out[phase] = (js, latencies(owner, phase), missing, drain)
                # the quiet events committed while the backlog drained: what it delays
                js, missing = to_jetstream(commits, stored, since=committed, until=ended)
                out["during"] = (js, latencies(owner, "beside", since=committed, until=ended), missing, drain_s)
                # and those committed while its transaction was open, before
                # (the writers' first second: every claim then walks the
                # import's uncommitted rows; docs/benchmarks.md)
                first = min(commits.values())
                js, missing = to_jetstream(commits, stored, since=first, until=committed)
                # (created_at is the emit's transaction start, before its commit)
                out["open"] = (js, latencies(owner, "beside", since=first - 1.0, until=committed), missing, None)
                return out
        finally:
            pipe.stop()


def latency(codes: list[str], seconds: float, backlog: int, rounds: int = 1) -> None:
    start = cpu_ticks()
    print(
        f"fair claims: {QUIET} tenants at {RATE} events/s each for {seconds:.0f} s, alone and"
        f" while another tenant's backlog of {backlog} lands 1 s into the phase; relay on its defaults; {load()}"
    )
    print(
        f"{'':>17} {'emit -> JetStream, ms':>30} {'emit -> mark, ms':>30}\n"
        f"{'code':>9} {'phase':>7} {'events':>7} {'p50':>7} {'p99':>7} {'max':>7}"
        f" {'events':>7} {'p50':>7} {'p99':>7} {'max':>7} {'missing':>7} {'backlog drained':>16}"
    )
    # rounds interleave the codes, so that each meets the same moments of a shared machine
    results = [
        (code if rounds == 1 else f"{code}#{r + 1}", run_code(code, seconds, backlog))
        for r in range(rounds)
        for code in codes
    ]
    for code, phases in results:
        for phase, (js, marks, missing, drain_s) in phases.items():
            print(
                f"{code:>9} {phase:>7} {len(js):7d} {statistics.median(js):7.1f} {pct(js, 0.99):7.1f} {js[-1]:7.1f}"
                f" {len(marks):7d} {statistics.median(marks):7.1f} {pct(marks, 0.99):7.1f} {marks[-1]:7.1f}"
                f" {missing:7d} {'' if drain_s is None else f'{drain_s:.1f} s':>16}"
            )
        for i, what in ((0, "emit -> JetStream"), (1, "emit -> mark")):
            alone = pct(phases["alone"][i], 0.99)
            ratios = [
                f"{name} / alone {pct(phases[name][i], 0.99) / alone:.2f}x"
                for name in ("beside", "during", "open")
                if name in phases
            ]
            print(f"{code:>9} {what}: p99 " + ", ".join(ratios))
    print(f"done: {load()}; {steal_since(start)}")


def plan(rows: int, tenants: int) -> None:
    with tempfile.TemporaryDirectory(prefix="pgoutbox-fair-plan-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        pg = EmbeddedPostgres(root / "pg", settings={"max_wal_size": "4GB"})
        pg.start()
        try:
            with psycopg.connect(pg.url, autocommit=True) as owner:
                migrate.migrate(owner)
                owner.execute("SELECT outbox.create_partitions()")
                owner.execute("CREATE ROLE bench_relay LOGIN IN ROLE pgoutbox_relay")
                started = time.monotonic()
                for start in range(0, rows, 100_000):
                    # the owner's INSERT: the policy trigger keys each row as emit's would
                    owner.execute(
                        "INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload,"
                        " tenant_id) SELECT 'orders', 'order', g::text, 'created', '{\"schema_version\": 1}',"
                        " 't' || (g %% %s)::text FROM generate_series(%s, %s) AS g",
                        (tenants, start, min(rows, start + 100_000) - 1),
                    )
                owner.execute("VACUUM ANALYZE outbox.events")
                print(f"{rows} due events over {tenants} tenants, written in {time.monotonic() - started:.0f} s")
                # auto_explain in the relay's sessions: settings only a superuser may make
                for setting in (
                    "session_preload_libraries = 'auto_explain'",
                    "auto_explain.log_min_duration = 0",
                    "auto_explain.log_analyze = on",
                    "auto_explain.log_buffers = on",
                    "auto_explain.log_nested_statements = on",
                    "client_min_messages = log",
                ):
                    owner.execute(f"ALTER ROLE bench_relay SET {setting}")
            with psycopg.connect(pg.url.replace("postgres@", "bench_relay@"), autocommit=True) as relay:
                notes: list[str] = []
                relay.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
                for label, before in (("first claim", 0), ("claim after 20 more", 20)):
                    for _ in range(before):  # claimed and marked, as a relay's batches are
                        batch = relay.execute(
                            "SELECT claim_token, event_id FROM outbox.claim('bench', %s, '5 minutes')", (DEFAULT_BATCH,)
                        ).fetchall()
                        relay.execute(
                            "SELECT outbox.mark_published(%s::uuid, %s::uuid[])", (batch[0][0], [r[1] for r in batch])
                        )
                    notes.clear()
                    started = time.perf_counter()
                    got = relay.execute(
                        "SELECT coalesce(tenant_id, '-') FROM outbox.claim('bench', %s, '5 minutes')", (DEFAULT_BATCH,)
                    ).fetchall()
                    took = time.perf_counter() - started
                    print(f"\n{label}: {len(got)} events of {len({t for (t,) in got})} tenants in {1000 * took:.1f} ms")
                    for note in notes:
                        if "candidates AS" in note or "Query Text: WITH RECURSIVE" in note:
                            print(note)
        finally:
            pg.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", default=".", help="comma-separated commits ('.' = this checkout)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--backlog", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=1, help="latency: runs of each code, interleaved")
    ap.add_argument("--plan", action="store_true")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--tenants", type=int, default=1000)
    args = ap.parse_args()
    if args.seconds < 2 or min(args.backlog, args.rounds, args.rows, args.tenants) < 1:
        ap.error("--seconds must be at least 2; --backlog, --rounds, --rows and --tenants at least 1")
    if args.plan:
        plan(args.rows, args.tenants)
    else:
        latency(args.code.split(","), args.seconds, args.backlog, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
