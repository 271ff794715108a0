"""pgoutbox status: outbox and inbox backlog, scheduled events, and recent dead letters."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import psycopg

from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import wrap_exceptions
from pgoutbox.core.settings import option

COMMAND = "status"
HELP = (
    "Show outbox.backlog() and inbox.backlog() per context, the events scheduled for later"
    " (outbox.scheduled(): apart from the backlog), and dead letters."
)


@dataclass(frozen=True)
class StatusConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    context: str | None = option(
        settings.Setting("context", "OUTBOX_STATUS_CONTEXT", None, "Only this bounded context", bound=bounds.CONTEXT)
    )
    dead_letters: int = option(
        settings.Setting(
            "dead_letters",
            "OUTBOX_STATUS_DEAD_LETTERS",
            "10",
            "How many dead-lettered events to list",
            settings.integer,
            bound=bounds.MAX_ROWS,
        )
    )


CONFIG = StatusConfig
SETTINGS = settings.of(CONFIG)


def _rows(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
    cur = conn.execute(query, params)
    names = [c.name for c in cur.description or ()]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def run(cfg: StatusConfig, args: argparse.Namespace) -> int:
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        report = {
            "outbox": _rows(conn, "SELECT * FROM outbox.backlog(%s)", (cfg.context,)),
            # Waiting for their delivery time (emit's deliver_at / deliver_after):
            # counted in the backlog's unpublished, never in its due.
            "scheduled": _rows(conn, "SELECT * FROM outbox.scheduled(%s)", (cfg.context,)),
            "inbox": _rows(conn, "SELECT * FROM inbox.backlog(%s)", (cfg.context,)),
            "dead_letters": _rows(conn, "SELECT * FROM outbox.dead_letters(%s, %s)", (cfg.context, cfg.dead_letters)),
        }
    print(json.dumps(report, indent=2, default=str))
    return 0
