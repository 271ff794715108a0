"""pgoutbox migrate: apply (or roll back to --target) the SQL migrations."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pgoutbox.core import db, migrate, settings
from pgoutbox.core.settings import option

COMMAND = "migrate"
HELP = "Apply pending migrations (or roll back to --target); safe to re-run."


@dataclass(frozen=True)
class MigrateConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    target: int | None = option(
        settings.Setting(
            "target",
            "OUTBOX_MIGRATE_TARGET",
            None,
            "Schema version to move to (default: the latest)",
            settings.non_negative_int,
        )
    )
    extension: bool = option(
        settings.Setting(
            "extension",
            "OUTBOX_MIGRATE_EXTENSION",
            "false",
            "On a database without pgoutbox, install it with CREATE EXTENSION (the files must be installed"
            " on the server: docs/extension.md) instead of the migration files; a database that has the"
            " extension is always moved with ALTER EXTENSION",
            settings.boolean,
        )
    )


CONFIG = MigrateConfig
SETTINGS = settings.of(CONFIG)


def run(cfg: MigrateConfig, args: argparse.Namespace) -> int:
    with db.connect(cfg.database_url) as conn:
        ran = migrate.migrate(conn, cfg.target, extension=cfg.extension)
        for step in ran:
            print(step)
        print(f"schema at version {migrate.applied_version(conn)}" + ("" if ran else " (nothing to do)"))
    return 0
