"""Connections. A conninfo/URL from OUTBOX_DATABASE_URL, else libpq's PG*
variables (an empty conninfo lets libpq read them); no default credentials."""

from __future__ import annotations

import psycopg

from . import SCHEMA_VERSION
from .errors import SchemaMismatch


def conninfo(database_url: str | None) -> str:
    return database_url or ""


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
