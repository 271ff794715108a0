"""pgoutbox requeue: move dead-lettered events back to PENDING, with a reason."""

from __future__ import annotations

import uuid

from pgoutbox.core import db, settings
from pgoutbox.core.errors import ConfigError, wrap_exceptions

COMMAND = "requeue"
HELP = "Requeue DEAD_LETTER events (all or nothing); the reason is recorded in outbox.requeue_log."
SETTINGS = settings.DATABASE + (
    settings.Setting("reason", "OUTBOX_REQUEUE_REASON", None, "Why (recorded)", required=True),
)


def add_arguments(parser) -> None:
    parser.add_argument("event_ids", nargs="+", metavar="EVENT_ID", help="event ids to requeue")


def run(cfg, args) -> int:
    try:
        ids = [uuid.UUID(x) for x in args.event_ids]
    except ValueError as exc:
        raise ConfigError(f"not an event id: {exc}") from exc
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        moved = conn.execute("SELECT outbox.requeue(%s, %s)", (ids, cfg.reason)).fetchone()[0]
    print(f"requeued {moved} event(s)")
    return 0
