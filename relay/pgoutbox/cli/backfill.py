"""pgoutbox backfill: replay the history the outbox keeps into one handler
of the registry, through its inbox (docs/backfill.md). It prints its plan
first, then delivers, throttled, with progress on stderr; run it again with
the same arguments after a kill and it resumes where it stopped."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from pgoutbox.core import db, settings
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.settings import option
from pgoutbox.inbox import backfill, registry
from pgoutbox.inbox import settings as cs

COMMAND = "backfill"
HELP = "Replay the outbox's history of a handler's subjects into that handler, through its inbox (resumable)."
S = settings.Setting


def moment(text: str) -> str:
    """'all', 'now' or an RFC 3339 time with its offset (checked here, read by run())."""
    if text not in ("all", "now"):
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            raise ValueError(f"{text!r} has no UTC offset (write 2026-11-01T00:00:00Z)")
    return text


def names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def page(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 10000:
        raise ValueError(f"must be from 1 to 10000 (outbox.backfill_page(page_size)), got {value}")
    return value


def rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be more than 0 events/s, got {text}")
    return value


@dataclass(frozen=True)
class BackfillConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    registry_file: str = option(cs.REGISTRY_FILE)
    handler: str = option(
        S("handler", "OUTBOX_BACKFILL_HANDLER", None, "The handler of the registry to backfill", required=True)
    )
    since: str = option(
        S(
            "since",
            "OUTBOX_BACKFILL_SINCE",
            "all",
            "Start of the range: RFC 3339 with offset, or all (what the outbox keeps)",
            moment,
        )
    )
    until: str = option(
        S(
            "until",
            "OUTBOX_BACKFILL_UNTIL",
            "now",
            "End of the range, excluded: RFC 3339 with offset, or now (the start)",
            moment,
        )
    )
    event_types: tuple[str, ...] = option(
        S(
            "event_types",
            "OUTBOX_BACKFILL_EVENT_TYPES",
            "",
            "Comma-separated event types (default: all the handler's subjects)",
            names,
        )
    )
    rate: float = option(
        S("rate", "OUTBOX_BACKFILL_RATE", "200", "Throttle: events delivered per second at most", rate)
    )
    page_size: int = option(S("page_size", "OUTBOX_BACKFILL_PAGE_SIZE", "500", "Events read per page", page))
    concurrency: int = option(
        S(
            "concurrency",
            "OUTBOX_BACKFILL_CONCURRENCY",
            "8",
            "Ordering keys delivered at once (connections and calls); one key's events go one after the other",
            settings.positive_int,
        )
    )
    state_file: str = option(
        S(
            "state_file",
            "OUTBOX_BACKFILL_STATE_FILE",
            "pgoutbox-backfill-{handler}.json",
            "Where the progress is kept to resume after a kill ({handler}: the handler's name; empty: none)",
        )
    )
    metrics_file: str = option(
        S(
            "metrics_file",
            "OUTBOX_BACKFILL_METRICS_FILE",
            "",
            "Prometheus text file of the progress, renewed per page (node_exporter's textfile collector; empty: none)",
        )
    )
    handler_timeout: float = option(
        S("handler_timeout", "OUTBOX_HANDLER_TIMEOUT", "10s", "HTTP handler timeout", settings.duration)
    )
    max_deliver: int = option(
        S(
            "max_deliver",
            "OUTBOX_CONSUMER_MAX_DELIVER",
            "5",
            "Handler failures before a message is dead-lettered (the inbox counts them; no JetStream limit)",
            settings.positive_int,
        )
    )
    cloudevents_source: str = option(settings.CLOUDEVENTS_SOURCE)


CONFIG = BackfillConfig
SETTINGS = settings.of(CONFIG)


def _at(text: str, now: datetime) -> datetime | None:
    if text == "all":
        return None
    return now if text == "now" else datetime.fromisoformat(text.replace("Z", "+00:00"))


def run(cfg: BackfillConfig, args: argparse.Namespace) -> int:
    handlers = {h.name: h for h in registry.load(Path(cfg.registry_file))}
    spec = handlers.get(cfg.handler)
    if spec is None:
        raise ConfigError(f"no handler {cfg.handler!r} in {cfg.registry_file} (it has: {', '.join(sorted(handlers))})")
    if spec.version is not None:
        raise ConfigError(f"handler {spec.name} declares a version: backfill does not upcast yet")
    now = datetime.now(UTC)
    since, until = _at(cfg.since, now), _at(cfg.until, now)
    if until is None:
        raise ConfigError("--until all means nothing: give a time or now")
    if since is not None and not since < until:
        raise ConfigError(f"--since {cfg.since} is not before --until {cfg.until}")
    subjects = backfill.subjects_of(spec, cfg.event_types)
    state = Path(cfg.state_file.replace("{handler}", spec.name)) if cfg.state_file else None
    asked = {"handler": spec.name, "subjects": list(subjects), "since": cfg.since, "until": cfg.until}
    resume = backfill.read_state(state, asked)
    if resume is not None:  # the range the interrupted run resolved ("now" then)
        since, until = (None if cfg.since == "all" else resume.since), resume.until
    with db.connect(cfg.database_url, check_schema=True):
        pass  # the schema check, once, as every command does
    delivery = backfill.Delivery(
        spec, spec.timeout or cfg.handler_timeout, spec.max_deliver or cfg.max_deliver, cfg.cloudevents_source
    )
    return asyncio.run(_run(cfg, spec, subjects, since, until, asked, delivery, state, resume))


async def _run(
    cfg: BackfillConfig,
    spec: registry.HandlerSpec,
    subjects: tuple[str, ...],
    since: datetime | None,
    until: datetime,
    asked: dict[str, Any],
    delivery: backfill.Delivery,
    state: Path | None,
    resume: backfill.Resume | None,
) -> int:
    conns: list[psycopg.AsyncConnection[Any]] = []
    try:
        for _ in range(cfg.concurrency):
            conns.append(await psycopg.AsyncConnection.connect(db.conninfo(cfg.database_url), autocommit=True))
        p = await backfill.plan(conns[0], spec, subjects, since, until, asked)
        print("\n".join(p.lines()), flush=True)
        after_id = resume.after_id if resume is not None else 0
        done = await backfill.run(
            conns,
            p,
            delivery,
            rate=cfg.rate,
            page_size=cfg.page_size,
            state_file=state,
            after_id=after_id,
            metrics_file=Path(cfg.metrics_file) if cfg.metrics_file else None,
        )
    except psycopg.OperationalError as exc:
        if not conns or db.is_connection_error(exc):
            raise db.unavailable(exc, cfg.database_url) from exc
        raise
    finally:
        for conn in conns:
            await conn.close()
    print(
        f"backfilled {spec.name}: {done.delivered} delivered, {done.skipped} already in the inbox, "
        f"{done.dead} dead-lettered",
        flush=True,
    )
    sys.stdout.flush()
    return 1 if done.dead else 0
