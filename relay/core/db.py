"""Connections. A conninfo/URL from OUTBOX_DATABASE_URL, else libpq's PG*
variables (an empty conninfo lets libpq read them); no default credentials.

connect() and aconnect() turn a failed connection into DatabaseUnavailable
(one line: where, which setting, libpq's reason; never the password), so every
command and worker reports it the same way."""

from __future__ import annotations

import os

import psycopg
import psycopg.errors

from pgoutbox import SCHEMA_VERSION
from pgoutbox.core.errors import ConfigError, DatabaseUnavailable, SchemaMismatch
from pgoutbox.core.settings import redact

SETTING = "OUTBOX_DATABASE_URL or --database-url; the PG* variables when unset"

# SQLSTATEs of a server that refuses or drops the session rather than a statement
# (libpq's own connection failures carry none).
_CONNECTION_STATES = ("08", "57P01", "57P02", "57P03", "53300", "28")


def conninfo(database_url: str | None) -> str:
    return database_url or ""


def describe(database_url: str | None) -> str:
    """Where a conninfo points, for messages: host, port and database, never the password."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(conninfo(database_url))
    except psycopg.ProgrammingError:
        return "(unparsable OUTBOX_DATABASE_URL)"
    host = parts.get("host") or os.environ.get("PGHOST") or "(libpq default host)"
    port = parts.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = parts.get("dbname") or os.environ.get("PGDATABASE") or "(default)"
    return f"{host}:{port} database {dbname}"


def is_connection_error(exc: BaseException) -> bool:
    """A failure of the connection itself (unreachable, refused, dropped), not of a statement."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    return exc.sqlstate is None or exc.sqlstate.startswith(_CONNECTION_STATES)


def _reason(exc: BaseException, database_url: str | None) -> str:
    reason = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return redact(reason.removeprefix("connection failed: "), conninfo(database_url))


def unavailable(exc: psycopg.Error, database_url: str | None, *, lost: bool = False) -> DatabaseUnavailable:
    """One line for a connection that failed: where, which setting, and libpq's reason.

    libpq gives connection failures no SQLSTATE, so the reason is shown, never matched on."""
    what = "lost the connection to" if lost else "cannot connect to"
    return DatabaseUnavailable(
        f"{what} PostgreSQL at {describe(database_url)} ({SETTING}): {_reason(exc, database_url)}"
    )


def refused(exc: psycopg.Error, database_url: str | None) -> DatabaseUnavailable:
    """One line for a statement the login role may not run (a missing grant, not a bug)."""
    return DatabaseUnavailable(
        f"PostgreSQL at {describe(database_url)} refused [{exc.sqlstate}]: {_reason(exc, database_url)}; "
        f"grant the role of {SETTING} the pgoutbox role this command needs (README: Roles)"
    )


def _bad_conninfo(exc: psycopg.ProgrammingError, database_url: str | None) -> ConfigError:
    return ConfigError(
        f"OUTBOX_DATABASE_URL (flag --database-url) is not a PostgreSQL URL or conninfo: {_reason(exc, database_url)}"
    )


def connect(
    database_url: str | None, *, autocommit: bool = True, check_schema: bool = False, **kwargs
) -> psycopg.Connection:
    """A connection; with check_schema, only to a schema this code was built for."""
    try:
        conn = psycopg.connect(conninfo(database_url), autocommit=autocommit, **kwargs)
    except psycopg.OperationalError as exc:
        raise unavailable(exc, database_url) from exc
    except psycopg.ProgrammingError as exc:  # an option libpq does not know
        raise _bad_conninfo(exc, database_url) from exc
    if check_schema:
        try:
            check_schema_version(applied_version(conn))
        except BaseException:
            conn.close()
            raise
    return conn


async def aconnect(database_url: str | None, *, autocommit: bool = True, **kwargs) -> psycopg.AsyncConnection:
    try:
        return await psycopg.AsyncConnection.connect(conninfo(database_url), autocommit=autocommit, **kwargs)
    except psycopg.OperationalError as exc:
        raise unavailable(exc, database_url) from exc
    except psycopg.ProgrammingError as exc:
        raise _bad_conninfo(exc, database_url) from exc


def applied_version(conn: psycopg.Connection) -> int:
    """The schema version of the database (0: pgoutbox was never migrated there)."""
    exists = conn.execute("SELECT to_regclass('outbox.schema_migrations') IS NOT NULL").fetchone()[0]
    if not exists:
        return 0
    return int(conn.execute("SELECT outbox.schema_version()").fetchone()[0])


def check_schema_version(found: int) -> None:
    """Refuse to run against a schema this code does not understand."""
    if found != SCHEMA_VERSION:
        raise SchemaMismatch(
            f"database schema is at version {found}, this pgoutbox expects {SCHEMA_VERSION}: "
            + ("run `pgoutbox migrate`" if found < SCHEMA_VERSION else "upgrade pgoutbox")
        )
