"""The relay's calls to the SQL API, over a connection that is reopened after
PostgreSQL went away (restart, failover, network). Only function calls: the
rules live in the database.

A call that fails because the server is unreachable raises DatabaseUnavailable
(the caller decides whether to retry); every (re)connection re-checks the
schema version, so a relay never runs against a schema it does not know.

Claimed rows are read so that no value can fail the fetch: ids, payload and
headers as text, and timestamps as the wire text built from PostgreSQL's own
rendering (envelope.wire_time), or a marker for values that have none
(±infinity, BC, years past 9999, which psycopg cannot load as datetimes).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.adapt import Loader
from psycopg.rows import dict_row, tuple_row
from psycopg.types.string import TextLoader

from pgoutbox.core import db
from pgoutbox.core import wire as envelope
from pgoutbox.core.errors import ConfigError, DatabaseUnavailable, SchemaMismatch, wrap_exceptions

log = logging.getLogger("pgoutbox.core.db")

# The columns the wire envelope needs (envelope.to_nats), plus the claim token
# and attempts; decoding fewer columns keeps claiming cheap. payload and
# headers come as jsonb text: the payload goes on the wire as PostgreSQL
# renders it (exact numbers, no decode/encode round trip through Python).
CLAIMED_COLUMNS = (
    "claim_token, event_id, context, subject, payload::text AS payload, headers::text AS headers, "
    "aggregate_type, aggregate_id, event_type, event_version, correlation_id, causation_id, "
    "tenant_id, ordering_key, occurred_at, attempts"
)
WAKEUP_CHANNEL = "outbox_v1"  # sql/40_outbox_wakeup.sql


def _log_warning(diag) -> None:
    """PostgreSQL's RAISE WARNING (e.g. from create_partitions) into our logs."""
    if diag.severity_nonlocalized == "WARNING":
        log.warning("PostgreSQL: %s", diag.message_primary, extra={"action": "db_warning", "hint": diag.message_hint})


_CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)


class WireTimeLoader(Loader):
    """timestamptz -> wire text or envelope.Unrepresentable; never raises (a
    value Python's datetime cannot hold would otherwise fail the whole fetch)."""

    def load(self, data) -> str | envelope.Unrepresentable:
        return envelope.wire_time(bytes(data).decode())


async def open_connection(
    database_url: str | None, *, synchronous_commit: bool = True, wire_times: bool = False, **kwargs
) -> psycopg.AsyncConnection:
    """An autocommit connection to a schema this code understands.

    Login refused, database missing and server unreachable all raise
    DatabaseUnavailable: libpq gives them no SQLSTATE to tell them apart."""
    options = []
    if not synchronous_commit:
        options.append("-c synchronous_commit=off")
    if wire_times:  # the rendering WireTimeLoader's fast path expects
        options.append("-c TimeZone=UTC -c DateStyle=ISO")
    if options:
        kwargs["options"] = " ".join(options)
    try:
        conn = await db.aconnect(database_url, connect_timeout=5, **kwargs)
    except _CONNECTION_ERRORS as exc:
        raise db.unavailable(exc, database_url) from exc
    try:
        cur = conn.cursor(row_factory=tuple_row)
        await cur.execute("SELECT outbox.schema_version()")
        db.check_schema_version((await cur.fetchone())[0])
    except (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName) as exc:
        await conn.close()
        raise SchemaMismatch(f"no pgoutbox schema in {db.describe(database_url)}: run `pgoutbox migrate`") from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        await conn.close()
        raise ConfigError(
            f"the role of OUTBOX_DATABASE_URL may not use the outbox schema in "
            f"{db.describe(database_url)}: grant it pgoutbox_relay"
        ) from exc
    except BaseException:
        await conn.close()
        raise
    if wire_times:
        conn.adapters.register_loader("timestamptz", WireTimeLoader)
    return conn


def _lost(exc: Exception) -> DatabaseUnavailable:
    """One line for a connection lost during a call (libpq's text can span lines)."""
    reason = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return DatabaseUnavailable(f"PostgreSQL connection lost: {reason or type(exc).__name__}")


class OutboxCalls:
    """One lazily (re)opened connection and the relay's SQL calls on it."""

    def __init__(
        self, database_url: str | None, purpose: str, *, synchronous_commit: bool = True, wire_times: bool = False
    ):
        self.database_url = database_url
        self.purpose = purpose
        self.synchronous_commit = synchronous_commit
        self.wire_times = wire_times
        self._conn: psycopg.AsyncConnection | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _run(self, query: str, params: tuple = (), *, rows: bool = False) -> Any:
        if not self.connected:
            self._conn = await open_connection(
                self.database_url,
                synchronous_commit=self.synchronous_commit,
                wire_times=self.wire_times,
                row_factory=dict_row,
            )
            # Ids only travel from a claim to the wire and back to a mark:
            # text avoids building (and re-formatting) a UUID object per id.
            self._conn.adapters.register_loader("uuid", TextLoader)
            self._conn.add_notice_handler(_log_warning)
            log.info("connected to PostgreSQL", extra={"action": "db_connected", "purpose": self.purpose})
        try:
            with wrap_exceptions():
                cur = await self._conn.execute(query, params)
                return await cur.fetchall() if rows else (await cur.fetchone())
        except _CONNECTION_ERRORS as exc:
            await self.close()
            raise _lost(exc) from exc

    async def claim(self, worker: str, batch_size: int, lease: float) -> list[dict]:
        return await self._run(
            f"SELECT {CLAIMED_COLUMNS} FROM outbox.claim(%s, %s, %s)",
            (worker, batch_size, timedelta(seconds=lease)),
            rows=True,
        )

    async def mark_published(self, claim_token, event_ids: list) -> int:
        row = await self._run("SELECT outbox.mark_published(%s::uuid, %s::uuid[]) AS n", (claim_token, event_ids))
        return row["n"]

    async def mark_failed(
        self, claim_token, event_ids: list, errors: list[str], retry_at: list[datetime | None]
    ) -> int:
        row = await self._run(
            "SELECT outbox.mark_failed(%s::uuid, %s::uuid[], %s, %s::timestamptz[]) AS n",
            (claim_token, event_ids, errors, retry_at),
        )
        return row["n"]

    async def backlog(self) -> list[dict]:
        return await self._run("SELECT * FROM outbox.backlog()", rows=True)

    async def notify_throttle(self) -> float:
        row = await self._run("SELECT outbox.notify_throttle() AS gap")
        return row["gap"].total_seconds()

    async def create_partitions(self, days_ahead: int) -> list[str]:
        rows = await self._run("SELECT p AS name FROM outbox.create_partitions(%s) AS p", (days_ahead,), rows=True)
        return [r["name"] for r in rows]

    async def schema_version(self) -> int:
        return (await self._run("SELECT outbox.schema_version() AS v"))["v"]
