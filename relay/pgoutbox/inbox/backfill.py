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

Three sources, each for its part of the range, oldest first (plan):
    archive  days of outbox.events archived and dropped: each day's Parquet
             folder is read back through the archival job's Spark machinery
             (pgoutbox_spark.backfill), its row count and checksum computed
             over the whole day and checked against the audit
             (outbox.backfill_verify_archived_day) before any row is used;
             a day that differs is refused (OB111) and the next days go on;
    outbox   the partitions it keeps (outbox.backfill_page);
    stream   the handler's stream, from the first event it still holds
             (created_at of its first message) to the end of the range,
             through an ephemeral pull consumer of its own (no durable of
             this or any other handler is created, read or moved).
The boundaries are the plan's: an event belongs to one source only, and
the inbox dedups whatever a boundary lets through twice.

No DLQ notice is published (a dead letter is in the inbox, where
`pgoutbox dead-letters` and redrive find it). Not done: handlers that
declare a version (their upcasting runs in the consumer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, LiteralString, Protocol

import psycopg
from prometheus_client import CollectorRegistry, Gauge, write_to_textfile
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgoutbox.core import cloudevents, wire
from pgoutbox.core.backoff import Backoff
from pgoutbox.core.errors import ConfigError, PgOutboxError, SqlState, wrap_exceptions
from pgoutbox.inbox.handler_client import HandlerClient, cloudevent_lines, payload_body, request_body
from pgoutbox.inbox.handler_contract import Action, decide
from pgoutbox.inbox.registry import HandlerSpec

log = logging.getLogger(__name__)

_SPAN = "SELECT * FROM outbox.backfill_span(%s, %s, %s)"
_PAGE = "SELECT * FROM outbox.backfill_page(%s, %s, %s, %s, %s)"
_ARCHIVED = "SELECT day, archive_uri, row_count, checksum FROM outbox.backfill_archived_days(%s, %s)"
_VERIFY = "SELECT outbox.backfill_verify_archived_day(%s, %s, %s) AS uri"
_COLUMNS = "SELECT column_name, kind FROM outbox.checksum_columns('outbox.events') ORDER BY ordinal"
# The three inbox calls of the consumer's path that pgoutbox_backfiller holds,
# written here rather than imported from store: store names every call of the
# consumer, and a command's role must hold every function its modules name
# (tests/cli/test_role_matrix.py).
_RECEIVE = "SELECT status, attempts FROM inbox.receive(%s, %s, %s, %s)"
_PROCESSED = "SELECT status FROM inbox.mark_processed(%s, %s)"
_ERROR = "SELECT status FROM inbox.record_error(%s, %s, %s, %s, NULL)"
# Between a handler's failures: the consumer's default backoff shape.
RETRY = Backoff(base=1.0, max_delay=30.0)
EARLIEST = datetime(1900, 1, 1, tzinfo=UTC)
# An archived day that is refused, and the days after it still go.
REFUSED_DAY = (SqlState.ARCHIVE_TAMPERED, SqlState.ARCHIVE_NOT_AUDITED)
PHASES = ("archive", "outbox", "stream")


class RangeNotKept(ConfigError):
    """The range starts before the oldest event the outbox and the archive keep."""


@dataclass(frozen=True)
class ArchivedDay:
    day: date
    uri: str
    row_count: int
    checksum: Decimal


@dataclass(frozen=True)
class StreamSide:
    """The handler's stream as a source: from `start` (the created_at of the
    first event it holds, or the range's start if later) to the end of the
    range, read up to `last_seq` (its last message when the plan was made)."""

    name: str
    start: datetime
    last_seq: int


@dataclass(frozen=True)
class Plan:
    handler: str
    subjects: tuple[str, ...]
    since: datetime
    until: datetime
    events: int  # in the outbox's part
    kept_from: datetime | None
    asked: dict[str, Any]  # the arguments as given ("now", "all"): what a state file must match to resume
    archive: tuple[ArchivedDay, ...] = ()
    stream: StreamSide | None = None
    stream_note: str = "not read"

    @property
    def outbox_until(self) -> datetime:
        return self.stream.start if self.stream is not None else self.until

    @property
    def archive_until(self) -> datetime:
        return min(self.kept_from or self.until, self.outbox_until)

    def lines(self) -> list[str]:
        def at(t: datetime | None) -> str:
            return "-" if t is None else t.isoformat()

        if self.archive:
            rows = sum(d.row_count for d in self.archive)
            archive = (
                f"  archive  {len(self.archive)} day(s) {self.archive[0].day} .. {self.archive[-1].day} "
                f"({rows} rows audited, all subjects), read back through Spark; each day's checksum "
                "is checked against its audit first"
            )
        else:
            archive = "  archive  not read: the range starts inside what the outbox keeps"
        outbox_range = (
            f"{at(self.since)} .. {at(self.outbox_until)}" if self.since < self.outbox_until else "nothing left to it"
        )
        return [
            f"backfill {self.handler}: {', '.join(self.subjects)}",
            f"  range    {at(self.since)} .. {at(self.until)} (until excluded)",
            archive,
            f"  outbox   {self.events} event(s), in emit order per ordering key ({outbox_range};"
            f" it keeps events since {at(self.kept_from)})",
            f"  stream   {self.stream_note}",
        ]


@dataclass
class Progress:
    done: int = 0  # events handled this run: delivered, skipped or dead-lettered
    delivered: int = 0
    skipped: int = 0  # already PROCESSED or DEAD_LETTER in the inbox
    dead: int = 0
    # Where the run is: the phase (a source), the archived day in progress,
    # the last outbox id done (of that day, or of the outbox), the last
    # stream sequence done.
    phase: str = PHASES[0]
    day: str | None = None
    after_id: int = 0
    stream_seq: int = 0
    refused: list[str] = field(default_factory=list)  # archived days refused this run
    by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))


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


