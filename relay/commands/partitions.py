"""pgoutbox partitions: create the daily outbox partitions ahead of time."""

from __future__ import annotations

from .. import db, settings
from ..errors import wrap_exceptions

COMMAND = "partitions"
HELP = "Create daily partitions of outbox.events ahead (idempotent); run daily."
SETTINGS = settings.DATABASE + (
    settings.Setting(
        "days_ahead", "OUTBOX_PARTITION_DAYS_AHEAD", "7",
        "How many days of partitions to keep ready", settings.non_negative_int,
    ),
)


def run(cfg, args) -> int:
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        created = [r[0] for r in conn.execute(
            "SELECT * FROM outbox.create_partitions(%s)", (cfg.days_ahead,)
        )]
    print("created: " + (", ".join(created) if created else "nothing (all present)"))
    return 0
