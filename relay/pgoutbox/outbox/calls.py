"""The relay's calls to the SQL API, over a session from a db.Pool that is
replaced after PostgreSQL went away (restart, failover, network). Only
function calls: the rules live in the database.

A call that fails because the server is unreachable raises DatabaseUnavailable
(the caller decides whether to retry); every (re)connection re-checks the
schema version (the pool's check), so a relay never runs against a schema it
does not know.

Claimed rows are read so that no value can fail the fetch: ids, payload and
headers as text, and timestamps as the wire text built from PostgreSQL's own
rendering (wire.wire_time), or a marker for values that have none
(±infinity, BC, years past 9999, which psycopg cannot load as datetimes).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.rows import dict_row
from psycopg.types.string import TextLoader

from pgoutbox.core import db, wire
from pgoutbox.core.errors import ConfigError, DatabaseUnavailable, PgOutboxError, SchemaMismatch, wrap_exceptions

__all__ = ["CLAIMED_COLUMNS", "WAKEUP_CHANNEL", "DatabaseUnavailable", "OutboxCalls", "WireTimeLoader", "pool"]

log = logging.getLogger(__name__)

# The columns the wire envelope needs (wire.to_nats), plus the claim token,
# attempts and created_at (the emitting transaction's time, from which the
# relay measures how long an event waited in the outbox); decoding fewer columns keeps claiming cheap. payload and
# headers come as jsonb text: the payload goes on the wire as PostgreSQL
# renders it (exact numbers, no decode/encode round trip through Python).
CLAIMED_COLUMNS = (
    "claim_token, event_id, context, subject, payload::text AS payload, headers::text AS headers, "
    "aggregate_type, aggregate_id, event_type, event_version, correlation_id, causation_id, "
    "tenant_id, ordering_key, occurred_at, created_at, attempts"
)
WAKEUP_CHANNEL = "outbox_v1"  # sql/15_outbox_wakeup.sql


def _log_warning(diag: psycopg.errors.Diagnostic) -> None:
    """PostgreSQL's RAISE WARNING (e.g. from create_partitions) into our logs."""
    if diag.severity_nonlocalized == "WARNING":
        log.warning("PostgreSQL: %s", diag.message_primary, extra={"action": "db_warning", "hint": diag.message_hint})


class WireTimeLoader(Loader):
    """timestamptz -> wire text or wire.Unrepresentable; never raises (a
    value Python's datetime cannot hold would otherwise fail the whole fetch)."""

    def load(self, data: Buffer) -> str | wire.Unrepresentable:
        return wire.wire_time(bytes(data).decode())


def pool(
    database_url: str | None, purpose: str, *, synchronous_commit: bool = True, wire_times: bool = False
) -> db.Pool:
    """One long-lived session for one stage of the relay (a db.Pool of one):
    its prepared statements (psycopg prepares a query run often enough)
    live as long as the session. Login refused, database missing and server
    unreachable all raise DatabaseUnavailable: libpq gives them no SQLSTATE
    to tell them apart."""
    options = {}
    if not synchronous_commit:
        options["synchronous_commit"] = "off"
    if wire_times:  # the rendering WireTimeLoader's fast path expects
        options.update(TimeZone="UTC", DateStyle="ISO")

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        conn.row_factory = dict_row
        # Ids only travel from a claim to the wire and back to a mark:
        # text avoids building (and re-formatting) a UUID object per id.
        conn.adapters.register_loader("uuid", TextLoader)
        if wire_times:
            conn.adapters.register_loader("timestamptz", WireTimeLoader)
        conn.add_notice_handler(_log_warning)

    def refused(exc: psycopg.Error) -> PgOutboxError | None:
        if isinstance(exc, (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName)):
            return SchemaMismatch(f"no pgoutbox schema in {db.describe(database_url)}: run `pgoutbox migrate`")
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return ConfigError(
                f"the role of OUTBOX_DATABASE_URL may not use the outbox schema in "
                f"{db.describe(database_url)}: grant it pgoutbox_relay"
            )
        return None

    return db.Pool(database_url, name=f"relay-{purpose}", options=options, configure=configure, refused=refused)


