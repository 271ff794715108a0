"""A snapshot held by another session (a report, pg_dump, a forgotten BEGIN)
keeps vacuum from removing the row versions claim and mark leave behind.
The claim floor (outbox._claim_floor) keeps claim's walk short all the same,
without ever passing over a claimable event; outbox.oldest_snapshots() names
the holder. Scheduled events waiting for their time neither hold the floor
back nor lengthen the walk, and one fallen due is claimed with an id above
the floor, where its expired lease is found. Each test runs the workers' calls as a login in the group the
docs give them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import psycopg
import pytest

from support.outbox import relay_config, running_relay
from support.roles import login
from support.waiting import until, wait_for

EMIT = (
    "SELECT count(outbox.emit('order', g::text, 'order_created', jsonb_build_object('schema_version', 1),"
    " context => 'held')) FROM generate_series(1, %s) AS g"
)
SCHEDULE = (
    "SELECT count(outbox.emit('order'::varchar, g::text, 'remind', jsonb_build_object('schema_version', 1),"
    " context => 'held', deliver_after => %s)) FROM generate_series(1, %s) AS g"
)
# events_claimable_idx's predicate (sql/10_outbox_events.sql)
CLAIMABLE = (
    "status IN ('PENDING', 'FAILED', 'PROCESSING') AND (status <> 'PENDING' OR claimed_at IS NOT NULL"
    " OR ordering_key IS NOT NULL OR available_at <= created_at)"
)
BUFFERS = re.compile(r"Buffers: shared hit=(\d+)(?: read=(\d+))?")


@contextmanager
def held_snapshot(url: str) -> Iterator[psycopg.Connection]:
    """Another session holding a snapshot, as the issue's report did."""
    with psycopg.connect(url, autocommit=True, application_name="monthly report") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")
        try:
            yield holder
        finally:
            holder.execute("ROLLBACK")


def claim_floor(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT coalesce(pg_sequence_last_value('outbox.claim_floor'), 0)").fetchone()[0]


def move_floor_past(relay: psycopg.Connection, conn: psycopg.Connection, last_id: int) -> None:
    """Claims that find nothing due, as an idle relay's polls, until the floor passes last_id."""

    def moved() -> bool:
        relay.execute("SELECT count(*) FROM outbox.claim('t', 1, '30 seconds')")
        return claim_floor(conn) > last_id

    wait_for(moved, 30, f"the claim floor to pass id {last_id}", interval=0.1)


def claim_buffers(relay: psycopg.Connection, notes: list[str]) -> int:
    """Shared buffers read by claim's own statements (auto_explain, nested)."""
    notes.clear()
    with relay.transaction():
        taken = relay.execute("SELECT count(*) FROM outbox.claim('t', 10, '30 seconds')").fetchone()[0]
        assert taken == 10
        raise psycopg.Rollback
    return events_buffers(notes)


def mark_buffers(relay: psycopg.Connection, notes: list[str]) -> int:
    """Shared buffers read by mark_published's own statements, for a claim of 10."""
    token, ids = relay.execute(
        "SELECT claim_token, array_agg(event_id) FROM outbox.claim('t', 10, '30 seconds') GROUP BY claim_token"
    ).fetchone()
    assert len(ids) == 10
    notes.clear()
    assert relay.execute("SELECT outbox.mark_published(%s, %s)", (token, ids)).fetchone()[0] == 10
    return events_buffers(notes)


def events_buffers(notes: list[str]) -> int:
    total = 0
    for note in notes:
        if "outbox.events" in note and (m := BUFFERS.search(note)):
            total += int(m.group(1)) + int(m.group(2) or 0)
    assert total > 0, notes
    return total


@pytest.fixture
def relay_url(database_url):
    url = login(database_url, "pgoutbox_relay")
    name = url.split("://", 1)[1].split("@", 1)[0]
    with psycopg.connect(database_url, autocommit=True) as c:
        # auto_explain for this login only, its notices sent to the client: what claim reads.
        c.execute(f"ALTER ROLE {name} SET session_preload_libraries = 'auto_explain'")
        for setting, value in (
            ("log_min_duration", "0"),
            ("log_analyze", "on"),
            ("log_buffers", "on"),
            ("log_nested_statements", "on"),
            ("log_level", "notice"),
        ):
            c.execute(f"ALTER ROLE {name} SET auto_explain.{setting} = '{value}'")
    return url


def drain(relay: psycopg.Connection, batch: int) -> int:
    """Claims and marks published everything due, batch by batch; returns how many."""
    done = 0
    while True:
        rows = relay.execute(
            "SELECT claim_token, array_agg(event_id) FROM outbox.claim('t', %s, '5 minutes') GROUP BY claim_token",
            (batch,),
        ).fetchall()
        if not rows:
            return done
        for token, ids in rows:
            done += relay.execute("SELECT outbox.mark_published(%s, %s)", (token, ids)).fetchone()[0]


def clean_table_figures(writer: psycopg.Connection, relay: psycopg.Connection, notes: list[str]) -> tuple[int, int]:
    """The buffers a claim of 10 and its mark read on a table whose 100 events
    were all published; notes collect the relay's auto_explain notices."""
    relay.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
    writer.execute(EMIT, (100,))
    drain(relay, 100)
    writer.execute(EMIT, (20,))
    claim, mark = claim_buffers(relay, notes), mark_buffers(relay, notes)
    drain(relay, 100)
    return claim, mark


@pytest.mark.slow
def test_a_claim_and_its_mark_past_200000_dead_entries_read_as_many_buffers_as_on_a_clean_table(
    database_url, relay_url
):
    writer_url = login(database_url, "pgoutbox_writer")
    notes: list[str] = []
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(writer_url, autocommit=True) as writer,
        psycopg.connect(relay_url, autocommit=True) as relay,
    ):
        clean, clean_mark = clean_table_figures(writer, relay, notes)

        with held_snapshot(database_url):
            writer.execute(EMIT, (100_000,))
            assert drain(relay, 10_000) == 100_000

            # Each event left two entries in events_claimable_idx (its PENDING and
            # PROCESSING versions), which nothing may remove while the snapshot is held.
            # (Not read from pg_stat_user_tables: its counts arrive late, and an
            # autovacuum that ran during the drain rewrites them; the walk below shows them.)
            # Walked from the bottom, as claim did before the floor, the index costs thousands of buffers.
            walk = conn.execute(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT min(id) FROM outbox.events WHERE {CLAIMABLE}"
            ).fetchone()[0][0]["Plan"]
            assert walk["Shared Hit Blocks"] + walk["Shared Read Blocks"] > 50 * clean

            last_id = conn.execute("SELECT max(id) FROM outbox.events").fetchone()[0]
            move_floor_past(relay, conn, last_id - 1)
            # An ANALYZE now counts live rows only, and no claimable one, while
            # events_claimable_idx holds the 200,000 dead entries: it prices a walk of
            # that index at a page. The plans made after it (claim's, the marks') must
            # still probe what they need, not walk that index.
            conn.execute("ANALYZE outbox.events")
            writer.execute(EMIT, (20,))
            held = claim_buffers(relay, notes)
            held_mark = mark_buffers(relay, notes)

    assert held <= 2 * clean + 20, f"claim read {held} buffers past 200,000 dead entries, {clean} on a clean table"
    assert held_mark <= 2 * clean_mark + 20, (
        f"mark_published read {held_mark} buffers past 200,000 dead entries, {clean_mark} on a clean table"
    )


