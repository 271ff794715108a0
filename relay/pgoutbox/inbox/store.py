"""The consumer's calls into the inbox: nothing but the SQL functions of
sql/50_inbox.sql and sql/60_inbox_replay.sql, over a db.Pool of
autocommit connections (each call is its own transaction unless the caller
opens one, as the replayer does); a lost connection raises DatabaseUnavailable."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgoutbox.core import db
from pgoutbox.core.errors import (
    DatabaseUnavailable,
    IllegalTransition,
    PgOutboxError,
    SchemaMismatch,
    SqlState,
    wrap_exceptions,
)

# The first schema with inbox.receive_batch() and inbox.settle(); on an older
# one (7 or 8) the consumer records and settles message by message.
BATCHES_FROM = 9
# The first schema that counts handler failures (dlq_metadata.failures) and
# has inbox.record_in_database_error().
FAILURES_FROM = 12
# The first schema with upcasters (inbox.receive_batch_as, inbox.upcast).
UPCASTS_FROM = 15
# The first schema where a dead letter names its DLQ notice (inbox.record_dlq_notice).
NOTICES_FROM = 17

_NO_SCHEMA = frozenset({"42883", "3F000"})  # undefined_function, invalid_schema_name
_PERMISSION_DENIED = "42501"


class ClaimedReplays(list[dict[str, Any]]):
    """The rows inbox.claim_replays() moved to RECEIVED, and the connection of
    the transaction that claimed them (to park a row that cannot be replayed)."""

    def __init__(self, rows: list[dict[str, Any]], conn: psycopg.AsyncConnection):
        super().__init__(rows)
        self.conn = conn

    async def park(self, row: dict[str, Any], error: str) -> None:
        """Back to DEAD_LETTER, without a next replay, in the claiming transaction."""
        await record_error(self.conn, str(row["message_id"]), row["handler"], error, dead=True)


def pool(database_url: str | None, size: int) -> db.Pool:
    """The consumer's connections: `size` autocommit sessions, each checked
    against the schema version when it connects."""

    def refused(exc: psycopg.Error) -> PgOutboxError | None:
        if exc.sqlstate in _NO_SCHEMA:
            return SchemaMismatch(f"no pgoutbox schema at {db.describe(database_url)}: run `pgoutbox migrate`")
        if exc.sqlstate == _PERMISSION_DENIED:
            denied = DatabaseUnavailable(
                f"permission denied at {db.describe(database_url)}: the login needs "
                "`GRANT pgoutbox_consumer TO <login>`"
            )
            denied.retryable = False
            return denied
        return None

    return db.Pool(database_url, name="inbox", size=size, refused=refused)


async def _one(conn: psycopg.AsyncConnection, query: str, params: tuple[Any, ...]) -> dict[str, Any]:
    async with conn.cursor(row_factory=dict_row) as cur:
        with wrap_exceptions():
            await cur.execute(query, params)
            row = await cur.fetchone()
    assert row is not None  # each inbox function returns one row
    return row


# The inbox functions on a given connection, inside whatever transaction it
# has open: in-database handlers call them in their business transaction.
async def receive(
    conn: psycopg.AsyncConnection[Any], message_id: str, handler: str, subject: str, envelope: dict[str, Any] | None
) -> dict[str, Any]:
    return await _one(
        conn,
        "SELECT * FROM inbox.receive(%s, %s, %s, %s)",
        (message_id, handler, subject, None if envelope is None else Jsonb(envelope)),
    )


async def mark_processed(conn: psycopg.AsyncConnection[Any], message_id: str, handler: str) -> dict[str, Any]:
    return await _one(conn, "SELECT * FROM inbox.mark_processed(%s, %s)", (message_id, handler))


async def record_error(
    conn: psycopg.AsyncConnection[Any],
    message_id: str,
    handler: str,
    error: str,
    *,
    dead: bool = False,
    replay_after: float | None = None,
) -> dict[str, Any]:
    after = None if replay_after is None else timedelta(seconds=replay_after)
    return await _one(
        conn, "SELECT * FROM inbox.record_error(%s, %s, %s, %s, %s)", (message_id, handler, error, dead, after)
    )


async def record_dlq_notice(
    conn: psycopg.AsyncConnection[Any], message_id: str, handler: str, stream: str, sequence: int
) -> bool:
    row = await _one(
        conn, "SELECT inbox.record_dlq_notice(%s, %s, %s, %s) AS recorded", (message_id, handler, stream, sequence)
    )
    return bool(row["recorded"])


async def record_in_database_error(
    conn: psycopg.AsyncConnection[Any],
    message_id: str,
    handler: str,
    subject: str,
    envelope: dict[str, Any] | None,
    error: str,
    *,
    dead: bool,
) -> dict[str, Any]:
    return await _one(
        conn,
        "SELECT * FROM inbox.record_in_database_error(%s, %s, %s, %s, %s, %s)",
        (message_id, handler, subject, None if envelope is None else Jsonb(envelope), error, dead),
    )


def failures(row: dict[str, Any], counted: bool) -> int:
    """Handler failures of an inbox row so far. `counted`: the schema counts
    them (FAILURES_FROM); on an older one, every earlier recorded delivery
    counts as one (a delivery cut short by a crash included)."""
    if counted:
        return int((row["dlq_metadata"] or {}).get("failures") or 0)
    return max(int(row["attempts"]) - 1, 0)


async def receive_batch(
    conn: psycopg.AsyncConnection[Any], handler: str, ids: list[str], subjects: list[str], envelopes: list[str]
) -> list[dict[str, Any]]:
    """inbox.receive_batch(): one row per message, in the order given;
    `envelopes` are JSON texts (serialised once by the caller)."""
    async with conn.cursor(row_factory=dict_row) as cur:
        with wrap_exceptions():
            await cur.execute(
                # %b: binary arrays (see receive_processed)
                "SELECT * FROM inbox.receive_batch(%s, %b::uuid[], %b::text[], %b::jsonb[])",
                (handler, ids, subjects, envelopes),
            )
            return await cur.fetchall()


async def receive_batch_as(
    conn: psycopg.AsyncConnection[Any],
    handler: str,
    ids: list[str],
    subjects: list[str],
    envelopes: list[str],
    version: int,
) -> list[dict[str, Any]]:
    """inbox.receive_batch_as(): receive_batch()'s rows plus, for each message
    to process, event_version (as it came), upcast_payload (JSON text, when it
    came older than `version`) or upcast_error (why it cannot be upcast)."""
    async with conn.cursor(row_factory=dict_row) as cur:
        with wrap_exceptions():
            await cur.execute(
                "SELECT * FROM inbox.receive_batch_as(%s, %b::uuid[], %b::text[], %b::jsonb[], %s)",
                (handler, ids, subjects, envelopes, version),
            )
            return await cur.fetchall()


async def upcast(
    conn: psycopg.AsyncConnection[Any], event_type: str, from_version: int, to_version: int, payload: dict[str, Any]
) -> dict[str, Any]:
    """inbox.upcast(): the payload as version to_version; raises PolicyViolation
    (SqlState.UPCAST_MISSING or UPCAST_FAILED) when the chain cannot."""
    async with conn.cursor() as cur:
        with wrap_exceptions():
            await cur.execute(
                "SELECT inbox.upcast(%s, %s, %s, %s)", (event_type, from_version, to_version, Jsonb(payload))
            )
            row = await cur.fetchone()
    assert row is not None
    result: dict[str, Any] = row[0]
    return result


async def settle(
    conn: psycopg.AsyncConnection[Any], handler: str, processed: list[str], failed: list[str], errors: list[str]
) -> set[str]:
    """inbox.settle(): the ids of the rows it moved."""
    async with conn.cursor() as cur:
        with wrap_exceptions():
            await cur.execute(
                "SELECT message_id::text FROM inbox.settle(%s, %s::uuid[], %s::uuid[], %s::text[])",
                (handler, processed, failed, errors),
            )
            return {row[0] for row in await cur.fetchall()}


async def receive_processed(
    conn: psycopg.AsyncConnection[Any], handler: str, ids: list[str], subjects: list[str], envelopes: list[str]
) -> list[tuple[int, str | None]]:
    """inbox.receive_processed(), in the caller's transaction: (ordinal,
    status) of each message it did not record, 1-based; none when it recorded
    them all. `envelopes` are JSON texts."""
    async with conn.cursor() as cur:
        with wrap_exceptions():
            await cur.execute(
                # %b: arrays in the binary format, sent as they are; in text,
                # psycopg escapes every quote of every JSON text in Python.
                "SELECT ordinal, status FROM inbox.receive_processed(%s, %b::uuid[], %b::text[], %b::jsonb[])",
                (handler, ids, subjects, envelopes),
            )
            return await cur.fetchall()


async def settles(call: Awaitable[Any]) -> bool:
    """Awaits an inbox move; False when the row was no longer RECEIVED/FAILED
    (ILLEGAL_TRANSITION): another delivery of the same message settled it."""
    try:
        await call
    except IllegalTransition as exc:
        if exc.code is not SqlState.ILLEGAL_TRANSITION:
            raise
        return False
    return True


# deadlock_detected, serialization_failure: the transaction rolled back, try again.
_RETRIED = frozenset({"40P01", "40001"})


class Settler:
    """Settles one handler's outcomes in batches (Inbox.settle_one): an
    outcome waits while the call before it runs, then goes with every other
    one that is ready in one inbox.settle() (one transaction). When nothing
    is running, an outcome goes at once: batching never adds a wait of its own."""

    def __init__(self, inbox: Inbox, handler: str):
        self.inbox = inbox
        self.handler = handler
        self._waiting: list[tuple[str, str | None, asyncio.Future[bool]]] = []
        self._running = False
        self._task: asyncio.Task[None] | None = None

    async def settle(self, message_id: str, error: str | None = None) -> bool:
        """PROCESSED (error None) or FAILED; False when the row was no longer
        RECEIVED/FAILED (another delivery settled it first)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((message_id, error, future))
        if not self._running:
            self._running = True
            self._task = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                items, self._waiting = self._waiting, []
                batch: list[tuple[str, str | None, asyncio.Future[bool]]] = []
                seen: set[str] = set()
                for item in items:
                    # The same id twice (two deliveries at once): the second waits for the next call.
                    (self._waiting if item[0] in seen else batch).append(item)
                    seen.add(item[0])
                processed = [m for m, error, _ in batch if error is None]
                failed = [(m, error) for m, error, _ in batch if error is not None]
                try:
                    moved = await self._settle(processed, failed)
                except Exception as exc:
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                except BaseException:
                    for _, _, future in batch:
                        future.cancel()
                    raise
                for message_id, _, future in batch:
                    if not future.done():
                        future.set_result(message_id in moved)
        finally:
            self._running = False

    async def _settle(self, processed: list[str], failed: list[tuple[str, str]]) -> set[str]:
        """inbox.settle(), tried again after a deadlock or serialization
        failure (two batches sharing ids, in another order: rolled back, nothing
        recorded), so that such a clash does not call the handlers again."""
        for attempt in range(3):
            try:
                return await self.inbox.settle(self.handler, processed, [m for m, _ in failed], [e for _, e in failed])
            except psycopg.Error as exc:
                if exc.sqlstate not in _RETRIED or attempt == 2:
                    raise
        raise AssertionError("unreachable")


