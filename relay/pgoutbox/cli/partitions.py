"""pgoutbox partitions: create the daily outbox partitions ahead of time."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pgoutbox.core import db, settings
from pgoutbox.core.errors import wrap_exceptions
from pgoutbox.core.settings import option
from pgoutbox.outbox.settings import DAYS_AHEAD

COMMAND = "partitions"
HELP = "Create daily partitions of outbox.events ahead (idempotent); run daily."


@dataclass(frozen=True)
class PartitionsConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    days_ahead: int = option(DAYS_AHEAD)


CONFIG = PartitionsConfig
SETTINGS = settings.of(CONFIG)


def run(cfg: PartitionsConfig, args: argparse.Namespace) -> int:
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        created = [r[0] for r in conn.execute("SELECT * FROM outbox.create_partitions(%s)", (cfg.days_ahead,))]
    print("created: " + (", ".join(created) if created else "nothing (all present)"))
    return 0