async def archived_days(
    conn: psycopg.AsyncConnection[Any], since: datetime | None, until: datetime
) -> list[ArchivedDay]:
    async with conn.cursor() as cur:
        with wrap_exceptions():
            await cur.execute(_ARCHIVED, (since or EARLIEST, until))
            rows = await cur.fetchall()
    return [ArchivedDay(day, uri, int(n), Decimal(c)) for day, uri, n, c in rows]


async def plan(
    conn: psycopg.AsyncConnection[Any],
    spec: HandlerSpec,
    subjects: tuple[str, ...],
    since: datetime | None,
    until: datetime,
    asked: dict[str, Any],
    stream: StreamSide | None = None,
    stream_note: str = "not read",
) -> Plan:
    """since None: everything kept (archive, outbox, stream). The stream, when
    given, takes the range from its start; the outbox what comes before it;
    the archive the days the outbox no longer keeps."""
    start = since or EARLIEST
    outbox_until = stream.start if stream is not None else until
    async with conn.cursor(row_factory=dict_row) as cur:
        with wrap_exceptions():
            await cur.execute(_SPAN, (list(subjects), start, until))
            row = await cur.fetchone()
    assert row is not None
    kept_from = row["kept_from"]
    events = 0
    if start < outbox_until:
        async with conn.cursor(row_factory=dict_row) as cur:
            with wrap_exceptions():
                await cur.execute(_SPAN, (list(subjects), start, outbox_until))
                part = await cur.fetchone()
        assert part is not None
        events = int(part["events"])
    days: list[ArchivedDay] = []
    older_than_kept = kept_from is None or start < kept_from
    if older_than_kept and start < min(kept_from or until, outbox_until):
        days = await archived_days(conn, since, min(kept_from or until, outbox_until))
    if since is not None and kept_from is not None and since < min(kept_from, outbox_until):
        first = datetime(days[0].day.year, days[0].day.month, days[0].day.day, tzinfo=UTC) if days else None
        if first is None or since < first:
            raise RangeNotKept(
                f"the range starts at {since.isoformat()}, before the oldest event the outbox keeps "
                f"({kept_from.isoformat()}) and before the first day the archive holds "
                f"({'none' if first is None else days[0].day}): start at or after it"
            )
    if since is None:
        oldest = [datetime(d.day.year, d.day.month, d.day.day, tzinfo=UTC) for d in days[:1]]
        since = min([*oldest, *([kept_from] if kept_from else []), *([stream.start] if stream else [])], default=until)
    return Plan(spec.name, subjects, since, until, events, kept_from, asked, tuple(days), stream, stream_note)