class Inbox:
    """The same calls, each on a pooled connection in its own transaction.
    Which calls a schema has is decided here: on 7 and 8 (no
    inbox.receive_batch, no inbox.settle) receive_batch returns None and
    settle_one goes message by message."""

    def __init__(self, pool: db.Pool):
        self.pool = pool
        self._settlers: dict[str, Settler] = {}

    @property
    def batches(self) -> bool:
        """Whether the schema found has the batched calls (receive_batch, settle)."""
        return (self.pool.schema_found or 0) >= BATCHES_FROM

    @property
    def counts_failures(self) -> bool:
        """Whether the schema found counts handler failures (dlq_metadata.failures)."""
        return (self.pool.schema_found or 0) >= FAILURES_FROM

    def failures(self, row: dict[str, Any]) -> int:
        return failures(row, self.counts_failures)

    @property
    def upcasts(self) -> bool:
        """Whether the schema found has upcasters (inbox.receive_batch_as)."""
        return (self.pool.schema_found or 0) >= UPCASTS_FROM

    @property
    def names_notices(self) -> bool:
        """Whether the schema found records a dead letter's notice (inbox.record_dlq_notice)."""
        return (self.pool.schema_found or 0) >= NOTICES_FROM

    async def receive_batch(
        self, handler: str, ids: list[str], subjects: list[str], envelopes: list[str], version: int | None = None
    ) -> list[dict[str, Any]] | None:
        """inbox.receive_batch(), or None on a schema without it: receive() each.
        With a version: inbox.receive_batch_as(), which upcasts in the same call."""
        if version is not None:
            async with self.pool.connection() as conn:
                return await receive_batch_as(conn, handler, ids, subjects, envelopes, version)
        if not self.batches:
            return None
        async with self.pool.connection() as conn:
            return await receive_batch(conn, handler, ids, subjects, envelopes)

    async def settle_one(self, handler: str, message_id: str, error: str | None = None) -> bool:
        """PROCESSED (error None) or FAILED, batched with the handler's other
        outcomes that are ready (Settler); False when the row was no longer
        RECEIVED/FAILED (another delivery settled it first)."""
        if not self.batches:
            if error is None:
                return await settles(self.mark_processed(message_id, handler))
            return await settles(self.record_error(message_id, handler, error))
        settler = self._settlers.get(handler)
        if settler is None:
            settler = self._settlers[handler] = Settler(self, handler)
        return await settler.settle(message_id, error)

    async def settle(self, handler: str, processed: list[str], failed: list[str], errors: list[str]) -> set[str]:
        async with self.pool.connection() as conn:
            return await settle(conn, handler, processed, failed, errors)

    async def receive(self, message_id: str, handler: str, subject: str, envelope: dict[str, Any]) -> dict[str, Any]:
        async with self.pool.connection() as conn:
            return await receive(conn, message_id, handler, subject, envelope)

    async def mark_processed(self, message_id: str, handler: str) -> dict[str, Any]:
        async with self.pool.connection() as conn:
            return await mark_processed(conn, message_id, handler)

    async def record_error(
        self,
        message_id: str,
        handler: str,
        error: str,
        *,
        dead: bool = False,
        replay_after: float | None = None,
    ) -> dict[str, Any]:
        async with self.pool.connection() as conn:
            return await record_error(conn, message_id, handler, error, dead=dead, replay_after=replay_after)

    async def record_dlq_notice(self, message_id: str, handler: str, stream: str, sequence: int) -> bool:
        """Names the DLQ stream message (notice) of a dead letter; False when
        the schema predates it or the row is no longer a live dead letter."""
        if not self.names_notices:
            return False
        async with self.pool.connection() as conn:
            return await record_dlq_notice(conn, message_id, handler, stream, sequence)

    async def backlog(self) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            async with conn.cursor(row_factory=dict_row) as cur:
                with wrap_exceptions():
                    await cur.execute("SELECT * FROM inbox.backlog()")
                    return await cur.fetchall()

    async def schema_version(self) -> int:
        async with self.pool.connection() as conn:
            return int((await _one(conn, "SELECT outbox.schema_version() AS v", ()))["v"])

    @contextlib.asynccontextmanager
    async def claimed_replays(self, worker: str, batch_size: int) -> AsyncIterator[ClaimedReplays]:
        """Due replays, moved to RECEIVED in a transaction that commits when
        the block exits normally (after the caller re-published them) and
        rolls back otherwise (see inbox.claim_replays)."""
        async with self.pool.connection() as conn:
            async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                with wrap_exceptions():
                    await cur.execute("SELECT * FROM inbox.claim_replays(%s, %s)", (worker, batch_size))
                    rows = await cur.fetchall()
                yield ClaimedReplays(rows, conn)
