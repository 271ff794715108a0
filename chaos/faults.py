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
keep its state in `pipeline.extras`. `stop(pipeline)` runs at the end, before
PostgreSQL stops. `pipeline.pg` is the PostgreSQL that restart_postgres
restarts: a fault that moves the primary points it at the new one.

Modules named in PLUGINS register more kinds when they exist (the harness
runs without them otherwise): chaos.pg_failover adds PostgreSQL failover.
"""

from __future__ import annotations

import asyncio
import importlib
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import foreign

if TYPE_CHECKING:
    from .harness import Pipeline

TOPOLOGIES = ("single", "cluster")
PLUGINS = ("chaos.pg_failover",)
RECOVERY_TIMEOUT = 90.0  # a NATS node back and healthy
FOREIGN_POOL = 200  # hostile foreign messages drawn per run (used in turn)
FOREIGN_BURST = 20  # published by one foreign_messages fault
OUTAGE_MESSAGES = 20  # well-formed messages published while PostgreSQL is down


@dataclass(frozen=True)
class FaultKind:
    name: str
    inject: Callable[[Pipeline, random.Random], str]
    topologies: frozenset[str]
    prepare: Callable[[Pipeline], None] | None = None
    stop: Callable[[Pipeline], None] | None = None


REGISTRY: dict[str, FaultKind] = {}


def fault(
    name: str,
    *,
    topologies: tuple[str, ...] = TOPOLOGIES,
    prepare: Callable[[Pipeline], None] | None = None,
    stop: Callable[[Pipeline], None] | None = None,
):
    """Registers the decorated function as the fault kind `name`."""
    unknown = set(topologies) - set(TOPOLOGIES)
    if unknown:
        raise ValueError(f"fault {name}: unknown topologies {sorted(unknown)}")

    def register(inject: Callable[[Pipeline, random.Random], str]):
        if name in REGISTRY:
            raise ValueError(f"fault kind {name} registered twice")
        REGISTRY[name] = FaultKind(name, inject, frozenset(topologies), prepare, stop)
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


def _kill_and_restart(processes: list, start: Callable[[int], None], rng: random.Random) -> str:
    i = rng.randrange(len(processes))
    process = processes[i]
    if process is not None:  # kill -9 of a worker the harness started
        process.kill()
        process.wait()
    time.sleep(rng.uniform(0.2, 1.5))
    start(i)
    return f"#{i}"


@fault("kill_relay")
def kill_relay(pipeline: Pipeline, rng: random.Random) -> str:
    return _kill_and_restart(pipeline.relays, pipeline.start_relay, rng)


@fault("kill_consumer")
def kill_consumer(pipeline: Pipeline, rng: random.Random) -> str:
    return _kill_and_restart(pipeline.consumers, pipeline.start_consumer, rng)


@fault("pause_relay")
def pause_relay(pipeline: Pipeline, rng: random.Random) -> str:
    """SIGSTOP for longer than the lease: another relay re-claims its batch."""
    i = rng.randrange(len(pipeline.relays))
    relay = pipeline.relays[i]
    assert relay is not None
    relay.send_signal(signal.SIGSTOP)
    time.sleep(pipeline.lease_seconds + rng.uniform(1.0, 2.5))
    relay.send_signal(signal.SIGCONT)
    return f"#{i}"


@fault("kill_all_consumers")
def kill_all_consumers(pipeline: Pipeline, rng: random.Random) -> str:
    """kill -9 of every consumer process at once, then all restarted: what
    they had in flight comes back only after ack_wait."""
    killed = [p for p in pipeline.consumers if p is not None]
    for process in killed:
        process.kill()
    for process in killed:
        process.wait()
    time.sleep(rng.uniform(0.2, 3.0))
    for i in range(len(pipeline.consumers)):
        pipeline.start_consumer(i)
    return f"{len(killed)} consumers"


@fault("restart_postgres")
def restart_postgres(pipeline: Pipeline, rng: random.Random) -> str:
    pipeline.pg.restart()
    return ""


@fault("postgres_outage")
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


def _draw_foreign(pipeline: Pipeline) -> None:
    pipeline.extras["foreign_cases"] = foreign.draw_cases(pipeline.seed, FOREIGN_POOL, pipeline.subject)
    pipeline.extras["foreign_next"] = 0


@fault("foreign_messages", prepare=_draw_foreign)
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


@fault("restart_nats", topologies=("single",))
def restart_nats(pipeline: Pipeline, rng: random.Random) -> str:
    pipeline.nats.stop()
    time.sleep(rng.uniform(0.5, 2.0))
    pipeline.nats.start()
    return ""


# -- three clustered nodes -------------------------------------------------------------------------


def _recovered(pipeline: Pipeline, node: int) -> str:
    """Waits until the node is healthy again (its /healthz: every stream and
    consumer replica on it current) and the stream has all its replicas."""
    t0 = time.monotonic()
    ok = pipeline.nats.wait_healthy(node, RECOVERY_TIMEOUT) and asyncio.run(
        pipeline.nats.wait_until_current(pipeline.stream, RECOVERY_TIMEOUT)
    )
    return f"healthy after {time.monotonic() - t0:.1f}s" if ok else "NOT healthy"


@fault("kill_nats_leader", topologies=("cluster",))
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


@fault("kill_nats_node", topologies=("cluster",))
def kill_nats_node(pipeline: Pipeline, rng: random.Random) -> str:
    """kill -9 of a node that does not lead the stream."""
    leader = asyncio.run(pipeline.nats.stream_leader(pipeline.stream))
    i = rng.choice([n for n in range(pipeline.nats.size) if n != leader])
    pipeline.nats.kill(i)
    time.sleep(rng.uniform(0.5, 3.0))
    pipeline.nats.start_node(i)
    return f"n{i + 1}, {_recovered(pipeline, i)}"


@fault("rolling_restart_nats", topologies=("cluster",))
def rolling_restart_nats(pipeline: Pipeline, rng: random.Random) -> str:
    """Every node in turn: SIGTERM, start, wait until its replica is current."""
    notes = []
    for i in range(pipeline.nats.size):
        pipeline.nats.restart(i)
        notes.append(f"n{i + 1}: {_recovered(pipeline, i)}")
    return "; ".join(notes)


@fault("partition_nats_node", topologies=("cluster",))
def partition_nats_node(pipeline: Pipeline, rng: random.Random) -> str:
    """Cuts one node's routes (the leader half the time) for a few seconds; its clients stay connected to it."""
    leader = asyncio.run(pipeline.nats.stream_leader(pipeline.stream))
    i = leader if rng.random() < 0.5 else rng.randrange(pipeline.nats.size)
    pipeline.nats.partition(i)
    time.sleep(rng.uniform(3.0, 10.0))
    pipeline.nats.heal(i)
    return f"n{i + 1}{' (leader)' if i == leader else ''}, {_recovered(pipeline, i)}"
