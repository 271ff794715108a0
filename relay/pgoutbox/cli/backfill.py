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

from pgoutbox.core import broker, db, settings
from pgoutbox.core.errors import BrokerUnavailable, ConfigError
from pgoutbox.core.settings import option
from pgoutbox.inbox import backfill, registry
from pgoutbox.inbox import settings as cs

COMMAND = "backfill"
HELP = (
    "Replay the history of a handler's subjects (the archive, the outbox, the stream) into that handler, "
    "through its inbox (resumable)."
)
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


def stream_mode(text: str) -> str:
    if text not in ("auto", "off"):
        raise ValueError(f"must be auto or off, got {text!r}")
    return text


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
    nats_url: str = option(settings.NATS_URL)
    stream: str = option(
        S(
            "stream",
            "OUTBOX_BACKFILL_STREAM",
            "auto",
            "auto: read the part of the range the handler's stream still holds from the stream "
            "(when NATS answers); off: never connect to NATS",
            stream_mode,
        )
    )
    spark_master: str = option(settings.SPARK_MASTER)


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


async def _stream(
    cfg: BackfillConfig,
    spec: registry.HandlerSpec,
    since: datetime | None,
    until: datetime,
    resume: backfill.Resume | None,
) -> tuple[Any, Any, backfill.StreamSide | None, str]:
    """(connection, JetStream, the stream side, the plan's line): the stream
    is a source when NATS answers and the handler's stream holds part of the
    range; otherwise the plan says why not and the outbox takes that part."""
    if cfg.stream == "off":
        return None, None, None, "not read: OUTBOX_BACKFILL_STREAM=off"
    if resume is not None and resume.stream_start is None:
        return None, None, None, "not read: the run being resumed did not read it"
    try:
        nc = await broker.connect(cfg.nats_url, "pgoutbox-backfill", retry=False, quiet=True)
    except BrokerUnavailable as exc:
        if resume is not None and resume.stream_start is not None:
            raise  # the run being resumed reads its last part from the stream: it needs it
        return None, None, None, f"not read: {exc}"
    js = nc.jetstream()
    side, note = await backfill.find_stream(
        js, spec, since, until, start=resume.stream_start if resume is not None else None
    )
    if side is None:
        await nc.close()
        return None, None, None, note
    return nc, js, side, note


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
    nc = None
    try:
        for _ in range(cfg.concurrency):
            conns.append(await psycopg.AsyncConnection.connect(db.conninfo(cfg.database_url), autocommit=True))
        nc, js, side, note = await _stream(cfg, spec, since, until, resume)
        p = await backfill.plan(conns[0], spec, subjects, since, until, asked, side, note)
        print("\n".join(p.lines()), flush=True)
        kwargs: dict[str, Any] = dict(
            rate=cfg.rate,
            page_size=cfg.page_size,
            state_file=state,
            resume=resume.progress if resume is not None else None,
            metrics_file=Path(cfg.metrics_file) if cfg.metrics_file else None,
            js=js,
        )
        if p.archive and not (resume is not None and resume.progress.phase != "archive"):
            done = await _with_spark(cfg, conns, p, delivery, kwargs)
        else:
            done = await backfill.run(conns, p, delivery, **kwargs)
    except psycopg.OperationalError as exc:
        if not conns or db.is_connection_error(exc):
            raise db.unavailable(exc, cfg.database_url) from exc
        raise
    finally:
        for conn in conns:
            await conn.close()
        if nc is not None:
            await nc.close()
    refused = f", {len(done.refused)} archived day(s) refused ({', '.join(done.refused)})" if done.refused else ""
    print(
        f"backfilled {spec.name}: {done.delivered} delivered, {done.skipped} already in the inbox, "
        f"{done.dead} dead-lettered{refused}",
        flush=True,
    )
    sys.stdout.flush()
    return 1 if done.dead or done.refused else 0


async def _with_spark(
    cfg: BackfillConfig,
    conns: list[psycopg.AsyncConnection[Any]],
    p: backfill.Plan,
    delivery: backfill.Delivery,
    kwargs: dict[str, Any],
) -> backfill.Progress:
    """The archived days are read on the archival job's Spark session (the
    spark extra), started only when the plan has any."""
    try:
        from pgoutbox_spark import session
        from pgoutbox_spark.backfill import SparkReader
    except ImportError as exc:
        raise ConfigError(
            f"the plan reads archived days, which needs the spark extra (pip install 'pgoutbox[spark]'): {exc}"
        ) from exc
    with session.spark_session(cfg.spark_master, None, "pgoutbox-backfill") as spark:
        return await backfill.run(conns, p, delivery, reader=SparkReader(spark), **kwargs)