@pytest.mark.parametrize("newest", [False, True], ids=["older-xid", "newest-xid"])
def test_an_event_of_a_transaction_still_running_is_claimed_once_committed(database_url, relay_url, newest):
    """An emit whose transaction is still running while claims step the floor:
    the floor never passes its id. older-xid: later ids are committed before
    it. newest-xid: its transaction id is the newest and nothing ends after it,
    as when commits wait for a synchronous standby (tests/chaos/test_failover.py
    found one such event stuck below the floor): the snapshot's xmax (the
    latest ended id + 1) is then not above it. The pauses between claims are
    there for the time-based floor this replaced (250 ms); the floor must not
    move past the id however long they are."""
    writer_url = login(database_url, "pgoutbox_writer")
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(writer_url, autocommit=True) as writer,
        psycopg.connect(writer_url) as late,
        psycopg.connect(relay_url, autocommit=True) as relay,
    ):
        if newest:
            writer.execute(EMIT, (50,))
            drain(relay, 10)
        late_event = late.execute(
            "SELECT outbox.emit('order', 'late', 'order_created', '{\"schema_version\": 1}', context => 'held')"
        ).fetchone()[0]
        late_id = conn.execute("SELECT pg_sequence_last_value('outbox.events_id_seq')").fetchone()[0]
        if not newest:
            writer.execute(EMIT, (50,))
            drain(relay, 10)
        for _ in range(12):
            assert relay.execute("SELECT count(*) FROM outbox.claim('t', 1, '30 seconds')").fetchone()[0] == 0
            conn.execute("SELECT pg_sleep(0.3)")
        assert claim_floor(conn) <= late_id, "the floor passed an id of a transaction still running"
        late.commit()
        claimed = relay.execute("SELECT event_id FROM outbox.claim('t', 10, '30 seconds')").fetchall()
        assert [r[0] for r in claimed] == [late_event]


