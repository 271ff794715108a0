"""`pgoutbox backfill`: a handler that joins late gets the history the
outbox still keeps, through its ordinary inbox path (docs/backfill.md).

    1. plan: the handler's subjects (or the event types asked for), the
       range, and where each part of it comes from, printed before anything
       is delivered (outbox.backfill_span);
    2. pages of events in id order (outbox.backfill_page): id order is emit
       order within an ordering key, and a key's events go one after the
       other, so each key's order holds;
    3. each event as the consumer takes a message: the envelope built from
       the message the relay publishes (wire.to_nats, then wire.from_nats),
       inbox.receive (PROCESSED or DEAD_LETTER: a duplicate, the handler is
       not called), the handler's POST with the consumer's body and headers,
       handler_contract.decide, then inbox.mark_processed or
       inbox.record_error (FAILED and retried with backoff here; on the
       max_deliver-th failure, DEAD_LETTER);
    4. a throttle (events/s) and a state file written as pages complete
       (the last id of the page): after a kill, the next run with the same
       arguments starts there, and the inbox skips whatever was recorded
       PROCESSED in between.

Within a page the events go in lanes, one per ordering key, the lanes at
once (--concurrency connections and calls), each lane's events one after
the other: a key's order holds, and the keys share the time. A handler called for an event whose outcome did not
       commit before the kill is called again, as after a consumer crash.

It never touches NATS: no durable of this or any other handler, no DLQ
notice (a dead letter is in the inbox, where `pgoutbox dead-letters` and
redrive find it). What it does not do yet: the stream and the Parquet
archive as sources (a range older than the outbox keeps is refused), and
handlers that declare a version (their upcasting runs in the consumer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from prometheus_client import CollectorRegistry, Gauge, write_to_textfile
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgoutbox.core import cloudevents, wire
from pgoutbox.core.backoff import Backoff
from pgoutbox.core.errors import ConfigError, wrap_exceptions
from pgoutbox.inbox.handler_client import HandlerClient, cloudevent_lines, payload_body, request_body
from pgoutbox.inbox.handler_contract import Action, decide
from pgoutbox.inbox.registry import HandlerSpec

log = logging.getLogger(__name__)

_SPAN = "SELECT * FROM outbox.backfill_span(%s, %s, %s)"
_PAGE = "SELECT * FROM outbox.backfill_page(%s, %s, %s, %s, %s)"
# The three inbox calls of the consumer's path that pgoutbox_backfiller holds,
# written here rather than imported from store: store names every call of the
# consumer, and a command's role must hold every function its modules name
# (tests/cli/test_role_matrix.py).
_RECEIVE = "SELECT status, attempts FROM inbox.receive(%s, %s, %s, %s)"
_PROCESSED = "SELECT status FROM inbox.mark_processed(%s, %s)"
_ERROR = "SELECT status FROM inbox.record_error(%s, %s, %s, %s, NULL)"
# Between a handler's failures: the consumer's default backoff shape.
RETRY = Backoff(base=1.0, max_delay=30.0)


class RangeNotKept(ConfigError):
    """The range starts before the oldest event the outbox keeps."""


@dataclass(frozen=True)
class Plan:
    handler: str
    subjects: tuple[str, ...]
    since: datetime
    until: datetime
    events: int
    kept_from: datetime | None
    asked: dict[str, Any]  # the arguments as given ("now", "all"): what a state file must match to resume

    def lines(self) -> list[str]:
        def at(t: datetime | None) -> str:
            return "-" if t is None else t.isoformat()

        return [
            f"backfill {self.handler}: {', '.join(self.subjects)}",
            f"  range    {at(self.since)} .. {at(self.until)} (until excluded)",
            f"  outbox   {self.events} event(s), in emit order per ordering key"
            f" (it keeps events since {at(self.kept_from)})",
            "  stream   not read: the outbox holds every event the stream still does",
            "  archive  not read: the range starts inside what the outbox keeps",
        ]


@dataclass
class Progress:
    done: int = 0  # events handled this run: delivered, skipped or dead-lettered
    delivered: int = 0
    skipped: int = 0  # already PROCESSED or DEAD_LETTER in the inbox
    dead: int = 0
    after_id: int = 0


def subjects_of(spec: HandlerSpec, event_types: tuple[str, ...]) -> tuple[str, ...]:
    if not event_types:
        return spec.subjects
    chosen = tuple(s for s in spec.subjects if wire.parse_subject(s)[1] in event_types)
    unknown = sorted(set(event_types) - {wire.parse_subject(s)[1] for s in spec.subjects})
    if unknown:
        raise ConfigError(
            f"handler {spec.name} takes no event type {', '.join(unknown)} (its subjects: {spec.subjects})"
        )
    return chosen


async def plan(
    conn: psycopg.AsyncConnection[Any],
    spec: HandlerSpec,
    subjects: tuple[str, ...],
    since: datetime | None,
    until: datetime,
    asked: dict[str, Any],
) -> Plan:
    """since None: everything the outbox keeps."""
    start = since or datetime(1900, 1, 1, tzinfo=until.tzinfo)
    async with conn.cursor(row_factory=dict_row) as cur:
        with wrap_exceptions():
            await cur.execute(_SPAN, (list(subjects), start, until))
            row = await cur.fetchone()
    assert row is not None
    kept_from = row["kept_from"]
    if since is not None and kept_from is not None and since < kept_from:
        raise RangeNotKept(
            f"the range starts at {since.isoformat()}, before the oldest event the outbox keeps "
            f"({kept_from.isoformat()}); the archive is not a backfill source yet: start at or after it"
        )
    return Plan(spec.name, subjects, since or kept_from or until, until, int(row["events"]), kept_from, asked)


@dataclass(frozen=True)
class Resume:
    since: datetime
    until: datetime
    after_id: int


def read_state(path: Path | None, asked: dict[str, Any]) -> Resume | None:
    """Where a run with the same arguments stopped: its range as it was
    resolved then ("now" is the first run's now) and the last id it finished.
    None: no state file, or one of other arguments."""
    if path is None or not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
        if state.get("asked") != asked:
            return None
        since, until = datetime.fromisoformat(state["since"]), datetime.fromisoformat(state["until"])
        return Resume(since, until, int(state["after_id"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_metrics(path: Path | None, p: Plan, progress: Progress) -> None:
    """The progress as Prometheus metrics in a file (node_exporter's textfile
    collector reads such a folder; written whole, then renamed)."""
    if path is None:
        return
    registry = CollectorRegistry()
    planned = Gauge("pgoutbox_backfill_planned_events", "Events the plan found", ["handler"], registry=registry)
    planned.labels(p.handler).set(p.events)
    handled = Gauge(
        "pgoutbox_backfill_events", "Events handled by this run, by outcome", ["handler", "outcome"], registry=registry
    )
    for outcome, value in (("delivered", progress.delivered), ("skipped", progress.skipped), ("dead", progress.dead)):
        handled.labels(p.handler, outcome).set(value)
    last = Gauge("pgoutbox_backfill_after_id", "The last event id of the pages done", ["handler"], registry=registry)
    last.labels(p.handler).set(progress.after_id)
    write_to_textfile(str(path), registry)


def write_state(path: Path | None, p: Plan, progress: Progress) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    state = {"asked": p.asked, "since": p.since.isoformat(), "until": p.until.isoformat(), **asdict(progress)}
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)  # atomic: a kill leaves the old file or the new one


class Throttle:
    """At most `rate` events a second, evenly spaced."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        self.interval = 1.0 / rate
        self.clock = clock
        self.next_at = clock()

    async def wait(self) -> None:
        now = self.clock()
        slot = max(self.next_at, now)  # taken before sleeping: lanes waiting at once get successive slots
        self.next_at = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)


