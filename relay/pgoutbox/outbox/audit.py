"""Broker-loss audit: which COMPLETED events does a stream lack?

A JetStream ack means "received", not "on disk", and an operator can delete
messages: an event can be COMPLETED in the outbox and absent from its stream.
The audit compares the two sides by Nats-Msg-Id (the event id) and reports
what the stream lacks; repair() requeues those events (COMPLETED -> PENDING,
outbox.requeue_completed) so that a relay publishes them again.

Bounded memory over any number of events: neither side is held whole. Both
are streamed once and spilled to temporary files, split into buckets by the
first bytes of the event id (random in a UUIDv4); then each bucket's stream
ids are loaded as a set (at most about `bucket` of them) and its outbox events
are checked against it.

    1. outbox pass   COMPLETED events of the stream's subjects published at or
                     after the horizon, read by ranges of outbox.events.id (one
                     short read-only statement each: no snapshot held, no lock
                     a relay waits for)
    2. stream pass   the stream's messages from the horizon on, headers only,
                     through an ephemeral pull consumer without acks
    3. compare       bucket by bucket

The outbox is read before the stream: an event seen COMPLETED in pass 1 was
acked before pass 2 starts, so its message is in what pass 2 reads. Events
that relays complete meanwhile are simply not audited this time.

The horizon: only events whose messages must still be inside the stream's
retention are audited. A message is stored before its event is marked
published (by up to the duplicate window when the ack answered a re-publish,
plus `slack` for clock skew and the ack-to-mark delay), so with max_age the
horizon is now - max_age + duplicate_window + slack; with max_msgs or
max_bytes the oldest message still present bounds it the same way (a message
lost at the head of such a stream cannot be told from one the limits
discarded). The horizon is taken again after the stream pass: events whose
message has left the retention during the audit are counted, not judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import resource
import struct
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import nats.errors
import psycopg
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pgoutbox.core import db, jetstream
from pgoutbox.core.errors import ConfigError, SchemaMismatch, wrap_exceptions
from pgoutbox.core.stopping import wait_set
from pgoutbox.core.wire import JS_STREAM_NOT_FOUND, MSG_ID

# An outbox event in the spill files: event id, outbox.events.id, published_at
# (microseconds since the epoch), index of its subject.
_EVENT = struct.Struct("<16sqqI")
_ID = 16
# Events requeued per call of outbox.requeue_completed (one transaction each).
REPAIR_CHUNK = 1000

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Options:
    page: int = 10_000  # outbox ids per query
    fetch: int = 2_000  # stream messages per fetch
    bucket: int = 250_000  # events compared in memory at once
    slack: float = 60.0  # seconds: clock skew plus the longest ack-to-mark delay
    since: float | None = None  # audit only events published in the last `since` seconds
    sample: int = 10  # missing event ids shown
    progress_every: float = 5.0  # seconds between progress lines
    spill_dir: str | None = None  # where the temporary files go (default: the system's)


@dataclass(frozen=True)
class StreamView:
    """What the audit needs of a stream's configuration and state."""

    name: str
    subjects: tuple[str, ...]
    duplicate_window: float  # seconds
    max_age: float  # seconds, 0 = none
    size_limited: bool  # max_msgs or max_bytes set: the limits may discard at the head
    first_ts: datetime | None
    last_seq: int
    messages: int

    def horizon(self, now: datetime, since: float | None, slack: float) -> datetime | None:
        """Events published at or after this time must still have their message in the stream."""
        margin = timedelta(seconds=self.duplicate_window + slack)
        bounds = []
        if since is not None:
            bounds.append(now - timedelta(seconds=since))
        if self.max_age:
            bounds.append(now - timedelta(seconds=self.max_age) + margin)
        if self.size_limited:
            bounds.append(self.first_ts + margin if self.first_ts else now)
        return max(bounds) if bounds else None


@dataclass
class Missing:
    count: int = 0
    first: int = 0  # published_at, microseconds
    last: int = 0

    def add(self, micros: int) -> None:
        self.first = micros if not self.count else min(self.first, micros)
        self.last = max(self.last, micros)
        self.count += 1


