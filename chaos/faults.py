"""The fault kinds of the chaos harness, one registration each.

A fault kind is a function that injects the fault AND waits for its
recovery (restarts what it killed, heals what it cut), so that faults run one
at a time; it returns a short detail for the fault log ("" when there is
none). It is registered with the topologies it applies to ("single": one
nats-server; "cluster": three nodes, streams at replicas 3):

    from chaos.faults import fault

    @fault("promote_standby", topologies=("cluster",), prepare=start_standby, stop=stop_standby)
    def promote_standby(pipeline, rng) -> str:
        ...

`prepare(pipeline)` runs once, after PostgreSQL and NATS are up and the
schema is migrated, before any writer, relay or consumer starts: it may
start more processes and set `pipeline.database_url` (what every writer,
worker and the ledger check connect with, e.g. a multi-host string) and
keep its state in `pipeline.extras`. `ready(pipeline)` runs once the workers'
logins exist (`pipeline.url_as(who)`), before the workers start.
`stop(pipeline)` runs at the end, before PostgreSQL stops. `pipeline.pg` is the PostgreSQL that restart_postgres
restarts: a fault that moves the primary points it at the new one.

A kind registered with `long=True` lasts what the profile's away_seconds say
(minutes in the long profiles): it runs exactly long_repeats times a run,
the other kinds fill up the profile's fault count. `estimate(pipeline)`
tells the scheduler how long one takes (DEFAULT_ESTIMATE when not given), so
that the faults fit in the load.

Modules named in PLUGINS register more kinds when they exist (the harness
runs without them otherwise): chaos.pg_failover adds PostgreSQL failover.
"""

from __future__ import annotations

import asyncio
import importlib
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psycopg

from pgoutbox.dev.embedded import nats_server_binary

from . import foreign
from .ledger_app import LedgerApp

TOPOLOGIES = ("single", "cluster")
PLUGINS = ("chaos.pg_failover",)
RECOVERY_TIMEOUT = 90.0  # a NATS node back and healthy
FOREIGN_POOL = 200  # hostile foreign messages drawn per run (used in turn)
FOREIGN_BURST = 20  # published by one foreign_messages fault
OUTAGE_MESSAGES = 20  # well-formed messages published while PostgreSQL is down
UPCAST_BURST = 30  # older-version events emitted by one upcaster_raises fault, a third of them failing
FLOW_TIMEOUT = 30.0  # how long a consumer kill waits for deliveries under way
DEFAULT_ESTIMATE = 5.0  # seconds a fault kind takes, injection and recovery, unless it says


class Pipeline(Protocol):
    """What a fault kind uses of the run under test; chaos.harness.Pipeline
    is one. A protocol rather than that class: the harness imports this
    module, so this module imports nothing of the harness back."""

    stream: str
    subject: str
    event_type: str  # the ledger's events
    version: int  # their payload version; upcaster_raises emits version - 1
    root: Path
    seed: int
    profile: Any  # chaos.harness.Profile: the run's counts and durations
    pg: Any  # what restart_postgres restarts: an EmbeddedPostgres, or pg_failover's pair
    nats: Any  # an EmbeddedNats or a NatsCluster
    database_url: str
    extras: dict[str, Any]
    relays: list[subprocess.Popen | None]
    consumers: list[subprocess.Popen | None]
    app: LedgerApp | None
    foreign: foreign.ForeignLedger

    @property
    def lease_seconds(self) -> float: ...

    def url_as(self, who: str) -> str: ...

    def start_relay(self, i: int) -> None: ...

    def start_consumer(self, i: int) -> None: ...

    def emit_old_version(self, failing: list[str | None]) -> tuple[int, int]: ...


@dataclass(frozen=True)
class FaultKind:
    name: str
    inject: Callable[[Pipeline, random.Random], str]
    topologies: frozenset[str]
    prepare: Callable[[Pipeline], None] | None = None
    stop: Callable[[Pipeline], None] | None = None
    ready: Callable[[Pipeline], None] | None = None
    long: bool = False
    estimate: Callable[[Pipeline], float] | None = None

    def seconds(self, pipeline: Pipeline) -> float:
        return self.estimate(pipeline) if self.estimate else DEFAULT_ESTIMATE


