"""Connections. A conninfo/URL from OUTBOX_DATABASE_URL, else libpq's PG*
variables (an empty conninfo lets libpq read them); no default credentials."""

from __future__ import annotations

import psycopg

from . import SCHEMA_VERSION
from .errors import DatabaseUnavailable, SchemaMismatch


def conninfo(database_url: str | None) -> str:
    return database_url or ""


def describe(database_url: str | None) -> str:
    """Where a conninfo points, for messages: host, port and database, never the password."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(conninfo(database_url))
    except psycopg.ProgrammingError:
        return "(unparsable OUTBOX_DATABASE_URL)"
    where = f"{parts.get('host') or '(libpq default host)'}:{parts.get('port') or '(default port)'}"
    return f"{where} database {parts.get('dbname') or '(default)'}"


def unavailable(exc: psycopg.Error, database_url: str | None) -> DatabaseUnavailable:
    """One line for a connection that failed: where, which setting, and libpq's reason.

    libpq gives connection failures no SQLSTATE, so the reason is shown, never matched on."""
    reason = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    reason = reason.removeprefix("connection failed: ")
    return DatabaseUnavailable(
        f"cannot connect to PostgreSQL at {describe(database_url)} (OUTBOX_DATABASE_URL or PG*): {reason}"
    )


def connect(database_url: str | None, *, autocommit: bool = True, **kwargs) -> psycopg.Connection:
    return psycopg.connect(conninfo(database_url), autocommit=autocommit, **kwargs)


async def aconnect(
    database_url: str | None, *, autocommit: bool = True, **kwargs
) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(
        conninfo(database_url), autocommit=autocommit, **kwargs
    )


def check_schema_version(found: int) -> None:
    """Refuse to run against a schema this code does not understand."""
    if found != SCHEMA_VERSION:
        raise SchemaMismatch(
            f"database schema is at version {found}, this pgoutbox expects {SCHEMA_VERSION}: "
            + ("run `pgoutbox migrate`" if found < SCHEMA_VERSION else "upgrade pgoutbox")
        )
