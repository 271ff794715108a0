"""pgoutbox redrive: an operator sends dead-lettered inbox messages back to
their handler, with a reason (recorded in inbox.redrive_log); with --match,
every dead letter a filter matches, on both sides (outbox events are
requeued), in throttled batches (outbox.dlq_replay)."""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgoutbox.cli import dead_letters
from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import ConfigError, wrap_exceptions
from pgoutbox.core.settings import option

COMMAND = "redrive"
HELP = (
    "List a handler's dead letters (--list), or redrive some (ids) or all (--all) of them with a "
    "reason; the replayer re-publishes them, whatever the replay switch and cap say. --match: every "
    "dead letter a filter matches, both sides, in batches (--dry-run prints the exact count)."
)


@dataclass(frozen=True)
class RedriveConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    reason: str | None = option(
        settings.Setting(
            "reason", "OUTBOX_REDRIVE_REASON", None, "Why (recorded; required to redrive)", bound=bounds.REASON
        )
    )
    batch: int = option(dead_letters.batch_setting("REDRIVE"))
    pause: float = option(dead_letters.pause_setting("REDRIVE"))


CONFIG = RedriveConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("handler", nargs="?", metavar="HANDLER", help="the handler whose dead letters to redrive")
    parser.add_argument("message_ids", nargs="*", metavar="MESSAGE_ID", help="message ids to redrive")
    parser.add_argument("--all", action="store_true", help="every dead letter of the handler")
    parser.add_argument("--list", action="store_true", help="only list the handler's dead letters")
    parser.add_argument(
        "--match", action="store_true", help="every dead letter the filter options match, both sides (no HANDLER)"
    )
    parser.add_argument("--dry-run", action="store_true", help="--match: print the exact count only")
    dead_letters.add_filter_arguments(parser)


def _match(conn: psycopg.Connection[Any], cfg: RedriveConfig, args: argparse.Namespace) -> int:
    if args.handler or args.message_ids or args.all or args.list:
        raise ConfigError(
            "--match takes filter options (--owner for a handler, --id for ids), not HANDLER, ids, --all or --list"
        )
    found = dead_letters.filter_from(args)
    if found.get("discarded", False) is not False:
        raise ConfigError("a discarded dead letter is redriven only once restored (pgoutbox dead-letters restore)")
    done = dead_letters.run_batches(conn, "replay", "dlq_replay", found, cfg.reason, cfg.batch, cfg.pause, args.dry_run)
    if not args.dry_run:
        print(f"replayed {done} dead letter(s): outbox events requeued, inbox messages marked for the replayer")
    return 0


def run(cfg: RedriveConfig, args: argparse.Namespace) -> int:
    if not args.match and (dead_letters.filter_from(args) or args.dry_run):
        raise ConfigError("filter options and --dry-run go with --match")
    if not args.match and not args.handler:
        raise ConfigError("give HANDLER (with ids, --all or --list), or --match with filter options")
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        if args.match:
            return _match(conn, cfg, args)
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
