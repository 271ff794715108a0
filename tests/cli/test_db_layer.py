"""The one database layer (core.db.Pool) both workers use: session settings and
the schema check on every new connection, long-lived sessions, and connection
failure or loss as DatabaseUnavailable, in bounded time, on both sides."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from pgoutbox import OLDEST_SCHEMA, SCHEMA_VERSION
from pgoutbox.core import db
from pgoutbox.core.errors import DatabaseUnavailable, SchemaMismatch
from pgoutbox.inbox import store as inbox_store
from pgoutbox.outbox.calls import OutboxCalls
from support.schema import newer_schema


def _terminate(database_url: str, pid: int) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))


async def test_every_new_connection_checks_the_schema_version(database_url, empty_database_url):
    newer_schema(database_url)  # a contract release that no longer serves this code
    for url, expected in ((database_url, "database schema is at version 99"), (empty_database_url, "no pgoutbox")):
        for pool in (inbox_store.pool(url, 2), OutboxCalls(url, "claim").pool):
            try:
                with pytest.raises(SchemaMismatch, match=expected):
                    async with pool.connection():
                        pass
            finally:
                await pool.close()


async def test_a_newer_schema_that_still_serves_this_code_is_accepted_an_older_one_is_not(database_url):
    # Expand-only release: schema 99 still serves workers built for ours.
    newer_schema(database_url, serves_workers_from=OLDEST_SCHEMA)
    for pool in (inbox_store.pool(database_url, 1), OutboxCalls(database_url, "claim").pool):
        try:
            async with pool.connection():
                pass
            assert pool.schema_found == 99
        finally:
            await pool.close()
    with psycopg.connect(database_url, autocommit=True) as conn:
        db.check_schema_version(db.applied_version(conn), db.serves_from(conn))
        conn.execute("DELETE FROM outbox.schema_migrations WHERE version >= %s", (OLDEST_SCHEMA,))
        with pytest.raises(SchemaMismatch, match="run `pgoutbox migrate`"):
            db.check_schema_version(db.applied_version(conn), db.serves_from(conn))
    # A schema from before outbox.serves_workers_from() serves no other build.
    with pytest.raises(SchemaMismatch, match="upgrade pgoutbox"):
        db.check_schema_version(SCHEMA_VERSION + 1, None)


async def test_sessions_are_set_up_once_and_kept(database_url):
    set_up = []

    async def configure(conn):
        set_up.append(conn.info.backend_pid)

    pool = db.Pool(database_url, name="t", options={"TimeZone": "UTC", "DateStyle": "ISO"}, configure=configure)
    try:
        pids = set()
        for _ in range(5):
            async with pool.connection() as conn:
                pids.add(conn.info.backend_pid)
                assert (await (await conn.execute("SHOW TimeZone")).fetchone())[0] == "UTC"
                assert (await (await conn.execute("SELECT outbox.schema_version()")).fetchone())[0] == SCHEMA_VERSION
        assert len(pids) == 1 and set_up == list(pids)
    finally:
        await pool.close()


async def test_a_lost_connection_is_database_unavailable_then_replaced_on_the_inbox_side(database_url):
    pool = inbox_store.pool(database_url, 1)
    inbox = inbox_store.Inbox(pool)
    try:
        assert await inbox.schema_version() == SCHEMA_VERSION
        async with pool.connection() as conn:
            pid = conn.info.backend_pid
        _terminate(database_url, pid)
        with pytest.raises(DatabaseUnavailable, match="lost the connection to PostgreSQL"):
            await inbox.backlog()
        assert await inbox.schema_version() == SCHEMA_VERSION
        async with pool.connection() as conn:
            assert conn.info.backend_pid != pid
    finally:
        await pool.close()


async def test_a_lost_connection_is_database_unavailable_then_replaced_on_the_relay_side(database_url):
    calls = OutboxCalls(database_url, "claim", synchronous_commit=False, wire_times=True)
    try:
        assert not calls.connected
        assert await calls.schema_version() == SCHEMA_VERSION
        assert calls.connected
        settings = await calls._run(
            "SELECT current_setting('synchronous_commit') AS sc, current_setting('TimeZone') AS tz, "
            "pg_backend_pid() AS pid, now() AS at"
        )
        assert (settings["sc"], settings["tz"]) == ("off", "UTC")
        assert isinstance(settings["at"], str)  # the wire text loader of claim sessions
        _terminate(database_url, settings["pid"])
        with pytest.raises(DatabaseUnavailable, match="lost the connection to PostgreSQL"):
            await calls.backlog()
        assert not calls.connected
        again = await calls._run("SELECT pg_backend_pid() AS pid")
        assert again["pid"] != settings["pid"]
    finally:
        await calls.close()


async def test_concurrent_relay_calls_share_its_one_session(database_url):
    """The relay's backlog and partitions loops call the same OutboxCalls at once."""
    calls = OutboxCalls(database_url, "backlog")
    try:
        rows = await asyncio.wait_for(
            asyncio.gather(*(calls._run("SELECT pg_backend_pid() AS pid, pg_sleep(0.2)") for _ in range(3))), 5
        )
        assert len({row["pid"] for row in rows}) == 1
    finally:
        await calls.close()
