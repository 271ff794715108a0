"""The poison writer: a share of the chaos emits drawn from the Hypothesis
strategies of chaos/poison.py (the poison pipeline test's), so that the
ledger covers hostile input under faults.

Each hostile emit runs in a business transaction that first inserts a marker
row into chaos.business and passes the marker as correlation_id. Outcomes:
  * refused (an OB code, or a NUL refused before emit runs): rolled back, so
    neither the marker row nor an event with that correlation_id may exist;
  * accepted: committed with its business row; the event must end COMPLETED
    (in the stream exactly once; on the ledger's subject, with one side
    effect or an inbox dead letter) or DEAD_LETTER with a coded last_error;
  * anything else (a refusal without a code) is a violation.
The cases are drawn once, before the load, from the run's seed."""

from __future__ import annotations

import dataclasses
import re
import threading
import uuid
from dataclasses import dataclass, field

import psycopg
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from chaos import poison

CODED = re.compile(r"^[A-Z][A-Z0-9_]+: ")


@dataclass
class HostileLedger:
    refused: set[uuid.UUID] = field(default_factory=set)  # markers
    accepted: dict[uuid.UUID, uuid.UUID] = field(default_factory=dict)  # event id -> marker
    uncertain: dict[uuid.UUID, uuid.UUID] = field(default_factory=dict)  # COMMIT lost its connection
    uncoded: list[str] = field(default_factory=list)  # refusals without a code
    lock: threading.Lock = field(default_factory=threading.Lock)


def draw_cases(seed: int, count: int, context: str, event_type: str) -> list[poison.EmitCase]:
    """`count` hostile emits (fewer when the strategies run dry), retargeted
    from the test's context and event type to the chaos ledger's."""
    drawn: list[poison.EmitCase] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(poison.any_emit())
    def collect(case: poison.EmitCase) -> None:
        drawn.append(case)

    collect()
    return [
        dataclasses.replace(
            c,
            context=context if c.context == poison.CONTEXT else c.context,
            event_type=event_type if c.event_type == poison.EVENT_TYPE else c.event_type,
        )
        for c in drawn
    ]


def emit(conn: psycopg.Connection, case: poison.EmitCase, ledger: HostileLedger) -> psycopg.Connection | None:
    """One hostile business transaction on conn (not autocommit); returns
    the connection to keep using (None: it is lost)."""
    marker = uuid.uuid4()
    try:
        conn.execute("INSERT INTO chaos.business (marker) VALUES (%s)", (marker,))
        sql, params = case.sql(ordering_suffix=f"~{marker.hex[:8]}", correlation_id=str(marker))
        event_id = conn.execute(sql, params).fetchone()[0]
    except psycopg.OperationalError:
        return None  # a fault, not a verdict: the server rolls it back
    except psycopg.Error as exc:
        try:
            conn.rollback()
        except psycopg.Error:
            return None
        why = poison.refusal_problem(case, exc)
        with ledger.lock:
            if why:
                ledger.uncoded.append(f"{why} [{case.short()[:300]}]")
            else:
                ledger.refused.add(marker)
        return conn
    try:
        conn.commit()
    except psycopg.Error:
        with ledger.lock:
            ledger.uncertain[event_id] = marker
        return None
    with ledger.lock:
        ledger.accepted[event_id] = marker
    return conn


def check(
    conn: psycopg.Connection,
    ledger: HostileLedger,
    copies,
    effect_count: dict,
    dead_inbox: set,
    ledger_subjects: tuple[str, ...],
) -> tuple[dict, list[str]]:
    """The poison writer's part of the ledger check. copies: Nats-Msg-Id ->
    stream copies; effect_count: event id -> side effects; dead_inbox: the
    ledger handler's inbox dead letters; ledger_subjects: the handler's subjects."""
    problems: list[str] = []
    rows = {
        r[0]: r[1:]
        for r in conn.execute(
            "SELECT event_id, status, last_error, subject FROM outbox.events WHERE correlation_id = ANY(%s::uuid[])",
            ([*ledger.refused, *ledger.accepted.values(), *ledger.uncertain.values()],),
        ).fetchall()
    }
    business = {r[0] for r in conn.execute("SELECT marker FROM chaos.business").fetchall()}
    accepted = dict(ledger.accepted)
    accepted.update({e: m for e, m in ledger.uncertain.items() if e in rows})
    leaked = [m for m in ledger.refused if m in business]
    by_marker = {m for m in ledger.refused} & {
        r[0]
        for r in conn.execute(
            "SELECT correlation_id FROM outbox.events WHERE correlation_id = ANY(%s::uuid[])", (list(ledger.refused),)
        ).fetchall()
    }
    lost, not_ended, uncoded_dead, doubled, no_outcome = [], [], [], [], []
    completed = dead = 0
    for event_id, marker in accepted.items():
        if event_id not in rows or marker not in business:
            lost.append(event_id)
            continue
        status, last_error, subject = rows[event_id]
        if status == "DEAD_LETTER":
            dead += 1
            if not CODED.match(last_error or ""):
                uncoded_dead.append(f"{event_id}: {(last_error or '')[:120]!r}")
        elif status == "COMPLETED":
            completed += 1
            if copies[str(event_id)] != 1:
                doubled.append(f"{event_id} x{copies[str(event_id)]}")
            if subject in ledger_subjects and effect_count.get(event_id, 0) != 1 and event_id not in dead_inbox:
                no_outcome.append(f"{event_id}: {effect_count.get(event_id, 0)} side effects")
        else:
            not_ended.append(f"{event_id} {status} {(last_error or '')[:120]!r}")
    for name, items in (
        ("refused but its business change committed", leaked),
        ("refused but its event exists", sorted(by_marker)),
        ("accepted but lost", lost),
        ("accepted but neither COMPLETED nor DEAD_LETTER", not_ended),
        ("dead-lettered without a coded last_error", uncoded_dead),
        ("completed but not in the stream exactly once", doubled),
        ("completed on the ledger subject without exactly one outcome", no_outcome),
        ("refused without a code", ledger.uncoded),
    ):
        if items:
            problems.append(f"{len(items)} hostile emits {name}: {'; '.join(map(str, items[:3]))}")
    figures = {
        "hostile_refused": len(ledger.refused),
        "hostile_accepted": len(accepted),
        "hostile_completed": completed,
        "hostile_dead_letter": dead,
        "hostile_uncoded": len(ledger.uncoded),
    }
    return figures, problems
