"""In-database handlers (logical exactly-once): an application that
processes an event in its own PostgreSQL database records the inbox marker
in the same transaction as its business change. Both commit, or neither:

    BEGIN;
    SELECT status FROM inbox.receive($message_id, 'order_totals', $subject, $envelope);
    -- PROCESSED: a duplicate, COMMIT and ack without doing anything
    UPDATE shop.order_totals SET ...;                      -- the business change
    SELECT inbox.mark_processed($message_id, 'order_totals');
    COMMIT;                                                 -- then ack the broker

A second delivery of the same message running at the same time waits on the
first one's uncommitted inbox row, then finds it PROCESSED. The connection's
role needs pgoutbox_consumer (the inbox functions are granted to it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from pgoutbox.inbox import store as inbox_store

Apply = Callable[[psycopg.AsyncConnection, dict[str, Any]], Awaitable[None]]


async def handle_in_transaction(
    conn: psycopg.AsyncConnection,
    handler: str,
    envelope: dict[str, Any],
    apply: Apply,
    *,
    last_delivery: bool = False,
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
            await apply(conn, envelope)
            await inbox_store.mark_processed(conn, message_id, handler)
        return "processed"
    except Exception as exc:
        if conn.broken:
            raise  # nothing can be recorded; the redelivery will tell
        async with conn.transaction():
            # The rolled-back transaction took a first delivery's row with it.
            await inbox_store.receive(conn, message_id, handler, subject, envelope)
            await inbox_store.record_error(
                conn, message_id, handler, f"{type(exc).__name__}: {exc}", dead=last_delivery
            )
        raise
