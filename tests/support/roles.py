"""Logins for tests that run as the least-privileged role the docs give."""

from __future__ import annotations

import time

import psycopg


def login(url: str, role: str) -> str:
    """The URL for a fresh login role in group `role` only (the server trusts loopback)."""
    name = f"t_{role.removeprefix('pgoutbox_')}_{time.monotonic_ns()}"
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(
            psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                psycopg.sql.Identifier(name), psycopg.sql.Identifier(role)
            )
        )
    return url.replace("postgres@", f"{name}@", 1)
