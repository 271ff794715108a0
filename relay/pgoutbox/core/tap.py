"""The testing kit's SQL (docs/testing.md): pgTAP assertions on emitted
events and on upcasters, and the two functions the pytest plugin reads
(pgoutbox_tap.high_water, pgoutbox_tap.emitted_since), all in the schema
pgoutbox_tap.

The files ship inside the package (pgoutbox/tap/: in the checkout a link to
pgtap/helpers/, their one copy), read through importlib.resources; the
extension pgoutbox_tap is generated from the same files
(scripts/gen_extension.py). Installing them is opt-in: the product's
migrations never create pgoutbox_tap, and only the assertions need pgTAP.
"""

from __future__ import annotations

from importlib import resources

import psycopg

# In this order: the upcaster helpers are independent of the events ones.
FILES = ("events.sql", "upcasters.sql")
SCHEMA = "pgoutbox_tap"


def kit_sql() -> str:
    """The kit as one script: every statement idempotent (CREATE SCHEMA IF NOT
    EXISTS, CREATE OR REPLACE FUNCTION), so it installs again over itself."""
    folder = resources.files("pgoutbox").joinpath("tap")
    return "\n".join(folder.joinpath(name).read_text() for name in FILES)


def install(conn: psycopg.Connection) -> None:
    """Creates or replaces the kit in conn's database, in one transaction.
    The caller is the role that owns the pgoutbox schema (the one that ran
    `pgoutbox migrate`): the kit's SECURITY DEFINER functions read
    outbox.events with its rights."""
    with conn.transaction():
        conn.execute(kit_sql())  # several statements: no parameters, so one simple query


def pgtap_installed(conn: psycopg.Connection) -> bool:
    return conn.execute("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'pgtap')").fetchone() == (
        True,
    )
