"""Poison events: rows whose content no relay can publish. Each must end
DEAD_LETTER with a code at the start of last_error, at once, while the other
events of its batch are published, the relay keeps running, and the events
emitted after it are published promptly.

Poison rows are written the way an earlier pgoutbox version or an owner
with `SET session_replication_role = replica` could have written them:
straight into outbox.events, around emit() and the INSERT policy trigger,
so these tests do not depend on what emit() refuses."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgoutbox.core import wire
from pgoutbox.outbox.publisher import MAX_DETAIL
from support.outbox import (
    RelayProcess,
    apply_streams,
    emit,
    msg_ids,
    relay_config,
    running_relay,
    status_counts,
    stream_messages,
)
from support.waiting import until, wait_for

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def insert_raw(url: str, **columns) -> str:
    """One event written around emit() (the policy trigger does not fire):
    every NOT NULL column given here, subject included. Returns its event_id."""
    row = {
        "event_id": str(uuid.uuid4()),
        "context": "sea",
        "aggregate_type": "order",
        "aggregate_id": "1",
        "event_type": "order_created",
        "event_version": 1,
        "subject": "sea.event.order_created.v1",
        "payload": Jsonb({"schema_version": 1}),
        "headers": Jsonb({}),
        "occurred_at": "now",
        "created_at": "now",
        "available_at": "now",
    }
    row.update(columns)
    names = ", ".join(row)
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute(
                f"INSERT INTO outbox.events ({names}) VALUES ({', '.join(['%s'] * len(row))})", list(row.values())
            )
    return row["event_id"]


# (columns of the poison row, code expected at the start of last_error)
POISON = {
    "occurred_at -infinity": ({"occurred_at": "-infinity"}, "BAD_TIMESTAMP"),
    "occurred_at infinity": ({"occurred_at": "infinity"}, "BAD_TIMESTAMP"),
    "occurred_at year 10000": ({"occurred_at": "10000-01-01 00:00:00+00"}, "BAD_TIMESTAMP"),
    "occurred_at BC": ({"occurred_at": "0044-03-15 12:00:00+00 BC"}, "BAD_TIMESTAMP"),
    "header value injecting a header": ({"headers": Jsonb({"x": "a\r\nNats-Rollup: all"})}, "BAD_HEADER"),
    "header value with LF": ({"headers": Jsonb({"x": "a\nb"})}, "BAD_HEADER"),
    "header value with edge spaces": ({"headers": Jsonb({"x": " padded "})}, "BAD_HEADER"),
    "header name with a space": ({"headers": Jsonb({"bad name": "v"})}, "BAD_HEADER"),
    "header name with a colon": ({"headers": Jsonb({"a:b": "v"})}, "BAD_HEADER"),
    "empty header name": ({"headers": Jsonb({"": "v"})}, "BAD_HEADER"),
    "nats-msg-id in lower case": ({"headers": Jsonb({"nats-msg-id": str(uuid.uuid4())})}, "BAD_HEADER"),
    "Nats-Msg-Id": ({"headers": Jsonb({"Nats-Msg-Id": str(uuid.uuid4())})}, "BAD_HEADER"),
    "NATS-ROLLUP": ({"headers": Jsonb({"NATS-ROLLUP": "all"})}, "BAD_HEADER"),
    "Nats-Expected-Stream": ({"headers": Jsonb({"Nats-Expected-Stream": "OTHER"})}, "BAD_HEADER"),
    "pgoutbox-context in lower case": ({"headers": Jsonb({"pgoutbox-context": "other"})}, "BAD_HEADER"),
    "Status": ({"headers": Jsonb({"Status": "404"})}, "BAD_HEADER"),
    "traceparent not ASCII": ({"headers": Jsonb({"traceparent": "00-\u00e9\x7f-01"})}, "BAD_HEADER"),
    "headers not an object": ({"headers": Jsonb(["a", "b"])}, "BAD_HEADER"),
    "aggregate_id injecting a header": ({"aggregate_id": "42\r\nNats-Msg-Id: forged"}, "BAD_HEADER"),
    "tenant_id with a trailing space": ({"tenant_id": "t1 "}, "BAD_HEADER"),
    "no subject": ({"subject": None}, "BAD_SUBJECT"),
    "subject of another event type": ({"subject": "sea.event.other.v1"}, "BAD_SUBJECT"),
    "context with a space": ({"context": "se a", "subject": "se a.event.order_created.v1"}, "BAD_SUBJECT"),
    "wildcard subject": ({"context": "*", "subject": "*.event.order_created.v1"}, "BAD_SUBJECT"),
    # Past the server's max_control_line, the PUB line would cost the relay its connection.
    "subject of 5000 characters": (
        {"context": "c" * 4978, "subject": "c" * 4978 + ".event.order_created.v1"},
        "BAD_SUBJECT",
    ),
    "payload an array": ({"payload": Jsonb([1, 2])}, "BAD_PAYLOAD"),
    "payload null": ({"payload": Jsonb(None)}, "BAD_PAYLOAD"),
}


# Extreme but expressible, or in columns the wire does not carry: published.
FINE = {
    "occurred_at year 1": {"occurred_at": "0001-01-01 00:00:00+00"},
    "occurred_at 9999-12-31": {"occurred_at": "9999-12-31 23:59:59.999999+00"},
    "created_at infinity": {"created_at": "infinity"},
    "created_at -infinity": {"created_at": "-infinity"},
    "available_at -infinity": {"available_at": "-infinity"},
    "control characters inside values": {"headers": Jsonb({"x": "a\tb\x01c"}), "aggregate_id": "4\x7f2"},
    "null header value (absent)": {"headers": Jsonb({"traceparent": TRACEPARENT, "baggage": None})},
}


def rows(url: str, ids) -> dict[str, tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {
            r[0]: r[1:]
            for r in conn.execute(
                "SELECT event_id::text, status, last_error, attempts FROM outbox.events WHERE event_id = ANY(%s::uuid[])",
                (list(ids),),
            ).fetchall()
        }


def assert_settled(url: str, poison: dict[str, tuple[str, str]], fine: list[str]) -> None:
    """poison: event_id -> (name, code). Each poison event DEAD_LETTER after one
    attempt with its code; every other event COMPLETED; nothing in flight."""
    found = rows(url, list(poison) + fine)
    for event_id, (name, code) in poison.items():
        status, error, attempts = found[event_id]
        assert (status, attempts) == ("DEAD_LETTER", 1), f"{name}: {found[event_id]}"
        assert error.startswith(f"{code}: "), f"{name}: {error!r}"
        assert "\x00" not in error and len(error) < MAX_DETAIL + 100
    for event_id in fine:
        assert found[event_id][0] == "COMPLETED", (event_id, found[event_id])
    assert "PROCESSING" not in status_counts(url)


def settled(url: str, n: int):
    def check():
        counts = status_counts(url)
        return "PROCESSING" not in counts and "PENDING" not in counts and sum(counts.values()) == n

    return check


def unsettled(url: str) -> str:
    """The events not yet COMPLETED or DEAD_LETTER, for a failure's message."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, status, attempts, left(last_error, 200) FROM outbox.events"
            " WHERE status NOT IN ('COMPLETED', 'DEAD_LETTER', 'FAILED') ORDER BY id"
        ).fetchall()
    return f"{len(rows)} unsettled: {rows[:10]}"


