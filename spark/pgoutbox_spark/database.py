"""The SQL steps of archival, as the job calls them. Nothing here but
`SELECT * FROM schema.function(...)`: every rule is in sql/91_archival_*.sql
to sql/95_archival_*.sql."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row

from pgoutbox.core.errors import SchemaMismatch, wrap_exceptions

from .checksum import ChecksumColumn, Figures

OUTBOX = "outbox.events"
INBOX = "inbox.messages"
COMMANDS = "inbox.commands"
SOURCES = (OUTBOX, INBOX, COMMANDS)


def _row(conn: psycopg.Connection, query: str, params: tuple[object, ...] = ()) -> tuple[Any, ...]:
    """The one row a function that always returns one row returned."""
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise SchemaMismatch(f"{query} returned no row: the schema is not the one this pgoutbox knows")
    return row


@dataclass(frozen=True)
class Unit:
    """One day of one source, as the listing functions see it."""

    source: str
    day: date
    partition: str | None
    row_count: int
    open_rows: int
    dead_letters: int
    eligible: bool
    blocked_by: str | None
    audit_id: int | None


@dataclass(frozen=True)
class Sealed:
    day: date
    range_from: datetime
    range_to: datetime
    min_id: int | None
    max_id: int | None


@dataclass(frozen=True)
class Audit:
    id: int
    source: str
    day: date
    relation: str | None
    row_count: int
    checksum: Decimal
    archive_uri: str
    archived_at: datetime
    archived_by: str
    removed_at: datetime | None
    removed_by: str | None
    voided_at: datetime | None
    voided_by: str | None
    void_reason: str | None

    @property
    def standing(self) -> bool:
        return self.voided_at is None

    @property
    def figures(self) -> Figures:
        return Figures(self.row_count, self.checksum)


def units(conn: psycopg.Connection, source: str, retention: timedelta, dead_letter_retention: timedelta) -> list[Unit]:
    """The days of a source old enough to archive, eligible or not (and why).
    Command keys have no dead letters: their retention counts from each
    key's settling."""
    with wrap_exceptions(), conn.cursor(row_factory=dict_row) as cur:
        if source == COMMANDS:
            rows = cur.execute("SELECT * FROM inbox.archivable_command_days(%s)", (retention,)).fetchall()
        else:
            query = {
                OUTBOX: "SELECT * FROM outbox.archivable_partitions(%s, %s)",
                INBOX: "SELECT * FROM inbox.archivable_days(%s, %s)",
            }[source]
            rows = cur.execute(query, (retention, dead_letter_retention)).fetchall()
    return [
        Unit(
            source=source,
            day=r["day"],
            partition=r.get("partition_name"),
            row_count=r["row_count"],
            open_rows=r["open_rows"],
            dead_letters=r.get("dead_letters", 0),
            eligible=r["eligible"],
            blocked_by=r["blocked_by"],
            audit_id=r["audit_id"],
        )
        for r in rows
    ]


def checksum_columns(conn: psycopg.Connection, source: str) -> list[ChecksumColumn]:
    with wrap_exceptions():
        rows = conn.execute(
            "SELECT column_name, kind FROM outbox.checksum_columns(%s) ORDER BY ordinal", (source,)
        ).fetchall()
    return [ChecksumColumn(name, kind) for name, kind in rows]


def seal(
    conn: psycopg.Connection,
    partition: str,
    retention: timedelta,
    dead_letter_retention: timedelta,
    lock_timeout: timedelta,
) -> Sealed:
    with wrap_exceptions(), conn.cursor(row_factory=class_row(Sealed)) as cur:
        sealed = cur.execute(
            "SELECT * FROM outbox.seal_partition(%s, %s, %s, %s)",
            (partition, retention, dead_letter_retention, lock_timeout),
        ).fetchone()
    if sealed is None:
        raise SchemaMismatch(f"outbox.seal_partition({partition}) returned no row")
    return sealed


def seal_figures(conn: psycopg.Connection, partition: str) -> Figures:
    """The row count and checksum of a sealed partition, taken once right after its seal."""
    with wrap_exceptions():
        row_count, checksum = _row(conn, "SELECT * FROM outbox.seal_figures(%s)", (partition,))
    return Figures(row_count, checksum)


def has_seal_figures(conn: psycopg.Connection) -> bool:
    """Whether the schema takes seal figures (older ones cannot: run `pgoutbox migrate`)."""
    return bool(_row(conn, "SELECT to_regprocedure('outbox.seal_figures(text)') IS NOT NULL")[0])


def has_command_archival(conn: psycopg.Connection) -> bool:
    """Whether the schema archives command keys (14 on: older ones have no inbox.commands)."""
    return bool(_row(conn, "SELECT to_regprocedure('inbox.archivable_command_days(interval)') IS NOT NULL")[0])


def audits(conn: psycopg.Connection, source: str | None = None) -> list[Audit]:
    with wrap_exceptions(), conn.cursor(row_factory=class_row(Audit)) as cur:
        return cur.execute("SELECT * FROM outbox.archive_audits(%s)", (source,)).fetchall()


def record(conn: psycopg.Connection, source: str, day: date, figures: Figures, uri: str) -> int:
    with wrap_exceptions():
        return int(
            _row(
                conn,
                "SELECT outbox.record_archive(%s, %s, %s, %s, %s)",
                (source, day, figures.row_count, figures.checksum, uri),
            )[0]
        )


def remove(conn: psycopg.Connection, unit: Unit, lock_timeout: timedelta) -> int:
    """Drops the partition (outbox) or purges the day (inbox, command keys); 0 if already gone."""
    with wrap_exceptions():
        if unit.source == OUTBOX:
            return int(_row(conn, "SELECT outbox.drop_archived(%s, %s)", (unit.partition, lock_timeout))[0])
        if unit.source == COMMANDS:
            return int(_row(conn, "SELECT inbox.purge_archived_commands(%s)", (unit.day,))[0])
        return int(_row(conn, "SELECT inbox.purge_archived(%s)", (unit.day,))[0])


def try_lock(conn: psycopg.Connection, unit: Unit) -> bool:
    with wrap_exceptions():
        return bool(_row(conn, "SELECT outbox.try_lock_archive(%s, %s)", (unit.source, unit.day))[0])


def unlock(conn: psycopg.Connection, unit: Unit) -> None:
    with wrap_exceptions():
        conn.execute("SELECT outbox.unlock_archive(%s, %s)", (unit.source, unit.day))


def id_range(conn: psycopg.Connection) -> tuple[int | None, int | None]:
    with wrap_exceptions():
        low, high = _row(conn, "SELECT * FROM outbox.id_range()")
    return low, high


def received_range(conn: psycopg.Connection) -> tuple[datetime | None, datetime | None]:
    with wrap_exceptions():
        low, high = _row(conn, "SELECT * FROM inbox.received_range()")
    return low, high


def day_range(day: date) -> tuple[datetime, datetime]:
    """UTC bounds of a day (as outbox._day_from does)."""
    start = datetime.combine(day, time(), tzinfo=UTC)
    return start, start + timedelta(days=1)
