"""The console's tests log in with a role and a password, so they run on a
PostgreSQL of their own that checks passwords (scram-sha-256 for every role
but the superuser, which sets up): the suite's shared server trusts loopback,
where a wrong password would pass."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from pgoutbox.core import migrate as migrate_mod
from pgoutbox.dev.embedded import EmbeddedPostgres
from support.waiting import wait_for

TEMPLATE = "console_template"

_HBA = """\
local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
"""


@pytest.fixture(scope="session")
def password_pg():
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-console-pg-"))
    server = EmbeddedPostgres(root, settings={"fsync": "off", "synchronous_commit": "off"})
    server.start()
    try:
        (server.datadir / "pg_hba.conf").write_text(_HBA)
        server.reload()
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {TEMPLATE}")
            conn.execute("CREATE ROLE hba_probe LOGIN PASSWORD 'right'")

        def checks_passwords() -> bool:  # a reload takes effect a moment after pg_ctl returns
            try:
                psycopg.connect(server.dsn().replace("postgres@", "hba_probe:wrong@", 1)).close()
                return False
            except psycopg.OperationalError:
                return True

        wait_for(checks_passwords, 10, "pg_hba.conf to ask for passwords")
        with psycopg.connect(server.dsn(TEMPLATE), autocommit=True) as conn:
            migrate_mod.migrate(conn)
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def console_db(password_pg):
    """A fresh migrated database on the password-checking server: (superuser URL, URL without a user)."""
    name = f"c{time.monotonic_ns()}"
    with psycopg.connect(password_pg.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    yield password_pg.dsn(name), f"postgresql://127.0.0.1:{password_pg.port}/{name}"
    with psycopg.connect(password_pg.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