REGISTRY: dict[str, FaultKind] = {}


def fault(
    name: str,
    *,
    topologies: tuple[str, ...] = TOPOLOGIES,
    prepare: Callable[[Pipeline], None] | None = None,
    stop: Callable[[Pipeline], None] | None = None,
    ready: Callable[[Pipeline], None] | None = None,
    long: bool = False,
    estimate: Callable[[Pipeline], float] | None = None,
):
    """Registers the decorated function as the fault kind `name`."""
    unknown = set(topologies) - set(TOPOLOGIES)
    if unknown:
        raise ValueError(f"fault {name}: unknown topologies {sorted(unknown)}")

    def register(inject: Callable[[Pipeline, random.Random], str]):
        if name in REGISTRY:
            raise ValueError(f"fault kind {name} registered twice")
        REGISTRY[name] = FaultKind(name, inject, frozenset(topologies), prepare, stop, ready, long, estimate)
        return inject

    return register


def load_plugins() -> list[str]:
    """Imports the plugin modules that exist; returns their names."""
    loaded = []
    for module in PLUGINS:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise  # the plugin exists but is broken: say so
            continue
        loaded.append(module)
    return loaded


def kinds_for(topology: str, only: tuple[str, ...] | None = None) -> list[FaultKind]:
    load_plugins()
    if only:
        unknown = [k for k in only if k not in REGISTRY]
        wrong = [k for k in only if k in REGISTRY and topology not in REGISTRY[k].topologies]
        if unknown or wrong:
            raise ValueError(
                f"fault kinds {unknown + wrong} unknown or not for topology {topology}; "
                f"known: {sorted(k for k, f in REGISTRY.items() if topology in f.topologies)}"
            )
        return [REGISTRY[k] for k in only]
    return [f for f in REGISTRY.values() if topology in f.topologies]


# -- workers and PostgreSQL (both topologies) ----------------------------------------------------


def await_deliveries(pipeline: Pipeline, timeout: float = FLOW_TIMEOUT) -> None:
    """Until the handler is being called (two calls apart), at most
    `timeout`: a consumer kill lands while messages are in flight, even on a
    machine so loaded that deliveries start late."""
    app = pipeline.app
    if app is None:
        return
    deadline = time.monotonic() + timeout
    seen = app.calls
    while app.calls < seen + 2 and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill_and_restart(processes: list, start: Callable[[int], None], rng: random.Random) -> str:
    i = rng.randrange(len(processes))
    process = processes[i]
    if process is not None:  # kill -9 of a worker the harness started
        process.kill()
        process.wait()
    time.sleep(rng.uniform(0.2, 1.5))
    start(i)
    return f"#{i}"


@fault("kill_relay", estimate=lambda p: 2.0)
def kill_relay(pipeline: Pipeline, rng: random.Random) -> str:
    return _kill_and_restart(pipeline.relays, pipeline.start_relay, rng)


@fault("kill_consumer", estimate=lambda p: 2.0)
def kill_consumer(pipeline: Pipeline, rng: random.Random) -> str:
    await_deliveries(pipeline)
    return _kill_and_restart(pipeline.consumers, pipeline.start_consumer, rng)


@fault("pause_relay", estimate=lambda p: p.lease_seconds + 2)
def pause_relay(pipeline: Pipeline, rng: random.Random) -> str:
    """SIGSTOP for longer than the lease: another relay re-claims its batch."""
    i = rng.randrange(len(pipeline.relays))
    relay = pipeline.relays[i]
    assert relay is not None
    relay.send_signal(signal.SIGSTOP)
    time.sleep(pipeline.lease_seconds + rng.uniform(1.0, 2.5))
    relay.send_signal(signal.SIGCONT)
    return f"#{i}"


