"""The command inbox under concurrency (sql/65_inbox_commands.sql), with
several connections to a real PostgreSQL, each a login holding only
pgoutbox_writer (the role docs/reference.md gives applications).

The semantics proved here are the ones docs/commands.md states: a claim of a
key whose first claim is uncommitted waits for that transaction; committed,
it sees the row as committed; rolled back, it becomes the first. So two
identical claims never both come back claimed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgoutbox.core.errors import SqlState
from support.roles import login

HANDLER = "start_workflow_run"


@pytest.fixture
def writer_url(database_url):
    return login(database_url, "pgoutbox_writer")


def claim(conn: psycopg.Connection, key: str) -> tuple[bool, str, Any]:
    return conn.execute("SELECT claimed, status, result FROM inbox.claim_command(%s, %s)", (HANDLER, key)).fetchone()


def wait_until_blocked(admin: psycopg.Connection, pid: int, timeout: float = 10.0) -> None:
    """Until backend `pid` waits on a lock: the claim really waits, it did not
    merely run late."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = admin.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        if row and row[0] == "Lock":
            return
        time.sleep(0.02)
    raise AssertionError(f"backend {pid} never waited on a lock")


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def joined(t: threading.Thread, out: dict[str, Any]) -> Any:
    t.join(10)
    assert not t.is_alive(), "the second claim never returned"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_second_claim_waits_for_the_first_commit_and_gets_its_result(writer_url, conn):
    with psycopg.connect(writer_url) as first, psycopg.connect(writer_url) as second:
        assert claim(first, "k1")[:2] == (True, "IN_PROGRESS")
        t, out = in_thread(lambda: (claim(second, "k1"), second.commit()))
        wait_until_blocked(conn, second.info.backend_pid)
        first.execute("SELECT inbox.complete_command(%s, 'k1', %s)", (HANDLER, Jsonb({"run_id": "r-1"})))
        first.commit()
        (claimed, status, result), _ = joined(t, out)
    assert (claimed, status, result) == (False, "DONE", {"run_id": "r-1"})


def test_a_second_claim_becomes_the_first_when_the_first_rolls_back(writer_url, conn):
    with psycopg.connect(writer_url) as first, psycopg.connect(writer_url) as second:
        assert claim(first, "k1")[0] is True
        t, out = in_thread(lambda: claim(second, "k1"))
        wait_until_blocked(conn, second.info.backend_pid)
        first.rollback()
        assert joined(t, out) == (True, "IN_PROGRESS", None)
        second.commit()
    assert conn.execute("SELECT attempts FROM inbox.commands").fetchall() == [(1,)]


def test_a_claim_committed_on_its_own_is_seen_in_progress_without_waiting(writer_url):
    """Two transactions (claim, commit, slow work, complete): a duplicate
    learns "in progress" at once instead of waiting for the work."""
    with psycopg.connect(writer_url) as first, psycopg.connect(writer_url) as second:
        claim(first, "k1")
        first.commit()
        second.execute("SET lock_timeout = '1s'")
        assert claim(second, "k1") == (False, "IN_PROGRESS", None)
        second.commit()
        first.execute("SELECT inbox.complete_command(%s, 'k1', '{\"run_id\": \"r-1\"}')", (HANDLER,))
        first.commit()
        assert claim(second, "k1") == (False, "DONE", {"run_id": "r-1"})


def test_two_retries_of_a_failed_command_give_one_claim(writer_url, conn):
    with psycopg.connect(writer_url, autocommit=True) as c:
        claim(c, "k1")
        c.execute("SELECT inbox.fail_command(%s, 'k1', 'engine said 503')", (HANDLER,))
    with psycopg.connect(writer_url) as first, psycopg.connect(writer_url) as second:
        assert claim(first, "k1") == (True, "IN_PROGRESS", None)
        t, out = in_thread(lambda: claim(second, "k1"))
        wait_until_blocked(conn, second.info.backend_pid)
        first.commit()
        assert joined(t, out) == (False, "IN_PROGRESS", None)
        second.commit()
    assert conn.execute("SELECT status, attempts FROM inbox.commands").fetchall() == [("IN_PROGRESS", 2)]