def insert_with_id(owner: psycopg.Connection, template: str, new_id: int) -> str:
    """A copy of event template (a row as to_jsonb wrote it, PENDING) with an id
    of its own, as a restore or the owner's INSERT ... OVERRIDING SYSTEM VALUE
    writes it; returns its event_id."""
    return owner.execute(
        "INSERT INTO outbox.events OVERRIDING SYSTEM VALUE"
        " SELECT (jsonb_populate_record(NULL::outbox.events,"
        "  %s::jsonb || jsonb_build_object('id', %s::bigint, 'event_id', gen_random_uuid()))).*"
        " RETURNING event_id",
        (template, new_id),
    ).fetchone()[0]


def steps(relay: psycopg.Connection, n: int) -> None:
    """Claims that find nothing due, each a step of the floor."""
    for _ in range(n):
        assert relay.execute("SELECT count(*) FROM outbox.claim('t', 1, '30 seconds')").fetchone()[0] == 0


@pytest.mark.parametrize("where", ["below-floor", "below-candidate", "negative"])
def test_an_event_inserted_with_a_low_id_is_claimed(database_url, relay_url, where):
    """A row written with an id of its own below the floor, or between the floor
    and a pending candidate, lowers the floor: claimed once its transaction
    commits, and not passed while it runs."""
    writer_url = login(database_url, "pgoutbox_writer")
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(database_url) as owner,
        psycopg.connect(writer_url, autocommit=True) as writer,
        psycopg.connect(writer_url) as gap,
        psycopg.connect(relay_url, autocommit=True) as relay,
    ):
        template_id = writer.execute(
            "SELECT outbox.emit('order', 't', 'order_created', '{\"schema_version\": 1}', context => 'held')"
        ).fetchone()[0]
        template = conn.execute(
            "SELECT to_jsonb(e)::text FROM outbox.events AS e WHERE e.event_id = %s", (template_id,)
        )
        template = template.fetchone()[0]
        gap.execute("SELECT outbox.emit('order', 'gap', 'order_created', '{\"schema_version\": 1}', context => 'held')")
        gap_id = conn.execute("SELECT pg_sequence_last_value('outbox.events_id_seq')").fetchone()[0]
        gap.rollback()  # an id nobody holds: the restored row takes it
        writer.execute(EMIT, (20,))
        drain(relay, 10)
        if where == "below-candidate":
            # The floor stops at the gap's id, then a candidate above it is taken.
            conn.execute(
                "SELECT setval('outbox.claim_floor', %s), setval('outbox.claim_floor_next', 1, false)", (gap_id,)
            )
            steps(relay, 1)
            assert conn.execute("SELECT pg_sequence_last_value('outbox.claim_floor_next')").fetchone()[0] > gap_id
        else:
            move_floor_past(relay, conn, gap_id)
        new_id = -5 if where == "negative" else gap_id
        event_id = insert_with_id(owner, template, new_id)
        steps(relay, 6)  # the owner's transaction still runs: the floor stays at or below its id
        assert claim_floor(conn) <= new_id
        owner.commit()
        steps_then = relay.execute("SELECT event_id FROM outbox.claim('t', 10, '30 seconds')").fetchall()
        assert [r[0] for r in steps_then] == [event_id]


def test_a_requeued_dead_letter_below_the_floor_is_claimed(database_url, relay_url):
    writer_url = login(database_url, "pgoutbox_writer")
    admin_url = login(database_url, "pgoutbox_admin")
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(writer_url, autocommit=True) as writer,
        psycopg.connect(admin_url, autocommit=True) as admin,
        psycopg.connect(relay_url, autocommit=True) as relay,
    ):
        writer.execute(EMIT, (1,))
        token, event_id = relay.execute(
            "SELECT claim_token, event_id FROM outbox.claim('t', 1, '30 seconds')"
        ).fetchone()
        relay.execute(
            "SELECT outbox.mark_failed(%s, ARRAY[%s]::uuid[], ARRAY['broken'], ARRAY[NULL]::timestamptz[])",
            (token, event_id),
        )
        writer.execute(EMIT, (30,))
        drain(relay, 10)
        move_floor_past(relay, conn, conn.execute("SELECT max(id) FROM outbox.events").fetchone()[0] - 1)
        admin.execute("SELECT outbox.requeue(ARRAY[%s]::uuid[], 'fixed the subject')", (event_id,))
        claimed = relay.execute("SELECT event_id FROM outbox.claim('t', 10, '30 seconds')").fetchall()
        assert [r[0] for r in claimed] == [event_id]