@fault("kill_all_consumers", estimate=lambda p: 2.0)
def kill_all_consumers(pipeline: Pipeline, rng: random.Random) -> str:
    """kill -9 of every consumer process at once, then all restarted: what
    they had in flight comes back only after ack_wait."""
    await_deliveries(pipeline)
    killed = [p for p in pipeline.consumers if p is not None]
    for process in killed:
        process.kill()
    for process in killed:
        process.wait()
    time.sleep(rng.uniform(0.2, 3.0))
    for i in range(len(pipeline.consumers)):
        pipeline.start_consumer(i)
    return f"{len(killed)} consumers"


@fault("restart_postgres", estimate=lambda p: 2.0)
def restart_postgres(pipeline: Pipeline, rng: random.Random) -> str:
    pipeline.pg.restart()
    return ""


@fault("postgres_outage", estimate=lambda p: sum(p.outage_seconds()) / 2 + 3)
def postgres_outage(pipeline: Pipeline, rng: random.Random) -> str:
    """PostgreSQL (the primary, under a standby pair) stopped, cleanly or as a
    crash, for longer than a message's redeliveries take with the handler's
    settings (Pipeline.outage_seconds); well-formed messages are published
    straight to the stream as it goes down, so that they wait through it."""
    seconds = rng.uniform(*pipeline.outage_seconds())
    pair = getattr(pipeline.pg, "pair", None)  # chaos.pg_failover.Failover
    node = pair.primary if pair is not None else pipeline.pg
    mode = rng.choice(("fast", "immediate"))
    node.stop(mode)
    started = time.monotonic()
    try:
        sent = foreign.publish(
            pipeline.nats.url,
            [foreign.well_formed(pipeline.subject)] * OUTAGE_MESSAGES,
            "processed",
            pipeline.foreign,
        )
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    finally:
        node.start()
    return f"{seconds:.0f}s ({mode}), well-formed messages published meanwhile: {sent}"


def _pg_away_seconds(pipeline: Pipeline) -> tuple[float, float]:
    return pipeline.profile.pg_away_seconds or pipeline.outage_seconds()


@fault("postgres_outage_long", long=True, estimate=lambda p: sum(_pg_away_seconds(p)) / 2 + 3)
def postgres_outage_long(pipeline: Pipeline, rng: random.Random) -> str:
    """PostgreSQL (the primary) stopped for a minute or more in the long
    profiles (the profile's pg_away_seconds; the short ones: as long as
    postgres_outage, the mechanism the same): past the relay's and the
    consumer's reconnect pauses, the lease and every redelivery delay."""
    seconds = rng.uniform(*_pg_away_seconds(pipeline))
    pair = getattr(pipeline.pg, "pair", None)
    node = pair.primary if pair is not None else pipeline.pg
    mode = rng.choice(("fast", "immediate"))
    node.stop(mode)
    try:
        time.sleep(seconds)
    finally:
        node.start()
    return f"{seconds:.0f}s ({mode})"


def _away(pipeline: Pipeline) -> float:
    return sum(pipeline.profile.away_seconds) / 2


@fault("handler_down", long=True, estimate=lambda p: _away(p) + 2)
def handler_down(pipeline: Pipeline, rng: random.Random) -> str:
    """The handler's HTTP server closed for the profile's away_seconds (five
    minutes in the long profiles): connections refused, requests on open
    ones unanswered. The consumer's gate of that handler closes: its
    messages wait, with no failure counted, until a probe finds it back
    (docs/handlers.md, "A handler that is away")."""
    assert pipeline.app is not None
    seconds = rng.uniform(*pipeline.profile.away_seconds)
    pipeline.app.down()
    try:
        time.sleep(seconds)
    finally:
        pipeline.app.up()
    return f"{seconds:.0f}s"


UPCASTER = """
CREATE OR REPLACE FUNCTION chaos.ledger_entry_v1_v2(p jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    -- A payload with "upcast_fail" cannot be upcast: the upcaster raises, in three ways.
    IF jsonb_typeof(p) = 'object' AND p ? 'upcast_fail' THEN
        IF p ->> 'upcast_fail' = 'assert' THEN
            ASSERT false, 'chaos: this v1 payload cannot be upcast';
        ELSIF p ->> 'upcast_fail' = 'divide' THEN
            RETURN jsonb_build_object('ratio', length(p::text) / 0);
        END IF;
        RAISE EXCEPTION 'chaos: this v1 payload cannot be upcast' USING ERRCODE = 'CH001';
    END IF;
    IF jsonb_typeof(p) <> 'object' THEN
        RETURN p;
    END IF;
    RETURN p || jsonb_build_object('schema_version', 2);
END
$$;
"""
UPCAST_FAILURES = ("assert", "raise", "divide")


