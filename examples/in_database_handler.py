"""An in-database handler, runnable: it keeps a running total of orders per
customer in `shop.order_totals`, and records each event in the inbox in the
SAME transaction as that business change (logical exactly-once).
A duplicate delivery, whenever it comes, changes nothing.

    OUTBOX_DATABASE_URL=postgresql://... OUTBOX_NATS_URL=nats://... \\
        python examples/in_database_handler.py [--idle-exit SECONDS]

It reads `sea.event.order_created.v1` from the SEA_EVENTS stream through its
own durable `order_totals`, a fetch of up to 64 messages at a time, and
handles each fetch in ONE transaction (handle_batch_in_transaction): the
inbox rows are written once, already PROCESSED, with the business changes,
and the fetch is acked after the commit. When one message's change fails,
the fetch rolls back and each message is handled again on its own, so only
that one fails. It prints one JSON line per delivery. With
--idle-exit N it exits (code 0) once N seconds have passed without a message;
without it, it runs until interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import nats
import nats.errors
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig

from pgoutbox.core import wire
from pgoutbox.inbox.in_database import handle_batch_in_transaction

HANDLER = "order_totals"
STREAM, SUBJECT = "SEA_EVENTS", "sea.event.order_created.v1"
MAX_DELIVER, RETRY_DELAY, FETCH = 3, 0.2, 64

SETUP = """
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE IF NOT EXISTS shop.order_totals (
    customer text PRIMARY KEY,
    total numeric NOT NULL,
    orders integer NOT NULL
);
"""


async def add_order(conn: psycopg.AsyncConnection, envelope: dict) -> None:
    """The business change. A negative total is a business error: nothing of
    this delivery is kept, neither the total nor the inbox marker."""
    payload = envelope["payload"]
    await conn.execute(
        """INSERT INTO shop.order_totals AS t (customer, total, orders) VALUES (%s, %s, 1)
           ON CONFLICT (customer) DO UPDATE SET total = t.total + excluded.total, orders = t.orders + 1""",
        (payload["customer"], payload["total"]),
    )
    if payload["total"] < 0:
        raise ValueError(f"negative order total {payload['total']}")


async def main(idle_exit: float | None) -> int:
    conn = await psycopg.AsyncConnection.connect(os.environ.get("OUTBOX_DATABASE_URL", ""), autocommit=True)
    await conn.execute(SETUP)
    nc = await nats.connect(os.environ.get("OUTBOX_NATS_URL", "nats://127.0.0.1:4222"))
    js = nc.jetstream()
    await js.add_consumer(
        STREAM,
        ConsumerConfig(
            durable_name=HANDLER,
            ack_policy=AckPolicy.EXPLICIT,
            filter_subject=SUBJECT,
            max_deliver=MAX_DELIVER,
            ack_wait=30,
        ),
    )
    sub = await js.pull_subscribe_bind(HANDLER, STREAM)
    last_message = time.monotonic()
    while (left := _idle_left(idle_exit, last_message)) > 0:
        try:
            msgs = await sub.fetch(FETCH, timeout=min(0.5, max(left, 0.05)))
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        await handle_fetch(conn, msgs)
        last_message = time.monotonic()  # idle time counts from the end of the last delivery handled
    await nc.close()
    await conn.close()
    return 0


async def handle_fetch(conn: psycopg.AsyncConnection, msgs: list) -> None:
    """One transaction for the fetch; each message acked after the commit, or
    nak'ed for a retry when its change failed (acked on its last delivery:
    dead-lettered in the inbox, inbox.dead_letters() lists it)."""
    taken, envelopes = [], []
    for msg in msgs:
        try:
            envelopes.append(wire.from_nats(msg.subject, msg.data, msg.headers))
            taken.append(msg)
        except wire.InvalidMessage as exc:  # no usable id: it cannot enter the inbox
            await msg.term()
            _print({"message_id": None, "delivery": msg.metadata.num_delivered, "outcome": f"refused: {exc}"})
    if not taken:
        return
    deliveries = [msg.metadata.num_delivered for msg in taken]
    recorded = True
    try:
        outcomes = await handle_batch_in_transaction(
            conn, HANDLER, envelopes, add_order, last_deliveries=[d >= MAX_DELIVER for d in deliveries]
        )
    except psycopg.Error as exc:  # the connection failed: nothing could be recorded
        outcomes, recorded = [exc] * len(taken), False
    for msg, envelope, delivery, outcome in zip(taken, envelopes, deliveries, outcomes, strict=True):
        if not isinstance(outcome, Exception):
            await msg.ack()  # only after the commit
        elif recorded and delivery >= MAX_DELIVER:
            await msg.ack()  # the inbox holds it as a dead letter
        else:
            await msg.nak(delay=RETRY_DELAY)
        text = outcome if isinstance(outcome, str) else f"failed: {outcome}"
        _print({"message_id": envelope["message_id"], "delivery": delivery, "outcome": text})


def _print(line: dict) -> None:
    print(json.dumps(line), flush=True)


def _idle_left(idle_exit: float | None, last_message: float) -> float:
    """Seconds until --idle-exit is due (always positive without it). Wall-clock time, so a
    slow fetch does not stretch N."""
    return 1.0 if idle_exit is None else idle_exit - (time.monotonic() - last_message)


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--idle-exit", type=_seconds, metavar="N", help="exit (code 0) after N seconds without a message"
    )
    sys.exit(asyncio.run(main(parser.parse_args().idle_exit)))
