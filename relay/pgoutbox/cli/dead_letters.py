"""pgoutbox dead-letters: the dead letters of both sides (outbox events by
context, inbox messages by handler), grouped by cause, listed, shown one by
one, discarded and restored. Every rule is in SQL (sql/67_dead_letters.sql):
this module builds the filter, calls outbox.dlq_*, and prints.

Reads need pgoutbox_viewer (or pgoutbox_admin); discard and restore need
pgoutbox_admin. A batch action calls the SQL function again and again, one
transaction and at most --batch rows a call, until it touches nothing, with
a progress line per call and a pause between calls (the throttle); the SQL
touches only rows not already done, so an interrupted run is resumed by
running it again."""

from __future__ import annotations

import argparse
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import ConfigError, wrap_exceptions
from pgoutbox.core.settings import option

log = logging.getLogger(__name__)

COMMAND = "dead-letters"
HELP = (
    "Dead letters of both sides: groups (by cause), list, show ID; discard or restore what a filter "
    "matches, with a reason, in batches (--dry-run prints the exact count)."
)
VERBS = ("groups", "list", "show", "discard", "restore")
FORMATS = ("table", "json")
PAST = {"discard": "discarded", "restore": "restored", "replay": "replayed"}


def output_format(text: str) -> str:
    if text not in FORMATS:
        raise ValueError(f"must be one of {', '.join(FORMATS)}")
    return text


# The batch knobs, shared with `pgoutbox redrive --match` (each command its own variables).
def batch_setting(prefix: str) -> settings.Setting:
    return settings.Setting(
        "batch",
        f"OUTBOX_{prefix}_BATCH",
        "100",
        "Rows a batch action touches per call (one transaction each)",
        settings.integer,
        bound=bounds.MAX_ROWS,
    )


def pause_setting(prefix: str) -> settings.Setting:
    return settings.Setting(
        "pause",
        f"OUTBOX_{prefix}_PAUSE",
        "100ms",
        "Pause between the calls of a batch action (the throttle; 0 for none)",
        settings.duration,
    )


@dataclass(frozen=True)
class DeadLettersConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    format: str = option(
        settings.Setting(
            "format", "OUTBOX_DEAD_LETTERS_FORMAT", "table", "Output: table or json (one object a line)", output_format
        )
    )
    max_rows: int = option(
        settings.Setting(
            "max_rows",
            "OUTBOX_DEAD_LETTERS_MAX_ROWS",
            "100",
            "Rows groups and list print (list: --after the last cursor for the next page)",
            settings.integer,
            bound=bounds.MAX_ROWS,
        )
    )
    reason: str | None = option(
        settings.Setting(
            "reason",
            "OUTBOX_DEAD_LETTERS_REASON",
            None,
            "Why (recorded; required to discard or restore)",
            bound=bounds.REASON,
        )
    )
    batch: int = option(batch_setting("DEAD_LETTERS"))
    pause: float = option(pause_setting("DEAD_LETTERS"))


CONFIG = DeadLettersConfig
SETTINGS = settings.of(CONFIG)


def add_filter_arguments(parser: argparse.ArgumentParser) -> None:
    """The filter of outbox.dlq_* as options (per run, so no environment twin:
    a variable left set must never widen a bulk action)."""
    group = parser.add_argument_group("filter (every option narrows; none: every dead letter)")
    group.add_argument("--side", choices=("outbox", "inbox"), help="one side only")
    group.add_argument("--owner", help="a context (outbox) or handler (inbox)")
    group.add_argument("--subject", help="an exact subject")
    group.add_argument("--error", help="text the error contains (any letter case, taken literally)")
    group.add_argument("--tenant", help="a tenant id")
    group.add_argument("--since", help="dead-lettered at or after (ISO 8601 with an offset)")
    group.add_argument("--until", help="dead-lettered before (ISO 8601 with an offset)")
    group.add_argument("--group", help="a group id (from `pgoutbox dead-letters groups`)")
    group.add_argument("--id", dest="ids", action="append", metavar="ID", help="an event or message id (repeatable)")
    state = group.add_mutually_exclusive_group()
    state.add_argument("--discarded", action="store_true", help="groups, list: the discarded ones only")
    state.add_argument("--with-discarded", action="store_true", help="groups, list: live and discarded")


