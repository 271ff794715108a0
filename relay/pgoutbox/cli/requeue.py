"""pgoutbox requeue: move dead-lettered events back to PENDING, with a reason."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass

from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import ConfigError, wrap_exceptions
from pgoutbox.core.settings import option

COMMAND = "requeue"
HELP = "Requeue DEAD_LETTER events (all or nothing); the reason is recorded in outbox.requeue_log."


@dataclass(frozen=True)
class RequeueConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    reason: str = option(
        settings.Setting("reason", "OUTBOX_REQUEUE_REASON", None, "Why (recorded)", required=True, bound=bounds.REASON)
    )


CONFIG = RequeueConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_ids", nargs="+", metavar="EVENT_ID", help="event ids to requeue")


def run(cfg: RequeueConfig, args: argparse.Namespace) -> int:
    try:
        ids = [uuid.UUID(x) for x in args.event_ids]
    except ValueError as exc:
        raise ConfigError(f"not an event id: {exc}") from exc
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        [(moved,)] = conn.execute("SELECT outbox.requeue(%s, %s)", (ids, cfg.reason)).fetchall()
    print(f"requeued {moved} event(s)")
    return 0
