"""In-memory fakes for the unit tier, and only for it: every other tier runs on
a real PostgreSQL and nats-server (the house rule). In the spirit of
procrastinate's in-memory connector, each fake implements the public methods
the real object offers to the code under test, keeps its state in plain
Python and records what it was asked, so that a unit test checks the
decisions of the relay loop (pgoutbox.outbox.relay) and of the consumer's
flow (pgoutbox.inbox.flow) in milliseconds, without a server.

They model the contract the code relies on, not the SQL (pgTAP and the server
tiers test that): FakeOutboxStore stands for outbox.calls.OutboxCalls,
FakePublisher for outbox.publisher.Publisher, FakeInbox for inbox.store.Inbox,
FakeHandlerClient for inbox.handler_client.HandlerClient, FakeNats and
FakeJetStream for the nats-py connection and its JetStream context.
Their methods keep the real ones' signatures (tests/unit/test_fakes.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg.errors
from nats.aio.msg import Msg
from nats.js.api import PubAck

from pgoutbox import SCHEMA_VERSION
from pgoutbox.core import wire
from pgoutbox.core.errors import DatabaseUnavailable
from pgoutbox.inbox.handler_client import HandlerAnswer
from pgoutbox.inbox.store import Settler
from pgoutbox.outbox.publisher import Outcome, PublishError

SUBJECT = "sea.event.order_created.v1"


def event_row(**overrides: Any) -> dict[str, Any]:
    """An outbox.events row as the relay claims it (the columns it reads)."""
    row = {
        "event_id": str(uuid.uuid4()),
        "subject": SUBJECT,
        "context": "sea",
        "event_type": "order_created",
        "event_version": 1,
        "aggregate_type": "order",
        "aggregate_id": "1",
        "ordering_key": None,
        "occurred_at": "2025-01-02T03:04:05Z",
        "payload": '{"schema_version": 1}',
        "headers": "{}",
        "attempts": 0,
    }
    return {**row, **overrides}


# -- the relay's side ---------------------------------------------------------


class FakeOutboxStore:
    """outbox.events in a dict, behind OutboxCalls' methods (one object can
    stand for the relay's claims, marks and monitor sessions). Statuses and
    fencing as the SQL has them: a claim hands out due PENDING/FAILED events,
    counts an attempt and sets a claim token; marks move only the events that
    token still holds."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.down = 0  # the next `down` calls raise DatabaseUnavailable
        self.calls: list[str] = []
        self.connected = True

    def add(self, n: int = 1, **overrides: Any) -> list[str]:
        ids = []
        for _ in range(n):
            row = event_row(**overrides)
            self.events[row["event_id"]] = {**row, "status": "PENDING", "claim_token": None, "retry_at": None}
            ids.append(row["event_id"])
        return ids

    def status(self, event_id: str) -> str:
        return self.events[event_id]["status"]

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.down:
            self.down -= 1
            raise DatabaseUnavailable("PostgreSQL unavailable (fake)")

    async def claim(self, worker: str, batch_size: int, lease: float) -> list[dict[str, Any]]:
        self._call("claim")
        now, token, rows = datetime.now(UTC), str(uuid.uuid4()), []
        for e in self.events.values():
            due = e["status"] == "PENDING" or (e["status"] == "FAILED" and e["retry_at"] <= now)
            if due and len(rows) < batch_size:
                e.update(status="PROCESSING", claim_token=token, attempts=e["attempts"] + 1)
                rows.append({k: v for k, v in e.items() if k not in ("status", "retry_at")})
        return rows

    def _held(self, token, event_ids) -> list[dict]:
        return [
            self.events[i]
            for i in event_ids
            if self.events[i]["status"] == "PROCESSING" and self.events[i]["claim_token"] == token
        ]

    async def mark_published(self, claim_token: Any, event_ids: list[Any]) -> int:
        self._call("mark_published")
        held = self._held(claim_token, event_ids)
        for e in held:
            e.update(status="COMPLETED", claim_token=None)
        return len(held)

    async def mark_failed(
        self, claim_token: Any, event_ids: list[Any], errors: list[str], retry_at: list[datetime | None]
    ) -> int:
        self._call("mark_failed")
        held = {e["event_id"]: e for e in self._held(claim_token, event_ids)}
        for event_id, error, at in zip(event_ids, errors, retry_at):
            if event_id in held:
                status = "DEAD_LETTER" if at is None else "FAILED"
                held[event_id].update(status=status, claim_token=None, last_error=error, retry_at=at)
        return len(held)

    async def hand_back(self, claim_token: Any, event_ids: list[Any], reason: str) -> int:
        self._call("hand_back")
        held = self._held(claim_token, event_ids)
        for e in held:
            e.update(status="PENDING", attempts=e["attempts"] - 1, last_error=reason)
        return len(held)

    async def backlog(self) -> list[dict[str, Any]]:
        self._call("backlog")
        return []

    async def oldest_snapshot(self) -> tuple[float, int]:
        """(seconds, xids) of the oldest snapshot holding back vacuum: none here."""
        self._call("oldest_snapshot")
        return 0.0, 0

    async def notify_throttle(self) -> float:
        return 0.0

    async def next_scheduled(self) -> float | None:
        return None  # the fake schedules nothing

    async def create_partitions(self, days_ahead: int) -> list[str]:
        self._call("create_partitions")
        return []

    async def schema_version(self) -> int:
        return SCHEMA_VERSION

    async def close(self) -> None:
        pass


