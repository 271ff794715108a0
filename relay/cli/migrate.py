"""pgoutbox migrate: apply (or roll back to --target) the SQL migrations."""

from __future__ import annotations

from pgoutbox.core import db, migrate, settings

COMMAND = "migrate"
HELP = "Apply pending migrations (or roll back to --target); safe to re-run."
SETTINGS = settings.DATABASE + (
    settings.Setting(
        "target",
        "OUTBOX_MIGRATE_TARGET",
        None,
        "Schema version to move to (default: the latest)",
        settings.non_negative_int,
    ),
)


def run(cfg, args) -> int:
    with db.connect(cfg.database_url) as conn:
        ran = migrate.migrate(conn, cfg.target)
        for step in ran:
            print(step)
        print(f"schema at version {migrate.applied_version(conn)}" + ("" if ran else " (nothing to do)"))
    return 0