def filter_from(args: argparse.Namespace) -> dict[str, Any]:
    """The jsonb filter the options describe; the database checks it (OB100)."""
    found: dict[str, Any] = {}
    for key in ("side", "owner", "subject", "error", "tenant", "group"):
        if getattr(args, key, None) is not None:
            found[key] = getattr(args, key)
    for key in ("since", "until"):
        value = getattr(args, key, None)
        if value is not None:
            try:
                found[key] = datetime.fromisoformat(value).isoformat()
            except ValueError as exc:
                raise ConfigError(f"--{key} {value!r} is not an ISO 8601 time") from exc
    if getattr(args, "ids", None):
        try:
            found["ids"] = [str(uuid.UUID(x)) for x in args.ids]
        except ValueError as exc:
            raise ConfigError(f"not an event or message id: {exc}") from exc
    if getattr(args, "discarded", False):
        found["discarded"] = True
    elif getattr(args, "with_discarded", False):
        found["discarded"] = None
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("verb", choices=VERBS, help="what to do")
    parser.add_argument("id", nargs="?", metavar="ID", help="show: the event or message id")
    parser.add_argument("--after", metavar="CURSOR", help="list: the page after this cursor")
    parser.add_argument("--dry-run", action="store_true", help="discard, restore: print the exact count only")
    add_filter_arguments(parser)


def _rows(conn: psycopg.Connection[Any], query: str, params: Sequence[Any]) -> list[dict[str, Any]]:
    return conn.cursor(row_factory=dict_row).execute(query, params).fetchall()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def print_rows(rows: list[dict[str, Any]], columns: Sequence[str], fmt: str) -> None:
    if fmt == "json":
        for row in rows:
            print(json.dumps(row, default=str))
        return
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


GROUP_COLUMNS = (
    "group_id",
    "side",
    "owner",
    "subject",
    "error_class",
    "dead_letters",
    "discarded",
    "refailed",
    "replayable",
    "last_seen",
    "error_pattern",
)
LIST_COLUMNS = ("side", "owner", "id", "attempts", "seen_at", "discarded", "refailed", "last_error")


def run_batches(
    conn: psycopg.Connection[Any],
    action: str,
    function: str,
    found: dict[str, Any],
    reason: str | None,
    batch: int,
    pause: float,
    dry_run: bool,
    say: Callable[[str], None] = print,
) -> int:
    """outbox.dlq_<action>'s count, then (unless dry_run) its calls until one
    touches nothing; a progress line each. Returns the rows touched."""
    [(total,)] = conn.execute("SELECT outbox.dlq_count(%s, %s)", (Jsonb(found), action)).fetchall()
    if dry_run:
        say(f"{action}: {total} dead letter(s) match; nothing done (--dry-run)")
        return 0
    if not reason:
        raise ConfigError(f"a {action} needs --reason")
    done = 0
    while True:
        [(touched,)] = conn.execute(
            f"SELECT outbox.{function}(%s, %s, %s)",  # function: one of three names, never input
            (Jsonb(found), reason, batch),
        ).fetchall()
        if touched == 0:
            break
        done += touched
        say(f"{action}: {done} of {total}")
        if pause > 0:
            time.sleep(pause)
    return done


def _show(conn: psycopg.Connection[Any], cfg: DeadLettersConfig, args: argparse.Namespace) -> int:
    if not args.id:
        raise ConfigError("show needs the event or message ID")
    found = filter_from(args)
    found.setdefault("discarded", None)
    try:
        found["ids"] = [str(uuid.UUID(args.id))]
    except ValueError as exc:
        raise ConfigError(f"not an event or message id: {args.id!r}") from exc
    matches = _rows(conn, "SELECT side, handler FROM outbox.dlq_list(%s, 2)", (Jsonb(found),))
    if not matches:
        raise ConfigError(f"no dead letter {args.id}")
    if len(matches) > 1:
        raise ConfigError(f"{args.id} is a dead letter of several handlers: name one with --owner")
    [(doc,)] = conn.execute(
        "SELECT outbox.dlq_show(%s, %s, %s)", (matches[0]["side"], args.id, matches[0]["handler"])
    ).fetchall()
    print(json.dumps(doc, indent=None if cfg.format == "json" else 2, default=str))
    return 0


def run(cfg: DeadLettersConfig, args: argparse.Namespace) -> int:
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        if args.verb == "show":
            return _show(conn, cfg, args)
        if args.id:
            raise ConfigError(f"{args.verb} takes no ID (filter with --id)")
        found = filter_from(args)
        if args.verb == "groups":
            rows = _rows(conn, "SELECT * FROM outbox.dlq_groups(%s, %s)", (Jsonb(found), cfg.max_rows))
            print_rows(rows, GROUP_COLUMNS, cfg.format)
        elif args.verb == "list":
            rows = _rows(conn, "SELECT * FROM outbox.dlq_list(%s, %s, %s)", (Jsonb(found), cfg.max_rows, args.after))
            print_rows(rows, LIST_COLUMNS, cfg.format)
            if rows and len(rows) == cfg.max_rows and cfg.format == "table":
                print(f"more: --after '{rows[-1]['cursor']}'")
        else:
            done = run_batches(
                conn, args.verb, f"dlq_{args.verb}", found, cfg.reason, cfg.batch, cfg.pause, args.dry_run
            )
            if not args.dry_run:
                print(f"{PAST[args.verb]} {done} dead letter(s)")
    return 0