class FakePublisher:
    """Publisher's methods: outcomes per row, publishes recorded in order.
    `failing` maps an event id to the code its publish fails with (a
    refusal); `broken` makes the next publish_batch raise; `connected` False
    is NATS away. `away` (a reason) makes every publish go unanswered
    (PUBLISH_TIMEOUT, away) and the $JS.API.INFO probe fail, unless
    `info_answers` (a JetStream whose stream has no leader)."""

    def __init__(self) -> None:
        self.published: list[str] = []
        self.failing: dict[str, PublishError] = {}
        self.broken: Exception | None = None
        self.connected = True
        self.batches = 0
        self.batch_sizes: list[int] = []
        self.js = None
        self.away: str | None = None
        self.info_answers = False
        self.probes = 0

    async def jetstream_answers(self) -> str | None:
        self.probes += 1
        return None if self.away is None or self.info_answers else f"NATS_UNAVAILABLE: {self.away}"

    async def connect(self) -> None:
        pass

    async def wait_connected(self, timeout: float | None = None) -> bool:
        return self.connected

    async def publish_batch(self, rows: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        self.batches += 1
        if self.broken is not None:
            exc, self.broken = self.broken, None
            raise exc
        self.batch_sizes.append(len(rows))
        if self.away is not None:
            return [
                Outcome(r["event_id"], code=PublishError.PUBLISH_TIMEOUT, detail=self.away, away=True) for r in rows
            ]
        outcomes = []
        for row in rows:
            code = self.failing.get(row["event_id"])
            if code is None:
                self.published.append(row["event_id"])
                outcomes.append(Outcome(row["event_id"]))
            else:
                outcomes.append(Outcome(row["event_id"], code=code, detail="refused (fake)"))
        return outcomes

    async def close(self) -> None:
        pass


# -- the consumer's side ------------------------------------------------------


class FakeNats:
    """The nats-py client as a delivered Msg and the flow use it: acks, naks
    and in-progress acks are publishes to the message's reply subject,
    recorded here per reply subject."""

    def __init__(self, max_payload: int = 1024 * 1024) -> None:
        self.max_payload = max_payload
        self.replies: dict[str, list[bytes]] = {}

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        self.replies.setdefault(subject, []).append(payload)


class FakeJetStream:
    """js.publish as dlq.publish calls it: the DLQ notices, recorded."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, dict[str, str]]] = []

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> PubAck:
        self.published.append((subject, payload, dict(headers or {})))
        return PubAck(stream="SEA_DLQ", seq=len(self.published))


def delivery(nc: FakeNats, *, delivered: int = 1, seq: int = 1, **overrides: Any) -> Msg:
    """A real nats-py Msg, as JetStream delivers an event the relay published,
    whose acks go to `nc`."""
    subject, body, headers = wire.to_nats(event_row(**overrides))
    reply = f"$JS.ACK.SEA_EVENTS.billing.{delivered}.{seq}.{seq}.{time.time_ns()}.0"
    return Msg(_client=nc, subject=subject, reply=reply, data=body, headers=headers)  # type: ignore[arg-type]


def answers(nc: FakeNats, msg: Msg) -> list[bytes]:
    """What the consumer answered JetStream for msg: b"" is an ack, b"-NAK..." a nak."""
    return nc.replies.get(msg.reply, [])


@dataclass
class FakeInboxRow:
    status: str = "RECEIVED"
    attempts: int = 1
    failures: int = 0
    last_error: str | None = None
    replay_after: float | None = None
    # (stream, sequence) of the DLQ notice, as inbox.record_dlq_notice records it
    notice: tuple[str, int] | None = None

    def as_row(self, ordinal: int | None = None) -> dict[str, Any]:
        row = {"status": self.status, "attempts": self.attempts, "dlq_metadata": {"failures": self.failures}}
        return row if ordinal is None else {**row, "ordinal": ordinal}


@dataclass
class FakeInbox:
    """inbox.messages in a dict keyed (message_id, handler), behind Inbox's
    methods (the batched ones of the current schema). `down` makes the next
    calls raise DatabaseUnavailable: PostgreSQL away."""

    rows: dict[tuple[str, str], FakeInboxRow] = field(default_factory=dict)
    down: int = 0
    # the next calls roll back for a clash with a concurrent transaction (40P01)
    clashes: int = 0
    calls: list[str] = field(default_factory=list)
    counts_failures: bool = True
    settlers: dict[str, Settler] = field(default_factory=dict)
    # message_id -> the payload text the upcasters give a handler declaring a version
    upcasts: dict[str, str] = field(default_factory=dict)
    # message_id -> the error its upcast raises out of the call (a schema before 18,
    # or a statement_timeout): the call records nothing
    upcast_raises: dict[str, Exception] = field(default_factory=dict)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.down:
            self.down -= 1
            raise DatabaseUnavailable("PostgreSQL unavailable (fake)")
        if self.clashes:
            self.clashes -= 1
            raise psycopg.errors.DeadlockDetected("deadlock detected (fake)")

    def failures(self, row: dict[str, Any]) -> int:
        return int(row["dlq_metadata"]["failures"])

    def row(self, message_id: str, handler: str) -> FakeInboxRow:
        return self.rows[(message_id, handler)]

    async def receive_batch(
        self, handler: str, ids: list[str], subjects: list[str], envelopes: list[str], version: int | None = None
    ) -> list[dict[str, Any]] | None:
        """Payloads as they came, or as `upcasts` gives them to a handler declaring a version."""
        self._call("receive_batch")
        raised = [self.upcast_raises[i] for i in ids if i in self.upcast_raises] if version is not None else []
        if raised:
            raise raised[0]
        out = []
        for ordinal, message_id in enumerate(ids, 1):
            row = self.rows.get((message_id, handler))
            if row is None:
                row = self.rows[(message_id, handler)] = FakeInboxRow()
            elif row.status in ("RECEIVED", "FAILED"):
                row.attempts += 1
            got = row.as_row(ordinal)
            if version is not None and message_id in self.upcasts:
                got["upcast_payload"] = self.upcasts[message_id]
            out.append(got)
        return out

    async def settle(self, handler: str, processed: list[str], failed: list[str], errors: list[str]) -> set[str]:
        self._call("settle")
        moved = set()
        for message_id, error in [(m, None) for m in processed] + list(zip(failed, errors)):
            row = self.rows[(message_id, handler)]
            if row.status in ("RECEIVED", "FAILED"):
                row.status, row.last_error = ("PROCESSED", None) if error is None else ("FAILED", error)
                row.failures += error is not None
                moved.add(message_id)
        return moved

    async def settle_one(self, handler: str, message_id: str, error: str | None = None) -> bool:
        """The real Settler's batching, over settle() below."""
        settler = self.settlers.get(handler)
        if settler is None:
            settler = self.settlers[handler] = Settler(self, handler)  # type: ignore[arg-type]
        return await settler.settle(message_id, error)

    async def record_error(
        self, message_id: str, handler: str, error: str, *, dead: bool = False, replay_after: float | None = None
    ) -> dict[str, Any]:
        self._call("record_error")
        row = self.rows[(message_id, handler)]
        row.status, row.last_error, row.replay_after = ("DEAD_LETTER" if dead else "FAILED"), error, replay_after
        row.failures += 1
        if dead:
            row.notice = None
        return row.as_row()

    async def record_dlq_notice(self, message_id: str, handler: str, stream: str, sequence: int) -> bool:
        self._call("record_dlq_notice")
        row = self.rows[(message_id, handler)]
        if row.status != "DEAD_LETTER":
            return False
        row.notice = (stream, sequence)
        return True

    async def schema_version(self) -> int:
        self._call("schema_version")
        return SCHEMA_VERSION


class FakeHandlerClient:
    """HandlerClient.call: answers given by status, in order (the last one
    repeats); every call recorded as (message_id, delivery)."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses) or [200]
        self.calls: list[tuple[str, int]] = []
        self.traces: list[dict | None] = []  # the trace context given for each call (None: the envelope's)
        self.bodies: list[bytes] = []
        self.cloudevents: list[dict | None] = []  # the attributes given to a handler of format "cloudevents"

    async def call(
        self,
        url: str,
        body: bytes,
        envelope: dict[str, Any],
        *,
        handler: str,
        delivery: int,
        timeout: float,
        received: int | None = None,
        trace: Mapping[str, str] | None = None,
        cloudevent: dict[str, str] | None = None,
    ) -> HandlerAnswer:
        self.calls.append((envelope["message_id"], delivery))
        self.traces.append(trace)
        self.bodies.append(body)
        self.cloudevents.append(cloudevent)
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return HandlerAnswer(status=status, error=None, retry_after=None, elapsed=0.001, text="fake")
