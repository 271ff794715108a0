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


def as_role(url: str | None, role: str, as_owner: str | None = None) -> str | None:
    """The URL a command under test runs with: a fresh login in `role` only when
    `url` is the superuser's (the suite's fixtures), else `url` as it is (a
    login the test made). `as_owner`: why this test runs the command as the
    owner instead (the suite's audit counts it)."""
    if as_owner is not None or not url or "//postgres@" not in url:
        return url
    try:
        return login(url, role)
    except psycopg.OperationalError:
        # A server (or database) a test made unreachable: no login can be made, and
        # none is needed, since nothing runs there as anyone until it answers.
        return url


def groups(url: str) -> set[str]:
    """The roles the URL's user is a member of (directly), as PostgreSQL says."""
    with psycopg.connect(url, autocommit=True) as c:
        rows = c.execute(
            "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
            " JOIN pg_roles u ON u.oid = m.member WHERE u.rolname = current_user"
        ).fetchall()
        superuser = c.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]
    return {r[0] for r in rows} | ({"SUPERUSER"} if superuser else set())
