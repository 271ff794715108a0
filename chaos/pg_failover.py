"""PostgreSQL failover for the chaos runs: a primary with a streaming standby
(harness.pg_standby) behind one multi-host URL, a `promote` fault, and
business writers whose ledger shows what a promotion did to the data.

Interface (what a soak registers; every call blocks until done):

    pg = Failover(root / "postgres", synchronous=True)  # synchronous_commit="on"|"remote_apply"
    url = pg.start()     # both nodes; target_session_attrs=read-write
    pg.url, pg.dsn(db)   # the same URL (drop-in for EmbeddedPostgres.url/.dsn)
    label = pg.fault(rng)  # retire the primary (stop -m immediate or fast,
                           # drawn from rng), promote the standby, rebuild the
                           # retired node as the new standby; returns one line
                           # for the fault log; timings in pg.switches
    pg.restart()         # the current primary restarts in place (restart_postgres)
    pg.stop()

KIND ("pg_failover") is the fault's name. Failover has the attributes of
EmbeddedPostgres that chaos.harness.Pipeline uses (start, stop, restart, url,
dsn), so a Pipeline runs on it when given it as its `pg`. Workers, writers and
the ledger app must be given `pg.url`; they follow a promotion without being
restarted. With synchronous=True nothing a writer saw committed may be lost,
so the soak's ledger keeps its usual verdicts; with synchronous=False a crash
of the primary loses what had not streamed yet, and only business_ledger()
below tells that loss from a fault of pgoutbox.

Business writers (write_business) commit an event and a business row
(chaos.business, marker = event id) in one transaction; business_ledger()
compares what the writers saw committed, what the new primary holds, the
stream and the side effects.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from harness.pg_standby import StandbyPair

KIND = "pg_failover"
AGGREGATE = "failover"  # aggregate_type of the business writers' events


@dataclass(frozen=True)
class Switch:
    mode: str  # how the old primary was retired: immediate (a crash) or fast
    promoted_port: int
    writable_seconds: float  # from the retirement until the new primary accepted writes
    rebuild_seconds: float  # the retired node back as a standby


class Failover:
    def __init__(
        self,
        root: Path,
        *,
        synchronous: bool = True,
        synchronous_commit: str = "on",  # or remote_apply
        modes: tuple[str, ...] = ("immediate", "fast"),
    ):
        self.pair = StandbyPair(root, synchronous=synchronous, synchronous_commit=synchronous_commit)
        self.modes = modes
        self.switches: list[Switch] = []
        self.started_at: list[float] = []  # time.time() of each fault's start
        self.writable_at: list[float] = []  # time.time() when each new primary took writes

    @property
    def url(self) -> str:
        return self.pair.url()

    def dsn(self, dbname: str = "postgres") -> str:
        return self.pair.url(dbname)

    def start(self) -> str:
        return self.pair.start()

    def fault(self, rng: random.Random) -> str:
        mode = rng.choice(self.modes)
        self.started_at.append(time.time())
        writable = self.pair.promote(mode)
        self.writable_at.append(time.time())
        promoted = self.pair.primary.port
        rebuild = self.pair.rebuild()
        self.switches.append(Switch(mode, promoted, writable, rebuild))
        return f"{KIND} ({mode}): port {promoted} promoted in {writable:.2f}s, standby rebuilt in {rebuild:.2f}s"

    def restart(self) -> None:
        self.pair.restart()

    def stop(self, mode: str = "fast") -> None:
        self.pair.stop(mode)


@dataclass
class BusinessLedger:
    """What the writers saw: event ids whose COMMIT returned, and those whose
    COMMIT lost its connection (committed or not: the database says)."""

    acked: dict[uuid.UUID, float] = field(default_factory=dict)  # event id -> time.time() of the ack
    uncertain: set[uuid.UUID] = field(default_factory=set)
    errors: Counter = field(default_factory=Counter)  # SQLSTATE (or the class name) -> count
    lock: threading.Lock = field(default_factory=threading.Lock)


def write_business(
    url: str, rate: float, ledger: BusinessLedger, stop: threading.Event, seed: int, context: str = "chaos"
) -> None:
    """One writer: `rate` business transactions per second, each an emit and
    its business row, until `stop`; reconnects (through the multi-host URL)
    after any error."""
    from chaos.harness import EVENT_TYPE, VERSION  # here, not on top: the harness may import this module

    rng = random.Random(seed)
    conn: psycopg.Connection | None = None
    next_at = time.monotonic()
    while not stop.is_set():
        next_at = max(next_at + 1 / rate, time.monotonic() - 1)
        time.sleep(max(0.0, next_at - time.monotonic()))
        event_id = None
        try:
            if conn is None or conn.closed:
                conn = psycopg.connect(url, connect_timeout=3)
            event_id = conn.execute(
                "SELECT outbox.emit(%s, %s, %s, %s::jsonb, context => %s, event_version => %s)",
                (
                    AGGREGATE,
                    str(rng.randrange(10_000)),
                    EVENT_TYPE,
                    json.dumps({"schema_version": VERSION}),
                    context,
                    VERSION,
                ),
            ).fetchone()[0]
            conn.execute("INSERT INTO chaos.business (marker) VALUES (%s)", (event_id,))
        except psycopg.Error as exc:
            _failed(ledger, exc, conn)
            conn = None
            continue
        try:
            conn.commit()
        except psycopg.Error as exc:
            with ledger.lock:
                ledger.uncertain.add(event_id)
            _failed(ledger, exc, conn)
            conn = None
            continue
        with ledger.lock:
            ledger.acked[event_id] = time.time()
    if conn is not None:
        conn.close()


def _failed(ledger: BusinessLedger, exc: psycopg.Error, conn: psycopg.Connection | None) -> None:
    with ledger.lock:
        ledger.errors[exc.sqlstate or type(exc).__name__] += 1
    if conn is not None:
        conn.close()
    time.sleep(0.05)


def wait_settled(url: str, nats_url: str, timeout: float) -> tuple[bool, str]:
    """Until nothing is left to publish and JetStream has nothing to deliver
    or awaiting an ack (twice in a row, a second apart). The inbox is left to
    the ledger: after an asynchronous failover a consumer's PROCESSED mark can
    be lost with the WAL although JetStream has the message acknowledged, and
    then nothing will ever settle that row."""
    from chaos.harness import consumer_state  # here, not on top: the harness may import this module

    deadline, state, calm = time.monotonic() + timeout, "not checked", 0
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=3) as c:
                unpublished = c.execute("SELECT coalesce(sum(unpublished), 0) FROM outbox.backlog()").fetchone()[0]
            pending, ack_pending, unacked, replaying = asyncio.run(consumer_state(nats_url))
            state = (
                f"outbox unpublished={unpublished}, jetstream pending={pending} ack_pending={ack_pending}"
                f" unacked={unacked} replays_in_flight={replaying}"
            )
            calm = calm + 1 if unpublished == pending == ack_pending == unacked == replaying == 0 else 0
            if calm >= 2:
                return True, state
        except Exception as exc:
            state, calm = f"unreachable: {exc!r}", 0
        time.sleep(1)
    return False, state


def business_ledger(
    url: str,
    nats_url: str,
    stream: str,
    ledger: BusinessLedger,
    *,
    synchronous: bool,
    handler: str = "ledger",
    switched_at: float = 0.0,
) -> tuple[dict, list[str]]:
    """Figures and problems once settled (wait_settled). Always problems: a
    business row without its event or an event without its business row
    (atomicity), an event not COMPLETED (stuck), an event absent from the
    stream or in it twice, a side effect applied twice, an inbox row of
    `handler` left unsettled that was received after the last switch
    (`switched_at`, time.time()). Lost with the WAL (problems only when
    synchronous, else reported): writer-acknowledged transactions missing on
    the new primary, events published (and maybe applied) before their
    transaction was lost, side effects applied and then lost, inbox rows
    received before the switch whose PROCESSED mark was lost after JetStream
    had the message acknowledged."""
    from chaos.harness import read_stream  # here, not on top: the harness may import this module

    with psycopg.connect(url, autocommit=True) as c:
        status = dict(
            c.execute("SELECT event_id, status FROM outbox.events WHERE aggregate_type = %s", (AGGREGATE,)).fetchall()
        )
        business = {r[0] for r in c.execute("SELECT marker FROM chaos.business")}
        effects = Counter(dict(c.execute("SELECT event_id, count(*) FROM chaos.side_effects GROUP BY event_id")))
        unsettled = c.execute(
            "SELECT message_id, extract(epoch FROM received_at)::float8 FROM inbox.messages "
            "WHERE handler = %s AND status <> 'PROCESSED'",
            (handler,),
        ).fetchall()
    copies = Counter(h.get("Nats-Msg-Id") for _, _, _, h in asyncio.run(read_stream(nats_url, stream)))
    ids = {str(e) for e in status}
    writer_ids = set(ledger.acked) | ledger.uncertain

    hard = {
        "events without their business row": [e for e in status if e not in business],
        "business rows without their event": [m for m in business if m not in status],
        "events not COMPLETED (stuck)": [e for e, s in status.items() if s != "COMPLETED"],
        "events missing from the stream": [e for e in status if copies[str(e)] == 0],
        "events in the stream twice": [e for e in status if copies[str(e)] > 1],
        "side effects applied twice": [e for e, n in effects.items() if n > 1],
        "events no writer emitted": [e for e in status if e not in writer_ids],
        "inbox rows unsettled, received after the switch": [m for m, at in unsettled if at >= switched_at],
    }
    wal = {
        "acknowledged commits lost": [e for e in ledger.acked if e not in status],
        "published events whose transaction was lost": [m for m in copies if m and m not in ids],
        "side effects lost": [e for e in status if effects[e] == 0],
        "side effects of lost events": [e for e in effects if e not in status],
        "inbox marks lost": [m for m, at in unsettled if at < switched_at],
    }
    problems = [f"{len(v)} {k}: {', '.join(map(str, v[:3]))}" for k, v in hard.items() if v]
    if synchronous:
        problems += [
            f"{len(v)} {k} (synchronous replication): {', '.join(map(str, v[:3]))}" for k, v in wal.items() if v
        ]
    figures = {
        "acked": len(ledger.acked),
        "uncertain_commits": len(ledger.uncertain),
        "uncertain_committed": sum(1 for e in ledger.uncertain if e in status),
        "events": len(status),
        "business_rows": len(business),
        "stream_messages": sum(copies.values()),
        "side_effects": sum(effects.values()),
        "writer_errors": dict(ledger.errors),
        **{"lost_with_wal." + k.replace(" ", "_"): len(v) for k, v in wal.items()},
    }
    return figures, problems


# -- the soak's fault kind ------------------------------------------------------------------------


def _prepare(pipeline) -> None:
    """Moves the pipeline onto a synchronous primary + standby pair before any
    writer or worker starts: the single PostgreSQL the harness started is
    replaced (migrated the same way, then stopped), and everything connects
    through the pair's multi-host URL from then on."""
    from chaos.ledger_app import SCHEMA
    from pgoutbox.core import migrate

    pair = Failover(pipeline.root / "postgres-pair", synchronous=True)
    pair.start()
    with psycopg.connect(pair.url, autocommit=True) as conn:
        migrate.migrate(conn)
        conn.execute(SCHEMA)
    pipeline.pg.stop()
    pipeline.pg = pair  # restart_postgres restarts its primary; the harness stops both at the end
    pipeline.database_url = pair.url


def _register() -> None:
    from chaos.faults import fault

    @fault(KIND, topologies=("cluster",), prepare=_prepare, estimate=lambda p: 20.0)
    def promote_standby(pipeline, rng: random.Random) -> str:
        return pipeline.pg.fault(rng)


_register()
