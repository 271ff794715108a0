"""Command keys leave inbox.commands only by the audited archival of
everything else: on a real PostgreSQL and a real local Spark, run as a login
holding only pgoutbox_archiver (the role docs/reference.md gives
`pgoutbox archive`), a day of keys is exported by handler, verified and
audited, and only then purged; a retried command of a purged day is claimed
afresh, by a login holding only pgoutbox_writer."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from pgoutbox_spark import archive, jdbc, storage
from pgoutbox_spark import database as db
from support.archival import archived_rows, commands, live_rows, today
from support.roles import login

pytestmark = pytest.mark.spark

COMMANDS = db.COMMANDS


def make_options(tmp_path: Path, **overrides) -> archive.ArchiveOptions:
    """The archiver's options at the product's defaults, for command keys only."""
    values = dict(
        archive_uri=storage.normalise_uri(str(tmp_path / "archive")),
        retention=timedelta(days=7),
        dead_letter_retention=timedelta(days=30),
        inbox_retention=timedelta(days=14),
        read_partitions=3,
        fetch_size=500,
        drop=True,
        lock_timeout=timedelta(seconds=5),
        sources=(COMMANDS,),
    )
    values.update(overrides)
    return archive.ArchiveOptions(**values)


def claim(url: str, handler: str, key: str) -> tuple:
    with psycopg.connect(url, autocommit=True) as c:
        return c.execute(
            "SELECT claimed, status, result, attempts FROM inbox.claim_command(%s, %s)", (handler, key)
        ).fetchone()


def standing_audit(conn: psycopg.Connection, day) -> tuple:
    return conn.execute(
        "SELECT row_count, checksum, archive_uri, removed_at IS NOT NULL FROM outbox.archive_audit"
        " WHERE source = %s AND day = %s AND voided_at IS NULL",
        (COMMANDS, day),
    ).fetchone()


def test_a_day_of_command_keys_is_archived_then_purged_and_its_keys_claimed_afresh(spark, conn, database_url, tmp_path):
    old, open_day, recent = today() - timedelta(days=40), today() - timedelta(days=35), today() - timedelta(days=3)
    keys = commands(conn, old, "start_run", 7, failed=2)
    # A digits-only handler: its folder name must not come back as a number.
    keys_0123 = commands(conn, old, "0123", 2)
    commands(conn, open_day, "start_run", 3, in_progress=1)
    late = commands(conn, open_day - timedelta(days=1), "start_run", 1, settled_after=timedelta(days=33))
    commands(conn, recent, "start_run", 2)
    live_before = live_rows(conn, COMMANDS, old)
    assert len(live_before) == 9

    archiver_url, writer_url = login(database_url, "pgoutbox_archiver"), login(database_url, "pgoutbox_writer")
    with psycopg.connect(archiver_url, autocommit=True) as as_archiver:
        target = jdbc.from_connection(as_archiver)
        first = archive.run(spark, as_archiver, target, make_options(tmp_path, drop=False))
        states = {o.day: (o.state, o.detail) for o in first}
        assert states[old][0] == "archived", first
        assert states[open_day] == ("blocked", "open rows (IN_PROGRESS)"), first
        assert states[open_day - timedelta(days=1)] == ("blocked", "keys settled within the retention"), first
        assert recent not in states, "a day younger than the retention is not even listed"

        # Audited, not removed: every key still answers its retry.
        row_count, checksum, uri, removed = standing_audit(conn, old)
        assert (row_count, removed) == (9, False)
        assert conn.execute(
            "SELECT row_count, checksum FROM outbox.archive_figures(%s, %s)", (COMMANDS, old)
        ).fetchone() == (row_count, checksum)
        assert claim(writer_url, "start_run", keys[-1])[:2] == (False, "DONE")
        folder = Path(uri.removeprefix("file://"))
        assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["handler=0123", "handler=start_run"]
        assert archived_rows(spark, uri) == live_before, "the archive holds exactly the day's keys"

        second = archive.run(spark, as_archiver, target, make_options(tmp_path))
        assert {(o.day, o.state, o.rows) for o in second if o.day == old} == {(old, "removed", 9)}, second

    assert standing_audit(conn, old)[3] is True, "the audit is marked removed"
    assert live_rows(conn, COMMANDS, old) == []
    assert len(live_rows(conn, COMMANDS, open_day)) == 3, "blocked days keep their keys"
    assert conn.execute("SELECT count(*) FROM inbox.commands WHERE command_key = %s", (late[0],)).fetchone() == (1,)
    # Keys are remembered for the retention, no longer: a retry after the
    # purge is a new command.
    claimed, status, result, attempts = claim(writer_url, "start_run", keys[-1])
    assert (claimed, status, result, attempts) == (True, "IN_PROGRESS", None, 1)
    assert claim(writer_url, "0123", keys_0123[0])[0] is True


def test_keys_claimed_again_after_the_audit_are_not_purged(spark, conn, database_url, tmp_path):
    """A FAILED key retried between the audit and the purge holds its day
    back again (IN_PROGRESS, then settled within the retention): nothing is
    purged. (A change the listing cannot see makes the purge roll back with
    ARCHIVE_MISMATCH: pgtap/96_command_archival.sql.)"""
    old = today() - timedelta(days=40)
    keys = commands(conn, old, "start_run", 3, failed=1)
    archiver_url, writer_url = login(database_url, "pgoutbox_archiver"), login(database_url, "pgoutbox_writer")
    with psycopg.connect(archiver_url, autocommit=True) as as_archiver:
        target = jdbc.from_connection(as_archiver)
        [done] = archive.run(spark, as_archiver, target, make_options(tmp_path, drop=False))
        assert done.state == "archived", done
        assert claim(writer_url, "start_run", keys[0])[:2] == (True, "IN_PROGRESS")
        [again] = archive.run(spark, as_archiver, target, make_options(tmp_path))
        assert again.state == "blocked" and again.detail == "open rows (IN_PROGRESS)", again
        with psycopg.connect(writer_url, autocommit=True) as w:
            w.execute("SELECT inbox.fail_command(%s, %s, %s)", ("start_run", keys[0], "again"))
        [late] = archive.run(spark, as_archiver, target, make_options(tmp_path))
        assert late.state == "blocked" and late.detail == "keys settled within the retention", late
    assert len(live_rows(conn, COMMANDS, old)) == 3
    assert standing_audit(conn, old)[3] is False
