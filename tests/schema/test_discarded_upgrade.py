"""Five outbox statuses (migration 0018): an event version 17 left DISCARDED
becomes a DEAD_LETTER with its mark (outbox.discarded_events), discarded
when its discard says, with no second audit row; restore and requeue then
work on it, and the down makes it DISCARDED again. Each call as the role
the docs give it."""

from __future__ import annotations

import psycopg
import pytest

from pgoutbox.core import migrate as m

DISCARD = "SELECT outbox.dlq_discard(jsonb_build_object('side', 'outbox', 'ids', jsonb_build_array(%s::uuid)), %s)"
RESTORE = "SELECT outbox.dlq_restore(jsonb_build_object('side', 'outbox', 'ids', jsonb_build_array(%s::uuid)), %s)"


def as_role(conn: psycopg.Connection, role: str, sql: str, params: tuple = ()) -> list[tuple]:
    conn.execute(f"SET ROLE {role}")
    try:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []
    finally:
        conn.execute("RESET ROLE")


def dead_letter(conn: psycopg.Connection) -> str:
    (event_id,) = as_role(
        conn,
        "pgoutbox_writer",
        "SELECT outbox.emit('order', '1', 'created', '{\"schema_version\": 1}', context => 'sea')",
    )[0]
    (token,) = as_role(conn, "pgoutbox_relay", "SELECT claim_token FROM outbox.claim('w', 1, '1 minute')")[0]
    as_role(
        conn,
        "pgoutbox_relay",
        "SELECT outbox.mark_failed(%s, %s, %s, %s)",
        (token, [event_id], ["HTTP 422: refused"], [None]),
    )
    return str(event_id)


def state(conn: psycopg.Connection, event_id: str) -> tuple:
    return conn.execute(
        "SELECT e.status, d.discarded_at IS NOT NULL FROM outbox.events AS e"
        " LEFT JOIN outbox.discarded_events AS d ON d.event_id = e.event_id WHERE e.event_id = %s",
        (event_id,),
    ).fetchone()


@pytest.mark.slow
def test_0018_turns_discarded_events_into_marked_dead_letters(empty_database_url):
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        m.migrate(conn, target=17)
        event_id = dead_letter(conn)
        assert as_role(conn, "pgoutbox_admin", DISCARD, (event_id, "duplicate")) == [(1,)]
        assert conn.execute("SELECT status FROM outbox.events").fetchone() == ("DISCARDED",)

        assert m.migrate(conn, target=18) == ["up 0018_steady_under_faults"]
        assert state(conn, event_id) == ("DEAD_LETTER", True)
        assert conn.execute(
            "SELECT d.discarded_at = l.acted_at, (SELECT count(*) FROM outbox.discard_log)"
            " FROM outbox.discarded_events AS d INNER JOIN outbox.discard_log AS l USING (event_id)"
        ).fetchall() == [(True, 1)], "discarded when its discard says, and not audited twice"
        listed = as_role(conn, "pgoutbox_admin", """SELECT id::text FROM outbox.dlq_list('{"discarded": true}')""")
        assert listed == [(event_id,)]
        with pytest.raises(psycopg.Error) as refused:
            as_role(conn, "pgoutbox_admin", "SELECT outbox.requeue(%s::uuid[], 'x')", ([event_id],))
        assert refused.value.sqlstate == "OB101"

        assert as_role(conn, "pgoutbox_admin", RESTORE, (event_id, "wanted")) == [(1,)]
        assert state(conn, event_id) == ("DEAD_LETTER", False)
        assert as_role(conn, "pgoutbox_admin", DISCARD, (event_id, "duplicate after all")) == [(1,)]

        assert m.migrate(conn, target=17) == ["down 0018_steady_under_faults"]
        assert conn.execute("SELECT status FROM outbox.events").fetchone() == ("DISCARDED",)
        assert m.migrate(conn, target=18) == ["up 0018_steady_under_faults"]
        assert state(conn, event_id) == ("DEAD_LETTER", True)
        assert conn.execute("SELECT count(*) FROM outbox.dlq_entries WHERE discarded").fetchone() == (1,)
