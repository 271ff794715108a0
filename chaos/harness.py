"""Chaos harness: the whole pipeline under load while faults are injected,
then a ledger check. Seeded, bounded in time and count, loopback only.

    emit (writers, some rolled back) -> outbox -> 2 relays -> JetStream
        -> 2 consumers -> HTTP ledger app (side effect + inbox marker, one txn)

Two topologies: "single" (one nats-server) and "cluster" (three clustered
nats-server nodes on loopback, relays and consumers given every node's URL,
streams at replicas 3). Faults, at moments drawn from the seed, one at a
time, from the kinds registered in chaos/faults.py for the topology: kill -9
of a relay or a consumer (restarted), a PostgreSQL restart, SIGSTOP of a
relay for longer than its lease (then SIGCONT); a NATS restart (single); kill
-9 of the stream leader or of another node, a rolling restart of all three
nodes, a network partition of one node (pipeline). When the load stops the
harness waits for quiescence and checks that every committed emit is
COMPLETED and in the stream exactly once, that no rolled-back emit appears
anywhere, that every event has exactly one side effect (none for poison),
that nothing is left PROCESSING, due or unacked, that the DLQ holds exactly
the injected poison events, and that events of one ordering key reached the
stream in emit order. It prints the figures and exits 1 on any violation.

A share of the emits (hostile_share, --poison-share) is hostile input drawn
from the poison pipeline test's strategies (chaos/poison_writer.py): each
must be refused with a code and leave nothing behind, or be accepted and end
COMPLETED or DEAD_LETTER with a code, never lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import psycopg

from pgoutbox.core import migrate
from pgoutbox.dev import nats_cluster
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres
from pgoutbox.dev.nats_cluster import NatsCluster

from . import faults as fault_registry
from . import poison_writer
from .ledger_app import SCHEMA, LedgerApp

CONTEXT = "chaos"
HANDLER = "ledger"
STREAM = "CHAOS_EVENTS"
SUBJECT = f"{CONTEXT}.event.ledger_entry.v1"
LEASE_SECONDS = 3.0


@dataclass(frozen=True)
class Profile:
    seconds: float  # how long writers emit
    rate: float  # committed + rolled-back emits per second, all writers together
    writers: int
    faults: int  # at least one of each kind
    rollback_fraction: float = 0.1
    poison_fraction: float = 0.005  # events the ledger app answers with 422
    hostile_share: float = 0.01  # emits drawn from tests/poison.py (the poison writer)
    keys: int = 50  # ordering keys used by half of the events
    quiesce_timeout: float = 180.0
    topology: str = "single"  # or "cluster"
    kinds: tuple[str, ...] | None = None  # fault kinds drawn from; None: all of the topology


PROFILES = {
    "short": Profile(seconds=40, rate=75, writers=3, faults=6),
    "long": Profile(seconds=1200, rate=100, writers=4, faults=60, quiesce_timeout=600),
    "cluster-short": Profile(seconds=45, rate=60, writers=3, faults=8, topology="cluster"),
    # >= 100,000 committed events and >= 50 faults in about 20 minutes here.
    "cluster": Profile(seconds=1080, rate=108, writers=4, faults=56, topology="cluster", quiesce_timeout=600),
}


@dataclass
class Ledger:
    committed: dict[uuid.UUID, float] = field(default_factory=dict)  # event id -> commit time
    rolled_back: set[uuid.UUID] = field(default_factory=set)
    uncertain: set[uuid.UUID] = field(default_factory=set)  # connection lost during COMMIT
    poison: set[uuid.UUID] = field(default_factory=set)
    keyed: dict[uuid.UUID, str] = field(default_factory=dict)
    writer_errors: int = 0
    hostile: poison_writer.HostileLedger = field(default_factory=poison_writer.HostileLedger)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipeline:
    """The processes under test, started and stopped by PID."""

    stream = STREAM
    lease_seconds = LEASE_SECONDS

    def __init__(self, root: Path, seed: int, topology: str = "single", kinds: list | None = None):
        self.root = root
        self.topology = topology
        self.pg = EmbeddedPostgres(root / "postgres")
        self.nats: Any = NatsCluster(root / "nats") if topology == "cluster" else EmbeddedNats(root / "nats")
        self.database_url = ""  # set at start; a fault's prepare() may replace it
        self.extras: dict[str, Any] = {}  # state of the fault kinds' prepare()
        self.kinds = kinds or []
        self.relays: list[subprocess.Popen | None] = [None, None]
        self.consumers: list[subprocess.Popen | None] = [None, None]
        self.app: LedgerApp | None = None
        self.seed = seed
        self.logs = root / "logs"

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
        env.update(
            {
                "OUTBOX_DATABASE_URL": self.database_url,
                "OUTBOX_NATS_URL": self.nats.url,
                "OUTBOX_LOG_LEVEL": "WARNING",
            }
        )
        env.update(extra)
        return env

    def _spawn(self, command: str, name: str, extra: dict[str, str]) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        return subprocess.Popen(
            [sys.executable, "-m", "pgoutbox.cli.main", command],
            env=self.env(extra),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def start_relay(self, i: int) -> None:
        self.relays[i] = self._spawn(
            "relay",
            f"relay-{i}",
            {
                "OUTBOX_RELAY_NAME": f"relay-{i}",
                "OUTBOX_STREAMS_FILE": str(self.root / "streams.toml"),
                "OUTBOX_RELAY_LEASE": f"{LEASE_SECONDS}s",
                "OUTBOX_RELAY_PUBLISH_TIMEOUT": "2s",
                "OUTBOX_RELAY_POLL_INTERVAL": "500ms",
                "OUTBOX_RELAY_BATCH_SIZE": "100",
                "OUTBOX_RELAY_RETRY_BASE": "200ms",
                "OUTBOX_RELAY_RETRY_CAP": "2s",
                "OUTBOX_RELAY_MAX_ATTEMPTS": "100000",  # outages must not dead-letter events
                "OUTBOX_RELAY_HTTP_PORT": "0",  # any free port: two relays share this host
            },
        )

    def start_consumer(self, i: int) -> None:
        self.consumers[i] = self._spawn(
            "consume",
            f"consumer-{i}",
            {
                "OUTBOX_REGISTRY_FILE": str(self.root / "handlers.registry.json"),
                "OUTBOX_CONSUMER_HTTP_PORT": "0",
                "OUTBOX_REPLAY_WORKER": f"consumer-{i}",
                "OUTBOX_CONSUMER_RETRY_DELAY": "200ms",
                "OUTBOX_CONSUMER_RETRY_MAX_DELAY": "2s",
                "OUTBOX_CONSUMER_FETCH_TIMEOUT": "500ms",
            },
        )

    def start(self, app_url_holder: list[str]) -> None:
        self.pg.start()
        self.nats.start()
        self.database_url = self.pg.url
        with psycopg.connect(self.pg.url, autocommit=True) as conn:
            migrate.migrate(conn)
            conn.execute(SCHEMA)
        for kind in self.kinds:
            if kind.prepare:
                kind.prepare(self)
        self.app = LedgerApp(self.database_url)
        self.app.start()
        app_url_holder.append(self.app.url)
        streams = (
            f"[defaults]\nreplicas = {self.nats.size if self.topology == 'cluster' else 1}\n"
            'duplicate_window = "2m"\nmax_age = "1d"\n'
            f'[streams.{CONTEXT}]\nname = "{STREAM}"\n'
        )
        if self.topology == "cluster":  # else the consumer creates it, with one replica
            streams += f'[streams.{CONTEXT}_dlq]\nname = "{CONTEXT.upper()}_DLQ"\nsubjects = ["{CONTEXT}.dlq.>"]\n'
        (self.root / "streams.toml").write_text(streams)
        manifests = self.root / "handlers"
        manifests.mkdir(exist_ok=True)
        (manifests / "ledger.toml").write_text(
            f'[[handler]]\nname = "{HANDLER}"\nurl = "{self.app.url}"\n'
            f'subjects = ["{SUBJECT}"]\n'
            'timeout = "2s"\nack_wait = "5s"\nmax_deliver = 1000\nmax_ack_pending = 256\n'
            "concurrency = 16\nreplay_max_attempts = 0\n"
        )
        env = self.env({})
        for argv in (
            ["streams", "--streams-file", str(self.root / "streams.toml")],
            [
                "registry",
                "generate",
                "--manifest-dir",
                str(manifests),
                "--registry-file",
                str(self.root / "handlers.registry.json"),
            ],
        ):
            subprocess.run([sys.executable, "-m", "pgoutbox.cli.main", *argv], env=env, check=True, capture_output=True)
        for i in range(2):
            self.start_relay(i)
            self.start_consumer(i)

    def stop(self) -> None:
        for p in [*self.relays, *self.consumers]:
            if p and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in [*self.relays, *self.consumers]:
            if p:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.app:
            self.app.stop()
        for kind in self.kinds:
            if kind.stop:
                try:
                    kind.stop(self)
                except Exception as exc:
                    print(f"fault {kind.name}: stop failed: {exc!r}")
        self.nats.stop()
        self.pg.stop()

    def crashed(self) -> list[str]:
        """Workers that exited on their own (not killed by us)."""
        out = []
        for kind, procs in (("relay", self.relays), ("consumer", self.consumers)):
            for i, p in enumerate(procs):
                if p and p.poll() is not None:
                    out.append(f"{kind}-{i} exited with {p.returncode}")
        return out


def write_load(
    pipeline: Pipeline,
    profile: Profile,
    rng_seed: int,
    ledger: Ledger,
    stop: threading.Event,
    hostile: list | None = None,
) -> None:
    """One writer thread: business transactions at a steady pace, a share
    of them hostile (drawn from `hostile`)."""
    rng = random.Random(rng_seed)
    interval = profile.writers / profile.rate
    conn: psycopg.Connection | None = None
    next_at = time.monotonic()
    while not stop.is_set():
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
        if hostile and rng.random() < profile.hostile_share:
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(pipeline.database_url, connect_timeout=3)
                conn = poison_writer.emit(conn, hostile[rng.randrange(len(hostile))], ledger.hostile)
            except psycopg.Error:
                conn = None
            if conn is None:
                with ledger.lock:
                    ledger.writer_errors += 1
            continue
        roll_back = rng.random() < profile.rollback_fraction
        poison = not roll_back and rng.random() < profile.poison_fraction
        key = f"k{rng.randrange(profile.keys)}" if rng.random() < 0.5 else None
        event_id = None
        try:
            if conn is None or conn.closed:
                conn = psycopg.connect(pipeline.database_url, connect_timeout=3)
            event_id = conn.execute(
                "SELECT outbox.emit('account', %s, 'ledger_entry', %s::jsonb, context => %s, ordering_key => %s)",
                (str(rng.randrange(10_000)), json.dumps({"schema_version": 1, "poison": poison}), CONTEXT, key),
            ).fetchone()[0]
        except psycopg.Error:
            with ledger.lock:
                ledger.writer_errors += 1
            conn = None  # not committed: the server rolls it back
            continue
        if roll_back:
            try:
                conn.rollback()
            except psycopg.Error:
                conn = None  # lost with its connection: rolled back all the same
            with ledger.lock:
                ledger.rolled_back.add(event_id)
            continue
        try:
            conn.commit()
        except psycopg.Error:
            with ledger.lock:
                ledger.uncertain.add(event_id)
                ledger.writer_errors += 1
            conn = None
            continue
        with ledger.lock:
            ledger.committed[event_id] = time.time()
            if poison:
                ledger.poison.add(event_id)
            if key:
                ledger.keyed[event_id] = key


@dataclass(frozen=True)
class Injected:
    kind: str
    started: float  # wall clock (time.time()), comparable with commit times
    ended: float
    detail: str


def inject_faults(
    pipeline: Pipeline,
    profile: Profile,
    rng: random.Random,
    stop: threading.Event,
    done: list[Injected],
    log: list[str],
) -> None:
    """Every kind at least once, the rest drawn at random; one at a time, each
    with its recovery, at moments drawn from the seed."""
    names = [k.name for k in pipeline.kinds]
    kinds = names + [rng.choice(names) for _ in range(max(0, profile.faults - len(names)))]
    rng.shuffle(kinds)
    span = profile.seconds - 8
    moments = sorted(4 + rng.random() * span for _ in kinds)
    t0 = time.monotonic()
    for at, kind in zip(moments, kinds):
        while time.monotonic() - t0 < at:
            if stop.wait(0.1):
                return
        started, wall = time.monotonic(), time.time()
        try:
            detail = fault_registry.REGISTRY[kind].inject(pipeline, rng)
        except Exception as exc:  # the fault itself failed: the run says so and goes on
            detail = f"FAULT FAILED: {exc!r}"
        done.append(Injected(kind, wall, time.time(), detail))
        log.append(f"{started - t0:6.1f}s {kind} {detail} ({time.monotonic() - started:.1f}s)")


async def read_stream(nats_url: str, stream: str, parallel: int = 64) -> list[tuple[int, str, bytes, dict]]:
    """Every message of a stream: (sequence, subject, data, headers)."""
    nc = await nats_cluster.connect(nats_url)
    try:
        js = nc.jetstream(timeout=10)
        try:
            info = await js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            return []
        if info.state.messages == 0:
            return []

        async def get(seq: int):
            try:
                msg = await js.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                return None
            return (msg.seq, msg.subject, msg.data or b"", dict(msg.headers or {}))

        out = []
        seqs = range(info.state.first_seq, info.state.last_seq + 1)
        for i in range(0, len(seqs), parallel):
            out += [m for m in await asyncio.gather(*map(get, seqs[i : i + parallel])) if m]
        return out
    finally:
        await nc.close()


async def consumer_state(nats_url: str) -> tuple[int, int, int]:
    """(num_pending, num_ack_pending, unacked) of the handler's durable;
    unacked: the stream sequences past its ack floor up to the last message
    of its subject as the stream leader has it (a consumer led by a replica
    that is behind reports nothing pending while it is)."""
    nc = await nats_cluster.connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.consumer_info(STREAM, HANDLER)
        try:
            last = (await js.get_last_msg(STREAM, SUBJECT)).seq or 0
        except nats.js.errors.NotFoundError:
            last = 0
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        return info.num_pending or 0, info.num_ack_pending or 0, max(0, last - (floor or 0))
    finally:
        await nc.close()


def wait_for_quiescence(
    pipeline: Pipeline, ledger: Ledger, timeout: float, stuck_after: float = 30.0
) -> tuple[bool, str]:
    """Waits until nothing is unpublished, unprocessed or unacked; gives up
    at the timeout, or once the state has not changed for stuck_after
    seconds (longer than every redelivery and retry delay configured here)."""
    deadline = time.monotonic() + timeout
    state, since = "not checked", time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < stuck_after:
        try:
            with psycopg.connect(pipeline.database_url, autocommit=True) as c:
                outbox = c.execute(
                    "SELECT coalesce(sum(unpublished), 0), coalesce(sum(dead_letter), 0) FROM outbox.backlog()"
                ).fetchone()
                inbox = c.execute("SELECT coalesce(sum(unprocessed), 0) FROM inbox.backlog()").fetchone()[0]
            pending, ack_pending, unacked = asyncio.run(consumer_state(pipeline.nats.url))
            new_state = (
                f"outbox unpublished={outbox[0]} dead={outbox[1]}, inbox unprocessed={inbox}, "
                f"jetstream pending={pending} ack_pending={ack_pending} past_ack_floor={unacked}"
            )
            if new_state != state:
                state, since = new_state, time.monotonic()
            if outbox[0] == 0 and inbox == 0 and pending == 0 and ack_pending == 0 and unacked == 0:
                return True, state
        except Exception as exc:
            state, since = f"unreachable: {exc!r}", time.monotonic()
        time.sleep(1)
    return False, state


def check(pipeline: Pipeline, ledger: Ledger, injected: list[Injected]) -> tuple[dict, list[str]]:
    problems: list[str] = []
    with psycopg.connect(pipeline.database_url, autocommit=True) as c:
        rows = c.execute("SELECT event_id, status FROM outbox.events").fetchall()
        effects = c.execute(
            "SELECT event_id, count(*), max(handled_at) FROM chaos.side_effects GROUP BY event_id"
        ).fetchall()
        dead_inbox = {
            r[0]
            for r in c.execute(
                "SELECT message_id FROM inbox.messages WHERE handler = %s AND status = 'DEAD_LETTER'", (HANDLER,)
            )
        }
    status = dict(rows)
    # An emit whose COMMIT lost its connection committed iff its row exists.
    committed = dict(ledger.committed)
    for event_id in ledger.uncertain:
        if event_id in status:
            committed[event_id] = float("nan")
    expected_effects = set(committed) - ledger.poison
    hostile_ids = set(ledger.hostile.accepted) | set(ledger.hostile.uncertain)

    not_completed = [e for e in committed if status.get(e) != "COMPLETED"]
    ghosts = [e for e in ledger.rolled_back if e in status]
    stream = asyncio.run(read_stream(pipeline.nats.url, STREAM))
    copies = Counter(h.get("Nats-Msg-Id") for _, _, _, h in stream)
    missing = [e for e in committed if copies[str(e)] == 0]
    doubled = [e for e in committed if copies[str(e)] > 1]
    ghost_msgs = [e for e in ledger.rolled_back if copies[str(e)]]
    effect_count = {r[0]: r[1] for r in effects}
    no_effect = [e for e in expected_effects if effect_count.get(e, 0) == 0]
    dup_effects = [e for e, n in effect_count.items() if n > 1]
    wrong_effects = [e for e in effect_count if e not in expected_effects and e not in hostile_ids]
    dlq = asyncio.run(read_stream(pipeline.nats.url, f"{CONTEXT.upper()}_DLQ"))
    dlq_ids = Counter()
    unreadable = 0
    for _, subject, data, _ in dlq:
        if ".dlq.dead." in subject:
            message_id = json.loads(data).get("message_id")
            if message_id is None:
                unreadable += 1  # an emitted event the consumer could not read
            elif uuid.UUID(message_id) not in hostile_ids:
                dlq_ids[uuid.UUID(message_id)] += 1
    if unreadable:
        problems.append(f"{unreadable} .invalid DLQ notices: the consumer could not read emitted events")
    poison = {e for e in ledger.poison if e in committed}
    if set(dlq_ids) != poison:
        problems.append(f"DLQ holds {sorted(map(str, set(dlq_ids) ^ poison))[:5]}... unlike the injected poison")
    if any(n > 1 for n in dlq_ids.values()):
        problems.append("a poison event has several DLQ notices")
    if dead_inbox - hostile_ids != poison:
        problems.append(f"inbox DEAD_LETTER rows {len(dead_inbox - hostile_ids)} != poison events {len(poison)}")
    with psycopg.connect(pipeline.database_url, autocommit=True) as c:
        hostile_figures, hostile_problems = poison_writer.check(
            c, ledger.hostile, copies, effect_count, dead_inbox, SUBJECT
        )
    problems += hostile_problems

    # Per-key order: within a key, stream order must be emit order (outbox id).
    with psycopg.connect(pipeline.database_url, autocommit=True) as c:
        emit_order = {
            r[0]: r[1] for r in c.execute("SELECT event_id, id FROM outbox.events WHERE ordering_key IS NOT NULL")
        }
    first_seq: dict[str, int] = {}
    for seq, _, _, h in stream:
        first_seq.setdefault(h.get("Nats-Msg-Id"), seq)
    by_key: dict[str, list[uuid.UUID]] = defaultdict(list)
    for e, key in ledger.keyed.items():
        if str(e) in first_seq:
            by_key[key].append(e)
    out_of_order = 0
    for events in by_key.values():
        ordered = sorted(events, key=lambda e: emit_order[e])
        seqs = [first_seq[str(e)] for e in ordered]
        out_of_order += sum(1 for a, b in zip(seqs, seqs[1:]) if b < a)

    for name, items in (
        ("committed but not COMPLETED", not_completed),
        ("rolled back but stored", ghosts),
        ("committed but not in the stream", missing),
        ("in the stream twice", doubled),
        ("rolled back but in the stream", ghost_msgs),
        ("without its side effect", no_effect),
        ("with duplicated side effects", dup_effects),
        ("with an unexpected side effect", wrong_effects),
    ):
        if items:
            problems.append(f"{len(items)} events {name}: {', '.join(map(str, items[:3]))}")
    if out_of_order:
        problems.append(f"{out_of_order} per-key order inversions in the stream")

    latency = {
        r[0]: r[2].timestamp() - committed[r[0]]
        for r in effects
        if r[0] in committed and committed[r[0]] == committed[r[0]]  # not NaN
    }
    latencies = sorted(latency.values())
    figures = {
        "committed": len(committed),
        "rolled_back": len(ledger.rolled_back),
        "uncertain_commits": len(ledger.uncertain),
        "poison": len(poison),
        "stream_messages": len(stream),
        "side_effects": sum(effect_count.values()),
        "lost": len(missing) + len(no_effect),
        "duplicated_side_effects": len(dup_effects),
        "stuck": len(not_completed),
        "order_inversions": out_of_order,
        **{f"e2e_{k}_ms": v for k, v in percentiles(latencies).items()},
        **hostile_figures,
        "by_fault_kind": by_fault_kind(injected, committed, latency),
    }
    return figures, problems


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and max of sorted seconds, in milliseconds."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    at = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    out: dict[str, float | None] = {k: round(1000 * values[int(len(values) * q)], 1) for k, q in at.items()}
    out["max"] = round(1000 * values[-1], 1)
    return out


def by_fault_kind(injected: list[Injected], committed: dict[uuid.UUID, float], latency: dict) -> dict[str, dict]:
    """Per fault kind: how many, how long each took (injection and recovery),
    and the end-to-end latency of the events committed while one was under way."""
    starts = sorted((f.started, f.ended, f.kind) for f in injected)
    during: dict[str, list[float]] = defaultdict(list)
    for event_id, at in committed.items():
        if event_id not in latency:
            continue
        for started, ended, kind in starts:
            if started > at:
                break
            if at <= ended:
                during[kind].append(latency[event_id])
                break
    out = {}
    for kind in sorted({f.kind for f in injected}):
        seconds = sorted(f.ended - f.started for f in injected if f.kind == kind)
        out[kind] = {
            "count": len(seconds),
            "seconds_p50": round(seconds[len(seconds) // 2], 1),
            "seconds_max": round(seconds[-1], 1),
            "events_during": len(during[kind]),
            **{f"e2e_{k}_ms": v for k, v in percentiles(sorted(during[kind])).items()},
        }
    return out


def run(profile: Profile, seed: int, root: Path | None = None, keep: bool = False) -> int:
    root = root or Path(tempfile.mkdtemp(prefix="pgoutbox-chaos-"))
    root.chmod(0o755)  # PostgreSQL runs as the postgres user below it
    rng = random.Random(seed)
    kinds = fault_registry.kinds_for(profile.topology, profile.kinds)
    print(f"fault kinds: {', '.join(k.name for k in kinds)}", flush=True)
    pipeline = Pipeline(root, seed, profile.topology, kinds)
    ledger = Ledger()
    stop_writers, stop_faults = threading.Event(), threading.Event()
    injected: list[Injected] = []
    fault_log: list[str] = []
    t_start = time.monotonic()
    try:
        hostile = None
        if profile.hostile_share > 0:
            expected = profile.seconds * profile.rate * profile.hostile_share
            hostile = poison_writer.draw_cases(seed, min(400, int(2 * expected) + 20), CONTEXT, "ledger_entry")
            print(f"poison writer: {len(hostile)} hostile cases drawn, share {profile.hostile_share}", flush=True)
        pipeline.start([])
        writers = [
            threading.Thread(
                target=write_load, args=(pipeline, profile, rng.getrandbits(32), ledger, stop_writers, hostile)
            )
            for _ in range(profile.writers)
        ]
        injector = threading.Thread(
            target=inject_faults,
            args=(pipeline, profile, random.Random(rng.getrandbits(32)), stop_faults, injected, fault_log),
        )
        for t in (*writers, injector):
            t.start()
        time.sleep(profile.seconds)
        stop_writers.set()
        for t in writers:
            t.join()
        injector.join()  # lets a fault in progress finish (restarts included)
        quiet, state = wait_for_quiescence(pipeline, ledger, profile.quiesce_timeout)
        figures, problems = check(pipeline, ledger, injected)
        if not quiet:
            problems.append(f"no quiescence: {state}")
        problems += [f"worker died on its own: {c}" for c in pipeline.crashed()]
        figures.update(
            {
                "topology": profile.topology,
                "faults": dict(Counter(f.kind for f in injected)),
                "faults_total": len(injected),
                "writer_errors": ledger.writer_errors,
                "seed": seed,
                "seconds": round(time.monotonic() - t_start, 1),
            }
        )
        print("fault log:\n  " + "\n  ".join(fault_log))
        print("figures: " + json.dumps(figures, sort_keys=True))
        missing_kinds = [k.name for k in kinds if k.name not in figures["faults"]]
        if missing_kinds:
            problems.append(f"fault kinds never injected: {missing_kinds}")
        problems += [f"fault {f.kind} at {f.started:.0f}: {f.detail}" for f in injected if "FAILED" in f.detail]
        problems += [f"fault {f.kind}: {f.detail}" for f in injected if "NOT healthy" in f.detail]
        if problems:
            print("VIOLATIONS:\n  " + "\n  ".join(problems))
            print(f"logs kept in {root}")
            keep = True
            return 1
        print("ledger OK: nothing lost, nothing processed twice, nothing stuck")
        return 0
    finally:
        stop_writers.set()
        stop_faults.set()
        pipeline.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