async def find_stream(
    js: Any, spec: HandlerSpec, since: datetime | None, until: datetime, start: datetime | None = None
) -> tuple[StreamSide | None, str]:
    """The handler's stream as a source, and the plan's line about it. It
    holds the range from the created_at of its first message on (a message
    is published after its event was written, and the stream drops the
    oldest first). `start`: the boundary of the run being resumed."""
    from nats.js.errors import NotFoundError

    try:
        info = await js.stream_info(spec.stream)
    except NotFoundError:
        return None, f"not read: there is no stream {spec.stream}"
    if not info.state.messages:
        return None, f"not read: {spec.stream} holds no message"
    first = await js.get_msg(spec.stream, seq=info.state.first_seq)
    created = wire.created_epoch(first.headers)
    if created is None:
        return None, f"not read: the first message of {spec.stream} does not say when its event was written"
    held_from = datetime.fromtimestamp(created, UTC)
    if start is not None and held_from > start:
        raise RangeNotKept(
            f"the run being resumed reads {spec.stream} from {start.isoformat()}, but it now holds events from "
            f"{held_from.isoformat()} on: remove the state file and run again with --stream off "
            "(the inbox skips what was delivered)"
        )
    start = start or held_from
    if since is not None and since > start:
        start = since
    if not start < until:
        return None, f"not read: {spec.stream} holds events from {start.isoformat()} on, after the range"
    side = StreamSide(spec.stream, start, int(info.state.last_seq))
    return side, (
        f"{spec.stream} {start.isoformat()} .. {until.isoformat()}: it holds every event from then on "
        f"(sequences up to {side.last_seq}, an ephemeral consumer of this run; no durable touched)"
    )


@dataclass(frozen=True)
class Resume:
    since: datetime
    until: datetime
    progress: Progress
    stream_start: datetime | None


def read_state(path: Path | None, asked: dict[str, Any]) -> Resume | None:
    """Where a run with the same arguments stopped: its range and stream
    boundary as they were resolved then ("now" is the first run's now) and
    its position. None: no state file, or one of other arguments."""
    if path is None or not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
        if state.get("asked") != asked:
            return None
        since, until = datetime.fromisoformat(state["since"]), datetime.fromisoformat(state["until"])
        stream_start = datetime.fromisoformat(state["stream_start"]) if state.get("stream_start") else None
        progress = Progress(
            phase=state.get("phase", PHASES[1]),
            day=state.get("day"),
            after_id=int(state["after_id"]),
            stream_seq=int(state.get("stream_seq", 0)),
        )
        if progress.phase not in PHASES:
            return None
        return Resume(since, until, progress, stream_start)
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
    sourced = Gauge(
        "pgoutbox_backfill_source_events",
        "Events handled by this run, by the source they were read from (archive, outbox, stream)",
        ["handler", "source"],
        registry=registry,
    )
    for source, value in progress.by_source.items():
        sourced.labels(p.handler, source).set(value)
    refused = Gauge(
        "pgoutbox_backfill_refused_days",
        "Archived days refused this run (their checksum is not the audited one)",
        ["handler"],
        registry=registry,
    )
    refused.labels(p.handler).set(len(progress.refused))
    write_to_textfile(str(path), registry)


def write_state(path: Path | None, p: Plan, progress: Progress) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    state = {
        "asked": p.asked,
        "since": p.since.isoformat(),
        "until": p.until.isoformat(),
        "stream_start": p.stream.start.isoformat() if p.stream is not None else None,
        **asdict(progress),
    }
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


Message = tuple[str, bytes, dict[str, str]]  # subject, body, headers: what the relay publishes


@dataclass(frozen=True)
class Item:
    """One event to deliver: its lane (the ordering key; an event without a
    key is a lane of its own) and its message."""

    lane: Any
    message: Message


def outbox_item(row: dict[str, Any], source: str) -> Item:
    """An outbox or archive row as the relay publishes it (wire.to_nats)."""
    key = row["ordering_key"] if row["ordering_key"] is not None else ("no key", row["id"])
    return Item(key, wire.to_nats(row, source))