@pytest.mark.slow
def test_poison_rows_dead_letter_and_the_relay_process_keeps_publishing(database_url, nats_server, tmp_path):
    """The issue's case, with a real `pgoutbox relay`: poison rows among
    ordinary events in the same claims; then more ordinary events."""
    asyncio.run(apply_streams(nats_server.url))
    before = emit(database_url, 20)
    poison: dict[str, tuple[str, str]] = {}
    fine: list[str] = []
    for i, (name, (columns, code)) in enumerate(POISON.items()):
        poison[insert_raw(database_url, **{"aggregate_id": str(i), **columns})] = (name, code)
        fine += emit(database_url, 1, start=100 + i)  # poison and ordinary events interleaved in id order
    for columns in FINE.values():
        fine.append(insert_raw(database_url, **columns))
    total = len(before) + len(poison) + len(fine)
    relay = RelayProcess(
        tmp_path, "relay-poison", database_url, nats_server.url, relay_batch_size="16", relay_poll_interval="200ms"
    )
    try:
        relay.start().wait_started()
        wait_for(
            settled(database_url, total),
            30,
            "every event COMPLETED or DEAD_LETTER",
            detail=lambda: unsettled(database_url) + "\n" + relay.output()[-3000:],
        )
        assert relay.proc.poll() is None, relay.output()
        assert_settled(database_url, poison, before + fine)
        # Ordinary events emitted after the poison ones: published, the poison holds nothing back.
        after = emit(database_url, 50, start=1000)
        wait_for(settled(database_url, total + 50), 60, "the events emitted after the poison ones")
        assert_settled(database_url, poison, before + fine + after)
        assert relay.proc.poll() is None
        dead = [e for e in relay.log_entries() if e.get("action") == "dead_letter"]
        assert sorted(e["event_id"] for e in dead) == sorted(poison)
        assert "Traceback" not in relay.output()
        assert relay.terminate(timeout=20) == 0
    finally:
        relay.stop()
    in_stream = msg_ids(asyncio.run(stream_messages(nats_server.url)))
    assert sorted(in_stream) == sorted(before + fine + after)  # no poison event, every other one once


