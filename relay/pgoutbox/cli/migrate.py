"""pgoutbox migrate: apply (or roll back to --target) the SQL migrations."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import timedelta

from pgoutbox.core import db, migrate, settings
from pgoutbox.core.settings import option

COMMAND = "migrate"
HELP = "Apply pending migrations (or roll back to --target); safe to re-run."


def lock_timeout(text: str) -> timedelta:
    return settings.bound(text, floor=timedelta(milliseconds=1), ceiling=timedelta(hours=1))


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

    lock_timeout: timedelta = option(
        settings.Setting(
            "lock_timeout",
            "OUTBOX_MIGRATE_LOCK_TIMEOUT",
            f"{migrate.LOCK_TIMEOUT.total_seconds() * 1000:.0f}ms",
            "Longest wait for each lock a migration takes; past it the migration gives way to the running"
            " workers, rolls back and runs again after a pause (for at most 5 minutes). Keep it below"
            " PostgreSQL's deadlock_timeout (1s) so that a deadlock costs the migration a retry, not a worker",
            lock_timeout,
        )
    )


CONFIG = MigrateConfig
SETTINGS = settings.of(CONFIG)


def run(cfg: MigrateConfig, args: argparse.Namespace) -> int:
    with db.connect(cfg.database_url) as conn:
        ran = migrate.migrate(conn, cfg.target, extension=cfg.extension, lock_timeout=cfg.lock_timeout)
        for step in ran:
            print(step)
        print(f"schema at version {migrate.applied_version(conn)}" + ("" if ran else " (nothing to do)"))
    return 0