def test_a_waiting_claim_under_repeatable_read_fails_with_a_serialization_error(writer_url, conn):
    """As documented: under REPEATABLE READ the waiting claim cannot see the
    row its snapshot predates; it fails with 40001 and a retry sees it."""
    with psycopg.connect(writer_url) as first, psycopg.connect(writer_url) as second:
        claim(first, "k1")
        second.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        second.execute("SELECT 1")  # the snapshot is taken here
        t, out = in_thread(lambda: claim(second, "k1"))
        wait_until_blocked(conn, second.info.backend_pid)
        first.execute("SELECT inbox.complete_command(%s, 'k1', '{}')", (HANDLER,))
        first.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            joined(t, out)
        second.rollback()
        assert claim(second, "k1") == (False, "DONE", {})


def test_many_identical_claims_at_once_give_exactly_one_first(writer_url, conn):
    """Each of 20 connections claims the same key in its own transaction and,
    if it holds the command, stores a result naming itself: one holds it, all
    20 end up with that one result."""
    n = 20
    barrier = threading.Barrier(n)

    def one(i: int) -> tuple[bool, Any]:
        with psycopg.connect(writer_url) as c:
            barrier.wait()
            claimed, status, result = claim(c, "k1")
            if claimed:
                time.sleep(0.2)  # the work, while the others arrive
                c.execute("SELECT inbox.complete_command(%s, 'k1', %s)", (HANDLER, Jsonb({"by": i})))
                return True, {"by": i}
            assert status == "DONE"
            return False, result

    with ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(one, range(n)))
    firsts = [result for claimed, result in outcomes if claimed]
    assert len(firsts) == 1
    assert all(result == firsts[0] for _, result in outcomes)
    assert conn.execute("SELECT status, attempts FROM inbox.commands").fetchall() == [("DONE", 1)]


def test_a_key_cannot_be_deleted_even_by_the_owner(writer_url, conn):
    with psycopg.connect(writer_url, autocommit=True) as c:
        claim(c, "k1")
    with pytest.raises(psycopg.Error) as e:
        conn.execute("DELETE FROM inbox.commands")
    assert e.value.sqlstate == SqlState.DELETE_FORBIDDEN
    with pytest.raises(psycopg.Error) as e:
        conn.execute("TRUNCATE inbox.commands")
    assert e.value.sqlstate == SqlState.DELETE_FORBIDDEN


@pytest.mark.parametrize("status", ["DONE", "FAILED"])
def test_a_claim_waiting_on_a_purge_of_its_key_claims_it_afresh(writer_url, database_url, conn, status):
    """The audited purge of a day (as pgoutbox_archiver) deletes a key while
    a retry of it is claiming: the claim waits for the purge's transaction
    and, the key gone, is the first claim of a new command (never an empty
    answer)."""
    conn.execute(
        "INSERT INTO inbox.commands (handler, command_key, status, result, last_error, first_claimed_at,"
        " claimed_at, settled_at) VALUES (%s, 'k1', %s, %s, %s, now() - interval '40 days',"
        " now() - interval '40 days', now() - interval '40 days')",
        (HANDLER, status, Jsonb({"run": 1}) if status == "DONE" else None, "boom" if status == "FAILED" else None),
    )
    day = conn.execute("SELECT ((now() - interval '40 days') AT TIME ZONE 'UTC')::date").fetchone()[0]
    conn.execute(
        "SELECT outbox.record_archive('inbox.commands', %s, f.row_count, f.checksum, 'file:/archive/c')"
        " FROM outbox.archive_figures('inbox.commands', %s) AS f",
        (day, day),
    )
    with psycopg.connect(login(database_url, "pgoutbox_archiver")) as purger, psycopg.connect(writer_url) as w:
        assert purger.execute("SELECT inbox.purge_archived_commands(%s)", (day,)).fetchone() == (1,)
        t, out = in_thread(lambda: claim(w, "k1"))
        wait_until_blocked(conn, w.info.backend_pid)
        purger.commit()
        joined(t, out)
        w.commit()
    assert out["value"] == (True, "IN_PROGRESS", None)
    assert conn.execute("SELECT status, attempts FROM inbox.commands").fetchall() == [("IN_PROGRESS", 1)]