@dataclass
class Report:
    stream: str
    horizon: datetime | None
    duplicate_window: float
    slack: float
    checked: int = 0  # outbox events compared with the stream
    read: int = 0  # stream messages read
    foreign: int = 0  # stream messages whose Nats-Msg-Id is not an event id
    left_retention: int = 0  # events whose message left the retention during the audit
    missing: Missing = field(default_factory=Missing)
    by_subject: dict[str, Missing] = field(default_factory=dict)
    sample: list[str] = field(default_factory=list)
    repairable: int = 0  # missing and published before repair_before
    repair_before: datetime | None = None
    requeued: int = 0
    seconds: float = 0.0
    repair_file: Path | None = None  # the repairable events (_EVENT records), while the audit's files live

    @property
    def too_recent(self) -> int:
        return self.missing.count - self.repairable

    @property
    def retry_after(self) -> datetime | None:
        """When the youngest missing event leaves the duplicate window."""
        if not self.too_recent:
            return None
        return _time(self.missing.last) + timedelta(seconds=self.duplicate_window + self.slack)

    def lines(self) -> list[str]:
        rate = self.checked / self.seconds if self.seconds else 0.0
        since = f"published since {_show(self.horizon)}" if self.horizon else "published at any time"
        out = [
            f"{self.stream}: {self.checked:,} COMPLETED events {since} checked against "
            f"{self.read:,} stream messages in {self.seconds:.1f}s ({rate:,.0f} events/s)"
        ]
        if self.left_retention:
            out.append(
                f"{self.stream}: {self.left_retention:,} events left the retention during the audit (not judged)"
            )
        if self.foreign:
            out.append(f"{self.stream}: {self.foreign:,} messages without an event id as Nats-Msg-Id (ignored)")
        if not self.missing.count:
            out.append(f"{self.stream}: ok, the stream lacks no event")
            return out
        out.append(
            f"{self.stream}: MISSING {self.missing.count:,} events, published from "
            f"{_show(_time(self.missing.first))} to {_show(_time(self.missing.last))}"
        )
        for subject, m in sorted(self.by_subject.items()):
            out.append(f"  {subject}: {m.count:,} (published {_show(_time(m.first))} to {_show(_time(m.last))})")
        out.append(f"  sample: {', '.join(self.sample)}")
        if self.requeued:
            out.append(f"{self.stream}: requeued {self.requeued:,} events for republishing")
        elif self.repairable:
            out.append(
                f"{self.stream}: {self.repairable:,} of them can be requeued for republishing now: "
                '`pgoutbox audit --repair --reason "..."`'
            )
        if self.too_recent:
            out.append(
                f"{self.stream}: {self.too_recent:,} missing events were published less than the duplicate window "
                f"({self.duplicate_window:g}s) + slack ({self.slack:g}s) ago; JetStream would drop their "
                f"re-publish as a duplicate: run `pgoutbox audit --repair` again after {_show(self.retry_after)}"
            )
        return out


def _time(micros: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)


def _micros(t: datetime) -> int:
    return (t - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def _show(t: datetime | None) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ") if t else "-"


def _parse_ts(text: str | None) -> datetime | None:
    """A JetStream time (RFC 3339 with nanoseconds); None for the zero time of an empty stream."""
    if not text or text.startswith("0001-"):
        return None
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + (f".{frac[:6]}" if frac else "")).replace(tzinfo=UTC)


def subject_pattern(subject: str) -> str:
    """A NATS subject filter as a regular expression (PostgreSQL and Python read it alike)."""
    parts = []
    for token in subject.split("."):
        parts.append("[^.]+" if token == "*" else ".+" if token == ">" else re.escape(token))
    return "^" + r"\.".join(parts) + "$"


async def stream_view(nc: nats.NATS, name: str) -> StreamView:
    """The stream's configuration and state (raw API: nats-py drops first_ts)."""
    reply = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{name}", b"", timeout=5)).data)
    error = reply.get("error")
    if error:
        if error.get("err_code") == JS_STREAM_NOT_FOUND:
            raise ConfigError(f"stream {name} not found (`pgoutbox streams` creates the streams of the streams file)")
        raise ConfigError(f"stream {name}: JetStream answered [{error.get('err_code')}] {error.get('description')}")
    config, state = reply["config"], reply["state"]
    if config.get("retention", "limits") != "limits":
        raise ConfigError(
            f"stream {name} has retention={config['retention']}: it drops messages once consumed, "
            "so an audit cannot tell a lost message from a consumed one"
        )
    if (config.get("max_msgs_per_subject") or -1) > 0:
        raise ConfigError(
            f"stream {name} has max_msgs_per_subject: an audit cannot tell a lost message from one the limit discarded"
        )
    return StreamView(
        name=name,
        subjects=tuple(config.get("subjects") or ()),
        duplicate_window=(config.get("duplicate_window") or 0) / 1e9,
        max_age=(config.get("max_age") or 0) / 1e9,
        size_limited=(config.get("max_msgs") or -1) > 0 or (config.get("max_bytes") or -1) > 0,
        first_ts=_parse_ts(state.get("first_ts")) if state.get("messages") else None,
        last_seq=int(state.get("last_seq") or 0),
        messages=int(state.get("messages") or 0),
    )


