"""A snapshot held by another session keeps vacuum from removing the RECEIVED
version every settled message leaves in messages_unprocessed_idx. The backlog
floor (inbox._backlog_floor) keeps inbox.backlog()'s walk short all the same,
without ever passing over a RECEIVED or FAILED message: one received by a
transaction that began long before, one that another transaction still has
uncommitted, a dead letter replayed. Each test runs the workers' calls as a
login in the group the docs give them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from support.roles import login
from support.waiting import wait_for

SUBJECT = "held.event.order_created.v1"


@contextmanager
def held_snapshot(url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(url, autocommit=True, application_name="monthly report") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")
        try:
            yield holder
        finally:
            holder.execute("ROLLBACK")


def receive(conn: psycopg.Connection, n: int, handler: str = "h") -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(n)]
    conn.execute("SELECT count(*) FROM inbox.receive_batch(%s, %s, %s, %s)", (handler, ids, [SUBJECT] * n, ["{}"] * n))
    return ids


def settle(conn: psycopg.Connection, ids: list[uuid.UUID], handler: str = "h") -> None:
    for i in range(0, len(ids), 10_000):
        conn.execute("SELECT count(*) FROM inbox.settle(%s, %s)", (handler, ids[i : i + 10_000]))


def backlog(conn: psycopg.Connection) -> dict[str, tuple[int, int, int]]:
    """handler -> (unprocessed, failed, dead_letter)."""
    rows = conn.execute("SELECT handler, unprocessed, failed, dead_letter FROM inbox.backlog()").fetchall()
    return {h: (u, f, d) for h, u, f, d in rows}


def floor_us(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT coalesce(pg_sequence_last_value('inbox.backlog_floor'), 0)").fetchone()[0]


def move_floor_past(consumer: psycopg.Connection, conn: psycopg.Connection, at_us: int) -> None:
    """Backlog calls, as the consumer's periodic ones, until the floor passes at_us."""

    def moved() -> bool:
        backlog(consumer)
        return floor_us(conn) > at_us

    wait_for(moved, 30, f"the backlog floor to pass {at_us}", interval=0.1)


def micros(conn: psycopg.Connection, message_id: uuid.UUID) -> int:
    return conn.execute(
        "SELECT inbox._backlog_micros(received_at) FROM inbox.messages WHERE message_id = %s", (message_id,)
    ).fetchone()[0]


def walk_buffers(explained: psycopg.Connection) -> int:
    """Shared buffers inbox.backlog()'s own statements read (auto_explain, nested),
    called on a connection of a login that has auto_explain on."""
    notes: list[str] = []
    backlog(explained)  # the session's first call reads the catalog: not counted
    explained.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
    backlog(explained)
    total = 0
    for note in notes:
        if "inbox.messages" in note and "FROM inbox.backlog()" not in note.split("Plan", 1)[0]:
            plan = json.loads(note[note.index("{") :])
            total += plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    assert total > 0, notes
    return total


@pytest.fixture
def consumer_url(database_url):
    return login(database_url, "pgoutbox_consumer")


@pytest.fixture
def explained_url(database_url):
    """A second consumer login whose statements auto_explain reports to it."""
    url = login(database_url, "pgoutbox_consumer")
    name = url.split("://", 1)[1].split("@", 1)[0]
    with psycopg.connect(database_url, autocommit=True) as c:
        c.execute(f"ALTER ROLE {name} SET session_preload_libraries = 'auto_explain'")
        for setting, value in (
            ("log_min_duration", "0"),
            ("log_analyze", "on"),
            ("log_buffers", "on"),
            ("log_nested_statements", "on"),
            ("log_format", "json"),
            ("log_level", "notice"),
        ):
            c.execute(f"ALTER ROLE {name} SET auto_explain.{setting} = '{value}'")
    return url


@contextmanager
def sessions(
    database_url: str, consumer_url: str, explained_url: str
) -> Iterator[tuple[psycopg.Connection, psycopg.Connection, psycopg.Connection]]:
    """The owner's session, a consumer's, and a consumer's that auto_explain reports to."""
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(consumer_url, autocommit=True) as consumer,
        psycopg.connect(explained_url, autocommit=True) as explained,
    ):
        yield conn, consumer, explained


@pytest.mark.slow
def test_inbox_backlog_past_20000_dead_entries_reads_as_many_buffers_as_on_a_clean_table(
    database_url, consumer_url, explained_url
):
    with sessions(database_url, consumer_url, explained_url) as (conn, consumer, explained):
        settle(consumer, receive(consumer, 100))
        pending = receive(consumer, 20)
        move_floor_past(consumer, conn, 0)
        clean = walk_buffers(explained)
        settle(consumer, pending)

        with held_snapshot(database_url):
            done = []
            for _ in range(20):
                ids = receive(consumer, 1000)
                settle(consumer, ids)
                done += ids
            # Each settled message left its RECEIVED entry in messages_unprocessed_idx,
            # which nothing may remove while the snapshot is held: walked from the
            # bottom, as inbox.backlog() did before the floor, it costs hundreds of buffers.
            walk = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT count(*) FROM inbox.messages"
                " WHERE status <> 'PROCESSED'"
            ).fetchone()[0][0]["Plan"]
            assert walk["Shared Hit Blocks"] + walk["Shared Read Blocks"] > 10 * clean

            move_floor_past(consumer, conn, micros(conn, done[-1]) - 1)
            pending = receive(consumer, 20)
            assert backlog(consumer) == {"h": (20, 0, 0)}
            held = walk_buffers(explained)

    assert held <= 2 * clean + 20, f"inbox.backlog read {held} buffers past 20,000 dead entries, {clean} when clean"