async def deliver(conn: psycopg.AsyncConnection[Any], client: HandlerClient, d: Delivery, message: Message) -> str:
    """One event through the handler's inbox path: "delivered", "skipped" or "dead"."""
    subject, body, headers = message
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
    items: Sequence[Item],
    throttle: Throttle,
    progress: Progress,
    bar: Bar,
) -> None:
    """One page: a lane per ordering key, the lanes at once on the free
    connections, each lane's events one after the other in the page's order."""
    lanes: dict[Any, list[Item]] = {}
    for item in items:
        lanes.setdefault(item.lane, []).append(item)
    source = progress.phase

    async def lane(events: list[Item]) -> None:
        conn = await conns.get()
        try:
            for item in events:
                await throttle.wait()
                outcome = await deliver(conn, client, d, item.message)
                progress.done += 1
                progress.by_source[source] += 1
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


class ArchiveReader(Protocol):
    """Reads archived days back (pgoutbox_spark.backfill, on the archival job's Spark session)."""

    def figures(self, uri: str, columns: Sequence[tuple[str, str]]) -> tuple[int, Decimal]: ...

    def rows(
        self, uri: str, subjects: Sequence[str], since: datetime, until: datetime, after_id: int
    ) -> list[dict[str, Any]]: ...


@dataclass
class Runner:
    conns: list[psycopg.AsyncConnection[Any]]
    p: Plan
    d: Delivery
    page_size: int
    state_file: Path | None
    metrics_file: Path | None
    progress: Progress
    throttle: Throttle
    bar: Bar
    client: HandlerClient
    free: asyncio.Queue[psycopg.AsyncConnection[Any]]
    out: Any

    async def page(self, items: Sequence[Item]) -> None:
        await _page(self.free, self.client, self.d, items, self.throttle, self.progress, self.bar)

    def saved(self) -> None:
        write_state(self.state_file, self.p, self.progress)
        write_metrics(self.metrics_file, self.p, self.progress)

    def next_phase(self, phase: str) -> None:
        self.progress.phase, self.progress.day, self.progress.after_id = phase, None, 0
        self.saved()

    async def archive(self, reader: ArchiveReader | None) -> None:
        if not self.p.archive:
            return
        assert reader is not None, "a plan with archived days needs a reader"
        async with self.conns[0].cursor() as cur:
            with wrap_exceptions():
                await cur.execute(_COLUMNS)
                columns = [(str(n), str(k)) for n, k in await cur.fetchall()]
        for day in self.p.archive:
            name = day.day.isoformat()
            if self.progress.day is not None and name < self.progress.day:
                continue  # done before the kill
            after = self.progress.after_id if self.progress.day == name else 0
            if not await self.verified(day, reader, columns):
                continue
            if not day.row_count:
                continue  # an empty day, verified empty
            rows = await asyncio.to_thread(
                reader.rows, day.uri, self.p.subjects, self.p.since, self.p.archive_until, after
            )
            self.progress.day, self.progress.after_id = name, after
            for i in range(0, len(rows), self.page_size):
                chunk = rows[i : i + self.page_size]
                await self.page([outbox_item(r, self.d.cloudevents_source) for r in chunk])
                self.progress.after_id = int(chunk[-1]["id"])
                self.saved()

    async def verified(self, day: ArchivedDay, reader: ArchiveReader, columns: Sequence[tuple[str, str]]) -> bool:
        """The day's figures over its files, checked by PostgreSQL against the
        audit. A day that differs is refused whole, and the next ones go on."""
        try:
            row_count, checksum = await asyncio.to_thread(reader.figures, day.uri, columns)
            async with self.conns[0].cursor() as cur:
                with wrap_exceptions():
                    await cur.execute(_VERIFY, (day.day, row_count, checksum))
        except PgOutboxError as exc:
            if exc.code not in REFUSED_DAY:
                raise
            self.progress.refused.append(day.day.isoformat())
            self.out.write(f"backfill: refused archived day {day.day}: [{exc.code}] {exc}\n")
            self.out.flush()
            return False
        return True

    async def outbox(self) -> None:
        if not self.p.since < self.p.outbox_until:
            return
        while True:
            async with self.conns[0].cursor(row_factory=dict_row) as cur:
                with wrap_exceptions():
                    await cur.execute(
                        _PAGE,
                        (
                            list(self.p.subjects),
                            self.p.since,
                            self.p.outbox_until,
                            self.progress.after_id,
                            self.page_size,
                        ),
                    )
                    rows = await cur.fetchall()
            if not rows:
                return
            await self.page([outbox_item(r, self.d.cloudevents_source) for r in rows])
            self.progress.after_id = int(rows[-1]["id"])
            self.saved()

    async def stream(self, js: Any) -> None:
        side = self.p.stream
        if side is None:
            return
        assert js is not None, "a plan with the stream needs a JetStream context"
        async for batch in stream_batches(js, side, self.p.subjects, self.progress.stream_seq, self.page_size):
            items = []
            low, high = side.start.timestamp(), self.p.until.timestamp()
            for seq, message in batch:
                created = wire.created_epoch(message[2])
                if created is not None and not low <= created < high:
                    continue  # before the boundary: the outbox's or the archive's; after the range
                key = message[2].get("Pgoutbox-Ordering-Key") or ("no key", seq)
                items.append(Item(key, message))
            await self.page(items)
            self.progress.stream_seq = batch[-1][0]
            self.saved()