def _register_upcaster(pipeline: Pipeline) -> None:
    """The upcaster v1 -> v2 of the ledger's event type: created by the
    schema owner, registered through the SQL API by a pgoutbox_admin login
    (docs/in-database.md, "Payload versions")."""
    with psycopg.connect(pipeline.database_url, autocommit=True) as conn:
        conn.execute(UPCASTER)
    with psycopg.connect(pipeline.url_as("admin"), autocommit=True) as conn:
        conn.execute(
            "SELECT inbox.register_upcaster(%s, %s, 'chaos.ledger_entry_v1_v2(jsonb)')",
            (pipeline.event_type, pipeline.version - 1),
        )


@fault("upcaster_raises", ready=_register_upcaster)
def upcaster_raises(pipeline: Pipeline, rng: random.Random) -> str:
    """A burst of events of the older payload version, which the consumer
    upcasts for the handler; for a third of them (a marker field) the
    upcaster raises (ASSERT, RAISE with a custom SQLSTATE, division by
    zero): each of those must end UPCAST_FAILED, dead-lettered with its
    notice, the others processed."""
    failing = [rng.choice(UPCAST_FAILURES) if k % 3 == 0 else None for k in range(UPCAST_BURST)]
    ok, bad = pipeline.emit_old_version(failing)
    return f"{ok} upcast, {bad} with a raising upcaster"


def _draw_foreign(pipeline: Pipeline) -> None:
    pipeline.extras["foreign_cases"] = foreign.draw_cases(pipeline.seed, FOREIGN_POOL, pipeline.subject)
    pipeline.extras["foreign_next"] = 0


@fault("foreign_messages", prepare=_draw_foreign, estimate=lambda p: 2.0)
def foreign_messages(pipeline: Pipeline, rng: random.Random) -> str:
    """A burst of hostile messages published straight to the stream, drawn
    from the poison strategies (chaos/poison.py), header values
    nats-py would not send included; the check follows each one."""
    cases = pipeline.extras["foreign_cases"]
    first = pipeline.extras["foreign_next"]
    burst = [cases[(first + k) % len(cases)] for k in range(FOREIGN_BURST)]
    pipeline.extras["foreign_next"] = first + FOREIGN_BURST
    return foreign.publish(pipeline.nats.url, burst, "outcome", pipeline.foreign)


# -- one nats-server -------------------------------------------------------------------------------


@fault("restart_nats", topologies=("single",), estimate=lambda p: 3.0)
def restart_nats(pipeline: Pipeline, rng: random.Random) -> str:
    pipeline.nats.stop()
    time.sleep(rng.uniform(0.5, 2.0))
    pipeline.nats.start()
    return ""