class Bar:
    """A progress bar on a terminal, else a line every `every` seconds."""

    def __init__(self, total: int, out: Any = sys.stderr, every: float = 10.0):
        self.total, self.out, self.every = total, out, every
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.last = 0.0
        self.started = time.monotonic()

    def show(self, progress: Progress, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < (0.2 if self.tty else self.every):
            return
        self.last = now
        rate = progress.done / max(now - self.started, 1e-9)
        share = progress.done / self.total if self.total else 1.0
        text = (
            f"{progress.done}/{self.total} events ({share:.0%}), {progress.delivered} delivered, "
            f"{progress.skipped} already in the inbox, {progress.dead} dead-lettered, {rate:.0f}/s"
        )
        if self.tty:
            width = 30
            filled = int(width * min(share, 1.0))
            self.out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}" + ("\n" if final else ""))
        else:
            self.out.write(f"backfill: {text}\n")
        self.out.flush()


async def _call(conn: psycopg.AsyncConnection[Any], query: LiteralString, params: tuple[Any, ...]) -> dict[str, Any]:
    async with conn.cursor(row_factory=dict_row) as cur:
        with wrap_exceptions():
            await cur.execute(query, params)
            row = await cur.fetchone()
    assert row is not None  # each inbox function returns its row
    return row


