"""pgoutbox testing: the testing kit for applications (docs/testing.md).

pgoutbox testing install-tap   create or replace the schema pgoutbox_tap
                               (run as the role that ran `pgoutbox migrate`)
pgoutbox testing tap-sql       print the same SQL, for \\i in a test's
                               transaction or a deployment tool
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from pgoutbox.core import db, settings, tap
from pgoutbox.core.errors import wrap_exceptions
from pgoutbox.core.settings import option

COMMAND = "testing"
HELP = "The testing kit: install the pgTAP assertions on emitted events (install-tap), or print their SQL (tap-sql)."


@dataclass(frozen=True)
class TestingConfig:
    database_url: str | None = option(settings.DATABASE_URL)


CONFIG = TestingConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("install-tap", "tap-sql"))


def run(cfg: TestingConfig, args: argparse.Namespace) -> int:
    if args.action == "tap-sql":
        sys.stdout.write(tap.kit_sql())
        return 0
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        tap.install(conn)
        has_pgtap = tap.pgtap_installed(conn)
    print(f"installed the testing kit in schema {tap.SCHEMA}")
    if not has_pgtap:
        print("note: pgTAP is not installed in this database; its assertions need it (CREATE EXTENSION pgtap)")
    return 0