class OutboxCalls:
    """The relay's SQL calls on a connection held from a pool of its own
    (given back, and so replaced, when it breaks)."""

    def __init__(
        self, database_url: str | None, purpose: str, *, synchronous_commit: bool = True, wire_times: bool = False
    ):
        self.purpose = purpose
        self.pool = pool(database_url, purpose, synchronous_commit=synchronous_commit, wire_times=wire_times)
        self._conn: psycopg.AsyncConnection | None = None
        self._getting = asyncio.Lock()  # concurrent calls (the monitor's two loops) share the one session

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def _give_back(self, conn: psycopg.AsyncConnection | None) -> None:
        if conn is not None and conn is self._conn:  # not one a concurrent call got since
            self._conn = None
            await self.pool.putconn(conn)

    async def close(self) -> None:
        await self._give_back(self._conn)
        await self.pool.close()

    async def _run(self, query: str, params: tuple[Any, ...] = (), *, rows: bool = False) -> Any:
        conn = self._conn
        if conn is None:
            async with self._getting:
                if self._conn is None:
                    self._conn = await self.pool.getconn()
                    log.info("connected to PostgreSQL", extra={"action": "db_connected", "purpose": self.purpose})
                conn = self._conn
        try:
            with wrap_exceptions():
                cur = await conn.execute(query, params)
                return await cur.fetchall() if rows else (await cur.fetchone())
        except psycopg.Error as exc:
            if conn.broken or conn.closed or db.is_connection_error(exc):
                await self._give_back(conn)
                raise self.pool.lost(exc) from exc
            raise
        except BaseException:
            if conn.broken or conn.closed:  # e.g. cancelled in the middle of a call
                await self._give_back(conn)
            raise

    async def claim(self, worker: str, batch_size: int, lease: float) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = await self._run(
            f"SELECT {CLAIMED_COLUMNS} FROM outbox.claim(%s, %s, %s)",
            (worker, batch_size, timedelta(seconds=lease)),
            rows=True,
        )
        return rows

    async def mark_published(self, claim_token: Any, event_ids: list[Any]) -> int:
        row = await self._run("SELECT outbox.mark_published(%s::uuid, %s::uuid[]) AS n", (claim_token, event_ids))
        return int(row["n"])

    async def mark_failed(
        self, claim_token: Any, event_ids: list[Any], errors: list[str], retry_at: list[datetime | None]
    ) -> int:
        row = await self._run(
            "SELECT outbox.mark_failed(%s::uuid, %s::uuid[], %s, %s::timestamptz[]) AS n",
            (claim_token, event_ids, errors, retry_at),
        )
        return int(row["n"])

    async def hand_back(self, claim_token: Any, event_ids: list[Any], reason: str) -> int:
        row = await self._run(
            "SELECT outbox.hand_back(%s::uuid, %s::uuid[], %s) AS n", (claim_token, event_ids, reason)
        )
        return int(row["n"])

    async def backlog(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = await self._run("SELECT * FROM outbox.backlog()", rows=True)
        return rows

    async def next_scheduled(self) -> float | None:
        """Seconds until the next scheduled event falls due (None: none waits),
        by the database's clock, as claim compares it."""
        row = await self._run(
            "SELECT extract(epoch FROM outbox.next_scheduled() - clock_timestamp())::float8 AS seconds"
        )
        return None if row["seconds"] is None else float(row["seconds"])

    async def oldest_snapshot(self) -> tuple[float, int]:
        """(seconds, xids): the age of the oldest snapshot holding back vacuum
        (outbox.oldest_snapshots: a slot's has no time, so seconds come from
        the sessions and prepared transactions); (0, 0) when none."""
        row = await self._run(
            "SELECT coalesce(max(s.age_seconds), 0) AS seconds, coalesce(max(s.age_xids), 0) AS xids"
            " FROM outbox.oldest_snapshots(10000) AS s"
        )
        return float(row["seconds"]), int(row["xids"])

    async def notify_throttle(self) -> float:
        row = await self._run("SELECT outbox.notify_throttle() AS gap")
        return float(row["gap"].total_seconds())

    async def create_partitions(self, days_ahead: int) -> list[str]:
        rows = await self._run("SELECT p AS name FROM outbox.create_partitions(%s) AS p", (days_ahead,), rows=True)
        return [r["name"] for r in rows]

    async def schema_version(self) -> int:
        return int((await self._run("SELECT outbox.schema_version() AS v"))["v"])
