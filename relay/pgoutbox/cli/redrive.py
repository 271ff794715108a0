"""pgoutbox redrive: an operator sends dead-lettered inbox messages back to
their handler, with a reason (recorded in inbox.redrive_log)."""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass

from psycopg.rows import dict_row

from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import ConfigError, wrap_exceptions
from pgoutbox.core.settings import option

COMMAND = "redrive"
HELP = (
    "List a handler's dead letters (--list), or redrive some (ids) or all (--all) of them with a "
    "reason; the replayer re-publishes them, whatever the replay switch and cap say."
)


@dataclass(frozen=True)
class RedriveConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    reason: str | None = option(
        settings.Setting(
            "reason", "OUTBOX_REDRIVE_REASON", None, "Why (recorded; required to redrive)", bound=bounds.REASON
        )
    )


CONFIG = RedriveConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("handler", metavar="HANDLER", help="the handler whose dead letters to redrive")
    parser.add_argument("message_ids", nargs="*", metavar="MESSAGE_ID", help="message ids to redrive")
    parser.add_argument("--all", action="store_true", help="every dead letter of the handler")
    parser.add_argument("--list", action="store_true", help="only list the handler's dead letters")


def run(cfg: RedriveConfig, args: argparse.Namespace) -> int:
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        if args.list:
            cur = conn.cursor(row_factory=dict_row).execute(
                "SELECT * FROM inbox.dead_letters(%s, 1000)", (args.handler,)
            )
            for row in cur.fetchall():
                print(json.dumps(row, default=str))
            return 0
        if bool(args.message_ids) == bool(args.all):
            raise ConfigError("give message ids or --all (not both), or --list")
        if not cfg.reason:
            raise ConfigError("a redrive needs --reason (or OUTBOX_REDRIVE_REASON)")
        try:
            ids = None if args.all else [uuid.UUID(x) for x in args.message_ids]
        except ValueError as exc:
            raise ConfigError(f"not a message id: {exc}") from exc
        [(count,)] = conn.execute("SELECT inbox.redrive(%s, %s, %s)", (args.handler, ids, cfg.reason)).fetchall()
    print(f"marked {count} dead letter(s) of {args.handler} for redrive; the replayer re-publishes them")
    return 0