@pytest.mark.parametrize("when", ["before-candidate", "before-floor"])
def test_a_message_received_in_a_transaction_older_than_the_floor_is_counted(database_url, consumer_url, when):
    """received_at is the receiving transaction's start: an application handling
    a message in its own transaction receives it long after it began. The floor
    moves past that time meanwhile (before-floor: the transaction has taken no
    id yet; before-candidate: it receives while a candidate above its start is
    pending); the message lowers it and is counted."""
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(consumer_url, autocommit=True) as consumer,
        psycopg.connect(consumer_url) as app,
    ):
        began = app.execute("SELECT (extract(epoch FROM now()) * 1000000)::bigint").fetchone()[0]
        settle(consumer, receive(consumer, 10))
        move_floor_past(consumer, conn, began)
        if when == "before-candidate":
            backlog(consumer)  # a step: at most one of two leaves a candidate pending
            if conn.execute("SELECT pg_sequence_last_value('inbox.backlog_floor_next')").fetchone()[0] is None:
                settle(consumer, receive(consumer, 1))
                backlog(consumer)
            assert conn.execute("SELECT pg_sequence_last_value('inbox.backlog_floor_next')").fetchone()[0] > began
        late = receive(app, 1, handler="app")
        for _ in range(4):
            backlog(consumer)
        assert floor_us(conn) <= began, "the floor passed a message of a transaction still running"
        app.commit()
        assert micros(conn, late[0]) == began
        assert backlog(consumer) == {"app": (1, 0, 0)}
        assert floor_us(conn) <= began


def test_a_replayed_dead_letter_below_the_floor_is_counted(database_url, consumer_url):
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(consumer_url, autocommit=True) as consumer,
    ):
        (dead,) = receive(consumer, 1)
        consumer.execute(
            "SELECT inbox.record_error(%s, 'h', 'poison', dead => true, replay_after => interval '0')", (dead,)
        )
        later = receive(consumer, 10)
        settle(consumer, later)
        move_floor_past(consumer, conn, micros(conn, later[-1]) - 1)
        assert backlog(consumer) == {"h": (0, 0, 1)}, "a dead letter below the floor still counts"
        replayed = consumer.execute("SELECT message_id FROM inbox.claim_replays('replayer', 10)").fetchall()
        assert [r[0] for r in replayed] == [dead]
        assert backlog(consumer) == {"h": (1, 0, 0)}
        assert floor_us(conn) <= micros(conn, dead)


def update_buffers(explained: psycopg.Connection, sql: str, args: tuple) -> int:
    """Shared buffers the UPDATE of inbox.messages inside one call read (auto_explain, nested)."""
    notes: list[str] = []

    def note(d: psycopg.errors.Diagnostic) -> None:
        notes.append(d.message_primary or "")

    explained.add_notice_handler(note)
    try:
        explained.execute(sql, args)
    finally:
        explained.remove_notice_handler(note)
    total = 0
    for text in notes:
        if "UPDATE inbox.messages" in text:
            plan = json.loads(text[text.index("{") :])
            total += plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    assert total > 0, notes
    return total


def outcome_buffers(explained: psycopg.Connection) -> tuple[int, int]:
    """(mark_processed, record_error) of one message each, as a consumer session makes them:
    its sixth call on, with the plan PostgreSQL keeps for the session."""
    figures = (0, 0)
    for _ in range(6):
        done, failed = receive(explained, 2)
        figures = (
            update_buffers(explained, "SELECT inbox.mark_processed(%s, 'h')", (done,)),
            update_buffers(explained, "SELECT inbox.record_error(%s, 'h', 'boom')", (failed,)),
        )
        settle(explained, [failed])  # no unsettled message left behind
    return figures


@pytest.mark.slow
def test_a_message_outcome_past_20000_dead_entries_reads_as_many_buffers_as_on_a_clean_table(
    database_url, consumer_url, explained_url
):
    with sessions(database_url, consumer_url, explained_url) as (conn, consumer, explained):
        settle(consumer, receive(consumer, 100))
        clean = outcome_buffers(explained)

        with held_snapshot(database_url):
            for _ in range(20):
                settle(consumer, receive(consumer, 1000))
            # ANALYZE counts live rows only: it sees no unsettled message, while
            # messages_unprocessed_idx holds the 20,000 RECEIVED entries the hold keeps.
            # A plan made after it must still probe the primary key.
            conn.execute("ANALYZE inbox.messages")
            held = outcome_buffers(explained)

    for name, before, after in zip(("mark_processed", "record_error"), clean, held, strict=True):
        assert after <= 2 * before + 20, f"{name} read {after} buffers past 20,000 dead entries, {before} when clean"