def test_scheduled_events_waiting_neither_hold_the_floor_nor_lengthen_a_claim(database_url, relay_url):
    """20,000 reminders due tomorrow, emitted among the day's events: the floor
    passes them, and a claim reads as many buffers as with none waiting (it
    stepped over each of them, a heap visit apiece, before they had an index of
    their own). They stay counted as unpublished."""
    writer_url = login(database_url, "pgoutbox_writer")
    notes: list[str] = []
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(writer_url, autocommit=True) as writer,
        psycopg.connect(relay_url, autocommit=True) as relay,
    ):
        clean, _ = clean_table_figures(writer, relay, notes)

        writer.execute(SCHEDULE, (timedelta(days=1), 20_000))
        writer.execute(EMIT, (100,))
        assert drain(relay, 100) == 100
        move_floor_past(relay, conn, conn.execute("SELECT max(id) FROM outbox.events").fetchone()[0] - 1)
        writer.execute(EMIT, (20,))
        waiting = claim_buffers(relay, notes)
        unpublished = conn.execute("SELECT unpublished FROM outbox.backlog('held')").fetchone()[0]

    assert waiting <= 2 * clean + 20, f"claim read {waiting} buffers beside 20,000 waiting, {clean} with none"
    assert unpublished == 20_000 + 20


def test_a_scheduled_event_fallen_due_is_reclaimed_when_its_lease_expires(database_url, relay_url):
    """Due, it is claimed with a new id, above the floor that had passed its
    old one; the relay that claimed it dies (no mark): once the lease ends, the
    next claim takes it again through the id-ordered walk, same id."""
    writer_url = login(database_url, "pgoutbox_writer")
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(writer_url, autocommit=True) as writer,
        psycopg.connect(relay_url, autocommit=True) as relay,
    ):
        event_id = writer.execute(
            "SELECT outbox.emit('order'::varchar, 'r', 'remind', '{\"schema_version\": 1}', context => 'held',"
            " deliver_after => interval '2 seconds')"
        ).fetchone()[0]
        old_id = conn.execute("SELECT id FROM outbox.events WHERE event_id = %s", (event_id,)).fetchone()[0]
        writer.execute(EMIT, (30,))
        drain(relay, 10)
        move_floor_past(relay, conn, conn.execute("SELECT max(id) FROM outbox.events").fetchone()[0] - 1)
        assert claim_floor(conn) > old_id

        def claimed(lease: str) -> list[tuple[str, int]]:
            return relay.execute("SELECT event_id, id FROM outbox.claim('t', 10, %s::interval)", (lease,)).fetchall()

        first = wait_for(lambda: claimed("1 second"), 30, "the scheduled event to fall due", interval=0.1)
        assert [e for e, _ in first] == [event_id] and first[0][1] > old_id
        again = wait_for(lambda: claimed("30 seconds"), 30, "its lease to expire", interval=0.1)
        assert again == first


def test_oldest_snapshots_names_the_holder_but_not_its_query(database_url):
    viewer_url = login(database_url, "pgoutbox_viewer")
    with held_snapshot(database_url) as holder, psycopg.connect(viewer_url, autocommit=True) as viewer:
        pid = holder.info.backend_pid
        rows = viewer.execute(
            "SELECT kind, pid, application_name, state, age_seconds, age_xids FROM outbox.oldest_snapshots()"
        ).fetchall()
        mine = [r for r in rows if r[1] == pid]
        assert mine, rows
        kind, _, app, state, seconds, xids = mine[0]
        assert (kind, app, state) == ("session", "monthly report", "idle in transaction")
        assert seconds >= 0 and xids >= 0
        columns = [d.name for d in viewer.execute("SELECT * FROM outbox.oldest_snapshots(1)").description]
        assert "query" not in columns
    with psycopg.connect(viewer_url, autocommit=True) as viewer:
        assert pid not in [r[0] for r in viewer.execute("SELECT pid FROM outbox.oldest_snapshots()").fetchall()]


async def test_the_relay_exports_the_age_of_the_held_snapshot(database_url, nats_server):
    relay_login = login(database_url, "pgoutbox_relay")
    # backlog_interval: the gauges are read by the backlog loop, every 5 s by default.
    cfg = relay_config(
        relay_login, nats_server.url, backlog_interval="200ms"
    )  # not default: the gauges within the test
    async with running_relay(cfg) as relay:

        def age() -> float:
            return relay.metrics.registry.get_sample_value("pgoutbox_outbox_oldest_snapshot_age_seconds") or 0.0

        def xids() -> float:
            return relay.metrics.registry.get_sample_value("pgoutbox_outbox_oldest_snapshot_age_xids") or 0.0

        await until(lambda: age() == 0, 10, "no snapshot held at first")
        with held_snapshot(database_url), psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("SELECT pg_current_xact_id()")  # an xid after the snapshot: it is one transaction old
            await until(lambda: age() >= 1 and xids() >= 1, 10, "the held snapshot's age in the gauges")
        await until(lambda: age() < 1, 10, "the gauge to fall once the snapshot is released")
