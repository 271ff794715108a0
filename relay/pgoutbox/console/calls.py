"""The console's database calls: every one a SQL function, run in a session
opened as the person logged in (the console has no role of its own), so
PostgreSQL's grants decide what each person may see and do.

The SQL lives here and nowhere else in the console; rows come back as dicts
for the templates."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, LiteralString

import psycopg
import psycopg.errors
from psycopg.rows import dict_row

from pgoutbox.console import inputs
from pgoutbox.core import db

log = logging.getLogger(__name__)

Row = dict[str, Any]
Conn = psycopg.AsyncConnection[Row]


class LoginRefused(Exception):
    """PostgreSQL refused the role or password (the console does not say which)."""


class Unavailable(Exception):
    """PostgreSQL could not be reached (one line: where, and libpq's reason)."""


SETTING = "OUTBOX_CONSOLE_DATABASE_URL; the PG* variables when unset"
# What a person who has not logged in is told: not where the database is.
UNAVAILABLE = f"The console cannot reach PostgreSQL now: try again, or ask whoever runs it to check {SETTING}."


@contextlib.asynccontextmanager
async def session(database_url: str | None, user: str, password: str) -> AsyncIterator[Conn]:
    """An autocommit session as `user`: each call its own transaction.

    The user and password are checked here too, whoever calls: libpq must never
    see a NUL (it would end the conninfo there) nor more than PostgreSQL takes."""
    inputs.role(user)
    inputs.password(password)
    if not user or not password:
        raise LoginRefused()  # never let libpq fill in PGPASSWORD or a pgpass file's
    try:
        conn = await psycopg.AsyncConnection.connect(
            db.conninfo(database_url),
            user=user,
            password=password,
            autocommit=True,
            row_factory=dict_row,
            connect_timeout=db.CONNECT_TIMEOUT,
            application_name="pgoutbox-console",
        )
    except psycopg.Error as exc:
        # libpq gives a refused login no SQLSTATE; what tells it from an
        # unreachable server is that the server asked for the password (a role
        # that does not exist is asked too: PostgreSQL does not tell them apart).
        pgconn = getattr(exc, "pgconn", None)
        if pgconn is not None and pgconn.used_password:
            raise LoginRefused() from None  # `from None`: the chained error's pgconn holds the password
        raise Unavailable(db.unavailable(exc, database_url, setting=SETTING).args[0]) from None
    try:
        yield conn
    finally:
        await conn.close()


async def rows(conn: Conn, query: LiteralString, params: tuple[Any, ...] = ()) -> list[Row]:
    cur = await conn.execute(query, params)
    return await cur.fetchall()


async def one(conn: Conn, query: LiteralString, params: tuple[Any, ...] = ()) -> Row | None:
    cur = await conn.execute(query, params)
    return await cur.fetchone()


def is_connection_error(exc: BaseException) -> bool:
    return db.is_connection_error(exc)


def _may(function: LiteralString) -> LiteralString:
    """Whether the role may run `function`: false, not an error, when it does not exist (an older schema)."""
    return "coalesce(has_function_privilege(to_regprocedure('" + function + "'), 'EXECUTE'), false)"


async def who(conn: Conn) -> Row:
    """The role logged in, and which of the console's actions PostgreSQL lets it run
    (each answered by the grant on the function the action calls: the controls
    follow the grants, and the grants decide)."""
    query: LiteralString = (
        "SELECT session_user AS name, "
        + _may("outbox.dlq_replay(jsonb, text, integer)")
        + " AS may_replay, "
        + _may("outbox.dlq_discard(jsonb, text, integer)")
        + " AS may_discard, "
        + _may("outbox.dlq_restore(jsonb, text, integer)")
        + " AS may_restore, "
        + _may("inbox.set_replay(text, boolean, text)")
        + " AS may_switch"
    )
    row = await one(conn, query)
    assert row is not None
    return row


async def outbox_backlog(conn: Conn) -> list[Row]:
    return await rows(conn, "SELECT * FROM outbox.backlog()")


async def outbox_scheduled(conn: Conn) -> list[Row]:
    return await rows(conn, "SELECT * FROM outbox.scheduled()")


async def inbox_backlog(conn: Conn) -> list[Row]:
    return await rows(conn, "SELECT * FROM inbox.backlog()")


async def set_replay(conn: Conn, handler: str, enabled: bool, reason: str) -> Row | None:
    return await one(conn, "SELECT * FROM inbox.set_replay(%s, %s, %s)", (handler, enabled, reason))


async def dlq_summary(conn: Conn) -> dict[tuple[str, str], Row]:
    """Per (side, owner) with dead letters: live and discarded counts, re-failures and,
    for a handler, whether automated replay is on."""
    found = await rows(conn, "SELECT * FROM outbox.dlq_summary()")
    return {(r["side"], r["owner"]): r for r in found}


def _filter(flt: dict[str, Any]) -> str:
    return json.dumps(flt)


async def groups(conn: Conn, flt: dict[str, Any], max_rows: int) -> list[Row]:
    return await rows(conn, "SELECT * FROM outbox.dlq_groups(%s::jsonb, %s)", (_filter(flt), max_rows))


async def dead_letters(conn: Conn, flt: dict[str, Any], max_rows: int, after: str | None = None) -> list[Row]:
    return await rows(conn, "SELECT * FROM outbox.dlq_list(%s::jsonb, %s, %s)", (_filter(flt), max_rows, after))


async def show(conn: Conn, side: str, id: str, handler: str | None) -> dict[str, Any]:
    row = await one(conn, "SELECT outbox.dlq_show(%s, %s::uuid, %s) AS detail", (side, id, handler))
    assert row is not None
    detail: dict[str, Any] = row["detail"]
    return detail


async def flow(conn: Conn, correlation_id: str, max_rows: int) -> list[Row]:
    return await rows(conn, "SELECT * FROM outbox.flow(%s::uuid, %s)", (correlation_id, max_rows))


async def count(conn: Conn, flt: dict[str, Any], action: str) -> int:
    row = await one(conn, "SELECT outbox.dlq_count(%s::jsonb, %s) AS n", (_filter(flt), action))
    return int(row["n"]) if row else 0


_ACTIONS: dict[str, LiteralString] = {
    "replay": "SELECT outbox.dlq_replay(%s::jsonb, %s, %s) AS n",
    "discard": "SELECT outbox.dlq_discard(%s::jsonb, %s, %s) AS n",
    "restore": "SELECT outbox.dlq_restore(%s::jsonb, %s, %s) AS n",
}
ACTIONS = tuple(_ACTIONS)


async def act(conn: Conn, action: str, flt: dict[str, Any], reason: str, max_rows: int) -> int:
    """One batch of `action` by filter: the rows it touched (0: nothing left)."""
    row = await one(conn, _ACTIONS[action], (_filter(flt), reason, max_rows))
    return int(row["n"]) if row else 0


async def prepare(conn: Conn, flt: dict[str, Any], action: str) -> tuple[int, int]:
    """Fixes the rows `action` would touch now: (the action's id, how many)."""
    row = await one(conn, "SELECT * FROM outbox.dlq_prepare(%s::jsonb, %s)", (_filter(flt), action))
    assert row is not None
    return int(row["action_id"]), int(row["total"])


async def act_prepared(conn: Conn, action_id: int, reason: str, max_rows: int) -> int:
    """One batch of a prepared action: the targets it took (0: none left, or stopped)."""
    row = await one(conn, "SELECT outbox.dlq_act(%s, %s, %s) AS n", (action_id, reason, max_rows))
    return int(row["n"]) if row else 0


async def stop(conn: Conn, action_id: int) -> bool:
    row = await one(conn, "SELECT outbox.dlq_stop(%s) AS stopped", (action_id,))
    return bool(row and row["stopped"])


async def progress(conn: Conn, action_id: int) -> Row | None:
    return await one(conn, "SELECT * FROM outbox.dlq_action_progress(%s)", (action_id,))
