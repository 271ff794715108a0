"""In-database handlers (logical exactly-once): an application that
processes an event in its own PostgreSQL database records the inbox marker
in the same transaction as its business change. Both commit, or neither:

    BEGIN;
    SELECT status FROM inbox.receive($message_id, 'order_totals', $subject, $envelope);
    -- PROCESSED: a duplicate, COMMIT and ack without doing anything
    UPDATE shop.order_totals SET ...;                      -- the business change
    SELECT inbox.mark_processed($message_id, 'order_totals');
    COMMIT;                                                 -- then ack the broker

A whole fetch in one transaction (handle_batch_in_transaction) writes each
inbox row once, already PROCESSED, since it commits with the business change:

    BEGIN;
    SELECT ordinal, status FROM inbox.receive_processed('order_totals', $ids, $subjects, $envelopes);
    -- the messages returned were NOT recorded: duplicates (PROCESSED) or parked
    UPDATE shop.order_totals SET ...;                      -- for every other one
    COMMIT;                                                 -- then ack them all

A handler written for one payload version passes `version`: apply gets every
older payload upcast by inbox.upcast() in the same transaction (as_version);
a payload that cannot be (UPCAST_MISSING, UPCAST_FAILED) is dead-lettered at
once, since another delivery would fail the same way.

A second delivery of the same message running at the same time waits on the
first one's uncommitted inbox row, then finds it PROCESSED. The connection's
role needs pgoutbox_consumer (the inbox functions are granted to it).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from pgoutbox.core import db
from pgoutbox.core.errors import PolicyViolation, SqlState
from pgoutbox.inbox import store as inbox_store

Apply = Callable[[psycopg.AsyncConnection, dict[str, Any]], Awaitable[None]]


_UPCAST_ERRORS = frozenset({SqlState.UPCAST_MISSING, SqlState.UPCAST_FAILED})


async def as_version(conn: psycopg.AsyncConnection, envelope: dict[str, Any], version: int) -> dict[str, Any]:
    """The envelope with its payload as `version` (inbox.upcast(), on the
    caller's connection and transaction) and received_version, the version it
    came in at; the envelope itself when it came as `version`."""
    received = int(envelope["event_version"])
    if received == version:
        return envelope
    payload = await inbox_store.upcast(conn, envelope["event_type"], received, version, envelope["payload"])
    return {**envelope, "event_version": version, "payload": payload, "received_version": received}


def _dead_at_once(exc: Exception) -> bool:
    return isinstance(exc, PolicyViolation) and exc.code in _UPCAST_ERRORS


async def handle_in_transaction(
    conn: psycopg.AsyncConnection,
    handler: str,
    envelope: dict[str, Any],
    apply: Apply,
    *,
    last_delivery: bool = False,
    version: int | None = None,
) -> str:
    """Runs apply(conn, envelope), the business change, in one transaction
    with the inbox marker. Returns "processed", or "duplicate" / "parked"
    when the inbox already holds the message as PROCESSED / DEAD_LETTER (apply
    is not called). When apply raises, its changes and the marker roll back
    together, the error is recorded (FAILED; DEAD_LETTER on the last
    delivery) in a transaction of its own, and the exception propagates: do
    not ack."""
    message_id, subject = envelope["message_id"], envelope["subject"]
    try:
        async with conn.transaction():
            row = await inbox_store.receive(conn, message_id, handler, subject, envelope)
            if row["status"] == "PROCESSED":
                return "duplicate"
            if row["status"] == "DEAD_LETTER":
                return "parked"
            await apply(conn, envelope if version is None else await as_version(conn, envelope, version))
            await inbox_store.mark_processed(conn, message_id, handler)
        return "processed"
    except Exception as exc:
        if conn.broken or db.failure_of(exc) is db.Failure.AWAY:
            raise  # nothing can be recorded; the redelivery will tell
        error = f"{type(exc).__name__}: {exc}"
        last_delivery = last_delivery or _dead_at_once(exc)
        if await _schema(conn) >= inbox_store.FAILURES_FROM:
            # The rolled-back transaction took a first delivery's row with it:
            # one call records the delivery again and the failure, and marks
            # the row as an in-database one (never replayed to the consumer's
            # subject, nor redriven).
            await inbox_store.record_in_database_error(
                conn, message_id, handler, subject, envelope, error, dead=last_delivery
            )
        else:
            async with conn.transaction():
                await inbox_store.receive(conn, message_id, handler, subject, envelope)
                await inbox_store.record_error(conn, message_id, handler, error, dead=last_delivery)
        raise


async def handle_batch_in_transaction(
    conn: psycopg.AsyncConnection,
    handler: str,
    envelopes: list[dict[str, Any]],
    apply: Apply,
    *,
    last_deliveries: list[bool] | None = None,
    version: int | None = None,
) -> list[str | Exception]:
    """handle_in_transaction() for a whole fetch: one transaction records the
    batch in the inbox already PROCESSED (inbox.receive_processed: each row
    written once) and runs apply for each message it recorded, i.e. not
    PROCESSED / DEAD_LETTER before. Returns one outcome per envelope, in order: "processed",
    "duplicate", "parked", or the exception its apply raised (do not ack
    that one). When anything in the batch fails, the whole batch rolls back
    and each message goes through handle_in_transaction() on its own, so
    that one failure costs the others nothing but a second try. On a schema
    without the batched functions (7), it is message by message throughout."""
    lasts = last_deliveries or [False] * len(envelopes)
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE and await _has_batches(conn):
        try:
            return await _batch(conn, handler, envelopes, apply, version)
        except Exception as exc:
            if conn.broken or db.failure_of(exc) is db.Failure.AWAY:
                raise
    outcomes: list[str | Exception] = []
    for envelope, last in zip(envelopes, lasts, strict=True):
        try:
            outcomes.append(
                await handle_in_transaction(conn, handler, envelope, apply, last_delivery=last, version=version)
            )
        except Exception as exc:
            if conn.broken or db.failure_of(exc) is db.Failure.AWAY:
                raise
            outcomes.append(exc)
    return outcomes


# Per connection: its schema version (asked once).
_SCHEMA: weakref.WeakKeyDictionary[psycopg.AsyncConnection, int] = weakref.WeakKeyDictionary()


async def _schema(conn: psycopg.AsyncConnection) -> int:
    known = _SCHEMA.get(conn)
    if known is None:
        cur = await conn.execute("SELECT outbox.schema_version()")
        row = await cur.fetchone()
        known = _SCHEMA[conn] = row[0] if row is not None else 0
    return known


async def _has_batches(conn: psycopg.AsyncConnection) -> bool:
    return await _schema(conn) >= inbox_store.BATCHES_FROM


async def _batch(
    conn: psycopg.AsyncConnection, handler: str, envelopes: list[dict[str, Any]], apply: Apply, version: int | None
) -> list[str | Exception]:
    outcomes: list[str | Exception] = ["processed"] * len(envelopes)
    # Pipeline mode: the business changes of the batch go to the server
    # without waiting for each other's answers (an error still rolls back all).
    async with conn.pipeline(), conn.transaction():
        # The inbox rows are written PROCESSED at once (each row once): they
        # commit with the business changes below, or roll back with them.
        skipped = await inbox_store.receive_processed(
            conn,
            handler,
            [e["message_id"] for e in envelopes],
            [e["subject"] for e in envelopes],
            [_dumps(e) for e in envelopes],
        )
        for ordinal, status in skipped:
            # Not recorded: PROCESSED already (or the same id earlier in this
            # batch), or DEAD_LETTER.
            outcomes[ordinal - 1] = "parked" if status == "DEAD_LETTER" else "duplicate"
        for envelope, outcome in zip(envelopes, outcomes, strict=True):
            if outcome == "processed":
                await apply(conn, envelope if version is None else await as_version(conn, envelope, version))
    return outcomes


_dumps = json.JSONEncoder(separators=(",", ":")).encode