class _Spill:
    """Append-only bucket files under one temporary directory."""

    def __init__(self, root: Path, kind: str, buckets: int):
        self.paths = [root / f"{kind}.{i}" for i in range(buckets)]
        _allow_open_files(buckets + 64)
        # 64 KiB of buffer per file, 16 MiB at most in all (many buckets: smaller buffers)
        buffer = max(4096, min(1 << 16, (16 << 20) // buckets))
        self._files: list[BinaryIO] = [p.open("ab", buffering=buffer) for p in self.paths]

    def bucket(self, event_id: bytes) -> BinaryIO:
        return self._files[(event_id[0] << 8 | event_id[1]) % len(self._files)]

    def close(self) -> None:
        for f in self._files:
            f.close()


def _allow_open_files(n: int) -> None:
    """One spill's files are open at once (one per bucket): raise the soft limit if it is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            raise ConfigError(f"the audit needs {n} open files, more than the limit {hard}: raise OUTBOX_AUDIT_BUCKET")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def _records(path: Path, size: int, chunk: int = 10_000) -> Iterator[bytes]:
    with path.open("rb") as f:
        while block := f.read(size * chunk):
            for i in range(0, len(block), size):
                yield block[i : i + size]


class _Ticker:
    def __init__(self, progress: Progress, every: float):
        self.progress = progress
        self.every = every
        self.start = self.last = time.monotonic()

    def due(self) -> float | None:
        """Seconds since the start when a progress line is due, else None."""
        now = time.monotonic()
        if now - self.last < self.every:
            return None
        self.last = now
        return now - self.start

    def say(self, line: str) -> None:
        self.progress(line)


_OUTBOX_PAGE = """
SELECT e.event_id, e.id, (extract(EPOCH FROM e.published_at) * 1000000)::bigint, e.subject
FROM outbox.events AS e
WHERE e.id > %(lo)s AND e.id <= %(hi)s AND e.status = 'COMPLETED'
    AND e.published_at >= %(since)s AND e.subject ~ ANY(%(patterns)s)
"""


def read_only(database_url: str | None) -> psycopg.Connection:
    """The audit's connection: every statement read-only, short, and never queued long behind a lock."""
    return db.connect(
        database_url,
        check_schema=True,
        options="-c default_transaction_read_only=on -c statement_timeout=60s -c lock_timeout=5s",
        application_name="pgoutbox-audit",
    )


def _outbox_pass(
    database_url: str | None, view: StreamView, opts: Options, root: Path, tick: _Ticker
) -> tuple[_Spill, list[str], datetime, datetime | None, int]:
    with read_only(database_url) as conn, wrap_exceptions():
        now, lo, hi = conn.execute("SELECT now(), min(id), max(id) FROM outbox.events").fetchone()  # type: ignore[misc]
        horizon = view.horizon(now, opts.since, opts.slack)
        span = (hi - lo + 1) if lo is not None else 0
        buckets = max(1, math.ceil(max(span, view.messages) / opts.bucket))
        spill = _Spill(root, "outbox", buckets)
        subjects: dict[str, int] = {}
        params: dict[str, Any] = {
            "since": horizon or datetime(1, 1, 1, tzinfo=UTC),
            "patterns": [subject_pattern(s) for s in view.subjects],
        }
        found = 0
        pack = _EVENT.pack
        cur = conn.cursor(binary=True)
        for start in range((lo or 1) - 1, (hi or 0), opts.page):
            params.update(lo=start, hi=start + opts.page)
            for event_id, row_id, micros, subject in cur.execute(_OUTBOX_PAGE, params):
                raw = event_id.bytes
                index = subjects.setdefault(subject, len(subjects))
                spill.bucket(raw).write(pack(raw, row_id, micros, index))
                found += 1
            if (s := tick.due()) is not None:
                tick.say(
                    f"{view.name}: outbox pass: ids up to {min(start + opts.page, hi):,} "
                    f"of {hi:,}, {found:,} events in scope ({found / max(s, 1e-9):,.0f}/s)"
                )
        spill.close()
        return spill, list(subjects), now, horizon, found


async def _stream_pass(
    nc: nats.NATS, view: StreamView, start: datetime | None, spill: _Spill, opts: Options, tick: _Ticker
) -> tuple[int, int]:
    """Every message of the stream from `start` on (headers only), into the
    spill, through an ephemeral consumer deleted afterwards; returns (read, foreign)."""
    if not view.messages:
        spill.close()
        return 0, 0
    js = nc.jetstream(timeout=10)
    consumer = (await js.add_consumer(view.name, _pass_consumer(start))).name
    assert consumer
    reader = _StreamReader(nc, js, view, consumer, spill, opts.fetch)
    try:
        await reader.run(tick)
    finally:
        with contextlib.suppress(Exception):
            await js.delete_consumer(view.name, consumer)
        spill.close()
    return reader.read, reader.foreign


def _pass_consumer(start: datetime | None) -> ConsumerConfig:
    """The stream pass's consumer: no acks, headers only, gone a minute after
    the audit (even a killed one)."""
    return ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        headers_only=True,
        inactive_threshold=60.0,
        mem_storage=True,
        num_replicas=1,
        deliver_policy=DeliverPolicy.BY_START_TIME if start else DeliverPolicy.ALL,
        opt_start_time=start,
    )


class _StreamReader:
    """Reads a stream through its consumer into the spill, up to the
    sequence the view names. Pull requests (core/jetstream.py) are sent by
    hand to a subscription with a callback: nats-py's fetch() costs a task
    per message, which made it five times slower. The next request goes
    once a batch is in, or when a status ends the request while messages
    are still pending."""

    # A request (or its expiry status) silent this long is taken as lost: asked again.
    LOST = 10.0

    def __init__(self, nc: nats.NATS, js: JetStreamContext, view: StreamView, consumer: str, spill: _Spill, fetch: int):
        self.nc, self.js = nc, js
        self.view, self.consumer = view, consumer
        self.spill, self.fetch = spill, fetch
        self.next = jetstream.next_subject(view.name, consumer)
        self.request = jetstream.pull_request(fetch, expires=2.0)
        self.inbox = nc.new_inbox()
        self.done = asyncio.Event()
        self.failure: BaseException | None = None
        self.read = self.foreign = self.batch = self.seq = 0
        self.activity = time.monotonic()  # of the last message or status received

    async def run(self, tick: _Ticker) -> None:
        sub = await self.nc.subscribe(self.inbox, cb=self._on_message, pending_msgs_limit=4 * self.fetch)
        try:
            await self._pull()
            while not self.done.is_set():
                await wait_set(self.done, 1.0)
                if self.nc.is_closed:
                    raise nats.errors.ConnectionClosedError
                if time.monotonic() - self.activity > self.LOST:
                    self.activity = time.monotonic()
                    await self._pull()
                if (s := tick.due()) is not None:
                    tick.say(
                        f"{self.view.name}: stream pass: {self.read:,} messages read, at sequence "
                        f"{self.seq:,} of {self.view.last_seq:,} ({self.read / max(s, 1e-9):,.0f}/s)"
                    )
            if self.failure is not None:
                raise self.failure
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _pull(self) -> None:
        self.batch = 0
        await self.nc.publish(self.next, self.request, reply=self.inbox)

    async def _on_message(self, msg: Msg) -> None:
        if self.done.is_set():
            return
        self.activity = time.monotonic()
        try:
            code = jetstream.status(msg)
            if code is None:
                await self._take(msg)
            elif jetstream.ends_request(code):  # expired (408), or found nothing (404)
                await self._request_ended()
        except BaseException as exc:
            self.failure = self.failure or exc
            self.done.set()

    async def _request_ended(self) -> None:
        """Done when the consumer has nothing pending, else the next request."""
        if (await self.js.consumer_info(self.view.name, self.consumer)).num_pending == 0:
            self.done.set()
        else:
            await self._pull()

    async def _take(self, msg: Msg) -> None:
        """A stream message's event id into the spill (foreign: not a UUID);
        done at the view's last sequence, the next request once a batch is in."""
        try:
            raw = uuid.UUID((msg.headers or {}).get(MSG_ID)).bytes
            self.spill.bucket(raw).write(raw)
        except (TypeError, ValueError):
            self.foreign += 1
        self.read += 1
        self.batch += 1
        self.seq, pending = jetstream.position(msg)
        if self.seq >= self.view.last_seq or pending == 0:
            self.done.set()
        elif self.batch >= self.fetch:
            await self._pull()


def _compare(
    outbox: _Spill,
    stream: _Spill,
    subjects: list[str],
    report: Report,
    horizon: datetime | None,
    repair_before: datetime,
    root: Path,
    opts: Options,
    tick: _Ticker,
) -> None:
    floor = _micros(horizon) if horizon else None
    cut = _micros(repair_before)
    report.repair_file = root / "repairable"
    unpack = _EVENT.unpack
    with report.repair_file.open("wb", buffering=1 << 16) as repair:
        for i, (ours, theirs) in enumerate(zip(outbox.paths, stream.paths, strict=True)):
            present = set(_records(theirs, _ID))
            for record in _records(ours, _EVENT.size):
                raw, _, micros, index = unpack(record)
                if floor is not None and micros < floor:
                    report.left_retention += 1
                    continue
                report.checked += 1
                if raw in present:
                    continue
                report.missing.add(micros)
                report.by_subject.setdefault(subjects[index], Missing()).add(micros)
                if len(report.sample) < opts.sample:
                    report.sample.append(str(uuid.UUID(bytes=raw)))
                if micros < cut:
                    report.repairable += 1
                    repair.write(record)
            del present
            if tick.due() is not None:
                tick.say(f"{report.stream}: compare: bucket {i + 1} of {len(outbox.paths)}")


@contextlib.asynccontextmanager
async def workspace(opts: Options) -> AsyncIterator[Path]:
    """The temporary directory of the spill files, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="pgoutbox-audit-", dir=opts.spill_dir) as root:
        yield Path(root)


async def audit_stream(
    database_url: str | None, nc: nats.NATS, name: str, opts: Options, root: Path, progress: Progress = print
) -> Report:
    """Audits one stream; the report's repair_file lives as long as `root`."""
    started = time.monotonic()
    tick = _Ticker(progress, opts.progress_every)
    before = await stream_view(nc, name)
    outbox, subjects, _, horizon, found = await asyncio.to_thread(_outbox_pass, database_url, before, opts, root, tick)
    tick.say(f"{name}: outbox pass done: {found:,} events in scope at {time.monotonic() - started:.1f}s")
    start = horizon - timedelta(seconds=before.duplicate_window + 2 * opts.slack) if horizon else None
    buckets = len(outbox.paths)
    stream = _Spill(root, "stream", buckets)
    view = await stream_view(nc, name)  # the newest last_seq: everything acked before pass 1 ended
    read, foreign = await _stream_pass(nc, view, start, stream, opts, tick)
    tick.say(f"{name}: stream pass done: {read:,} messages at {time.monotonic() - started:.1f}s")
    after = await stream_view(nc, name)
    with read_only(database_url) as conn:
        [(now,)] = conn.execute("SELECT now()").fetchall()
    horizon_end = after.horizon(now, opts.since, opts.slack)
    if horizon is not None and (horizon_end is None or horizon_end < horizon):
        horizon_end = horizon
    report = Report(name, horizon_end, before.duplicate_window, opts.slack, read=read, foreign=foreign)
    report.repair_before = now - timedelta(seconds=before.duplicate_window + opts.slack)
    await asyncio.to_thread(
        _compare, outbox, stream, subjects, report, horizon_end, report.repair_before, root, opts, tick
    )
    report.seconds = time.monotonic() - started
    tick.say(f"{name}: compare done at {report.seconds:.1f}s")
    return report


REQUEUE_COMPLETED = "outbox.requeue_completed(uuid[],text,timestamptz,bigint[])"


def check_repairable(database_url: str | None) -> None:
    """Refuses a schema without outbox.requeue_completed()."""
    with db.connect(database_url, check_schema=True) as conn:
        [(exists,)] = conn.execute("SELECT to_regprocedure(%s) IS NOT NULL", (REQUEUE_COMPLETED,)).fetchall()
    if not exists:
        raise SchemaMismatch(
            "this database has no outbox.requeue_completed(), which --repair needs: run `pgoutbox migrate`"
        )


def repair(database_url: str | None, report: Report, reason: str, progress: Progress = print) -> int:
    """Requeues the report's repairable events (COMPLETED -> PENDING), REPAIR_CHUNK per transaction.
    The database re-checks each against the duplicate window at its own clock."""
    if not report.repairable or report.repair_file is None:
        return 0
    window = timedelta(seconds=report.duplicate_window + report.slack)
    moved = 0
    with db.connect(database_url, application_name="pgoutbox-audit") as conn, wrap_exceptions():
        ids: list[uuid.UUID] = []
        rows: list[int] = []

        def flush() -> None:
            nonlocal moved
            if ids:
                [(n,)] = conn.execute(
                    "SELECT outbox.requeue_completed(%s, %s, now() - %s, %s)", (ids, reason, window, rows)
                ).fetchall()
                moved += n
                ids.clear()
                rows.clear()
                progress(f"{report.stream}: repair: {moved:,} of {report.repairable:,} events requeued")

        for record in _records(report.repair_file, _EVENT.size):
            raw, row_id, _, _ = _EVENT.unpack(record)
            ids.append(uuid.UUID(bytes=raw))
            rows.append(row_id)
            if len(ids) >= REPAIR_CHUNK:
                flush()
        flush()
    report.requeued = moved
    return moved
