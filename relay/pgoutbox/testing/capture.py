"""The events a block of code emits in the test's open transaction.

    with capture(conn) as emitted:
        place_order(conn, "c-1", 5)
    emitted.assert_emits("order_created", {"total": 5})

The capture reads pgoutbox_tap.high_water() when the block starts and
pgoutbox_tap.emitted_since() when it ends: the rows the connection's own
transaction wrote, which no other session can see before it commits. So it
needs the testing kit in the database (`pgoutbox testing install-tap`, or
install_kit() as the schema's owner) and a transaction left open by the block
(the test rolls it back); a role with only pgoutbox_writer may use it.

The assertions mean what the pgTAP ones mean (pgtap/helpers/events.sql), and
fail with the same two lines: what was expected, what was emitted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from pgoutbox.core import tap

_HIGH_WATER = "SELECT pgoutbox_tap.high_water()"
_EMITTED = "SELECT * FROM pgoutbox_tap.emitted_since(%s)"
_SHOWN_PAYLOAD = 200  # characters of a payload in a failure message, as in SQL


class KitMissing(RuntimeError):
    """The testing kit is not installed in this database."""


class TransactionEnded(RuntimeError):
    """The captured block ended the connection's transaction."""


@dataclass(frozen=True)
class EmittedEvent:
    """One event as the outbox holds it (the columns the relay publishes)."""

    id: int
    event_id: str
    subject: str
    context: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    event_version: int
    payload: dict[str, Any]
    headers: dict[str, Any] = field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None
    tenant_id: str | None = None
    ordering_key: str | None = None
    occurred_at: datetime | None = None
    created_at: datetime | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> EmittedEvent:
        uuids = ("event_id", "correlation_id", "causation_id")
        columns: dict[str, Any] = {k: (str(v) if k in uuids and v is not None else v) for k, v in row.items()}
        return cls(**columns)

    def as_row(self) -> dict[str, Any]:
        """The outbox row as a mapping (what pgoutbox.core.wire.to_nats reads)."""
        return asdict(self)

    def shown(self) -> str:
        text = json.dumps(self.payload, ensure_ascii=False)
        if len(text) > _SHOWN_PAYLOAD:
            text = text[:_SHOWN_PAYLOAD] + "..."
        key = f" (ordering_key {self.ordering_key})" if self.ordering_key is not None else ""
        return f"{self.event_type} {text}{key}"


def contains(have: Any, want: Any) -> bool:
    """jsonb's @>: every key of an object with a contained value, every element
    of an array contained in some element, equal scalars (true is not 1)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and contains(have[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and all(any(contains(h, w) for h in have) for w in want)
    if isinstance(want, bool) or isinstance(have, bool):
        return type(want) is type(have) and want == have
    return bool(have == want) and not isinstance(have, dict | list)


def _wanted(event_type: str, payload_contains: Mapping[str, Any] | None) -> str:
    if not payload_contains:
        return event_type
    return f"{event_type} whose payload contains {json.dumps(payload_contains, ensure_ascii=False)}"


@dataclass
class Captured:
    """What a block emitted (filled when the block ends), with assertions."""

    events: list[EmittedEvent] = field(default_factory=list)

    def of_type(self, event_type: str, payload_contains: Mapping[str, Any] | None = None) -> list[EmittedEvent]:
        return [e for e in self.events if e.event_type == event_type and contains(e.payload, payload_contains or {})]

    def failure(self, expected: str) -> str:
        if not self.events:
            return f"expected: {expected}\nemitted:  nothing"
        lines = "".join(f"\n    {e.shown()}" for e in self.events)
        return f"expected: {expected}\nemitted:  {len(self.events)} event(s){lines}"

    def assert_emits(self, event_type: str, payload_contains: Mapping[str, Any] | None = None) -> EmittedEvent:
        """At least one event_type whose payload contains payload_contains; returns the first."""
        found = self.of_type(event_type, payload_contains)
        if not found:
            raise AssertionError(self.failure(f"an event {_wanted(event_type, payload_contains)}"))
        return found[0]

    def assert_emits_exactly(
        self, n: int, event_type: str, payload_contains: Mapping[str, Any] | None = None
    ) -> list[EmittedEvent]:
        found = self.of_type(event_type, payload_contains)
        if len(found) != n:
            raise AssertionError(self.failure(f"exactly {n} event(s) {_wanted(event_type, payload_contains)}"))
        return found

    def assert_emits_nothing(self) -> None:
        if self.events:
            raise AssertionError(self.failure("no event"))

    def assert_emitted_in_order(self, event_types: Sequence[str]) -> None:
        """The event types emitted, in emit order, are event_types: no more, no fewer."""
        if [e.event_type for e in self.events] != list(event_types):
            raise AssertionError(self.failure(", ".join(event_types) + ", in this order"))


def _missing(exc: psycopg.Error) -> KitMissing:
    return KitMissing(
        f"the testing kit is not installed in this database ({exc.sqlstate}): run `pgoutbox testing install-tap`"
        " (or pgoutbox.testing.install_kit(conn)) as the role that ran `pgoutbox migrate`"
    )


_KIT_MISSING = (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName)


def _open(status: TransactionStatus, autocommit: bool) -> None:
    if autocommit:
        raise TransactionEnded(
            "capture needs a connection whose transaction the test keeps open (autocommit off): "
            "it sees only the events of that transaction, before it commits"
        )
    if status == TransactionStatus.IDLE:
        raise TransactionEnded(
            "the captured block ended the transaction (commit or rollback): "
            "the capture sees only the events of the open transaction; let the test roll it back"
        )


def _mark(row: tuple[Any, ...] | None) -> int:
    return int(row[0]) if row else 0


@contextmanager
def capture(conn: psycopg.Connection[Any]) -> Iterator[Captured]:
    """Captures the events the block emits on conn, in its open transaction."""
    _open(TransactionStatus.INTRANS, conn.autocommit)
    try:
        mark = _mark(conn.execute(_HIGH_WATER).fetchone())
    except _KIT_MISSING as exc:
        raise _missing(exc) from exc
    captured = Captured()
    yield captured
    _open(conn.info.transaction_status, conn.autocommit)
    with conn.cursor(row_factory=dict_row) as cur:
        captured.events = [EmittedEvent.from_row(r) for r in cur.execute(_EMITTED, (mark,))]


@asynccontextmanager
async def acapture(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[Captured]:
    """capture() for an async connection."""
    _open(TransactionStatus.INTRANS, conn.autocommit)
    try:
        mark = _mark(await (await conn.execute(_HIGH_WATER)).fetchone())
    except _KIT_MISSING as exc:
        raise _missing(exc) from exc
    captured = Captured()
    yield captured
    _open(conn.info.transaction_status, conn.autocommit)
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(_EMITTED, (mark,))
        captured.events = [EmittedEvent.from_row(r) async for r in cur]


def install_kit(conn: psycopg.Connection[Any]) -> None:
    """Installs the testing kit (as `pgoutbox testing install-tap` does)."""
    tap.install(conn)