@dataclass(frozen=True)
class Delivery:
    handler: HandlerSpec
    timeout: float
    max_deliver: int
    cloudevents_source: str


async def deliver(conn: psycopg.AsyncConnection[Any], client: HandlerClient, d: Delivery, row: dict[str, Any]) -> str:
    """One event through the handler's inbox path: "delivered", "skipped" or "dead"."""
    subject, body, headers = wire.to_nats(row, d.cloudevents_source)
    envelope = wire.from_nats(subject, body, headers)
    payload = wire.payload_bytes(body, headers)
    message_id, name = envelope["message_id"], d.handler.name
    got = await _call(conn, _RECEIVE, (message_id, name, subject, Jsonb(envelope)))
    if got["status"] in ("PROCESSED", "DEAD_LETTER"):
        return "skipped"
    attributes = None
    sent = request_body(envelope, payload)
    if d.handler.format == "cloudevents":
        stored = envelope.get("cloudevents")
        attributes = (
            cloudevents.expand(stored, envelope) if stored else cloudevents.derived(envelope, d.cloudevents_source)
        )
        sent = payload_body(envelope, payload)
        cloudevent_lines(attributes, envelope, name, 1)  # refuses what the consumer could not send either
    failures = 0
    while True:
        delivery = int(got.get("attempts") or 1) + failures
        answer = await client.call(
            d.handler.url, sent, envelope, handler=name, delivery=delivery, timeout=d.timeout, cloudevent=attributes
        )
        action = decide(answer)
        if action is Action.PROCESSED:
            await _call(conn, _PROCESSED, (message_id, name))
            return "delivered"
        failures += 1
        dead = action is Action.DEAD_LETTER or failures >= d.max_deliver
        await _call(conn, _ERROR, (message_id, name, f"backfill: {answer.summary}", dead))
        if dead:
            return "dead"
        await asyncio.sleep(answer.retry_after if answer.retry_after is not None else RETRY.delay(failures))


async def _page(
    conns: asyncio.Queue[psycopg.AsyncConnection[Any]],
    client: HandlerClient,
    d: Delivery,
    rows: list[dict[str, Any]],
    throttle: Throttle,
    progress: Progress,
    bar: Bar,
) -> None:
    """One page: a lane per ordering key (an event without a key is a lane
    of its own), the lanes at once on the free connections, each lane's
    events one after the other in id order."""
    lanes: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        key = row["ordering_key"] if row["ordering_key"] is not None else ("no key", row["id"])
        lanes.setdefault(key, []).append(row)

    async def lane(events: list[dict[str, Any]]) -> None:
        conn = await conns.get()
        try:
            for row in events:
                await throttle.wait()
                outcome = await deliver(conn, client, d, row)
                progress.done += 1
                progress.delivered += outcome == "delivered"
                progress.skipped += outcome == "skipped"
                progress.dead += outcome == "dead"
                bar.show(progress)
        finally:
            conns.put_nowait(conn)

    try:
        async with asyncio.TaskGroup() as tg:
            for events in lanes.values():
                tg.create_task(lane(events))
    except BaseExceptionGroup as failed:  # the first failure, as one sequential run would raise it
        raise failed.exceptions[0] from None


async def run(
    conns: list[psycopg.AsyncConnection[Any]],
    p: Plan,
    d: Delivery,
    *,
    rate: float,
    page_size: int,
    state_file: Path | None,
    after_id: int = 0,
    metrics_file: Path | None = None,
    out: Any = sys.stderr,
) -> Progress:
    """Delivers the plan's events page after page, each page's lanes on as
    many connections as given (one lane per connection at a time); the
    state file is written when a page is done, so it never names an id
    whose predecessors are not all done."""
    progress = Progress(after_id=after_id)
    if after_id:
        out.write(f"backfill: resuming after event id {after_id} (state file {state_file})\n")
    free: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()
    for conn in conns:
        free.put_nowait(conn)
    throttle = Throttle(rate)
    bar = Bar(p.events, out)
    client = HandlerClient(per_origin=len(conns))
    try:
        while True:
            async with conns[0].cursor(row_factory=dict_row) as cur:
                with wrap_exceptions():
                    await cur.execute(_PAGE, (list(p.subjects), p.since, p.until, progress.after_id, page_size))
                    page = await cur.fetchall()
            if not page:
                break
            await _page(free, client, d, page, throttle, progress, bar)
            progress.after_id = int(page[-1]["id"])
            write_state(state_file, p, progress)
            write_metrics(metrics_file, p, progress)
    finally:
        await client.aclose()
    write_metrics(metrics_file, p, progress)
    bar.show(progress, final=True)
    return progress