async def test_the_wire_carries_extreme_but_expressible_times_exactly(database_url, nats_server):
    await apply_streams(nats_server.url)
    times = {
        "0001-01-01 00:00:00+00": "0001-01-01T00:00:00Z",
        "9999-12-31 23:59:59.999999+00": "9999-12-31T23:59:59.999999Z",
        "2024-02-29 12:00:00.5+00": "2024-02-29T12:00:00.500000Z",
        "2024-02-29 23:30:00-02": "2024-03-01T01:30:00Z",
    }
    ids = {insert_raw(database_url, occurred_at=t): text for t, text in times.items()}
    [emitted] = emit(database_url, 1)
    with psycopg.connect(database_url, autocommit=True) as conn:
        at = conn.execute("SELECT occurred_at FROM outbox.events WHERE event_id = %s", (emitted,)).fetchone()[0]
        # A session time zone far from UTC must not leak into the wire text.
        conn.execute("ALTER DATABASE " + conn.info.dbname + " SET timezone TO 'Asia/Kathmandu'")
    ids[emitted] = at.astimezone(UTC).isoformat().replace("+00:00", "Z")  # as before this change
    # not default: the poison rows come back through the poll (no wake-up for them)
    async with running_relay(relay_config(database_url, nats_server.url, poll_interval="200ms")):
        await until(lambda: status_counts(database_url) == {"COMPLETED": len(ids)}, 15, "all COMPLETED")
    got = {m.headers["Nats-Msg-Id"]: m.headers["Pgoutbox-Occurred-At"] for m in await stream_messages(nats_server.url)}
    assert got == ids


async def test_an_unexpected_encoding_failure_is_that_events_dead_letter(database_url, nats_server, monkeypatch):
    await apply_streams(nats_server.url)
    ids = emit(database_url, 10)
    doomed = ids[4]
    real = wire.to_nats

    def to_nats(event, *args):
        if event["event_id"] == doomed:
            raise RuntimeError("injected: the encoder has a bug")
        return real(event, *args)

    monkeypatch.setattr(wire, "to_nats", to_nats)
    async with running_relay(relay_config(database_url, nats_server.url)) as relay:
        await until(settled(database_url, 10), 15, "all settled")
        assert not relay.stopping.is_set()
        later = emit(database_url, 5, start=10)
        await until(settled(database_url, 15), 10, "later events")
    assert_settled(database_url, {doomed: ("injected", "ENCODE_FAILED")}, [i for i in ids if i != doomed] + later)
    assert rows(database_url, [doomed])[doomed][1] == "ENCODE_FAILED: RuntimeError: injected: the encoder has a bug"


# -- the encoder alone ---------------------------------------------------------


def test_poison_inserts_bypass_the_policy_trigger(database_url):
    """The helper really writes rows that emit() would never have written."""
    event_id = insert_raw(database_url, occurred_at="-infinity", subject=None)
    with psycopg.connect(database_url, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT occurred_at::text, subject, status FROM outbox.events WHERE event_id = %s", (event_id,)
        )
        assert cur.fetchone() == ("-infinity", None, "PENDING")
        # ...and that the default loaders cannot read (the fetch that used to kill the relay).
        with pytest.raises(psycopg.DataError):
            conn.execute("SELECT occurred_at FROM outbox.events WHERE event_id = %s", (event_id,)).fetchone()


def test_backlog_counts_a_stored_row_whose_available_at_is_minus_infinity(database_url):
    """Interval has no infinity: the age of such a row is bounded, not an error (22008 before)."""
    insert_raw(database_url, available_at="-infinity")
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT due, oldest_due_age > interval '100 years' FROM outbox.backlog('sea')").fetchone()
    assert row == (1, True)
