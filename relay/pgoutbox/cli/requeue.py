"""pgoutbox requeue: move dead-lettered events back to PENDING, with a reason.

--broker-outage takes, instead of ids, every outbox dead letter an older
release gave up on because the broker did not answer (docs/relay.md,
"JetStream away"): last_error of class NATS_UNAVAILABLE, PUBLISH_TIMEOUT or
NATS_TIMEOUT, or a JETSTREAM_ERROR that JetStream's own code says was the
broker's (publisher.JETSTREAM_AWAY_CODES) or "stream ... did not respond". It
finds them with outbox.dlq_list, keeps those whose error is one of these
exactly (the filter's error text matches anywhere), and requeues them by id
through outbox.dlq_replay: audited in outbox.requeue_log like every requeue.
"""

from __future__ import annotations

import argparse
import re
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from pgoutbox.cli import dead_letters
from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import ConfigError, wrap_exceptions
from pgoutbox.core.settings import option
from pgoutbox.outbox.publisher import JETSTREAM_AWAY_CODES

COMMAND = "requeue"
HELP = (
    "Requeue DEAD_LETTER events (all or nothing); the reason is recorded in outbox.requeue_log. "
    "--broker-outage: every event dead-lettered because the broker did not answer."
)

# The error classes (the code before the colon) of a broker that did not
# answer. NATS_TIMEOUT is no code of this release; it is named in reports of
# older ones and taken too.
OUTAGE_CLASSES = ("NATS_UNAVAILABLE", "PUBLISH_TIMEOUT", "NATS_TIMEOUT")
_AWAY_DETAIL = re.compile(r"^JETSTREAM_ERROR: (\[(\d+)\] |stream \S+ did not respond for )")
PAGE = 1000  # rows a dlq_list call reads
IDS_PER_CALL = 10_000  # what a filter's ids may hold (outbox._check_dlq_filter)


@dataclass(frozen=True)
class RequeueConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    reason: str = option(
        settings.Setting("reason", "OUTBOX_REQUEUE_REASON", None, "Why (recorded)", required=True, bound=bounds.REASON)
    )


CONFIG = RequeueConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_ids", nargs="*", metavar="EVENT_ID", help="event ids to requeue")
    parser.add_argument(
        "--broker-outage",
        action="store_true",
        help="instead of ids: every dead letter whose error says the broker did not answer "
        f"({', '.join(OUTAGE_CLASSES)}, JetStream unavailable / no leader)",
    )
    parser.add_argument("--dry-run", action="store_true", help="--broker-outage: print the count only")


def broker_outage(last_error: str | None) -> bool:
    """True when an outbox dead letter's error says the broker did not answer."""
    if not last_error:
        return False
    if last_error.split(":", 1)[0] in OUTAGE_CLASSES:
        return True
    found = _AWAY_DETAIL.match(last_error)
    return found is not None and (found.group(2) is None or int(found.group(2)) in JETSTREAM_AWAY_CODES)


def outage_dead_letters(conn: psycopg.Connection[Any]) -> list[str]:
    """The ids of the outbox dead letters (not discarded) a broker outage made."""
    ids: dict[str, None] = {}  # in the order found, each once
    for text in (*OUTAGE_CLASSES, "JETSTREAM_ERROR"):
        after = None
        while True:
            rows = conn.execute(
                "SELECT id::text, last_error, cursor FROM outbox.dlq_list(%s, %s, %s)",
                (Jsonb({"side": "outbox", "error": f"{text}: "}), PAGE, after),
            ).fetchall()
            ids.update((event_id, None) for event_id, error, _ in rows if broker_outage(error))
            if len(rows) < PAGE:
                break
            after = rows[-1][2]
    return list(ids)


def _broker_outage(cfg: RequeueConfig, args: argparse.Namespace) -> int:
    if args.event_ids:
        raise ConfigError("--broker-outage finds the events itself: give no EVENT_ID")
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        ids = outage_dead_letters(conn)
        if args.dry_run or not ids:
            nothing = "; nothing done (--dry-run)" if ids else ""
            print(f"{len(ids)} event(s) dead-lettered because the broker did not answer{nothing}")
            return 0
        done = 0
        for start in range(0, len(ids), IDS_PER_CALL):
            found = {"side": "outbox", "ids": ids[start : start + IDS_PER_CALL]}
            done += dead_letters.run_batches(conn, "replay", "dlq_replay", found, cfg.reason, 100, 0.1, False)
    print(f"requeued {done} event(s) dead-lettered because the broker did not answer")
    return 0


def run(cfg: RequeueConfig, args: argparse.Namespace) -> int:
    if args.broker_outage:
        return _broker_outage(cfg, args)
    if args.dry_run:
        raise ConfigError("--dry-run goes with --broker-outage")
    if not args.event_ids:
        raise ConfigError("give EVENT_IDs, or --broker-outage")
    try:
        ids = [uuid.UUID(x) for x in args.event_ids]
    except ValueError as exc:
        raise ConfigError(f"not an event id: {exc}") from exc
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        [(moved,)] = conn.execute("SELECT outbox.requeue(%s, %s)", (ids, cfg.reason)).fetchall()
    print(f"requeued {moved} event(s)")
    return 0
