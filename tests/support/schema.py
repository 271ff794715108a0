"""Schemas other than the one this code is built for, made from the real one."""

from __future__ import annotations

import psycopg


def newer_schema(url: str, version: int = 99, serves_workers_from: int = 99) -> None:
    """Makes the database look migrated to `version` by a later release; with
    serves_workers_from above our SCHEMA_VERSION it is a contract that no
    longer serves this code."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox.schema_migrations (version, name) VALUES (%s, %s)", (version, f"{version:04d}_future")
        )
        conn.execute(
            f"CREATE OR REPLACE FUNCTION outbox.serves_workers_from() RETURNS integer"
            f" LANGUAGE sql IMMUTABLE AS 'SELECT {int(serves_workers_from)}'"
        )