@fault("jetstream_away", topologies=("single",), long=True, estimate=lambda p: _away(p) + 5)
def jetstream_away(pipeline: Pipeline, rng: random.Random) -> str:
    """nats-server restarted on the same port WITHOUT JetStream for the
    profile's away_seconds (five minutes and more in the long profile), then
    back with JetStream and its old store: clients connect, no stream
    answers (what they see while a cluster has lost its quorum)."""
    seconds = rng.uniform(*pipeline.profile.away_seconds)
    nats = pipeline.nats
    nats.stop()
    bare = subprocess.Popen(
        [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(nats.port), "-l", str(nats.root / "nats-nojs.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(seconds)
    finally:
        bare.terminate()
        try:
            bare.wait(10)
        except subprocess.TimeoutExpired:
            bare.kill()
            bare.wait()
        nats.start()
    return f"{seconds:.0f}s"


# -- three clustered nodes -------------------------------------------------------------------------


def _recovered(pipeline: Pipeline, node: int) -> str:
    """Waits until the node is healthy again (its /healthz: every stream and
    consumer replica on it current) and the stream has all its replicas."""
    t0 = time.monotonic()
    ok = pipeline.nats.wait_healthy(node, RECOVERY_TIMEOUT) and asyncio.run(
        pipeline.nats.wait_until_current(pipeline.stream, RECOVERY_TIMEOUT)
    )
    return f"healthy after {time.monotonic() - t0:.1f}s" if ok else "NOT healthy"


@fault("kill_nats_leader", topologies=("cluster",), estimate=lambda p: 15.0)
def kill_nats_leader(pipeline: Pipeline, rng: random.Random) -> str:
    """kill -9 of the node that leads the stream, found through the JetStream API."""
    leader = asyncio.run(pipeline.nats.stream_leader(pipeline.stream))
    pipeline.nats.kill(leader)
    t0 = time.monotonic()
    new = asyncio.run(pipeline.nats.stream_leader(pipeline.stream))
    elected = time.monotonic() - t0
    time.sleep(rng.uniform(0.5, 3.0))
    pipeline.nats.start_node(leader)
    return f"n{leader + 1} (new leader n{new + 1} in {elected:.1f}s), {_recovered(pipeline, leader)}"


@fault("kill_nats_node", topologies=("cluster",), estimate=lambda p: 10.0)
def kill_nats_node(pipeline: Pipeline, rng: random.Random) -> str:
    """kill -9 of a node that does not lead the stream."""
    leader = asyncio.run(pipeline.nats.stream_leader(pipeline.stream))
    i = rng.choice([n for n in range(pipeline.nats.size) if n != leader])
    pipeline.nats.kill(i)
    time.sleep(rng.uniform(0.5, 3.0))
    pipeline.nats.start_node(i)
    return f"n{i + 1}, {_recovered(pipeline, i)}"


@fault("rolling_restart_nats", topologies=("cluster",), estimate=lambda p: 30.0)
def rolling_restart_nats(pipeline: Pipeline, rng: random.Random) -> str:
    """Every node in turn: SIGTERM, start, wait until its replica is current."""
    notes = []
    for i in range(pipeline.nats.size):
        pipeline.nats.restart(i)
        notes.append(f"n{i + 1}: {_recovered(pipeline, i)}")
    return "; ".join(notes)


@fault("partition_nats_node", topologies=("cluster",), estimate=lambda p: 15.0)
def partition_nats_node(pipeline: Pipeline, rng: random.Random) -> str:
    """Cuts one node's routes (the leader half the time) for a few seconds; its clients stay connected to it."""
    leader = asyncio.run(pipeline.nats.stream_leader(pipeline.stream))
    i = leader if rng.random() < 0.5 else rng.randrange(pipeline.nats.size)
    pipeline.nats.partition(i)
    time.sleep(rng.uniform(3.0, 10.0))
    pipeline.nats.heal(i)
    return f"n{i + 1}{' (leader)' if i == leader else ''}, {_recovered(pipeline, i)}"


@fault("jetstream_quorum_lost", topologies=("cluster",), long=True, estimate=lambda p: _away(p) + 20)
def jetstream_quorum_lost(pipeline: Pipeline, rng: random.Random) -> str:
    """Two of the three nodes stopped (SIGTERM) for the profile's
    away_seconds (five minutes and more in the cluster profile): the third
    keeps its clients connected, but no stream has a quorum. Then both back,
    with their stores."""
    seconds = rng.uniform(*pipeline.profile.away_seconds)
    keep = rng.randrange(pipeline.nats.size)
    stopped = [i for i in range(pipeline.nats.size) if i != keep]
    for i in stopped:
        pipeline.nats.nodes[i].stop()
    try:
        time.sleep(seconds)
    finally:
        for i in stopped:
            pipeline.nats.start_node(i)
    notes = [f"n{i + 1}: {_recovered(pipeline, i)}" for i in stopped]
    return f"{seconds:.0f}s, n{keep + 1} kept; " + "; ".join(notes)
