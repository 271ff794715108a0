"""Chaos harness: the whole pipeline under load while faults are injected,
then a ledger check. Seeded, bounded in time and count, loopback only.

    emit (writers, some rolled back) -> outbox -> 2 relays -> JetStream
        -> 2 consumers -> HTTP ledger app (side effect + inbox marker, one txn)

Every worker runs on the settings a user gets. The relays are given only
their streams file and an HTTP port (two share this host); the consumers
(the replayer runs inside them) only the registry file and an HTTP port;
all of them only the database and NATS addresses and a log level besides.
The handler's manifest is the README's (MANIFEST) plus the payload version
it is written for: max_deliver 5, dead letters replayed automatically
(3 times, the first after 30-60 s), redeliveries 1 s doubling to 1 min,
ack_wait 30 s; the relays: a 30 s lease, 10 publish attempts, 1 s doubling
to 60 s. The ledger's expectations and waits follow from what the
workers make of those defaults (Pipeline.handler, Pipeline.relay), not from
numbers written here. Each worker connects as a login that holds only the
pgoutbox role docs/reference.md gives it (Pipeline.logins).

Two topologies: "single" (one nats-server) and "cluster" (three clustered
nats-server nodes on loopback, relays and consumers given every node's URL,
streams at replicas 3). Faults, at moments drawn from the seed, one at a
time, from the kinds registered in chaos/faults.py for the topology: kill -9
of a relay or a consumer (restarted), kill -9 of every consumer at once, a
PostgreSQL restart, a PostgreSQL outage longer than every redelivery
max_deliver allows (with well-formed messages published straight to the
stream as it starts), a PostgreSQL outage of a minute or more, SIGSTOP of a
relay for longer than its lease (then SIGCONT), a burst of hostile foreign
messages (chaos/foreign.py), the handler down (its HTTP server closed),
events of an older payload version whose upcaster raises for some of them;
a NATS restart, and JetStream away with the NATS connection up (single);
kill -9 of the stream leader or of another node, a rolling restart of all
three nodes, a network partition of one node, two of three nodes stopped
(quorum lost), a PostgreSQL failover (cluster). The long faults (JetStream
away, the handler down, the long PostgreSQL outage) last what the profile
says: minutes in the long profiles, tens of seconds in the short ones.

When the faults are done the load stops and the harness waits for the run
to settle (nothing unpublished, unprocessed, unacked or being replayed, every
dead letter replayed once and every one the handler did not ask for replayed
until it stops; or nothing left that could move) and checks, for every
committed emit: COMPLETED and in the stream exactly once; then PROCESSED with
exactly one side effect, or, for a poison event (the app answers 422) or one
whose upcaster raises, DEAD_LETTER with 1 to 1 + replay_max_attempts DLQ
notices and no side effect. It reports an event with no outcome anywhere as
lost, one with two side effects as duplicated, one left RECEIVED/FAILED (or
DEAD_LETTER without its notice, or unpublished) as stuck, and every dead
letter, in the outbox or the inbox, that neither the handler's own answer
(422) nor an upcaster caused (dead_letters_not_own: a broker or database
outage, the handler unreachable, the relay giving up). Also: no rolled-back
emit anywhere, nothing PROCESSING or due in the outbox, no replay overdue,
events of one ordering key in the stream in emit order. Every foreign message
that reached the stream ends as a `.invalid` notice naming its sequence,
PROCESSED, or DEAD_LETTER with a notice (the well-formed ones PROCESSED with
one side effect). It prints the figures and exits 1 on any violation.

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
import psycopg.sql

from harness import nats_cluster
from harness.nats_cluster import NatsCluster
from pgoutbox.core import migrate
from pgoutbox.core import settings as core_settings
from pgoutbox.core.backoff import Backoff
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres
from pgoutbox.inbox import registry
from pgoutbox.inbox import settings as consumer_settings
from pgoutbox.outbox import away
from pgoutbox.outbox import settings as relay_settings

from . import faults as fault_registry
from . import foreign, poison_writer
from .ledger_app import LOGIN_GRANTS, SCHEMA, LedgerApp

CONTEXT = "chaos"
HANDLER = "ledger"
STREAM = "CHAOS_EVENTS"
DLQ_STREAM = f"{CONTEXT.upper()}_DLQ"
EVENT_TYPE = "ledger_entry"
VERSION = 2  # what the writers emit and the handler is written for
SUBJECT = f"{CONTEXT}.event.{EVENT_TYPE}.v{VERSION}"
OLD_SUBJECT = f"{CONTEXT}.event.{EVENT_TYPE}.v{VERSION - 1}"  # upcast to VERSION (faults.upcaster_raises)
SUBJECTS = (OLD_SUBJECT, SUBJECT)
DUPLICATE_WINDOW = 120.0  # the streams' duplicate_window: longer than the relay's lease (checked at start)
# The handler's manifest: the README's, every value it leaves out the
# consumer's default (max_deliver 5 here, automated replay on, the default
# retry delays, ack_wait and concurrency), plus the payload version it is
# written for (older payloads reach it upcast). Pipeline.handler is what the
# consumer makes of it; the ledger's expectations follow from that.
MANIFEST = """[[handler]]
name = "{name}"
url = "{url}"
subjects = [{subjects}]
version = {version}
timeout = "10s"
max_deliver = 5
"""


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
    quiesce_timeout: float = 300.0
    topology: str = "single"  # or "cluster"
    kinds: tuple[str, ...] | None = None  # fault kinds drawn from; None: all of the topology
    # How long the long faults last (faults.LONG): JetStream away or without
    # quorum, the handler down; and the long PostgreSQL outage (None: as long
    # as postgres_outage, Pipeline.outage_seconds). Each long kind runs
    # long_repeats times, the other kinds fill up `faults`.
    away_seconds: tuple[float, float] = (25.0, 35.0)
    pg_away_seconds: tuple[float, float] | None = None
    long_repeats: int = 1


PROFILES = {
    # The suite's: every kind once, the long faults tens of seconds (the
    # mechanisms are those of the long runs: the relay paused by JetStream
    # away, the consumer's database gate, the handler's failures and the
    # automated replay; only the minutes differ). About five minutes here.
    "short": Profile(seconds=150, rate=60, writers=3, faults=12),
    # >= 100,000 committed events and >= 50 faults of every single-node kind
    # in about 35 minutes: JetStream away and the handler down 5 minutes
    # each, PostgreSQL away 60-90 s twice, the rest short faults; the writers
    # go on until the last fault has recovered.
    "long": Profile(
        seconds=1000,
        rate=140,
        writers=4,
        faults=54,
        quiesce_timeout=900,
        away_seconds=(300.0, 330.0),
        pg_away_seconds=(60.0, 90.0),
        long_repeats=1,
    ),
    "cluster-short": Profile(seconds=150, rate=60, writers=3, faults=16, topology="cluster"),
    # As "long", on three nodes: two of them stopped for 5 minutes (quorum
    # lost) instead of JetStream restarted without its store.
    "cluster": Profile(
        seconds=1000,
        rate=140,
        writers=4,
        faults=54,
        topology="cluster",
        quiesce_timeout=900,
        away_seconds=(300.0, 330.0),
        pg_away_seconds=(60.0, 90.0),
        long_repeats=1,
    ),
}


@dataclass
class Ledger:
    committed: dict[uuid.UUID, float] = field(default_factory=dict)  # event id -> commit time
    rolled_back: set[uuid.UUID] = field(default_factory=set)
    uncertain: set[uuid.UUID] = field(default_factory=set)  # connection lost during COMMIT
    poison: set[uuid.UUID] = field(default_factory=set)
    upcast_fail: set[uuid.UUID] = field(default_factory=set)  # older version, its upcaster raises
    upcast_ok: set[uuid.UUID] = field(default_factory=set)  # older version, upcast
    keyed: dict[uuid.UUID, str] = field(default_factory=dict)
    writer_errors: int = 0
    hostile: poison_writer.HostileLedger = field(default_factory=poison_writer.HostileLedger)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipeline:
    """The processes under test, started and stopped by PID."""

    stream = STREAM
    subject = SUBJECT
    event_type = EVENT_TYPE
    version = VERSION

    def __init__(
        self,
        root: Path,
        seed: int,
        topology: str = "single",
        kinds: list | None = None,
        profile: Profile | None = None,
    ):
        self.root = root
        self.topology = topology
        self.profile = profile or PROFILES["cluster-short" if topology == "cluster" else "short"]
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
        self.foreign = foreign.ForeignLedger()  # messages published straight to the stream
        # What the consumers run the handler with (set at start, from the registry and their environment).
        self.handler: consumer_settings.HandlerRuntime | None = None
        self.retry: Backoff | None = None
        self.replay_poll_interval = 0.0
        self.replay_delay = 0.0  # the first automated replay's, at most
        # What the relays run with (set at start, from their environment: the defaults).
        self.relay: relay_settings.RelayConfig | None = None
        # A login per worker, each in the one pgoutbox role docs/reference.md gives it (set at start).
        self.logins: dict[str, str] = {}
        self.ledger: Ledger | None = None  # the run's (set by run(); faults that emit record there)

    @property
    def lease_seconds(self) -> float:
        assert self.relay is not None
        return self.relay.lease

    def url_as(self, who: str) -> str:
        """The database URL as `who`'s login (the superuser's until start made them)."""
        name = self.logins.get(who)
        return self.database_url.replace("postgres@", f"{name}@", 1) if name else self.database_url

    def env(self, extra: dict[str, str], login: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
        env.update(
            {
                "OUTBOX_DATABASE_URL": self.url_as(login) if login else self.database_url,
                "OUTBOX_NATS_URL": self.nats.url,
                "OUTBOX_LOG_LEVEL": "WARNING",  # the run's logs stay readable: warnings and errors only
            }
        )
        env.update(extra)
        return env

    def _spawn(self, command: str, name: str, extra: dict[str, str], login: str) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        return subprocess.Popen(
            [sys.executable, "-m", "pgoutbox.cli.main", command],
            env=self.env(extra, login),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def relay_env(self) -> dict[str, str]:
        """Every relay setting at its default but the streams file and the
        HTTP port."""
        return {
            "OUTBOX_STREAMS_FILE": str(self.root / "streams.toml"),  # the run's streams
            "OUTBOX_RELAY_HTTP_PORT": "0",  # any free port: two relays share this host
        }

    def start_relay(self, i: int) -> None:
        self.relays[i] = self._spawn("relay", f"relay-{i}", self.relay_env(), "relay")

    def consumer_env(self) -> dict[str, str]:
        """Every consumer setting at its default but the registry file and the
        HTTP port."""
        return {
            "OUTBOX_REGISTRY_FILE": str(self.root / "handlers.registry.json"),  # the run's handler
            "OUTBOX_CONSUMER_HTTP_PORT": "0",  # any free port: two consumers share this host
        }

    def start_consumer(self, i: int) -> None:
        self.consumers[i] = self._spawn("consume", f"consumer-{i}", self.consumer_env(), "consumer")

    def emit_old_version(self, failing: list[str | None]) -> tuple[int, int]:
        """Emits one event of the older payload version per item of `failing`
        (a value: the upcaster raises for it, that way), each in its own
        transaction, as the writers' login; records them in the run's ledger
        (self.ledger). Returns (upcast, raising) of those committed."""
        ledger = self.ledger
        assert ledger is not None
        ok = bad = 0
        try:
            with psycopg.connect(self.url_as("writer"), connect_timeout=3, autocommit=True) as conn:
                for how in failing:
                    payload: dict[str, Any] = {"schema_version": VERSION - 1}
                    if how:
                        payload["upcast_fail"] = how
                    try:
                        event_id = conn.execute(
                            "SELECT outbox.emit('account', 'old', %s, %s::jsonb, context => %s, event_version => %s)",
                            (EVENT_TYPE, json.dumps(payload), CONTEXT, VERSION - 1),
                        ).fetchone()[0]
                    except psycopg.Error:
                        with ledger.lock:
                            ledger.writer_errors += 1
                        return ok, bad  # the connection is gone: the burst ends here, what committed counts
                    with ledger.lock:
                        ledger.committed[event_id] = time.time()
                        (ledger.upcast_fail if how else ledger.upcast_ok).add(event_id)
                    if how:
                        bad += 1
                    else:
                        ok += 1
        except psycopg.Error:
            with ledger.lock:
                ledger.writer_errors += 1
        return ok, bad

    def settle_seconds(self) -> float:
        """How long the run may stand still after a fault before what is
        left counts as stuck: a redelivery after a consumer's death (twice
        ack_wait), the first automated replay, and an event a dead relay had
        claimed (its lease) whose publish then failed once more (the publish
        timeout and the longest retry pause, or the longest pause of the
        probe that finds JetStream back); all from the workers' defaults."""
        assert self.handler is not None and self.relay is not None
        relay = self.relay.lease + self.relay.publish_timeout + max(self.relay.retry_cap, away.PAUSE_CAP)
        return max(2 * self.handler.ack_wait, self.replay_delay, relay) + 10

    def replay_late(self) -> float:
        """How long past its due time a replay may still be waiting for the
        replayer, which looks every replay_poll_interval."""
        return self.replay_poll_interval + 20

    def outage_seconds(self) -> tuple[float, float]:
        """A PostgreSQL outage longer than every redelivery of a message the
        handler's settings allow (max_deliver - 1 retry delays at their
        ceiling) and than max_deliver x the first delay, by 5 s at least."""
        assert self.handler is not None and self.retry is not None
        span = sum(self.retry.ceiling(n) for n in range(1, self.handler.max_deliver))
        low = max(20.0, span + 5, self.handler.max_deliver * self.retry.base + 5)
        return low, low + 10

    def make_logins(self) -> None:
        """One login per worker, in the pgoutbox role docs/reference.md gives
        it; the ledger app's also writes its side effects, the writers' their
        business rows (the tables of the application, not pgoutbox's)."""
        roles = {
            "relay": "pgoutbox_relay",
            "consumer": "pgoutbox_consumer",
            "writer": "pgoutbox_writer",
            "app": "pgoutbox_consumer",
            "admin": "pgoutbox_admin",
        }
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            for who, role in roles.items():
                name = f"chaos_{who}"
                conn.execute(
                    psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                        psycopg.sql.Identifier(name), psycopg.sql.Identifier(role)
                    )
                )
                self.logins[who] = name
            conn.execute(LOGIN_GRANTS)

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
        self.make_logins()
        self.relay = core_settings.build(relay_settings.RelayConfig, self.env(self.relay_env(), "relay"))
        if DUPLICATE_WINDOW <= self.relay.lease:
            raise RuntimeError(
                f"the streams' duplicate_window ({DUPLICATE_WINDOW:g}s) must be longer than the relay's lease"
                f" ({self.relay.lease:g}s): a batch re-claimed after the lease would be stored twice"
            )
        for kind in self.kinds:
            if kind.ready:
                kind.ready(self)
        self.app = LedgerApp(self.url_as("app"))
        self.app.start()
        app_url_holder.append(self.app.url)
        streams = (
            f"[defaults]\nreplicas = {self.nats.size if self.topology == 'cluster' else 1}\n"
            f'duplicate_window = "{DUPLICATE_WINDOW:g}s"\nmax_age = "1d"\n'
            f'[streams.{CONTEXT}]\nname = "{STREAM}"\n'
        )
        if self.topology == "cluster":  # else the consumer creates it, with one replica
            streams += f'[streams.{CONTEXT}_dlq]\nname = "{CONTEXT.upper()}_DLQ"\nsubjects = ["{CONTEXT}.dlq.>"]\n'
        (self.root / "streams.toml").write_text(streams)
        manifests = self.root / "handlers"
        manifests.mkdir(exist_ok=True)
        (manifests / "ledger.toml").write_text(
            MANIFEST.format(
                name=HANDLER, url=self.app.url, subjects=", ".join(f'"{s}"' for s in SUBJECTS), version=VERSION
            )
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
        cfg = core_settings.build(consumer_settings.ConsumerConfig, self.env(self.consumer_env()))
        (spec,) = registry.load(self.root / "handlers.registry.json")
        self.handler = consumer_settings.resolve(spec, cfg)
        self.retry = consumer_settings.retry_backoff(cfg)
        self.replay_poll_interval = cfg.replay_poll_interval
        self.replay_delay = cfg.replay_base_delay
        print(
            f"handler {HANDLER}: max_deliver {self.handler.max_deliver}, ack_wait {self.handler.ack_wait:g}s, "
            f"timeout {self.handler.timeout:g}s, concurrency {self.handler.concurrency}, "
            f"replay_max_attempts {self.handler.replay_max_attempts}, retry delay {self.retry.base:g}s "
            f"doubling to {self.retry.max_delay:g}s, replays after {cfg.replay_base_delay:g}s doubling "
            f"to {cfg.replay_max_delay:g}s; relays: lease {self.relay.lease:g}s, publish timeout "
            f"{self.relay.publish_timeout:g}s, max_attempts {self.relay.max_attempts}, retry {self.relay.retry_base:g}s "
            f"doubling to {self.relay.retry_cap:g}s; settled after {self.settle_seconds():g}s standing still",
            flush=True,
        )
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
                    conn = psycopg.connect(pipeline.url_as("writer"), connect_timeout=3)
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
                conn = psycopg.connect(pipeline.url_as("writer"), connect_timeout=3)
            event_id = conn.execute(
                "SELECT outbox.emit('account', %s, %s, %s::jsonb, context => %s, event_version => %s,"
                " ordering_key => %s)",
                (
                    str(rng.randrange(10_000)),
                    EVENT_TYPE,
                    json.dumps({"schema_version": VERSION, "poison": poison}),
                    CONTEXT,
                    VERSION,
                    key,
                ),
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
    """Every kind at least once (a long one exactly long_repeats times), the
    rest drawn at random from the short kinds; one at a time, each with its
    recovery, the pauses between them drawn from the seed so that what the
    faults are expected to take (FaultKind.seconds) fits in the load."""
    long = [k.name for k in pipeline.kinds if k.long]
    short = [k.name for k in pipeline.kinds if not k.long] or long
    kinds = long * max(1, profile.long_repeats) + [k.name for k in pipeline.kinds if not k.long]
    kinds += [rng.choice(short) for _ in range(max(0, profile.faults - len(kinds)))]
    rng.shuffle(kinds)
    expected = {k.name: k.seconds(pipeline) for k in pipeline.kinds}
    t0 = time.monotonic()
    end = t0 + profile.seconds - 4
    for i, kind in enumerate(kinds):
        left = len(kinds) - i
        slack = end - time.monotonic() - sum(expected[k] for k in kinds[i:])
        at = time.monotonic() + max(1.0, slack / (left + 1)) * rng.uniform(0.5, 1.5)
        at = max(at, t0 + 4)  # the workers running and the load under way first
        while time.monotonic() < at:
            if stop.wait(0.1):
                return
        started, wall = time.monotonic(), time.time()
        try:
            detail = fault_registry.REGISTRY[kind].inject(pipeline, rng)
        except Exception as exc:  # the fault itself failed: the run says so and goes on
            detail = f"FAULT FAILED: {exc!r}"
        done.append(Injected(kind, wall, time.time(), detail))
        log.append(f"{started - t0:6.1f}s {kind} {detail} ({time.monotonic() - started:.1f}s)")
        print(f"fault {i + 1}/{len(kinds)}: {log[-1].strip()}", flush=True)  # a long run shows its progress


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
            # str(): a value nats-py parsed as an email Header (non-ASCII) is not hashable
            return (msg.seq, msg.subject, msg.data or b"", {k: str(v) for k, v in (msg.headers or {}).items()})

        out = []
        seqs = range(info.state.first_seq, info.state.last_seq + 1)
        for i in range(0, len(seqs), parallel):
            out += [m for m in await asyncio.gather(*map(get, seqs[i : i + parallel])) if m]
        return out
    finally:
        await nc.close()


async def consumer_state(nats_url: str) -> tuple[int, int, int, int]:
    """(num_pending, num_ack_pending, unacked) of the handler's durable on the
    event stream, and num_pending + num_ack_pending of its replay durable;
    unacked: the stream sequences past its ack floor up to the last message
    of its subject as the stream leader has it (a consumer led by a replica
    that is behind reports nothing pending while it is)."""
    nc = await nats_cluster.connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.consumer_info(STREAM, HANDLER)
        last = 0
        for subject in SUBJECTS:
            try:
                last = max(last, (await js.get_last_msg(STREAM, subject)).seq or 0)
            except nats.js.errors.NotFoundError:
                pass
        try:
            replays = await js.consumer_info(DLQ_STREAM, HANDLER)
            replaying = (replays.num_pending or 0) + (replays.num_ack_pending or 0)
        except nats.js.errors.NotFoundError:
            replaying = 0
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        return info.num_pending or 0, info.num_ack_pending or 0, max(0, last - (floor or 0)), replaying
    finally:
        await nc.close()


async def ack_floor(nats_url: str) -> int:
    """The stream sequence of the handler's durable's ack floor."""
    nc = await nats_cluster.connect(nats_url)
    try:
        info = await nc.jetstream().consumer_info(STREAM, HANDLER)
        return (info.ack_floor.stream_seq if info.ack_floor else 0) or 0
    finally:
        await nc.close()


# Dead letters with an automated replay still to come that the settle period
# waits for: every one's first replay, and every replay of one that the
# handler's own answer (422) or an upcaster did not cause (the handler was
# down: its replays are what brings it back). How many, how many of them are
# not yet due (or only just: the replayer looks every replay_poll_interval),
# and how long until the next is due. The settle period waits for them (a
# replayer that cannot replay them shows as dead letters that never leave
# this count).
REPLAY_DUE = (
    "SELECT count(*), count(*) FILTER (WHERE (dlq_metadata ->> 'next_replay_at')::timestamptz"
    " > now() - make_interval(secs => %s)),"
    " extract(epoch FROM min((dlq_metadata ->> 'next_replay_at')::timestamptz) - now())"
    " FROM inbox.messages WHERE handler = %s AND status = 'DEAD_LETTER'"
    " AND dlq_metadata ->> 'next_replay_at' IS NOT NULL"
    " AND (coalesce((dlq_metadata ->> 'replay_attempts')::integer, 0) = 0"
    "      OR NOT (last_error LIKE 'HTTP 422%%' OR last_error LIKE 'UPCAST\\_%%'))"
)
IDLE_SETTLE = 10.0  # nothing in flight anywhere: what is left is final after this long


def wait_for_quiescence(
    pipeline: Pipeline, ledger: Ledger, timeout: float, stuck_after: float | None = None
) -> tuple[bool, str]:
    """Waits until nothing is unpublished, unprocessed, unacked or being
    replayed, and every dead letter has had its first automated replay.
    Gives up at the timeout, or once the state has not changed for a while:
    IDLE_SETTLE seconds when nothing is in flight (no message pending or
    unacknowledged in JetStream, no replay due soon: nothing can move what
    is left), else stuck_after (default: Pipeline.settle_seconds, from the
    workers' defaults), or until the next replay the run waits for is due."""
    assert pipeline.handler is not None
    stuck_after = stuck_after or pipeline.settle_seconds()
    deadline = time.monotonic() + timeout
    state, since, idle = "not checked", time.monotonic(), False
    shown = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < (IDLE_SETTLE if idle else stuck_after):
        try:
            with psycopg.connect(pipeline.database_url, autocommit=True) as c:
                outbox = c.execute(
                    "SELECT coalesce(sum(unpublished), 0), coalesce(sum(dead_letter), 0) FROM outbox.backlog()"
                ).fetchone()
                inbox = c.execute("SELECT coalesce(sum(unprocessed), 0) FROM inbox.backlog()").fetchone()[0]
                unreplayed, upcoming, next_due = c.execute(REPLAY_DUE, (pipeline.replay_late(), HANDLER)).fetchone()
            pending, ack_pending, unacked, replaying = asyncio.run(consumer_state(pipeline.nats.url))
            new_state = (
                f"outbox unpublished={outbox[0]} dead={outbox[1]}, inbox unprocessed={inbox}, "
                f"jetstream pending={pending} ack_pending={ack_pending} past_ack_floor={unacked} "
                f"replays_in_flight={replaying}, dead letters awaiting a replay={unreplayed}"
            )
            if new_state != state or (next_due is not None and next_due > -pipeline.replay_late()):
                state, since = new_state, time.monotonic()  # moving, or a replay to come
            if outbox[0] == inbox == unreplayed == 0 and pending == ack_pending == unacked == replaying == 0:
                return True, state
            idle = outbox[0] == upcoming == pending == ack_pending == replaying == 0
            if time.monotonic() - shown >= 60:  # a long drain shows its progress (and its pace)
                shown = time.monotonic()
                print(f"settling: {state}", flush=True)
        except Exception as exc:
            state, since, idle = f"unreachable: {exc!r}", time.monotonic(), False
        time.sleep(1)
    return False, state


SETTLED = ("PROCESSED", "DEAD_LETTER")
UNPUBLISHED = ("PENDING", "FAILED", "PROCESSING")  # outbox statuses of an event not yet in the stream


def settled_inbox(database_url: str, grace: float) -> dict[uuid.UUID, tuple[str, str | None]]:
    """The handler's inbox (message id -> status, last_error). A row not yet
    PROCESSED or DEAD_LETTER is read again until `grace` has passed: a replay
    that began just after the run went quiet settles within seconds, a stuck
    row does not."""
    query = "SELECT message_id, status, last_error FROM inbox.messages WHERE handler = %s"
    deadline = time.monotonic() + grace
    with psycopg.connect(database_url, autocommit=True) as c:
        rows = {r[0]: (r[1], r[2]) for r in c.execute(query, (HANDLER,))}
        while True:
            unsettled = [m for m, (status, _) in rows.items() if status not in SETTLED]
            if not unsettled or time.monotonic() > deadline:
                return rows
            time.sleep(2)
            again = c.execute(query + " AND message_id = ANY(%s)", (HANDLER, unsettled))
            rows.update({r[0]: (r[1], r[2]) for r in again})


@dataclass
class Notices:
    dead: Counter = field(default_factory=Counter)  # message id (text) -> MessageDeadLettered notices
    reasons: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # message id -> their reasons
    invalid: set[tuple[str | None, int | None]] = field(default_factory=set)  # (stream, sequence) of .invalid ones


def read_notices(nats_url: str) -> Notices:
    notices = Notices()
    for _, subject, data, _ in asyncio.run(read_stream(nats_url, DLQ_STREAM)):
        if ".dlq.dead." not in subject:
            continue  # a replay
        body = json.loads(data)
        if body.get("message_id") is None:
            notices.invalid.add((body.get("stream"), body.get("stream_sequence")))
        else:
            notices.dead[body["message_id"]] += 1
            notices.reasons[body["message_id"]].append(str(body.get("reason") or ""))
    return notices


# Outbox last_error codes that say the broker was away, not that it refused the event.
BROKER_AWAY = ("NATS_UNAVAILABLE", "PUBLISH_TIMEOUT", "JETSTREAM_ERROR", "NO_STREAM")


def cause_of(last_error: str | None) -> str:
    """What an inbox dead letter's last_error says caused it."""
    text = last_error or ""
    if text.startswith("HTTP 422"):
        return "handler answered 422"
    if text.startswith("UPCAST_"):
        return "upcaster"
    if "connection error" in text or "timeout after" in text:
        return "handler unreachable"
    if "HTTP 503" in text:
        return "handler answered 503"
    return text[:60] or "no last_error"


def handler_unreachable(reasons: list[str]) -> bool:
    """Every dead-letter notice of the message names the handler's own
    failure as the last: no answer (it was down, its connections refused) or
    a 503. The app counts its 503s, not the connections it refused, so a
    message refused a few times and then answered 503 reaches max_deliver
    with fewer 503s: still the handler's failures."""
    return bool(reasons) and all(cause_of(r) in ("handler unreachable", "handler answered 503") for r in reasons)


def check(pipeline: Pipeline, ledger: Ledger, injected: list[Injected], quiet: bool = True) -> tuple[dict, list[str]]:
    """The ledger: every committed event, poison, hostile emit and foreign
    message against what the stream, the DLQ, the inbox and the side effects
    say. Each committed event ends PROCESSED with one side effect, or (poison,
    or the handler failed it max_deliver times) DEAD_LETTER with a notice;
    anything else is lost (no outcome anywhere), duplicated, or stuck (not
    PROCESSED nor DEAD_LETTER with a notice when the run has settled)."""
    assert pipeline.handler is not None and pipeline.app is not None
    problems: list[str] = []
    max_deliver = pipeline.handler.max_deliver
    notices_cap = 1 + pipeline.handler.replay_max_attempts  # the first dead letter, then one per replay
    inbox = settled_inbox(pipeline.database_url, grace=10.0 if quiet else 0.0)
    failures = pipeline.app.failed()
    with psycopg.connect(pipeline.database_url, autocommit=True) as c:
        rows = c.execute("SELECT event_id, status FROM outbox.events").fetchall()
        outbox_dead = c.execute(
            "SELECT event_id, split_part(coalesce(last_error, ''), ':', 1), last_error FROM outbox.events"
            " WHERE status = 'DEAD_LETTER'"
        ).fetchall()
        effects = c.execute(
            "SELECT event_id, count(*), max(handled_at) FROM chaos.side_effects GROUP BY event_id"
        ).fetchall()
        # Replays the replayer should have published by now (Pipeline.replay_late).
        overdue = c.execute(
            "SELECT count(*), min(last_error) FROM inbox.messages WHERE handler = %s AND status = 'DEAD_LETTER'"
            " AND (dlq_metadata ->> 'next_replay_at')::timestamptz < now() - make_interval(secs => %s)",
            (HANDLER, pipeline.replay_late()),
        ).fetchone()
    status = dict(rows)
    # An emit whose COMMIT lost its connection committed iff its row exists.
    committed = dict(ledger.committed)
    for event_id in ledger.uncertain:
        if event_id in status:
            committed[event_id] = float("nan")
    upcast_fail = {e for e in ledger.upcast_fail if e in committed}
    # Poison: dead letters the handler asks for (422) or whose upcaster raises.
    poison = {e for e in ledger.poison if e in committed} | upcast_fail
    expected_effects = set(committed) - poison
    hostile_ids = set(ledger.hostile.accepted) | set(ledger.hostile.uncertain)
    foreign_ids = {s.uid for s in pipeline.foreign.sent if s.uid is not None}

    # Dead-lettered by the relay: a committed event of the ledger is always
    # publishable, so it never is its own fault; a hostile one only when the
    # code says the broker was away.
    relay_dead = [(e, code, err) for e, code, err in outbox_dead if e in committed]
    relay_dead += [
        (e, code, err)
        for e, code, err in outbox_dead
        if e in set(ledger.hostile.accepted) | set(ledger.hostile.uncertain) and code in BROKER_AWAY
    ]
    not_completed = [e for e in committed if status.get(e) not in ("COMPLETED", "DEAD_LETTER")]
    ghosts = [e for e in ledger.rolled_back if e in status]
    stream = asyncio.run(read_stream(pipeline.nats.url, STREAM))
    copies = Counter(h.get("Nats-Msg-Id") for _, _, _, h in stream)
    # Not in the stream although the outbox says COMPLETED, or not in the
    # outbox at all: lost. One the relay has not published yet (PENDING,
    # FAILED, PROCESSING) is stuck (not_completed), one it dead-lettered counts
    # in dead_letters_not_own.
    missing = [e for e in committed if copies[str(e)] == 0 and status.get(e) not in ("DEAD_LETTER", *UNPUBLISHED)]
    doubled = [e for e in committed if copies[str(e)] > 1]
    ghost_msgs = [e for e in ledger.rolled_back if copies[str(e)]]
    effect_count = {r[0]: r[1] for r in effects}
    dup_effects = [e for e, n in effect_count.items() if n > 1]
    allowed_effects = expected_effects | hostile_ids | foreign_ids
    wrong_effects = [e for e in effect_count if e not in allowed_effects]
    notices = read_notices(pipeline.nats.url)

    # Each committed event that reached the stream, by where it ended. One
    # with no inbox row that the handler's durable has not acknowledged (past
    # its ack floor) is still being redelivered: stuck, not lost.
    floor = asyncio.run(ack_floor(pipeline.nats.url))
    seq_of: dict[str, int] = {}
    for seq, _, _, h in stream:
        seq_of.setdefault(h.get("Nats-Msg-Id") or "", seq)
    lost, stuck, no_notice, too_many_notices, poison_applied = [], [], [], [], []
    dead_by_handler, dead_for_faults, awaiting_replay = [], [], []
    unpublished = set(not_completed)
    for e in committed:
        if copies[str(e)] == 0:
            continue  # counted as missing from the stream
        if e in unpublished:
            # Counted stuck already. A run that did not settle goes on moving
            # while the check reads: the relays publish it and the consumers
            # process it after the inbox was read, before the stream and the
            # ack floor were, which looked lost.
            continue
        row_status = inbox.get(e, (None, None))[0]
        if row_status is None and seq_of.get(str(e), 0) > floor:
            stuck.append(e)
            continue
        dead = notices.dead.get(str(e), 0)
        applied = effect_count.get(e, 0)
        if row_status in ("RECEIVED", "FAILED"):
            stuck.append(e)
        elif row_status == "DEAD_LETTER" and not dead:
            no_notice.append(e)
        if e in poison:
            if applied:
                poison_applied.append(e)
            if row_status == "DEAD_LETTER" and dead > notices_cap:
                too_many_notices.append(e)
            elif row_status is None or (row_status == "PROCESSED" and not applied):
                lost.append(e)
            continue
        if dead:
            by_handler = failures.get(e, 0) >= max_deliver or handler_unreachable(notices.reasons.get(str(e), []))
            (dead_by_handler if by_handler else dead_for_faults).append(e)
        if not applied and row_status == "DEAD_LETTER" and dead:
            awaiting_replay.append(e)  # dead-lettered with its notice: the next replay may still process it
        elif not applied and row_status not in ("RECEIVED", "FAILED", "DEAD_LETTER"):
            lost.append(e)  # no side effect, and no outcome in the inbox
    poison_dead = {e for e in poison if inbox.get(e, (None, None))[0] == "DEAD_LETTER" and notices.dead.get(str(e))}
    upcast_wrong = [e for e in upcast_fail if e in poison_dead and cause_of(inbox[e][1]) != "upcaster"]
    # Dead letters at the end that neither the handler's own answer (422) nor
    # an upcaster caused: the relay's, and the inbox's of an event that was
    # to be processed (a well-formed foreign message's included).
    well_formed = {s.uid for s in pipeline.foreign.sent if s.uid is not None and s.expect == "processed"}
    # (A hostile emit's own dead letters, its data refused, are its own: of
    # those only the ones a fault caused count.)
    faulted = ("handler unreachable", "handler answered 503")
    inbox_dead_not_own = [
        m
        for m, (st, err) in inbox.items()
        if st == "DEAD_LETTER"
        and (
            (m in expected_effects and cause_of(err) not in ("handler answered 422", "upcaster"))
            or ((m in well_formed or m in hostile_ids) and cause_of(err) in faulted)
        )
    ]
    dead_causes = Counter(f"relay {code or 'no code'}" for _, code, _ in relay_dead)
    dead_causes.update(cause_of(inbox[m][1]) for m in inbox_dead_not_own)
    dead_causes_all = Counter(cause_of(err) for st, err in inbox.values() if st == "DEAD_LETTER")
    recovered = Counter(
        cause_of(notices.reasons[str(e)][0])
        for e in committed
        if notices.dead.get(str(e)) and e not in poison and effect_count.get(e, 0) == 1
    )
    known = set(committed) | hostile_ids | foreign_ids
    strange_dead = [m for m, (st, _) in inbox.items() if st == "DEAD_LETTER" and m not in known]
    # .invalid notices of messages the pipeline published itself: emitted
    # events, or replays (which name the DLQ stream). Foreign messages are
    # expected there; one whose PubAck was lost may be behind a notice too.
    foreign_seqs = {s.seq for s in pipeline.foreign.sent if s.seq is not None}
    unacked_foreign = sum(1 for s in pipeline.foreign.sent if s.seq is None)
    unknown = sorted(
        (str(where), seq or 0) for where, seq in notices.invalid if not (where == STREAM and seq in foreign_seqs)
    )
    if sum(1 for where, _ in unknown if where == STREAM) > unacked_foreign or any(w != STREAM for w, _ in unknown):
        problems.append(
            f"{len(unknown)} .invalid DLQ notices of messages the pipeline published itself (emitted events,"
            f" or replays): the consumer could not read them: {unknown[:5]}"
        )

    dead_inbox = {m for m, (st, _) in inbox.items() if st == "DEAD_LETTER"}
    with psycopg.connect(pipeline.database_url, autocommit=True) as c:
        hostile_figures, hostile_problems = poison_writer.check(
            c, ledger.hostile, copies, effect_count, dead_inbox, SUBJECTS
        )
    problems += hostile_problems
    foreign_figures, foreign_problems, foreign_outcomes = foreign.check(
        pipeline.foreign,
        STREAM,
        foreign.Outcomes(
            invalid=notices.invalid,
            notices=notices.dead,
            inbox={m: st for m, (st, _) in inbox.items()},
            effects=effect_count,
            failures=failures,
            max_deliver=max_deliver,
        ),
    )
    problems += foreign_problems
    pipeline.logs.mkdir(parents=True, exist_ok=True)
    with (pipeline.logs / "foreign.jsonl").open("w") as out:
        out.writelines(json.dumps(o) + "\n" for o in foreign_outcomes)

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
        ("committed but neither COMPLETED nor DEAD_LETTER in the outbox (stuck)", not_completed),
        (
            f"dead letters neither the handler's answer (422) nor an upcaster caused, by cause {dict(dead_causes)}",
            [e for e, _, _ in relay_dead] + inbox_dead_not_own,
        ),
        ("whose upcaster raised but dead-lettered for another reason", upcast_wrong),
        ("rolled back but stored", ghosts),
        ("committed and COMPLETED (or gone from the outbox) but not in the stream (lost)", missing),
        ("in the stream twice", doubled),
        ("rolled back but in the stream", ghost_msgs),
        ("without its side effect and without an outcome in the inbox (lost)", lost),
        ("left RECEIVED or FAILED in the inbox, or unacknowledged without an inbox row (stuck)", stuck),
        ("DEAD_LETTER in the inbox without a DLQ notice", no_notice),
        (
            f"dead-lettered though the handler failed them fewer than max_deliver ({max_deliver}) times",
            dead_for_faults,
        ),
        ("poison with a side effect", poison_applied),
        (f"poison with more than 1 + replay_max_attempts ({notices_cap}) DLQ notices", too_many_notices),
        ("with duplicated side effects", dup_effects),
        ("with an unexpected side effect", wrong_effects),
        ("DEAD_LETTER in the inbox but neither committed, hostile nor foreign", strange_dead),
    ):
        if items:
            problems.append(f"{len(items)} events {name}: {', '.join(map(str, items[:3]))}")
    if overdue[0]:
        problems.append(
            f"{overdue[0]} dead letters not replayed {pipeline.replay_late():g}s after their replay was due (a"
            f" replay pass that fails for all of them?); e.g. last_error {str(overdue[1])[:200]!r}"
        )
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
        "poison_dead_lettered": len(poison_dead),
        "poison_notices": sum(notices.dead.get(str(e), 0) for e in poison),
        "stream_messages": len(stream),
        "side_effects": sum(effect_count.values()),
        "lost": len(missing) + len(lost),
        "duplicated_side_effects": len(dup_effects),
        "stuck": len(not_completed) + len(stuck) + len(no_notice),
        # Where the stuck are: not yet published (and how many of those carry
        # an ordering key: a key has one event in flight, so a keyed backlog
        # drains one claim round per event of its longest key), or in the inbox.
        "stuck_unpublished": len(not_completed),
        "stuck_unpublished_keyed": sum(1 for e in not_completed if e in ledger.keyed),
        "dead_letters_not_own": len(relay_dead) + len(inbox_dead_not_own),
        "dead_letters_not_own_by_cause": dict(dead_causes),
        "dead_letters_by_cause": dict(dead_causes_all),
        "dead_lettered_then_processed_by_cause": dict(recovered),
        "relay_dead_letters": len(relay_dead),
        "upcast_events": len(upcast_fail) + len(ledger.upcast_ok & set(committed)),
        "upcast_failed_dead_lettered": len(upcast_fail & poison_dead),
        "dead_lettered_for_faults": len(dead_for_faults),
        "dead_lettered_by_handler_failures": len(dead_by_handler),
        "dead_letters_awaiting_replay": len(awaiting_replay),
        "handler_failures_503": sum(failures.values()),
        "replays_overdue": overdue[0],
        "order_inversions": out_of_order,
        **{f"e2e_{k}_ms": v for k, v in percentiles(latencies).items()},
        **hostile_figures,
        **foreign_figures,
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


def ledger_line(figures: dict) -> str:
    """The five columns of the soak's ledger (docs/benchmarks.md)."""
    return (
        f"ledger: events {figures['committed']}, lost {figures['lost']}, duplicated "
        f"{figures['duplicated_side_effects']}, stuck {figures['stuck']}, dead letters not caused by the "
        f"handler's answer or an upcaster {figures['dead_letters_not_own']}"
    )


def run(profile: Profile, seed: int, root: Path | None = None, keep: bool = False) -> int:
    root = root or Path(tempfile.mkdtemp(prefix="pgoutbox-chaos-"))
    root.chmod(0o755)  # PostgreSQL runs as the postgres user below it
    rng = random.Random(seed)
    kinds = fault_registry.kinds_for(profile.topology, profile.kinds)
    print(f"fault kinds: {', '.join(k.name for k in kinds)}", flush=True)
    pipeline = Pipeline(root, seed, profile.topology, kinds, profile)
    ledger = Ledger()
    pipeline.ledger = ledger
    stop_writers, stop_faults = threading.Event(), threading.Event()
    injected: list[Injected] = []
    fault_log: list[str] = []
    t_start = time.monotonic()
    try:
        hostile = None
        if profile.hostile_share > 0:
            expected = profile.seconds * profile.rate * profile.hostile_share
            hostile = poison_writer.draw_cases(seed, min(400, int(2 * expected) + 20), CONTEXT, EVENT_TYPE)
            print(f"poison writer: {len(hostile)} hostile cases drawn, share {profile.hostile_share}", flush=True)
        pipeline.start([])
        started = round(time.monotonic() - t_start, 1)
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
        injector.join()  # the load goes on until the last fault has recovered
        stop_writers.set()
        for t in writers:
            t.join()
        phases = {"started": started, "faults_done": round(time.monotonic() - t_start, 1)}
        print(f"faults done at {phases['faults_done']}s; waiting for quiescence", flush=True)
        quiet, state = wait_for_quiescence(pipeline, ledger, profile.quiesce_timeout)
        phases["quiet"] = round(time.monotonic() - t_start, 1)
        print(f"{'quiet' if quiet else 'NOT quiet'} at {phases['quiet']}s: {state}", flush=True)
        figures, problems = check(pipeline, ledger, injected, quiet)
        phases["checked"] = round(time.monotonic() - t_start, 1)
        figures["phases_s"] = phases
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
        print(ledger_line(figures))
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
