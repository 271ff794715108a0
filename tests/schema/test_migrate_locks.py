"""A migration gives way to the running workers: it waits for each lock at
most OUTBOX_MIGRATE_LOCK_TIMEOUT, then rolls its file back and runs it again,
so that a worker holding a lock is never the side PostgreSQL aborts."""

from __future__ import annotations

import logging
import threading
import time

import psycopg

from pgoutbox.core import migrate


def test_a_migration_waits_behind_a_worker_lock_and_retries_until_it_is_gone(database_url, caplog):
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrate.migrate(conn, target=10)  # 0011 drops a trigger of outbox.events: ACCESS EXCLUSIVE
    held = threading.Event()

    def worker() -> None:  # a relay's statement that keeps outbox.events open for 2 s
        with psycopg.connect(database_url) as conn:
            conn.execute("SELECT count(*) FROM outbox.events")
            held.set()
            time.sleep(2)

    thread = threading.Thread(target=worker)
    thread.start()
    held.wait(10)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pgoutbox.core.migrate"):
        with psycopg.connect(database_url, autocommit=True) as conn:
            ran = migrate.migrate(conn)
            assert migrate.applied_version(conn) == migrate.discover()[-1].version
            # The session's own setting is back as it was.
            assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
    took = time.monotonic() - started
    thread.join()
    assert ran[0] == "up 0011_emit_path", ran
    retries = [r for r in caplog.records if getattr(r, "action", None) == "migrate_lock_retry"]
    assert retries, "the migration never gave way"
    assert retries[0].getMessage().startswith("0011_emit_path.up.sql gave way to a lock a running worker holds"), (
        retries[0].getMessage()
    )
    # not a race: a lower bound the test's own lock (held for 2 s from before the start) guarantees
    assert took >= 1.0, took  # it waited for the worker rather than failing


def test_a_lock_held_past_the_lock_wait_fails_the_migration_in_one_line(database_url, monkeypatch):
    monkeypatch.setattr(migrate, "LOCK_WAIT", 1.0)
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrate.migrate(conn, target=10)
    with psycopg.connect(database_url) as holder:
        holder.execute("SELECT count(*) FROM outbox.events")  # held until this block ends
        with psycopg.connect(database_url, autocommit=True) as conn:
            try:
                migrate.migrate(conn)
            except psycopg.errors.LockNotAvailable:
                pass
            else:
                raise AssertionError("a migration that never gets its lock must fail")
            assert migrate.applied_version(conn) == 10  # rolled back whole