async def stream_batches(
    js: Any, side: StreamSide, subjects: Sequence[str], after_seq: int, size: int
) -> AsyncIterator[list[tuple[int, Message]]]:
    """The stream's messages of these subjects, from the plan's start time
    (or after the sequence a killed run finished) to its last sequence, in
    batches, through an ephemeral pull consumer of this run: no durable is
    created, and the server removes the consumer if this process dies."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    if after_seq:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after_seq + 1)
    else:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=side.start)
    config.filter_subjects = list(subjects)
    config.ack_policy = AckPolicy.NONE
    config.inactive_threshold = 60.0
    config.mem_storage = True
    info = await js.add_consumer(side.name, config)
    sub = await js.pull_subscribe_bind(consumer=info.name, stream=side.name)
    try:
        while True:
            try:
                msgs = await sub.fetch(size, timeout=2.0)
            except NatsTimeout:
                return  # nothing more of these subjects
            batch = [(int(m.metadata.sequence.stream), (m.subject, m.data, dict(m.headers or {}))) for m in msgs]
            batch = [b for b in batch if b[0] <= side.last_seq]
            if batch:
                yield batch
            last = msgs[-1].metadata
            if int(last.sequence.stream) >= side.last_seq or not last.num_pending:
                return
    finally:
        await sub.unsubscribe()
        try:
            await js.delete_consumer(side.name, info.name)
        except Exception:  # already gone (inactive_threshold) or NATS away: the server drops it anyway
            log.debug("backfill: the ephemeral consumer %s was not deleted", info.name)


async def run(
    conns: list[psycopg.AsyncConnection[Any]],
    p: Plan,
    d: Delivery,
    *,
    rate: float,
    page_size: int,
    state_file: Path | None,
    resume: Progress | None = None,
    metrics_file: Path | None = None,
    out: Any = sys.stderr,
    reader: ArchiveReader | None = None,
    js: Any = None,
) -> Progress:
    """Delivers the plan's sources oldest first: the archived days, the
    outbox, the stream. The state file is written when a page is done, so it
    never names a position whose predecessors are not all done."""
    progress = resume or Progress()
    progress.done = progress.delivered = progress.skipped = progress.dead = 0
    if resume is not None:
        where = f"day {progress.day}, " if progress.phase == "archive" and progress.day else ""
        at = f"sequence {progress.stream_seq}" if progress.phase == "stream" else f"event id {progress.after_id}"
        out.write(f"backfill: resuming in the {progress.phase} after {where}{at} (state file {state_file})\n")
    free: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()
    for conn in conns:
        free.put_nowait(conn)
    r = Runner(
        conns,
        p,
        d,
        page_size,
        state_file,
        metrics_file,
        progress,
        Throttle(rate),
        Bar(p.events + sum(day.row_count for day in p.archive), out),
        HandlerClient(per_origin=len(conns)),
        free,
        out,
    )
    try:
        start = PHASES.index(progress.phase)
        if start <= 0:
            await r.archive(reader)
            r.next_phase("outbox")
        if start <= 1:
            await r.outbox()
            r.next_phase("stream")
        await r.stream(js)
    finally:
        await r.client.aclose()
    write_metrics(metrics_file, p, progress)
    r.bar.show(progress, final=True)
    return progress
